// ModelParameters, and what an Accumulator takes of them (see parameters.h).
#include "parameters.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/nn/modules/embedding.h>

#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace gradaccum {
namespace detail {

// Drops frozen and repeated (tied) parameters: each is hooked and reduced
// once. Returns the frozen ones, watched in case they are unfrozen later.
std::vector<std::pair<std::string, at::Tensor>> keep_trainable_once(ModelParameters& model, const char* what) {
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<std::pair<std::string, at::Tensor>> frozen;
  for (const auto i : c10::irange(model.parameters.size())) {
    const auto& p = model.parameters[i];
    TORCH_CHECK_VALUE(p.defined(), "gradaccum: ", what, ": parameter ", i, " is undefined");
    const auto name = model.names.empty() ? "parameter " + std::to_string(i) : model.names[i];
    TORCH_CHECK_VALUE(!p.is_meta(),
        "gradaccum: ", what, ": ", name, " is on the meta device (no data); materialise the model "
        "(e.g. to_empty(device=...) and initialise it) before building the Accumulator");
    if (!seen.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    if (!p.requires_grad()) {
      frozen.emplace_back(name, p);
      continue;
    }
    params.push_back(p);
    names.push_back(model.names.empty() ? "parameter " + std::to_string(i) : model.names[i]);
  }
  model.parameters = std::move(params);
  model.names = std::move(names);
  return frozen;
}

std::vector<std::pair<std::string, at::Tensor>> checked_trainable(ModelParameters& model, const char* what) {
  TORCH_CHECK_VALUE(model.names.empty() || model.names.size() == model.parameters.size(),
      "gradaccum: ", what, ": got ", model.names.size(), " names for ", model.parameters.size(), " parameters");
  TORCH_CHECK_VALUE(model.sparse_modules.empty(),
      "gradaccum: ", what, ": ", model.sparse_modules.front(), " makes sparse gradients "
      "(Embedding(sparse=True)); gradaccum supports dense gradients only: use sparse=False");
  auto frozen = keep_trainable_once(model, what);
  TORCH_CHECK_VALUE(!model.parameters.empty(),
      "gradaccum: ", what, ": the model has no trainable parameters (none requires grad)");
  for (const auto i : c10::irange(model.parameters.size())) {
    TORCH_CHECK_VALUE(model.parameters[i].is_leaf(),
        "gradaccum: ", what, ": ", model.names[i], " is not a leaf tensor; pass the model's parameters");
    TORCH_CHECK_VALUE(at::isFloatingType(model.parameters[i].scalar_type()),
        "gradaccum: ", what, ": ", model.names[i], " has dtype ", model.parameters[i].scalar_type(),
        at::isComplexType(model.parameters[i].scalar_type())
            ? "; complex trainable parameters are not supported (freeze it, or train its real and imaginary "
              "parts as real parameters)"
            : "; gradients need a floating-point dtype");
    TORCH_CHECK_VALUE(model.parameters[i].layout() == at::kStrided,
        "gradaccum: ", what, ": ", model.names[i], " is sparse; sparse parameters are not supported");
  }
  return frozen;
}

// Parameters owned by a live Accumulator: a second one over any of them would
// leave the first one's hooks reducing too (a notebook re-run, a rebuilt loop).
namespace {
std::mutex& claims_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const c10::TensorImpl*, std::string>& claims() {
  static std::unordered_map<const c10::TensorImpl*, std::string> owned;
  return owned;
}
} // namespace

std::shared_ptr<void> claim(const std::vector<at::Tensor>& params, const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(claims_mutex());
  for (const auto i : c10::irange(params.size())) {
    TORCH_CHECK_VALUE(!claims().count(params[i].unsafeGetTensorImpl()),
        "gradaccum: Accumulator(): ", names[i], " already belongs to another live Accumulator, whose "
        "hooks would keep running (reducing every micro-step). Drop the old one (del acc) "
        "or call its close() before building a new one");
  }
  auto keys = std::make_shared<std::vector<const c10::TensorImpl*>>();
  for (const auto& p : params) {
    claims()[p.unsafeGetTensorImpl()] = "";
    keys->push_back(p.unsafeGetTensorImpl());
  }
  return std::shared_ptr<void>(nullptr, [keys](void*) {
    std::lock_guard<std::mutex> lock(claims_mutex());
    for (const auto* key : *keys) {
      claims().erase(key);
    }
  });
}

} // namespace detail

ModelParameters::ModelParameters(std::vector<at::Tensor> parameters_)
    : parameters(std::move(parameters_)) {}

ModelParameters::ModelParameters(
    std::vector<at::Tensor> parameters_,
    std::vector<std::string> names_,
    std::vector<at::Tensor> buffers_)
    : parameters(std::move(parameters_)),
      names(std::move(names_)),
      buffers(std::move(buffers_)) {}

ModelParameters::ModelParameters(const std::shared_ptr<torch::nn::Module>& module, int) {
  TORCH_CHECK_VALUE(module, "gradaccum: Accumulator(): the module is null");
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    names.push_back(item.key());
    parameters.push_back(item.value());
  }
  buffers = module->buffers(/*recurse=*/true);
  for (const auto& item : module->named_modules()) {
    const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(item.value().get());
    const auto* bag = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(item.value().get());
    if ((embedding && embedding->options.sparse()) || (bag && bag->options.sparse())) {
      sparse_modules.push_back(item.key().empty() ? "the module" : item.key());
    }
  }
}

} // namespace gradaccum
