// Real multi-rank tests of failures around a micro-step's own code: a C++
// forward that throws on one rank (end_micro_step), and a rank told to end
// training inside join(). Every rank must raise alike or recover alike; one
// thread per rank, each with its own Gloo group over loopback.
#include "test_util.h"

#include "catch_torch.h"

using namespace gradaccum;
using gradaccum::test::CountingGroup;
using gradaccum::test::run_ranks;

TEST_CASE("a C++ forward that throws on one rank fails its micro-step with end_micro_step", "[reducer][distributed][errors]") {
  // docs/integrations.md, C++: rank 1's forward throws before its backward()
  // (window 1, a no_sync micro-step; window 2, the closing one). It fails the
  // micro-step with end_micro_step(true): both windows are dropped on both
  // ranks, each rank raises at the window's close naming rank 1, and the
  // windows that count equal one process on their micro-batches (float64).
  constexpr int kSteps = 3;
  const auto x_of = [](int rank, int w, int k) {
    return torch::full({2, 6}, 0.1 * double(1 + w + 2 * k + 5 * rank), torch::kFloat64);
  };
  const auto throws = [](int rank, int w, int k) { return rank == 1 && ((w == 1 && k == 0) || (w == 2 && k == 2)); };
  std::vector<std::vector<std::string>> errors(2);
  std::vector<std::vector<at::Tensor>> results(2);
  std::vector<int64_t> dropped(2), stepped(2);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    auto net = gradaccum::test::mlp();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    Accumulator acc(net, opt, AccumulatorOptions(kSteps).process_group(group));
    for (int w = 0; w < 4; ++w) {
      for (int k = 0; k < kSteps; ++k) {
        const auto before = acc.progress_marker();
        try {
          if (throws(rank, w, k)) throw std::runtime_error("a bad sample");
          acc.backward(net->forward(x_of(rank, w, k)).pow(2).mean());
          acc.step();
        } catch (const std::exception& e) {
          const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
          errors[rank].push_back(std::to_string(w) + "/" + std::to_string(k) + ": " +
                                 (c10_error ? c10_error->what_without_backtrace() : e.what()));
          if (acc.progress_marker() == before) {
            try {
              acc.end_micro_step(/*failed=*/true);
            } catch (const c10::Error& again) {
              errors[rank].push_back(std::to_string(w) + "/" + std::to_string(k) + " end: " +
                                     again.what_without_backtrace());
            }
          }
        }
      }
    }
    dropped[rank] = acc.stats().reducer.dropped_windows;
    stepped[rank] = acc.stats().optimizer_steps;
    for (auto& p : net->parameters()) results[rank].push_back(p.detach().clone());
  });
  INFO(errors[0].size() << " " << errors[1].size());
  REQUIRE(errors[0].size() == 2);
  CHECK_THAT(errors[0][0], Catch::StartsWith("1/2: gradaccum: acc.backward(): window 1 was dropped on every rank") &&
                               Catch::Contains("rank 1"));
  CHECK_THAT(errors[0][1], Catch::StartsWith("2/2: gradaccum: acc.backward(): window 2 was dropped on every rank") &&
                               Catch::Contains("rank 1"));
  REQUIRE(errors[1].size() == 4);
  CHECK(errors[1][0] == "1/0: a bad sample");
  CHECK_THAT(errors[1][1], Catch::StartsWith("1/2: gradaccum: acc.backward(): window 1 was dropped on every rank"));
  CHECK(errors[1][2] == "2/2: a bad sample");
  CHECK_THAT(errors[1][3], Catch::StartsWith("2/2 end: gradaccum: acc.end_micro_step(): window 2 was dropped on every "
                                             "rank"));
  CHECK(dropped == std::vector<int64_t>{2, 2});
  CHECK(stepped == std::vector<int64_t>{2, 2});
  // One process over windows 0 and 3 (the mean of 2 * kSteps micro-batches each).
  auto net = gradaccum::test::mlp();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  for (int w : {0, 3}) {
    opt.zero_grad();
    at::Tensor loss;
    for (int rank = 0; rank < 2; ++rank) {
      for (int k = 0; k < kSteps; ++k) {
        auto l = net->forward(x_of(rank, w, k)).pow(2).mean() / double(2 * kSteps);
        loss = loss.defined() ? loss + l : l;
      }
    }
    loss.backward();
    opt.step();
  }
  for (size_t i = 0; i < results[0].size(); ++i) {
    CHECK(torch::equal(results[0][i], results[1][i]));
    CHECK(torch::allclose(results[0][i], net->parameters()[i].detach(), 1e-13, 1e-15));
  }
}

TEST_CASE("a rank told to end training inside join() runs no micro-step and shadows nothing", "[reducer][distributed][errors][join]") {
  // Note [Training ended in join()]: K=2; rank 0 has one window and shadows,
  // rank 2's closing backward of window 2 throws, so that window is dropped
  // on every rank telling every rank to end training. Ranks 1 and 2 catch
  // the error and go on: their last micro-batches are refused (before, they
  // made a window that paired with rank 0's next epoch) and join() returns at
  // once. The next, even epoch pairs; every window equals one process.
  constexpr int kSteps = 2;
  const auto x_of = [](int rank, int epoch, int i) {
    return torch::full({2, 6}, 0.05 * double(1 + i + 3 * rank + 11 * epoch), torch::kFloat64);
  };
  std::vector<std::vector<std::string>> errors(3);
  std::vector<std::vector<at::Tensor>> results(3);
  std::vector<int64_t> joined_steps(3), allreduces(3);
  run_ranks(3, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    auto net = gradaccum::test::mlp();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    Accumulator acc(net, opt, AccumulatorOptions(kSteps).process_group(group));
    bool arm = false;
    net->parameters()[0].register_hook([&arm](torch::Tensor g) {
      if (arm) throw std::runtime_error("injected failure");
      return g;
    });
    const auto record = [&](const std::string& where, const std::exception& e) {
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      errors[rank].push_back(where + ": " + (c10_error ? c10_error->what_without_backtrace() : e.what()));
    };
    for (int i = 0; i < (rank == 0 ? 2 : 8); ++i) {
      try {
        arm = rank == 2 && i == 5;
        acc.backward(net->forward(x_of(rank, 0, i)).pow(2).mean());
        acc.step();
      } catch (const std::exception& e) {
        record(std::to_string(i), e);
      }
      arm = false;
    }
    try {
      joined_steps[rank] = acc.join();
    } catch (const std::exception& e) {
      record("join", e);
    }
    for (int i = 0; i < kSteps; ++i) { // the next epoch: every rank, one window
      acc.backward(net->forward(x_of(rank, 1, i)).pow(2).mean());
      acc.step();
    }
    acc.join();
    allreduces[rank] = group->allreduces;
    for (auto& p : net->parameters()) results[rank].push_back(p.detach().clone());
  });
  const std::string told = "the last reduction dropped its window on every rank and told every rank to end training "
                           "there (ranks were shadowing in acc.join(), one left its block with an exception, or one "
                           "was interrupted): end training on this rank too; inside acc.join(), let that error leave "
                           "its block (C++: call acc.join(), which returns at once). Nothing was changed";
  REQUIRE(errors[0].size() == 1);
  CHECK_THAT(errors[0][0], Catch::StartsWith("join: gradaccum: acc.join(): window 2 was dropped on every rank"));
  for (int rank : {1, 2}) {
    INFO("rank " << rank);
    REQUIRE(errors[rank].size() == 3);
    CHECK_THAT(errors[rank][0], Catch::StartsWith("5: gradaccum: acc.backward(): window 2 was dropped on every rank"));
    CHECK(errors[rank][1] == "6: gradaccum: acc.backward(): " + told);
    CHECK(errors[rank][2] == "7: gradaccum: acc.backward(): " + told);
    CHECK(joined_steps[rank] == 0);
  }
  CHECK(allreduces[0] == allreduces[1]);
  CHECK(allreduces[1] == allreduces[2]);
  // One process: epoch 0's windows 0 (every rank) and 1 (ranks 1 and 2),
  // then epoch 1's window; each the mean over the micro-batches it holds.
  auto net = gradaccum::test::mlp();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  const std::vector<std::vector<std::tuple<int, int, int>>> windows = {
      {{0, 0, 0}, {0, 0, 1}, {1, 0, 0}, {1, 0, 1}, {2, 0, 0}, {2, 0, 1}},
      {{1, 0, 2}, {1, 0, 3}, {2, 0, 2}, {2, 0, 3}},
      {{0, 1, 0}, {0, 1, 1}, {1, 1, 0}, {1, 1, 1}, {2, 1, 0}, {2, 1, 1}}};
  for (const auto& window : windows) {
    opt.zero_grad();
    at::Tensor loss;
    for (const auto& [r, e, i] : window) {
      auto l = net->forward(x_of(r, e, i)).pow(2).mean() / double(window.size());
      loss = loss.defined() ? loss + l : l;
    }
    loss.backward();
    opt.step();
  }
  for (size_t i = 0; i < results[0].size(); ++i) {
    CHECK(torch::equal(results[0][i], results[1][i]));
    CHECK(torch::equal(results[0][i], results[2][i]));
    CHECK(torch::allclose(results[0][i], net->parameters()[i].detach(), 1e-13, 1e-15));
  }
}
