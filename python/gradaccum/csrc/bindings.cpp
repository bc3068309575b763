// Translates types between Python and gradaccum's C++ API, nothing else:
// the logic lives in src/, the Pythonic sugar in python/gradaccum/*.py; the
// state and stats dicts are state_dict.cpp.
#include <gradaccum/gradaccum.h>
#include <gradaccum/detail/failed_backward.h>

#include "state_dict.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>
#include <tuple>

namespace py = pybind11;

namespace gradaccum::python {
namespace {

// Note [C++ warnings reach Python's warnings]
// The library's TORCH_WARNs (a non-finite window acc.flush() dropped, tested;
// a bucket rebuild that failed, hooks that could not be removed) go to c10's
// handler, which prints to stderr: Python's filters, pytest.warns and -W
// error never saw them. Every binding that runs library code holds this
// guard: it collects the calling thread's warnings during the call and issues
// them as Python warnings when the call returns or raises, with the GIL. A
// filter that makes one an error cannot raise from there (the call's effects
// are done): that error is reported as unraisable. Warnings raised on other
// threads (autograd's device threads) still go to stderr.
class WarningsToPython {
 public:
  WarningsToPython() noexcept : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(&buffer_);
  }
  WarningsToPython(const WarningsToPython&) = delete;
  WarningsToPython& operator=(const WarningsToPython&) = delete;
  ~WarningsToPython() {
    c10::WarningUtils::set_warning_handler(previous_);
    if (buffer_.warnings.empty()) {
      return;
    }
    py::gil_scoped_acquire gil;
    PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
    PyErr_Fetch(&type, &value, &traceback); // an error leaving the call stays pending
    for (const auto& [message, deprecation] : buffer_.warnings) {
      if (PyErr_WarnEx(deprecation ? PyExc_DeprecationWarning : PyExc_UserWarning, message.c_str(), 1) < 0) {
        PyErr_WriteUnraisable(nullptr);
      }
    }
    PyErr_Restore(type, value, traceback);
  }

 private:
  struct Buffer : c10::WarningHandler {
    void process(const c10::Warning& warning) override {
      warnings.emplace_back(warning.msg(), std::holds_alternative<c10::Warning::DeprecationWarning>(warning.type()));
    }
    std::vector<std::pair<std::string, bool>> warnings;
  };
  Buffer buffer_;
  c10::WarningHandler* previous_;
};

// Note [An interrupt in a synchronising backward]
// A KeyboardInterrupt or SystemExit raised in the window's closing backward
// (a gradient hook, or a signal handled there) drops the window on every rank
// like any failure there, and the library raises its own error for the drop.
// On this rank the interrupt must stay itself: a loop that catches Exception
// and goes on must still stop. The reducer keeps what it replaced
// (detail::keep_failed_backward()); a Python error whose type is not an
// Exception (a BaseException only) is raised again as itself, the drop's text
// added as a note (and the drop told every rank to end training: Note [An
// interrupt tells every rank to end], src/reducer/hooks.cpp). Every other
// error stays gradaccum's (its text names the original), but where what was
// kept asks for it (raise_original: an acc.run() part whose failure dropped
// nothing yet, as a failed no_sync acc.backward() raises its own error).
// Whatever was kept is taken after the call, raised or not.
// The note: the drop's text, where the original's message (python_error's
// what(): its str(), or "python_error" when it has none, as a signal's
// KeyboardInterrupt) reads as the exception's type and message.
std::string interrupt_note(const std::exception& dropped, const python_error& original, const py::handle& value) {
  const auto* error = dynamic_cast<const c10::Error*>(&dropped);
  std::string note = error ? error->what_without_backtrace() : dropped.what();
  try {
    const std::string text = py::str(value);
    const auto named = py::type::of(value).attr("__name__").cast<std::string>() + (text.empty() ? "" : ": " + text);
    // The cause ends the text or a sentence ("... (rank 1): stop. The
    // window's ...", "...: stop; rank 1 could not ...", "The error: stop").
    const auto cause = ": " + original.message;
    for (auto at = note.find(cause); !original.message.empty() && at != std::string::npos;
         at = note.find(cause, at + 1)) {
      const auto end = at + cause.size();
      if (end == note.size() || note[end] == '.' || note[end] == ';') {
        note.replace(at + 2, original.message.size(), named);
        break;
      }
    }
  } catch (const py::error_already_set&) { // (a __str__ that raises: the note as it was)
  }
  return note;
}

// Note [An interrupt tells every rank to end] (src/reducer/hooks.cpp): what
// the reducer, which knows no Python, must tell of an error: whether it is an
// interrupt, and its type's name (for an error whose message says nothing).
detail::ErrorFacts inspect_python_error(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const python_error& e) {
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    if (e.type == nullptr || !Py_IsInitialized() || finalizing) {
      return {};
    }
    py::gil_scoped_acquire gil;
    detail::ErrorFacts facts;
    facts.interrupt = !PyErr_GivenExceptionMatches(e.type, PyExc_Exception);
    if (PyType_Check(e.type)) {
      const std::string name = reinterpret_cast<PyTypeObject*>(e.type)->tp_name;
      facts.type = name.substr(name.rfind('.') + 1); // ("torch.OutOfMemoryError": its __name__)
    }
    return facts;
  } catch (...) {
    return {};
  }
}

template <typename Call>
void keeping_interrupts(Call&& call) {
  try {
    py::gil_scoped_release no_gil;
    call();
  } catch (const std::exception& e) {
    const auto kept = detail::take_failed_backward();
    if (kept.error) {
      try {
        std::rethrow_exception(kept.error);
      } catch (const python_error& original) {
        if (original.type != nullptr &&
            (kept.raise_original || !PyErr_GivenExceptionMatches(original.type, PyExc_Exception))) {
          Py_XINCREF(original.type);
          Py_XINCREF(original.value);
          Py_XINCREF(original.traceback);
          PyErr_Restore(original.type, original.value, original.traceback); // (steals the references)
          py::error_already_set interrupt; // (takes it back, normalized)
          const auto& value = interrupt.value();
          const auto note = interrupt_note(e, original, value);
          const auto add_note = py::getattr(value, "add_note", py::none()); // Python 3.11+
          if (PyCallable_Check(add_note.ptr())) {
            add_note(note);
          } else if (py::hasattr(value, "__dict__")) { // (an older Python: the same list)
            py::list notes = py::getattr(value, "__notes__", py::list());
            notes.append(note);
            value.attr("__notes__") = notes;
          }
          throw interrupt;
        }
      } catch (const py::error_already_set&) {
        throw;
      } catch (...) { // not a Python error: gradaccum's error says what it was
      }
    }
    throw;
  }
  detail::take_failed_backward();
}

// torch binds ProcessGroup with c10::intrusive_ptr as holder, and this module
// is built with torch's pybind11, so the cast works; should a torch release
// change the holder, c10d's registry still finds the group by its name.
c10::intrusive_ptr<c10d::ProcessGroup> to_process_group(const py::object& group) {
  try {
    return group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  } catch (const py::cast_error&) {
    if (py::hasattr(group, "group_name")) {
      return c10d::resolve_process_group(group.attr("group_name").cast<std::string>());
    }
    throw py::type_error("gradaccum: Accumulator(): process_group must be a torch.distributed.ProcessGroup, got "
        + py::str(py::type::of(group)).cast<std::string>());
  }
}

// Python's keyword options (gradaccum.Accumulator validated them) to AccumulatorOptions.
std::unique_ptr<Accumulator> make_accumulator(
    std::vector<at::Tensor> params,
    std::vector<std::string> names,
    std::vector<at::Tensor> buffers,
    int64_t steps,
    const std::string& reduction,
    std::optional<double> max_grad_norm,
    const std::string& nonfinite,
    const py::object& process_group,
    bool local_only,
    std::optional<double> bucket_cap_mb,
    double first_bucket_cap_mb,
    bool gradient_as_bucket_view,
    bool broadcast_buffers,
    bool check_parameters,
    bool rebuild_buckets,
    std::optional<at::ScalarType> accumulate_dtype,
    std::optional<at::ScalarType> comm_dtype,
    bool error_feedback,
    std::vector<std::string> metrics,
    std::optional<std::tuple<double, double, double, int64_t>> grad_scaler,
    Accumulator::StepFunction optimizer_step,
    Accumulator::StepFunction scheduler_step,
    Accumulator::ParameterList optimizer_parameters) {
  auto options = AccumulatorOptions(steps)
                     .reduction(reduction_from_string(reduction, "Accumulator()"))
                     .max_grad_norm(max_grad_norm)
                     .nonfinite(nonfinite_from_string(nonfinite, "Accumulator()"))
                     .local_only(local_only)
                     .accumulate_dtype(accumulate_dtype)
                     .comm_dtype(comm_dtype)
                     .error_feedback(error_feedback)
                     .metrics(std::move(metrics))
                     .reducer(ReducerOptions()
                                  .bucket_cap_mb(bucket_cap_mb)
                                  .first_bucket_cap_mb(first_bucket_cap_mb)
                                  .gradient_as_bucket_view(gradient_as_bucket_view)
                                  .broadcast_buffers(broadcast_buffers)
                                  .check_parameters(check_parameters)
                                  .rebuild_buckets(rebuild_buckets));
  if (grad_scaler) { // (scale, growth_factor, backoff_factor, growth_interval), compared across ranks
    const auto [scale, growth, backoff, interval] = *grad_scaler;
    options.external_loss_scaler(
        LossScalerOptions().init_scale(scale).growth_factor(growth).backoff_factor(backoff).growth_interval(interval));
  }
  if (!process_group.is_none()) {
    options.process_group(to_process_group(process_group));
  }
  WarningsToPython warnings; // Note [C++ warnings reach Python's warnings]
  py::gil_scoped_release no_gil; // the reducer's setup runs collectives
  return std::make_unique<Accumulator>(
      ModelParameters(std::move(params), std::move(names), std::move(buffers)),
      std::move(options), std::move(optimizer_step), std::move(scheduler_step), std::move(optimizer_parameters));
}

void init_accumulator(py::module_& m) {
  // Note [C++ warnings reach Python's warnings]: the guard first, so that it
  // ends with the GIL held again.
  using release = py::call_guard<WarningsToPython, py::gil_scoped_release>;
  py::class_<Accumulator>(m, "Accumulator")
      .def(py::init(&make_accumulator),
           py::arg("params"), py::arg("names"), py::arg("buffers"), py::kw_only(), py::arg("steps"),
           py::arg("reduction"), py::arg("max_grad_norm"), py::arg("nonfinite"),
           py::arg("process_group"), py::arg("local_only"), py::arg("bucket_cap_mb"),
           py::arg("first_bucket_cap_mb"), py::arg("gradient_as_bucket_view"),
           py::arg("broadcast_buffers"), py::arg("check_parameters"), py::arg("rebuild_buckets"),
           py::arg("accumulate_dtype"), py::arg("comm_dtype"), py::arg("error_feedback"),
           py::arg("metrics"), py::arg("grad_scaler"), py::arg("optimizer_step"), py::arg("scheduler_step"),
           py::arg("optimizer_parameters"), "See gradaccum.Accumulator.")
      .def("backward",
           [](Accumulator& acc, const at::Tensor& loss, std::optional<double> num_items,
              std::optional<at::Tensor> reported, std::optional<at::Tensor> metrics) {
             keeping_interrupts([&] {
               acc.backward(loss, num_items, reported.value_or(at::Tensor()), metrics.value_or(at::Tensor()));
             });
           },
           py::arg("loss"), py::arg("num_items") = py::none(), py::arg("reported") = py::none(),
           py::arg("metrics") = py::none(), py::call_guard<WarningsToPython>(),
           "Backward on one micro-batch's loss; counts the micro-step.")
      .def("abandon", &Accumulator::abandon, release(),
           "An exception left acc.join()'s block: tell the ranks that would wait for this one.")
      .def("empty_micro_step", &Accumulator::empty_micro_step, release(),
           "Count a micro-step this rank has no micro-batch for (no backward, weight 0).")
      .def("backward_whole",
           [](Accumulator& acc, const at::Tensor& loss, std::optional<double> num_items,
              std::optional<at::Tensor> reported, std::optional<at::Tensor> metrics) {
             keeping_interrupts([&] {
               acc.backward_whole(loss, num_items, reported.value_or(at::Tensor()), metrics.value_or(at::Tensor()));
             });
           },
           py::arg("loss"), py::arg("num_items") = py::none(), py::arg("reported") = py::none(),
           py::arg("metrics") = py::none(), py::call_guard<WarningsToPython>(), "backward() for a micro-batch acc.run() runs whole (errors name acc.run()).")
      .def("backward_part",
           [](Accumulator& acc, const at::Tensor& loss, std::optional<double> num_items,
              std::optional<at::Tensor> reported, double share, std::optional<at::Tensor> metrics) {
             keeping_interrupts([&] {
               acc.backward_part(loss, num_items, reported.value_or(at::Tensor()), share,
                                 metrics.value_or(at::Tensor()), "acc.run()");
             });
           },
           py::arg("loss"), py::arg("num_items") = py::none(), py::arg("reported") = py::none(),
           py::arg("share") = 1.0, py::arg("metrics") = py::none(), py::call_guard<WarningsToPython>(), "One part of a micro-step run in parts (acc.run()).")
      .def("end_micro_step",
           [](Accumulator& acc, bool failed, bool out_of_memory, bool interrupted) {
             acc.end_micro_step(failed, out_of_memory, "acc.run()", interrupted);
           },
           py::arg("failed") = false, py::arg("out_of_memory") = false, py::arg("interrupted") = false, release(),
           "Count the micro-step the parts made; synchronises at the window's end.")
      .def("refuse_micro_batch",
           [](Accumulator& acc, bool interrupted) { return acc.refuse_micro_batch("acc.backward()", interrupted); },
           py::arg("interrupted") = false, release(),
           "acc.backward()'s Python checks rejected the micro-batch: drops the window on every rank if it closes it.")
      .def("check_micro_step_state", [](const Accumulator& acc) { acc.check_micro_step_state("acc.run()"); },
           "The checks acc.run() makes before it runs its function.")
      .def_property_readonly("progress_marker", &Accumulator::progress_marker)
      .def_property_readonly("parts_open", &Accumulator::parts_open)
      // Readers another thread may call while this one trains (no CallGuard):
      // without the GIL, which a collective's completion may need while the
      // reducer's lock is held (Note [One thread drives an Accumulator]).
      .def_property_readonly("window_loss", [](const Accumulator& a) {
        std::optional<at::Tensor> loss;
        {
          py::gil_scoped_release no_gil;
          loss = a.window_loss();
        }
        return loss;
      })
      .def_property_readonly("window_metrics", [](const Accumulator& a) {
        std::optional<at::Tensor> metrics;
        {
          py::gil_scoped_release no_gil;
          metrics = a.window_metrics();
        }
        return metrics;
      })
      .def_property_readonly("window_items", &Accumulator::window_items)
      .def("step", &Accumulator::step, release(), "Optimizer step at a closed window.")
      .def("flush", &Accumulator::flush, release(), "Close a partial window and step.")
      .def("join", &Accumulator::join, release(), "End of this rank's data: shadow the others until all join.")
      .def("refresh_parameters",
           [](Accumulator& acc, std::vector<at::Tensor> params, std::vector<std::string> names,
              std::vector<at::Tensor> buffers, const std::string& refused) {
             acc.refresh_parameters(ModelParameters(std::move(params), std::move(names), std::move(buffers)),
                                    refused);
           },
           py::arg("params"), py::arg("names"), py::arg("buffers"), py::arg("refused") = "", release(),
           "Take the trainable set again at a window boundary.")
      .def("zero_grad", &Accumulator::zero_grad, py::call_guard<WarningsToPython>(), "Drop the current window.")
      .def_property_readonly("sync_gradients", &Accumulator::sync_gradients)
      .def_property_readonly("micro_step", &Accumulator::micro_step)
      .def_property_readonly("window_ready", &Accumulator::window_ready)
      .def_property_readonly("epoch_ended", &Accumulator::epoch_ended)
      .def_property("expect_hooks", &Accumulator::expect_hooks, &Accumulator::set_expect_hooks)
      .def("stats", [](const Accumulator& a) {
        AccumulatorStats s;
        {
          py::gil_scoped_release no_gil; // (as window_loss above)
          s = a.stats();
        }
        return stats_to_dict(s);
      })
      .def("last_window_timeline", [](const Accumulator& a) {
        WindowTimeline t;
        {
          py::gil_scoped_release no_gil; // (as window_loss above)
          t = a.last_window_timeline();
        }
        py::list buckets;
        for (const auto& b : t.buckets) {
          py::dict d;
          d["bytes"] = b.bytes;
          d["ready"] = b.ready;
          d["launched"] = b.launched;
          d["completed"] = b.completed;
          d["written"] = b.written;
          buckets.append(d);
        }
        py::dict out;
        out["gradients"] = t.gradients;
        out["buckets"] = buckets;
        out["backward_end"] = t.backward_end;
        out["finished"] = t.finished;
        out["origin"] = t.origin;
        return out;
      })
      .def("state_dict", [](Accumulator& a, bool rank_independent) {
             AccumulatorState state;
             {
               WarningsToPython warnings; // Note [C++ warnings reach Python's warnings]
               py::gil_scoped_release no_gil; // mid-window and data parallel: a collective
               state = a.state_dict(rank_independent);
             }
             return state_to_dict(state);
           }, py::arg("rank_independent") = true)
      // Without the GIL: dropping the last reference to a process group
      // (destroy_process_group() already ran) joins its worker threads, which
      // may need the GIL to release the Python tensors of their last work.
      .def("close", &Accumulator::close, release(), "Remove the hooks; release the parameters.")
      .def("restart_window", &Accumulator::restart_window, release(),
           "zero_grad(), and the position too (every rank at the same point).")
      .def("set_window_callbacks", &Accumulator::set_window_callbacks, py::arg("before_step"),
           py::arg("after_window"), "Callbacks around each window's optimizer step.")
      .def("rescale_residuals", &Accumulator::rescale_residuals, py::arg("ratio"),
           "A loss scale's change at a window's end, for the error-feedback residuals.")
      .def_property_readonly("closed", &Accumulator::closed)
      .def_property_readonly("running_call", &Accumulator::running_call)
      .def("realign", [](Accumulator& acc, const std::string& call) { acc.realign_after_manual_reduction(call.c_str()); },
           py::arg("call"), "Note [A manual reduction in the middle of a window], for a call of Python's")
      .def("load_state_dict", [](Accumulator& a, const py::dict& d) { a.load_state_dict(state_from_dict(d)); },
           py::arg("state_dict"), py::call_guard<WarningsToPython>())
      .def_property_readonly("parameter_names", &Accumulator::parameter_names)
      .def_property_readonly("bucket_indices", [](Accumulator& a) {
        std::vector<std::vector<size_t>> out;
        if (a.reducer()) {
          for (const auto& bucket : a.reducer()->buckets()) {
            out.push_back(bucket.params);
          }
        }
        return out;
      }, "Parameter indices of each bucket, in launch order ([] without a process group).");
}

} // namespace
} // namespace gradaccum::python

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradaccum's C++ core (use the gradaccum package, not this module)";
  gradaccum::detail::set_error_inspector(&gradaccum::python::inspect_python_error);
  gradaccum::python::init_accumulator(m);
  m.def("split", py::overload_cast<const std::vector<at::Tensor>&, int64_t>(&gradaccum::split),
        py::arg("tensors"), py::arg("steps"), "Split tensors of one batch alike along dim 0.");
  m.def("nccl_available", &gradaccum::nccl_available);
  // The Python package's own construction checks refuse through this (Note
  // [Construction refused on one rank]); kind: "value", "type" or "runtime".
  m.def("_refuse_construction",
        [](const py::object& group, const std::string& message, const std::string& kind, at::Device device) {
          const c10::SourceLocation where{"Accumulator", __FILE__, __LINE__};
          const auto pg = gradaccum::python::to_process_group(group);
          gradaccum::python::WarningsToPython warnings; // Note [C++ warnings reach Python's warnings]
          py::gil_scoped_release no_gil;
          if (kind == "value") {
            gradaccum::refuse_construction(pg, c10::ValueError(where, message), device);
          } else if (kind == "type") {
            gradaccum::refuse_construction(pg, c10::TypeError(where, message), device);
          } else {
            gradaccum::refuse_construction(pg, c10::Error(where, message), device);
          }
        },
        py::arg("process_group"), py::arg("message"), py::arg("kind"), py::arg("device"));
  m.attr("__version__") = GRADACCUM_VERSION;
}
