#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace gradaccum::detail {

/// Writes `in / divisor` (no divisor: `in` itself) into `out`, as at::div_out
/// (or copy_) with a CPU double scalar would, bit for bit; `out` may be `in`
/// (in place), or undefined (nothing written). With `norm_terms > 0` it also
/// checks every value it writes, in the same pass, and returns true when each
/// one is finite and small enough that a 2-norm over `norm_terms` such values,
/// summed in their dtype, cannot overflow: the window's norm is then finite
/// without being computed (see Note [The reducer checks the window's gradient]
/// in src/accumulator/window_end.cpp). False when a value fails, or when this pass cannot
/// check (not a float32/float64 CPU tensor with `out` laid out like `in`, or
/// `norm_terms == 0`): ATen then writes and the caller checks what it needs.
bool write_checked(
    const at::Tensor& out,
    const at::Tensor& in,
    std::optional<double> divisor,
    int64_t norm_terms);

} // namespace gradaccum::detail
