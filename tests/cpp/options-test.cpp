#include <gradaccum/options.h>

#include "catch_torch.h"

#include <cmath>

using namespace gradaccum;

TEST_CASE("options chain and keep their defaults", "[options]") {
  auto o = AccumulatorOptions(8).reduction(Reduction::Items).max_grad_norm(1.0);
  CHECK(o.steps() == 8);
  CHECK(o.reduction() == Reduction::Items);
  CHECK(o.nonfinite() == NonFinite::Skip);
  CHECK(*o.max_grad_norm() == 1.0);
  CHECK_FALSE(o.reducer().bucket_cap_mb().has_value()); // default_bucket_cap_bytes()
  CHECK(o.reducer().first_bucket_cap_mb() == 1.0);
  CHECK_FALSE(o.reducer().gradient_as_bucket_view());
  CHECK_NOTHROW(o.validate());
}

TEST_CASE("invalid options name the field and value", "[options][errors]") {
  CHECK_THROWS_WITH(AccumulatorOptions(0).validate(), Catch::Contains("invalid steps: 0"));
  CHECK_THROWS_WITH(AccumulatorOptions(-3).validate(), Catch::Contains("invalid steps: -3"));
  CHECK_THROWS_WITH(AccumulatorOptions(2).max_grad_norm(-1.0).validate(),
      Catch::Contains("invalid max_grad_norm: -1"));
  // 0 clipped every window to nothing, silently (review): None clips nothing.
  CHECK_THROWS_WITH(AccumulatorOptions(2).max_grad_norm(0.0).validate(),
      Catch::StartsWith("gradaccum: Accumulator(): invalid max_grad_norm: 0 (must be a finite number > 0: 0 would clip "
                    "every gradient to zero and train nothing; no max_grad_norm (None, C++ std::nullopt) clips "
                    "nothing)"));
  CHECK_THROWS_WITH(AccumulatorOptions(2).reducer(ReducerOptions().bucket_cap_mb(0)).validate(),
      Catch::Contains("invalid bucket_cap_mb"));
  CHECK_THROWS_AS(AccumulatorOptions(0).validate(), c10::ValueError);
  CHECK_THROWS_WITH(AccumulatorOptions(2).reduction(static_cast<Reduction>(9)).validate(),
      Catch::StartsWith("gradaccum: Accumulator(): invalid reduction: 9 names no Reduction"));
  CHECK_THROWS_WITH(AccumulatorOptions(2).nonfinite(static_cast<NonFinite>(-1)).validate(),
      Catch::StartsWith("gradaccum: Accumulator(): invalid nonfinite: -1 names no NonFinite mode"));
  // The external scaler (Python's GradScaler) is only compared across ranks:
  // a NaN would compare unequal on every rank and read "the ranks disagree".
  const auto external = [](LossScalerOptions s) { return AccumulatorOptions(2).external_loss_scaler(s); };
  CHECK_THROWS_WITH(external(LossScalerOptions().init_scale(NAN)).validate(),
      Catch::StartsWith("gradaccum: Accumulator(): invalid external_loss_scaler (Python: grad_scaler) init_scale: nan"));
  CHECK_THROWS_WITH(external(LossScalerOptions().growth_factor(NAN)).validate(),
      Catch::Contains("invalid external_loss_scaler (Python: grad_scaler) growth_factor: nan (the ranks compare it: not NaN)"));
  // What torch's GradScaler accepts, and a scaler-like object without getters (zeros), pass:
  CHECK_NOTHROW(external(LossScalerOptions().init_scale(-5).growth_factor(INFINITY).backoff_factor(-0.5)).validate());
  CHECK_NOTHROW(external(LossScalerOptions().backoff_factor(0).growth_interval(0)).validate());
  CHECK_NOTHROW(external(LossScalerOptions().init_scale(0).growth_factor(0).backoff_factor(0)).validate());
  CHECK_THROWS_WITH(AccumulatorOptions(2).loss_scaler(LossScalerOptions().growth_interval(0)).validate(),
      Catch::StartsWith("gradaccum: Accumulator(): invalid loss_scaler growth_interval: 0 (must be > 0)"));
}

TEST_CASE("names parse both ways", "[options]") {
  for (auto r : {Reduction::Mean, Reduction::Sum, Reduction::Items}) {
    CHECK(reduction_from_string(to_string(r)) == r);
  }
  for (auto n : {NonFinite::Skip, NonFinite::Raise, NonFinite::Ignore}) {
    CHECK(nonfinite_from_string(to_string(n)) == n);
  }
  CHECK_THROWS_WITH(reduction_from_string("avg"),
      Catch::StartsWith("gradaccum: reduction_from_string(): invalid reduction: 'avg'"));
  CHECK_THROWS_WITH(nonfinite_from_string("nan"),
      Catch::StartsWith("gradaccum: nonfinite_from_string(): invalid nonfinite: 'nan'"));
  CHECK_THROWS_WITH(reduction_from_string("avg", "Accumulator()"),
      Catch::StartsWith("gradaccum: Accumulator(): invalid reduction: 'avg'"));
}
