#include <gradaccum/options.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

namespace gradaccum {

Reduction reduction_from_string(const std::string& name, const char* call) {
  if (name == "mean") return Reduction::Mean;
  if (name == "sum") return Reduction::Sum;
  if (name == "items") return Reduction::Items;
  TORCH_CHECK_VALUE(false,
      "gradaccum: ", call, ": invalid reduction: '", name, "' (expected 'mean', 'sum' or 'items')");
}

std::string to_string(Reduction reduction) {
  switch (reduction) {
    case Reduction::Mean: return "mean";
    case Reduction::Sum: return "sum";
    case Reduction::Items: return "items";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Reduction");
}

NonFinite nonfinite_from_string(const std::string& name, const char* call) {
  if (name == "skip") return NonFinite::Skip;
  if (name == "raise") return NonFinite::Raise;
  if (name == "ignore") return NonFinite::Ignore;
  if (name == "skip_micro_batch") return NonFinite::SkipMicroBatch;
  TORCH_CHECK_VALUE(false,
      "gradaccum: ", call, ": invalid nonfinite: '", name,
      "' (expected 'skip', 'raise', 'ignore' or 'skip_micro_batch')");
}

std::string to_string(NonFinite mode) {
  switch (mode) {
    case NonFinite::Skip: return "skip";
    case NonFinite::Raise: return "raise";
    case NonFinite::Ignore: return "ignore";
    case NonFinite::SkipMicroBatch: return "skip_micro_batch";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown NonFinite");
}

void ReducerOptions::validate() const {
  TORCH_CHECK_VALUE(!bucket_cap_mb_ || (std::isfinite(*bucket_cap_mb_) && *bucket_cap_mb_ > 0),
      "gradaccum: Accumulator(): invalid bucket_cap_mb: ", bucket_cap_mb_.value_or(0),
      " (must be > 0, or unset/None for the default)");
  TORCH_CHECK_VALUE(std::isfinite(first_bucket_cap_mb_) && first_bucket_cap_mb_ > 0,
      "gradaccum: Accumulator(): invalid first_bucket_cap_mb: ", first_bucket_cap_mb_, " (must be > 0)");
}

namespace {

// `which`: the option's name in the message. An external scaler (Python's
// GradScaler, or an object like one) is only compared across ranks: any
// value passes (torch checks GradScaler's own; a scaler-like object reads 0
// where it has no getter) but NaN, which would compare unequal on every rank
// and read "the ranks disagree".
void validate_scaler(const LossScalerOptions& o, const char* which, bool external) {
  if (external) {
    for (const auto& [name, value] : {std::pair<const char*, double>{"init_scale", o.init_scale()},
                                      {"growth_factor", o.growth_factor()},
                                      {"backoff_factor", o.backoff_factor()}}) {
      TORCH_CHECK_VALUE(!std::isnan(value),
          "gradaccum: Accumulator(): invalid ", which, " ", name, ": ", value, " (the ranks compare it: not NaN)");
    }
    return;
  }
  TORCH_CHECK_VALUE(std::isfinite(o.init_scale()) && o.init_scale() > 0,
      "gradaccum: Accumulator(): invalid ", which, " init_scale: ", o.init_scale(), " (must be a finite number > 0)");
  TORCH_CHECK_VALUE(std::isfinite(o.growth_factor()) && o.growth_factor() > 1,
      "gradaccum: Accumulator(): invalid ", which, " growth_factor: ", o.growth_factor(), " (must be > 1)");
  TORCH_CHECK_VALUE(o.backoff_factor() > 0 && o.backoff_factor() < 1,
      "gradaccum: Accumulator(): invalid ", which, " backoff_factor: ", o.backoff_factor(), " (must be in (0, 1))");
  TORCH_CHECK_VALUE(o.growth_interval() > 0,
      "gradaccum: Accumulator(): invalid ", which, " growth_interval: ", o.growth_interval(), " (must be > 0)");
}

} // namespace

void LossScalerOptions::validate() const {
  validate_scaler(*this, "loss_scaler", /*external=*/false);
}

void AccumulatorOptions::validate() const {
  TORCH_CHECK_VALUE(steps_ > 0, "gradaccum: Accumulator(): invalid steps: ", steps_, " (must be a positive integer)");
  // (An enum cast from an integer out of range names nothing.)
  const auto reduction = static_cast<int64_t>(reduction_);
  TORCH_CHECK_VALUE(reduction >= static_cast<int64_t>(Reduction::Mean) &&
                        reduction <= static_cast<int64_t>(Reduction::Items),
      "gradaccum: Accumulator(): invalid reduction: ", reduction, " names no Reduction");
  const auto nonfinite = static_cast<int64_t>(nonfinite_);
  TORCH_CHECK_VALUE(nonfinite >= static_cast<int64_t>(NonFinite::Skip) &&
                        nonfinite <= static_cast<int64_t>(NonFinite::SkipMicroBatch),
      "gradaccum: Accumulator(): invalid nonfinite: ", nonfinite, " names no NonFinite mode");
  TORCH_CHECK_VALUE(!(local_only_ && process_group_),
      "gradaccum: Accumulator(): local_only(true) trains each rank alone, but a process_group was given too; "
      "pass one or the other");
  if (max_grad_norm_) {
    TORCH_CHECK_VALUE(std::isfinite(*max_grad_norm_) && *max_grad_norm_ > 0,
        "gradaccum: Accumulator(): invalid max_grad_norm: ", *max_grad_norm_, " (must be a finite number > 0: 0 "
        "would clip every gradient to zero and train nothing; no max_grad_norm (None, C++ std::nullopt) clips "
        "nothing)");
  }
  reducer_.validate();
  if (loss_scaler_) {
    loss_scaler_->validate();
  }
  if (external_loss_scaler_) {
    validate_scaler(*external_loss_scaler_, "external_loss_scaler (Python: grad_scaler)", /*external=*/true);
  }
  if (accumulate_dtype_) {
    TORCH_CHECK_VALUE(*accumulate_dtype_ == at::kFloat || *accumulate_dtype_ == at::kDouble,
        "gradaccum: Accumulator(): invalid accumulate_dtype: ", *accumulate_dtype_, " (float32 or float64)");
    TORCH_CHECK_VALUE(!reducer_.gradient_as_bucket_view(),
        "gradaccum: Accumulator(): accumulate_dtype and gradient_as_bucket_view exclude each other: an "
        "accumulating bucket keeps the window's sums in its own storage, which .grad cannot be (use one or the "
        "other)");
  }
  if (comm_dtype_) {
    TORCH_CHECK_VALUE(*comm_dtype_ == at::kBFloat16 || *comm_dtype_ == at::kHalf ||
                      *comm_dtype_ == at::kFloat,
        "gradaccum: Accumulator(): invalid comm_dtype: ", *comm_dtype_, " (bfloat16, float16 or float32)");
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(metrics_.size()) <= kMaxWindowMetrics,
      "gradaccum: Accumulator(): at most ", kMaxWindowMetrics, " metrics, got ", metrics_.size());
  for (size_t i = 0; i < metrics_.size(); ++i) {
    TORCH_CHECK_VALUE(!metrics_[i].empty(), "gradaccum: Accumulator(): a metric's name is empty");
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(metrics_[i] != metrics_[j], "gradaccum: Accumulator(): the metric '", metrics_[i],
          "' is named twice");
    }
  }
  TORCH_CHECK_VALUE(!error_feedback_ || comm_dtype_,
      "gradaccum: Accumulator(): error_feedback=True needs a comm_dtype: it keeps what compressing the gradients to "
      "comm_dtype loses");
}

} // namespace gradaccum
