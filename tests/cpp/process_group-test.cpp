#include "test_util.h"

#include "catch_torch.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>

using namespace gradaccum;

namespace {
struct EnvGuard {
  explicit EnvGuard(std::vector<std::pair<std::string, std::string>> vars) {
    for (auto& [k, v] : vars) {
      const char* old = std::getenv(k.c_str());
      saved.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
      if (v.empty()) unsetenv(k.c_str()); else setenv(k.c_str(), v.c_str(), 1);
    }
  }
  ~EnvGuard() {
    for (auto& [k, v] : saved) {
      if (v) setenv(k.c_str(), v->c_str(), 1); else unsetenv(k.c_str());
    }
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
};

// What is written to file descriptor 2 while `fn` runs.
template <typename F>
std::string capture_stderr(F&& fn) {
  char path[] = "/tmp/gradaccum-stderr-XXXXXX";
  const int file = mkstemp(path);
  REQUIRE(file >= 0);
  std::cerr.flush();
  std::fflush(stderr);
  const int saved = dup(2);
  dup2(file, 2);
  fn();
  std::cerr.flush();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(file);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  unlink(path);
  return text;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

const std::vector<std::pair<std::string, std::string>> kNoLaunch{
    {"RANK", ""}, {"WORLD_SIZE", ""}, {"LOCAL_RANK", ""}, {"MASTER_ADDR", ""},
    {"MASTER_PORT", ""}, {"TORCHELASTIC_USE_AGENT_STORE", ""}};
} // namespace

TEST_CASE("without torchrun's variables there is no group, said once", "[process_group]") {
  EnvGuard env(kNoLaunch);
  CHECK_FALSE(LaunchEnvironment::launched());
  c10::intrusive_ptr<c10d::ProcessGroup> first, second;
  const auto said = capture_stderr([&] {
    first = init_process_group_from_env();
    second = init_process_group_from_env();
  });
  CHECK_FALSE(first);
  CHECK_FALSE(second);
  CHECK(count(said, "running as one process, without a process group") == 1);
}

TEST_CASE("some of torchrun's variables but not all is an error", "[process_group][errors]") {
  auto vars = kNoLaunch;
  vars[3].second = "127.0.0.1"; // MASTER_ADDR alone
  EnvGuard env(vars);
  CHECK(LaunchEnvironment::launched());
  CHECK_THROWS_WITH(init_process_group_from_env(), Catch::Contains("WORLD_SIZE is not set"));
}

TEST_CASE("torchrun's variables are read and checked", "[process_group]") {
  {
    EnvGuard env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                  {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
    auto e = LaunchEnvironment::from_env();
    CHECK(e.rank == 1);
    CHECK(e.world_size == 2);
    CHECK(e.master_port == 29500);
    CHECK(e.agent_store);
  }
  {
    EnvGuard env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"},
                  {"TORCHELASTIC_RESTART_COUNT", "3"}, {"TORCHELASTIC_MAX_RESTARTS", "5"}, {"GROUP_WORLD_SIZE", "2"}});
    auto e = LaunchEnvironment::from_env();
    CHECK(e.restart_count == 3);
    CHECK(e.max_restarts == 5);
    CHECK(e.agents == 2);
  }
  {
    EnvGuard env({{"RANK", ""}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
    CHECK_THROWS_WITH(LaunchEnvironment::from_env(), Catch::Contains("RANK is not set"));
  }
  {
    EnvGuard env({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
    CHECK_THROWS_WITH(LaunchEnvironment::from_env(), Catch::Contains("RANK=2 is not below WORLD_SIZE=2"));
  }
  {
    EnvGuard env({{"RANK", "0"}, {"WORLD_SIZE", "two"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
    CHECK_THROWS_WITH(LaunchEnvironment::from_env(), Catch::Contains("WORLD_SIZE='two'"));
  }
}

TEST_CASE("a Gloo group built from C++ all-reduces", "[process_group]") {
  std::vector<double> sums(3);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      auto group = new_process_group(store, r, 3, ProcessGroupOptions().backend("gloo"));
      std::vector<at::Tensor> t{torch::full({5}, double(r + 1), torch::kFloat64)};
      group->allreduce(t)->wait();
      sums[r] = t[0][4].item<double>();
    });
  }
  for (auto& t : threads) t.join();
  CHECK(sums == std::vector<double>{6, 6, 6});
}

TEST_CASE("bad group arguments are rejected", "[process_group][errors]") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  CHECK_THROWS_WITH(new_process_group(store, 2, 2), Catch::Contains("out of range"));
  CHECK_THROWS_WITH(new_process_group(store, 0, 1, ProcessGroupOptions().backend("mpi")),
      Catch::Contains("invalid backend: 'mpi'"));
  if (!nccl_available()) {
    CHECK_THROWS_WITH(new_process_group(store, 0, 1, ProcessGroupOptions().backend("nccl")),
        Catch::Contains("built without NCCL"));
  }
}

TEST_CASE("parameters on a device the group has no backend for are refused when built",
          "[process_group][errors]") {
  // A group that reduces CUDA tensors only (as NCCL alone does), over CPU parameters.
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto gloo = new_process_group(store, 0, 1, ProcessGroupOptions().backend("gloo"));
  auto cuda_only = c10::make_intrusive<c10d::ProcessGroup>(store, 0, 1);
  cuda_only->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO,
                        gloo->getBackend(c10::DeviceType::CPU));
  cuda_only->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  auto net = gradaccum::test::mlp();
  torch::optim::SGD opt(net->parameters(), 0.1);
  CHECK_THROWS_WITH(Accumulator(net.ptr(), opt, AccumulatorOptions(2).process_group(cuda_only)),
      Catch::Contains("gradaccum: Accumulator(): the process group (backend 'gloo') has no backend for cpu "
                      "tensors, and 0.weight is on cpu"));
  // the same model under the group's own CPU backend is fine
  CHECK_NOTHROW(Accumulator(net.ptr(), opt, AccumulatorOptions(2).process_group(gloo)));
}

TEST_CASE("several agents sharing a store across restarts are refused before they meet", "[process_group][errors]") {
  // Their restart counts may differ: the ranks would wait for each other
  // under different keys. Refused before any store is dialled.
  EnvGuard env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"},
                {"MASTER_PORT", "1"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"GROUP_WORLD_SIZE", "2"},
                {"TORCHELASTIC_MAX_RESTARTS", "1"}, {"TORCHELASTIC_RESTART_COUNT", "0"}});
  CHECK_THROWS_WITH(init_process_group_from_env(),
                    Catch::Contains("gradaccum: init_process_group_from_env(): 2 torchrun agents share one store "
                                    "across restarts (--max-restarts=1)") &&
                        Catch::Contains("set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every agent's environment"));
}
