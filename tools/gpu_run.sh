#!/usr/bin/env bash
# Runs gradaccum's CUDA checks on a machine with an NVIDIA GPU (the device
# machine lent to some sessions; CI has none). Builds against the torch that
# is installed there (whatever its version), then runs the named stages:
#
#   tools/gpu_run.sh info build cpp example test bench      (default: all)
#
#   info     nvidia-smi, torch/CUDA/NCCL versions, tools found
#   build    the Python package (pip, no build isolation) and, beside it, the
#            CMake tree: libgradaccum, the Catch2 tests, the consumer and the
#            C++ example, installed under build/gpu/install
#   cpp      the Catch2 [cuda] cases (NCCL, Gloo over CUDA tensors), then the
#            whole CPU Catch2 suite against this CUDA build (CPP_CPU=0: the
#            [cuda] cases only)
#   example  the C++ example under torchrun with the default backend (NCCL
#            for CUDA tensors), one rank per GPU
#   test     tests/python/test_gpu.py
#   bench    benchmarks/bench_gpu.py (BENCH_ARGS, default --quick)
#   net      benchmarks/bench_net.py's schedule bound (2 nodes in network
#            namespaces, throttled by tc) on this machine's many cores: the
#            wall-clock hidden fraction with cores to spare (NET_ARGS; skips
#            when namespaces are not allowed). Not in the default stages.
#
# A machine without a registry has no Catch2 and no iproute2:
# `tools/gpu_run.sh carry` (run where Debian's catch2 and iproute2 are
# installed) copies Catch2, and `ip` and `tc` with their libraries, into .gpu/
# (ignored by git; 4.5 MB), which the device tool can carry along; the stages
# put .gpu/iproute2/bin on PATH. Logs go to $OUT (or ./gpu-out). Each
# stage has its own time limit, so one that hangs or fails still leaves the
# others' results.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
stages=${*:-info build cpp example test bench}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
[ -d "$ROOT/.gpu/iproute2/bin" ] && export PATH=$ROOT/.gpu/iproute2/bin:$PATH
B=$ROOT/build/gpu
GEN=$(command -v ninja >/dev/null && echo "-G Ninja")

stage_carry() {
  rm -rf .gpu/catch2 && mkdir -p .gpu/catch2/include .gpu/catch2/lib/cmake
  cp -r /usr/include/catch2 .gpu/catch2/include/ &&
    cp -r /usr/lib/cmake/Catch2 .gpu/catch2/lib/cmake/ &&
    cp /usr/lib/libCatch2WithMain.a .gpu/catch2/lib/ || return 1
  # ip and tc for the net stage's namespaces, with the libraries they link
  # (not libc), each run through the machine's own loader with these
  # libraries: the commands they start (tc, the ranks) see no library path.
  local d=.gpu/iproute2 b l
  rm -rf $d && mkdir -p $d/bin $d/libexec $d/lib || return 1
  for b in ip tc; do
    cp "$(command -v $b)" $d/libexec/ || return 1
    ldd $d/libexec/$b | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|libdl|libpthread)\.so' |
      while read -r l; do cp -L "$l" $d/lib/; done
    printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/..\nexec /lib64/ld-linux-x86-64.so.2 --library-path "$d/lib" "$d/libexec/%s" "$@"\n' \
      $b >$d/bin/$b && chmod +x $d/bin/$b || return 1
  done
  $d/bin/ip -V && $d/bin/tc -V && du -sh .gpu
}

stage_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  $PY - <<'PY'
import sys, torch, torch.distributed as dist
print(sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("nccl available", dist.is_nccl_available(), "nccl", torch.cuda.nccl.version() if dist.is_nccl_available() else "-")
PY
  which cmake ninja nvcc ccache || true
}

build_python() {
  $PY -m pip install -v --no-build-isolation --no-deps . >"$OUT/build_python.log" 2>&1
}

build_cmake() {
  local torch_prefix catch2=()
  torch_prefix=$($PY -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  # Catch2 carried in .gpu/ (else a system one, else no tests)
  if [ -d "$ROOT/.gpu/catch2" ]; then catch2=(-DCatch2_DIR="$ROOT/.gpu/catch2/lib/cmake/Catch2")
  elif [ ! -f /usr/include/catch2/catch.hpp ]; then catch2=(-DGRADACCUM_TEST=OFF); fi
  {
    cmake -S . -B "$B/cmake" $GEN -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$B/install" \
      -DPython3_EXECUTABLE="$(command -v $PY)" ${catch2[@]+"${catch2[@]}"} &&
      cmake --build "$B/cmake" -j "$MAX_JOBS" && cmake --install "$B/cmake" >/dev/null &&
      for p in tests/consumer:consumer examples/cpp:examples benchmarks/cpp:bench; do
        cmake -S "${p%%:*}" -B "$B/${p##*:}" $GEN -DCMAKE_BUILD_TYPE=Release \
          -DCMAKE_PREFIX_PATH="$B/install;$torch_prefix" && cmake --build "$B/${p##*:}" -j "$MAX_JOBS" || return 1
      done
  } >"$OUT/build_cmake.log" 2>&1
}

stage_build() {
  local t0=$SECONDS rc=0
  build_python & local py=$!
  build_cmake || { rc=1; echo "CMAKE BUILD FAILED"; grep -n -E 'error|Error' "$OUT/build_cmake.log" | head -40; tail -30 "$OUT/build_cmake.log"; }
  wait $py || { rc=1; echo "PYTHON BUILD FAILED"; grep -n -E 'error|Error' "$OUT/build_python.log" | head -40; tail -30 "$OUT/build_python.log"; }
  grep -h -E 'NCCL groups enabled|without NCCL' "$OUT/build_cmake.log" "$OUT/build_python.log" | sort -u
  echo "built in $((SECONDS - t0)) s"
  (cd /tmp && $PY -c 'import gradaccum, gradaccum._C as C; print("gradaccum", gradaccum.__version__, "nccl in C++:", C.nccl_available())')
  return $rc
}

stage_cpp() {
  [ -x "$B/cmake/tests/cpp/gradaccum_tests" ] || { echo "no Catch2 build (run 'carry' where catch2 is installed)"; return 1; }
  local rc=0
  timeout ${CPP_TIMEOUT:-240} "$B/cmake/tests/cpp/gradaccum_tests" "[cuda]" 2>&1 | tee "$OUT/catch2_cuda.log" | tail -40 || rc=1
  [ "${CPP_CPU:-1}" = 0 ] ||
    OMP_NUM_THREADS=1 timeout ${CPP_TIMEOUT:-240} "$B/cmake/tests/cpp/gradaccum_tests" 2>&1 | tee "$OUT/catch2_cpu.log" | tail -8 || rc=1
  (cd "$B/consumer" && timeout 60 ctest --output-on-failure 2>&1 | tail -20) || rc=1
  return $rc
}

stage_example() {
  local gpus
  gpus=$($PY -c 'import torch; print(max(1, torch.cuda.device_count()))')
  timeout ${EXAMPLE_TIMEOUT:-120} $PY -m torch.distributed.run --standalone --nproc_per_node="$gpus" \
    --no-python "$B/examples/train_mlp" --steps 4 2>&1 | tee "$OUT/example.log" | tail -12
}

stage_test() {
  timeout ${TEST_TIMEOUT:-300} $PY -m pytest tests/python/test_gpu.py -q -rs \
    -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test_gpu.log" | tail -60
}

stage_bench() {
  timeout ${BENCH_TIMEOUT:-300} $PY benchmarks/bench_gpu.py ${BENCH_ARGS:---quick} \
    --out "$OUT/gpu-latest.json" 2>&1 | tee "$OUT/bench_gpu.log" | tail -40
}

stage_net() {
  # The worker runs from the source tree (benchmarks/) against the installed
  # package; bench_window from the CMake build above, when it built.
  timeout ${NET_TIMEOUT:-300} $PY benchmarks/bench_net.py --cpp-bench "$B/bench/bench_window" \
    --log-dir "$OUT/net-logs" --out "$OUT/net-bound.json" --links none --no-growth \
    ${NET_ARGS:---bound-blocks 3 --bound-budget-s 60} 2>&1 | tee "$OUT/bench_net.log" | tail -60
}

for s in $stages; do
  echo "=== $s ($(date +%T))"
  "stage_$s" || echo "=== stage $s failed"
done
