#include "consensus/agreement.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace gradaccum::detail {

namespace {

double dtype_code(const std::optional<at::ScalarType>& dtype) {
  return dtype ? static_cast<double>(*dtype) : -1.0;
}

// The metric names as one number: FNV-1a over the names and their order, cut
// to 48 bits (exact in a double); 0 for none.
double names_code(const std::vector<std::string>& names) {
  uint64_t hash = 1469598103934665603ULL;
  for (const auto& name : names) {
    for (const unsigned char c : name + '\0') {
      hash = (hash ^ c) * 1099511628211ULL;
    }
  }
  return names.empty() ? 0.0 : static_cast<double>(hash >> 16);
}

} // namespace

const std::vector<Agreement>& agreements() {
  using I = AgreementInputs;
  static const std::vector<Agreement> table{
      // First: when it differs, the others (steps, the window number) are
      // another Accumulator's, not a mistake in this one's options.
      {"which Accumulator this collective belongs to (a number each Accumulator over this process group gets "
       "when built, the same on every rank and none shared by two alive; refresh_parameters() gives a new one)", Shown::Number, [](const I& in) { return static_cast<double>(in.instance); },
       false, kInstance, true,
       "Several Accumulators over one process group pair their collectives in launch order: every rank must "
       "build them in the same order (built in another order, each was numbered, and had its parameters "
       "broadcast from rank 0's, as another one), and run their windows in the same order, with the same "
       "number of micro-batches for each (equal shards); docs/design.md, Limits"},
      {"steps", Shown::Number, [](const I& in) { return static_cast<double>(in.rule.steps); },
       true, kSteps, true, nullptr},
      {"reduction", Shown::Reduction,
       [](const I& in) { return static_cast<double>(static_cast<int>(in.rule.reduction)); },
       true, kReductionMode, true, nullptr},
      // (Its remedy depends on which part differs: kind_remedy().)
      {"what this collective is, whether a bucket rebuild follows it, or whether its window was resumed from a rank-independent state",
       Shown::Kind, [](const I& in) { return static_cast<double>(in.kind); }, false, kKind, true, nullptr},
      {"the window number", Shown::Number, [](const I& in) { return static_cast<double>(in.window); },
       false, kWindow, false,
       "Some rank ran a reduction the others did not (flush() on some ranks only, a failed "
       "micro-step handled differently, or acc.load_state_dict() refused or skipped on some ranks)"},
      {"bucket_cap_mb", Shown::Optional, [](const I& in) { return in.options.bucket_cap_mb().value_or(-1.0); },
       true, kMetaHeader, false, nullptr},
      // An unset cap follows the launch (Note [The default bucket cap]);
      // an explicit one does not, and reads 0 here on every rank.
      {"whether every rank runs on one host (LOCAL_WORLD_SIZE equal to WORLD_SIZE), which an unset "
       "bucket_cap_mb follows (25 MiB on one host, a sixteenth of the model across hosts)",
       Shown::Flag,
       [](const I& in) { return !in.options.bucket_cap_mb() && in.one_host ? 1.0 : 0.0; },
       true, kMetaHeader, false,
       // Compared at construction only: the remedy ends that error.
       "launch every rank alike (torchrun sets both on every node), or pass bucket_cap_mb explicitly"},
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
      // The step's treatment of the reduced window: a rank that clips, skips or
      // unscales differently steps another gradient (a rank that scales its
      // loss and one that does not would even sum different units).
      {"max_grad_norm", Shown::Optional, [](const I& in) { return in.rule.max_grad_norm.value_or(-1.0); },
       true, kMetaHeader, false, nullptr},
      {"nonfinite", Shown::NonFinite, [](const I& in) { return static_cast<double>(in.rule.nonfinite); },
       true, kMetaHeader, false, nullptr},
      {"the loss scale (grad_scaler's or loss_scaler's scale; None: no loss scaling)", Shown::Optional,
       [](const I& in) { return in.rule.loss_scaler ? in.rule.loss_scaler->init_scale() : -1.0; },
       true, kMetaHeader, false,
       "every rank must scale its loss alike: the same grad_scaler settings (enabled, init_scale) and the "
       "same scaler state (load it on every rank)"},
      {"the loss scaler's growth_factor", Shown::Optional,
       [](const I& in) { return in.rule.loss_scaler ? in.rule.loss_scaler->growth_factor() : -1.0; },
       true, kMetaHeader, false, nullptr},
      {"the loss scaler's backoff_factor", Shown::Optional,
       [](const I& in) { return in.rule.loss_scaler ? in.rule.loss_scaler->backoff_factor() : -1.0; },
       true, kMetaHeader, false, nullptr},
      {"the loss scaler's growth_interval", Shown::Optional,
       [](const I& in) {
         return in.rule.loss_scaler ? static_cast<double>(in.rule.loss_scaler->growth_interval()) : -1.0;
       },
       true, kMetaHeader, false, nullptr},
      {"the metric names (AccumulatorOptions::metrics, in their order)", Shown::Names,
       [](const I& in) { return names_code(in.rule.metrics); }, true, kMetaHeader, false, nullptr,
       [](const I& in) { return &in.rule.metrics; }},
      // Shapes alone (check_shapes_match) pass two ranks that unfroze
      // different layers of one shape: rank 0's values would be broadcast into
      // the other layer, and the windows would sum different layers' gradients.
      {"the trainable parameters' names (in the Accumulator's order)", Shown::Names,
       [](const I& in) { return in.names ? names_code(*in.names) : 0.0; }, true, kMetaHeader, false,
       "every rank must train the same parameters, under the same names: the same layers frozen "
       "(requires_grad=False) and the same module passed",
       [](const I& in) { return in.names; }},
      // (After the names, which show the first that differs: where names
      // are not known, the count alone.)
      {"the number of trainable parameters", Shown::Number,
       [](const I& in) { return static_cast<double>(in.parameters); }, true, kMetaHeader, false,
       "every rank must train the same parameters: the same layers frozen (requires_grad=False) and the same "
       "module passed"},
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
    case Shown::Flag:
      return value == 1 ? "yes" : value == 0 ? "no" : "?";
    case Shown::NonFinite: {
      const auto code = static_cast<int>(value);
      return value == code && code >= 0 && code <= static_cast<int>(NonFinite::SkipMicroBatch)
          ? "'" + to_string(static_cast<NonFinite>(code)) + "'"
          : "?";
    }
    case Shown::Kind: {
      // State::kind_code(): the kind, plus 4 while a bucket rebuild is pending,
      // plus 8 in a window resumed from a rank-independent state.
      static const char* const kinds[] = {"a window's reduction", "acc.state_dict()'s snapshot of a half-done window",
                                          "acc.refresh_parameters()'s check at a window boundary",
                                          "a plain loss.backward()'s reduction (the manual path)"};
      const auto code = static_cast<int64_t>(value);
      if (value != static_cast<double>(code) || code < 0 || code > 15) {
        return "?";
      }
      return std::string(kinds[code % 4]) + (code & 4 ? " (a bucket rebuild pending)" : "") +
          (code & 8 ? " in a window resumed from a rank-independent state" : "");
    }
    case Shown::Optional:
      if (value < 0) {
        return "None";
      }
      break;
    case Shown::Number:
    case Shown::Names:
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
  out << "the ranks disagree on " << agreement.what << " (";
  for (const auto r : c10::irange(values.size())) {
    out << (r ? ", " : "") << "rank " << r << ": " << show(agreement.shown, values[r]);
  }
  out << "); "
      << (agreement.remedy ? agreement.remedy
                           : "every rank must build its Accumulator with the same options and model");
  return out.str();
}

std::string construction_disagreement(const Agreement& agreement,
                                      const std::vector<std::vector<std::string>>& names) {
  TORCH_INTERNAL_ASSERT(agreement.shown == Shown::Names && !names.empty());
  size_t longest = 0;
  for (const auto& theirs : names) {
    longest = std::max(longest, theirs.size());
  }
  const auto at = [](const std::vector<std::string>& list, size_t i) {
    return i < list.size() ? "\"" + list[i] + "\"" : std::string("none");
  };
  std::ostringstream out;
  out << "the ranks disagree on " << agreement.what;
  for (size_t i = 0; i < longest; ++i) {
    for (const auto r : c10::irange<size_t>(1, names.size())) {
      if (at(names[r], i) != at(names[0], i)) {
        out << ": the first that differs is " << at(names[0], i) << " on rank 0 and " << at(names[r], i)
            << " on rank " << r << " (position " << i << "; rank 0 has " << names[0].size() << ", rank " << r
            << " has " << names[r].size() << ")";
        return out.str() + "; " +
            (agreement.remedy ? agreement.remedy : "every rank must build its Accumulator with the same options and model");
      }
    }
  }
  // The hashes differ but the names do not: say so rather than nothing.
  return out.str() + " (their hashes differ, their names do not)";
}

namespace {

// What the ranks should do when their kind codes (State::kind_code(): the
// call, plus 4 while a bucket rebuild is pending, plus 8 in a resumed
// window) differ: by the part that differs, or all where the values are not
// known (more than 2 ranks).
//
// Note [A window resumed on some ranks only]
// A rank-independent state saved in the middle of a window holds the
// window's sums reduced over ranks; acc.load_state_dict() gives each rank its
// share of them. A rank that loaded it while another went on with its own
// sums (or loaded another) would reduce a window that counts some micro-batch
// twice and another not at all, with nothing else differing. So each such
// window says so in its kind code, and the ranks that disagree drop it.
std::string kind_remedy(const HeaderValues& values) {
  const bool known = values.other.has_value();
  // The manual path against a window: a stray plain backward, or another path.
  const bool manual = known && ((values.mine % 4 == 3 && *values.other % 4 == 0) ||
                                (values.mine % 4 == 0 && *values.other % 4 == 3));
  const std::string calls = manual
      ? "Every rank must reduce its windows the same way: acc.backward(loss) on every micro-batch, or on every "
        "rank the manual path (a plain loss.backward() outside acc.no_sync() for the window's last micro-batch). "
        "A stray plain loss.backward() on one rank reduces a window the others do not"
      : "Every rank must call acc.state_dict() at the same micro-step of a window, and "
        "acc.refresh_parameters() at the same window boundary (a rank that does not call it reduces its "
        "next window against the others' check)";
  const std::string rebuild = "rebuild_buckets differs across ranks? Every rank must use the same options";
  const std::string resumed = "A rank-independent state saved in the middle of a window must be loaded "
      "(acc.load_state_dict()) on every rank or on none: a rank that loaded it holds a share of every rank's "
      "sums, one that went on holds its own";
  const bool call_differs = known && values.mine % 4 != *values.other % 4;
  const bool rebuild_differs = known && (values.mine & 4) != (*values.other & 4);
  const bool resumed_differs = known && (values.mine & 8) != (*values.other & 8);
  if (!call_differs && !rebuild_differs && !resumed_differs) {
    return "The codes: 0 a window's reduction, 1 acc.state_dict()'s snapshot, 2 acc.refresh_parameters()'s "
        "check, 3 a plain loss.backward()'s reduction, plus 4 with a bucket rebuild pending, plus 8 in a window "
        "resumed from a rank-independent state. " + calls + "; or " + rebuild + "; or: " + resumed;
  }
  std::string out;
  for (const auto& [differs, text] : {std::pair<bool, const std::string*>{call_differs, &calls},
                                      {rebuild_differs, &rebuild}, {resumed_differs, &resumed}}) {
    if (differs) {
      out += (out.empty() ? "" : ". ") + *text;
    }
  }
  return out;
}

} // namespace

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
  out << ". "
      << (agreement.shown == Shown::Kind ? kind_remedy(values)
          : agreement.remedy             ? agreement.remedy
                                         : "Every rank must use the same options")
      << ". The window was dropped on every rank";
  return out.str();
}

std::string mispaired(const std::string& where, int64_t bucket) {
  return where + ": collectives were mis-paired across ranks (bucket " + std::to_string(bucket) +
      " met another bucket on some rank): the ranks' calls diverged. The window was dropped on "
      "every rank";
}

namespace {

// Why `who` ("rank 1", or "this rank (rank 1)") dropped the window: the one
// text of each reason, whichever rank reads it.
std::string abort_phrase(AbortReason why, const std::string& who) {
  switch (why) {
    case AbortReason::EpochEnded:
      return who + " went on training after the other ranks had ended the epoch with acc.flush(); "
          "every rank must run the same number of full windows and call acc.flush() at the end of "
          "each epoch";
    case AbortReason::WeightTooLarge:
      return c10::str(who, "'s window weight (micro-steps or items) is larger than ",
          static_cast<int64_t>(Bucket::max_meta_value(kWeight)), ", the most a bf16/fp16 bucket's "
          "meta carries exactly");
    case AbortReason::WeightTooSmall:
      return c10::str(who, "'s window weight (its num_items summed over the window) is below ",
          Bucket::min_meta_weight(), " (2^-13), too small for a bf16/fp16 bucket's meta to carry "
          "exactly; count items in larger units, or use float32 parameters and comm_dtype");
    case AbortReason::GradientsChanged:
      return "on " + who + " the accumulated gradients were cleared or changed outside the "
          "Accumulator in the middle of the window (optimizer.zero_grad() or model.zero_grad() "
          "between micro-steps, clipping or another in-place change of .grad before the window closed (clip "
          "under `if acc.window_ready:`, after its last backward, or pass max_grad_norm), a model converted "
          "there (model.double(): convert it at a window boundary, "
          "then call acc.refresh_parameters()), or a backward other than acc.backward() through these parameters, "
          "such as another model's loss?), or held a gradient no micro-step counted when it began (a "
          "plain loss.backward() at the window boundary, or .grad left before the Accumulator was "
          "built?), or acc.zero_grad() dropped its part of a window resumed in its middle from a "
          "rank-independent state, whose gradients hold a share of every rank's sums; clear them only "
          "after acc.step() returns True, or drop a window with acc.zero_grad()";
    case AbortReason::ForeignReducer:
      return who + "'s parameters carry another reducer's gradient hooks (the model is also "
          "wrapped in torch DDP there?)";
    case AbortReason::Closed:
      return who + " destroyed its Accumulator during the synchronising backward";
    case AbortReason::ClosedWindowNotStepped:
      return who + " could not step a window every rank had reduced as its data ended (its last, in acc.flush() "
          "or acc.join(), or one it shadowed in acc.join()), while other ranks stepped theirs";
    case AbortReason::OutOfMemory:
      return who + " ran out of memory in acc.run() on a micro-batch it could not split further (one row) "
          "or run again (part of its gradient had reached .grad)";
    case AbortReason::MicroBatchRefused:
      return who + " refused the micro-batch that closes the window: its acc.backward() or acc.run() "
          "rejected its loss, num_items or metrics (a loss that is not a scalar or does not require grad, a "
          "num_items that is not a number >= 0, ...) or its other arguments, found a parameter unfrozen without "
          "acc.refresh_parameters() or an inference .grad, or was called inside acc.no_sync() or "
          "torch.inference_mode()";
    case AbortReason::LeftJoin:
      return who + " left its acc.join() block with an exception";
    case AbortReason::RefreshRefused:
      return who + " refused acc.refresh_parameters() at the window boundary";
    case AbortReason::ResendFailed:
      return who + " could not round its part of the window again for the float16 wire's second all-reduce (a "
          "window far lighter than the wire's scale: Note [Re-sending a light window])";
    case AbortReason::Interrupted:
      return "the synchronising backward (or a micro-step of the window) was interrupted on " + who;
    case AbortReason::None:
    case AbortReason::BackwardFailed:
      break;
  }
  return "the synchronising backward (or a micro-step of the window) failed on " + who;
}

// Whether the rank that dropped the window raises an error of its own.
bool raised_there(AbortReason why) {
  return why == AbortReason::None || why == AbortReason::BackwardFailed ||
      why == AbortReason::ClosedWindowNotStepped || why == AbortReason::OutOfMemory ||
      why == AbortReason::MicroBatchRefused || why == AbortReason::LeftJoin ||
      why == AbortReason::RefreshRefused || why == AbortReason::ResendFailed || why == AbortReason::Interrupted;
}

// What several ranks that dropped the window did, after a count ("2 of them ran out
// of memory ..."), singular or plural alike: the shorter abort_phrase().
const char* several_phrase(AbortReason why) {
  switch (why) {
    case AbortReason::EpochEnded:
      return "went on training after other ranks had ended the epoch with acc.flush()";
    case AbortReason::Closed:
      return "destroyed the Accumulator during the synchronising backward";
    case AbortReason::ForeignReducer:
      return "carried another reducer's gradient hooks on the parameters (torch DDP?)";
    case AbortReason::GradientsChanged:
      return "had the accumulated gradients cleared or changed outside the Accumulator in the middle of the "
             "window, or a gradient no micro-step counted when it began, or dropped its part of a window "
             "resumed from a rank-independent state";
    case AbortReason::WeightTooLarge:
      return "had a window weight larger than a bf16/fp16 bucket's meta carries exactly";
    case AbortReason::WeightTooSmall:
      return "had a window weight too small for a bf16/fp16 bucket's meta to carry exactly";
    case AbortReason::ClosedWindowNotStepped:
      return "could not step a window every rank had reduced as their data ended (in acc.flush() or acc.join()), "
             "while other ranks stepped theirs";
    case AbortReason::OutOfMemory:
      return "ran out of memory in acc.run() on a micro-batch that could not be split further or run again";
    case AbortReason::MicroBatchRefused:
      return "refused the micro-batch that closes the window";
    case AbortReason::LeftJoin:
      return "left the acc.join() block with an exception";
    case AbortReason::RefreshRefused:
      return "refused acc.refresh_parameters() at the window boundary";
    case AbortReason::ResendFailed:
      return "could not round their part of the window again for the float16 wire's second all-reduce";
    case AbortReason::Interrupted:
      return "got interrupted in the synchronising backward (or a micro-step of the window)";
    case AbortReason::None:
    case AbortReason::BackwardFailed:
      break;
  }
  return "failed in the synchronising backward (or a micro-step of the window)";
}

// What a rank that could not step a window it closed means: the replicas
// differ; with shadows, which leave join() with the drop's error, training
// ends there too (Note [Training ended in join()]).
std::string replicas_differ(int64_t joined) {
  return joined > 0 ? ": the replicas differ from here on, and " + std::to_string(joined) + " rank(s) out of data in "
          "acc.join() raise this error too and leave it: end training on every rank here and resume every rank "
          "from a checkpoint"
                    : ": the replicas differ from here on. Resume every rank from a checkpoint";
}

// Note [A window dropped while ranks shadow]
// A rank in acc.join() (out of data) that reads a dropped window raises its
// error and leaves join(): the window's failure is the job's, and it cannot
// tell whether the ranks with data will go on. So with `joined` > 0 no rank
// may: the ranks with data would wait for a shadow in their next window.
// Every rank reads the same verdict, so every rank's text says so alike.
std::string consequence(AbortReason why, int64_t joined) {
  if (why == AbortReason::ClosedWindowNotStepped) {
    return replicas_differ(joined);
  }
  if (why == AbortReason::RefreshRefused && joined == 0) { // Note [A refresh pairs like a window]
    return ". No rank refreshed its parameters and no optimizer step was taken (any window a rank reduced "
        "in the refresh's place was cleared); training can go on from the next window";
  }
  std::string text = ". The window's gradients were cleared on every rank and no optimizer step was taken; ";
  if (why == AbortReason::LeftJoin) { // Note [Leaving join() with an exception]
    return text + "a rank that left its acc.join() block reduces no more: end training on every rank here (or resume every rank "
        "from a checkpoint)";
  }
  if (why == AbortReason::Interrupted) { // Note [An interrupt tells every rank to end]
    return text + "an interrupted rank (KeyboardInterrupt, SystemExit) stops: end training on every rank here (or "
        "resume every rank from a checkpoint)";
  }
  if (joined > 0) {
    return text + std::to_string(joined) + " rank(s) out of data in acc.join() raise this error too and leave "
        "it, so no next window can pair there: end training on every rank here (or resume every rank from "
        "a checkpoint)";
  }
  return text + "training can go on from the next window";
}

// Note [Every rank reads what several aborters did]
// The consequence every rank is told follows from every rank that dropped
// the window, not only from this one: a rank that could not step a window
// it closed (the others stepped theirs) means the replicas differ, whatever
// else failed beside it (unless every rank could not: then none stepped it),
// then a rank that left join(), or one that was interrupted, means nobody
// may go on. Each such count rides in the header (kAbortReasons), so every
// rank words the same consequence; with one reason only, it is that reason's.
// `unstepped`, `left` and `interrupted` count the ranks dropping the window
// for those reasons; `otherwise` is told where none did.
AbortReason told(int64_t unstepped, int64_t left, int64_t interrupted, AbortReason otherwise) {
  return unstepped > 0 ? AbortReason::ClosedWindowNotStepped
      : left > 0       ? AbortReason::LeftJoin
      : interrupted > 0 ? AbortReason::Interrupted
                        : otherwise;
}

} // namespace

AbortReason Aborters::shared() const {
  for (const auto r : c10::irange(kAbortReasonSlots)) {
    if (count > 0 && by_reason[static_cast<size_t>(r)] == count) {
      return static_cast<AbortReason>(r + 1);
    }
  }
  return AbortReason::None;
}

namespace {

// "this rank (rank 1) and 2 other ranks", "rank 3", "2 of the 4 ranks": the
// ranks a mark names (Unstepped).
std::string marked_ranks(const Unstepped& who) {
  std::ostringstream out;
  const auto others = who.count - (who.here ? 1 : 0);
  if (who.here) {
    out << "this rank (rank " << who.reader << ")";
    if (others > 0) {
      out << " and " << others << " other rank" << (others == 1 ? "" : "s");
    }
  } else if (who.count == 1 && who.rank >= 0) {
    out << "rank " << who.rank;
  } else {
    out << who.count << " of the " << who.world << " ranks";
  }
  return out.str();
}

} // namespace

std::string not_stepped(const std::string& where, const Unstepped& who, int64_t joined) {
  // Note [A window not stepped on some ranks]
  std::ostringstream out;
  out << where << ": " << marked_ranks(who) << " did not step a window every rank had reduced";
  if (who.here) {
    out << " (" << who.here << ")";
  }
  out << ", while the other ranks stepped it";
  if (!who.here) {
    out << " (acc.zero_grad() dropped the closed window there, say after acc.step() raised; a failure there "
           "after the window's reduction cleared it; its loss scaler's update() raised after its step; or it left "
           "its acc.join() block with an exception before stepping it)";
  }
  out << replicas_differ(joined) << " (acc.load_state_dict() on every rank). The window was dropped on every rank";
  return out.str();
}

std::string dropped_elsewhere(const std::string& where, const Aborters& who, int64_t joined) {
  const auto why = who.shared();
  if (who.count == 1) {
    return where + " was dropped on every rank: " + abort_phrase(why, "rank " + std::to_string(who.ranks[0])) +
        (raised_there(why) ? " (its own error is raised there)" : "") + consequence(why, joined);
  }
  std::string text = where + " was dropped on every rank: " + std::to_string(who.count) + " ranks";
  if (who.ranks[1] >= 0) {
    text += " (ranks " + std::to_string(who.ranks[0]) + " and " + std::to_string(who.ranks[1]) + ")";
  }
  text += " could not contribute their window";
  bool all_raise = true;
  std::string sep = ": ";
  for (const auto r : c10::irange(kAbortReasonSlots)) {
    const auto n = who.by_reason[static_cast<size_t>(r)];
    if (n > 0) {
      const auto reason = static_cast<AbortReason>(r + 1);
      all_raise = all_raise && raised_there(reason);
      text += sep + (n == who.count ? std::string(n == 2 ? "both " : "all ") : std::to_string(n) + " of them ") +
          several_phrase(reason);
      sep = "; ";
    }
  }
  const auto consequence_told = told(who.of(AbortReason::ClosedWindowNotStepped), who.of(AbortReason::LeftJoin),
                                     who.of(AbortReason::Interrupted), why);
  return text + (all_raise ? " (each raises its own error there)" : "") + consequence(consequence_told, joined);
}

std::string dropped_here(const std::string& where, int rank, AbortReason why, const std::string& local_error,
                         const std::string& transport, int64_t joined, int64_t left, int64_t unstepped,
                         int64_t interrupted, int64_t others, int64_t other_rank, int world) {
  // (torch's own texts end in a full stop; ours continue after it: review)
  std::string local = local_error;
  while (!local.empty() && (local.back() == '.' || local.back() == ' ' || local.back() == '\n')) {
    local.pop_back();
  }
  const auto failed_too = transport.empty() ? "" : ". Dropping it failed too: " + transport;
  if (why == AbortReason::ClosedWindowNotStepped && world > 0 && unstepped == world) {
    // Note [Every rank reads what several aborters did]: every rank failed
    // alike (its optimizer or its scheduler), none stepped while another did not.
    return where + " was dropped on every rank: this rank (rank " + std::to_string(rank) + ") could not step a "
        "window every rank had reduced as its data ended (its last, in acc.flush() or acc.join(), or one it "
        "shadowed in acc.join())" + (local.empty() ? "" : ": " + local) +
        (world > 1 ? "; neither could any other rank, so the replicas still agree (unless the ranks failed at "
                     "different points of their step)"
                   : "") +
        ". Mend what failed; training can go on from the next window" + failed_too;
  }
  // What another rank's drop in the same reduction means for every rank
  // (Note [Every rank reads what several aborters did]); both counts include
  // this rank's own reason.
  const auto told_here = told(unstepped, left, interrupted, why);
  // Where that comes from other ranks, say what they did; else, that other
  // ranks dropped it too (the others' error names them: the same story).
  std::string also;
  if (told_here != why) {
    const auto n = told_here == AbortReason::ClosedWindowNotStepped ? unstepped
        : told_here == AbortReason::LeftJoin                        ? left
                                                                    : interrupted;
    also = "; " + (n == 1 ? std::string("another rank ") : std::to_string(n) + " other ranks ") +
        several_phrase(told_here);
  } else if (others > 0) {
    also = "; " + (others == 1 ? (other_rank >= 0 ? "rank " + std::to_string(other_rank) : std::string("another rank")) +
                                     " could not contribute its window either"
                               : std::to_string(others) + " other ranks could not contribute theirs either");
  }
  return where + " was dropped on every rank: " +
      abort_phrase(why, "this rank (rank " + std::to_string(rank) + ")") + (local.empty() ? "" : ": " + local) +
      also + consequence(told_here, joined) + failed_too;
}

} // namespace gradaccum::detail
