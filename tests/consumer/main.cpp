// Builds against the installed package and checks the one thing users buy it
// for: K accumulated micro-batches give the K-times batch's parameters.
#include <gradaccum/gradaccum.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  const int64_t K = 4;
  torch::manual_seed(0);
  auto x = torch::randn({32, 5}, torch::kFloat64), y = torch::randn({32, 1}, torch::kFloat64);
  auto make = [] {
    torch::manual_seed(1);
    torch::nn::Sequential m(torch::nn::Linear(5, 8), torch::nn::ReLU(), torch::nn::Linear(8, 1));
    m->to(torch::kFloat64);
    return m;
  };
  auto ref = make();
  torch::optim::Adam ref_opt(ref->parameters(), 1e-2);
  ref_opt.zero_grad();
  torch::mse_loss(ref->forward(x), y).backward();
  ref_opt.step();

  auto model = make();
  torch::optim::Adam opt(model->parameters(), 1e-2);
  gradaccum::Accumulator acc(model.ptr(), opt, gradaccum::AccumulatorOptions(K));
  bool stepped = false;
  for (auto& mb : gradaccum::split(std::vector<at::Tensor>{x, y}, K)) {
    acc.backward(torch::mse_loss(model->forward(mb[0]), mb[1]));
    stepped = acc.step();
  }
  double diff = 0;
  for (size_t i = 0; i < ref->parameters().size(); ++i) {
    diff = std::max(diff, (ref->parameters()[i] - model->parameters()[i]).abs().max().item<double>());
  }
  std::cout << "consumer: gradaccum " << GRADACCUM_VERSION << ", stepped=" << stepped
            << ", max |diff| = " << diff << std::endl;
  return stepped && diff < 1e-12 ? 0 : 1;
}
