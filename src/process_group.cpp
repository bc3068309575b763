#include <gradaccum/process_group.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp> // with src/shim
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/cuda.h>

#ifdef GRADACCUM_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>

namespace gradaccum {
namespace {

std::string require_env(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK_VALUE(value && *value,
      "gradaccum: init_process_group_from_env(): ", name, " is not set (launch with torchrun, "
      "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)");
  return value;
}

int env_int(const char* name, int minimum, const char* fallback = nullptr) {
  const char* raw = std::getenv(name);
  const std::string text = raw && *raw ? std::string(raw) : (fallback ? fallback : require_env(name));
  size_t used = 0;
  int value = 0;
  try {
    value = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK_VALUE(used == text.size() && used > 0 && value >= minimum,
      "gradaccum: init_process_group_from_env(): ", name, "='", text, "' is not an integer >= ", minimum);
  return value;
}

std::string resolve_backend(const ProcessGroupOptions& options) {
  if (!options.backend().empty()) {
    TORCH_CHECK_VALUE(options.backend() == "gloo" || options.backend() == "nccl",
        "gradaccum: init_process_group_from_env(): invalid backend: '", options.backend(), "' (expected 'gloo', 'nccl' or '')");
    TORCH_CHECK_VALUE(options.backend() != "nccl" || nccl_available(),
        "gradaccum: init_process_group_from_env(): backend 'nccl' requested but gradaccum was built without NCCL "
        "(build against a CUDA torch with NCCL headers)");
    return options.backend();
  }
  return nccl_available() && torch::cuda::is_available() ? "nccl" : "gloo";
}

} // namespace

bool nccl_available() {
#ifdef GRADACCUM_WITH_NCCL
  return true;
#else
  return false;
#endif
}

bool LaunchEnvironment::launched() {
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
    const char* value = std::getenv(name);
    if (value && *value) {
      return true;
    }
  }
  return false;
}

LaunchEnvironment LaunchEnvironment::from_env() {
  LaunchEnvironment env;
  env.world_size = env_int("WORLD_SIZE", 1);
  env.rank = env_int("RANK", 0);
  TORCH_CHECK_VALUE(env.rank < env.world_size,
      "gradaccum: init_process_group_from_env(): RANK=", env.rank, " is not below WORLD_SIZE=", env.world_size);
  env.local_rank = env_int("LOCAL_RANK", 0, "0");
  env.master_addr = require_env("MASTER_ADDR");
  env.master_port = env_int("MASTER_PORT", 1);
  TORCH_CHECK_VALUE(env.master_port <= 65535,
      "gradaccum: init_process_group_from_env(): MASTER_PORT=", env.master_port, " is not a port");
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent && std::string(agent) == "True";
  env.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0, "0");
  env.max_restarts = env_int("TORCHELASTIC_MAX_RESTARTS", 0, "0");
  env.agents = env_int("GROUP_WORLD_SIZE", 1, "1");
  return env;
}

c10::intrusive_ptr<c10d::ProcessGroup> new_process_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int world_size,
    ProcessGroupOptions options) {
  TORCH_CHECK_VALUE(store, "gradaccum: new_process_group(): store is null");
  TORCH_CHECK_VALUE(world_size > 0 && rank >= 0 && rank < world_size,
      "gradaccum: new_process_group(): rank ", rank, " of world size ", world_size, " is out of range");
  TORCH_CHECK_VALUE(options.timeout().count() > 0,
      "gradaccum: new_process_group(): timeout must be positive, got ", options.timeout().count(), " ms");
  const auto backend = resolve_backend(options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world_size);
  // The default ("") under NCCL is torch's "cpu:gloo,cuda:nccl": CPU tensors
  // (a model or metadata left on the host) still have a backend.
  if (backend == "gloo" || options.backend().empty()) {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create_default(options.timeout());
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, world_size, gloo_options);
    // Gloo reduces CPU tensors and, on CUDA builds, CUDA tensors.
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  }
  if (backend == "nccl") {
#ifdef GRADACCUM_WITH_NCCL
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = options.timeout();
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, world_size, nccl_options);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#endif
  }
  return group;
}

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group_from_env(
    ProcessGroupOptions options) {
  if (!LaunchEnvironment::launched()) {
    static std::once_flag said;
    std::call_once(said, [] {
      std::cerr << "gradaccum: no torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) "
                   "are set: running as one process, without a process group" << std::endl;
    });
    return {};
  }
  const auto env = LaunchEnvironment::from_env();
#ifdef GRADACCUM_WITH_NCCL
  if (resolve_backend(options) == "nccl") {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(env.local_rank));
  }
#endif
  // A store shared across attempts (see the header): one agent's count is
  // every rank's; several agents' counts may differ, and their ranks would
  // wait for each other under different keys until the timeout.
  TORCH_CHECK_VALUE(!env.agent_store || env.agents == 1 || env.max_restarts == 0,
      "gradaccum: init_process_group_from_env(): ", env.agents, " torchrun agents share one store across restarts "
      "(--max-restarts=", env.max_restarts, ") and count their restarts each on its own, so a restarted job could "
      "wait for ranks under another attempt's keys: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every agent's "
      "environment (each attempt then gets a store of its own)");
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(env.master_port);
  // Under torchrun the agent already serves MASTER_PORT; everyone is a client.
  store_options.isServer = env.rank == 0 && !env.agent_store;
  store_options.numWorkers = env.world_size;
  store_options.timeout = options.timeout();
  auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  const std::string prefix = env.agent_store ? "gradaccum/attempt_" + std::to_string(env.restart_count) : "gradaccum";
  return new_process_group(
      c10::make_intrusive<c10d::PrefixStore>(prefix, store),
      env.rank, env.world_size, std::move(options));
}

} // namespace gradaccum
