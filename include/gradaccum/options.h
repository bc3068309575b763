#pragma once

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace gradaccum {

/// What a window's gradient equals.
enum class Reduction {
  /// The gradient of the mean of the window's micro-batch losses (over all ranks).
  Mean,
  /// The gradient of the sum of the window's micro-batch losses (over all ranks).
  Sum,
  /// The gradient of (sum of the summed losses) / (sum of `num_items`), over all
  /// micro-batches of all ranks: the exact per-item mean for uneven micro-batches.
  Items,
};

/// What to do when the window's gradient holds a NaN or an infinity.
enum class NonFinite {
  /// Skip the optimizer step, clear the gradients, count it in `stats()`.
  Skip,
  /// Throw, leaving the gradients in place for inspection.
  Raise,
  /// Step anyway (no check, no host synchronisation).
  Ignore,
  /// Leave out each micro-batch whose loss is not finite: no backward, its
  /// weight not counted (a host synchronisation per micro-batch to read the
  /// loss); the window is the mean over the micro-batches kept, on every rank
  /// alike. A window gradient that is still not finite is skipped as by Skip.
  SkipMicroBatch,
};

/// Parses "mean" / "sum" / "items"; throws a ValueError-style error otherwise,
/// naming `call` (the call that took the name).
Reduction reduction_from_string(const std::string& name, const char* call = "reduction_from_string()");
std::string to_string(Reduction reduction);
/// Parses "skip" / "raise" / "ignore" / "skip_micro_batch" (the error names `call`).
NonFinite nonfinite_from_string(const std::string& name, const char* call = "nonfinite_from_string()");
std::string to_string(NonFinite mode);

/// How the reducer groups gradients and where they live.
struct ReducerOptions {
  /// Cap of every bucket but the first, in MiB. Unset (the default): with
  /// every rank on one host (LOCAL_WORLD_SIZE == WORLD_SIZE, as torchrun sets
  /// them), torch DDP's fixed 25 MiB; across hosts, a sixteenth of the
  /// trainable parameters' bytes, at least 1 MiB and at most 25 MiB, so that
  /// a mid-sized model's gradients leave in enough buckets to overlap with
  /// backward on the slower link; see default_bucket_cap_bytes() (bucket.h).
  /// Example: `ReducerOptions().bucket_cap_mb(10)`.
  TORCH_ARG(std::optional<double>, bucket_cap_mb) = std::nullopt;
  /// Cap of the first bucket (the last layers, ready first), in MiB: small, so
  /// the first all-reduce starts early in backward.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Make each `.grad` a view into its bucket: no second copy of the gradients.
  /// `acc.step()` clears them; LibTorch's `Optimizer::zero_grad()` cannot (it
  /// detaches each `.grad` in place, which a view refuses), so do not call it
  /// with views (as with torch DDP's gradient_as_bucket_view).
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Broadcast rank 0's buffers (batch-norm statistics…) at each window's
  /// end: one broadcast per window and buffer dtype, none for a model without
  /// buffers (torch DDP broadcasts before every forward instead: within a
  /// window the other ranks' forwards read their own buffers). False keeps
  /// them per rank.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Check at construction that every rank has the same parameters and
  /// options (and, with an unset bucket_cap_mb, the same one-host launch).
  TORCH_ARG(bool, check_parameters) = true;
  /// Rebuild the buckets once, after the first window, in the order that
  /// window's backward made the gradients ready (rank 0's order, on every
  /// rank), so that buckets launch during backward even when the registration
  /// order is not backward's. Example: `ReducerOptions().rebuild_buckets(false)`.
  TORCH_ARG(bool, rebuild_buckets) = true;


 public:
  /// Throws if a field is out of range.
  void validate() const;
};

/// A dynamic loss scaler for fp16 training from C++ (LibTorch has none), as
/// torch.amp.GradScaler: the loss is scaled before backward; at each closed
/// window the reduced gradient is unscaled and checked; an overflow skips the
/// window and multiplies the scale by `backoff_factor`, and `growth_interval`
/// windows in a row without one multiply it by `growth_factor`.
struct LossScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;

 public:
  void validate() const;
};

/// The most user metrics a window carries (AccumulatorOptions::metrics): the
/// room the bucket header keeps for them (Note [Bucket meta layout]).
constexpr int64_t kMaxWindowMetrics = 8;

/// Options of an `Accumulator`.
///
/// Example:
/// ```
/// auto options = gradaccum::AccumulatorOptions(8)
///                    .reduction(gradaccum::Reduction::Items)
///                    .max_grad_norm(1.0)
///                    .process_group(pg);
/// ```
struct AccumulatorOptions {
  /* implicit */ AccumulatorOptions(int64_t steps) : steps_(steps) {}

  /// Micro-steps per window (K); the optimizer steps once per window.
  TORCH_ARG(int64_t, steps);
  TORCH_ARG(Reduction, reduction) = Reduction::Mean;
  /// Clip the window's gradient to this total 2-norm (> 0), once, at the
  /// boundary; std::nullopt clips nothing.
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt;
  TORCH_ARG(NonFinite, nonfinite) = NonFinite::Skip;
  /// Data-parallel group; null means single process (no reducer).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group);
  /// Without a process group, train each rank alone on purpose. Without this
  /// flag, an Accumulator with no group in a launch whose environment says
  /// WORLD_SIZE > 1 (torchrun) is an error: its ranks would silently train
  /// apart (Note [No group under a multi-rank launch]).
  TORCH_ARG(bool, local_only) = false;
  TORCH_ARG(ReducerOptions, reducer) = {};
  /// The dtype each window's gradient is summed in (float32 or float64), for
  /// parameters of a narrower dtype (bf16, fp16): every micro-step's gradient is
  /// added into a buffer of this dtype and the parameter's own `.grad` released,
  /// so the sum is rounded once, when `.grad` receives the window's gradient
  /// (in the parameter's dtype). `std::nullopt`: sum in the parameter's dtype.
  /// Example: `AccumulatorOptions(16).accumulate_dtype(torch::kFloat32)`.
  TORCH_ARG(std::optional<at::ScalarType>, accumulate_dtype) = std::nullopt;
  /// The dtype gradients travel in between ranks (bfloat16, float16, float32),
  /// independent of the dtype they are summed in: e.g. accumulate in float32,
  /// all-reduce in bfloat16 (half the bytes). Each rank scales its gradients by
  /// 1 / (the expected global weight) before rounding them to this dtype, so
  /// fp16 sums do not overflow. `std::nullopt`: the buckets' own dtype.
  /// Example: `AccumulatorOptions(16).accumulate_dtype(torch::kFloat32).comm_dtype(torch::kBFloat16)`.
  TORCH_ARG(std::optional<at::ScalarType>, comm_dtype) = std::nullopt;
  /// With comm_dtype: keep what rounding to it lost of each rank's window (the
  /// residual, one copy of the gradients in the buckets' dtype) and add it to the
  /// next window's gradient before rounding, so no part of a gradient is lost
  /// for good. The residual is per rank; per-rank checkpoints keep it.
  TORCH_ARG(bool, error_feedback) = false;
  /// Names of the window's user metrics (at most kMaxWindowMetrics): small
  /// scalars each backward() may add (`metrics`, in this order), summed over
  /// the window and every rank in the gradient all-reduce's header, like the
  /// window's loss (Accumulator::window_metrics()). Every rank builds with the
  /// same names. Example: `AccumulatorOptions(8).metrics({"correct", "tokens"})`.
  TORCH_ARG(std::vector<std::string>, metrics) = {};
  /// A dynamic loss scaler (fp16). Example:
  /// `AccumulatorOptions(8).loss_scaler(LossScalerOptions().init_scale(1024))`.
  TORCH_ARG(std::optional<LossScalerOptions>, loss_scaler) = std::nullopt;
  /// A loss scaler outside the Accumulator, wired in after construction with
  /// set_window_callbacks (Python's GradScaler): its scale now and its
  /// schedule. Only compared across ranks at construction, so that ranks
  /// scaling differently (one rank without it, another scale) are refused
  /// instead of summing gradients in different units (Note [What ranks
  /// agree on]). Unset: none.
  TORCH_ARG(std::optional<LossScalerOptions>, external_loss_scaler) = std::nullopt;


 public:
  /// Throws if a field is out of range.
  void validate() const;
};

} // namespace gradaccum
