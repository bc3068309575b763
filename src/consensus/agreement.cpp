#include "consensus/agreement.h"

#include <c10/util/irange.h>

#include <cmath>
#include <sstream>

namespace gradaccum::detail {

namespace {

double dtype_code(const std::optional<at::ScalarType>& dtype) {
  return dtype ? static_cast<double>(*dtype) : -1.0;
}

} // namespace

const std::vector<Agreement>& agreements() {
  using I = AgreementInputs;
  static const std::vector<Agreement> table{
      {"steps", Shown::Number, [](const I& in) { return static_cast<double>(in.rule.steps); },
       true, kSteps, true, nullptr},
      {"reduction", Shown::Reduction,
       [](const I& in) { return static_cast<double>(static_cast<int>(in.rule.reduction)); },
       true, kReductionMode, true, nullptr},
      {"what this collective is (a checkpoint's state_dict() on some ranks, a window's "
       "reduction on others), or whether it rebuilds the buckets after it (rebuild_buckets "
       "differs across ranks?); the code is 0/1 for a window/checkpoint, plus 2 while a "
       "rebuild is pending",
       Shown::Number, [](const I& in) { return static_cast<double>(in.kind); }, false, kKind, true, nullptr},
      {"the window number", Shown::Number, [](const I& in) { return static_cast<double>(in.window); },
       false, kWindow, false,
       "Some rank ran a reduction the others did not (flush() on some ranks only, or a failed "
       "micro-step handled differently)"},
      {"bucket_cap_mb", Shown::Number, [](const I& in) { return in.options.bucket_cap_mb(); },
       true, kMetaHeader, false, nullptr},
      {"first_bucket_cap_mb", Shown::Number, [](const I& in) { return in.options.first_bucket_cap_mb(); },
       true, kMetaHeader, false, nullptr},
      {"gradient_as_bucket_view", Shown::Number,
       [](const I& in) { return in.options.gradient_as_bucket_view() ? 1.0 : 0.0; },
       true, kMetaHeader, false, nullptr},
      {"broadcast_buffers", Shown::Number, [](const I& in) { return in.options.broadcast_buffers() ? 1.0 : 0.0; },
       true, kMetaHeader, false, nullptr},
      {"rebuild_buckets", Shown::Number, [](const I& in) { return in.options.rebuild_buckets() ? 1.0 : 0.0; },
       true, kMetaHeader, false, nullptr},
      {"accumulate_dtype", Shown::Dtype, [](const I& in) { return dtype_code(in.rule.accumulate_dtype); },
       true, kMetaHeader, false, nullptr},
      {"comm_dtype", Shown::Dtype, [](const I& in) { return dtype_code(in.rule.comm_dtype); },
       true, kMetaHeader, false, nullptr},
      {"error_feedback", Shown::Number, [](const I& in) { return in.rule.error_feedback ? 1.0 : 0.0; },
       true, kMetaHeader, false, nullptr},
      {"the number of trainable parameters", Shown::Number,
       [](const I& in) { return static_cast<double>(in.parameters); }, true, kMetaHeader, false, nullptr},
  };
  return table;
}

std::string show(Shown shown, double value) {
  switch (shown) {
    case Shown::Reduction:
      // Another rank's code may be anything: only valid ones have a name.
      return value == 0 || value == 1 || value == 2
          ? to_string(static_cast<Reduction>(static_cast<int>(value)))
          : "?";
    case Shown::Dtype:
      return value < 0 ? "None" : c10::toString(static_cast<at::ScalarType>(static_cast<int>(value)));
    case Shown::Number:
      break;
  }
  if (value == std::floor(value) && std::abs(value) < 9.0e15) {
    return std::to_string(static_cast<int64_t>(value));
  }
  std::ostringstream out;
  out << value;
  return out.str();
}

std::string construction_disagreement(const Agreement& agreement, const std::vector<double>& values) {
  std::ostringstream out;
  out << "gradaccum: the ranks disagree on " << agreement.what << " (";
  for (const auto r : c10::irange(values.size())) {
    out << (r ? ", " : "") << "rank " << r << ": " << show(agreement.shown, values[r]);
  }
  out << "); every rank must build its Accumulator with the same options and model";
  return out.str();
}

std::string window_disagreement(const std::string& where, const Agreement& agreement,
                                const HeaderValues& values) {
  std::ostringstream out;
  out << where << ": the ranks disagree on " << agreement.what << ": this rank (rank " << values.rank
      << ") has " << show(agreement.shown, static_cast<double>(values.mine));
  if (values.other) {
    out << ", rank " << (1 - values.rank) << " has " << show(agreement.shown, static_cast<double>(*values.other));
  } else {
    out << " (mean over the " << values.world << " ranks: " << values.mean << ")";
  }
  out << ". " << (agreement.remedy ? agreement.remedy : "Every rank must use the same options")
      << ". The window was dropped on every rank";
  return out.str();
}

std::string mispaired(const std::string& where, int64_t bucket) {
  return where + ": collectives were mis-paired across ranks (bucket " + std::to_string(bucket) +
      " met another bucket on some rank): the ranks' calls diverged. The window was dropped on "
      "every rank";
}

namespace {

// What the others read about the one rank `who` that dropped the window.
std::string cause_elsewhere(int64_t who, AbortReason why) {
  std::ostringstream cause;
  switch (why) {
    case AbortReason::EpochEnded:
      cause << "rank " << who << " went on training after other ranks had ended the epoch "
            << "with flush(); every rank must run the same number of full windows and call "
            << "flush() at the end of each epoch";
      break;
    case AbortReason::WeightTooLarge:
      cause << "rank " << who << "'s window weight (micro-steps or items) is larger than "
            << static_cast<int64_t>(Bucket::max_meta_value(kWeight)) << ", the most a bf16/fp16 "
            << "bucket's meta carries exactly";
      break;
    case AbortReason::WeightTooSmall:
      cause << "rank " << who << "'s window weight (its num_items summed over the window) is "
            << "below " << Bucket::min_meta_weight() << " (2^-13), too small for a bf16/fp16 "
            << "bucket's meta to carry exactly; count items in larger units, or use float32 "
            << "parameters and comm_dtype";
      break;
    case AbortReason::GradientsChanged:
      cause << "on rank " << who << " the accumulated gradients were cleared or changed outside "
            << "the Accumulator in the middle of the window (optimizer.zero_grad() or "
            << "model.zero_grad() between micro-steps? clear them only after step() returns True)";
      break;
    case AbortReason::ForeignReducer:
      cause << "rank " << who << "'s parameters carry another reducer's gradient hooks (the "
            << "model is also wrapped in torch DDP there?)";
      break;
    case AbortReason::Closed:
      cause << "rank " << who << " destroyed its Accumulator during the synchronising backward";
      break;
    default:
      cause << "the synchronising backward (or a micro-step of the window) failed on rank "
            << who << " (its own error is raised there)";
      break;
  }
  return cause.str();
}

} // namespace

std::string dropped_elsewhere(const std::string& where, int64_t aborting, int64_t who, AbortReason why) {
  if (aborting == 1 && why == AbortReason::ClosedWindowNotStepped) {
    return where + " (flush) was dropped on every rank: rank " + std::to_string(who) +
        " could not step the window it had closed before this flush() (its own error is raised "
        "there), while the other ranks stepped theirs: the replicas differ from here on. Resume "
        "every rank from a checkpoint";
  }
  const auto cause = aborting > 1
      ? std::to_string(aborting) + " ranks could not contribute their window (their synchronising "
        "backward failed, or they left the epoch early)"
      : cause_elsewhere(who, why);
  return where + " was dropped on every rank: " + cause + ". The window's gradients were cleared "
      "on every rank and no optimizer step was taken; training can go on from the next window";
}

std::string dropped_here(const std::string& where, int rank, AbortReason why, double weight) {
  if (why == AbortReason::ClosedWindowNotStepped) {
    return where + " (flush): this rank (rank " + std::to_string(rank) + ") could not step the "
        "window it had closed before this flush(), while the other ranks stepped theirs: the "
        "replicas differ from here on, and the flush was dropped on every rank. Resume every rank "
        "from a checkpoint";
  }
  auto message = where + ": this rank (rank " + std::to_string(rank) + ") could not contribute its "
      "window, so the window was dropped on every rank (its gradients cleared, no optimizer "
      "step); training can go on from the next window";
  switch (why) {
    case AbortReason::WeightTooLarge:
      message += ". Why: this rank's window weight " + std::to_string(weight) +
          " is larger than a bf16/fp16 bucket's meta carries";
      break;
    case AbortReason::WeightTooSmall:
      message += c10::str(". Why: this rank's window weight ", weight,
                          " is smaller than a bf16/fp16 bucket's meta carries exactly");
      break;
    case AbortReason::GradientsChanged:
      message += ". Why: the accumulated gradients were cleared or changed outside the "
          "Accumulator in the middle of the window (optimizer.zero_grad() or "
          "model.zero_grad() between micro-steps?); clear them only after step() returns "
          "True, or drop a window with the Accumulator's zero_grad()";
      break;
    case AbortReason::ForeignReducer:
      message += ". Why: another reducer's hooks are on this rank's parameters";
      break;
    case AbortReason::EpochEnded:
      message += ". Why: the other ranks had ended the epoch with flush()";
      break;
    default:
      break;
  }
  return message;
}

} // namespace gradaccum::detail
