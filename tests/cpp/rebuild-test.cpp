// The one-time bucket rebuild in backward's order (Note [Rebuilding buckets
// in ready order]), on real ranks: the layout rank 0's backward gives, the
// results against one process, and a rebuild that fails on one rank.
#include "test_util.h"

#include "catch_torch.h"

#include <gradaccum/detail/testing.h>

#include <set>

using namespace gradaccum;
using gradaccum::test::Chain;
using gradaccum::test::CountingGroup;
using gradaccum::test::flat;
using gradaccum::test::max_rel_diff;
using gradaccum::test::run_ranks;

namespace {

constexpr int64_t kChainRows = 4; // rows per micro-batch

} // namespace

TEST_CASE("buckets are rebuilt once in rank 0's backward order", "[reducer][distributed]") {
  // Rank 0 runs the layers in reverse (its gradients come in registration
  // order), rank 1 in registration order: after the first window both use rank
  // 0's order, and the gradients still equal one process on the global batch.
  const int64_t K = 2;
  const int windows = 3;
  for (bool as_view : {false, true}) {
    DYNAMIC_SECTION((as_view ? "bucket views" : "copies")) {
      torch::manual_seed(17);
      auto x = torch::randn({2 * K * windows * kChainRows, 8}, torch::kFloat64);
      // The reference: one process, both ranks' losses of each window.
      Chain ref;
      torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
      for (int w = 0; w < windows; ++w) {
        ref_opt.zero_grad();
        torch::Tensor total = torch::zeros({}, torch::kFloat64);
        for (int r = 0; r < 2; ++r) {
          for (int k = 0; k < K; ++k) {
            total = total + ref->forward(x.narrow(0, ((w * 2 + r) * K + k) * kChainRows, kChainRows), r == 0);
          }
        }
        (total / double(2 * K)).backward();
        ref_opt.step();
      }
      std::vector<at::Tensor> expected;
      for (auto& p : ref->parameters()) expected.push_back(p.detach().clone());

      std::vector<std::vector<size_t>> before(2), after(2);
      std::vector<std::vector<int64_t>> launched(2), rebuilds(2);
      std::vector<std::vector<at::Tensor>> results(2);
      // not vector<bool>: its bits share a word, and the rank threads write them
      std::vector<int> grads_kept(2, 0);
      run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
        Chain net;
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
        Accumulator acc(net, opt, AccumulatorOptions(K).process_group(group).reducer(
            ReducerOptions().bucket_cap_mb(0.0004).first_bucket_cap_mb(0.0004).gradient_as_bucket_view(as_view)));
        before[rank] = flat(acc.reducer()->buckets());
        for (int w = 0; w < windows; ++w) {
          for (int k = 0; k < K; ++k) {
            acc.backward(net->forward(x.narrow(0, ((w * 2 + rank) * K + k) * kChainRows, kChainRows), rank == 0));
            if (acc.window_ready()) {
              const auto stats = acc.stats().reducer;
              launched[rank].push_back(stats.last_window_launched_in_backward);
              rebuilds[rank].push_back(stats.bucket_rebuilds);
              if (w == 0) {
                // the rebuilt buckets hold the window's gradient: .grad is still it
                const auto p = net->parameters()[0];
                grads_kept[rank] = p.grad().defined() ? 1 : 0;
                if (as_view) {
                  const auto& buckets = acc.reducer()->buckets();
                  bool in_a_bucket = false;
                  for (const auto& b : buckets) {
                    in_a_bucket = in_a_bucket || (p.grad().data_ptr() >= b.buffer.data_ptr() &&
                        p.grad().data_ptr() < static_cast<char*>(b.buffer.data_ptr()) + b.buffer.nbytes());
                  }
                  grads_kept[rank] = (grads_kept[rank] && in_a_bucket) ? 1 : 0;
                }
              }
            }
            acc.step();
          }
          if (w == 0) after[rank] = flat(acc.reducer()->buckets());
        }
        RANK_CHECK(flat(acc.reducer()->buckets()) == after[rank]); // once only
        for (auto& p : net->parameters()) results[rank].push_back(p.detach().clone());
      });
      const std::vector<size_t> guess{7, 6, 5, 4, 3, 2, 1, 0};
      CHECK(before[0] == guess);
      CHECK(before[1] == guess);
      CHECK(after[0] == after[1]);
      // rank 0's backward: layer 0's gradients first, layer 3's last
      const std::set<size_t> first(after[0].begin(), after[0].begin() + 2), last(after[0].end() - 2, after[0].end());
      CHECK(first == std::set<size_t>{0, 1});
      CHECK(last == std::set<size_t>{6, 7});
      CHECK(rebuilds[0] == std::vector<int64_t>{1, 1, 1});
      CHECK(rebuilds[1] == std::vector<int64_t>{1, 1, 1});
      CHECK(grads_kept == std::vector<int>{1, 1});
      // rank 0: nothing overlapped before the rebuild, every bucket but the last after
      CHECK(launched[0][0] == 0);
      CHECK(launched[0][1] >= 2);
      CHECK(launched[0][2] == launched[0][1]);
      CHECK(launched[1][1] == 0); // rank 1 follows rank 0's order, not its own
      for (int r = 0; r < 2; ++r) {
        CHECK(max_rel_diff(results[r], expected) <= 1e-10);
      }
    }
  }
}

TEST_CASE("rebuild_buckets(false) keeps the registration-order buckets", "[reducer][distributed]") {
  std::vector<std::vector<size_t>> layouts(2);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    Chain net;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    Accumulator acc(net, opt, AccumulatorOptions(1).process_group(group).reducer(
        ReducerOptions().bucket_cap_mb(0.0004).first_bucket_cap_mb(0.0004).rebuild_buckets(false)));
    for (int w = 0; w < 2; ++w) {
      acc.backward(net->forward(torch::ones({2, 8}, torch::kFloat64), true));
      acc.step();
    }
    RANK_CHECK(acc.stats().reducer.bucket_rebuilds == 0);
    RANK_CHECK(acc.stats().reducer.last_window_launched_in_backward == 0);
    layouts[rank] = flat(acc.reducer()->buckets());
  });
  CHECK(layouts[0] == std::vector<size_t>{7, 6, 5, 4, 3, 2, 1, 0});
  CHECK(layouts[1] == layouts[0]);
}

TEST_CASE("a rebuild that fails on one rank keeps the old layout on every rank", "[reducer][distributed][errors]") {
  // The rebuild fails on one rank after it freed its old buckets, as if out
  // of memory: every rank keeps the first layout, that rank builds it again
  // (with its error-feedback residuals), and training goes on exactly as with
  // rebuild_buckets(false), bit for bit.
  const int64_t K = 2;
  const int windows = 3;
  torch::manual_seed(23);
  const auto x = torch::randn({2 * K * windows * kChainRows, 8}, torch::kFloat64);
  struct Mode {
    const char* name;
    bool as_view;
    std::optional<at::ScalarType> accumulate, comm;
    torch::Dtype dtype;
  };
  const std::vector<Mode> modes{{"copies", false, std::nullopt, std::nullopt, torch::kFloat64},
                                {"bucket views", true, std::nullopt, std::nullopt, torch::kFloat64},
                                {"wide sums", false, torch::kFloat64, std::nullopt, torch::kFloat32},
                                {"bf16 wire, error feedback", false, std::nullopt, torch::kBFloat16, torch::kFloat64}};
  for (const auto& mode : modes) {
    for (int failing : {0, 1}) {
      DYNAMIC_SECTION(mode.name << ", failing on rank " << failing) {
        // [rank][run]: run 0 with rebuild_buckets(false), run 1 with the failure
        std::vector<std::vector<std::vector<at::Tensor>>> results(2, std::vector<std::vector<at::Tensor>>(2));
        std::vector<std::vector<int64_t>> rebuilds(2, std::vector<int64_t>(2, -1));
        std::vector<std::vector<std::vector<size_t>>> layouts(2, std::vector<std::vector<size_t>>(2));
        for (int run = 0; run < 2; ++run) {
          if (run == 1) {
            gradaccum::detail::testing::failing_rebuild_builds = 1;
            gradaccum::detail::testing::fail_rebuild_on_rank = failing;
          }
          run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
            Chain net;
            net->to(mode.dtype);
            torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
            Accumulator acc(net, opt, AccumulatorOptions(K).process_group(group)
                .accumulate_dtype(mode.accumulate).comm_dtype(mode.comm).error_feedback(mode.comm.has_value())
                .reducer(ReducerOptions().bucket_cap_mb(0.0004).first_bucket_cap_mb(0.0004)
                    .gradient_as_bucket_view(mode.as_view).rebuild_buckets(run == 1)));
            for (int w = 0; w < windows; ++w) {
              for (int k = 0; k < K; ++k) {
                const auto rows = x.narrow(0, ((w * 2 + rank) * K + k) * kChainRows, kChainRows).to(mode.dtype);
                acc.backward(net->forward(rows, rank == 0));
              }
              RANK_CHECK(acc.step());
            }
            rebuilds[rank][run] = acc.stats().reducer.bucket_rebuilds;
            layouts[rank][run] = flat(acc.reducer()->buckets());
            for (auto& p : net->parameters()) results[rank][run].push_back(p.detach().clone());
          });
        }
        CHECK(gradaccum::detail::testing::fail_rebuild_on_rank == -1); // the failure was injected
        const std::vector<size_t> guess{7, 6, 5, 4, 3, 2, 1, 0};
        for (int rank = 0; rank < 2; ++rank) {
          CHECK(rebuilds[rank] == std::vector<int64_t>{0, 0});
          CHECK(layouts[rank][1] == guess);
          REQUIRE(results[rank][1].size() == results[rank][0].size());
          for (size_t i = 0; i < results[rank][0].size(); ++i) {
            CHECK(torch::equal(results[rank][1][i], results[rank][0][i]));
          }
        }
      }
    }
  }
}

TEST_CASE("a rank that cannot build its old buckets again after a failed rebuild raises at every call",
          "[reducer][distributed][errors]") {
  // Pathological: the old layout's memory was taken between its release and
  // its second build. That rank's window is still written back (its step
  // goes on); its next call raises, naming what happened.
  std::vector<std::string> errors(2);
  std::vector<int> stepped(2, 0);
  gradaccum::detail::testing::failing_rebuild_builds = 2;
  gradaccum::detail::testing::fail_rebuild_on_rank = 1;
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    Chain net;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    Accumulator acc(net, opt, AccumulatorOptions(1).process_group(group).reducer(
        ReducerOptions().bucket_cap_mb(0.0004).first_bucket_cap_mb(0.0004)));
    acc.backward(net->forward(torch::ones({2, 8}, torch::kFloat64), rank == 0));
    stepped[rank] = acc.step() ? 1 : 0;
    RANK_CHECK(acc.stats().reducer.bucket_rebuilds == 0);
    if (rank == 1) { // (rank 0 would wait for it in its next window's collectives)
      try {
        acc.backward(net->forward(torch::ones({2, 8}, torch::kFloat64), false));
      } catch (const c10::Error& e) {
        errors[rank] = e.what_without_backtrace();
      }
    }
  });
  CHECK(gradaccum::detail::testing::fail_rebuild_on_rank == -1);
  CHECK(stepped == std::vector<int>{1, 1});
  CHECK(errors[1] == "gradaccum: acc.backward(): after a failed bucket rebuild, allocating the old buckets again "
                     "failed on rank 1: injected bucket rebuild failure, so this rank cannot reduce again: end "
                     "training on every rank and resume from a checkpoint in new Accumulators");
}
