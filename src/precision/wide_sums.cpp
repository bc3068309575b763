#include "precision/wide_sums.h"

#include "precision/precision.h"

#include <c10/util/irange.h>

#include <map>
#include <tuple>

namespace gradaccum::detail {

WideSums::WideSums(const std::vector<at::Tensor>& params, at::ScalarType dtype)
    : locator_(params.size(), {kNone, 0}),
      touched_(std::make_unique<std::atomic<bool>[]>(params.size())),
      parameters_(params.size()) {
  // One bucket per (dtype, device) group of narrower parameters, in
  // registration order: without a collective, no cap and no launch order.
  std::map<std::tuple<at::ScalarType, at::DeviceType, at::DeviceIndex>, std::vector<size_t>> groups;
  for (const auto i : c10::irange(params.size())) {
    const auto& p = params[i];
    if (at::elementSize(dtype) > p.element_size()) {
      groups[{p.scalar_type(), p.device().type(), p.device().index()}].push_back(i);
    }
  }
  const BucketConfig config{dtype, std::nullopt, /*world=*/1, /*error_feedback=*/false};
  for (auto& [key, indices] : groups) {
    buckets_.emplace_back(params, std::move(indices), config);
    TORCH_INTERNAL_ASSERT(buckets_.back().accumulating);
    const auto b = buckets_.size() - 1;
    for (const auto slot : c10::irange(buckets_.back().params.size())) {
      locator_[buckets_.back().params[slot]] = {b, slot};
    }
  }
  for (const auto i : c10::irange(parameters_)) {
    touched_[i].store(false, std::memory_order_relaxed);
  }
}

void WideSums::add(const std::vector<at::Tensor>& params) {
  TORCH_INTERNAL_ASSERT(params.size() == parameters_);
  for (auto& bucket : buckets_) {
    accumulate_grads(bucket, params, touched_.get());
  }
  any_touched_ = true;
}

void WideSums::write_back(const std::vector<at::Tensor>& params, std::optional<double> divisor) {
  TORCH_INTERNAL_ASSERT(params.size() == parameters_);
  if (!any_touched_) {
    return; // every sum is zero already, and every held .grad undefined
  }
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    std::vector<char> nowhere(bucket.params.size(), 0);
    for (const auto slot : c10::irange(bucket.params.size())) {
      nowhere[slot] = !touched_[bucket.params[slot]].load(std::memory_order_relaxed);
    }
    write_back_wide(bucket, params, nowhere, divisor);
  }
  clear(); // (zeroes the sums)
}

std::vector<at::Tensor> WideSums::sums() const {
  return accumulated_sums(buckets_, parameters_, touched_.get());
}

void WideSums::load(size_t i, const at::Tensor& sum, const std::string& name, at::IntArrayRef sizes) {
  TORCH_INTERNAL_ASSERT(holds(i));
  const auto [b, slot] = locator_[i];
  load_wide_sum(buckets_[b], slot, sum, name, sizes);
  touched_[i].store(true, std::memory_order_relaxed);
  any_touched_ = true;
}

void WideSums::clear() {
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    bucket.gradients.zero_();
  }
  for (const auto i : c10::irange(parameters_)) {
    touched_[i].store(false, std::memory_order_relaxed);
  }
  any_touched_ = false;
}

} // namespace gradaccum::detail
