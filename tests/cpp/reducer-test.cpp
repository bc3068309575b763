// Real multi-rank tests: one thread per rank, each with its own Gloo group over
// loopback (a HashStore rendezvous), checked against one process on the whole
// global batch and against an independent count of the collectives.
#include "test_util.h"

#include "catch_torch.h"

#include <chrono>
#include <set>

using namespace gradaccum;
using gradaccum::test::CountingGroup;
using gradaccum::test::max_rel_diff;
using gradaccum::test::Chain;
using gradaccum::test::run_ranks;

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    std::lock_guard<std::mutex> lock(gradaccum::test::init_mutex());
    torch::manual_seed(3);
    trunk = register_module("trunk", torch::nn::Linear(6, 16));
    head = register_module("head", torch::nn::Linear(16, 3));
    side = register_module("side", torch::nn::Linear(16, 2));
    idle = register_module("idle", torch::nn::Linear(16, 2));
    to(torch::kFloat64);
  }
  // `use_side` varies by rank and micro-step; `idle` is never used.
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y, bool use_side) {
    auto z = torch::tanh(trunk->forward(x));
    auto l = (head->forward(z) - y).pow(2).sum(1).mean();
    return use_side ? l + side->forward(z).pow(2).mean() : l;
  }
  torch::nn::Linear trunk{nullptr}, head{nullptr}, side{nullptr}, idle{nullptr};
};
TORCH_MODULE(Net);

std::vector<at::Tensor> params_of(Net& n) {
  std::vector<at::Tensor> out;
  for (auto& p : n->parameters()) out.push_back(p.detach().clone());
  return out;
}

constexpr int64_t kRows = 4; // rows per micro-batch

bool uses_side(int rank, int micro) {
  return rank == 0 || micro == 1; // rank 0 always, the others in one micro-step
}

// One process, the global batch: the mean over all ranks' micro-batch losses.
std::vector<at::Tensor> reference(int world, int64_t K, int windows, const torch::Tensor& x, const torch::Tensor& y) {
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int w = 0; w < windows; ++w) {
    opt.zero_grad();
    torch::Tensor total;
    for (int r = 0; r < world; ++r) {
      for (int k = 0; k < K; ++k) {
        const int64_t start = ((w * world + r) * K + k) * kRows;
        auto l = net->loss(x.narrow(0, start, kRows), y.narrow(0, start, kRows), uses_side(r, k));
        total = total.defined() ? total + l : l;
      }
    }
    (total / double(world * K)).backward();
    opt.step();
  }
  CHECK_FALSE(net->idle->weight.grad().defined());
  return params_of(net);
}

} // namespace

TEST_CASE("W ranks x K micro-batches equal one process on the global batch", "[reducer][distributed]") {
  for (int world : {2, 4}) {
    const int64_t K = 3;
    const int windows = 3;
    torch::manual_seed(11);
    auto x = torch::randn({world * K * windows * kRows, 6}, torch::kFloat64);
    auto y = torch::randn({world * K * windows * kRows, 3}, torch::kFloat64);
    auto expected = reference(world, K, windows, x, y);
    for (bool as_view : {false, true}) {
      DYNAMIC_SECTION("world " << world << (as_view ? " bucket views" : " copies")) {
        std::vector<std::vector<at::Tensor>> results(world);
        std::vector<std::vector<int>> counts(world), buckets(world);
        run_ranks(world, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
          Net net;
          torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
          auto options = AccumulatorOptions(K).process_group(group).reducer(
              ReducerOptions().bucket_cap_mb(0.0005).first_bucket_cap_mb(0.0002).gradient_as_bucket_view(as_view));
          Accumulator acc(net, opt, options);
          for (int w = 0; w < windows; ++w) {
            // the buckets of this window (rebuilt in backward's order after the first)
            buckets[rank].push_back(static_cast<int>(acc.stats().reducer.buckets));
            for (int k = 0; k < K; ++k) {
              const int64_t start = ((w * world + rank) * K + k) * kRows;
              const int before = group->allreduces;
              acc.backward(net->loss(x.narrow(0, start, kRows), y.narrow(0, start, kRows), uses_side(rank, k)));
              counts[rank].push_back(group->allreduces - before);
              acc.step();
            }
          }
          const auto stats = acc.stats();
          RANK_CHECK(stats.reducer.buckets > 1);
          RANK_CHECK(stats.reducer.bucket_rebuilds == 1); // the guess was not backward's order
          RANK_CHECK(stats.reducer.last_window_collectives == stats.reducer.buckets);
          RANK_CHECK(stats.reducer.collectives == buckets[rank][0] + (windows - 1) * stats.reducer.buckets);
          // the idle layer got no gradient anywhere: None, as in one process
          if (!as_view) RANK_CHECK_FALSE(net->idle->weight.grad().defined());
          results[rank] = params_of(net);
          acc.close(); // stats() still tells what the run reduced
          const auto closed = acc.stats();
          RANK_CHECK(closed.data_parallel);
          RANK_CHECK(closed.world_size == world);
          RANK_CHECK(closed.reducer.collectives == stats.reducer.collectives);
          RANK_CHECK(closed.reducer.buckets == stats.reducer.buckets);
        });
        for (int r = 0; r < world; ++r) {
          CHECK(max_rel_diff(results[r], expected) <= 1e-10);
          for (int i = 0; i < static_cast<int>(counts[r].size()); ++i) {
            // no collective on micro-steps 1..K-1, one per bucket on the K-th
            CHECK(counts[r][i] == ((i % K == K - 1) ? buckets[r][i / K] : 0));
          }
        }
      }
    }
  }
}

TEST_CASE("no_sync gives DDP-style manual control", "[reducer][distributed]") {
  std::vector<at::Tensor> local(2), synced(2);
  std::vector<int> inside(2);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    auto net = gradaccum::test::mlp();
    auto params = net->parameters();
    Reducer reducer(params, group);
    const int built = group->allreduces; // (construction's own agreement)
    auto x = torch::full({2, 6}, double(rank + 1), torch::kFloat64);
    {
      NoSync guard(&reducer);
      net->forward(x).sum().backward();
    }
    inside[rank] = group->allreduces - built;
    local[rank] = params[0].grad().clone();
    net->forward(x).sum().backward(); // outside no_sync: synchronises, as DDP
    RANK_CHECK(group->allreduces - built == static_cast<int>(reducer.buckets().size()));
    RANK_CHECK(reducer.stats().windows == 1);
    synced[rank] = params[0].grad().clone();
  });
  CHECK(inside == std::vector<int>{0, 0});
  CHECK_FALSE(torch::allclose(local[0], local[1]));
  // each rank accumulated 2 g(rank); DDP's mean over ranks is g(0) + g(1)
  for (int r = 0; r < 2; ++r) {
    CHECK(torch::allclose(synced[r], local[0] + local[1], 1e-12, 1e-12));
  }
}

TEST_CASE("models that differ across ranks fail fast on every rank", "[reducer][distributed][errors]") {
  std::vector<std::string> messages(2);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto group = new_process_group(store, r, 2, ProcessGroupOptions().backend("gloo").timeout(std::chrono::seconds(30)));
      torch::nn::Linear lin(4, r == 0 ? 5 : 6);
      try {
        Accumulator acc(lin, AccumulatorOptions(2).process_group(group));
      } catch (const c10::Error& e) {
        messages[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& m : messages) {
    CHECK_THAT(m, Catch::Contains("differs across ranks") && Catch::Contains("weight") &&
                      Catch::Contains("[6, 4] on rank 1") && Catch::Contains("[5, 4] on rank 0"));
  }
}

TEST_CASE("construction broadcasts rank 0's parameters", "[reducer][distributed]") {
  std::vector<at::Tensor> weights(2);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    auto net = gradaccum::test::mlp(torch::kFloat64, /*seed=*/100 + rank);
    Accumulator acc(net, AccumulatorOptions(2).process_group(group));
    weights[rank] = net->parameters()[0].detach().clone();
  });
  CHECK(torch::equal(weights[0], weights[1]));
  CHECK(torch::equal(weights[0], gradaccum::test::mlp(torch::kFloat64, 100)->parameters()[0]));
}

TEST_CASE("a no_sync guard may outlive the reducer it guards", "[reducer][distributed]") {
  // acc.close() and acc.refresh_parameters() destroy the reducer; the guard's
  // end must not touch it (a use after free under the sanitizers before).
  std::vector<int> expect_after(2, -1);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    auto net = gradaccum::test::mlp();
    Accumulator acc(net, AccumulatorOptions(2).process_group(group));
    {
      auto guard = acc.no_sync();
      RANK_CHECK_FALSE(acc.expect_hooks());
      acc.refresh_parameters(net);
    }
    expect_after[rank] = acc.expect_hooks() ? 1 : 0; // the new reducer's own, untouched by the old guard
    {
      auto guard = acc.no_sync();
      acc.close();
    }
    RANK_CHECK(acc.closed());
  });
  CHECK(expect_after == std::vector<int>{1, 1});
}

TEST_CASE("ranks with different steps fail in the first reduction, without the construction check", "[reducer][distributed][errors]") {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    auto net = gradaccum::test::mlp();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    Accumulator acc(net, opt, AccumulatorOptions(rank == 0 ? 4 : 2).process_group(group).reducer(
        ReducerOptions().check_parameters(false)));
    try {
      for (int i = 0; i < 8; ++i) {
        acc.backward(net->forward(torch::ones({2, 6}, torch::kFloat64)).sum());
        acc.step();
      }
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  CHECK_THAT(errors[0], Catch::Contains("the ranks disagree on steps: this rank (rank 0) has 4, rank 1 has 2"));
  CHECK_THAT(errors[1], Catch::Contains("the ranks disagree on steps: this rank (rank 1) has 2, rank 0 has 4"));
}

TEST_CASE("comm_dtype: one collective per bucket, fewer bytes, within the wire's rounding", "[reducer][distributed]") {
  const int world = 2;
  const int64_t K = 4;
  const int windows = 2;
  torch::manual_seed(12);
  auto x = torch::randn({world * K * windows * kRows, 6}, torch::kFloat64);
  auto y = torch::randn({world * K * windows * kRows, 3}, torch::kFloat64);
  const auto expected = reference(world, K, windows, x, y);
  struct Case {
    std::optional<at::ScalarType> comm;
    double tolerance;
    int64_t bytes_per_element;
  };
  // float64 parameters: float32 and bf16 wires, with and without error feedback.
  for (const auto& c : {Case{std::nullopt, 1e-10, 8}, Case{at::kFloat, 1e-6, 4}, Case{at::kBFloat16, 2e-2, 2}}) {
    for (bool feedback : {false, true}) {
      if (feedback && !c.comm) continue;
      DYNAMIC_SECTION("comm " << (c.comm ? c10::toString(*c.comm) : "None") << (feedback ? " error feedback" : "")) {
        std::vector<std::vector<at::Tensor>> results(world);
        std::vector<gradaccum::AccumulatorStats> stats(world);
        std::vector<int> allreduces(world);
        run_ranks(world, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
          Net net;
          torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
          auto options = AccumulatorOptions(K).process_group(group).comm_dtype(c.comm).error_feedback(feedback)
              .reducer(ReducerOptions().bucket_cap_mb(0.0005).first_bucket_cap_mb(0.0002));
          Accumulator acc(net, opt, options);
          int before = 0;
          for (int w = 0; w < windows; ++w) {
            before = group->allreduces; // the last window's (the first may rebuild the buckets)
            for (int k = 0; k < K; ++k) {
              const int64_t start = ((w * world + rank) * K + k) * kRows;
              acc.backward(net->loss(x.narrow(0, start, kRows), y.narrow(0, start, kRows), uses_side(rank, k)));
              acc.step();
            }
          }
          allreduces[rank] = group->allreduces - before;
          stats[rank] = acc.stats();
          results[rank] = params_of(net);
        });
        for (int r = 0; r < world; ++r) {
          const auto& reducer = stats[r].reducer;
          CHECK(reducer.buckets > 1);
          CHECK(allreduces[r] == reducer.buckets); // counted by the group itself
          CHECK(reducer.last_window_collectives == reducer.buckets);
          int64_t numel = 0;
          for (const auto& p : results[r]) numel += p.numel();
          // The gradients' bytes, and a header and flags per bucket.
          CHECK(reducer.last_window_bytes >= numel * c.bytes_per_element);
          CHECK(reducer.last_window_bytes < numel * c.bytes_per_element + 512 * reducer.buckets);
          CHECK(max_rel_diff(results[r], expected) <= c.tolerance);
          CHECK(max_rel_diff(results[r], results[0]) == 0);
        }
      }
    }
  }
}

TEST_CASE("the timeline starts on the system clock; parameter names in the Accumulator's order",
          "[reducer][distributed][timeline]") {
  run_ranks(2, [&](int /*rank*/, c10::intrusive_ptr<CountingGroup> group) {
    Chain net;
    for (auto& p : net->layers[0]->parameters()) {
      p.set_requires_grad(false); // frozen: not the Accumulator's
    }
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    Accumulator acc(net, opt, AccumulatorOptions(1).process_group(group));
    RANK_CHECK(acc.last_window_timeline().origin == -1);
    const auto now = [] {
      return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    };
    const double before = now();
    acc.backward(net->forward(torch::ones({2, 8}, torch::kFloat64), false));
    acc.step();
    const double after = now();
    const auto t = acc.last_window_timeline();
    RANK_CHECK(before <= t.origin);
    RANK_CHECK(t.origin + t.finished <= after);
    RANK_CHECK(t.gradients.size() == 6);
    // Note [Writing back while the last buckets reduce]: each written once
    // its all-reduce was launched, in launch order, before the window finished.
    double previous = 0;
    for (const auto& b : t.buckets) {
      RANK_CHECK(0 <= b.launched);
      RANK_CHECK(b.launched <= b.written);
      RANK_CHECK(previous <= b.written);
      RANK_CHECK(b.written <= t.finished);
      previous = b.written;
    }
    RANK_CHECK(acc.parameter_names() ==
               std::vector<std::string>{"l1.weight", "l1.bias", "l2.weight", "l2.bias", "l3.weight", "l3.bias"});
  });
}

TEST_CASE("zero_grad() at a window boundary is no uncounted backward, bucket views or not", "[reducer][distributed][misuse]") {
  // Found by the fuzzer: with bucket views the last window leaves zeroed views
  // in .grad; optimizer.zero_grad() at the boundary drops them, and
  // acc.step() took that for a plain loss.backward(). It returns false, as
  // with copies; a real write is still refused, on every rank.
  for (bool as_view : {false, true}) {
    DYNAMIC_SECTION((as_view ? "bucket views" : "copies")) {
      std::vector<std::vector<at::Tensor>> results(2);
      std::vector<std::vector<bool>> stepped(2);
      std::vector<std::string> refused(2);
      run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
        auto net = gradaccum::test::mlp();
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
        Accumulator acc(net, opt, AccumulatorOptions(2).process_group(group).reducer(
            ReducerOptions().gradient_as_bucket_view(as_view)));
        const auto loss = [&](int k) {
          return net->forward(torch::ones({2, 6}, torch::kDouble) * double(rank + 1 + k)).pow(2).sum();
        };
        for (int w = 0; w < 2; ++w) {
          for (int k = 0; k < 2; ++k) {
            acc.backward(loss(k));
            stepped[rank].push_back(acc.step());
          }
          if (w == 0) {
            stepped[rank].push_back(acc.step());
            // Python's optimizer.zero_grad() (set_to_none); LibTorch's
            // detach_()es first, which a bucket view refuses.
            for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
            stepped[rank].push_back(acc.step());
          }
        }
        for (auto& p : net->parameters()) results[rank].push_back(p.detach().clone());
        {
          // not acc.backward(), and a gradient of zeros on rank 0 only: still
          // refused on both ranks (marks decide, not values)
          auto guard = acc.no_sync();
          (loss(0) * double(rank)).backward();
        }
        try {
          acc.step();
        } catch (const std::exception& e) {
          refused[rank] = e.what();
        }
      });
      for (int r = 0; r < 2; ++r) {
        CHECK(stepped[r] == std::vector<bool>{false, true, false, false, false, true});
        CHECK_THAT(refused[r], Catch::StartsWith(
            "gradaccum: acc.step(): gradients were written since the last window, but no micro-step was counted"));
      }
      for (size_t i = 0; i < results[0].size(); ++i) CHECK(torch::equal(results[0][i], results[1][i]));
    }
  }
}
