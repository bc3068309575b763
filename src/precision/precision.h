#pragma once
// Internal: what a bucket does beyond summing in its parameters' dtype: wide
// accumulation (accumulate_dtype: micro-steps summed in the bucket) and
// compression to comm_dtype, with its error feedback.

#include "reducer/config.h"

#include <gradaccum/bucket.h>

#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gradaccum::detail {

/// The expected global weight E of a reduction (Note [Scaling before the
/// sum]); `last_weight`: the global weight of the last full window (0: none).
double expected_weight(const WindowRule& rule, int world, double last_weight);

/// What a rank multiplies its error-feedback residual by before adding it to
/// the reduction `request` asks for (Note [Error feedback across window
/// weights]); `residual_weight`: this rank's weight in the window whose
/// rounding the residual holds (0: unknown).
double residual_carry(const ReductionRequest& request, double residual_weight);

/// Fills the wire of a compressed bucket (Bucket::compressed) from its
/// gradients, divided by `scale` (E when prescaled, else 1), keeping the
/// rounding error as the residual with error feedback (carried in multiplied
/// by `carry`: residual_carry(); 0 leaves the residual as it is), and by
/// `rescale` too where defined (a 0-dim tensor: Note [Error feedback across
/// loss scales]).
void compress(Bucket& bucket, double scale, double carry, const at::Tensor& rescale = {});

/// Windows at least this many times lighter than their fp16 wire's scale are
/// sent again at their own (Note [Re-sending a light window]).
constexpr double kLightWindow = 16.0;

/// Rounds a prescaled bucket's wire again from its gradients multiplied by
/// `factor` (E / W), at the scale `scale` (W): the residual, with error
/// feedback (`feedback`: compress() computed one), holds what this rounding
/// lost (Note [Re-sending a light window]).
void rescale_wire(Bucket& bucket, double factor, double scale, bool feedback);

/// The inverse of compress(), into the bucket's gradients, with the window's
/// division folded in when the wire was prescaled. Returns whether the
/// division by `divisor` is still to be done.
bool decompress(Bucket& bucket, double scale, bool divide, double divisor);

/// Adds each `.grad` of a wide bucket's parameters into the bucket, releases
/// it and marks the parameter touched (after a no_sync micro-step).
void accumulate_grads(Bucket& bucket, const std::vector<at::Tensor>& params, std::atomic<bool>* touched);

/// Writes a wide bucket's reduced sums back into `.grad`, rounded once to
/// each parameter's dtype, divided by `divisor` when given; undefined where
/// `nowhere`. The sums stay: the caller zeroes the bucket for the next window
/// (the reducer once the window is agreed, since a bucket written before that
/// may be written again: Note [Writing back while the last buckets reduce]).
void write_back_wide(Bucket& bucket, const std::vector<at::Tensor>& params, const std::vector<char>& nowhere,
                     std::optional<double> divisor);

/// Restores one slot's wide sum from a checkpoint (`name`, `sizes`: its
/// parameter's, for the error).
void load_wide_sum(Bucket& bucket, size_t slot, const at::Tensor& sum, const std::string& name,
                   at::IntArrayRef sizes);

/// The window's sums so far of the parameters of wide buckets that hold one
/// (a copy; undefined elsewhere).
std::vector<at::Tensor> accumulated_sums(const std::vector<Bucket>& buckets, size_t parameters,
                                         const std::atomic<bool>* touched);

/// Each slot's part of `bucket.residual`, flat (which must be defined).
std::vector<at::Tensor> residual_parts(const Bucket& bucket);

/// Each parameter's residual (a copy shaped like it; undefined where its
/// bucket keeps none).
std::vector<at::Tensor> residuals(const std::vector<Bucket>& buckets, size_t parameters);

/// Restores what residuals() returned (undefined or no entries: zero);
/// checks every entry before it writes any.
void set_residuals(std::vector<Bucket>& buckets, const ReducerConfig& config,
                   const std::vector<at::Tensor>& residuals);

void discard_residuals(std::vector<Bucket>& buckets);

/// Each bucket's residual, one view a slot (none for a bucket without one):
/// they keep the residuals alive, and nothing else of the buckets.
std::vector<std::vector<at::Tensor>> residuals_by_slot(const std::vector<Bucket>& buckets);

/// Moves each parameter's residual from `from` (residuals_by_slot() of the
/// old buckets, where `locator` finds each parameter) into the rebuilt
/// buckets `to`.
void move_residuals(const std::vector<std::vector<at::Tensor>>& from,
                    const std::vector<std::pair<size_t, size_t>>& locator, std::vector<Bucket>& to);

} // namespace gradaccum::detail
