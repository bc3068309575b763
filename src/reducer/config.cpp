#include "reducer/config.h"

#include "comm.h"

#include <c10/util/irange.h>

namespace gradaccum::detail {

namespace {

constexpr double kMiB = 1024 * 1024;

// A group whose backends are registered per device type (as torch's and
// gradaccum's own) must have one for each parameter's device: an NCCL-only
// group cannot reduce CPU parameters, and would fail only at the first
// synchronising backward, after a window of work.
void check_group_reaches(c10d::ProcessGroup& group, const at::Tensor& param, const std::string& name) {
  const auto device = param.device();
  TORCH_CHECK_VALUE(group_reaches(group, device.type()),
      "gradaccum: Accumulator(): the process group (backend '", group.getBackendName(),
      "') has no backend for ", device.type(), " tensors, and ", name, " is on ", device,
      ": move the model to a device the group reduces (model.to('cuda') under NCCL) or use a "
      "Gloo group for CPU training");
}

} // namespace

ReducerConfig::ReducerConfig(
    std::vector<at::Tensor> params_,
    c10::intrusive_ptr<c10d::ProcessGroup> group_,
    ReducerOptions options_,
    std::vector<at::Tensor> buffers_,
    std::vector<std::string> names_,
    WindowRule rule_)
    : params(std::move(params_)),
      buffers(std::move(buffers_)),
      names(std::move(names_)),
      group(std::move(group_)),
      options(options_),
      rule(rule_) {
  // A Reducer built by an Accumulator gets a group, names and the model's
  // parameters: what only a direct use of Reducer can break names Reducer().
  TORCH_CHECK_VALUE(group, "gradaccum: Reducer(): process_group is null");
  options.validate();
  TORCH_CHECK_VALUE(rule.steps >= 1, "gradaccum: Accumulator(): steps must be >= 1, got ", rule.steps);
  TORCH_CHECK_VALUE(!params.empty(), "gradaccum: Accumulator(): the model has no trainable parameters");
  TORCH_CHECK_VALUE(names.empty() || names.size() == params.size(),
      "gradaccum: Reducer(): got ", names.size(), " names for ", params.size(), " parameters");
  if (names.empty()) {
    for (const auto i : c10::irange(params.size())) {
      names.push_back("parameter " + std::to_string(i));
    }
  }
  for (const auto i : c10::irange(params.size())) {
    const auto& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), "gradaccum: Reducer(): ", name(i), " is undefined");
    TORCH_CHECK_VALUE(p.is_leaf() && p.requires_grad(),
        "gradaccum: Reducer(): ", name(i), " must be a leaf tensor that requires grad");
    TORCH_CHECK_VALUE(!p.is_sparse(),
        "gradaccum: Accumulator(): ", name(i), " is sparse; sparse parameters are not supported");
    check_group_reaches(*group, p, name(i));
    numel += p.numel();
    dtypes.push_back(p.scalar_type());
  }
  rank = group->getRank();
  world = group->getSize();
  one_host = launched_on_one_host();
}

at::Device ReducerConfig::metadata_device() const {
  return detail::metadata_device(*group, params.front().device());
}

int64_t ReducerConfig::first_cap_bytes() const {
  return static_cast<int64_t>(options.first_bucket_cap_mb() * kMiB);
}

int64_t ReducerConfig::cap_bytes() const {
  if (options.bucket_cap_mb()) {
    return static_cast<int64_t>(*options.bucket_cap_mb() * kMiB);
  }
  return default_bucket_cap_bytes(params, one_host);
}

} // namespace gradaccum::detail
