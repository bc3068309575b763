// Accumulator::save / load: the state (state_dict()) as a torch archive, by
// Note [The checkpoint schema] in state.h.
#include <gradaccum/accumulator.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <string>
#include <vector>

namespace gradaccum {

namespace {

// Scalars of Note [The checkpoint schema] as archive values.
c10::IValue to_ivalue(int64_t v) { return c10::IValue(v); }
c10::IValue to_ivalue(double v) { return c10::IValue(v); }
c10::IValue to_ivalue(bool v) { return c10::IValue(v); }
c10::IValue to_ivalue(Reduction v) { return c10::IValue(static_cast<int64_t>(v)); }
// Reading one: an archive written by something else (or damaged) gets an
// error naming the key, not torch's internal assert.
constexpr const char* kLoad = "gradaccum: acc.load(): the archive's ";
void from_ivalue(const std::string& key, const c10::IValue& v, int64_t& out) {
  TORCH_CHECK_VALUE(v.isInt(), kLoad, key, " must be an integer, got ", v.tagKind());
  out = v.toInt();
}
void from_ivalue(const std::string& key, const c10::IValue& v, double& out) {
  TORCH_CHECK_VALUE(v.isDouble() || v.isInt(), kLoad, key, " must be a number, got ", v.tagKind());
  out = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}
void from_ivalue(const std::string& key, const c10::IValue& v, bool& out) {
  TORCH_CHECK_VALUE(v.isBool(), kLoad, key, " must be a bool, got ", v.tagKind());
  out = v.toBool();
}
void from_ivalue(const std::string& key, const c10::IValue& v, Reduction& out) {
  TORCH_CHECK_VALUE(v.isInt(), kLoad, key, " must be an integer, got ", v.tagKind());
  const auto code = v.toInt();
  TORCH_CHECK_VALUE(code >= static_cast<int64_t>(Reduction::Mean) && code <= static_cast<int64_t>(Reduction::Items),
      kLoad, key, " is ", code, ", which names no reduction");
  out = static_cast<Reduction>(code);
}
// A key acc.save() always writes: missing, the archive is not (all) ours,
// an error naming it, not torch's ObjectAttributeError.
void read_required(torch::serialize::InputArchive& archive, const std::string& key, c10::IValue& value) {
  if (archive.try_read(key, value)) {
    return;
  }
  TORCH_CHECK_VALUE(key != "gradaccum.steps",
      "gradaccum: acc.load(): the archive holds no Accumulator state (no gradaccum.steps): write it with "
      "acc.save(archive) beside the model's and the optimizer's");
  TORCH_CHECK_VALUE(false, kLoad, key, " is missing (a damaged archive, or not one acc.save() wrote)");
}
int64_t read_count(const std::string& key, const c10::IValue& v) {
  int64_t count = 0;
  from_ivalue(key, v, count);
  TORCH_CHECK_VALUE(count >= 0, kLoad, key, " is ", count, ", not a count");
  return count;
}

// A list of tensors, undefined ones included: `count_key`, then per entry
// `prefix<i>.defined` and `prefix<i>` (an empty tensor where undefined).
void write_tensors(torch::serialize::OutputArchive& archive, const std::string& count_key,
                   const std::string& prefix, const std::vector<at::Tensor>& tensors) {
  archive.write(count_key, c10::IValue(static_cast<int64_t>(tensors.size())));
  for (const auto i : c10::irange(tensors.size())) {
    const auto key = prefix + std::to_string(i);
    archive.write(key + ".defined", c10::IValue(tensors[i].defined()));
    archive.write(key, tensors[i].defined() ? tensors[i] : at::empty({0}), /*is_buffer=*/true);
  }
}

std::vector<at::Tensor> read_tensors(torch::serialize::InputArchive& archive, const std::string& prefix,
                                     int64_t count) {
  std::vector<at::Tensor> tensors;
  c10::IValue defined;
  for (int64_t i = 0; i < count; ++i) {
    at::Tensor tensor;
    const auto key = prefix + std::to_string(i);
    read_required(archive, key + ".defined", defined);
    TORCH_CHECK_VALUE(archive.try_read(key, tensor, /*is_buffer=*/true), kLoad, key, " is missing (a damaged "
        "archive, or not one acc.save() wrote)");
    bool is_defined = false;
    from_ivalue(key + ".defined", defined, is_defined);
    tensors.push_back(is_defined ? tensor : at::Tensor());
  }
  return tensors;
}

std::vector<std::string> read_names(const c10::IValue& value, const char* key) {
  TORCH_CHECK_VALUE(value.isList(), kLoad, key, " must be a list of names, got ", value.tagKind());
  std::vector<std::string> names;
  for (const auto& name : value.toListRef()) {
    TORCH_CHECK_VALUE(name.isString(), kLoad, key, " must be a list of names, got a ", name.tagKind());
    names.push_back(name.toStringRef());
  }
  return names;
}

} // namespace

void Accumulator::save(torch::serialize::OutputArchive& archive, bool rank_independent) {
  const auto state = state_dict(rank_independent);
  for_each_state_field(state, [&](const char* name, const auto& field, bool) {
    archive.write(std::string("gradaccum.") + name, to_ivalue(field));
  });
  write_tensors(archive, "gradaccum.grads", "gradaccum.grad.", state.grads);
  write_tensors(archive, "gradaccum.residuals", "gradaccum.residual.", state.residuals);
  if (state.window_loss_sums.defined()) {
    archive.write("gradaccum.window_loss_sums", state.window_loss_sums);
    c10::List<std::string> metric_names;
    for (const auto& name : state.window_metric_names) {
      metric_names.push_back(name);
    }
    archive.write("gradaccum.window_metric_names", c10::IValue(metric_names));
  }
  c10::List<std::string> names;
  for (const auto& name : state.parameter_names) {
    names.push_back(name);
  }
  archive.write("gradaccum.parameter_names", c10::IValue(names));
}

void Accumulator::load(torch::serialize::InputArchive& archive) {
  AccumulatorState state;
  c10::IValue value;
  for_each_state_field(state, [&](const char* name, auto& field, bool required) {
    const auto key = std::string("gradaccum.") + name;
    if (required) {
      read_required(archive, key, value);
    } else if (!archive.try_read(key, value)) {
      return; // an older archive: the field keeps its default
    }
    from_ivalue(key, value, field);
  });
  read_required(archive, "gradaccum.grads", value);
  state.grads = read_tensors(archive, "gradaccum.grad.", read_count("gradaccum.grads", value));
  if (archive.try_read("gradaccum.residuals", value)) { // older archives have none
    state.residuals = read_tensors(archive, "gradaccum.residual.", read_count("gradaccum.residuals", value));
  }
  at::Tensor sums;
  if (archive.try_read("gradaccum.window_loss_sums", sums)) { // older archives have none: the loss is not known
    state.window_loss_sums = sums;
    if (archive.try_read("gradaccum.window_metric_names", value)) {
      state.window_metric_names = read_names(value, "gradaccum.window_metric_names");
    }
  }
  if (archive.try_read("gradaccum.parameter_names", value)) { // older archives load by position
    state.parameter_names = read_names(value, "gradaccum.parameter_names");
  }
  load_state_dict(state);
}

} // namespace gradaccum
