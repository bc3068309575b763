#include "reducer/state.h"

#include <cmath>
#include <sstream>

namespace gradaccum {

namespace detail {

// The modulus M of Note [Bucket meta layout]: the largest power of two with
// world * (M - 1)^2 and world * M exact in the meta's dtype.
int64_t consensus_modulus(int world, at::ScalarType meta_dtype) {
  const int mantissa = meta_dtype == at::kDouble ? 53 : 24;
  int world_bits = 0;
  while ((int64_t{1} << world_bits) < world) {
    ++world_bits;
  }
  const int bits = std::max(1, std::min(20, (mantissa - world_bits) / 2));
  return int64_t{1} << bits;
}

const char* reduction_name(int64_t code) {
  switch (code) {
    case 0: return "mean";
    case 1: return "sum";
    case 2: return "items";
    default: return "?";
  }
}

} // namespace detail

void Reducer::State::check_consensus(const at::Tensor& summed) {
  const auto h = summed.accessor<double, 2>();
  const auto n = static_cast<int64_t>(buckets.size());
  const double w = world;
  const auto all_equal = [&](int64_t b, int64_t field) {
    return w * h[b][field + 1] == h[b][field] * h[b][field];
  };
  for (int64_t b = 0; b < n; ++b) {
    if (!all_equal(b, kBucketIndex)) {
      fail("gradaccum: " + window_label() + ": collectives were mis-paired across ranks "
           "(bucket " + std::to_string(b) + " met another bucket on some rank): the ranks' "
           "calls diverged. The window was dropped on every rank");
    }
  }
  const auto last = n - 1;
  const auto aborting = static_cast<int64_t>(std::llround(h[last][kAbort]));
  if (aborting > 0) {
    std::ostringstream cause;
    const auto who = static_cast<int64_t>(std::llround(h[last][kAbortRank]));
    const auto why = static_cast<AbortReason>(aborting == 1 ? std::llround(h[last][kAbortReason]) : 0);
    if (aborting > 1) {
      cause << aborting << " ranks could not contribute their window (their synchronising "
            << "backward failed, or they left the epoch early)";
    } else if (why == AbortReason::EpochEnded) {
      cause << "rank " << who << " went on training after other ranks had ended the epoch "
            << "with flush(); every rank must run the same number of full windows and call "
            << "flush() at the end of each epoch";
    } else if (why == AbortReason::WeightTooLarge) {
      cause << "rank " << who << "'s window weight (micro-steps or items) is larger than "
            << static_cast<int64_t>(Bucket::max_meta_value(kWeight)) << ", the most a bf16/fp16 "
            << "bucket's meta carries exactly";
    } else if (why == AbortReason::WeightTooSmall) {
      cause << "rank " << who << "'s window weight (its num_items summed over the window) is "
            << "below " << Bucket::min_meta_weight() << " (2^-13), too small for a bf16/fp16 "
            << "bucket's meta to carry exactly; count items in larger units, or use float32 "
            << "parameters and comm_dtype";
    } else if (why == AbortReason::GradientsChanged) {
      cause << "on rank " << who << " the accumulated gradients were cleared or changed outside "
            << "the Accumulator in the middle of the window (optimizer.zero_grad() or "
            << "model.zero_grad() between micro-steps? clear them only after step() returns True)";
    } else if (why == AbortReason::ForeignReducer) {
      cause << "rank " << who << "'s parameters carry another reducer's gradient hooks (the "
            << "model is also wrapped in torch DDP there?)";
    } else if (why == AbortReason::Closed) {
      cause << "rank " << who << " destroyed its Accumulator during the synchronising backward";
    } else if (why == AbortReason::ClosedWindowNotStepped) {
      fail("gradaccum: " + window_label() + " (flush) was dropped on every rank: rank " +
           std::to_string(who) + " could not step the window it had closed before this flush() "
           "(its own error is raised there), while the other ranks stepped theirs: the replicas "
           "differ from here on. Resume every rank from a checkpoint");
    } else {
      cause << "the synchronising backward (or a micro-step of the window) failed on rank "
            << who << " (its own error is raised there)";
    }
    fail("gradaccum: " + window_label() + " was dropped on every rank: " + cause.str() +
         ". The window's gradients were cleared on every rank and no optimizer step was "
         "taken; training can go on from the next window");
  }
  struct Check {
    MetaField field;
    const char* what;
    int64_t mine;
  };
  const Check checks[] = {
      {kSteps, "steps", rule.steps},
      {kReductionMode, "reduction", static_cast<int64_t>(rule.reduction)},
      {kKind, "what this collective is (a checkpoint's state_dict() on some ranks, a window's "
              "reduction on others), or whether it rebuilds the buckets after it (rebuild_buckets "
              "differs across ranks?); the code is 0/1 for a window/checkpoint, plus 2 while a "
              "rebuild is pending", kind_code()},
      {kWindow, "the window number", sequence},
  };
  for (const auto& check : checks) {
    if (all_equal(last, check.field)) {
      continue;
    }
    const auto show = [&](int64_t v) {
      return check.field == kReductionMode ? std::string(reduction_name(v)) : std::to_string(v);
    };
    std::ostringstream message;
    message << "gradaccum: " << window_label() << ": the ranks disagree on " << check.what
            << ": this rank (rank " << rank << ") has " << show(check.mine);
    const auto mine_mod = ((check.mine % modulus) + modulus) % modulus;
    if (world == 2 && check.field != kWindow) {
      const auto other = static_cast<int64_t>(std::llround(h[last][check.field])) - mine_mod;
      message << ", rank " << (1 - rank) << " has " << show(other);
    } else {
      message << " (mean over the " << world << " ranks: "
              << h[last][check.field] / w + static_cast<double>(check.mine - mine_mod) << ")";
    }
    if (check.field == kWindow) {
      message << ". Some rank ran a reduction the others did not (flush() on some ranks "
                 "only, or a failed micro-step handled differently)";
    } else {
      message << ". Every rank must use the same options";
    }
    message << ". The window was dropped on every rank";
    fail(message.str());
  }
}

} // namespace gradaccum
