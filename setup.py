"""Builds gradaccum: libgradaccum with CMake, then gradaccum._C over it with
torch.utils.cpp_extension, both against the torch that is already installed.

    pip install --no-build-isolation .

The wheel is also the C++ SDK. Inside the package:

    gradaccum/_C.*.so                  the binding alone; links lib/libgradaccum.so ($ORIGIN/lib)
    gradaccum/lib/libgradaccum.so      the library (finds torch's libraries at $ORIGIN/../../torch/lib)
    gradaccum/lib/cmake/gradaccum/     find_package(gradaccum) via gradaccum.cmake_prefix_path
    gradaccum/include/gradaccum/       the public headers
    gradaccum/_build_info.py           the torch it was built against (checked at import)

The library is compiled once, by the project's own CMakeLists.txt (in
build/cmake-temp.*); with ccache on PATH, as under `make`, the sources that the
`make build` CMake tree already compiled are cache hits.
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    import torch.utils
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as error:
    sys.exit(
        f"gradaccum: cannot import torch ({error}).\n"
        "gradaccum is compiled against the torch already installed in this environment.\n"
        "Install torch first, then build without pip's build isolation, which hides it:\n\n"
        "    pip install --no-build-isolation .\n\n"
        "(a plain `pip install .` builds in a fresh environment without your torch, and "
        "gradaccum never downloads another one)"
    )


def read_version():
    """MAJOR.MINOR.PATCH from include/gradaccum/version.h, the one place it is written."""
    with open(os.path.join(ROOT, "include", "gradaccum", "version.h")) as f:
        text = f.read()
    parts = []
    for part in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"^#define GRADACCUM_VERSION_{part} (\d+)$", text, re.MULTILINE)
        if not match:
            raise RuntimeError(f"no GRADACCUM_VERSION_{part} in include/gradaccum/version.h")
        parts.append(match.group(1))
    return ".".join(parts)


def torch_release_line():
    """'2.13' for torch 2.13.0+cpu: the line whose C++ ABI the build is bound to."""
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if not match:
        raise RuntimeError(f"cannot read torch's version {torch.__version__!r}")
    return f"{match.group(1)}.{match.group(2)}"


class BuildGradaccum(BuildExtension):
    """build_ext that first builds and stages libgradaccum (headers, library,
    CMake package) into the package, then links _C against it."""

    def run(self):
        package_dir = os.path.dirname(self.get_ext_fullpath("gradaccum._C"))
        prefix = self.build_library()
        os.makedirs(package_dir, exist_ok=True)
        for sub in ("include", "lib"):
            target = os.path.join(package_dir, sub)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(os.path.join(prefix, sub), target)
        with open(os.path.join(package_dir, "_build_info.py"), "w") as f:
            f.write("# Written by setup.py when this copy of gradaccum was built.\n"
                    f"TORCH_VERSION = {str(torch.__version__)!r}\n")
        for ext in self.extensions:
            ext.library_dirs.append(os.path.join(package_dir, "lib"))
        super().run()

    def build_library(self):
        """Configures, builds and installs libgradaccum with CMake into a staging prefix."""
        cmake = shutil.which("cmake")
        if cmake is None:
            sys.exit("gradaccum: building libgradaccum needs CMake >= 3.18 on PATH "
                     "(apt-get install cmake, or pip install cmake)")
        # build/cmake-temp.*: two levels below the checkout, as the Makefile's
        # build/cmake, so the two share ccache's objects (Note [One compiler
        # cache for every checkout] in the Makefile).
        temp = os.path.abspath(self.build_temp)
        build_dir = os.path.join(os.path.dirname(temp), "cmake-" + os.path.basename(temp))
        prefix = os.path.join(temp, "cmake-install")
        configure = [
            cmake, "-S", ROOT, "-B", build_dir,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGRADACCUM_TEST=OFF",
            "-DGRADACCUM_INSTALL=ON",
            "-DGRADACCUM_PYTHON_PACKAGE=ON",
            f"-DCMAKE_INSTALL_PREFIX={prefix}",
            "-DCMAKE_INSTALL_LIBDIR=lib",
            "-DCMAKE_INSTALL_INCLUDEDIR=include",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            # Named, not found: a cache left by a build against another torch
            # (the CPU and CUDA builds share build/temp.*) must not win.
            f"-DTorch_DIR={os.path.join(torch.utils.cmake_prefix_path, 'Torch')}",
        ]
        if shutil.which("ninja") and not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            configure += ["-G", "Ninja"]
        if shutil.which("ccache"):
            configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        shutil.rmtree(prefix, ignore_errors=True)  # nothing stale goes into the wheel
        for command in (configure,
                        [cmake, "--build", build_dir, "-j", jobs],
                        [cmake, "--install", build_dir]):
            print(" ".join(shlex.quote(c) for c in command), flush=True)
            subprocess.run(command, check=True)
        return prefix


def get_extensions():
    return [
        CppExtension(
            "gradaccum._C",
            # every source of the binding (tools/sanitize_python.py builds the same)
            sorted(glob.glob(os.path.join("python", "gradaccum", "csrc", "*.cpp"))),
            include_dirs=[os.path.join(ROOT, "include")],
            define_macros=[("USE_C10D_GLOO", None)],
            libraries=["gradaccum"],  # library_dirs: added by BuildGradaccum
            # The standard libgradaccum is compiled with (CMake: cxx_std_20):
            # options and tensors cross between the two, and torch's headers
            # differ by standard (cpp_extension would add -std=c++17).
            extra_compile_args={"cxx": ["-O2", "-std=c++20"]},
            # Note [Static runtime pieces stay private] in CMakeLists.txt
            extra_link_args=["-Wl,-rpath,$ORIGIN/lib"]
            + (["-Wl,--exclude-libs,ALL"] if sys.platform.startswith("linux") else []),
        )
    ]


setup(
    version=read_version(),
    install_requires=[f"torch=={torch_release_line()}.*"],
    ext_modules=get_extensions(),
    cmdclass={"build_ext": BuildGradaccum.with_options(use_ninja=True)},
)
