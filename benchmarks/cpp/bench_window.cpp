// bench_window: gradaccum's C++ contender of benchmarks/bench.py.
//
// One rank of a data-parallel run: launch WORLD_SIZE copies with RANK,
// WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (torchrun sets them too; and
// LOCAL_WORLD_SIZE, which an unset bucket cap follows), e.g.
//
//   for r in 0 1; do RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 \
//     OMP_NUM_THREADS=1 build/bench/bench_window --model small --steps 1,4,16 --windows 20 & done; wait
//
// The model is the benchmark's Linear/ReLU stack (the same widths as
// benchmarks/_bench_worker.py), trained with SGD on random data through a
// gradaccum::Accumulator with K = --steps micro-batches of 32 rows per window;
// or, with --model gpt, its GPT-style transformer (torch::nn modules, the same
// sizes and parameter order as the Python one) on random tokens, micro-batches
// of 2 sequences (GRADACCUM_BENCH_GPT_MICRO_BATCH).
// Each rank prints one JSON line per K: the time of each window (seconds, after
// one warm-up window), the reducer's buckets, collectives and bytes of the last
// window, the process's peak RSS (VmHWM, KiB), and the last window's micro-step
// clock marks and Accumulator::last_window_timeline() (benchmarks/_bound.py).
//
// --serve: instead, read commands from stdin, the same on every rank, and
// answer each with one JSON line ("@@ {...}"); bench.py drives it this way to
// interleave it with the Python contenders:
//   run K W    W timed windows of K micro-batches (no warm-up)
//   rss        peak RSS so far
//   quit
//
// --contenders gradaccum,local: also time plain LibTorch without communication
// (the floor: loss / K, backward, optimizer step), one JSON line per K and
// contender, in the other order each time a K comes again in --steps.
// --widths 512,1024,10 replaces --model's layer widths.
//
// --callgrind: count instructions instead of time (run under
// `valgrind --tool=callgrind --instr-atstart=no`): after warm-up windows,
// switches instrumentation on around each measured section, per contender
// (gradaccum, local) and K = the first --steps value, the K-1 no-sync
// micro-steps of one window and --windows whole windows, each dumped under a
// label ("gradaccum micro", "gradaccum window", ...) that benchmarks/bench_instr.py reads.
#include <gradaccum/gradaccum.h>

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define BENCH_HAVE_CALLGRIND 1
#else
#define BENCH_HAVE_CALLGRIND 0
#endif

namespace {

// Rows per micro-batch: 32, or GRADACCUM_BENCH_MICRO_BATCH (as _bench_worker.py).
int64_t micro_batch_rows() {
  const char* env = std::getenv("GRADACCUM_BENCH_MICRO_BATCH");
  return env && *env ? std::stoll(env) : 32;
}
// Sequences per transformer micro-batch: 2, or GRADACCUM_BENCH_GPT_MICRO_BATCH (as _bench_worker.py).
int64_t gpt_micro_batch() {
  const char* env = std::getenv("GRADACCUM_BENCH_GPT_MICRO_BATCH");
  return env && *env ? std::stoll(env) : 2;
}
constexpr int64_t kPool = 16;
constexpr double kLr = 1e-4;

std::vector<int64_t> widths_of(const std::string& model) {
  if (model == "small") {
    return {256, 512, 256, 128, 10};
  }
  if (model == "large") {
    return {1024, 2048, 2048, 2048, 256};
  }
  if (model == "gpt") {
    return {};
  }
  throw std::invalid_argument("--model must be small, large or gpt, got '" + model + "'");
}

// The transformer of _bench_worker.py (TRANSFORMERS["gpt"]): token and position
// embeddings, pre-LayerNorm blocks of causal self-attention and a 4x MLP, a
// final LayerNorm, the output head tied to the token embedding. Registered in
// the same order as the Python model, so parameters() agree.
struct GptConfig {
  int64_t vocab = 4096, seq = 128, d = 384, layers = 6, heads = 6;
};

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads)
      : heads(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        qkv(register_module("qkv", torch::nn::Linear(d, 3 * d))),
        proj(register_module("proj", torch::nn::Linear(d, d))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc(register_module("fc", torch::nn::Linear(d, 4 * d))),
        out(register_module("out", torch::nn::Linear(4 * d, d))) {}

  torch::Tensor forward(torch::Tensor x) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2);
    auto q = qkv->forward(ln1->forward(x)).view({b, t, 3, heads, d / heads}).permute({2, 0, 3, 1, 4});
    auto a = at::scaled_dot_product_attention(q[0], q[1], q[2], {}, 0.0, /*is_causal=*/true)
                 .transpose(1, 2)
                 .reshape({b, t, d});
    x = x + proj->forward(a);
    return x + out->forward(torch::gelu(fc->forward(ln2->forward(x))));
  }

  int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, out;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& c)
      : wte(register_module("wte", torch::nn::Embedding(c.vocab, c.d))),
        wpe(register_module("wpe", torch::nn::Embedding(c.seq, c.d))),
        blocks(register_module("blocks", torch::nn::ModuleList())) {
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks->push_back(Block(c.d, c.heads));
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d})));
  }

  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = wte->forward(idx) + wpe->forward(torch::arange(idx.size(1)));
    for (auto& block : *blocks) {
      x = block->as<Block>()->forward(x);
    }
    return torch::linear(ln_f->forward(x), wte->weight); // tied output head
  }

  torch::nn::Embedding wte, wpe;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Gpt);

/// A benchmark model: the module (its parameters) and its forward.
struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  bool language_model = false;

  /// MSE for the MLPs, next-token cross-entropy for the transformer.
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y) const {
    auto out = forward(x);
    if (language_model) {
      return torch::cross_entropy_loss(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
    }
    return torch::mse_loss(out, y);
  }
};

Model build_model(const std::string& name, const std::vector<int64_t>& widths) {
  torch::manual_seed(0); // the same initial weights on every rank
  if (name == "gpt" && widths.empty()) {
    Gpt gpt{GptConfig{}};
    return {gpt.ptr(), [gpt](const torch::Tensor& x) mutable { return gpt->forward(x); }, true};
  }
  torch::nn::Sequential model;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    model->push_back(torch::nn::Linear(widths[i], widths[i + 1]));
    if (i + 2 < widths.size()) {
      model->push_back(torch::nn::ReLU());
    }
  }
  return {model.ptr(), [model](const torch::Tensor& x) mutable { return model->forward(x); }, false};
}

/// Seconds on the steady clock (CLOCK_MONOTONIC, as Python's perf_counter).
double clock_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t peak_rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      return std::stoll(line.substr(6));
    }
  }
  return -1;
}

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    out.push_back(std::stoll(item));
  }
  return out;
}

/// Plain LibTorch, no communication: the floor a reducer is measured against.
struct LocalContender {
  LocalContender(const std::string& name, const std::vector<int64_t>& widths)
      : model(build_model(name, widths)), optimizer(model.module->parameters(), torch::optim::SGDOptions(kLr)) {}

  void micro_step(const torch::Tensor& x, const torch::Tensor& y, int64_t steps) {
    (model.loss(x, y) / static_cast<double>(steps)).backward();
  }

  Model model;
  torch::optim::SGD optimizer;
};

// Bucket cap in MiB: GRADACCUM_BENCH_BUCKET_CAP_MB (as _bench_worker.py), or else
// the library's default (unset: from the model's size).
std::optional<double> bucket_cap_mb() {
  const char* env = std::getenv("GRADACCUM_BENCH_BUCKET_CAP_MB");
  return env && *env ? std::optional<double>(std::stod(env)) : gradaccum::ReducerOptions().bucket_cap_mb();
}

// gradaccum's first bucket cap in MiB: the default, or GRADACCUM_BENCH_FIRST_BUCKET_CAP_MB.
double first_bucket_cap_mb() {
  const char* env = std::getenv("GRADACCUM_BENCH_FIRST_BUCKET_CAP_MB");
  return env && *env ? std::stod(env) : gradaccum::ReducerOptions().first_bucket_cap_mb();
}

/// One Accumulator (over its own copy of the model) per K.
struct Contender {
  Contender(
      const std::string& name,
      const std::vector<int64_t>& widths,
      int64_t steps,
      const c10::intrusive_ptr<c10d::ProcessGroup>& group,
      bool bucket_view,
      gradaccum::NonFinite nonfinite)
      : model(build_model(name, widths)),
        optimizer(model.module->parameters(), torch::optim::SGDOptions(kLr)),
        accumulator(
            model.module,
            optimizer,
            gradaccum::AccumulatorOptions(steps)
                .nonfinite(nonfinite)
                .process_group(group)
                .reducer(gradaccum::ReducerOptions()
                             .gradient_as_bucket_view(bucket_view)
                             .bucket_cap_mb(bucket_cap_mb())
                             .first_bucket_cap_mb(first_bucket_cap_mb()))) {}

  Model model;
  torch::optim::SGD optimizer;
  gradaccum::Accumulator accumulator;
};

/// The timeline of the last reduction (acc.last_window_timeline() in Python) as JSON.
std::string timeline_json(const gradaccum::WindowTimeline& t) {
  std::ostringstream out;
  out.precision(9);
  out << "{\"gradients\": [";
  for (size_t i = 0; i < t.gradients.size(); ++i) {
    out << (i ? ", " : "") << t.gradients[i];
  }
  out << "], \"buckets\": [";
  for (size_t i = 0; i < t.buckets.size(); ++i) {
    const auto& b = t.buckets[i];
    out << (i ? ", " : "") << "{\"bytes\": " << b.bytes << ", \"ready\": " << b.ready
        << ", \"launched\": " << b.launched << ", \"completed\": " << b.completed
        << ", \"written\": " << b.written << "}";
  }
  out << "], \"backward_end\": " << t.backward_end << ", \"finished\": " << t.finished << "}";
  return out.str();
}

struct Runner {
  std::string model_name;
  std::vector<int64_t> widths;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  bool bucket_view = false;
  gradaccum::NonFinite nonfinite = gradaccum::NonFinite::Skip;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  std::map<int64_t, std::unique_ptr<Contender>> contenders;
  std::unique_ptr<LocalContender> local;

  LocalContender& get_local() {
    if (!local) {
      local = std::make_unique<LocalContender>(model_name, widths);
    }
    return *local;
  }

  void local_window(int64_t steps, int64_t start) {
    auto& c = get_local();
    for (int64_t i = 0; i < steps; ++i) {
      const auto& [x, y] = data[(start + i) % data.size()];
      c.micro_step(x, y, steps);
    }
    c.optimizer.step();
    c.optimizer.zero_grad();
  }

  std::string run_local(int64_t steps, int64_t windows, int64_t warmup) {
    for (int64_t w = 0; w < warmup; ++w) {
      local_window(steps, w * steps);
    }
    group->barrier()->wait();
    std::vector<double> times;
    for (int64_t w = 0; w < windows; ++w) {
      const auto t0 = std::chrono::steady_clock::now();
      local_window(steps, w * steps);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::ostringstream out;
    out.precision(9);
    out << "{\"rank\": " << group->getRank() << ", \"contender\": \"local_cpp\", \"model\": \"" << model_name
        << "\", \"K\": " << steps << ", \"times\": [";
    for (size_t i = 0; i < times.size(); ++i) {
      out << (i ? ", " : "") << times[i];
    }
    out << "], \"peak_rss_kib\": " << peak_rss_kib() << "}";
    return out.str();
  }

  /// Instruction counts under callgrind (see the file comment); one JSON line.
  std::string count_instructions(int64_t steps, int64_t windows) {
#if BENCH_HAVE_CALLGRIND
    TORCH_CHECK(steps >= 2, "--callgrind needs K >= 2 (a window with no-sync micro-steps)");
    // Instrumentation on and off around each section (global: Gloo's threads
    // count too; collection toggles would be per thread), zeroed, then dumped.
    auto begin = [] {
      CALLGRIND_START_INSTRUMENTATION;
      CALLGRIND_ZERO_STATS;
    };
    auto end = [](const char* label) {
      CALLGRIND_STOP_INSTRUMENTATION;
      CALLGRIND_DUMP_STATS_AT(label);
    };
    auto& acc = get(steps);
    for (int64_t w = 0; w < 2; ++w) { // warm-up
      window(acc, steps, w * steps);
      local_window(steps, w * steps);
    }
    // gradaccum: the K-1 no-sync micro-steps of a window, then whole windows.
    group->barrier()->wait();
    begin();
    for (int64_t i = 0; i + 1 < steps; ++i) {
      const auto& [x, y] = data[i % data.size()];
      acc.accumulator.backward(acc.model.loss(x, y));
      acc.accumulator.step();
    }
    end("gradaccum micro");
    {
      const auto& [x, y] = data[(steps - 1) % data.size()];
      acc.accumulator.backward(acc.model.loss(x, y));
      acc.accumulator.step();
    }
    group->barrier()->wait();
    begin();
    for (int64_t w = 0; w < windows; ++w) {
      window(acc, steps, w * steps);
    }
    end("gradaccum window");
    auto& loc = get_local();
    begin();
    for (int64_t i = 0; i + 1 < steps; ++i) {
      const auto& [x, y] = data[i % data.size()];
      loc.micro_step(x, y, steps);
    }
    end("local micro");
    {
      const auto& [x, y] = data[(steps - 1) % data.size()];
      loc.micro_step(x, y, steps);
      loc.optimizer.step();
      loc.optimizer.zero_grad();
    }
    begin();
    for (int64_t w = 0; w < windows; ++w) {
      local_window(steps, w * steps);
    }
    end("local window");
    // One all-reduce of the whole gradient alone, as one flat tensor.
    int64_t numel = 0;
    for (const auto& p : acc.model.module->parameters()) {
      numel += p.numel();
    }
    std::vector<at::Tensor> flat = {torch::zeros({numel})};
    group->allreduce(flat)->wait();
    group->barrier()->wait();
    begin();
    group->allreduce(flat)->wait();
    end("allreduce");
    group->barrier()->wait();
    std::ostringstream out;
    out << "{\"rank\": " << group->getRank() << ", \"K\": " << steps << ", \"windows\": " << windows
        << ", \"micro_steps\": " << steps - 1 << ", \"running_on_valgrind\": " << RUNNING_ON_VALGRIND
        << ", \"dumps\": [\"gradaccum micro\", \"gradaccum window\", \"local micro\", \"local window\", \"allreduce\"]}";
    return out.str();
#else
    (void)steps;
    (void)windows;
    TORCH_CHECK(false, "bench_window was built without <valgrind/callgrind.h>: install valgrind and rebuild");
#endif
  }

  Contender& get(int64_t steps) {
    auto it = contenders.find(steps);
    if (it == contenders.end()) {
      it = contenders.emplace(steps, std::make_unique<Contender>(model_name, widths, steps, group, bucket_view, nonfinite)).first;
    }
    return *it->second;
  }

  /// With `marks`, the window's micro-steps' clock marks replace it: per
  /// micro-step (start, forward done, backward returned, step done), seconds
  /// (as _bench_worker.py's).
  void window(Contender& c, int64_t steps, int64_t start, std::vector<std::array<double, 4>>* marks = nullptr) {
    if (marks) {
      marks->clear();
    }
    for (int64_t i = 0; i < steps; ++i) {
      const auto& [x, y] = data[(start + i) % data.size()];
      if (!marks) {
        c.accumulator.backward(c.model.loss(x, y));
        c.accumulator.step();
        continue;
      }
      std::array<double, 4> m{clock_s(), 0, 0, 0};
      auto loss = c.model.loss(x, y);
      m[1] = clock_s();
      c.accumulator.backward(loss);
      m[2] = clock_s();
      c.accumulator.step();
      m[3] = clock_s();
      marks->push_back(m);
    }
  }

  std::string run(int64_t steps, int64_t windows, int64_t warmup) {
    auto& c = get(steps);
    for (int64_t w = 0; w < warmup; ++w) {
      window(c, steps, w * steps);
    }
    group->barrier()->wait();
    std::vector<double> times;
    std::vector<std::array<double, 4>> marks;
    for (int64_t w = 0; w < windows; ++w) {
      const auto t0 = std::chrono::steady_clock::now();
      window(c, steps, w * steps, &marks);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const auto stats = c.accumulator.stats();
    std::ostringstream out;
    out.precision(9);
    out << "{\"rank\": " << group->getRank() << ", \"contender\": \"gradaccum_cpp\", \"model\": \""
        << model_name << "\", \"K\": " << steps << ", \"bucket_view\": " << (bucket_view ? 1 : 0)
        << ", \"times\": [";
    for (size_t i = 0; i < times.size(); ++i) {
      out << (i ? ", " : "") << times[i];
    }
    out << "], \"buckets\": " << stats.reducer.buckets
        << ", \"last_window_collectives\": " << stats.reducer.last_window_collectives
        << ", \"last_window_bytes\": " << stats.reducer.last_window_bytes
        << ", \"optimizer_steps\": " << stats.optimizer_steps
        << ", \"peak_rss_kib\": " << peak_rss_kib();
    if (windows > 0) {
      // The last window: its micro-steps' clock marks and the timeline of its
      // synchronising backward (benchmarks/_bound.py).
      out << ", \"marks\": [";
      std::ostringstream m;
      m << std::fixed << std::setprecision(7);
      for (size_t i = 0; i < marks.size(); ++i) {
        m << (i ? ", " : "") << "[" << marks[i][0] << ", " << marks[i][1] << ", " << marks[i][2] << ", "
          << marks[i][3] << "]";
      }
      out << m.str();
      out << "], \"timeline\": " << timeline_json(c.accumulator.last_window_timeline());
    }
    out << "}";
    return out.str();
  }
};

[[noreturn]] void usage(const char* argv0, const std::string& error) {
  std::cerr << argv0 << ": " << error << "\n"
            << "usage: " << argv0
            << " [--model small|large|gpt] [--steps 1,4,16] [--windows N] [--warmup N]"
               " [--bucket-view 0|1] [--nonfinite skip|raise|ignore] [--serve]\n"
               "       [--widths 256,512,10] [--contenders gradaccum,local] [--callgrind]\n"
               "Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment.\n";
  std::exit(2);
}

} // namespace

// GRADACCUM_BENCH_COMPUTE_QUOTA=F: as _bench_worker.py's cap_compute_thread,
// this (compute) thread gets at most F of a core through a cgroup v1 cpu
// quota in GRADACCUM_BENCH_CGROUP_DIR; Gloo's threads, started with the
// group before this, stay outside the cap (a group created later would start
// its threads inside it). At exit the thread moves back to the hierarchy's
// root and the cgroup is removed.
static void cap_compute_thread() {
  const char* q = std::getenv("GRADACCUM_BENCH_COMPUTE_QUOTA");
  if (q == nullptr || *q == '\0') {
    return;
  }
  char* end = nullptr;
  const double quota = std::strtod(q, &end);
  TORCH_CHECK_VALUE(end != q && *end == '\0', "GRADACCUM_BENCH_COMPUTE_QUOTA=", q, ": not a number");
  if (quota == 0.0) {
    return;
  }
  TORCH_CHECK_VALUE(quota > 0.0 && quota < 1.0, "GRADACCUM_BENCH_COMPUTE_QUOTA=", q,
                    ": expected a fraction of a core in (0, 1)");
  const char* root = std::getenv("GRADACCUM_BENCH_CGROUP_DIR");
  TORCH_CHECK_VALUE(root != nullptr, "GRADACCUM_BENCH_COMPUTE_QUOTA needs GRADACCUM_BENCH_CGROUP_DIR");
  static const std::string base = root;
  static const auto tid = static_cast<long>(syscall(SYS_gettid));
  static const std::string group = base + "/gradaccum-bench-" + std::to_string(getpid()) + "-" + std::to_string(tid);
  const auto put = [](const std::string& path, const std::string& value) {
    std::ofstream f(path);
    f << value;
    f.close();
    TORCH_CHECK(f.good(), "bench_window: cannot write ", value, " to ", path, ": ", std::strerror(errno));
  };
  TORCH_CHECK(mkdir(group.c_str(), 0755) == 0, "bench_window: cannot create the cgroup ", group, ": ",
              std::strerror(errno));
  constexpr int64_t kPeriod = 10000;
  put(group + "/cpu.cfs_period_us", std::to_string(kPeriod));
  put(group + "/cpu.cfs_quota_us", std::to_string(std::llround(quota * kPeriod)));
  put(group + "/tasks", std::to_string(tid));
  std::atexit([] {
    std::ofstream(base + "/tasks") << tid;
    rmdir(group.c_str());
  });
}

int main(int argc, char** argv) {
  std::string model_name = "small";
  std::vector<int64_t> steps = {1, 4, 16};
  int64_t windows = 20;
  int64_t warmup = 1;
  bool bucket_view = false;
  bool serve = false;
  bool callgrind = false;
  std::string nonfinite = "skip";
  std::vector<int64_t> widths;
  std::vector<std::string> contenders = {"gradaccum"};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage(argv[0], arg + " needs a value");
      }
      return argv[++i];
    };
    if (arg == "--model") {
      model_name = value();
    } else if (arg == "--steps") {
      steps = parse_list(value());
    } else if (arg == "--windows") {
      windows = std::stoll(value());
    } else if (arg == "--warmup") {
      warmup = std::stoll(value());
    } else if (arg == "--bucket-view") {
      bucket_view = value() != "0";
    } else if (arg == "--nonfinite") {
      nonfinite = value();
    } else if (arg == "--serve") {
      serve = true;
    } else if (arg == "--callgrind") {
      callgrind = true;
    } else if (arg == "--widths") {
      widths = parse_list(value());
    } else if (arg == "--contenders") {
      contenders.clear();
      std::stringstream ss(value());
      std::string item;
      while (std::getline(ss, item, ',')) {
        if (item != "gradaccum" && item != "local") {
          usage(argv[0], "--contenders takes gradaccum and/or local, got " + item);
        }
        contenders.push_back(item);
      }
    } else if (arg == "-h" || arg == "--help") {
      usage(argv[0], "benchmark of gradaccum's data-parallel window");
    } else {
      usage(argv[0], "unknown argument " + arg);
    }
  }

  try {
    torch::set_num_threads(1);
    Runner runner;
    runner.model_name = model_name;
    runner.widths = widths.empty() ? widths_of(model_name) : widths;
    runner.bucket_view = bucket_view;
    runner.nonfinite = gradaccum::nonfinite_from_string(nonfinite);
    runner.group = gradaccum::init_process_group_from_env(gradaccum::ProcessGroupOptions().backend("gloo"));
    TORCH_CHECK(runner.group, "bench_window measures data-parallel windows: launch it with torchrun");
    if (const char* nice = std::getenv("GRADACCUM_BENCH_COMPUTE_NICE"); nice && std::atoi(nice) != 0) {
      // As _bench_worker.py: this thread computes, Gloo's threads (started with
      // the group) keep their priority and get a core whenever they need one.
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), std::atoi(nice));
    }
    cap_compute_thread();
    torch::manual_seed(1 + runner.group->getRank());
    for (int64_t i = 0; i < kPool; ++i) {
      if (runner.widths.empty()) { // the transformer: random tokens
        const GptConfig c;
        runner.data.emplace_back(
            torch::randint(c.vocab, {gpt_micro_batch(), c.seq}), torch::randint(c.vocab, {gpt_micro_batch(), c.seq}));
        continue;
      }
      runner.data.emplace_back(
          torch::randn({micro_batch_rows(), runner.widths.front()}),
          torch::randn({micro_batch_rows(), runner.widths.back()}));
    }

    if (callgrind) {
      std::cout << "@@ " << runner.count_instructions(steps.front(), windows) << std::endl;
      return 0;
    }
    if (!serve) {
      // Each time a K comes again in --steps (bench_net.py passes its K
      // values once per block), its contenders run in the other order (as
      // _bench_worker.py rotates them), so that neither always runs first.
      std::map<int64_t, int64_t> seen;
      for (const auto k : steps) {
        auto order = contenders;
        if (seen[k]++ % 2 == 1) {
          std::reverse(order.begin(), order.end());
        }
        for (const auto& c : order) {
          std::cout << (c == "local" ? runner.run_local(k, windows, warmup) : runner.run(k, windows, warmup))
                    << std::endl;
        }
      }
      return 0;
    }
    std::string line;
    while (std::getline(std::cin, line)) {
      std::istringstream in(line);
      std::string cmd;
      if (!(in >> cmd)) {
        continue;
      }
      if (cmd == "quit") {
        break;
      }
      if (cmd == "run") {
        int64_t k = 0, w = 0;
        in >> k >> w;
        std::cout << "@@ " << runner.run(k, w, 0) << std::endl;
      } else if (cmd == "rss") {
        std::cout << "@@ {\"rank\": " << runner.group->getRank() << ", \"peak_rss_kib\": " << peak_rss_kib()
                  << "}" << std::endl;
      } else {
        std::cout << "@@ {\"error\": \"unknown command\"}" << std::endl;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_window: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
