// Translates types between Python and gradaccum's C++ API, nothing else:
// the logic lives in src/, the Pythonic sugar in python/gradaccum/*.py.
#include <gradaccum/gradaccum.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

namespace py = pybind11;

namespace gradaccum::python {
namespace {

template <typename T>
T required(const py::dict& d, const char* key) {
  if (!d.contains(key)) {
    throw py::value_error(std::string("load_state_dict: the state dict has no key '") + key + "'");
  }
  const py::object value = d[key];
  const auto wrong = [&] {
    return py::value_error(std::string("load_state_dict: key '") + key + "' has the wrong type (" +
        py::str(py::type::of(value)).cast<std::string>() + ")");
  };
  if constexpr (std::is_same_v<T, py::list>) {
    if (!py::isinstance<py::list>(value)) {
      throw wrong();
    }
  }
  if constexpr (std::is_same_v<T, py::dict>) {
    if (!py::isinstance<py::dict>(value)) {
      throw wrong();
    }
  }
  if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) {
    if (py::isinstance<py::bool_>(value)) {
      throw wrong(); // True is an int to Python, not a count
    }
  }
  if constexpr (std::is_same_v<T, bool>) {
    if (!py::isinstance<py::bool_>(value)) {
      throw wrong();
    }
  }
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    throw wrong();
  }
}

py::dict reducer_stats_to_dict(const ReducerStats& r) {
  py::dict d;
  d["windows"] = r.windows;
  d["dropped_windows"] = r.dropped_windows;
  d["collectives"] = r.collectives;
  d["bytes_reduced"] = r.bytes_reduced;
  d["last_window_collectives"] = r.last_window_collectives;
  d["last_window_bytes"] = r.last_window_bytes;
  d["broadcasts"] = r.broadcasts;
  d["snapshots"] = r.snapshots;
  return d;
}

py::dict stats_to_dict(const AccumulatorStats& s) {
  py::dict d;
  d["micro_steps"] = s.micro_steps;
  d["optimizer_steps"] = s.optimizer_steps;
  d["skipped_steps"] = s.skipped_steps;
  d["windows"] = s.windows;
  d["last_grad_norm"] = s.last_grad_norm ? py::cast(*s.last_grad_norm) : py::none();
  d["loss_scale"] = s.loss_scale ? py::cast(*s.loss_scale) : py::none();
  d["buckets"] = s.reducer.buckets;
  d["reductions"] = s.reducer.windows;
  d["dropped_windows"] = s.reducer.dropped_windows;
  d["collectives"] = s.reducer.collectives;
  d["bytes_reduced"] = s.reducer.bytes_reduced;
  d["last_window_collectives"] = s.reducer.last_window_collectives;
  d["last_window_bytes"] = s.reducer.last_window_bytes;
  d["buffer_broadcasts"] = s.reducer.broadcasts;
  d["snapshots"] = s.reducer.snapshots;
  d["launched_in_backward"] = s.reducer.launched_in_backward;
  d["last_window_launched_in_backward"] = s.reducer.last_window_launched_in_backward;
  d["bucket_rebuilds"] = s.reducer.bucket_rebuilds;
  return d;
}

// Tensors, undefined ones as None (and back).
py::list tensor_list(const std::vector<at::Tensor>& tensors) {
  py::list out;
  for (const auto& t : tensors) {
    out.append(t.defined() ? py::cast(t) : py::none());
  }
  return out;
}

std::vector<at::Tensor> tensors_from_list(const py::dict& d, const char* key) {
  std::vector<at::Tensor> out;
  for (const auto& t : required<py::list>(d, key)) {
    if (t.is_none()) {
      out.emplace_back();
    } else if (THPVariable_Check(t.ptr())) {
      out.push_back(t.cast<at::Tensor>());
    } else {
      throw py::value_error(std::string("load_state_dict: '") + key + "' must hold tensors or None");
    }
  }
  return out;
}

py::dict state_to_dict(const AccumulatorState& s) {
  py::dict d;
  d["steps"] = s.steps;
  d["reduction"] = to_string(s.reduction);
  d["world_size"] = s.world_size;
  d["rank"] = s.rank;
  d["rank_independent"] = s.rank_independent;
  d["micro_step"] = s.micro_step;
  d["window_ready"] = s.window_ready;
  d["window_weight"] = s.window_weight;
  d["epoch_ended"] = s.epoch_ended;
  d["micro_steps"] = s.micro_steps;
  d["optimizer_steps"] = s.optimizer_steps;
  d["skipped_steps"] = s.skipped_steps;
  d["windows"] = s.windows;
  d["reducer"] = reducer_stats_to_dict(s.reducer);
  d["reducer_sequence"] = s.reducer_sequence;
  d["reducer_last_weight"] = s.reducer_last_weight;
  d["loss_scale"] = s.loss_scale;
  d["loss_scale_growth_tracker"] = s.loss_scale_growth_tracker;
  d["grads"] = tensor_list(s.grads);
  if (!s.residuals.empty()) {
    d["error_feedback_residuals"] = tensor_list(s.residuals);
  }
  return d;
}

AccumulatorState state_from_dict(const py::dict& d) {
  AccumulatorState s;
  s.steps = required<int64_t>(d, "steps");
  s.reduction = reduction_from_string(required<std::string>(d, "reduction"));
  s.world_size = required<int64_t>(d, "world_size");
  s.rank = required<int64_t>(d, "rank");
  s.rank_independent = required<bool>(d, "rank_independent");
  s.micro_step = required<int64_t>(d, "micro_step");
  s.window_ready = required<bool>(d, "window_ready");
  s.window_weight = required<double>(d, "window_weight");
  s.epoch_ended = required<bool>(d, "epoch_ended");
  s.micro_steps = required<int64_t>(d, "micro_steps");
  s.optimizer_steps = required<int64_t>(d, "optimizer_steps");
  s.skipped_steps = required<int64_t>(d, "skipped_steps");
  s.windows = required<int64_t>(d, "windows");
  s.reducer_sequence = required<int64_t>(d, "reducer_sequence");
  if (d.contains("reducer_last_weight")) { // states saved before it was kept have none
    s.reducer_last_weight = required<double>(d, "reducer_last_weight");
  }
  s.loss_scale = required<double>(d, "loss_scale");
  s.loss_scale_growth_tracker = required<int64_t>(d, "loss_scale_growth_tracker");
  const auto r = required<py::dict>(d, "reducer");
  s.reducer.windows = required<int64_t>(r, "windows");
  s.reducer.dropped_windows = required<int64_t>(r, "dropped_windows");
  s.reducer.collectives = required<int64_t>(r, "collectives");
  s.reducer.bytes_reduced = required<int64_t>(r, "bytes_reduced");
  s.reducer.last_window_collectives = required<int64_t>(r, "last_window_collectives");
  s.reducer.last_window_bytes = required<int64_t>(r, "last_window_bytes");
  s.reducer.broadcasts = required<int64_t>(r, "broadcasts");
  s.reducer.snapshots = required<int64_t>(r, "snapshots");
  s.grads = tensors_from_list(d, "grads");
  if (d.contains("error_feedback_residuals")) {
    s.residuals = tensors_from_list(d, "error_feedback_residuals");
  }
  return s;
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
    throw py::type_error("process_group must be a torch.distributed.ProcessGroup, got "
        + py::str(py::type::of(group)).cast<std::string>());
  }
}

std::unique_ptr<Accumulator> make_accumulator(
    std::vector<at::Tensor> params,
    std::vector<std::string> names,
    std::vector<at::Tensor> buffers,
    int64_t steps,
    const std::string& reduction,
    std::optional<double> max_grad_norm,
    const std::string& nonfinite,
    const py::object& process_group,
    double bucket_cap_mb,
    double first_bucket_cap_mb,
    bool gradient_as_bucket_view,
    bool broadcast_buffers,
    bool check_parameters,
    bool rebuild_buckets,
    const std::string& accumulate_dtype,
    Accumulator::StepFunction optimizer_step,
    Accumulator::StepFunction scheduler_step,
    const std::string& comm_dtype,
    bool error_feedback) {
  auto options = AccumulatorOptions(steps)
                     .reduction(reduction_from_string(reduction))
                     .max_grad_norm(max_grad_norm)
                     .nonfinite(nonfinite_from_string(nonfinite))
                     .reducer(ReducerOptions()
                                  .bucket_cap_mb(bucket_cap_mb)
                                  .first_bucket_cap_mb(first_bucket_cap_mb)
                                  .gradient_as_bucket_view(gradient_as_bucket_view)
                                  .broadcast_buffers(broadcast_buffers)
                                  .check_parameters(check_parameters)
                                  .rebuild_buckets(rebuild_buckets));
  if (accumulate_dtype == "float32") {
    options.accumulate_dtype(at::kFloat);
  } else if (accumulate_dtype == "float64") {
    options.accumulate_dtype(at::kDouble);
  } else if (!accumulate_dtype.empty()) {
    throw py::value_error("accumulate_dtype must be torch.float32, torch.float64 or None, got " + accumulate_dtype);
  }
  if (comm_dtype == "bfloat16") {
    options.comm_dtype(at::kBFloat16);
  } else if (comm_dtype == "float16") {
    options.comm_dtype(at::kHalf);
  } else if (comm_dtype == "float32") {
    options.comm_dtype(at::kFloat);
  } else if (!comm_dtype.empty()) {
    throw py::value_error("comm_dtype must be torch.bfloat16, torch.float16, torch.float32 or None, got " + comm_dtype);
  }
  options.error_feedback(error_feedback);
  if (!process_group.is_none()) {
    options.process_group(to_process_group(process_group));
  }
  py::gil_scoped_release no_gil; // the reducer's setup runs collectives
  return std::make_unique<Accumulator>(
      ModelParameters(std::move(params), std::move(names), std::move(buffers)),
      std::move(options), std::move(optimizer_step), std::move(scheduler_step));
}

void init_accumulator(py::module_& m) {
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<Accumulator>(m, "Accumulator")
      .def(py::init(&make_accumulator),
           py::arg("params"), py::arg("names"), py::arg("buffers"), py::arg("steps"),
           py::arg("reduction"), py::arg("max_grad_norm"), py::arg("nonfinite"),
           py::arg("process_group"), py::arg("bucket_cap_mb"), py::arg("first_bucket_cap_mb"),
           py::arg("gradient_as_bucket_view"), py::arg("broadcast_buffers"),
           py::arg("check_parameters"), py::arg("rebuild_buckets"), py::arg("accumulate_dtype"),
           py::arg("optimizer_step"), py::arg("scheduler_step"), py::arg("comm_dtype") = "",
           py::arg("error_feedback") = false,
           "See gradaccum.Accumulator.")
      .def("backward", &Accumulator::backward, py::arg("loss"), py::arg("num_items") = py::none(),
           release(), "Backward on one micro-batch's loss; counts the micro-step.")
      .def("step", &Accumulator::step, release(), "Optimizer step at a closed window.")
      .def("flush", &Accumulator::flush, release(), "Close a partial window and step.")
      .def("zero_grad", &Accumulator::zero_grad, "Drop the current window.")
      .def_property_readonly("sync_gradients", &Accumulator::sync_gradients)
      .def_property_readonly("micro_step", &Accumulator::micro_step)
      .def_property_readonly("window_ready", &Accumulator::window_ready)
      .def_property("expect_hooks", &Accumulator::expect_hooks, &Accumulator::set_expect_hooks)
      .def("stats", [](const Accumulator& a) { return stats_to_dict(a.stats()); })
      .def("state_dict", [](Accumulator& a, bool rank_independent) {
             AccumulatorState state;
             {
               py::gil_scoped_release no_gil; // mid-window and data parallel: a collective
               state = a.state_dict(rank_independent);
             }
             return state_to_dict(state);
           }, py::arg("rank_independent") = true)
      // Without the GIL: dropping the last reference to a process group
      // (destroy_process_group() already ran) joins its worker threads, which
      // may need the GIL to release the Python tensors of their last work.
      .def("close", &Accumulator::close, release(), "Remove the hooks; release the parameters.")
      .def("set_window_callbacks", &Accumulator::set_window_callbacks, py::arg("before_step"),
           py::arg("after_window"), "Callbacks around each window's optimizer step.")
      .def_property_readonly("closed", &Accumulator::closed)
      .def("load_state_dict", [](Accumulator& a, const py::dict& d) { a.load_state_dict(state_from_dict(d)); },
           py::arg("state_dict"))
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
  gradaccum::python::init_accumulator(m);
  m.def("split", py::overload_cast<const std::vector<at::Tensor>&, int64_t>(&gradaccum::split),
        py::arg("tensors"), py::arg("steps"), "Split tensors of one batch alike along dim 0.");
  m.def("nccl_available", &gradaccum::nccl_available);
  m.attr("__version__") = GRADACCUM_VERSION;
}
