#!/usr/bin/env bash
# Runs gradaccum's CUDA checks on a machine with an NVIDIA GPU (the device
# machine lent to some sessions; CI has none). Builds against the torch that
# is installed there (whatever its version), then runs the named stages:
#
#   tools/gpu_run.sh info build test bench      (default: all four)
#
# Logs go to $OUT (or ./gpu-out). Each stage has its own time limit, so one
# that hangs or fails still leaves the others' results.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
stages=${*:-info build test bench}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}

stage_info() {
  nvidia-smi || true
  $PY - <<'PY'
import sys, torch, torch.distributed as dist
print(sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("nccl available", dist.is_nccl_available(), "nccl", torch.cuda.nccl.version() if dist.is_nccl_available() else "-")
PY
  $PY -m pip list 2>/dev/null | grep -i -E '^(torch|pytest|numpy|lightning|nvidia-nccl)' || true
  find / -name nccl.h -not -path '*/proc/*' 2>/dev/null | head -5
  which cmake ninja nvcc ccache || true
}

stage_build() {
  local t0=$SECONDS
  if ! $PY -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1; then
    echo "BUILD FAILED"; grep -n -E 'error|Error' "$OUT/build.log" | head -60; tail -40 "$OUT/build.log"; return 1
  fi
  grep -E 'NCCL groups enabled|CUDA' "$OUT/build.log" | head -5
  echo "built in $((SECONDS - t0)) s"
  (cd /tmp && $PY -c 'import gradaccum, gradaccum._C as C; print("gradaccum", gradaccum.__version__, "nccl in C++:", C.nccl_available() if hasattr(C, "nccl_available") else "?")')
}

stage_test() {
  timeout ${TEST_TIMEOUT:-420} $PY -m pytest tests/python/test_gpu.py -q -rs \
    -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test_gpu.log" | tail -60
}

stage_bench() {
  timeout ${BENCH_TIMEOUT:-300} $PY benchmarks/bench_gpu.py ${BENCH_ARGS:---quick} \
    --out "$OUT/gpu-latest.json" 2>&1 | tee "$OUT/bench_gpu.log" | tail -40
}

for s in $stages; do
  echo "=== $s ($(date +%T))"
  "stage_$s" || echo "=== stage $s failed"
done
