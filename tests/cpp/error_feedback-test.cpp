// Error feedback under the built-in loss scaler, on two Gloo ranks (Note
// [Error feedback across loss scales]): what the optimizer got over the
// windows plus what the ranks hold back is the float32 wire's sum. And
// windows far lighter than their fp16 wire's scale, sent again at their own
// (Note [Re-sending a light window]), and dropped on every rank where one
// rank cannot round it again.
#include "test_util.h"

#include "catch_torch.h"

#include <gradaccum/detail/testing.h>

using namespace gradaccum;
using gradaccum::test::CountingGroup;
using gradaccum::test::run_ranks;

namespace {

constexpr int64_t kFeedbackRows = 32;
constexpr int64_t kFeedbackSteps = 2;
constexpr int kFeedbackWindows = 5;

struct FeedbackRun {
  std::vector<at::Tensor> got; ///< each window's gradient, as the optimizer saw it
  std::vector<at::Tensor> held; ///< rank 0's residual after each window
  std::vector<double> scale; ///< the loss scale after each window
};

// Rank 0's gradients only: rank 1's inputs are zeros (no bias), so the bf16
// sum over ranks rounds nothing and only compression loses.
FeedbackRun feedback_run(int rank, const c10::intrusive_ptr<CountingGroup>& group,
                         std::optional<at::ScalarType> comm, bool feedback) {
  torch::nn::Linear model{nullptr};
  {
    std::lock_guard<std::mutex> lock(gradaccum::test::init_mutex()); // (the seed is global)
    torch::manual_seed(0);
    model = torch::nn::Linear(torch::nn::LinearOptions(16, 1).bias(false));
  }
  FeedbackRun run;
  auto step = [&] { run.got.push_back(model->weight.grad().reshape(-1).clone()); };
  Accumulator acc(model, AccumulatorOptions(kFeedbackSteps).process_group(group).comm_dtype(comm)
                             .error_feedback(feedback)
                             .loss_scaler(LossScalerOptions().init_scale(256).growth_interval(1)),
                  step);
  for (int w = 0; w < kFeedbackWindows; ++w) {
    for (int k = 0; k < kFeedbackSteps; ++k) {
      auto g = at::detail::createCPUGenerator(1000 * w + 10 * k);
      auto x = torch::randn({kFeedbackRows, 16}, g);
      auto y = torch::randn({kFeedbackRows, 1}, g);
      if (rank != 0) {
        x = torch::zeros_like(x);
      }
      acc.backward((model->forward(x) - y).pow(2).mean());
      acc.step();
    }
    if (feedback) {
      const auto state = acc.state_dict(/*rank_independent=*/false);
      run.held.push_back(state.residuals.at(0).reshape(-1).clone());
    }
    run.scale.push_back(acc.stats().loss_scale.value());
  }
  return run;
}

double relative(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).norm() / b.norm()).item<double>();
}

} // namespace

TEST_CASE("error feedback follows the built-in loss scaler's growth", "[reducer][distributed][loss_scaler]") {
  const int world = 2;
  std::vector<FeedbackRun> fp32(world), bf16(world), ef(world);
  run_ranks(world, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    fp32[rank] = feedback_run(rank, group, std::nullopt, false);
    bf16[rank] = feedback_run(rank, group, at::kBFloat16, false);
    ef[rank] = feedback_run(rank, group, at::kBFloat16, true);
  });
  at::Tensor got, want, plain;
  for (int w = 0; w < kFeedbackWindows; ++w) {
    // The scale doubles after every window.
    CHECK(ef[0].scale[w] == 256.0 * std::pow(2.0, w + 1));
    CHECK(ef[1].held[w].abs().max().item<double>() == 0);
    got = w == 0 ? ef[0].got[w] : got + ef[0].got[w];
    want = w == 0 ? fp32[0].got[w] : want + fp32[0].got[w];
    plain = w == 0 ? bf16[0].got[w] : plain + bf16[0].got[w];
    // A residual is in units of the next window's scaled gradients (the loss
    // scaled by the scale / steps), over the window's global weight: the
    // micro-steps of every rank.
    const auto held_back = ef[0].held[w] * kFeedbackSteps / (ef[0].scale[w] * world * kFeedbackSteps);
    CHECK(relative(got + held_back, want) < 1e-6);
    CHECK(relative(plain, want) > 1e-4); // bf16 alone loses what it rounds
  }
  CHECK(ef[0].held.back().abs().max().item<double>() > 0);
}

TEST_CASE("rescale_residuals() takes one floating-point ratio", "[accumulator][loss_scaler][errors]") {
  torch::nn::Linear model(2, 1);
  Accumulator acc(model, AccumulatorOptions(2));
  const std::string what = "gradaccum: acc.rescale_residuals(): the ratio must be a one-element floating-point tensor";
  CHECK_THROWS_WITH(acc.rescale_residuals(torch::ones({2})), Catch::StartsWith(what + ", got a Float tensor of 2 elements"));
  CHECK_THROWS_WITH(acc.rescale_residuals(torch::ones({1}, torch::kLong)),
                    Catch::StartsWith(what + ", got a Long tensor of 1 element"));
  CHECK_THROWS_WITH(acc.rescale_residuals(at::Tensor()), Catch::StartsWith(what + ", got an undefined one"));
  acc.rescale_residuals(torch::full({1}, 2.0)); // one process keeps no residual: nothing
}

namespace {

constexpr int64_t kLightSteps = 64;

struct LightRun {
  std::vector<at::Tensor> got; ///< each window's gradient, as the optimizer saw it
  std::vector<int> allreduces; ///< each window's all-reduces, counted by the group
  std::vector<int64_t> counted; ///< each window's, as stats() says
  std::vector<bool> stepped; ///< what each window's step() or flush() returned
  at::Tensor held; ///< rank 0's residual after the first window
};

// Windows of 1, 64 and 1 micro-steps (the short ones closed by flush()):
// with an fp16 wire scaled for 2 * 64, the short ones weigh 64 times less.
// Rank 1's inputs are zeros, so only rank 0's rounding loses anything; one
// micro-step's gradient sits in fp16's subnormal range once divided by 128.
LightRun light_run(int rank, const c10::intrusive_ptr<CountingGroup>& group, std::optional<at::ScalarType> comm,
                   bool feedback) {
  torch::nn::Linear model{nullptr};
  {
    std::lock_guard<std::mutex> lock(gradaccum::test::init_mutex()); // (the seed is global)
    torch::manual_seed(1);
    model = torch::nn::Linear(torch::nn::LinearOptions(64, 1).bias(false));
  }
  LightRun run;
  auto step = [&] { run.got.push_back(model->weight.grad().reshape(-1).clone()); };
  Accumulator acc(model, AccumulatorOptions(kLightSteps).process_group(group).comm_dtype(comm)
                             .error_feedback(feedback), step);
  int seed = 0;
  for (const int64_t micro : {int64_t{1}, kLightSteps, int64_t{1}}) {
    const int before = group->allreduces.load();
    for (int64_t k = 0; k < micro; ++k) {
      auto g = at::detail::createCPUGenerator(++seed);
      auto x = torch::randn({8, 64}, g);
      if (rank != 0) {
        x = torch::zeros_like(x);
      }
      acc.backward(model->forward(x).pow(2).mean() * 1e-3);
    }
    // (checked on the main thread: Catch2's assertions are not thread-safe)
    run.stepped.push_back(micro < kLightSteps ? acc.flush() : acc.step());
    run.allreduces.push_back(group->allreduces.load() - before);
    run.counted.push_back(acc.stats().reducer.last_window_collectives);
    if (feedback && run.held.numel() == 0) {
      run.held = acc.state_dict(/*rank_independent=*/false).residuals.at(0).reshape(-1).clone();
    }
  }
  return run;
}

} // namespace

TEST_CASE("a window far lighter than its fp16 wire's scale is sent again at its own",
          "[reducer][distributed][comm_dtype]") {
  const int world = 2;
  std::vector<LightRun> fp32(world), fp16(world), ef(world), bf16(world);
  run_ranks(world, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    fp32[rank] = light_run(rank, group, std::nullopt, false);
    fp16[rank] = light_run(rank, group, at::kHalf, false);
    ef[rank] = light_run(rank, group, at::kHalf, true);
    bf16[rank] = light_run(rank, group, at::kBFloat16, false);
  });
  for (int rank = 0; rank < world; ++rank) {
    for (const auto* run : {&fp32[rank], &fp16[rank], &ef[rank], &bf16[rank]}) {
      CHECK(run->stepped == std::vector<bool>{true, true, true});
    }
    // One bucket: the light windows' second all-reduce, the full one's none.
    CHECK(fp16[rank].allreduces == std::vector<int>{2, 1, 2});
    CHECK(fp16[rank].counted == std::vector<int64_t>{2, 1, 2});
    CHECK(ef[rank].allreduces == std::vector<int>{2, 1, 2});
    CHECK(bf16[rank].allreduces == std::vector<int>{1, 1, 1}); // float32's range: never re-sent
    CHECK(fp32[rank].allreduces == std::vector<int>{1, 1, 1});
  }
  for (int w = 0; w < 3; ++w) {
    INFO("window " << w);
    // fp16's own rounding (2^-11), not the subnormal range's: about 2e-4 in
    // each window, where the light ones, sent at E = 128, erred by 3.2e-3
    // and 4.3e-3 (bf16 by 1.5e-3 to 1.8e-3).
    CHECK(relative(fp16[0].got[w], fp32[0].got[w]) < std::ldexp(1.0, -11));
    CHECK(relative(fp16[1].got[w], fp16[0].got[w]) == 0);
  }
  // Error feedback keeps what the second rounding lost: with it, the first
  // window is the float32 one (the optimizer divided by the window's weight, 2).
  CHECK(relative(ef[0].got[0] + ef[0].held / 2, fp32[0].got[0]) < 1e-6);
  CHECK(ef[0].held.abs().max().item<double>() > 0);
  CHECK(relative(ef[0].got[2], fp32[0].got[2]) < std::ldexp(1.0, -11));
}

TEST_CASE("a rank that cannot round a light window again drops it on every rank", "[reducer][distributed][errors]") {
  // Note [Re-sending a light window]: rank 1 fails to round its part for the
  // second all-reduce (as if out of memory). It sends zeros and the drop's
  // flag, so the pairing holds: the window is dropped on every rank, each
  // told, and the next windows train (the full one, and a light one re-sent).
  const int world = 2;
  std::vector<std::vector<std::string>> errors(world);
  std::vector<std::vector<bool>> stepped(world);
  gradaccum::detail::testing::fail_resend_on_rank = 1;
  run_ranks(world, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    torch::nn::Linear model{nullptr};
    {
      std::lock_guard<std::mutex> lock(gradaccum::test::init_mutex());
      torch::manual_seed(1);
      model = torch::nn::Linear(torch::nn::LinearOptions(64, 1).bias(false));
    }
    auto noop = [] {};
    Accumulator acc(model, AccumulatorOptions(kLightSteps).process_group(group).comm_dtype(at::kHalf), noop);
    int seed = 0;
    for (const int64_t micro : {int64_t{1}, kLightSteps, int64_t{1}}) {
      for (int64_t k = 0; k < micro; ++k) {
        auto g = at::detail::createCPUGenerator(++seed);
        acc.backward(model->forward(torch::randn({8, 64}, g)).pow(2).mean() * 1e-3);
      }
      try {
        stepped[rank].push_back(micro < kLightSteps ? acc.flush() : acc.step());
      } catch (const c10::Error& e) {
        errors[rank].push_back(e.what_without_backtrace());
        stepped[rank].push_back(false);
      }
    }
  });
  CHECK(gradaccum::detail::testing::fail_resend_on_rank == -1); // injected
  for (int rank = 0; rank < world; ++rank) {
    CHECK(stepped[rank] == std::vector<bool>{false, true, true});
    REQUIRE(errors[rank].size() == 1);
  }
  const std::string what = "could not round its part of the window again for the float16 wire's second all-reduce";
  INFO(errors[0][0] << "\n" << errors[1][0]);
  CHECK(errors[0][0].rfind("gradaccum: acc.flush(): window 0 was dropped on every rank: rank 1 " + what, 0) == 0);
  CHECK(errors[1][0].rfind("gradaccum: acc.flush(): window 0 was dropped on every rank: this rank (rank 1) " + what,
                           0) == 0);
  CHECK(errors[1][0].find("injected resend failure") != std::string::npos);
}
