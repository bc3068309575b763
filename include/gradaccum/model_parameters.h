#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace gradaccum {

/// What an Accumulator trains: the trainable parameters (deduplicated, in
/// registration order), their names for error messages, and the buffers that
/// a data-parallel Accumulator broadcasts from rank 0.
struct ModelParameters {
  /// A `torch::nn::Module`, as `model.ptr()` or the holder itself.
  template <typename M, typename = std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>>>
  /* implicit */ ModelParameters(const std::shared_ptr<M>& module)
      : ModelParameters(std::static_pointer_cast<torch::nn::Module>(module), 0) {}
  template <typename M>
  /* implicit */ ModelParameters(const torch::nn::ModuleHolder<M>& module)
      : ModelParameters(module.ptr()) {}
  /// Bare parameters (names are "parameter i").
  /* implicit */ ModelParameters(std::vector<at::Tensor> parameters);
  /// What the Python binding passes.
  ModelParameters(
      std::vector<at::Tensor> parameters,
      std::vector<std::string> names,
      std::vector<at::Tensor> buffers);

  std::vector<at::Tensor> parameters;
  std::vector<std::string> names;
  std::vector<at::Tensor> buffers;
  /// Modules that make sparse gradients (`Embedding(sparse=True)`), by name:
  /// rejected at construction.
  std::vector<std::string> sparse_modules;

 private:
  ModelParameters(const std::shared_ptr<torch::nn::Module>& module, int /*tag*/);
};

} // namespace gradaccum
