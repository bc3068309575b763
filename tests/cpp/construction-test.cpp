// Building an Accumulator or Reducer over a group is a collective: a rank that
// refuses to build tells the others in the first one (Note [Construction
// refused on one rank], src/rank_check.cpp), so every rank raises at once, the
// others naming the refusing rank, as the same kind of error; the group still
// pairs afterwards. Real Gloo groups, one thread per rank.
#include "test_util.h"

#include "catch_torch.h"

#include <string>

using namespace gradaccum;
using gradaccum::test::CountingGroup;
using gradaccum::test::run_ranks;

namespace {

enum class Kind { None, Value, Type, Other };

struct Outcome {
  Kind kind = Kind::None;
  std::string message;
};

template <typename Body>
Outcome outcome_of(Body&& body) {
  try {
    body();
  } catch (const c10::ValueError& e) {
    return {Kind::Value, e.what_without_backtrace()};
  } catch (const c10::TypeError& e) {
    return {Kind::Type, e.what_without_backtrace()};
  } catch (const c10::Error& e) {
    return {Kind::Other, e.what_without_backtrace()};
  }
  return {};
}

// After the refusal: one window of 2 micro-steps on every rank, through the
// same group. Returns the first layer's weight after the step.
at::Tensor train_one_window(int rank, const c10::intrusive_ptr<CountingGroup>& group) {
  auto net = gradaccum::test::mlp();
  torch::optim::SGD opt(net->parameters(), 0.1);
  Accumulator acc(net.ptr(), opt, AccumulatorOptions(2).process_group(group));
  for (int k = 0; k < 2; ++k) {
    acc.backward(net->forward(torch::full({2, 6}, double(rank + k), torch::kFloat64)).pow(2).mean());
    acc.step();
  }
  return net->parameters()[0].detach().clone();
}

// A check of the caller's own that fails: told to the others, then raised.
[[noreturn]] void refuse_by_hand(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::string& text) {
  const c10::TypeError why({"test", __FILE__, __LINE__}, text);
  refuse_construction(group, why);
  throw why;
}

// On `world` ranks: each rank's outcome of build(rank, group, net, opt),
// then one window trained by every rank through the same group (its first
// layer's weight after the step), checked against reference_after().
struct Built {
  std::vector<Outcome> outcomes;
  std::vector<at::Tensor> after;
};

// What train_one_window() gives on `world` ranks: one process, SGD on the
// mean of every rank's micro-batch losses, in float64.
at::Tensor reference_after(int world) {
  auto net = gradaccum::test::mlp();
  auto loss = torch::zeros({}, torch::kFloat64);
  for (int r = 0; r < world; ++r) {
    for (int k = 0; k < 2; ++k) {
      loss = loss + net->forward(torch::full({2, 6}, double(r + k), torch::kFloat64)).pow(2).mean();
    }
  }
  (loss / (world * 2)).backward();
  const auto w = net->parameters()[0];
  return (w - 0.1 * w.grad()).detach();
}

template <typename Build>
Built build_on_ranks(int world, Build&& build) {
  Built out{std::vector<Outcome>(world), std::vector<at::Tensor>(world)};
  run_ranks(world, [&](int rank, c10::intrusive_ptr<CountingGroup> group) {
    auto net = gradaccum::test::mlp();
    torch::optim::SGD opt(net->parameters(), 0.1);
    out.outcomes[rank] = outcome_of([&] { build(rank, group, net, opt); });
    out.after[rank] = train_one_window(rank, group);
  });
  // The group still pairs: every rank's window is the big batch's.
  const auto expected = reference_after(world);
  for (const auto& after : out.after) {
    CHECK(gradaccum::test::max_rel_diff({after}, {expected}) <= 1e-12);
  }
  return out;
}

} // namespace

TEST_CASE("one rank refusing to build an Accumulator raises on every rank", "[construction][distributed]") {
  const auto got = build_on_ranks(2, [](int rank, auto group, auto& net, auto& opt) {
    Accumulator acc(net.ptr(), opt, AccumulatorOptions(rank == 1 ? 0 : 2).process_group(group));
  }).outcomes;
  const std::string own = "gradaccum: Accumulator(): invalid steps: 0 (must be a positive integer)";
  CHECK(got[1].kind == Kind::Value);
  CHECK(got[1].message == own);
  CHECK(got[0].kind == Kind::Value);
  CHECK(got[0].message == "gradaccum: Accumulator(): rank 1 refused, so every rank raises (rank 1 its "
                          "own error): invalid steps: 0 (must be a positive integer)");
}

TEST_CASE("a Reducer that one rank refuses raises on every rank", "[construction][distributed]") {
  const auto got = build_on_ranks(3, [](int rank, auto group, auto& net, auto&) {
    auto params = net->parameters();
    if (rank == 2) {
      params[0] = params[0] * 2; // not a leaf
    }
    Reducer reducer(params, group);
  }).outcomes;
  CHECK(got[2].kind == Kind::Value);
  CHECK(got[2].message == "gradaccum: Reducer(): parameter 0 must be a leaf tensor that requires grad");
  for (int r = 0; r < 2; ++r) {
    CHECK(got[r].kind == Kind::Value);
    CHECK(got[r].message == "gradaccum: Accumulator(): rank 2 refused, so every rank raises (rank 2 its "
                            "own error): Reducer(): parameter 0 must be a leaf tensor that "
                            "requires grad");
  }
}

TEST_CASE("refuse_construction() tells the other ranks a check of the caller's own", "[construction][distributed]") {
  const auto got = build_on_ranks(2, [](int rank, auto group, auto& net, auto& opt) {
    if (rank == 0) {
      refuse_by_hand(group, "my_trainer: the model config is not a dict");
    }
    Accumulator acc(net.ptr(), opt, AccumulatorOptions(2).process_group(group));
  }).outcomes;
  CHECK(got[0].kind == Kind::Type);
  CHECK(got[1].kind == Kind::Type);
  CHECK(got[1].message == "gradaccum: Accumulator(): rank 0 refused, so every rank raises (rank 0 its "
                          "own error): my_trainer: the model config is not a dict");
}

TEST_CASE("check_parameters that differs across ranks is refused on every rank", "[construction][distributed]") {
  const auto got = build_on_ranks(2, [](int rank, auto group, auto& net, auto& opt) {
    Accumulator acc(net.ptr(), opt,
        AccumulatorOptions(2).process_group(group).reducer(ReducerOptions().check_parameters(rank == 0)));
  }).outcomes;
  for (const auto& outcome : got) {
    CHECK(outcome.kind == Kind::Value);
    CHECK(outcome.message == "gradaccum: Accumulator(): check_parameters differs across ranks: true on rank 0; "
                             "false on rank 1; the ranks would run different construction collectives. Pass the "
                             "same value on every rank");
  }
}

TEST_CASE("ranks whose steps treat the window differently are refused on every rank", "[construction][distributed]") {
  // A clip, a non-finite policy or a loss scale on one rank only would step
  // another gradient there (a scaled and an unscaled rank sum different units).
  const auto loss_scale = build_on_ranks(2, [](int rank, auto group, auto& net, auto& opt) {
    auto options = AccumulatorOptions(2).process_group(group);
    if (rank == 1) {
      options.loss_scaler(LossScalerOptions().init_scale(1024));
    }
    Accumulator acc(net.ptr(), opt, options);
  }).outcomes;
  const auto clip = build_on_ranks(2, [](int rank, auto group, auto& net, auto& opt) {
    Accumulator acc(net.ptr(), opt, AccumulatorOptions(2).process_group(group).max_grad_norm(
        rank == 0 ? std::optional<double>(0.5) : std::nullopt));
  }).outcomes;
  const auto growth = build_on_ranks(2, [](int rank, auto group, auto& net, auto& opt) {
    Accumulator acc(net.ptr(), opt, AccumulatorOptions(2).process_group(group).loss_scaler(
        LossScalerOptions().growth_interval(rank == 0 ? 2000 : 100)));
  }).outcomes;
  for (const auto rank : {0, 1}) {
    CHECK(loss_scale[rank].kind == Kind::Value);
    CHECK(loss_scale[rank].message == "gradaccum: Accumulator(): the ranks disagree on the loss scale (grad_scaler's "
        "or loss_scaler's scale; None: no loss scaling) (rank 0: None, rank 1: 1024); every rank must scale its "
        "loss alike: the same grad_scaler settings (enabled, init_scale) and the same scaler state (load it on "
        "every rank)");
    CHECK(clip[rank].kind == Kind::Value);
    CHECK(clip[rank].message == "gradaccum: Accumulator(): the ranks disagree on max_grad_norm (rank 0: 0.5, rank 1: "
        "None); every rank must build its Accumulator with the same options and model");
    CHECK(growth[rank].kind == Kind::Value);
    CHECK_THAT(growth[rank].message, Catch::Contains("the ranks disagree on the loss scaler's growth_interval "
        "(rank 0: 2000, rank 1: 100)"));
  }
}

TEST_CASE("several refusing ranks: the lowest one's error, the others counted", "[construction][distributed]") {
  const auto got = build_on_ranks(4, [](int rank, auto group, auto& net, auto& opt) {
    if (rank == 1) {
      refuse_by_hand(group, "");
    }
    Accumulator acc(net.ptr(), opt, AccumulatorOptions(rank >= 2 ? 0 : 2).process_group(group));
  }).outcomes;
  CHECK(got[0].kind == Kind::Type); // rank 1's kind, though ranks 2 and 3 raise ValueErrors
  CHECK(got[0].message == "gradaccum: Accumulator(): rank 1 refused (as did 2 more ranks), so every rank raises "
                          "(rank 1 its own error): (no message)");
  CHECK(got[1].kind == Kind::Type);
  for (int r = 2; r < 4; ++r) {
    CHECK(got[r].kind == Kind::Value);
    CHECK(got[r].message == "gradaccum: Accumulator(): invalid steps: 0 (must be a positive integer)");
  }
}
