# gradaccum: `make demo` and `make test` each do every set-up step on a fresh machine.
PYTHON  ?= python3
PIP     := $(PYTHON) -m pip
BUILD   := build
PREFIX  := $(CURDIR)/$(BUILD)/install
# Evaluated when used (after deps): where the installed torch keeps TorchConfig.cmake.
TORCH_PREFIX = $(shell $(PYTHON) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
CONSTRAINTS := requirements/constraints.txt
JOBS    ?= 2
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
GEN     := $(if $(shell command -v ninja),-G Ninja,)
CMAKE_FLAGS := $(GEN) -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache

# ccache's compiler links first: the extension and the CMake builds both hit the cache.
# Note [One compiler cache for every checkout]: paths under the checkout are
# hashed relative to the build folder (CCACHE_BASEDIR), and the sanitizer
# tree's -g objects leave the build folder out (CCACHE_NOHASHDIR), so a clone
# in another folder (CI's fresh clone, a second worktree) hits what this one
# compiled. Trees that share objects with each other therefore sit two
# levels below the checkout (build/cmake, setup.py's build/cmake-temp.*, the
# packaging test's build/static-runtime), and every tree at a fixed place in
# build/ (build/sanitize, the packaging test's build/wheel-sdk), never in a
# temporary folder. Measured on 2 cores: `make build` in a second clone took
# 40 s, against 12.5 min with an empty cache.
export PATH     := /usr/lib/ccache:$(PATH)
export CCACHE_BASEDIR   := $(CURDIR)
export CCACHE_NOHASHDIR := 1
export MAX_JOBS := $(JOBS)

.PHONY: all deps build install-python build-cpp test test-cpp test-python test-gpu check-cuda sanitize demo bench bench-gpu clean fuzz

all: build

# torch is pinned to the CPU 2.13.0 build on disk; nothing may pull another:
# the constraints file holds it while pip installs Lightning, Accelerate and
# transformers (which need torch); the adapters are tested against these versions.
deps: $(BUILD)/.deps
$(BUILD)/.deps: Makefile $(CONSTRAINTS)
	$(PIP) install -q -c $(CONSTRAINTS) torch==2.13.0 pytest numpy scikit-learn tqdm matplotlib mypy \
	  "setuptools>=70.1" "lightning>=2.6" "accelerate==1.15.*" "transformers==5.23.*"
	@if ! dpkg -s catch2 ccache valgrind iproute2 >/dev/null 2>&1; then \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q catch2 ccache valgrind iproute2; fi
	@mkdir -p $(BUILD) && touch $@

build: install-python build-cpp

install-python: deps
	$(PIP) install -q --no-build-isolation --no-deps .

# The library, the Catch2 tests, the installed package, and the projects that
# use it as a user would: the consumer test, the C++ example and benchmark.
build-cpp: deps
	cmake -S . -B $(BUILD)/cmake $(CMAKE_FLAGS) -DCMAKE_INSTALL_PREFIX=$(PREFIX)
	cmake --build $(BUILD)/cmake -j $(JOBS)
	cmake --install $(BUILD)/cmake > /dev/null
	cmake -S tests/consumer -B $(BUILD)/consumer $(CMAKE_FLAGS) -DCMAKE_PREFIX_PATH="$(PREFIX);$(TORCH_PREFIX)"
	cmake --build $(BUILD)/consumer -j $(JOBS)
	cmake -S examples/cpp -B $(BUILD)/examples $(CMAKE_FLAGS) -DCMAKE_PREFIX_PATH="$(PREFIX);$(TORCH_PREFIX)"
	cmake --build $(BUILD)/examples -j $(JOBS)
	cmake -S benchmarks/cpp -B $(BUILD)/bench $(CMAKE_FLAGS) -DCMAKE_PREFIX_PATH="$(PREFIX);$(TORCH_PREFIX)"
	cmake --build $(BUILD)/bench -j $(JOBS)

test: build test-cpp test-python

test-cpp:
	OMP_NUM_THREADS=1 $(BUILD)/cmake/tests/cpp/gradaccum_tests
	cd $(BUILD)/consumer && ctest --output-on-failure

test-python:
	OMP_NUM_THREADS=1 GRADACCUM_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest tests/python -q -rs

# The model-based protocol fuzzer's long run: random schedules on real Gloo
# ranks against tests/python/_fuzz_model.py, FUZZ_SECONDS long (default 1800);
# each failure is shrunk and printed as a regression test. `make test` runs a
# fixed-seed budget of it (tests/python/test_fuzz.py).
fuzz:
	OMP_NUM_THREADS=1 $(PYTHON) tools/fuzz.py

# The library and the Catch2 tests (the multi-rank ones included: real Gloo
# groups, one thread per rank) under AddressSanitizer + UBSan; then the
# fuzzer's corpus (tests/python/test_fuzz.py: its fixed seeds and regression
# schedules, on real Gloo ranks) through the Python binding built over that
# library, with the sanitizer runtimes preloaded into python. libtorch and
# python are not instrumented; leak checking is off (torch keeps globals
# alive at exit).
SANITIZER_ENV = ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1 OMP_NUM_THREADS=1
SANITIZED_PYTHON = PYTHONPATH=$(CURDIR)/$(BUILD)/sanitize/python \
  LD_PRELOAD="$$(c++ -print-file-name=libasan.so) $$(c++ -print-file-name=libubsan.so)" $(PYTHON)
sanitize: deps
	cmake -S . -B $(BUILD)/sanitize $(GEN) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DGRADACCUM_SANITIZE=ON -DGRADACCUM_INSTALL=OFF
	cmake --build $(BUILD)/sanitize -j $(JOBS)
	$(SANITIZER_ENV) $(BUILD)/sanitize/tests/cpp/gradaccum_tests
	$(PYTHON) tools/sanitize_python.py --lib-dir $(BUILD)/sanitize --out $(BUILD)/sanitize/python
	$(SANITIZER_ENV) $(SANITIZED_PYTHON) -c \
	  'import gradaccum; f = gradaccum._C.__file__; assert "/sanitize/" in f, f; print("gradaccum:", f)'
	$(SANITIZER_ENV) $(SANITIZED_PYTHON) -m pytest tests/python/test_fuzz.py -q -p no:cacheprovider

# The set-up and the build print their steps, not their output: that goes to
# $(DEMO_LOG), whose last lines are shown if a step fails. The demo needs the
# Python package only; `make build` also builds the C++ tests and examples.
DEMO_LOG := $(BUILD)/demo-build.log
define quietly
	@echo "==> $(1)"
	@$(MAKE) --no-print-directory $(2) >> $(DEMO_LOG) 2>&1 || \
	  { echo "make $(2) failed; the last lines of $(DEMO_LOG):"; tail -n 40 $(DEMO_LOG); exit 1; }
endef

demo:
	@mkdir -p $(BUILD) && : > $(DEMO_LOG)
	$(call quietly,dependencies (pip and apt; log: $(DEMO_LOG)),deps)
	$(call quietly,gradaccum: libgradaccum (CMake) and the Python package (pip),install-python)
	@echo "==> the digits demo"
	OMP_NUM_THREADS=1 $(PYTHON) examples/python/digits_demo.py --out $(BUILD)/demo

# 40-55 minutes, not part of CI: throttled multi-node links (network namespaces,
# root): the schedule bound (transformer and MLP), overlap and growth; callgrind
# instruction counts; then the loopback wall clock.
bench: build
	$(PYTHON) benchmarks/bench.py --cpp-bench $(BUILD)/bench/bench_window --readme benchmarks/RESULTS.md

bench-gpu:
	$(PYTHON) benchmarks/bench_gpu.py

# On a machine with an NVIDIA GPU (never CI): builds against the torch found
# there, whatever its version (no registry needed), runs tests/python/test_gpu.py
# and bench_gpu.py; logs under $$OUT (default gpu-out/).
test-gpu:
	PYTHON=$(PYTHON) bash tools/gpu_run.sh

# The CUDA build without a GPU (not part of CI: about 5 GB of wheels the first
# time): torch's CUDA 13 wheel and the CUDA toolkit wheels in build/cuda-venv,
# gradaccum built against them with NCCL groups enabled, then the Catch2 suite
# and tests/python with that torch (the GPU tests skip).
check-cuda:
	JOBS=$(JOBS) bash tools/check_cuda.sh

clean:
	rm -rf $(BUILD) python/gradaccum/*.so python/gradaccum/lib python/gradaccum/include \
	  python/gradaccum/_build_info.py *.egg-info python/*.egg-info
