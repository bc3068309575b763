#pragma once
// Internal: what an Accumulator takes of its model's parameters.

#include <gradaccum/accumulator.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gradaccum::detail {

/// Keeps the parameters that require grad, in order (each tensor once); returns
/// the frozen ones by name (an error later if one starts to require grad).
std::vector<std::pair<std::string, at::Tensor>> keep_trainable_once(ModelParameters& model, const char* what);

/// keep_trainable_once(), then the checks every trained parameter must pass
/// (`what` names the call in errors).
std::vector<std::pair<std::string, at::Tensor>> checked_trainable(ModelParameters& model, const char* what);

/// Claims the parameters for one live Accumulator; the claim ends with the
/// returned handle. A parameter claimed already is an error naming it.
std::shared_ptr<void> claim(const std::vector<at::Tensor>& params, const std::vector<std::string>& names);

} // namespace gradaccum::detail
