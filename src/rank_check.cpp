#include "rank_check.h"

#include "comm.h"
#include "consensus/agreement.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <exception>
#include <cstring>
#include <sstream>

namespace gradaccum::detail {

namespace {

// Signature of one parameter for the cross-rank check: dtype, dim, the first
// kMaxCheckedDims sizes (what an error shows), then every size folded into
// one number (a parameter of more dims differs past them too).
constexpr int64_t kMaxCheckedDims = 8;
constexpr int64_t kSignatureWidth = 3 + kMaxCheckedDims;

int64_t sizes_hash(at::IntArrayRef sizes, const std::vector<int64_t>& expanded = {}) {
  uint64_t h = 1469598103934665603ULL; // FNV-1a over the sizes, kept positive (-1 marks None)
  for (const auto size : sizes) {
    h = (h ^ static_cast<uint64_t>(size)) * 1099511628211ULL;
  }
  for (const auto d : expanded) {
    h = (h ^ static_cast<uint64_t>(-2 - d)) * 1099511628211ULL; // (a size is never negative)
  }
  return static_cast<int64_t>(h >> 1);
}

// A row's dtype code: the dtype, or kNotStrided minus it for a sparse or
// quantized tensor (one the frozen parameters' broadcast leaves out).
constexpr int64_t kNotStrided = -100;

int64_t dtype_code(const at::Tensor& t) {
  const auto dtype = static_cast<int64_t>(t.scalar_type());
  return t.layout() == at::kStrided && !t.is_quantized() ? dtype : kNotStrided - dtype;
}

std::string describe(const at::Tensor& row) {
  std::ostringstream out;
  const auto code = row[0].item<int64_t>();
  const auto dtype = static_cast<at::ScalarType>(code <= kNotStrided ? kNotStrided - code : code);
  if (code <= kNotStrided) {
    out << "sparse or quantized ";
  }
  const auto dim = row[1].item<int64_t>();
  out << dtype << " [";
  for (int64_t d = 0; d < std::min(dim, kMaxCheckedDims); ++d) {
    out << (d ? ", " : "") << row[2 + d].item<int64_t>();
  }
  out << (dim > kMaxCheckedDims ? ", ...] (" + std::to_string(dim) + " dims)" : "]");
  return out.str();
}

// Every rank's `mine`, in rank order (two collectives: the lengths, then the
// bytes; only on the way to an error, which every rank takes alike).
std::vector<std::string> allgather_text(c10d::ProcessGroup& group, at::Device device, const std::string& mine) {
  const auto lengths = allgather(group, at::full({1}, static_cast<int64_t>(mine.size()), at::kLong).to(device));
  int64_t longest = 1;
  for (const auto& length : lengths) {
    longest = std::max(longest, length.item<int64_t>());
  }
  auto bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>(), mine.data(), mine.size());
  const auto all = allgather(group, bytes.to(device));
  std::vector<std::string> texts;
  for (const auto r : c10::irange(all.size())) {
    const auto theirs = all[r].cpu();
    const auto* data = reinterpret_cast<const char*>(theirs.const_data_ptr<uint8_t>());
    texts.emplace_back(data, data + std::min(lengths[r].item<int64_t>(), longest));
  }
  return texts;
}

// Every rank's list of names (allgather_text(), '\0'-separated).
std::vector<std::vector<std::string>> allgather_names(
    const ReducerConfig& config, at::Device device, const std::vector<std::string>& mine) {
  std::string joined;
  for (const auto& name : mine) {
    joined += name;
    joined.push_back('\0');
  }
  std::vector<std::vector<std::string>> names;
  for (const auto& text : allgather_text(*config.group, device, joined)) {
    names.emplace_back();
    for (size_t start = 0, i = 0; i < text.size(); ++i) {
      if (text[i] == '\0') {
        names.back().emplace_back(text.substr(start, i - start));
        start = i + 1;
      }
    }
  }
  return names;
}

void check_settings_match(const ReducerConfig& config, at::Device device) {
  std::vector<const Agreement*> compared;
  for (const auto& agreement : agreements()) {
    if (agreement.at_construction) {
      compared.push_back(&agreement);
    }
  }
  const AgreementInputs inputs{config.rule, config.options, config.params.size(), 0, 0, config.one_host,
                               &config.names};
  auto mine = at::empty({static_cast<int64_t>(compared.size())}, at::kDouble);
  for (const auto i : c10::irange(compared.size())) {
    mine[static_cast<int64_t>(i)].fill_(compared[i]->value(inputs));
  }
  const auto all = allgather(*config.group, mine.to(device));
  for (const auto i : c10::irange(compared.size())) {
    std::vector<double> values;
    for (const auto& theirs : all) {
      values.push_back(theirs[static_cast<int64_t>(i)].item<double>());
    }
    const bool differ = std::any_of(values.begin(), values.end(), [&](double v) { return v != values[0]; });
    if (differ && compared[i]->shown == Shown::Names) {
      const auto* mine_names = compared[i]->names(inputs);
      const auto names = allgather_names(config, device, mine_names ? *mine_names : std::vector<std::string>{});
      TORCH_CHECK_VALUE(false, "gradaccum: Accumulator(): ", construction_disagreement(*compared[i], names));
    }
    TORCH_CHECK_VALUE(!differ, "gradaccum: Accumulator(): ", construction_disagreement(*compared[i], values));
  }
}

// The parameters' signatures (their count is an agreement: check_settings_match),
// then the buffers'. Rank 0's buffers are broadcast into every rank's, at
// construction and (broadcast_buffers) at each window's end, one flat tensor
// per dtype and device: a buffer of another count, dtype or shape on some rank
// would mix values silently or fail inside the transport, so every rank
// raises here instead (torch DDP checks its module states alike).
void check_shapes_match(const ReducerConfig& config, at::Device device) {
  const auto n = static_cast<int64_t>(config.params.size());
  const auto b = static_cast<int64_t>(config.buffers.size());
  const auto f = static_cast<int64_t>(config.frozen.size());
  const auto counts = allgather(*config.group, at::tensor({b, f}, at::kLong).to(device));
  for (const auto r : c10::irange(counts.size())) {
    const auto theirs = counts[r].cpu();
    const auto first = counts[0].cpu();
    TORCH_CHECK_VALUE(theirs[0].item<int64_t>() == first[0].item<int64_t>(),
        "gradaccum: Accumulator(): the model's buffers differ across ranks: rank ", r, " has ", theirs[0].item<int64_t>(),
        " buffers, rank 0 has ", first[0].item<int64_t>(), ". Rank 0's buffers are broadcast into every rank's "
        "(as torch DDP does): every rank must hold the same ones");
    TORCH_CHECK_VALUE(theirs[1].item<int64_t>() == first[1].item<int64_t>(),
        "gradaccum: Accumulator(): the model's frozen parameters (requires_grad=False) differ across ranks: rank ",
        r, " has ", theirs[1].item<int64_t>(), ", rank 0 has ", first[1].item<int64_t>(), ". Rank 0's are broadcast "
        "into every rank's (as torch DDP does): freeze the same parameters on every rank");
  }
  // The rows: parameters, buffers, frozen parameters.
  const auto tensor_at = [&](int64_t i) -> const at::Tensor& {
    return i < n ? config.params[i] : i < n + b ? config.buffers[i - n] : config.frozen[i - n - b];
  };
  auto signature = at::full({n + b + f, kSignatureWidth}, -1, at::kLong);
  auto rows = signature.accessor<int64_t, 2>();
  for (const auto i : c10::irange(n + b + f)) {
    const auto& t = tensor_at(i);
    if (!t.defined()) {
      continue; // (a buffer set to None: -1, which no dtype is)
    }
    rows[i][0] = dtype_code(t);
    rows[i][1] = t.dim();
    for (int64_t d = 0; d < std::min<int64_t>(t.dim(), kMaxCheckedDims); ++d) {
      rows[i][2 + d] = t.size(d);
    }
    rows[i][2 + kMaxCheckedDims] = sizes_hash(t.sizes(), i >= n + b ? expanded_dims(t) : std::vector<int64_t>{});
  }
  const auto all = allgather(*config.group, signature.to(device));
  const auto reference = all[0].cpu();
  for (const auto r : c10::irange<size_t>(1, all.size())) {
    const auto theirs = all[r].cpu();
    const auto differs = theirs.ne(reference).any(1).nonzero();
    if (differs.numel() > 0) {
      const auto i = differs[0][0].item<int64_t>();
      const auto what = i < n ? config.name(i)
          : i < n + b ? "buffer " + std::to_string(i - n) + " (of " + std::to_string(b) +
              ", in the module's buffers() order)"
                      : "frozen parameter " + config.frozen_names[i - n - b];
      const auto shown = [&](const at::Tensor& row) { return row[0].item<int64_t>() == -1 ? "None" : describe(row); };
      auto there = shown(theirs[i]);
      auto here = shown(reference[i]);
      if (there == here) {
        // They differ past the first kMaxCheckedDims sizes: every rank saw
        // the same rows, so every rank gathers each rank's whole sizes here.
        const auto& t = tensor_at(i);
        std::ostringstream sizes;
        sizes << t.scalar_type() << " " << t.sizes();
        const auto expanded = i >= n + b ? expanded_dims(t) : std::vector<int64_t>{};
        if (!expanded.empty()) {
          sizes << " expanded (stride 0) along dim(s) " << at::IntArrayRef(expanded);
        }
        const auto texts = allgather_text(*config.group, device, sizes.str());
        there = texts[r];
        here = texts[0];
      }
      TORCH_CHECK_VALUE(false,
          "gradaccum: Accumulator(): the model differs across ranks: ", what, " is ", there, " on rank ", r,
          " but ", here, " on rank 0",
          i < n ? "" : i < n + b ? ". Rank 0's buffers are broadcast into every rank's (as torch DDP does): every "
          "rank must hold the same ones" : ". Rank 0's frozen parameters are broadcast into every rank's (as torch "
          "DDP does): every rank must hold the same ones");
    }
  }
}

} // namespace

Refusal Refusal::of(const std::exception& error) {
  if (dynamic_cast<const c10::ValueError*>(&error)) {
    return {Value, message_of(error)};
  }
  if (dynamic_cast<const c10::TypeError*>(&error)) {
    return {Type, message_of(error)};
  }
  return {Other, message_of(error)};
}

Refusal Refusal::of(std::exception_ptr error) {
  if (!error) {
    return {};
  }
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return of(e);
  } catch (...) {
    return {Other, "an unknown error"};
  }
}

// Note [Construction refused on one rank]
// Building an Accumulator (or a Reducer) over a group is a collective: the
// construction checks and the broadcasts pair across ranks. A rank that
// refuses before them (an option out of range, no trainable parameter,
// parameters still claimed by another live Accumulator, another reducer's
// hooks, a Python-side check) would leave the others waiting in the first
// collective until the group's timeout. So the first collective of every
// construction is this one, on every rank whatever it found: an all-gather
// of (refused?, check_parameters). The refusal's message follows (two more
// collectives, only on the way to the error); every rank then raises: the
// refusing ranks their own error, the others the lowest refusing rank's,
// named, as the same kind of error. check_parameters is compared here, as the
// collectives that follow depend on it. The Python package's own checks
// refuse through the same call (_C._refuse_construction), so the sequence
// is the same whichever side refused. Nothing before this collective may
// run one.
// Note [Which Accumulator a collective belongs to]
// Two Accumulators over one group (a GAN's generator and discriminator) pair
// their collectives by launch order, as any two users of a group do. A rank
// that runs one's window where another rank runs the other's (uneven data,
// one micro-batch short of one of them) would sum the two, and with buckets
// of the same sizes nothing else in the header tells them apart: each
// numbers its windows from 0, and their steps and kinds may agree. So every
// reducer gets a number when it is built, the same on every rank, and every
// bucket's header carries it (kInstance, the first row of Note [What ranks
// agree on]): a reduction that pairs two reducers is dropped on every rank,
// saying so. The number is agreed here, in the construction's first
// collective: each rank sends the numbers that live reducers over this
// group hold in its process (a mask of kMaxInstances bits, InstanceHold),
// and every rank takes the lowest number no rank holds. So no two reducers
// alive over one group share a number, whatever each process built before
// (other groups, reducers since destroyed, a reducer one rank still keeps
// alive), and numbers stay small: below the header's modulus, they are
// carried exactly and shown as they are. Buckets of different sizes cannot
// be told apart this way: Gloo checks the sizes first (docs/design.md,
// Limits).
namespace {
constexpr int64_t kMaxInstances = 62; // bits of a non-negative int64 mask
std::mutex held_mutex;
std::unordered_map<const c10d::ProcessGroup*, uint64_t> held; // bit n: number n is held

uint64_t held_mask(const c10d::ProcessGroup* group) {
  const std::lock_guard<std::mutex> lock(held_mutex);
  const auto it = held.find(group);
  return it == held.end() ? 0 : it->second;
}
} // namespace

InstanceHold::InstanceHold(const c10d::ProcessGroup* group, int64_t instance) : group_(group), instance_(instance) {
  TORCH_INTERNAL_ASSERT(instance >= 0 && instance < kMaxInstances);
  const std::lock_guard<std::mutex> lock(held_mutex);
  held[group_] |= uint64_t{1} << instance_;
}

InstanceHold::~InstanceHold() {
  const std::lock_guard<std::mutex> lock(held_mutex);
  const auto it = held.find(group_);
  if (it != held.end() && (it->second &= ~(uint64_t{1} << instance_)) == 0) {
    held.erase(it);
  }
}

int64_t agree_to_build(c10d::ProcessGroup& group, at::Device params_device, const Refusal& mine,
                       bool check_parameters, const char* call) {
  // A device the group cannot reach (a refusing rank's CPU or meta
  // parameters under NCCL) would fail here on this rank alone: the current
  // device of the group's accelerator then, which is where such a group's
  // metadata goes.
  const bool reachable = params_device.type() != at::kMeta && group_reaches(group, params_device.type());
  const auto device = metadata_device(group, reachable ? params_device : reached_device(group));
  auto flags = at::empty({3}, at::kLong);
  flags[0] = static_cast<int64_t>(mine.kind);
  flags[1] = check_parameters ? 1 : 0;
  flags[2] = static_cast<int64_t>(held_mask(&group));
  const auto all = allgather(group, flags.to(device));
  int refuser = -1;
  int refusers = 0;
  uint64_t taken = 0;
  std::vector<int> checking, not_checking;
  for (const auto r : c10::irange(all.size())) {
    const auto theirs = all[r].cpu();
    if (theirs[0].item<int64_t>() != Refusal::None) {
      refuser = refuser < 0 ? static_cast<int>(r) : refuser;
      ++refusers;
    }
    (theirs[1].item<int64_t>() ? checking : not_checking).push_back(static_cast<int>(r));
    taken |= static_cast<uint64_t>(theirs[2].item<int64_t>());
  }
  int64_t instance = 0; // the lowest number no rank holds (Note [Which Accumulator a collective belongs to])
  while (instance < kMaxInstances && (taken >> instance) & 1) {
    ++instance;
  }
  if (refuser >= 0) {
    const auto texts = allgather_text(group, device, mine.message);
    if (mine.kind != Refusal::None) {
      return 0; // the caller raises this rank's own error
    }
    auto reason = texts[static_cast<size_t>(refuser)];
    if (reason.empty()) {
      reason = "(no message)";
    }
    for (const auto& prefix : {std::string("gradaccum: "), std::string(call) + ": "}) {
      if (reason.rfind(prefix, 0) == 0) {
        reason.erase(0, prefix.size());
      }
    }
    const auto kind = all[static_cast<size_t>(refuser)][0].item<int64_t>();
    const auto message = c10::str("gradaccum: ", call, ": rank ", refuser, " refused",
        refusers > 1 ? c10::str(" (as did ", refusers - 1, " more rank", refusers > 2 ? "s" : "", ")") : "",
        ", so every rank raises (rank ", refuser, " its own error): ", reason);
    TORCH_CHECK_VALUE(kind != Refusal::Value, message);
    TORCH_CHECK_TYPE(kind != Refusal::Type, message);
    TORCH_CHECK(false, message);
  }
  if (!checking.empty() && !not_checking.empty()) {
    const auto list = [](const std::vector<int>& ranks) {
      std::string out = ranks.size() > 1 ? "ranks " : "rank ";
      for (const auto i : c10::irange(ranks.size())) {
        out += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
      }
      return out;
    };
    TORCH_CHECK_VALUE(false, "gradaccum: ", call, ": check_parameters differs across ranks: true on ",
        list(checking), "; false on ", list(not_checking), "; the ranks would run different construction "
        "collectives. Pass the same value on every rank");
  }
  // The same mask on every rank: every rank raises here alike.
  TORCH_CHECK(instance < kMaxInstances, "gradaccum: ", call, ": ", kMaxInstances, " Accumulators are alive over "
      "this process group already (on some rank): close the ones no longer used (acc.close())");
  return instance;
}

at::Device device_of(const std::vector<at::Tensor>& params) {
  return params.empty() || !params.front().defined() ? at::Device(at::kMeta) : params.front().device();
}

void tell_construction_refused(c10d::ProcessGroup& group, at::Device params_device) {
  const auto refusal = Refusal::of(std::current_exception());
  TORCH_INTERNAL_ASSERT(refusal.kind != Refusal::None, "gradaccum: tell_construction_refused() outside a catch block");
  try {
    agree_to_build(group, params_device, refusal, /*check_parameters=*/true, "Accumulator()");
  } catch (const std::exception&) {
    // Nobody to tell: the caller's error stands.
  }
}

void check_ranks_match(const ReducerConfig& config) {
  // The same collectives on every rank, in this order, whatever this rank finds.
  const auto device = config.metadata_device();
  check_settings_match(config, device);
  check_shapes_match(config, device);
}

std::string foreign_hooks(const ReducerConfig& config) {
  // torch DDP (and any other reducer) hooks the same gradient accumulators:
  // the gradient would be reduced twice. Ours are added after this check.
  for (const auto i : c10::irange(config.params.size())) {
    const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(config.params[i]);
    if (!accumulator) {
      continue;
    }
    const auto& hooks = accumulator->post_hooks();
    // torch DDP's reducer hooks with C++ lambdas; a user's Python node hook is
    // no reducer and stays allowed.
    const bool foreign = std::any_of(hooks.begin(), hooks.end(), [](const auto& hook) {
      return dynamic_cast<const torch::autograd::utils::LambdaPostHook*>(hook.get()) != nullptr;
    });
    if (foreign) {
      return config.name(i) + " already has a post-hook on its gradient accumulator "
          "that gradaccum did not add: the model is also wrapped in torch "
          "DistributedDataParallel (accelerator.prepare(model), HF Trainer?) or another "
          "reducer is attached, and the gradient would be reduced twice. Delete the DDP "
          "wrapper (del ddp_model; with Accelerate, do not prepare the model) before building "
          "the Accumulator: gradaccum does the data-parallel reduction";
    }
  }
  return "";
}

} // namespace gradaccum::detail
