#include <gradaccum/split.h>

#include <c10/util/Exception.h>

namespace gradaccum {

std::vector<std::vector<at::Tensor>> split(
    const std::vector<at::Tensor>& batch,
    int64_t steps) {
  TORCH_CHECK_VALUE(!batch.empty(), "gradaccum: split(): the batch holds no tensor");
  TORCH_CHECK_VALUE(steps > 0, "gradaccum: split(): steps must be positive, got ", steps);
  int64_t rows = -1;
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& t = batch[i];
    TORCH_CHECK_VALUE(t.defined(), "gradaccum: split(): tensor ", i, " is undefined");
    // (narrow() would fail inside torch on these, or on the first use of a part.)
    TORCH_CHECK_VALUE(!t.is_nested() && t.layout() == at::kStrided, "gradaccum: split(): tensor ", i, " is ",
        t.is_nested() ? std::string("a nested tensor") : "layout " + c10::str(t.layout()),
        "; only dense (strided) tensors split into views: pass a dense (padded) tensor, or split the samples "
        "yourself");
    TORCH_CHECK_VALUE(
        t.dim() > 0, "gradaccum: split(): tensor ", i, " is a 0-dim tensor; it has no dim 0 to split along");
    if (rows < 0) {
      rows = t.size(0);
    }
    TORCH_CHECK_VALUE(
        t.size(0) == rows,
        "gradaccum: split(): tensors have different batch sizes: tensor 0 has ",
        rows, " rows, tensor ", i, " has ", t.size(0));
  }
  TORCH_CHECK_VALUE(
      steps <= rows,
      "gradaccum: split(): cannot split ", rows, " rows into ", steps,
      " micro-batches (steps must be <= the batch size)");

  std::vector<std::vector<at::Tensor>> out(steps);
  const int64_t base = rows / steps;
  const int64_t extra = rows % steps;
  int64_t start = 0;
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t length = base + (k < extra ? 1 : 0);
    out[k].reserve(batch.size());
    for (const auto& t : batch) {
      out[k].push_back(t.narrow(0, start, length));
    }
    start += length;
  }
  return out;
}

std::vector<at::Tensor> split(const at::Tensor& batch, int64_t steps) {
  auto parts = split(std::vector<at::Tensor>{batch}, steps);
  std::vector<at::Tensor> out;
  out.reserve(parts.size());
  for (auto& part : parts) {
    out.push_back(std::move(part[0]));
  }
  return out;
}

} // namespace gradaccum
