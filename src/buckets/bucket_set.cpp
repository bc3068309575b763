#include "buckets/bucket_set.h"

#include "consensus/window_header.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>

namespace gradaccum::detail {

void point_grads_at_views(std::vector<Bucket>& buckets, const std::vector<at::Tensor>& params,
                          bool undefined_too) {
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets) {
    for (const auto slot : c10::irange(bucket.params.size())) {
      auto& grad = params[bucket.params[slot]].mutable_grad();
      if (grad.defined()) {
        bucket.views[slot].copy_(grad);
      } else if (!undefined_too) {
        continue;
      }
      grad = view_handle(bucket.views[slot]);
    }
  }
}

std::vector<std::vector<size_t>> BucketSet::layout(const ReducerConfig& config, const std::vector<size_t>& order) {
  return assign_buckets(config.params, config.first_cap_bytes(), config.cap_bytes(), order);
}

std::vector<Bucket> BucketSet::build(const ReducerConfig& config, const std::vector<std::vector<size_t>>& layout) {
  const c10::InferenceMode not_inference(/*enabled=*/false); // (buckets are written by every backward)
  const BucketConfig bucket_config{
      config.rule.accumulate_dtype, config.rule.comm_dtype, config.world, config.rule.error_feedback};
  std::vector<Bucket> built;
  built.reserve(layout.size());
  for (const auto& indices : layout) {
    built.emplace_back(config.params, indices, bucket_config);
  }
  return built;
}

void BucketSet::use(std::vector<Bucket> built, int world) {
  all = std::move(built);
  size_t parameters = 0;
  for (const auto& bucket : all) {
    parameters += bucket.params.size();
  }
  locator.assign(parameters, {0, 0});
  for (const auto b : c10::irange(all.size())) {
    for (const auto slot : c10::irange(all[b].params.size())) {
      TORCH_INTERNAL_ASSERT(all[b].params[slot] < parameters, "gradaccum: a bucket layout is not a permutation");
      locator[all[b].params[slot]] = {b, slot};
    }
  }
  modulus = header_modulus(all, world);
  exact_weights_below = exact_weight_bound(all);
}

bool BucketSet::any(bool Bucket::*flag) const {
  return std::any_of(all.begin(), all.end(), [flag](const Bucket& b) { return b.*flag; });
}

void BucketSet::broadcast_parameters(const ReducerConfig& config) {
  at::NoGradGuard no_grad;
  for (auto& bucket : all) {
    for (const auto slot : c10::irange(bucket.params.size())) {
      bucket.views[slot].copy_(config.params[bucket.params[slot]]);
    }
    std::vector<at::Tensor> flat{bucket.gradients};
    config.group->broadcast(flat)->wait();
    for (const auto slot : c10::irange(bucket.params.size())) {
      config.params[bucket.params[slot]].copy_(bucket.views[slot]);
    }
    bucket.gradients.zero_();
  }
}

} // namespace gradaccum::detail
