#include <gradaccum/bucket.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <map>
#include <tuple>

namespace gradaccum {

std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<at::Tensor>& params,
    int64_t first_cap_bytes,
    int64_t cap_bytes,
    const std::vector<size_t>& ready_order) {
  std::vector<size_t> order = ready_order;
  if (order.empty()) {
    for (size_t i = params.size(); i-- > 0;) {
      order.push_back(i);
    }
  }
  // position[i]: when parameter i becomes ready.
  std::vector<size_t> position(params.size(), params.size());
  TORCH_CHECK_VALUE(order.size() == params.size(),
      "assign_buckets: the ready order has ", order.size(), " entries for ", params.size(), " parameters");
  for (const auto k : c10::irange(order.size())) {
    TORCH_CHECK_VALUE(order[k] < params.size() && position[order[k]] == params.size(),
        "assign_buckets: the ready order is not a permutation of the parameters (entry ", k,
        " is ", order[k], ")");
    position[order[k]] = k;
  }
  struct Open {
    std::vector<size_t> indices;
    int64_t bytes = 0;
    bool first = true;
  };
  using Key = std::tuple<at::ScalarType, at::DeviceType, c10::DeviceIndex>;
  std::map<Key, Open> open;
  std::vector<std::vector<size_t>> closed;

  for (const size_t i : order) {
    const auto& p = params[i];
    auto& bucket = open[Key(p.scalar_type(), p.device().type(), p.device().index())];
    bucket.indices.push_back(i);
    bucket.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    if (bucket.bytes >= (bucket.first ? first_cap_bytes : cap_bytes)) {
      closed.push_back(std::move(bucket.indices));
      bucket.indices.clear();
      bucket.bytes = 0;
      bucket.first = false;
    }
  }
  for (auto& entry : open) {
    if (!entry.second.indices.empty()) {
      closed.push_back(std::move(entry.second.indices));
    }
  }
  // Launch order: by the first parameter to be ready, i.e. by when backward
  // should complete the bucket. The same on every rank for the same order.
  std::stable_sort(closed.begin(), closed.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  return closed;
}

Bucket::Bucket(const std::vector<at::Tensor>& all, std::vector<size_t> indices,
               std::optional<at::ScalarType> accumulate)
    : params(std::move(indices)) {
  TORCH_INTERNAL_ASSERT(!params.empty());
  const auto& first = all[params.front()];
  int64_t numel = 0;
  for (size_t index : params) {
    numel += all[index].numel();
  }
  const auto n = static_cast<int64_t>(params.size());
  const auto dtype = accumulate && at::elementSize(*accumulate) > first.element_size()
      ? *accumulate : first.scalar_type();
  meta_in_buffer = dtype == at::kFloat || dtype == at::kDouble;
  accumulating = dtype != first.scalar_type();
  const auto options = first.options().dtype(dtype).requires_grad(false);
  if (meta_in_buffer) {
    buffer = at::zeros({numel + kMetaHeader + n}, options);
    meta = buffer.narrow(0, numel, kMetaHeader + n);
  } else {
    buffer = at::zeros({numel}, options);
    meta = at::zeros({kMetaHeader + n}, options.dtype(at::kFloat));
  }
  gradients = buffer.narrow(0, 0, numel);
  int64_t offset = 0;
  views.reserve(params.size());
  for (size_t index : params) {
    const auto& p = all[index];
    auto flat = gradients.narrow(0, offset, p.numel());
    // Views keep the parameter's strides (channels_last and other dense
    // layouts): torch's gradient layout contract then holds, with no warning
    // and no extra copy when backward accumulates into a bucket view.
    views.push_back(p.is_non_overlapping_and_dense() && !p.is_contiguous()
                        ? flat.as_strided(p.sizes(), p.strides())
                        : flat.view(p.sizes()));
    offset += p.numel();
  }
}

int64_t Bucket::bytes() const {
  int64_t total = buffer.numel() * static_cast<int64_t>(buffer.element_size());
  if (!meta_in_buffer) {
    total += meta.numel() * static_cast<int64_t>(meta.element_size());
  }
  return total;
}

} // namespace gradaccum
