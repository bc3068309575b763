#pragma once
// Internal: what a Reducer is built from, checked where it enters and fixed
// from then on.

#include <gradaccum/reducer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gradaccum::detail {

/// A Reducer's parameters, group and options. Every layer of the reducer
/// reads it; none changes it (the tensors' contents excepted).
struct ReducerConfig {
  /// Checks every argument (a ValueError-style c10::Error naming it), then
  /// names the parameters that `names` leaves unnamed.
  ReducerConfig(
      std::vector<at::Tensor> params,
      c10::intrusive_ptr<c10d::ProcessGroup> group,
      ReducerOptions options,
      std::vector<at::Tensor> buffers,
      std::vector<std::string> names,
      WindowRule rule);

  std::vector<at::Tensor> params;
  /// The parameters' dtypes when built: a gradient of another (the model
  /// converted after construction, without refresh_parameters()) is refused.
  std::vector<at::ScalarType> dtypes;
  std::vector<at::Tensor> buffers;
  std::vector<std::string> names; ///< one per parameter
  /// The model's parameters that do not require grad, and their names:
  /// compared across ranks and broadcast once, at construction.
  std::vector<at::Tensor> frozen;
  std::vector<std::string> frozen_names;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  ReducerOptions options;
  WindowRule rule;
  int rank = 0;
  int world = 1;
  int64_t numel = 0; ///< of all parameters: the terms of the window's norm
  /// launched_on_one_host() when built: what an unset bucket_cap_mb follows
  /// (Note [The default bucket cap]). Read once, so the ready-order rebuild
  /// keeps it; refresh_parameters() builds a new config, which reads it again
  /// and is checked across ranks again.
  bool one_host = false;
  /// Its number among the reducers built over the group, the same on every
  /// rank (agree_to_build(); Note [Which Accumulator a collective belongs to]).
  int64_t instance = 0;

  const std::string& name(size_t index) const {
    return names[index];
  }
  /// Where the reducer's own small collectives put their tensors.
  at::Device metadata_device() const;
  /// The bucket caps of ReducerOptions, in bytes; cap_bytes() resolves an
  /// unset bucket_cap_mb with default_bucket_cap_bytes(params, one_host).
  int64_t first_cap_bytes() const;
  int64_t cap_bytes() const;
};

} // namespace gradaccum::detail
