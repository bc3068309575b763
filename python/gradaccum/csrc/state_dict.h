// The Accumulator's state and stats as Python dicts, and back.
#pragma once

#include <gradaccum/gradaccum.h>

#include <torch/extension.h>

namespace gradaccum::python {

namespace py = pybind11;

py::dict stats_to_dict(const AccumulatorStats& s);
// The state as a dict, by Note [The checkpoint schema].
py::dict state_to_dict(const AccumulatorState& s);
// A dict from state_to_dict() (or a torch.load() of one), checked key by key.
AccumulatorState state_from_dict(const py::dict& d);

} // namespace gradaccum::python
