#include "comm.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>
#include <tuple>

namespace gradaccum::detail {

std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

std::vector<at::Tensor> allgather(c10d::ProcessGroup& group, const at::Tensor& input) {
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group.getSize(); ++r) {
    outputs[0].push_back(at::empty_like(input));
  }
  std::vector<at::Tensor> inputs{input};
  group.allgather(outputs, inputs)->wait();
  return outputs[0];
}

void broadcast_from(c10d::ProcessGroup& group, const std::vector<at::Tensor>& tensors, int root) {
  using Key = std::tuple<at::ScalarType, at::DeviceType, c10::DeviceIndex>;
  std::map<Key, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      groups[Key(t.scalar_type(), t.device().type(), t.device().index())].push_back(t);
    }
  }
  at::NoGradGuard no_grad;
  for (auto& entry : groups) {
    auto& members = entry.second;
    std::vector<at::Tensor> flat_members;
    for (const auto& t : members) {
      flat_members.push_back(t.reshape(-1));
    }
    std::vector<at::Tensor> flat{at::cat(flat_members)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    group.broadcast(flat, options)->wait();
    int64_t offset = 0;
    for (auto& t : members) {
      t.copy_(flat[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

int lowest_rank_where(c10d::ProcessGroup& group, bool here, const at::Device& device) {
  std::vector<at::Tensor> candidate{
      at::full({1}, here ? group.getRank() : group.getSize(), at::TensorOptions().dtype(at::kLong).device(device))};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MIN;
  group.allreduce(candidate, options)->wait();
  return static_cast<int>(candidate[0].item<int64_t>());
}

bool group_reaches(c10d::ProcessGroup& group, c10::DeviceType type) {
  if (!group.hasBackends()) {
    return true;
  }
  try { // (hasBackendForDeviceType() is newer than torch 2.11)
    return group.getBackend(type).defined();
  } catch (const c10::Error&) {
    return false;
  }
}

at::Device metadata_device(c10d::ProcessGroup& group, at::Device params_device) {
  // NCCL reduces device tensors only; every other backend takes CPU tensors.
  // A group of per-device backends without one for the CPU gets its metadata
  // on the parameters' device too.
  const bool cpu_reachable = group_reaches(group, c10::DeviceType::CPU);
  return group.getBackendType() == c10d::ProcessGroup::BackendType::NCCL || !cpu_reachable
      ? params_device
      : at::Device(at::kCPU);
}

} // namespace gradaccum::detail
