#pragma once
// Shared by the Catch2 tests: reference models, comparisons, a real
// multi-rank harness (Gloo groups over a HashStore, one thread per rank) and a
// ProcessGroup that counts the collectives it forwards.
#include <gradaccum/gradaccum.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>

namespace gradaccum::test {

/// Rank threads share torch's global generator: seed-and-build under a lock so
/// each model gets the weights its seed promises.
inline std::mutex& init_mutex() {
  static std::mutex m;
  return m;
}

inline torch::nn::Sequential mlp(torch::Dtype dtype = torch::kFloat64, uint64_t seed = 1) {
  std::lock_guard<std::mutex> lock(init_mutex());
  torch::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  net->to(dtype);
  return net;
}

/// Rows of a regression problem for mlp(): inputs x [rows, 6], targets y [rows, 3].
struct Data {
  torch::Tensor x, y;
};

inline Data data(int64_t rows, torch::Dtype dtype) {
  torch::manual_seed(7);
  return {torch::randn({rows, 6}, dtype), torch::randn({rows, 3}, dtype)};
}

// Four equal layers; `forward(x, reversed)` applies them in registration order
// (backward then makes the gradients ready in reverse registration order, the
// guess) or in reverse (ready in registration order: the guess is wrong).
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    std::lock_guard<std::mutex> lock(init_mutex());
    torch::manual_seed(5);
    for (int i = 0; i < 4; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(8, 8)));
    }
    to(torch::kFloat64);
  }
  torch::Tensor forward(torch::Tensor x, bool reversed) {
    for (int i = 0; i < 4; ++i) {
      x = torch::tanh(layers[reversed ? 3 - i : i]->forward(x));
    }
    return x.pow(2).mean();
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Chain);

/// The parameters of `buckets`, in bucket order.
inline std::vector<size_t> flat(const std::vector<Bucket>& buckets) {
  std::vector<size_t> out;
  for (const auto& b : buckets) out.insert(out.end(), b.params.begin(), b.params.end());
  return out;
}

/// A detached copy of a model's parameters.
inline std::vector<at::Tensor> snapshot(const torch::nn::Sequential& m) {
  std::vector<at::Tensor> out;
  for (auto& p : m->parameters()) out.push_back(p.detach().clone());
  return out;
}

inline double max_rel_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(1.0, b[i].abs().max().item<double>());
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

/// Catch2 v2's assertions are not thread-safe: a rank thread asserts under
/// this lock (RANK_CHECK and friends), or hands its values to the main thread.
/// The expression runs under the lock: it must not wait on a collective (the
/// other rank could not reach its own assert to pair it).
inline std::mutex& catch_mutex() {
  static std::mutex m;
  return m;
}
#define GRADACCUM_TEST_LOCKED(...)                                               \
  do {                                                                           \
    std::lock_guard<std::mutex> catch_lock_(::gradaccum::test::catch_mutex()); \
    __VA_ARGS__;                                                                 \
  } while (false)
#define RANK_CHECK(...) GRADACCUM_TEST_LOCKED(CHECK(__VA_ARGS__))
#define RANK_CHECK_FALSE(...) GRADACCUM_TEST_LOCKED(CHECK_FALSE(__VA_ARGS__))
#define RANK_REQUIRE(...) GRADACCUM_TEST_LOCKED(REQUIRE(__VA_ARGS__))

/// Forwards to a real group and counts what passes through: an independent
/// witness of the reducer's collectives.
class CountingGroup : public c10d::ProcessGroup {
 public:
  explicit CountingGroup(c10::intrusive_ptr<c10d::ProcessGroup> inner)
      : c10d::ProcessGroup(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {
    // the reducer places its metadata by the backend type (NCCL: on the device)
    setDefaultBackend(inner_->getBackendType());
  }
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    ++allreduces;
    return inner_->allreduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    ++broadcasts;
    return inner_->broadcast(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
      const c10d::AllgatherOptions& opts) override {
    return inner_->allgather(out, in, opts);
  }
  const std::string getBackendName() const override {
    return inner_->getBackendName();
  }
  std::atomic<int> allreduces{0};
  std::atomic<int> broadcasts{0};

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> inner_;
};

/// Runs body(rank, group) on `world` threads, each with its own real Gloo group.
/// Rethrows the first rank's exception after all threads end.
inline void run_ranks(int world, const std::function<void(int, c10::intrusive_ptr<CountingGroup>)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto group = gradaccum::new_process_group(
            store, r, world, gradaccum::ProcessGroupOptions().backend("gloo").timeout(std::chrono::seconds(60)));
        body(r, c10::make_intrusive<CountingGroup>(group));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

} // namespace gradaccum::test
