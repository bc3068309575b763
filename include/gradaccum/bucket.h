#pragma once

#include <gradaccum/options.h>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace gradaccum {

/// Groups parameters into buckets, as torch DDP does: by (dtype, device), walking
/// the parameters in the order backward makes their gradients ready, closing a
/// bucket once it holds `first_cap_bytes` (the first bucket of each group) or
/// `cap_bytes` (the others). That order is `ready_order` (a permutation of the
/// indices: the order a backward was seen to produce) when given, else reverse
/// registration order (the usual guess). Returns indices into `params`;
/// buckets are ordered by when backward is expected to fill them.
std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<at::Tensor>& params,
    int64_t first_cap_bytes,
    int64_t cap_bytes,
    const std::vector<size_t>& ready_order = {});

/// Whether the launcher put every rank on this host: LOCAL_WORLD_SIZE and
/// WORLD_SIZE are both set, positive integers, and equal (torchrun sets both).
/// False when either is missing or malformed: nothing tells (mp.spawn,
/// Lightning's own launcher, srun and mpirun do not set LOCAL_WORLD_SIZE), and
/// an unset `bucket_cap_mb` then takes the rule for several hosts.
bool launched_on_one_host();

/// The bucket cap, in bytes, that an unset `ReducerOptions::bucket_cap_mb`
/// means for these parameters: with every rank on one host (`one_host`),
/// torch DDP's fixed 25 MiB; across hosts, a sixteenth of their bytes, at
/// least 1 MiB and at most 25 MiB. Note [The default bucket cap] in
/// src/buckets/bucket.cpp says why.
int64_t default_bucket_cap_bytes(const std::vector<at::Tensor>& params, bool one_host);

/// The same, for this process's launch (launched_on_one_host()): the cap an
/// Accumulator built here with an unset `bucket_cap_mb` would use.
int64_t default_bucket_cap_bytes(const std::vector<at::Tensor>& params);

// Note [Bucket meta layout]
// Every bucket's collective reduces its `wire`: `[gradients | meta]`, one
// all-reduce per bucket whatever the dtypes. `meta` is a header of
// `MetaField`s followed by one has-gradient flag per parameter, and the
// collective sums all of it over ranks, so with no collective of its own
// every rank learns:
//  - the window's divisor (kWeight: items or micro-steps, all ranks),
//  - how many ranks closed a partial window with flush() (kFlushing), how
//    many of those windows hold micro-steps (kFlushingSteps), and how many
//    of the ranks have joined: are out of data and shadow the others'
//    reductions until every rank has (kJoined; Note [Joining]),
//  - how many ranks drop the window (kAbort; Note [Dropping a window]),
//    their ranks and their ranks' squares summed (which one, when one; which
//    two, when two), and how many for each AbortReason (kAbortReasons...):
//    among them those that left their join() block with an exception (Note
//    [Leaving join() with an exception]), those that were interrupted (Note
//    [An interrupt tells every rank to end]) and those that could not step a
//    window they closed (the replicas then differ: every rank must say so),
//  - whether every rank agrees on what must be equal (the bucket's index, and
//    which reducer sends it, the window number, steps, the reduction and the
//    kind of reduction: Note [What ranks agree on] in
//    src/consensus/agreement.h): each such value v is
//    sent as (v mod M, (v mod M)^2); over W ranks the values are all equal iff
//    W * sum(v^2) == sum(v)^2. M is chosen so both sums stay exact (see
//    consensus_modulus() in src/consensus/window_header.cpp).
//  - how many ranks did not step the last window every rank reduced, and
//    their ranks summed (kUnstepped, kUnsteppedRank; Note [A window not
//    stepped on some ranks]),
//  - how many ranks send a weight that is not an integer (kInexactWeight):
//    with none, and a sum below 2^24 (2^53 where every bucket's meta is
//    float64 or digits), every bucket's summed kWeight is the window's divisor
//    bit for bit, whatever order a collective sums it in (Note [Writing back
//    while the last buckets reduce]),
//  - the window's loss, summed over micro-steps and ranks (kLoss), and its user
//    metrics after it (kMetric0...; float32 and float64 meta only:
//    digit-encoded meta sends 0 there),
//  - which parameters got no gradient on any rank (the flags).
// How the header travels depends on the wire's dtype (MetaEncoding):
//  - float32/float64 wires carry the numbers as they are (kPlain).
//  - bf16/fp16 wires hold small integers exactly only (256, 2048), so each
//    header value is sent as base-2^b digits, one element each (kDigits):
//    digit-wise sums stay exact integers when W * (2^b - 1) fits, and the
//    reader recombines them (the weight as fixed point with 32 fractional
//    bits; a field in which each rank sends 0 or 1, the counts kFlushing,
//    kFlushingSteps, kAbort, kJoined, kInexactWeight, kUnstepped and
//    kAbortReasons..., as
//    one digit;
//    every other field as an integer below 2^32). The has-gradient flags go
//    as 0/1: a sum over ranks only has to be told apart from 0.
//  - A half-precision wire with more ranks than digits allow sends the header
//    as a float32 tensor of its own, a second collective (kSeparate).
// The reducer writes the header in launch_bucket() (encode_header(), then
// write_meta()) and reads it back once per reduction (read_meta(), then
// read_headers()); the layout is the same on every rank because the buckets
// and the options are (checked at construction, or by the index field at the
// first window).
/// AbortReason's values after None (one header field each: kAbortReasons).
constexpr int64_t kAbortReasonSlots = 14;
/// Up to this many ranks the header names two ranks that drop a window: the
/// sum of two ranks' squares, 2 * 2895^2, stays exact in float32 meta (2^24).
constexpr int64_t kNamedAbortersWorld = 2896;

enum MetaField : int64_t {
  kWeight = 0,
  kFlushing,
  kFlushingSteps, ///< of them, ranks whose partial window holds micro-steps (Note [A flushed window with no weight])
  kAbort, ///< ranks that drop the window (Note [Dropping a window])
  kAbortRank, ///< their ranks summed
  kAbortRankSquare, ///< their ranks' squares summed (0 above kNamedAbortersWorld ranks)
  kAbortReasons, ///< then, for AbortReason r >= 1, the ranks dropping it for r (kAbortReasons + r - 1)
  kWindow = kAbortReasons + kAbortReasonSlots,
  kWindowSquare,
  kSteps,
  kStepsSquare,
  kReductionMode,
  kReductionModeSquare,
  kBucketIndex,
  kBucketIndexSquare,
  kKind, ///< 0: a window's reduction, 1: a checkpoint's snapshot of a half-done window, 2: a refresh's check, 3: a plain loss.backward()'s (the manual path); +4 while a bucket rebuild is pending
  kKindSquare,
  kInstance, ///< which reducer (Accumulator) of the group sends it (Note [Which Accumulator a collective belongs to])
  kInstanceSquare,
  kJoined, ///< ranks in Accumulator::join(): out of data, shadowing the others (Note [Joining])
  kInexactWeight, ///< ranks whose kWeight is not an integer (its sum may round by position)
  kUnstepped, ///< ranks that did not step the window before (Note [A window not stepped on some ranks])
  kUnsteppedRank, ///< their ranks summed
  kLoss, ///< the window's micro-batch losses summed (Note [The window's loss rides in the header])
  kMetric0, ///< then the window's user metrics summed, kMaxWindowMetrics of them (unused ones 0)
  kMetaHeader = kMetric0 + kMaxWindowMetrics, // the header's length
};

/// `sum += grad` for a wider `sum` (accumulate_dtype). On the CPU, torch's
/// mixed-dtype add is about 2x slower than widening first and adding (4.2M
/// bf16 elements into float32, one thread: 5.3 ms against 2.4 ms), so it
/// widens first there; CUDA's fused mixed-dtype add is kept.
void add_widened(at::Tensor& sum, const at::Tensor& grad);

/// How a bucket's meta travels (see Note [Bucket meta layout]).
enum class MetaEncoding {
  kPlain, ///< numbers in the wire's float32/float64 tail
  kDigits, ///< exact base-2^b digits in the wire's bf16/fp16 tail
  kSeparate, ///< a float32 tensor of its own: a second collective
};

/// The dtypes and the group a bucket is built for.
struct BucketConfig {
  /// Sum the window's gradients in this dtype when wider than the parameters'.
  std::optional<at::ScalarType> accumulate_dtype;
  /// The dtype on the wire, when other than the bucket's (comm_dtype).
  std::optional<at::ScalarType> comm_dtype;
  /// Ranks summing the meta (decides the digit base).
  int world = 1;
  /// Keep each rank's compression residual for the next window.
  bool error_feedback = false;
};

/// One flat buffer of gradients, reduced by one collective (see Note [Bucket
/// meta layout]).
struct Bucket {
  /// Builds the buffer and the per-parameter views for `params[indices]`.
  Bucket(const std::vector<at::Tensor>& params, std::vector<size_t> indices,
         const BucketConfig& config = {});

  std::vector<size_t> params; ///< indices into the reducer's parameters
  std::vector<at::Tensor> views; ///< one per parameter, shaped like it
  at::Tensor buffer; ///< the bucket's storage: gradients, and the meta when it is the wire
  at::Tensor gradients; ///< buffer's gradient part (the bucket's dtype)
  at::Tensor wire; ///< what the collective reduces: `buffer`, or its compressed copy
  at::Tensor wire_gradients; ///< wire's gradient part (`gradients` unless compressed)
  at::Tensor meta; ///< [header (MetaField), flags…], encoded as `encoding` says
  /// `meta` read back as float64 on the host, and (when `meta` is on a
  /// device) its copy there: allocated with the bucket, so reading the summed
  /// meta allocates nothing (Note [Reading the window allocates nothing]).
  at::Tensor meta_host, meta_staging;
  /// The last meta read back, decoded: header then flags (`kMetaHeader +
  /// params.size()` values, sized with the bucket). read_meta() writes it.
  mutable std::vector<double> meta_values;
  MetaEncoding encoding = MetaEncoding::kPlain;
  int digit_bits = 0; ///< b of kDigits
  /// The buffer is wider than the parameters (accumulate_dtype): micro-steps'
  /// gradients are summed in it and `.grad` holds none between them.
  bool accumulating = false;
  /// The wire has a dtype of its own (comm_dtype): launch_bucket() fills it.
  bool compressed = false;
  /// The wire is bf16/fp16: each rank scales before rounding (Note [Scaling
  /// before the sum]).
  bool prescaled = false;
  /// Error feedback: what compression lost of this rank's last window, in the
  /// bucket's dtype and unscaled; added to the next window before compressing.
  at::Tensor residual;

  // State of the reduction in flight.
  size_t pending = 0; ///< parameters not yet ready
  std::vector<size_t> missing; ///< slots with no local gradient (sent as zeros)
  std::vector<c10::intrusive_ptr<c10d::Work>> works;

  /// Bytes one launch hands to the collectives.
  int64_t bytes() const;
  /// Collectives one launch takes (2 with MetaEncoding::kSeparate).
  int64_t collectives() const {
    return encoding == MetaEncoding::kSeparate ? 2 : 1;
  }
  /// Writes header and flags (`kMetaHeader + params.size()` values, each >= 0)
  /// into `meta`, encoded.
  void write_meta(const std::vector<double>& values);
  /// Copies `meta` into `meta_host` (one copy from the device, if any) and
  /// returns its values.
  const double* meta_on_host() const;
  /// Reads the (summed) header and flags back through meta_on_host() into
  /// `meta_values`, decoded, and returns them; allocates nothing. It writes
  /// the bucket's host copies (meta_host, meta_values): the reducer calls it
  /// from the reduction's thread only, once this bucket's collectives have
  /// completed (other buckets' may still be in flight).
  const std::vector<double>& read_meta() const;
  /// The largest per-rank value of a field that write_meta() carries exactly
  /// (kWeight: with 32 fractional bits).
  static double max_meta_value(MetaField field);
  /// The smallest non-zero per-rank weight that digit-encoded meta (kDigits)
  /// carries to within 2^-20 of itself: its 32 fractional bits round a weight
  /// by up to 2^-33, so 2^-13 and above.
  static double min_meta_weight();
};

} // namespace gradaccum
