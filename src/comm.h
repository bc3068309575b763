#pragma once
// Internal: the few collectives the reducer runs besides its buckets'
// all-reduces, and what every layer above needs to talk about a group.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <exception>
#include <string>
#include <vector>

namespace gradaccum::detail {

/// The message of `e`, without a c10::Error's C++ backtrace.
std::string message_of(const std::exception& e);

/// Every rank's `input`, in rank order (a collective; waits).
std::vector<at::Tensor> allgather(c10d::ProcessGroup& group, const at::Tensor& input);

/// Gives every rank `root`'s values of `tensors`: one broadcast per (dtype,
/// device), through a flat copy (a collective; waits).
void broadcast_from(c10d::ProcessGroup& group, const std::vector<at::Tensor>& tensors, int root = 0);

/// The lowest rank whose `here` is true, or the group's size if none is (an
/// all-reduce MIN of one integer on `device`; a collective, waits).
int lowest_rank_where(c10d::ProcessGroup& group, bool here, const at::Device& device);

/// Whether `group` can reduce tensors of `type`. A group that registers no
/// per-device backends (a wrapper overriding the collectives) is trusted.
bool group_reaches(c10d::ProcessGroup& group, c10::DeviceType type);

/// Where the group's small collectives (checks, orders, a bucket's meta) put
/// their tensors, for parameters on `params_device`.
at::Device metadata_device(c10d::ProcessGroup& group, at::Device params_device);

} // namespace gradaccum::detail
