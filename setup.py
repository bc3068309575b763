"""Builds gradaccum._C from the C++ sources with torch.utils.cpp_extension.

Install with `pip install --no-build-isolation .`: the extension must be built
against the torch that is already installed, and nothing here may pull another.
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def get_extensions():
    sources = sorted(glob.glob(os.path.join("src", "*.cpp")))
    sources.append(os.path.join("python", "gradaccum", "csrc", "bindings.cpp"))
    return [
        CppExtension(
            "gradaccum._C",
            sources,
            include_dirs=[os.path.join(ROOT, "include"), os.path.join(ROOT, "src", "shim")],
            define_macros=[("USE_C10D_GLOO", None)],
            extra_compile_args={"cxx": ["-O2"]},
        )
    ]


setup(
    name="gradaccum",
    version="0.1.0",
    description="Gradient accumulation with once-per-window, overlapped data-parallel reduction",
    packages=["gradaccum"],
    package_dir={"": "python"},
    ext_modules=get_extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
)
