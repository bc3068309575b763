// The script's own optimizer step in the middle of a window, beside
// acc.step() (Note [A step of the script's own in the middle of a window]):
// C++ optimizers have no step hooks, so the parameters' versions tell it. One
// process refuses the next call, changing nothing more; data parallel the
// window is dropped on every rank, each told.
#include "test_util.h"

#include "catch_torch.h"

#include <string>
#include <vector>

using namespace gradaccum;
using gradaccum::test::CountingGroup;
using gradaccum::test::run_ranks;

namespace {

torch::Tensor loss_of(torch::nn::Sequential& net, const gradaccum::test::Data& d, int64_t row) {
  return torch::mse_loss(net->forward(d.x.narrow(0, row, 2)), d.y.narrow(0, row, 2));
}

std::vector<at::Tensor> values(torch::nn::Sequential& net) {
  return gradaccum::test::snapshot(net);
}

} // namespace

TEST_CASE("one process: the script's own optimizer.step() in the middle of a window is refused",
          "[accumulator][misuse]") {
  auto net = gradaccum::test::mlp();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(0.01));
  Accumulator acc(net.ptr(), opt, AccumulatorOptions(3));
  const auto d = gradaccum::test::data(16, torch::kFloat64);
  acc.backward(loss_of(net, d, 0));
  opt.step(); // a leftover of a plain loop: steps the partial sum
  const auto after_own = values(net);
  std::string error;
  try {
    acc.backward(loss_of(net, d, 2));
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  CHECK(error == "gradaccum: acc.backward(): the parameter 0.weight was changed in the middle of a window (1 of 3 "
                 "micro-steps done): by the script's own optimizer.step()? acc.step() steps the optimizer itself, "
                 "once per window, with the window's gradient: a step in between steps a partial sum. Remove the "
                 "script's optimizer.step(), or take the manual path (acc.no_sync() and a plain backward, stepping "
                 "the optimizer yourself). Nothing was stepped: drop the window with acc.zero_grad()");
  CHECK(acc.micro_step() == 1);
  // At a closed window: the script's step, then acc.step(), would step it twice.
  acc.zero_grad();
  for (int k = 0; k < 3; ++k) acc.backward(loss_of(net, d, 2 * k));
  REQUIRE(acc.window_ready());
  opt.step();
  const auto once = values(net);
  try {
    acc.step();
    error = "no error";
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  CHECK(error == "gradaccum: acc.step(): the parameter 0.weight was changed after the window closed, before "
                 "acc.step(): by the script's own optimizer.step()? acc.step() steps the optimizer itself, once per "
                 "window, with the window's gradient: a step of the closed window there and this one step it twice. "
                 "Remove the script's optimizer.step(), or take the manual path (acc.no_sync() and a plain backward, "
                 "stepping the optimizer yourself). Nothing was stepped: drop the window with acc.zero_grad()");
  const auto now = values(net);
  for (size_t i = 0; i < now.size(); ++i) CHECK(torch::equal(now[i], once[i])); // nothing stepped
  acc.zero_grad();
  acc.backward(loss_of(net, d, 0)); // a boundary: training goes on
  CHECK(acc.micro_step() == 1);
  (void)after_own;
}

TEST_CASE("torch::optim::SGD's own step is not seen: it writes through .data()", "[accumulator][misuse]") {
  // The documented limit (docs/design.md, Limits): libtorch's SGD updates
  // p.data(), whose version torch does not count. Should that change, this
  // fails: then the limit can go.
  auto net = gradaccum::test::mlp();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Accumulator acc(net.ptr(), opt, AccumulatorOptions(3));
  const auto d = gradaccum::test::data(16, torch::kFloat64);
  acc.backward(loss_of(net, d, 0));
  const auto before = values(net);
  opt.step();
  CHECK_FALSE(torch::equal(values(net)[0], before[0])); // it stepped...
  CHECK_NOTHROW(acc.backward(loss_of(net, d, 2)));      // ...unseen
}

TEST_CASE("data parallel: a rank's own optimizer.step() mid-window drops the window on every rank",
          "[accumulator][distributed][misuse]") {
  std::vector<std::string> errors(2);
  std::vector<int> stepped(2, 0);
  std::vector<std::vector<at::Tensor>> after(2);
  run_ranks(2, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    auto net = gradaccum::test::mlp();
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(0.01));
    Accumulator acc(net.ptr(), opt, AccumulatorOptions(2).process_group(group));
    const auto d = gradaccum::test::data(16, torch::kFloat64);
    try {
      for (int k = 0; k < 2; ++k) {
        acc.backward(loss_of(net, d, 4 * rank + 2 * k));
        if (rank == 1 && k == 0) opt.step(); // rank 1 alone
      }
      acc.step();
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
    stepped[rank] = static_cast<int>(acc.stats().optimizer_steps);
    after[rank] = values(net);
  });
  // The window closed on both ranks (no hang) and was dropped on both, each told.
  CHECK(stepped == std::vector<int>{0, 0});
  CHECK(errors[0].find("gradaccum: acc.backward(): window 0 was dropped on every rank: on rank 1 the accumulated "
                       "gradients were cleared or changed") == 0);
  CHECK(errors[0].find("or its parameters were changed in the middle of the window (the script's own "
                       "optimizer.step()? then the replicas differ: resume every rank from a checkpoint)") !=
        std::string::npos);
  CHECK(errors[1].find("on this rank the parameter 0.weight was changed in the middle of the window, by the script's "
                       "own optimizer.step()? acc.step() steps the optimizer once per window; the replicas now "
                       "differ") != std::string::npos);
}
