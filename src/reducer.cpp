#include <gradaccum/reducer.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

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

} // namespace

Reducer::Reducer(
    std::vector<at::Tensor> params,
    c10::intrusive_ptr<c10d::ProcessGroup> group,
    ReducerOptions options,
    std::vector<at::Tensor> buffers,
    std::vector<std::string> names)
    : params_(std::move(params)),
      buffers_(std::move(buffers)),
      names_(std::move(names)),
      group_(std::move(group)),
      options_(options) {
  TORCH_CHECK_VALUE(group_, "Reducer: process_group is null");
  options_.validate();
  TORCH_CHECK_VALUE(
      !params_.empty(), "Reducer: the model has no trainable parameters");
  TORCH_CHECK_VALUE(
      names_.empty() || names_.size() == params_.size(),
      "Reducer: got ", names_.size(), " names for ", params_.size(), " parameters");
  if (names_.empty()) {
    for (const auto i : c10::irange(params_.size())) {
      names_.push_back("parameter " + std::to_string(i));
    }
  }
  for (const auto i : c10::irange(params_.size())) {
    const auto& p = params_[i];
    TORCH_CHECK_VALUE(p.defined(), "Reducer: ", name(i), " is undefined");
    TORCH_CHECK_VALUE(p.is_leaf() && p.requires_grad(),
        "Reducer: ", name(i), " must be a leaf tensor that requires grad");
    TORCH_CHECK_VALUE(!p.is_sparse(), "Reducer: ", name(i), " is sparse; sparse parameters are not supported");
  }

  if (options_.check_parameters()) {
    check_parameters_match();
  }

  const auto layout = assign_buckets(
      params_,
      static_cast<int64_t>(options_.first_bucket_cap_mb() * kMiB),
      static_cast<int64_t>(options_.bucket_cap_mb() * kMiB));
  locator_.resize(params_.size());
  buckets_.reserve(layout.size());
  for (const auto b : c10::irange(layout.size())) {
    buckets_.emplace_back(params_, layout[b]);
    for (const auto slot : c10::irange(layout[b].size())) {
      locator_[layout[b][slot]] = {b, slot};
    }
  }
  stats_.buckets = static_cast<int64_t>(buckets_.size());
  ready_.assign(params_.size(), 0);

  broadcast_parameters_from_rank0();
  broadcast_from_rank0(buffers_);

  if (options_.gradient_as_bucket_view()) {
    // From now on backward accumulates straight into the buckets.
    for (auto& bucket : buckets_) {
      for (const auto slot : c10::irange(bucket.params.size())) {
        auto& grad = params_[bucket.params[slot]].mutable_grad();
        if (grad.defined()) {
          bucket.views[slot].copy_(grad);
        }
        grad = bucket.views[slot];
      }
    }
  }

  for (const auto i : c10::irange(params_.size())) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    hook_keys_.push_back(accumulator->add_post_hook(
        std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, i](const torch::autograd::variable_list& outputs,
                      const torch::autograd::variable_list& /*inputs*/) {
              mark_ready(i);
              return outputs;
            })));
    grad_accumulators_.push_back(std::move(accumulator));
  }
}

Reducer::~Reducer() {
  for (const auto i : c10::irange(grad_accumulators_.size())) {
    grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

const std::string& Reducer::name(size_t index) const {
  return names_[index];
}

at::Device Reducer::metadata_device() const {
  // NCCL reduces device tensors only; every other backend takes CPU tensors.
  return group_->getBackendType() == c10d::ProcessGroup::BackendType::NCCL
      ? params_.front().device()
      : at::Device(at::kCPU);
}

void Reducer::check_parameters_match() {
  const auto device = metadata_device();
  const auto n = static_cast<int64_t>(params_.size());
  const auto counts = allgather(*group_, at::full({1}, n, at::TensorOptions(device).dtype(at::kLong)));
  for (const auto r : c10::irange(counts.size())) {
    const auto theirs = counts[r].item<int64_t>();
    TORCH_CHECK_VALUE(
        theirs == counts[0].item<int64_t>(),
        "gradaccum: the model differs across ranks: rank ", r, " has ", theirs,
        " trainable parameters but rank 0 has ", counts[0].item<int64_t>());
  }
  auto signature = at::full({n, kSignatureWidth}, -1, at::kLong);
  auto rows = signature.accessor<int64_t, 2>();
  for (const auto i : c10::irange(n)) {
    const auto& p = params_[i];
    rows[i][0] = static_cast<int64_t>(p.scalar_type());
    rows[i][1] = p.dim();
    for (int64_t d = 0; d < std::min<int64_t>(p.dim(), kMaxCheckedDims); ++d) {
      rows[i][2 + d] = p.size(d);
    }
  }
  const auto all = allgather(*group_, signature.to(device));
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

void Reducer::broadcast_parameters_from_rank0() {
  // The buckets are flat buffers shaped like the parameters: broadcast through
  // them, one collective per bucket and no temporary copy of the model.
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    for (const auto slot : c10::irange(bucket.params.size())) {
      bucket.views[slot].copy_(params_[bucket.params[slot]]);
    }
    std::vector<at::Tensor> flat{bucket.gradients};
    group_->broadcast(flat)->wait();
    for (const auto slot : c10::irange(bucket.params.size())) {
      params_[bucket.params[slot]].copy_(bucket.views[slot]);
    }
    bucket.gradients.zero_();
  }
}

void Reducer::broadcast_from_rank0(const std::vector<at::Tensor>& tensors) {
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
    group_->broadcast(flat)->wait();
    int64_t offset = 0;
    for (auto& t : members) {
      t.copy_(flat[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

void Reducer::set_window_weight(double weight) {
  TORCH_CHECK_VALUE(weight >= 0, "Reducer: window weight must be >= 0, got ", weight);
  window_weight_ = weight;
}

void Reducer::mark_ready(size_t index) {
  if (!expect_hooks_) {
    return; // no_sync: the gradient stays in .grad
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const int task = torch::autograd::get_current_graph_task_id();
  if (!sync_in_flight_) {
    // A graph task older than the last synchronised one is an outer backward
    // whose nested (reentrant) backward already ran, and reduced, first. Ids
    // come from one global counter, narrowed to int by torch: compare by a
    // bounded distance so that a wrap after ~2^31 backward calls is no error.
    const int64_t newer_by = static_cast<int64_t>(sync_task_) - task;
    TORCH_CHECK(sync_task_ < 0 || newer_by <= 0 || newer_by > (int64_t{1} << 30),
        "gradaccum: ", name(index), " became ready in an outer backward after a nested "
        "backward had already synchronised (reentrant activation checkpointing?); use "
        "torch.utils.checkpoint with use_reentrant=False");
    sync_task_ = task;
    begin_sync_backward();
  }
  TORCH_CHECK(task == sync_task_,
      "gradaccum: ", name(index), " became ready in a nested backward inside a "
      "synchronising backward (reentrant activation checkpointing?); use "
      "torch.utils.checkpoint with use_reentrant=False");
  TORCH_CHECK(!ready_[index],
      "gradaccum: ", name(index), " got its gradient twice in one synchronising "
      "backward (reentrant backward or activation checkpointing over it?); "
      "each parameter may be reduced once per window");
  ready_[index] = 1;
  auto& bucket = buckets_[locator_[index].first];
  copy_into_bucket(bucket, locator_[index].second);
  if (--bucket.pending == 0) {
    launch_ready_buckets();
  }
}

void Reducer::begin_reduction() {
  sync_in_flight_ = true;
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.params.size();
    bucket.missing.clear();
    bucket.works.clear();
  }
  next_launch_ = 0;
  stats_.last_window_collectives = 0;
  stats_.last_window_bytes = 0;
}

void Reducer::begin_sync_backward() {
  begin_reduction();
  torch::autograd::Engine::get_default_engine().queue_callback(
      [this] { finalize_backward(); });
}

void Reducer::copy_into_bucket(Bucket& bucket, size_t slot) {
  auto& grad = params_[bucket.params[slot]].mutable_grad();
  auto& view = bucket.views[slot];
  if (!grad.defined()) {
    view.zero_();
    bucket.missing.push_back(slot);
    return;
  }
  if (grad.unsafeGetTensorImpl() == view.unsafeGetTensorImpl()) {
    return; // bucket view: backward already accumulated in place
  }
  TORCH_CHECK(!grad.is_sparse(), "gradaccum: ", name(bucket.params[slot]), " has a sparse gradient; not supported");
  view.copy_(grad);
  if (options_.gradient_as_bucket_view()) {
    grad = view; // someone replaced .grad (e.g. zero_grad(set_to_none=True)): re-point it
  }
}

void Reducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    launch_bucket(buckets_[next_launch_++]);
  }
}

void Reducer::launch_bucket(Bucket& bucket) {
  bucket.meta.fill_(1);
  bucket.weight().fill_(window_weight_);
  bucket.flushing().fill_(flushing_ ? 1 : 0);
  auto flags = bucket.flags();
  for (const auto slot : bucket.missing) {
    flags.narrow(0, static_cast<int64_t>(slot), 1).fill_(0);
  }
  std::vector<at::Tensor> tensors{bucket.buffer};
  bucket.works.push_back(group_->allreduce(tensors));
  if (!bucket.meta_in_buffer) {
    std::vector<at::Tensor> meta{bucket.meta};
    bucket.works.push_back(group_->allreduce(meta));
  }
  const auto launches = static_cast<int64_t>(bucket.works.size());
  stats_.collectives += launches;
  stats_.last_window_collectives += launches;
  stats_.bytes_reduced += bucket.bytes();
  stats_.last_window_bytes += bucket.bytes();
}

void Reducer::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  finish_reduction(/*read_weight=*/false);
}

double Reducer::synchronize() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!sync_in_flight_, "Reducer::synchronize() called during a synchronising backward");
  begin_reduction();
  flushing_ = true;
  return finish_reduction(/*read_weight=*/true);
}

void Reducer::abandon_reduction() {
  std::lock_guard<std::mutex> lock(mutex_);
  end_reduction();
}

void Reducer::end_reduction() {
  for (auto& bucket : buckets_) {
    bucket.works.clear();
  }
  sync_in_flight_ = false;
  flushing_ = false;
  window_weight_ = 1.0;
}

bool Reducer::last_reduction_closed_partial_windows() const {
  return stats_.windows > 0 && buckets_.front().flushing().item<double>() > 0;
}

double Reducer::finish_reduction(bool read_weight) {
  // Whatever happens below (a peer failing makes wait() throw), the next
  // backward starts from a clean state.
  struct End {
    Reducer* reducer;
    ~End() {
      reducer->end_reduction();
    }
  } end{this};
  // Whatever backward did not make ready (unused on this rank, or used only in
  // earlier micro-steps) is sent as it is: its accumulated .grad, or zeros
  // flagged as missing. Same buckets, same order, on every rank: no hang.
  for (size_t b = next_launch_; b < buckets_.size(); ++b) {
    auto& bucket = buckets_[b];
    for (const auto slot : c10::irange(bucket.params.size())) {
      if (!ready_[bucket.params[slot]]) {
        copy_into_bucket(bucket, slot);
      }
    }
    bucket.pending = 0;
  }
  launch_ready_buckets();

  for (auto& bucket : buckets_) {
    for (auto& work : bucket.works) {
      work->wait();
    }
  }
  // Every bucket carries the same summed weight. Reading it costs a host sync,
  // so only synchronize() does (a window with no micro-step anywhere sums to 0).
  double global_weight = -1;
  bool divide = divide_;
  if (read_weight) {
    global_weight = buckets_.front().weight().item<double>();
    divide = divide && global_weight > 0;
  }
  for (auto& bucket : buckets_) {
    write_back(bucket, divide);
  }
  if (options_.broadcast_buffers() && !buffers_.empty()) {
    broadcast_from_rank0(buffers_);
    ++stats_.broadcasts;
  }
  ++stats_.windows;
  return global_weight;
}

void Reducer::write_back(Bucket& bucket, bool divide) {
  const bool as_view = options_.gradient_as_bucket_view();
  // The division rides on the pass that writes .grad: in place in the bucket
  // for views, fused into the copy back otherwise.
  const auto divisor = bucket.weight().squeeze(0);
  if (divide && as_view) {
    bucket.gradients.div_(divisor);
  }
  // A parameter missing here may have a gradient elsewhere: the summed flag says.
  std::vector<char> nowhere(bucket.params.size(), 0);
  if (!bucket.missing.empty()) {
    const auto flags = bucket.flags().cpu();
    for (const auto slot : bucket.missing) {
      nowhere[slot] = flags[static_cast<int64_t>(slot)].item<double>() == 0;
    }
  }
  for (const auto slot : c10::irange(bucket.params.size())) {
    auto& grad = params_[bucket.params[slot]].mutable_grad();
    const auto& view = bucket.views[slot];
    if (nowhere[slot]) {
      grad = at::Tensor(); // no rank had a gradient: keep it None, as one process would
    } else if (as_view) {
      grad = view;
    } else {
      if (!grad.defined()) {
        grad = at::empty_like(view);
      }
      if (divide) {
        at::div_out(grad, view, divisor);
      } else {
        grad.copy_(view);
      }
    }
  }
}

void Reducer::zero_grad() {
  TORCH_CHECK(!sync_in_flight_, "Reducer::zero_grad() called during a synchronising backward");
  if (!options_.gradient_as_bucket_view()) {
    for (auto& p : params_) {
      p.mutable_grad() = at::Tensor();
    }
    return;
  }
  for (auto& bucket : buckets_) {
    bucket.gradients.zero_();
    for (const auto slot : c10::irange(bucket.params.size())) {
      params_[bucket.params[slot]].mutable_grad() = bucket.views[slot];
    }
  }
}

ReducerStats Reducer::stats() const {
  return stats_;
}

NoSync::NoSync(Reducer* reducer) : reducer_(reducer) {
  if (reducer_) {
    previous_ = reducer_->expect_hooks();
    reducer_->set_expect_hooks(false);
  }
}

NoSync::~NoSync() {
  if (reducer_) {
    reducer_->set_expect_hooks(previous_);
  }
}

NoSync::NoSync(NoSync&& other) noexcept
    : reducer_(other.reducer_), previous_(other.previous_) {
  other.reducer_ = nullptr;
}

} // namespace gradaccum
