"""Stages the Python package over the sanitizer build of libgradaccum, so that
the fuzzer's corpus replays through the Python API under ASan + UBSan.

    python tools/sanitize_python.py --lib-dir build/sanitize --out build/sanitize/python

`make sanitize` runs it after the CMake build (-DGRADACCUM_SANITIZE=ON): it
compiles the binding (python/gradaccum/csrc/*.cpp) with the same
sanitizer flags, links it to that build's libgradaccum, and puts it beside
the package's Python files (symlinks, so the sources are what runs) under
OUT/gradaccum. The Makefile then runs tests/python/test_fuzz.py with
PYTHONPATH=OUT and the sanitizer runtimes preloaded (python itself and torch
are not instrumented; the runtimes must be loaded first).

The binding is built without being imported here: an instrumented library
cannot be loaded into a process that did not preload the runtimes.
"""
import argparse
import glob
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "python", "gradaccum")
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]


def stage(out):
    """OUT/gradaccum: symlinks to the package's Python files and a _build_info.py."""
    import torch

    pkg = os.path.join(out, "gradaccum")
    shutil.rmtree(pkg, ignore_errors=True)
    os.makedirs(pkg)
    for path in glob.glob(os.path.join(PACKAGE, "*.py")) + glob.glob(os.path.join(PACKAGE, "*.pyi")):
        name = os.path.basename(path)
        if name != "_build_info.py":
            os.symlink(path, os.path.join(pkg, name))
    with open(os.path.join(pkg, "_build_info.py"), "w") as f:
        f.write("# Written by tools/sanitize_python.py (the sanitizer build).\n"
                f"TORCH_VERSION = {str(torch.__version__)!r}\n")
    return pkg


def build_binding(lib_dir, pkg, temp):
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    if not glob.glob(os.path.join(lib_dir, "libgradaccum.so*")):
        sys.exit(f"gradaccum: no libgradaccum.so in {lib_dir}: build the sanitizer tree first "
                 "(cmake -DGRADACCUM_SANITIZE=ON, as `make sanitize` does)")
    ext = CppExtension(
        "gradaccum._C",
        sorted(glob.glob(os.path.join(PACKAGE, "csrc", "*.cpp"))),  # (as setup.py)
        include_dirs=[os.path.join(ROOT, "include")],
        define_macros=[("USE_C10D_GLOO", None)],
        libraries=["gradaccum"],
        library_dirs=[lib_dir],
        extra_compile_args={"cxx": ["-O1", "-g", "-std=c++20"] + SANITIZE},
        extra_link_args=SANITIZE + [f"-Wl,-rpath,{lib_dir}"],
    )
    build_lib = os.path.dirname(pkg)
    setup(name="gradaccum-sanitize", ext_modules=[ext],
          cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
          script_args=["-q", "build_ext", "--build-lib", build_lib, "--build-temp", temp])
    built = glob.glob(os.path.join(pkg, "_C*.so"))
    if not built:
        sys.exit(f"gradaccum: the sanitizer binding was not built under {pkg}")
    return built[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib-dir", required=True, help="the CMake tree holding the sanitizer libgradaccum.so")
    p.add_argument("--out", required=True, help="where OUT/gradaccum is staged")
    a = p.parse_args()
    lib_dir, out = os.path.abspath(a.lib_dir), os.path.abspath(a.out)
    pkg = stage(out)
    so = build_binding(lib_dir, pkg, os.path.join(out, "temp"))
    print(f"gradaccum: sanitizer package staged at {pkg} ({os.path.basename(so)})")


if __name__ == "__main__":
    main()
