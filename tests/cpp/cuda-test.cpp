// CUDA paths from C++: an NCCL group at world size 1 and Gloo over CUDA
// tensors (2 ranks when there are 2 GPUs), each held to one process on the global batch (on the
// CPU, float64) and to an independent count of the collectives.
//
// Tagged [.cuda]: hidden from the default run (CI has no GPU) and run on a
// machine with one by `gradaccum_tests "[cuda]"` (tools/gpu_run.sh does). Run
// there without a CUDA device, they fail saying so rather than pass unrun.
#include "test_util.h"

#include "catch_torch.h"

#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

using namespace gradaccum;
using gradaccum::test::CountingGroup;
using gradaccum::test::max_rel_diff;

namespace {

constexpr int64_t kK = 3;       // micro-steps per window
constexpr int64_t kCudaRows = 4; // rows per micro-batch
constexpr int kWindows = 3;

void require_cuda() {
  if (!torch::cuda::is_available()) {
    FAIL("the [cuda] tests need a CUDA device (none is visible)");
  }
}

std::vector<at::Tensor> cpu_params(const torch::nn::Sequential& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().to(torch::kCPU).clone());
  return out;
}

// One process on the CPU in float64, the global batch of every window.
std::vector<at::Tensor> reference(int world, const torch::Tensor& x, const torch::Tensor& y) {
  auto net = gradaccum::test::mlp(torch::kFloat64, 7);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const int64_t rows = world * kK * kCudaRows;
  for (int w = 0; w < kWindows; ++w) {
    opt.zero_grad();
    torch::mse_loss(net->forward(x.narrow(0, w * rows, rows)), y.narrow(0, w * rows, rows)).backward();
    opt.step();
  }
  return cpu_params(net);
}

// Trains `rank`'s shard on cuda:0 in `dtype`; records the collectives each
// backward() started and returns the parameters (on the CPU, float64).
std::vector<at::Tensor> train_on_cuda(int rank, int world, const c10::intrusive_ptr<CountingGroup>& group,
                                      torch::Dtype dtype, const torch::Tensor& x, const torch::Tensor& y,
                                      std::vector<int>& counts, int64_t& buckets) {
  const torch::Device cuda(torch::kCUDA, static_cast<c10::DeviceIndex>(rank));
  auto net = gradaccum::test::mlp(torch::kFloat64, 7);
  net->to(cuda, dtype);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  // buckets as laid out at construction (no rebuild): the count holds for every window
  Accumulator acc(net.ptr(), opt,
                  AccumulatorOptions(kK).process_group(group).reducer(ReducerOptions().rebuild_buckets(false)));
  for (int w = 0; w < kWindows; ++w) {
    for (int64_t k = 0; k < kK; ++k) {
      const int64_t start = ((w * world + rank) * kK + k) * kCudaRows;
      const auto xb = x.narrow(0, start, kCudaRows).to(cuda, dtype);
      const auto yb = y.narrow(0, start, kCudaRows).to(cuda, dtype);
      const int before = group->allreduces;
      acc.backward(torch::mse_loss(net->forward(xb), yb));
      counts.push_back(group->allreduces - before);
      const bool stepped = acc.step();
      RANK_CHECK(stepped == (k == kK - 1)); // called from rank threads too
    }
  }
  buckets = acc.stats().reducer.buckets;
  RANK_CHECK(acc.stats().optimizer_steps == kWindows);
  auto out = cpu_params(net);
  for (auto& t : out) t = t.to(torch::kFloat64);
  return out;
}

void check_counts(const std::vector<int>& counts, int64_t buckets) {
  REQUIRE(counts.size() == static_cast<size_t>(kWindows * kK));
  REQUIRE(buckets > 0);
  for (size_t i = 0; i < counts.size(); ++i) {
    // no collective on micro-steps 1..K-1, one per bucket on the K-th
    CHECK(counts[i] == ((i % kK == kK - 1) ? buckets : 0));
  }
}

} // namespace

TEST_CASE("an NCCL group at world size 1 accumulates CUDA gradients as the big batch", "[.cuda][nccl]") {
  require_cuda();
  REQUIRE(gradaccum::nccl_available());
  torch::manual_seed(21);
  auto x = torch::randn({kWindows * kK * kCudaRows, 6}, torch::kFloat64);
  auto y = torch::randn({kWindows * kK * kCudaRows, 3}, torch::kFloat64);
  const auto expected = reference(1, x, y);
  for (auto [dtype, tol] : {std::pair{torch::kFloat64, 1e-10}, std::pair{torch::kFloat32, 1e-5}}) {
    DYNAMIC_SECTION("dtype " << c10::toString(dtype)) {
      auto store = c10::make_intrusive<c10d::HashStore>();
      auto nccl = new_process_group(store, 0, 1, ProcessGroupOptions().backend("nccl"));
      CHECK(nccl->getBackendName() == "nccl");
      auto group = c10::make_intrusive<CountingGroup>(nccl);
      std::vector<int> counts;
      int64_t buckets = 0;
      const auto got = train_on_cuda(0, 1, group, dtype, x, y, counts, buckets);
      CHECK(max_rel_diff(got, expected) <= tol);
      check_counts(counts, buckets);
    }
  }
}

TEST_CASE("the default backend on a CUDA build reduces CPU tensors with Gloo and CUDA tensors with NCCL",
          "[.cuda][nccl]") {
  require_cuda();
  REQUIRE(gradaccum::nccl_available());
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto group = new_process_group(store, 0, 1);
  CHECK(group->getBackendType() == c10d::ProcessGroup::BackendType::NCCL);
  CHECK(group->getBackend(c10::DeviceType::CPU)->getBackendName() == "gloo");
  CHECK(group->getBackend(c10::DeviceType::CUDA)->getBackendName() == "nccl");
  for (const auto& device : {torch::Device(torch::kCPU), torch::Device(torch::kCUDA, 0)}) {
    std::vector<at::Tensor> t{torch::full({4}, 3.0, torch::TensorOptions().device(device))};
    group->allreduce(t)->wait();
    CHECK(t[0].to(torch::kCPU).eq(3.0).all().item<bool>());
  }
}

// Ranks as threads of one process share autograd's one worker thread per
// device: on a single GPU one rank's synchronising backward would wait, on that
// thread, for a peer whose backward is queued behind it. So each rank gets a
// GPU of its own: 2 ranks with 2+ GPUs, world size 1 with one (multi-rank Gloo
// over CUDA tensors on one GPU runs as processes, in tests/python/test_gpu.py).
TEST_CASE("Gloo over CUDA tensors equals one process on the global batch", "[.cuda][gloo]") {
  require_cuda();
  const int world = torch::cuda::device_count() >= 2 ? 2 : 1;
  torch::manual_seed(22);
  auto x = torch::randn({kWindows * world * kK * kCudaRows, 6}, torch::kFloat64);
  auto y = torch::randn({kWindows * world * kK * kCudaRows, 3}, torch::kFloat64);
  const auto expected = reference(world, x, y);
  std::vector<std::vector<at::Tensor>> results(world);
  std::vector<std::vector<int>> counts(world);
  std::vector<int64_t> buckets(world);
  gradaccum::test::run_ranks(world, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    RANK_CHECK(group->getBackendName() == "gloo");
    results[rank] = train_on_cuda(rank, world, group, torch::kFloat64, x, y, counts[rank], buckets[rank]);
  });
  for (int r = 0; r < world; ++r) {
    CHECK(max_rel_diff(results[r], expected) <= 1e-10);
    check_counts(counts[r], buckets[r]);
    CHECK(max_rel_diff(results[r], results[0]) == 0);
  }
}
