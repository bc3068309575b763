#!/usr/bin/env bash
# make check-cuda: builds gradaccum against the CUDA 13 torch wheel on a machine
# without a GPU (NCCL groups enabled), then runs the CPU test suite with it.
#
#   build/cuda-venv      torch 2.13.0 (CUDA 13 wheel, with its NVIDIA runtime
#                        wheels), cuda-toolkit[nvcc,cccl] 13.0.3, the test deps
#                        (about 5 GB the first time; reused after)
#   build/cuda/          the CMake tree (library, Catch2 tests), its install,
#                        the consumer and the C++ example against it
#   build/cuda-src/      a copy of the sources for the wheel's build (its own
#                        setuptools and CMake caches, never the CPU build's)
#
# Then: the Catch2 suite, the consumer's ctest and tests/python (Gloo; the GPU
# tests skip) with that torch. Not part of .ci/run (the download size).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/build/cuda-venv
PY=$VENV/bin/python
B=$ROOT/build/cuda
JOBS=${JOBS:-2}
TORCH=2.13.0
TOOLKIT=13.0.3
GEN=$(command -v ninja >/dev/null && echo "-G Ninja" || true)
export PATH=/usr/lib/ccache:$PATH MAX_JOBS=$JOBS PYTHONUNBUFFERED=1
step() { echo "== check-cuda: $*"; }

# --isolated: this machine's pip configuration pins the CPU torch on disk;
# here we want PyPI's default torch, the CUDA build.
if [ ! -f "$VENV/.ready-$TORCH-$TOOLKIT" ]; then
  step "virtual environment $VENV (torch $TORCH CUDA wheel, cuda-toolkit $TOOLKIT)"
  python3 -m venv "$VENV"
  echo "torch==$TORCH" >"$VENV/constraints.txt"
  "$PY" -m pip install --isolated -q -c "$VENV/constraints.txt" "torch==$TORCH" \
    "cuda-toolkit[nvcc,cccl]==$TOOLKIT" pytest numpy scikit-learn tqdm matplotlib \
    "setuptools>=70.1" "lightning>=2.6"
  touch "$VENV/.ready-$TORCH-$TOOLKIT"
fi

SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CU=$SITE/nvidia/cu13
# The toolkit wheels lack the unversioned links and the lib64 folder that
# CMake's FindCUDAToolkit looks for.
[ -e "$CU/lib64" ] || ln -s lib "$CU/lib64"
for lib in nvrtc cudart; do
  [ -e "$CU/lib/lib$lib.so" ] || ln -s "lib$lib.so.13" "$CU/lib/lib$lib.so"
done
export CUDAToolkit_ROOT=$CU CUDA_TOOLKIT_ROOT_DIR=$CU CUDACXX=$CU/bin/nvcc PATH=$CU/bin:$PATH

"$PY" - <<'PY'
import torch, torch.distributed as dist
v = torch.cuda.nccl.version()
print("== check-cuda: torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| NCCL", ".".join(map(str, v)) if isinstance(v, tuple) else v,
      "| nccl available", dist.is_nccl_available(), "| GPU visible", torch.cuda.is_available())
PY

TORCH_PREFIX=$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
step "CMake tree $B/cmake (library, Catch2 tests)"
cmake -S . -B "$B/cmake" $GEN -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DPython3_EXECUTABLE="$PY" -DCMAKE_INSTALL_PREFIX="$B/install" >"$B.configure.log" 2>&1 ||
  { tail -40 "$B.configure.log"; exit 1; }
grep -E "NCCL groups enabled" "$B.configure.log" || { echo "check-cuda: NCCL was not enabled"; tail -20 "$B.configure.log"; exit 1; }
cmake --build "$B/cmake" -j "$JOBS" | grep -E "error|warning: |FAILED" || true
cmake --build "$B/cmake" -j "$JOBS" >/dev/null # fails here, loudly, if the above did
cmake --install "$B/cmake" >/dev/null
for p in tests/consumer:consumer examples/cpp:examples; do
  step "${p%%:*} against the install"
  cmake -S "${p%%:*}" -B "$B/${p##*:}" $GEN -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
    -DCMAKE_PREFIX_PATH="$B/install;$TORCH_PREFIX" >/dev/null
  cmake --build "$B/${p##*:}" -j "$JOBS" >/dev/null
done

step "Python package (wheel build of a source copy, installed into $VENV)"
rm -rf "$ROOT/build/cuda-src" && mkdir -p "$ROOT/build/cuda-src"
tar --exclude=./build --exclude=./.git --exclude=./.gpu --exclude='*.so' -cf - . | tar -xf - -C "$ROOT/build/cuda-src"
(cd "$ROOT/build/cuda-src" && "$PY" -m pip install -q --no-build-isolation --no-deps . >"$B.pip.log" 2>&1) ||
  { grep -n -E "error" "$B.pip.log" | head -30; tail -30 "$B.pip.log"; exit 1; }
grep -h "NCCL groups enabled" "$B.pip.log" | sort -u || true
(cd /tmp && "$PY" -c 'import gradaccum, gradaccum._C as C, torch; assert C.nccl_available(), "no NCCL in _C"; print("== check-cuda: gradaccum", gradaccum.__version__, "against torch", torch.__version__, "nccl in C++:", C.nccl_available())')

step "Catch2 suite"
OMP_NUM_THREADS=1 "$B/cmake/tests/cpp/gradaccum_tests"
(cd "$B/consumer" && ctest --output-on-failure >"$B.ctest.log" 2>&1) || { cat "$B.ctest.log"; exit 1; }
tail -1 "$B.ctest.log"
step "pytest tests/python with torch $("$PY" -c 'import torch; print(torch.__version__)')"
# from the copy: the tests that build a wheel build it there, never in the
# checkout, whose build/temp.* belongs to the CPU build
cd "$ROOT/build/cuda-src"
OMP_NUM_THREADS=1 GRADACCUM_BUILD=$B "$PY" -m pytest tests/python -q -rs -p no:cacheprovider
