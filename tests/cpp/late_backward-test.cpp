// A backward that reaches the parameters after the window closed and before
// step() (Note [A backward after the window closed]): refused by step(),
// changing nothing, in one process and on real Gloo ranks, where it begins
// no collective.
#include "test_util.h"

#include "catch_torch.h"

#include <functional>
#include <string>
#include <vector>

using namespace gradaccum;
using gradaccum::test::CountingGroup;
using gradaccum::test::run_ranks;

namespace {

const std::string kHead = "gradaccum: acc.step(): a backward reached 2.bias after the acc.backward() that closed the "
                          "window and before acc.step() (another loss's backward through these parameters, e.g. a "
                          "GAN's generator loss through a discriminator that is not frozen?): it sums into the "
                          "window's gradients a gradient no micro-step counted";
const std::string kTail = ". Call acc.step() right after the micro-step that closes the window, or freeze the other "
                          "network for that backward (requires_grad_(False)). Nothing was stepped: acc.zero_grad() "
                          "drops this window";

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

std::vector<at::Tensor> grads(torch::nn::Sequential& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.grad().clone());
  return out;
}

// The error's text without the backtrace c10 adds to what().
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

bool all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return a.size() == b.size();
}

} // namespace

TEST_CASE("one process: a backward after the window closed is refused by step()", "[accumulator][misuse]") {
  auto net = gradaccum::test::mlp();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Accumulator acc(net, opt, AccumulatorOptions(2));
  const auto loss = [&](double s) { return net->forward(torch::ones({2, 6}, torch::kDouble) * s).pow(2).sum(); };
  acc.backward(loss(1));
  acc.backward(loss(2));
  REQUIRE(acc.window_ready());
  for (auto& p : net->parameters()) p.grad().mul_(0.5); // clipping in place: no backward
  const auto window = grads(net);
  loss(3).backward(); // another loss's backward, the network not frozen
  const auto weights = copies(net->parameters());
  const auto summed = grads(net);
  CHECK_FALSE(all_equal(summed, window));
  CHECK(error_of([&] { acc.step(); }) == kHead + kTail);
  CHECK(acc.window_ready());
  CHECK(all_equal(copies(net->parameters()), weights));
  CHECK(all_equal(grads(net), summed));
  acc.zero_grad();
  acc.backward(loss(1));
  acc.backward(loss(2));
  CHECK(all_equal(grads(net), [&] {
    std::vector<at::Tensor> halves;
    for (const auto& g : window) halves.push_back(g * 2);
    return halves;
  }()));
  CHECK(acc.step());
}

TEST_CASE("data parallel: a backward after the window closed begins no collective and is refused alike",
          "[accumulator][misuse][distributed]") {
  std::vector<int> before(2), after(2);
  std::vector<std::string> refused(2);
  std::vector<std::vector<at::Tensor>> results(2);
  std::vector<bool> stepped(2);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    auto net = gradaccum::test::mlp();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    Accumulator acc(net, opt, AccumulatorOptions(2).process_group(group));
    const auto loss = [&](double s) {
      return net->forward(torch::ones({2, 6}, torch::kDouble) * s * double(rank + 1)).pow(2).sum();
    };
    acc.backward(loss(1));
    acc.backward(loss(2));
    before[rank] = group->allreduces.load();
    loss(3).backward(); // its hooks used to begin a reduction of their own (the manual path)
    after[rank] = group->allreduces.load();
    refused[rank] = error_of([&] { acc.step(); });
    acc.zero_grad(); // dropped alike on every rank: the next reduction says nothing
    acc.backward(loss(1));
    auto fake = loss(3); // its forward before the window closes
    acc.backward(loss(2));
    for (auto& p : net->parameters()) p.requires_grad_(false); // frozen since that forward
    fake.backward(); // AccumulateGrad adds nothing (its hooks still run): no refusal
    for (auto& p : net->parameters()) p.requires_grad_(true);
    stepped[rank] = acc.step();
    results[rank] = copies(net->parameters());
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(after[r] == before[r]);
    CHECK(refused[r] == kHead + ", reduced over no rank" + kTail);
    CHECK(stepped[r]);
  }
  CHECK(all_equal(results[0], results[1]));
}
