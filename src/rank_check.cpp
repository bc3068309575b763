#include "reducer/state.h"

#include <map>
#include <sstream>
#include <tuple>

namespace gradaccum {

namespace {

constexpr int64_t kMiB = 1024 * 1024;
// Signature of one parameter for the cross-rank check: dtype, dim, sizes.
constexpr int64_t kMaxCheckedDims = 8;
constexpr int64_t kSignatureWidth = 2 + kMaxCheckedDims;

std::string describe(const at::Tensor& row) {
  std::ostringstream out;
  const auto dtype = static_cast<at::ScalarType>(row[0].item<int64_t>());
  const auto dim = row[1].item<int64_t>();
  out << dtype << " [";
  for (int64_t d = 0; d < std::min(dim, kMaxCheckedDims); ++d) {
    out << (d ? ", " : "") << row[2 + d].item<int64_t>();
  }
  out << (dim > kMaxCheckedDims ? ", ...]" : "]");
  return out.str();
}

} // namespace

namespace detail {

std::vector<at::Tensor> allgather(
    c10d::ProcessGroup& group,
    const at::Tensor& input) {
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group.getSize(); ++r) {
    outputs[0].push_back(at::empty_like(input));
  }
  std::vector<at::Tensor> inputs{input};
  group.allgather(outputs, inputs)->wait();
  return outputs[0];
}

std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

} // namespace detail

void Reducer::State::check_ranks_match() {
  const auto device = metadata_device();
  const auto n = static_cast<int64_t>(params.size());
  // Options every rank must share, then the parameter count.
  const std::vector<std::pair<const char*, double>> settings{
      {"steps", static_cast<double>(rule.steps)},
      {"reduction", static_cast<double>(static_cast<int>(rule.reduction))},
      {"bucket_cap_mb", options.bucket_cap_mb()},
      {"first_bucket_cap_mb", options.first_bucket_cap_mb()},
      {"gradient_as_bucket_view", options.gradient_as_bucket_view() ? 1.0 : 0.0},
      {"broadcast_buffers", options.broadcast_buffers() ? 1.0 : 0.0},
      {"rebuild_buckets", options.rebuild_buckets() ? 1.0 : 0.0},
      {"accumulate_dtype", rule.accumulate_dtype ? static_cast<double>(*rule.accumulate_dtype) : -1.0},
      {"comm_dtype", rule.comm_dtype ? static_cast<double>(*rule.comm_dtype) : -1.0},
      {"error_feedback", rule.error_feedback ? 1.0 : 0.0},
      {"the number of trainable parameters", static_cast<double>(n)},
  };
  // Another reducer's hooks (torch DDP) on some rank fail every rank alike.
  const auto foreign = foreign_hooks();
  {
    auto flag = at::full({1}, foreign.empty() ? 0.0 : 1.0, at::kDouble);
    const auto flags = allgather(*group, flag.to(device));
    TORCH_CHECK_VALUE(foreign.empty(), foreign);
    for (const auto r : c10::irange(flags.size())) {
      TORCH_CHECK_VALUE(flags[r].item<double>() == 0,
          static_cast<int>(r) == rank ? foreign
              : "gradaccum: rank " + std::to_string(r) + "'s parameters carry another reducer's "
                "gradient hooks (the model is also wrapped in torch DDP there?)");
    }
  }
  auto mine = at::empty({static_cast<int64_t>(settings.size())}, at::kDouble);
  for (const auto i : c10::irange(settings.size())) {
    mine[static_cast<int64_t>(i)].fill_(settings[i].second);
  }
  const auto all_settings = allgather(*group, mine.to(device));
  for (const auto i : c10::irange(settings.size())) {
    std::ostringstream values;
    bool differ = false;
    for (const auto r : c10::irange(all_settings.size())) {
      const double v = all_settings[r][static_cast<int64_t>(i)].item<double>();
      differ = differ || v != all_settings[0][static_cast<int64_t>(i)].item<double>();
      values << (r ? ", " : "") << "rank " << r << ": ";
      if (i == 1) {
        values << reduction_name(static_cast<int64_t>(v));
      } else if (std::string(settings[i].first).find("_dtype") != std::string::npos) {
        values << (v < 0 ? "None" : c10::toString(static_cast<at::ScalarType>(static_cast<int>(v))));
      } else {
        values << v;
      }
    }
    TORCH_CHECK_VALUE(!differ,
        "gradaccum: the ranks disagree on ", settings[i].first, " (", values.str(),
        "); every rank must build its Accumulator with the same options and model");
  }
  auto signature = at::full({n, kSignatureWidth}, -1, at::kLong);
  auto rows = signature.accessor<int64_t, 2>();
  for (const auto i : c10::irange(n)) {
    const auto& p = params[i];
    rows[i][0] = static_cast<int64_t>(p.scalar_type());
    rows[i][1] = p.dim();
    for (int64_t d = 0; d < std::min<int64_t>(p.dim(), kMaxCheckedDims); ++d) {
      rows[i][2 + d] = p.size(d);
    }
  }
  const auto all = allgather(*group, signature.to(device));
  const auto reference = all[0].cpu();
  for (const auto r : c10::irange<size_t>(1, all.size())) {
    const auto theirs = all[r].cpu();
    const auto differs = theirs.ne(reference).any(1).nonzero();
    if (differs.numel() > 0) {
      const auto i = differs[0][0].item<int64_t>();
      TORCH_CHECK_VALUE(false,
          "gradaccum: the model differs across ranks: ", name(i), " is ",
          describe(theirs[i]), " on rank ", r, " but ", describe(reference[i]),
          " on rank 0");
    }
  }
}

void Reducer::State::broadcast_from_rank0(const std::vector<at::Tensor>& tensors) {
  // One broadcast per (dtype, device): flatten, broadcast, copy back.
  using Key = std::tuple<at::ScalarType, at::DeviceType, c10::DeviceIndex>;
  std::map<Key, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      groups[Key(t.scalar_type(), t.device().type(), t.device().index())].push_back(t);
    }
  }
  at::NoGradGuard no_grad;
  for (auto& entry : groups) {
    auto& members = entry.second;
    std::vector<at::Tensor> flat_members;
    for (const auto& t : members) {
      flat_members.push_back(t.reshape(-1));
    }
    std::vector<at::Tensor> flat{at::cat(flat_members)};
    group->broadcast(flat)->wait();
    int64_t offset = 0;
    for (auto& t : members) {
      t.copy_(flat[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

} // namespace gradaccum
