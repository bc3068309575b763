#pragma once
// Internal: a parameter's gradient accumulator, made again where the one it
// has was made for another shape (Note [A parameter reshaped after its
// accumulator was made]).

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

namespace gradaccum::detail {

// Note [A parameter reshaped after its accumulator was made]
// A parameter's AccumulateGrad node checks each gradient against the shape
// the parameter had when the node was made. torch makes a new node when the
// old one is gone, and `param.data = t` forgets the old one when the dtype or
// device changes, but not when only the shape does. Our hooks hold the nodes
// (as DDP's reducer does), so after `param.data = torch.zeros(3, 8)` every
// backward through the parameter would fail in torch ("returned an invalid
// gradient ... expected shape compatible with [2, 8]"), even after
// acc.refresh_parameters(). A node made for another shape can never take
// this parameter's gradient again: the reducer and the one-process watch
// forget it where they take the parameter's node, so a refresh after the
// change gets a node of the right shape (the old hooks stay on the old node,
// which no new graph reaches).
inline c10::intrusive_ptr<torch::autograd::Node> grad_accumulator_for(const at::Tensor& param) {
  if (const auto prior = torch::autograd::impl::try_get_grad_accumulator(param)) {
    if (prior->num_inputs() == 1 && !prior->input_metadata(0).is_same_shape(param)) {
      torch::autograd::impl::set_grad_accumulator(
          param, c10::weak_intrusive_ptr<torch::autograd::Node>(c10::intrusive_ptr<torch::autograd::Node>()));
    }
  }
  return torch::autograd::impl::grad_accumulator(param);
}

} // namespace gradaccum::detail
