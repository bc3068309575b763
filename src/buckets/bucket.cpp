#include <gradaccum/bucket.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <tuple>

namespace gradaccum {

// Note [The default bucket cap]
// Only the window's last backward can hide its all-reduce, and a bucket leaves
// when its last gradient is ready. With torch DDP's fixed 25 MiB, a model of
// 40-50 MiB of gradients fits in 2-3 buckets, and three quarters of its bytes
// wait for the end of backward: on the throttled link of benchmarks/RESULTS.md
// ("Bucket caps") any schedule could then hide at most 0.45 (a GPT-style
// transformer) and 0.18 (an MLP) of the all-reduce, against 0.82 and 0.57 with
// 4 MiB buckets. The bound levels off from about 12 buckets on (2 MiB: +0.01),
// so across hosts an unset cap aims at 16: a sixteenth of the gradients'
// bytes, at least 1 MiB (below that a collective's own latency dominates; a
// model under 1 MiB stays one bucket) and at most DDP's 25 MiB (from about
// 400 MiB of gradients on, the layout is DDP's, and NCCL's large messages
// keep their bandwidth).
//
// With every rank on one host (launched_on_one_host(): LOCAL_WORLD_SIZE ==
// WORLD_SIZE, as torchrun sets them), the unset cap is DDP's 25 MiB. The
// "link" is then shared memory, loopback or NVLink: a window's all-reduce is
// short, or, with Gloo, is CPU work on the very cores backward runs on, so
// there is little to hide and every extra collective costs its latency. On
// the 2-core loopback benchmark the transformer's 10-11 buckets (a sixteenth)
// took 1.03-1.08x DDP + no_sync's window at K=1, its 3 buckets (25 MiB)
// 0.99-1.03x, level with DDP's within the machine's noise (benchmarks/
// RESULTS.md, "The default bucket cap on one host").
//
// Each rank computes the cap from its own parameters and launch, and
// check_parameters compares both across ranks at construction (the shapes,
// and the one-host flag in agreements()): the cap agrees wherever they do.
// An explicit bucket_cap_mb is used as given.
bool launched_on_one_host() {
  auto read = [](const char* name) -> std::optional<long> {
    const char* raw = std::getenv(name);
    if (!raw || !*raw) {
      return std::nullopt;
    }
    char* end = nullptr;
    errno = 0;
    const long value = std::strtol(raw, &end, 10);
    if (errno != 0 || *end != '\0' || value < 1) {
      return std::nullopt;
    }
    return value;
  };
  const auto local = read("LOCAL_WORLD_SIZE");
  const auto world = read("WORLD_SIZE");
  return local && world && *local == *world;
}

int64_t default_bucket_cap_bytes(const std::vector<at::Tensor>& params, bool one_host) {
  constexpr int64_t kBuckets = 16;
  constexpr int64_t kMiB = int64_t{1} << 20;
  if (one_host) {
    return 25 * kMiB;
  }
  int64_t bytes = 0;
  for (const auto& p : params) {
    bytes += p.numel() * static_cast<int64_t>(p.element_size());
  }
  return std::clamp(bytes / kBuckets, 1 * kMiB, 25 * kMiB);
}

int64_t default_bucket_cap_bytes(const std::vector<at::Tensor>& params) {
  return default_bucket_cap_bytes(params, launched_on_one_host());
}

std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<at::Tensor>& params,
    int64_t first_cap_bytes,
    int64_t cap_bytes,
    const std::vector<size_t>& ready_order) {
  std::vector<size_t> order = ready_order;
  if (order.empty()) {
    for (size_t i = params.size(); i-- > 0;) {
      order.push_back(i);
    }
  }
  // position[i]: when parameter i becomes ready.
  std::vector<size_t> position(params.size(), params.size());
  TORCH_CHECK_VALUE(order.size() == params.size(),
      "gradaccum: assign_buckets(): the ready order has ", order.size(), " entries for ", params.size(), " parameters");
  for (const auto k : c10::irange(order.size())) {
    TORCH_CHECK_VALUE(order[k] < params.size() && position[order[k]] == params.size(),
        "gradaccum: assign_buckets(): the ready order is not a permutation of the parameters (entry ", k,
        " is ", order[k], ")");
    position[order[k]] = k;
  }
  struct Open {
    std::vector<size_t> indices;
    int64_t bytes = 0;
    bool first = true;
  };
  using Key = std::tuple<at::ScalarType, at::DeviceType, c10::DeviceIndex>;
  std::map<Key, Open> open;
  std::vector<std::vector<size_t>> closed;

  for (const size_t i : order) {
    const auto& p = params[i];
    auto& bucket = open[Key(p.scalar_type(), p.device().type(), p.device().index())];
    bucket.indices.push_back(i);
    bucket.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    if (bucket.bytes >= (bucket.first ? first_cap_bytes : cap_bytes)) {
      closed.push_back(std::move(bucket.indices));
      bucket.indices.clear();
      bucket.bytes = 0;
      bucket.first = false;
    }
  }
  for (auto& entry : open) {
    if (!entry.second.indices.empty()) {
      closed.push_back(std::move(entry.second.indices));
    }
  }
  // Launch order: by the first parameter to be ready, i.e. by when backward
  // should complete the bucket. The same on every rank for the same order.
  std::stable_sort(closed.begin(), closed.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  return closed;
}

namespace {

// Integers a half-precision dtype holds exactly: 2^(significand bits).
int64_t exact_integers(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? 256 : 2048;
}

// The digit width b of Note [Bucket meta layout]: the largest with
// world * (2^b - 1) exact in `dtype`; 0 when not even bits are.
int digit_bits_for(at::ScalarType dtype, int world) {
  int bits = 0;
  while (bits < 16 && static_cast<int64_t>(world) * ((int64_t{2} << bits) - 1) <= exact_integers(dtype)) {
    ++bits;
  }
  return bits;
}

// Fixed-point bits of each header field: the weight may be fractional (items,
// a checkpoint's 1/world share); the fields in which each rank sends 0 or 1
// (its own flags, the one reason it drops the window for) take one bit, one
// digit; every other field is an integer below 2^32, except the loss and the
// metrics, which digits do not carry (no bits: they are 0 and take no room on
// the wire).
constexpr int kWeightFractionBits = 32;
bool one_bit_field(int64_t field) {
  return field == kFlushing || field == kFlushingSteps || field == kAbort || field == kJoined || field == kInexactWeight ||
      field == kUnstepped || (field >= kAbortReasons && field < kAbortReasons + kAbortReasonSlots);
}
int field_bits(int64_t field) {
  return field == kWeight ? 63 : field >= kLoss ? 0 : one_bit_field(field) ? 1 : 32;
}
int field_fraction_bits(int64_t field) {
  return field == kWeight ? kWeightFractionBits : 0;
}
int64_t field_digits(int64_t field, int bits) {
  return (field_bits(field) + bits - 1) / bits;
}
int64_t header_digits(int bits) {
  int64_t total = 0;
  for (int64_t f = 0; f < kMetaHeader; ++f) {
    total += field_digits(f, bits);
  }
  return total;
}

} // namespace

void add_widened(at::Tensor& sum, const at::Tensor& grad) {
  if (grad.scalar_type() != sum.scalar_type() && grad.device().is_cpu()) {
    sum.add_(grad.to(sum.scalar_type()));
  } else {
    sum.add_(grad);
  }
}

double Bucket::max_meta_value(MetaField field) {
  return std::ldexp(1.0, field_bits(field) - field_fraction_bits(field)) - 1;
}

double Bucket::min_meta_weight() {
  return std::ldexp(1.0, 20 - 1 - kWeightFractionBits);
}

Bucket::Bucket(const std::vector<at::Tensor>& all, std::vector<size_t> indices,
               const BucketConfig& config)
    : params(std::move(indices)) {
  TORCH_INTERNAL_ASSERT(!params.empty());
  TORCH_INTERNAL_ASSERT(config.world >= 1);
  const auto& first = all[params.front()];
  int64_t numel = 0;
  for (size_t index : params) {
    numel += all[index].numel();
  }
  const auto n = static_cast<int64_t>(params.size());
  const auto& accumulate = config.accumulate_dtype;
  const auto dtype = accumulate && at::elementSize(*accumulate) > first.element_size()
      ? *accumulate : first.scalar_type();
  accumulating = dtype != first.scalar_type();
  const auto wire_dtype = config.comm_dtype.value_or(dtype);
  compressed = wire_dtype != dtype;
  const bool half_wire = wire_dtype == at::kHalf || wire_dtype == at::kBFloat16;
  prescaled = compressed && half_wire;
  if (half_wire) {
    digit_bits = digit_bits_for(wire_dtype, config.world);
    encoding = digit_bits > 0 ? MetaEncoding::kDigits : MetaEncoding::kSeparate;
  }
  const auto meta_numel = (encoding == MetaEncoding::kDigits ? header_digits(digit_bits) : kMetaHeader) + n;
  const auto tail = encoding == MetaEncoding::kSeparate ? 0 : meta_numel;
  const auto options = first.options().dtype(dtype).requires_grad(false);
  if (compressed) {
    buffer = at::zeros({numel}, options);
    wire = at::zeros({numel + tail}, options.dtype(wire_dtype));
  } else {
    buffer = at::zeros({numel + tail}, options);
    wire = buffer;
  }
  gradients = buffer.narrow(0, 0, numel);
  wire_gradients = wire.narrow(0, 0, numel);
  meta = encoding == MetaEncoding::kSeparate
      ? at::zeros({meta_numel}, options.dtype(at::kFloat))
      : wire.narrow(0, numel, meta_numel);
  meta_host = at::zeros({meta_numel}, at::TensorOptions().dtype(at::kDouble));
  meta_values.assign(static_cast<size_t>(kMetaHeader + n), 0.0);
  if (!meta.is_cpu()) {
    meta_staging = at::zeros({meta_numel}, at::TensorOptions().dtype(meta.scalar_type()));
  }
  // Rounding to a wire no wider than the bucket loses bits: error feedback
  // keeps them (a wider wire loses nothing).
  if (config.error_feedback && compressed && at::elementSize(wire_dtype) <= at::elementSize(dtype)) {
    residual = at::zeros({numel}, options);
  }
  int64_t offset = 0;
  views.reserve(params.size());
  for (size_t index : params) {
    const auto& p = all[index];
    auto flat = gradients.narrow(0, offset, p.numel());
    // Views keep the parameter's strides (channels_last and other dense
    // layouts): torch's gradient layout contract then holds, with no warning
    // and no extra copy when backward accumulates into a bucket view.
    views.push_back(p.is_non_overlapping_and_dense() && !p.is_contiguous()
                        ? flat.as_strided(p.sizes(), p.strides())
                        : flat.view(p.sizes()));
    offset += p.numel();
  }
}

int64_t Bucket::bytes() const {
  int64_t total = wire.numel() * static_cast<int64_t>(wire.element_size());
  if (encoding == MetaEncoding::kSeparate) {
    total += meta.numel() * static_cast<int64_t>(meta.element_size());
  }
  return total;
}

void Bucket::write_meta(const std::vector<double>& values) {
  const auto n = static_cast<int64_t>(params.size());
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(values.size()) == kMetaHeader + n);
  if (encoding != MetaEncoding::kDigits) {
    meta.copy_(at::from_blob(const_cast<double*>(values.data()),
                             {static_cast<int64_t>(values.size())}, at::kDouble));
    return;
  }
  std::vector<double> encoded;
  encoded.reserve(static_cast<size_t>(meta.numel()));
  const uint64_t digit_mask = (uint64_t{1} << digit_bits) - 1;
  for (int64_t f = 0; f < kMetaHeader; ++f) {
    const double v = values[static_cast<size_t>(f)];
    TORCH_INTERNAL_ASSERT(v >= 0 && v <= max_meta_value(static_cast<MetaField>(f)),
        "gradaccum: meta field ", f, " = ", v, " is out of the encodable range");
    auto fixed = static_cast<uint64_t>(std::llround(std::ldexp(v, field_fraction_bits(f))));
    for (int64_t d = 0; d < field_digits(f, digit_bits); ++d) {
      encoded.push_back(static_cast<double>(fixed & digit_mask));
      fixed >>= digit_bits;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    encoded.push_back(values[static_cast<size_t>(kMetaHeader + i)] != 0 ? 1.0 : 0.0);
  }
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(encoded.size()) == meta.numel());
  meta.copy_(at::from_blob(encoded.data(), {meta.numel()}, at::kDouble));
}

const double* Bucket::meta_on_host() const {
  if (meta_staging.defined()) {
    meta_staging.copy_(meta); // (same dtype: a plain copy from the device)
    meta_host.copy_(meta_staging);
  } else {
    meta_host.copy_(meta);
  }
  return meta_host.const_data_ptr<double>();
}

const std::vector<double>& Bucket::read_meta() const {
  const double* data = meta_on_host();
  const auto n = static_cast<int64_t>(params.size());
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(meta_values.size()) == kMetaHeader + n,
                        "gradaccum: a bucket's decoded meta has the wrong size");
  auto* values = meta_values.data();
  if (encoding != MetaEncoding::kDigits) {
    std::copy(data, data + kMetaHeader + n, values);
    return meta_values;
  }
  int64_t at = 0;
  for (int64_t f = 0; f < kMetaHeader; ++f) {
    // Each digit's sum is an exact integer; recombined in double: exact for
    // the integer fields, within 2^-53 relative for the weight.
    double value = 0;
    for (int64_t d = 0; d < field_digits(f, digit_bits); ++d) {
      value += std::ldexp(data[at++], static_cast<int>(d * digit_bits) - field_fraction_bits(f));
    }
    values[f] = value;
  }
  std::copy(data + at, data + at + n, values + kMetaHeader);
  return meta_values;
}

} // namespace gradaccum
