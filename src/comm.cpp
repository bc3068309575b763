#include "comm.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>
#include <tuple>

namespace gradaccum::detail {

std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  // A Python error a Python optimizer or hook raised through pybind11
  // (error_already_set): its text ends with the Python trace.
  std::string text = e.what();
  const auto trace = text.find("\n\nAt:\n");
  return trace == std::string::npos ? text : text.substr(0, trace);
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

namespace {

// Runs a collective's steps, keeping the first exception: every broadcast
// still launches after a step failed on this rank, so the ranks pair.
class FirstFailure {
 public:
  template <class Step>
  void attempt(const Step& step) {
    try {
      step();
    } catch (...) {
      if (!failed_) {
        failed_ = std::current_exception();
      }
    }
  }
  void rethrow() const {
    if (failed_) {
      std::rethrow_exception(failed_);
    }
  }

 private:
  std::exception_ptr failed_;
};

// One broadcast of `tensor` from `root` through `steps`: whether it arrived.
bool broadcast_from(c10d::ProcessGroup& group, const at::Tensor& tensor, int root, FirstFailure& steps) {
  bool received = false;
  steps.attempt([&] {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    group.broadcast(tensors, options)->wait();
    received = true;
  });
  return received;
}

void pack(const std::vector<at::Tensor>& members, const at::Tensor& flat) {
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const auto& t : members) {
    flat.narrow(0, offset, t.numel()).view(t.sizes()).copy_(t);
    offset += t.numel();
  }
}

void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& members) {
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const auto& t : members) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

} // namespace

// Note [The buffers' broadcast allocates nothing]
// It runs after every rank reduced the window (finish.cpp) and at
// construction after the ranks agreed that it succeeded everywhere: a failure
// on one rank there cannot be told to the others, and a broadcast it skipped
// would pair its later collectives with the wrong ones (Note [Collectives pair
// by launch order]). So the flat copies are allocated with the reducer, every
// broadcast launches whatever failed before it on this rank, and the first
// failure is rethrown once all have run; a rank whose broadcast failed keeps
// its buffers as they were. What is left is the collective itself failing
// (then the group is broken for every rank) and a buffer resized in place
// since, whose new flat copy is allocated then. The cost: one more copy of
// the buffers, for the reducer's life (with broadcast_buffers, else only
// while it is built).
BroadcastPlan::BroadcastPlan(const std::vector<at::Tensor>& tensors) {
  using Key = std::tuple<at::ScalarType, at::DeviceType, c10::DeviceIndex>;
  std::map<Key, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.defined()) {
      groups[Key(t.scalar_type(), t.device().type(), t.device().index())].push_back(t);
    }
  }
  for (auto& entry : groups) {
    int64_t numel = 0;
    for (const auto& t : entry.second) {
      numel += t.numel();
    }
    // Filled now: a root that fails to fill it later sends these values.
    auto flat = at::empty({numel}, entry.second.front().options());
    pack(entry.second, flat);
    groups_.push_back(Group{std::move(entry.second), std::move(flat)});
  }
}

void BroadcastPlan::run(c10d::ProcessGroup& group, int root) const {
  at::NoGradGuard no_grad;
  const bool sending = group.getRank() == root;
  FirstFailure steps;
  const auto attempt = [&](const auto& step) { steps.attempt(step); };
  for (const auto& g : groups_) {
    // A member resized in place since (a cache grown by the forward) takes a
    // flat copy of its new size: the one allocation left, and only then. The
    // buffers have one shape on every rank (as DDP requires): every rank
    // takes this branch, or skips an empty group, alike.
    int64_t numel = 0;
    for (const auto& t : g.members) {
      numel += t.numel();
    }
    if (numel == 0) {
      continue; // (the same on every rank: their buffers have one shape)
    }
    at::Tensor flat = g.flat;
    if (numel != g.flat.numel()) {
      attempt([&] { flat = at::empty({numel}, g.flat.options()); });
    }
    const bool fits = numel == flat.numel();
    if (sending) {
      attempt([&] {
        TORCH_INTERNAL_ASSERT(fits);
        pack(g.members, flat);
      });
    }
    const bool received = broadcast_from(group, flat, root, steps);
    if (!sending && received) { // (a failed broadcast leaves the buffers as they were)
      attempt([&] {
        TORCH_INTERNAL_ASSERT(fits);
        unpack(flat, g.members);
      });
    }
  }
  steps.rethrow();
}

namespace {

// `t`'s bytes as a 1-dim uint8 view (contiguous `t`).
at::Tensor bytes_of(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// `bytes` (as many as `t` holds, contiguous) viewed as `t`'s dtype and shape.
at::Tensor as_shaped(const at::Tensor& bytes, const at::Tensor& t) {
  return bytes.view(t.scalar_type()).view(t.sizes());
}

// The part of `t` that holds its values: an expanded tensor (stride 0)
// repeats its first slice.
at::Tensor core_of(at::Tensor t) {
  for (const auto d : expanded_dims(t)) {
    t = t.narrow(d, 0, 1);
  }
  return t;
}

} // namespace

std::vector<int64_t> expanded_dims(const at::Tensor& t) {
  std::vector<int64_t> dims;
  for (const auto d : c10::irange(t.dim())) {
    if (t.stride(d) == 0 && t.size(d) > 1) {
      dims.push_back(d);
    }
  }
  return dims;
}

// The plan depends on each tensor's device type, dtype, sizes and expanded
// dims only, which the construction check compares: not on its other
// strides, which it does not, so a tensor contiguous on one rank and a view
// on another sends alike. An expanded tensor sends the slice it repeats.
OnceBroadcast::OnceBroadcast(const std::vector<at::Tensor>& tensors) {
  std::map<at::DeviceType, Staged> staged;
  for (const auto& whole : tensors) {
    if (!whole.defined() || whole.numel() == 0 || whole.layout() != at::kStrided || whole.is_quantized()) {
      continue; // (the same on every rank: the check compares these too; sparse and quantized stay as they are)
    }
    const auto t = core_of(whole);
    TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes,
        "gradaccum: Accumulator(): a frozen parameter (requires_grad=False) of sizes ", whole.sizes(), " and "
        "strides ", whole.strides(), " overlaps itself in memory; it is broadcast from rank 0 as torch DDP does: "
        "clone() it");
    if (nbytes(t) >= kInPlaceBytes) {
      // In place if it can be; else through a copy of its own, allocated here.
      own_.push_back(Own{t, t.is_contiguous() ? bytes_of(t) : at::empty({nbytes(t)}, t.options().dtype(at::kByte))});
      continue;
    }
    auto& group = staged[t.device().type()];
    int64_t offset = 0;
    if (!group.members.empty()) {
      constexpr int64_t kAlign = 16; // (a byte slot viewed as any dtype)
      offset = (group.offsets.back() + nbytes(group.members.back()) + kAlign - 1) / kAlign * kAlign;
    }
    group.members.push_back(t);
    group.offsets.push_back(offset);
  }
  for (auto& entry : staged) {
    auto& group = entry.second;
    const auto& last = group.members.back();
    group.flat = at::empty({group.offsets.back() + nbytes(last)}, last.options().dtype(at::kByte));
    staged_.push_back(std::move(group));
  }
}

void OnceBroadcast::run(c10d::ProcessGroup& group, int root) const {
  at::NoGradGuard no_grad;
  const bool sending = group.getRank() == root;
  FirstFailure steps;
  const auto attempt = [&](const auto& step) { steps.attempt(step); };
  const auto broadcast = [&](const at::Tensor& bytes) { return broadcast_from(group, bytes, root, steps); };
  const auto write_back = [&](const at::Tensor& t, const at::Tensor& shaped) {
    attempt([&] { t.copy_(shaped); });
  };
  for (const auto& own : own_) {
    const bool copied = own.bytes.data_ptr() != own.tensor.data_ptr();
    if (sending && copied) {
      attempt([&] { as_shaped(own.bytes, own.tensor).copy_(own.tensor); });
    }
    // (a failed broadcast may leave part of it written: the error says so)
    if (broadcast(own.bytes) && !sending && copied) {
      write_back(own.tensor, as_shaped(own.bytes, own.tensor));
    }
  }
  for (const auto& g : staged_) {
    const auto slot = [&](size_t i) {
      return as_shaped(g.flat.narrow(0, g.offsets[i], nbytes(g.members[i])), g.members[i]);
    };
    if (sending) {
      attempt([&] {
        for (const auto i : c10::irange(g.members.size())) {
          slot(i).copy_(g.members[i]);
        }
      });
    }
    if (broadcast(g.flat) && !sending) {
      for (const auto i : c10::irange(g.members.size())) {
        write_back(g.members[i], slot(i));
      }
    }
  }
  steps.rethrow();
}

int lowest_rank_where(c10d::ProcessGroup& group, bool here, at::Tensor scratch) {
  TORCH_INTERNAL_ASSERT(scratch.numel() == 1 && scratch.scalar_type() == at::kLong);
  scratch.fill_(here ? group.getRank() : group.getSize());
  std::vector<at::Tensor> candidate{scratch};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MIN;
  group.allreduce(candidate, options)->wait();
  return static_cast<int>(candidate[0].item<int64_t>());
}

int lowest_rank_of_best_tier(c10d::ProcessGroup& group, int tier, int tiers, const at::Device& device) {
  TORCH_INTERNAL_ASSERT(tier >= 0 && tier <= tiers, "gradaccum: tier ", tier, " of ", tiers);
  const int64_t size = group.getSize();
  // tier * size + rank: the minimum is the best tier's lowest rank.
  auto key = at::full({1}, tier * size + group.getRank(), at::TensorOptions().dtype(at::kLong).device(device));
  std::vector<at::Tensor> candidate{key};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MIN;
  group.allreduce(candidate, options)->wait();
  const auto best = candidate[0].item<int64_t>();
  return static_cast<int>(best >= tiers * size ? size : best % size);
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

at::Device reached_device(c10d::ProcessGroup& group) {
  if (group.hasBackends()) {
    for (const auto& device : group.getDeviceTypes()) {
      if (device.type() != c10::DeviceType::CPU) {
        return at::Device(device.type());
      }
    }
  }
  return at::Device(at::kCUDA);
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
