// Data-parallel training with gradient accumulation from a LibTorch program.
//
//   torchrun --standalone --nproc_per_node=2 --no-python build/examples/train_mlp --steps 4
//   build/examples/train_mlp --steps 4          # one process
//
// Each rank trains on its shard of a synthetic 10-class, 64-feature data set
// (digits-sized); the gradients are all-reduced once per window, overlapped
// with backward. At the end rank 0 retrains one process on the global batches
// and prints how far the two runs' parameters are apart.
#include <gradaccum/gradaccum.h>

#include <memory>
#include <sstream>
#include <torch/torch.h>

#include <iostream>
#include <string>

namespace {

struct Args {
  int64_t steps = 4; // micro-batches per window
  int64_t micro_batch = 16;
  int64_t windows = 30;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 == argc) throw std::invalid_argument(flag + " needs a value");
    const int64_t value = std::stoll(argv[i + 1]);
    if (flag == "--steps") a.steps = value;
    else if (flag == "--micro-batch") a.micro_batch = value;
    else if (flag == "--windows") a.windows = value;
    else throw std::invalid_argument("unknown flag " + flag);
  }
  return a;
}

torch::nn::Sequential make_cpu_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(
      torch::nn::Linear(64, 128), torch::nn::ReLU(), torch::nn::Linear(128, 10));
}

// Ten Gaussian clusters in 64 dimensions; the same on every rank.
std::pair<torch::Tensor, torch::Tensor> make_data(int64_t rows) {
  torch::manual_seed(1234);
  auto centers = torch::randn({10, 64}) * 2;
  auto labels = torch::randint(10, {rows}, torch::kLong);
  return {centers.index_select(0, labels) + torch::randn({rows, 64}), labels};
}

} // namespace

int main(int argc, char** argv) try {
  const auto args = parse(argc, argv);
  // Under torchrun a Gloo (or NCCL) group; as a plain process none (local-only).
  const auto group = gradaccum::init_process_group_from_env();
  const int rank = group ? group->getRank() : 0;
  const int world = group ? group->getSize() : 1;
  // Under NCCL (torchrun on a CUDA machine) each rank trains on its GPU.
  const bool on_gpu = group && group->getBackendType() == c10d::ProcessGroup::BackendType::NCCL;
  const torch::Device device = on_gpu
      ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(gradaccum::LaunchEnvironment::from_env().local_rank))
      : torch::Device(torch::kCPU);
  const int64_t window_rows = world * args.steps * args.micro_batch;
  auto [x, y] = make_data(window_rows * args.windows);
  x = x.to(device);
  y = y.to(device);
  const auto make_model = [&] {
    auto m = make_cpu_model();
    m->to(device);
    return m;
  };
  if (rank == 0) {
    std::cout << "ranks " << world << " on " << device << (group ? " (" + group->getBackendName() + ")" : "")
              << std::endl;
  }

  auto model = make_model();
  auto optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), 1e-3);
  const auto options = gradaccum::AccumulatorOptions(args.steps).process_group(group);
  auto acc = std::make_unique<gradaccum::Accumulator>(model.ptr(), *optimizer, options);

  for (int64_t w = 0; w < args.windows; ++w) {
    double window_loss = 0;
    for (int64_t k = 0; k < args.steps; ++k) {
      const int64_t start = w * window_rows + (rank * args.steps + k) * args.micro_batch;
      auto loss = torch::cross_entropy_loss(
          model->forward(x.narrow(0, start, args.micro_batch)), y.narrow(0, start, args.micro_batch));
      window_loss += loss.item<double>() / args.steps;
      acc->backward(loss);
      acc->step();
      if (w == args.windows / 2 && k == 0 && args.steps > 1) {
        // A checkpoint in the middle of a window, then a resume from it into a
        // fresh model, optimizer and Accumulator, as a restarted job would do.
        // The Accumulator's state is rank-independent (saving it is a
        // collective), so rank 0's archive alone would resume every rank.
        std::stringstream file;
        torch::serialize::OutputArchive archive;
        model->save(archive);
        optimizer->save(archive);
        acc->save(archive);
        archive.save_to(file);
        acc.reset(); // releases the parameters for the new Accumulator
        model = make_model();
        optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), 1e-3);
        acc = std::make_unique<gradaccum::Accumulator>(model.ptr(), *optimizer, options);
        torch::serialize::InputArchive restored;
        restored.load_from(file);
        model->load(restored);
        optimizer->load(restored);
        acc->load(restored);
        if (rank == 0) {
          std::cout << "checkpoint saved and resumed at window " << w << ", micro-step " << k + 1 << std::endl;
        }
      }
    }
    if (rank == 0 && (w % 10 == 0 || w + 1 == args.windows)) {
      std::cout << "window " << w << " loss " << window_loss << std::endl;
    }
  }
  const auto stats = acc->stats();
  if (rank == 0) {
    std::cout << "ranks " << world << ", optimizer steps " << stats.optimizer_steps
              << ", collectives per window " << stats.reducer.last_window_collectives
              << " (buckets " << stats.reducer.buckets << "), bytes per window "
              << stats.reducer.last_window_bytes << std::endl;
    auto reference = make_model();
    torch::optim::Adam ref_opt(reference->parameters(), 1e-3);
    for (int64_t w = 0; w < args.windows; ++w) {
      ref_opt.zero_grad();
      torch::cross_entropy_loss(reference->forward(x.narrow(0, w * window_rows, window_rows)),
                                y.narrow(0, w * window_rows, window_rows)).backward();
      ref_opt.step();
    }
    double diff = 0;
    for (size_t i = 0; i < reference->parameters().size(); ++i) {
      diff = std::max(diff, (reference->parameters()[i] - model->parameters()[i]).abs().max().item<double>());
    }
    auto accuracy = model->forward(x).argmax(1).eq(y).to(torch::kFloat).mean().item<double>();
    std::cout << "train accuracy " << accuracy << std::endl;
    std::cout << "max |parameter difference| vs one process on the global batch: " << diff << std::endl;
    constexpr double kTolerance = 1e-5; // float32 sums in another order
    if (!(diff <= kTolerance)) {
      std::cerr << "train_mlp: the accumulated run is " << diff << " from the global batch's, more than "
                << kTolerance << std::endl;
      return 1;
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "train_mlp: " << e.what() << std::endl;
  return 1;
}
