#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace gradaccum {

/// Splits a batch along dim 0 into `steps` micro-batches whose sizes differ by
/// at most one (the first `rows % steps` get the extra row). Returns views.
///
/// Call it qualified, `gradaccum::split(batch, steps)`: an unqualified
/// `split(batch, 4)` finds `at::split(tensor, split_size)` by argument-dependent
/// lookup, whose second argument is the rows per piece, not the number of
/// pieces (under `using namespace gradaccum;` the call is ambiguous and does
/// not compile).
std::vector<at::Tensor> split(const at::Tensor& batch, int64_t steps);

/// Splits several tensors of one batch (inputs, targets…) alike: result[k] holds
/// micro-batch k of every tensor. All must have the same size along dim 0.
std::vector<std::vector<at::Tensor>> split(
    const std::vector<at::Tensor>& batch,
    int64_t steps);

} // namespace gradaccum
