// The Accumulator's state and stats as Python dicts, and back (Note [The
// checkpoint schema]): the one place the dict's keys and types are read.
#include "state_dict.h"

#include <pybind11/stl.h>

#include <set>
#include <string>
#include <tuple>

namespace gradaccum::python {

namespace {

template <typename T>
T required(const py::dict& d, const char* key) {
  if (!d.contains(key)) {
    throw py::value_error(std::string("gradaccum: acc.load_state_dict(): the state dict has no key '") + key + "'");
  }
  const py::object value = d[key];
  const auto wrong = [&] {
    return py::value_error(std::string("gradaccum: acc.load_state_dict(): key '") + key + "' has the wrong type (" +
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

} // namespace

py::dict stats_to_dict(const AccumulatorStats& s) {
  py::dict d;
  d["micro_steps"] = s.micro_steps;
  d["optimizer_steps"] = s.optimizer_steps;
  d["skipped_steps"] = s.skipped_steps;
  d["skipped_micro_batches"] = s.skipped_micro_batches;
  d["windows"] = s.windows;
  d["last_grad_norm"] = s.last_grad_norm ? py::cast(*s.last_grad_norm) : py::none();
  d["loss_scale"] = s.loss_scale ? py::cast(*s.loss_scale) : py::none();
  d["window_loss"] = s.window_loss ? py::cast(*s.window_loss) : py::none();
  d["window_items"] = s.window_items;
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
  d["hookless_windows"] = s.reducer.hookless_windows;
  d["bucket_rebuilds"] = s.reducer.bucket_rebuilds;
  d["data_parallel"] = s.data_parallel;
  d["world_size"] = s.world_size;
  d["backend"] = s.data_parallel ? py::cast(s.backend) : py::none();
  return d;
}

namespace {

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
      throw py::value_error(std::string("gradaccum: acc.load_state_dict(): '") + key + "' must hold tensors or None");
    }
  }
  return out;
}

} // namespace

// The state as a dict, by Note [The checkpoint schema]: "reducer.<x>" fields
// nested under "reducer"; the reduction by its name.
py::dict state_to_dict(const AccumulatorState& s) {
  py::dict d;
  py::dict reducer;
  for_each_state_field(s, [&](const char* name, const auto& field, bool) {
    const std::string key(name);
    py::object value;
    if constexpr (std::is_same_v<std::decay_t<decltype(field)>, Reduction>) {
      value = py::cast(to_string(field));
    } else {
      value = py::cast(field);
    }
    if (key.rfind("reducer.", 0) == 0) {
      reducer[py::str(key.substr(8))] = value;
    } else {
      d[py::str(key)] = value;
    }
  });
  d["reducer"] = reducer;
  d["grads"] = tensor_list(s.grads);
  if (!s.residuals.empty()) {
    d["error_feedback_residuals"] = tensor_list(s.residuals);
  }
  if (s.window_loss_sums.defined()) {
    d["window_loss_sums"] = s.window_loss_sums;
    d["window_metric_names"] = s.window_metric_names;
  }
  d["parameter_names"] = s.parameter_names;
  return d;
}

namespace {

// A key no state of this version holds: a newer version's field would be
// ignored silently, or the dict is not an Accumulator's (review).
void refuse_unknown_keys(const py::dict& d, const py::dict& r) {
  std::set<std::string> known{"reducer", "grads", "error_feedback_residuals", "parameter_names", "window_loss_sums",
                              "window_metric_names", "grad_scaler", "group_ranks"}; // (the last two: the Python side's, _checkpoint.py)
  std::set<std::string> known_nested;
  AccumulatorState s;
  for_each_state_field(s, [&](const char* name, const auto&, bool) {
    const std::string key(name);
    if (key.rfind("reducer.", 0) == 0) {
      known_nested.insert(key.substr(8));
    } else {
      known.insert(key);
    }
  });
  std::vector<std::string> unknown;
  for (const auto& [from, keys, prefix] : {std::tuple<const py::dict&, const std::set<std::string>&, std::string>{
                                               d, known, ""},
                                           {r, known_nested, "reducer."}}) {
    for (const auto& item : from) {
      const auto key = py::str(item.first).cast<std::string>();
      if (!py::isinstance<py::str>(item.first) || keys.count(key) == 0) {
        unknown.push_back(prefix + key);
      }
    }
  }
  if (!unknown.empty()) {
    std::string list;
    for (const auto& k : unknown) {
      list += (list.empty() ? "'" : ", '") + k + "'";
    }
    throw py::value_error("gradaccum: acc.load_state_dict(): unknown key(s) " + list + ": no state of this "
        "version of gradaccum holds them (a newer version's state, or not an Accumulator's state_dict()?)");
  }
}

} // namespace

AccumulatorState state_from_dict(const py::dict& d) {
  AccumulatorState s;
  const auto r = required<py::dict>(d, "reducer");
  refuse_unknown_keys(d, r);
  for_each_state_field(s, [&](const char* name, auto& field, bool needed) {
    const std::string key(name);
    const bool nested = key.rfind("reducer.", 0) == 0;
    const auto& from = nested ? r : d;
    const auto own = nested ? key.substr(8) : key;
    if (!needed && !from.contains(own.c_str())) {
      return; // a state saved before the field was kept: its default
    }
    using T = std::decay_t<decltype(field)>;
    if constexpr (std::is_same_v<T, Reduction>) {
      field = reduction_from_string(required<std::string>(from, own.c_str()), "acc.load_state_dict()");
    } else {
      field = required<T>(from, own.c_str());
    }
  });
  s.grads = tensors_from_list(d, "grads");
  if (d.contains("error_feedback_residuals")) {
    s.residuals = tensors_from_list(d, "error_feedback_residuals");
  }
  if (d.contains("window_loss_sums") && !d["window_loss_sums"].is_none()) { // older states: the loss is not known
    try {
      s.window_loss_sums = d["window_loss_sums"].cast<at::Tensor>();
    } catch (const py::cast_error&) {
      throw py::value_error("gradaccum: acc.load_state_dict(): 'window_loss_sums' must be a tensor");
    }
  }
  if (d.contains("window_metric_names")) { // (the version that first kept the sums: by count)
    try {
      s.window_metric_names = d["window_metric_names"].cast<std::vector<std::string>>();
    } catch (const py::cast_error&) {
      throw py::value_error("gradaccum: acc.load_state_dict(): 'window_metric_names' must be a list of str");
    }
  }
  if (d.contains("parameter_names")) { // older states load by position
    try {
      s.parameter_names = d["parameter_names"].cast<std::vector<std::string>>();
    } catch (const py::cast_error&) {
      throw py::value_error("gradaccum: acc.load_state_dict(): 'parameter_names' must be a list of str");
    }
  }
  return s;
}

} // namespace gradaccum::python
