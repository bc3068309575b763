// Real multi-rank tests of failures inside a reduction: a backward or a
// micro-batch refused on one rank, a local failure after the window's
// consensus (its write-back, a flush, join()'s shadow windows). Every rank
// must raise alike or recover alike; one thread per rank, each with its own
// Gloo group over loopback, as in reducer-test.cpp.
#include "test_util.h"

#include "catch_torch.h"

using namespace gradaccum;
using gradaccum::test::CountingGroup;
using gradaccum::test::run_ranks;

// What every rank reads of a rank that did not step a window the others
// stepped (Note [A window not stepped on some ranks]).
constexpr const char* kNotSteppedThere =
    "did not step a window every rank had reduced, while the other ranks stepped it (acc.zero_grad() dropped the "
    "closed window there, say after acc.step() raised; a failure there after the window's reduction cleared it; its "
    "loss scaler's update() raised after its step; or it left its acc.join() block with an exception before "
    "stepping it)";

TEST_CASE("a backward that throws on one rank drops the window on every rank", "[reducer][distributed][errors]") {
  // Rank 1's synchronising backward of window 1 throws from a tensor hook,
  // after the later layers' buckets were launched. Both ranks raise, drop the
  // window, go on, and end with identical parameters; so does a raising
  // no_sync micro-step, at its window's end.
  for (bool at_micro_step : {false, true}) {
    DYNAMIC_SECTION((at_micro_step ? "no_sync micro-step" : "synchronising backward")) {
      std::vector<std::vector<std::string>> errors(2);
      std::vector<std::vector<at::Tensor>> results(2);
      std::vector<int64_t> dropped(2);
      run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
        auto net = gradaccum::test::mlp();
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
        Accumulator acc(net, opt, AccumulatorOptions(2).process_group(group).reducer(
            ReducerOptions().bucket_cap_mb(0.0001).first_bucket_cap_mb(0.0001)));
        RANK_REQUIRE(acc.reducer()->buckets().size() >= 3);
        bool arm = false;
        net->parameters()[1].register_hook([&arm](torch::Tensor g) {
          if (arm) throw std::runtime_error("injected failure");
          return g;
        });
        for (int w = 0; w < 3; ++w) {
          for (int k = 0; k < 2; ++k) {
            arm = rank == 1 && w == 1 && k == (at_micro_step ? 0 : 1);
            auto x = torch::full({2, 6}, double(w + k + rank), torch::kFloat64);
            try {
              acc.backward(net->forward(x).pow(2).mean());
              acc.step();
            } catch (const c10::Error& e) {
              errors[rank].push_back(std::to_string(w) + "/" + std::to_string(k) + ": " + e.what_without_backtrace());
            } catch (const std::exception& e) {
              errors[rank].push_back(std::to_string(w) + "/" + std::to_string(k) + ": " + e.what());
            }
          }
        }
        dropped[rank] = acc.stats().reducer.dropped_windows;
        for (auto& p : net->parameters()) results[rank].push_back(p.detach().clone());
      });
      INFO(errors[0].front() << " | " << errors[0].back());
      REQUIRE(errors[0].size() == 1);
      CHECK_THAT(errors[0][0], Catch::StartsWith("1/1: gradaccum: acc.backward(): window 1 was dropped on every rank") &&
                                   Catch::Contains("failed on rank 1"));
      if (at_micro_step) {
        REQUIRE(errors[1].size() == 2);
        CHECK_THAT(errors[1][0], Catch::StartsWith("1/0: injected failure"));
        CHECK_THAT(errors[1][1], Catch::StartsWith("1/1: gradaccum: acc.backward(): window 1"));
      } else {
        REQUIRE(errors[1].size() == 1);
        CHECK_THAT(errors[1][0], Catch::StartsWith("1/1: gradaccum: acc.backward(): window 1 was dropped on "
                                                   "every rank: the synchronising backward (or a micro-step "
                                                   "of the window) failed on this rank (rank 1)") &&
                                     Catch::Contains("injected failure"));
      }
      CHECK(dropped == std::vector<int64_t>{1, 1});
      for (size_t i = 0; i < results[0].size(); ++i) {
        CHECK(torch::equal(results[0][i], results[1][i]));
      }
    }
  }
}

TEST_CASE("a micro-batch refused on one rank drops the window only when it closes it", "[reducer][distributed][errors]") {
  // Rank 1's loss in window 1 does not require grad (an empty batch's
  // torch::zeros({})). At the closing micro-step the other rank is already
  // reducing: the window is dropped on both, each naming rank 1. Before it,
  // nobody waits: the call is refused on rank 1 alone, changes nothing, and
  // rank 1 runs the micro-batch again (Note [A refused closing micro-batch]).
  for (bool closing : {true, false}) {
    DYNAMIC_SECTION((closing ? "closing micro-step" : "first micro-step")) {
      std::vector<std::vector<std::string>> errors(2);
      std::vector<std::vector<at::Tensor>> results(2);
      std::vector<int64_t> dropped(2), steps(2), allreduces(2);
      run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
        auto net = gradaccum::test::mlp();
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
        Accumulator acc(net, opt, AccumulatorOptions(2).process_group(group));
        const int before = group->allreduces;
        for (int w = 0; w < 3; ++w) {
          for (int k = 0; k < 2; ++k) {
            auto x = torch::full({2, 6}, double(w + k + rank), torch::kFloat64);
            const bool refuse = rank == 1 && w == 1 && k == (closing ? 1 : 0);
            try {
              acc.backward(refuse ? torch::zeros({}, torch::kFloat64) : net->forward(x).pow(2).mean());
              acc.step();
            } catch (const c10::ValueError& e) {
              errors[rank].push_back(std::to_string(w) + "/" + std::to_string(k) + ": " + e.what_without_backtrace());
              if (!closing && refuse) { // changed nothing: run it again
                acc.backward(net->forward(x).pow(2).mean());
                acc.step();
              }
            } catch (const c10::Error& e) {
              errors[rank].push_back(std::to_string(w) + "/" + std::to_string(k) + ": " + e.what_without_backtrace());
            }
          }
        }
        dropped[rank] = acc.stats().reducer.dropped_windows;
        steps[rank] = acc.stats().optimizer_steps;
        allreduces[rank] = group->allreduces - before;
        for (auto& p : net->parameters()) results[rank].push_back(p.detach().clone());
      });
      const std::string refused = "1/" + std::string(closing ? "1" : "0") + ": gradaccum: acc.backward(): loss does "
          "not require grad (computed under no_grad or inference_mode, or from no trainable parameter?)";
      REQUIRE(errors[1].size() == 1);
      if (closing) {
        REQUIRE(errors[0].size() == 1);
        CHECK(errors[0][0] == "1/1: gradaccum: acc.backward(): window 1 was dropped on every rank: rank 1 refused "
                              "the micro-batch that closes the window: its acc.backward() or acc.run() rejected its "
                              "loss, num_items or "
                              "metrics (a loss that is not a scalar or does not require grad, a num_items that is not "
                              "a number >= 0, ...) or its other arguments, found a parameter unfrozen without "
                              "acc.refresh_parameters() or an inference .grad, or was called inside acc.no_sync() or "
                              "torch.inference_mode() (its own "
                              "error is raised there). The window's gradients were "
                              "cleared on every rank and no optimizer step was taken; training can go on from the "
                              "next window");
        CHECK(errors[1][0] == refused + "; window 1 was dropped on every rank: this rank (rank 1) refused the "
                              "micro-batch that closes the window: its acc.backward() or acc.run() rejected its loss, "
                              "num_items or "
                              "metrics (a loss that is not a scalar or does not require grad, a num_items that is not "
                              "a number >= 0, ...) or its other arguments, found a parameter unfrozen without "
                              "acc.refresh_parameters() or an inference .grad, or was called inside acc.no_sync() or "
                              "torch.inference_mode(). The "
                              "window's gradients were cleared on every rank and no "
                              "optimizer step was taken; training can go on from the next window");
        CHECK(dropped == std::vector<int64_t>{1, 1});
        CHECK(steps == std::vector<int64_t>{2, 2});
      } else {
        CHECK(errors[0].empty());
        // Nothing changed; the error says how to keep the windows aligned.
        CHECK(errors[1][0] == refused + "; this micro-step was not counted: run it again with a valid loss, or call "
                                        "acc.empty_micro_step() in its place, so that this rank's windows stay "
                                        "aligned with the other ranks'");
        CHECK(dropped == std::vector<int64_t>{0, 0});
        CHECK(steps == std::vector<int64_t>{3, 3});
      }
      CHECK(allreduces[0] == allreduces[1]);
      for (size_t i = 0; i < results[0].size(); ++i) {
        CHECK(torch::equal(results[0][i], results[1][i]));
      }
    }
  }
}

namespace {
// A float64 buffer and an int64 one (two broadcasts a window, the int64 one
// first, like BatchNorm's num_batches_tracked), both set by each forward.
struct BufferNetImpl : torch::nn::Module {
  explicit BufferNetImpl(int64_t rank = 0) : rank(rank) {
    std::lock_guard<std::mutex> lock(gradaccum::test::init_mutex());
    torch::manual_seed(5);
    first = register_module("first", torch::nn::Linear(6, 16));
    second = register_module("second", torch::nn::Linear(16, 3));
    stat = register_buffer("stat", torch::zeros({16}));
    to(torch::kFloat64);
    count = register_buffer("count", torch::zeros({1}, torch::kLong));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(first->forward(x));
    stat.copy_(h.mean(0).detach());
    count.add_(1 + rank);
    return second->forward(h);
  }
  /// The loss of micro-batch `k` of this rank (`shift` moves it apart).
  torch::Tensor loss(int k, int shift = 1) {
    auto x = torch::full({4, 6}, double(k + shift * rank), torch::kFloat64) +
        torch::arange(24, torch::kFloat64).view({4, 6});
    return forward(x).pow(2).mean();
  }
  int64_t rank;
  torch::nn::Linear first{nullptr}, second{nullptr};
  torch::Tensor stat, count;
};
TORCH_MODULE(BufferNet);

// Broadcasts like its inner group (the pairing holds), then throws once on
// demand: a local failure after the window's consensus, before its write-back
// (and, with BufferNet, before the window's second broadcast).
class FailingBroadcastGroup : public CountingGroup {
 public:
  using CountingGroup::CountingGroup;
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    auto work = CountingGroup::broadcast(tensors, opts);
    long_broadcasts += tensors[0].scalar_type() == at::kLong;
    if (fail.exchange(false)) {
      work->wait();
      throw std::runtime_error("injected broadcast failure");
    }
    return work;
  }
  std::atomic<bool> fail{false};
  std::atomic<int> long_broadcasts{0}; ///< BufferNet's count: once at construction and each window
};
} // namespace

TEST_CASE("a failure between the consensus and the write-back steps nothing on that rank", "[reducer][distributed][errors]") {
  // Rank 1's buffer broadcast fails after pairing: its .grad would hold the
  // undivided sum. It is cleared, the window is dropped there with an error
  // that says the replicas now differ, and both ranks go on paired: the next
  // window is dropped on both, each saying so (Note [A window not stepped on
  // some ranks]), and the one after trains again. With the
  // rebuild on, the failure comes in window 0, whose end also agrees on the
  // buckets' ready order: rank 1 still runs that agreement and switches too.
  // The failure is in the first of the window's two buffer broadcasts: rank 1
  // still runs the second, and both ranks end with rank 0's buffers.
  for (bool as_view : {false, true}) {
    for (bool rebuild : {false, true}) {
      DYNAMIC_SECTION((as_view ? "bucket views" : "copies") << (rebuild ? ", rebuild" : "")) {
        const int failing = rebuild ? 0 : 1;
        std::vector<std::vector<std::string>> errors(2);
        std::vector<std::vector<bool>> stepped(2);
        std::vector<int> grads_left(2, -1), allreduces(2), broadcasts(2), long_broadcasts(2);
        std::vector<ReducerStats> stats(2);
        std::vector<std::vector<torch::Tensor>> buffers(2);
        std::vector<ReductionResult> at_failure(2);
        int64_t own_count = -1;
        run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> counting) {
          auto group = c10::make_intrusive<FailingBroadcastGroup>(counting);
          BufferNet net(rank);
          torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
          Accumulator acc(net, opt, AccumulatorOptions(1).process_group(group).reducer(
              ReducerOptions().rebuild_buckets(rebuild).bucket_cap_mb(0.0001).first_bucket_cap_mb(0.0001)
                  .gradient_as_bucket_view(as_view)));
          for (int w = 0; w < 4; ++w) { // the window after the failure is dropped everywhere
            group->fail = rank == 1 && w == failing;
            try {
              acc.backward(net->loss(w));
              if (w == failing) {
                at_failure[rank] = acc.reducer()->last_result();
              }
            } catch (const c10::Error& e) {
              errors[rank].push_back(std::to_string(w) + ": " + e.what_without_backtrace());
              if (w != failing) {
                stepped[rank].push_back(acc.step());
                continue;
              }
              at_failure[rank] = acc.reducer()->last_result();
              own_count = net->count.item<int64_t>();
              int left = 0;
              for (auto& p : net->parameters()) {
                left += p.grad().defined() && p.grad().abs().sum().item<double>() != 0;
              }
              grads_left[rank] = left;
            }
            stepped[rank].push_back(acc.step());
          }
          allreduces[rank] = counting->allreduces;
          broadcasts[rank] = counting->broadcasts;
          long_broadcasts[rank] = group->long_broadcasts;
          stats[rank] = acc.stats().reducer;
          buffers[rank] = {net->stat.clone(), net->count.clone()};
        });
        // Note [A window not stepped on some ranks]: the next window tells both.
        const auto next = std::to_string(failing + 1);
        const std::string replicas = ": the replicas differ from here on. Resume every rank from a checkpoint "
                                     "(acc.load_state_dict() on every rank). The window was dropped on every rank";
        REQUIRE(errors[0].size() == 1);
        CHECK(errors[0][0] == next + ": gradaccum: acc.backward(): window " + next + ": rank 1 " + kNotSteppedThere +
                                  replicas);
        REQUIRE(errors[1].size() == 2);
        CHECK(errors[1][0] == std::to_string(failing) + ": gradaccum: acc.backward(): every rank reduced the window, "
                              "but this rank (rank 1) failed after that: injected broadcast failure. This rank "
                              "dropped its window (no optimizer step here) while the other ranks step theirs: the "
                              "replicas differ from here on. Resume every rank from a checkpoint (the next reduction "
                              "tells every rank, and every rank drops it)");
        CHECK(errors[1][1] == next + ": gradaccum: acc.backward(): window " + next + ": this rank (rank 1) did not "
                              "step a window every rank had reduced (a failure after its reduction cleared it here), "
                              "while the other ranks stepped it" + replicas);
        CHECK(grads_left[1] == 0);
        // The window's loss and metric sums reach the result only after its
        // other collectives: the failing rank's has neither, the other's both.
        CHECK(at_failure[0].window == at_failure[1].window);
        CHECK(at_failure[0].written);
        CHECK(at_failure[0].loss_sum.has_value());
        CHECK(at_failure[0].metric_sums.size() == static_cast<size_t>(kMaxWindowMetrics));
        CHECK_FALSE(at_failure[1].written);
        CHECK_FALSE(at_failure[1].dropped);
        CHECK_FALSE(at_failure[1].loss_sum.has_value());
        CHECK(at_failure[1].metric_sums.empty());
        CHECK(stepped[0] == std::vector<bool>{true, failing != 0, failing != 1, true});
        CHECK(stepped[1] == std::vector<bool>{failing != 0, false, failing != 1, true});
        CHECK(allreduces[0] == allreduces[1]);
        CHECK(broadcasts[0] == broadcasts[1]);
        // construction and the three windows not dropped, and the rebuild's order (an int64 broadcast)
        const int expected = 4 + (rebuild ? 1 : 0);
        CHECK(long_broadcasts == std::vector<int>{expected, expected});
        CHECK(stats[0].broadcasts == 3);
        CHECK(stats[1].broadcasts == 3);
        CHECK(torch::equal(buffers[0][0], buffers[1][0]));
        CHECK(buffers[0][1].item<int64_t>() == 4); // rank 0's count, broadcast after the last window
        // The failed int64 broadcast left rank 1's count its own (rank 0's
        // after the window before, plus 2 from its forward).
        CHECK(own_count == (failing == 0 ? 2 : 1 + 2));
        CHECK(buffers[1][1].item<int64_t>() == 4);
        CHECK(stats[0].dropped_windows == 1);
        CHECK(stats[1].dropped_windows == 2);
        CHECK(stats[0].windows == 4);
        CHECK(stats[1].windows == 4);
        CHECK(stats[0].buckets > 1);
        CHECK(stats[1].buckets == stats[0].buckets);
        CHECK(stats[1].bucket_rebuilds == stats[0].bucket_rebuilds);
      }
    }
  }
}

TEST_CASE("a failure after the consensus of a flush steps nothing on that rank", "[reducer][distributed][errors]") {
  // The partial window's reduction in acc.flush() fails on rank 1 after every
  // rank reduced it: rank 1 says so in acc.flush()'s name, steps nothing, and
  // both ranks go on paired into the next epoch, whose first window both drop,
  // saying that the replicas differ; the next one trains.
  std::vector<std::vector<std::string>> errors(2);
  std::vector<std::vector<bool>> stepped(2);
  std::vector<int> allreduces(2);
  std::vector<ReducerStats> stats(2);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> counting) {
    auto group = c10::make_intrusive<FailingBroadcastGroup>(counting);
    BufferNet net(rank);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    Accumulator acc(net, opt, AccumulatorOptions(2).process_group(group));
    for (int k = 0; k < 3; ++k) { // one window, then a partial one flushed, then one more
      acc.backward(net->loss(k));
      stepped[rank].push_back(acc.step());
    }
    group->fail = rank == 1;
    try {
      stepped[rank].push_back(acc.flush());
    } catch (const c10::Error& e) {
      errors[rank].push_back(e.what_without_backtrace());
      stepped[rank].push_back(false);
    }
    group->fail = false;
    for (int k = 0; k < 4; ++k) { // the next window is dropped everywhere (Note [A window not stepped ...])
      try {
        acc.backward(net->loss(k, -1));
      } catch (const c10::Error& e) {
        errors[rank].push_back(e.what_without_backtrace());
      }
      stepped[rank].push_back(acc.step());
    }
    allreduces[rank] = counting->allreduces;
    stats[rank] = acc.stats().reducer;
  });
  const std::string replicas = ": the replicas differ from here on. Resume every rank from a checkpoint "
                               "(acc.load_state_dict() on every rank). The window was dropped on every rank";
  REQUIRE(errors[0].size() == 1);
  CHECK(errors[0][0] == std::string("gradaccum: acc.backward(): window 2: rank 1 ") + kNotSteppedThere + replicas);
  REQUIRE(errors[1].size() == 2);
  CHECK(errors[1][0] == "gradaccum: acc.flush(): every rank reduced the window, but this rank (rank 1) failed after "
                        "that: injected broadcast failure. This rank dropped its window (no optimizer step here) "
                        "while the other ranks step theirs: the replicas differ from here on. Resume every rank "
                        "from a checkpoint (the next reduction tells every rank, and every rank drops it)");
  CHECK(errors[1][1] == "gradaccum: acc.backward(): window 2: this rank (rank 1) did not step a window every rank had "
                        "reduced (a failure after its reduction cleared it here), while the other ranks stepped it" +
                        replicas);
  CHECK(stepped[0] == std::vector<bool>{false, true, false, true, false, false, false, true});
  CHECK(stepped[1] == std::vector<bool>{false, true, false, false, false, false, false, true});
  CHECK(allreduces[0] == allreduces[1]);
  CHECK(stats[0].dropped_windows == 1);
  CHECK(stats[1].dropped_windows == 2);
  CHECK(stats[0].windows == stats[1].windows);
}

TEST_CASE("a failure after the consensus while shadowing in acc.join() drops the next window everywhere", "[reducer][distributed][errors][join]") {
  // Rank 1 ran out of data after one window and shadows rank 0's windows in
  // acc.join(). Its buffer broadcast fails after the consensus of window 1:
  // it cannot step with rank 0. It keeps pairing and drops window 2 on every
  // rank, naming that, so rank 0 learns too, and leaves join() with the
  // error: that tells every rank to end training (Note [Training ended in
  // join()]), so rank 0's window 3 is refused, changing nothing, and its
  // join() returns at once. A next epoch (rank 1 joins at once) pairs.
  std::vector<std::vector<std::string>> errors(2);
  std::vector<int> allreduces(2);
  std::vector<std::vector<int64_t>> joined_steps(2);
  std::vector<ReducerStats> stats(2);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> counting) {
    auto group = c10::make_intrusive<FailingBroadcastGroup>(counting);
    BufferNet net(rank);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    Accumulator acc(net, opt, AccumulatorOptions(1).process_group(group));
    const int windows = rank == 0 ? 4 : 1;
    for (int w = 0; w < windows; ++w) {
      try {
        acc.backward(net->loss(w));
        acc.step();
      } catch (const c10::Error& e) {
        errors[rank].push_back(std::to_string(w) + ": " + e.what_without_backtrace());
      }
    }
    group->fail = rank == 1;
    try {
      joined_steps[rank].push_back(acc.join());
    } catch (const c10::Error& e) {
      errors[rank].push_back(std::string("join: ") + e.what_without_backtrace());
      group->fail = false;
    }
    for (int w = 0; w < (rank == 0 ? 2 : 0); ++w) { // the next epoch
      acc.backward(net->loss(w));
      acc.step();
    }
    joined_steps[rank].push_back(acc.join());
    allreduces[rank] = counting->allreduces;
    stats[rank] = acc.stats().reducer;
  });
  const std::string why = "rank 1) could not step a window every rank had reduced as its data ended (its last, in "
                          "acc.flush() or acc.join(), or one it shadowed in acc.join()), while other ranks stepped "
                          "theirs";
  REQUIRE(errors[0].size() == 2);
  CHECK(errors[0][0] == "2: gradaccum: acc.backward(): window 2 was dropped on every rank: rank 1 could not step a "
                        "window every rank had reduced as its data ended (its last, in acc.flush() or acc.join(), or "
                        "one it shadowed in acc.join()), while other ranks stepped theirs (its own error is raised there): the replicas differ from here on, and 1 "
                        "rank(s) out of data in acc.join() raise this error too and leave it: end training on every "
                        "rank here and resume every rank from a checkpoint");
  CHECK(errors[0][1].rfind("3: gradaccum: acc.backward(): the last reduction dropped its window on every rank and told "
                           "every rank to end training there", 0) == 0);
  REQUIRE(errors[1].size() == 1);
  CHECK(errors[1][0].rfind("join: gradaccum: acc.join(): ", 0) == 0);
  CHECK(errors[1][0].find("this rank (" + why) != std::string::npos);
  CHECK(errors[1][0].find("every rank reduced the window, but this rank (rank 1) failed after that: injected "
                          "broadcast failure") != std::string::npos);
  CHECK(joined_steps[0] == std::vector<int64_t>{0, 0}); // (the first: told to end, at once)
  CHECK(joined_steps[1] == std::vector<int64_t>{2}); // shadowed the next epoch's two windows
  CHECK(allreduces[0] == allreduces[1]);
  CHECK(stats[0].windows == stats[1].windows);
  CHECK(stats[0].dropped_windows == 1); // window 2
  CHECK(stats[1].dropped_windows == 2); // window 1, here alone, and window 2
}
