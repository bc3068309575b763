"""One install for Python and C++ users: the wheel, its metadata, the C++ SDK
inside it, the typed package and the version's one source.

The slow test builds the wheel from this checkout (in-tree: after `make build`
the CMake tree and _C are up to date, so it mostly packs), installs it into a
fresh virtual environment that sees the system's torch, and builds and runs
tests/consumer against it through `gradaccum.cmake_prefix_path`, as a C++ user
who only ran `pip install` would.
"""
import ast
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import textwrap
import sys
import sysconfig
import zipfile

import pytest
import torch

import gradaccum
from gradaccum import _C

REPO = pathlib.Path(__file__).resolve().parents[2]
TORCH_LIB = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))


def run(cmd, timeout=600, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def header_version():
    text = (REPO / "include" / "gradaccum" / "version.h").read_text()
    return ".".join(re.search(rf"^#define GRADACCUM_VERSION_{p} (\d+)$", text, re.M).group(1)
                    for p in ("MAJOR", "MINOR", "PATCH"))


def torch_line():
    return ".".join(str(torch.__version__).split(".")[:2])


def test_version_has_one_source():
    version = header_version()
    assert gradaccum.__version__ == version  # the C++ macro, through _C
    assert importlib.metadata.version("gradaccum") == version  # setup.py
    config = pathlib.Path(gradaccum.cmake_prefix_path) / "gradaccum" / "gradaccum-config-version.cmake"
    assert f'set(PACKAGE_VERSION "{version}")' in config.read_text()  # CMake


def test_catch2_tests_use_catchs_check_not_c10s():
    # Note [Catch's CHECK, not c10's] (tests/cpp/catch_torch.h): a test that
    # includes Catch before a torch header gets c10's fatal CHECK.
    direct = [p.name for p in sorted((REPO / "tests" / "cpp").glob("*.cpp"))
              if "#include <catch2/catch.hpp>" in p.read_text() and p.name != "main.cpp"]
    assert direct == []
    main = (REPO / "tests" / "cpp" / "main.cpp").read_text()
    assert "CHECK(" not in main and "torch" not in main


def test_metadata_pins_the_torch_line_built_against():
    requires = importlib.metadata.requires("gradaccum")
    assert f"torch=={torch_line()}.*" in requires
    assert any(r.startswith("lightning") and "extra ==" in r for r in requires)


def test_import_on_another_torch_fails_saying_so():
    code = "import torch; torch.__version__ = '1.99.0'; import gradaccum"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"built against torch {torch.__version__} but torch 1.99.0 is installed" in proc.stderr
    assert f"torch=={torch_line()}.*" in proc.stderr


def test_cmake_package_refuses_another_torch_line(tmp_path):
    """find_package(gradaccum) with a torch of another minor version (a stand-in
    TorchConfig saying 2.12.0): an error naming both, not a link that fails
    or crashes later."""
    fake = tmp_path / "torch" / "Torch"
    fake.mkdir(parents=True)
    (fake / "TorchConfig.cmake").write_text(
        "set(Torch_FOUND TRUE)\nadd_library(torch INTERFACE IMPORTED)\n")
    (fake / "TorchConfigVersion.cmake").write_text(
        'set(PACKAGE_VERSION "2.12.0")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n')
    project = tmp_path / "consumer"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(textwrap.dedent("""\
        cmake_minimum_required(VERSION 3.18)
        project(consumer LANGUAGES CXX)
        find_package(gradaccum CONFIG REQUIRED)
        """))
    proc = subprocess.run(["cmake", "-S", str(project), "-B", str(tmp_path / "build"),
                           f"-DCMAKE_PREFIX_PATH={gradaccum.cmake_prefix_path}", f"-DTorch_DIR={fake}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout
    text = " ".join(proc.stderr.split())
    assert (f"gradaccum: find_package(gradaccum): this gradaccum was built against torch {torch_line()}.*, but "
            f"the build found torch 2.12.0") in text, proc.stderr


def stub_names(tree):
    """Top-level names of a .pyi, and each class's members."""
    names, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {n.name if not isinstance(n, ast.AnnAssign) else n.target.id
                                  for n in node.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))}
    return names, members


def test_stub_names_what_the_module_has():
    """_C.pyi against the built _C (pybind11 gives no signatures to compare, so names)."""
    names, members = stub_names(ast.parse((REPO / "python" / "gradaccum" / "_C.pyi").read_text()))
    public = {n for n in dir(_C) if not n.startswith("__")} | {"__version__"}
    assert names == public, f"stub only: {names - public}; module only: {public - names}"
    for cls, stubbed in members.items():
        runtime = {n for n in dir(getattr(_C, cls)) if not n.startswith("_")} | {"__init__"}
        assert stubbed == runtime, f"{cls}: stub only {stubbed - runtime}; module only {runtime - stubbed}"


def doc_signatures(doc, name):
    """Each signature pybind11 wrote for `name` in its __doc__ (overloads
    too), as [(parameter, has a default)], `self` included."""
    signatures = []
    for line in (doc or "").splitlines():
        match = re.match(r"^(?:\d+\. )?%s\((.*)\) ->" % re.escape(name), line.strip())
        if not match:
            continue
        params, depth, current = [], 0, ""
        for ch in match.group(1) + ",":
            depth += ch in "([{"
            depth -= ch in ")]}"
            if ch == "," and depth == 0:
                if current.strip() not in ("", "*"):
                    params.append((current.split(":")[0].strip(), "=" in current))
                current = ""
            else:
                current += ch
        signatures.append(params)
    return signatures


def stub_signature(fn):
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    return ([(a.arg, d) for a, d in zip(positional, defaults)]
            + [(a.arg, d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)])


def test_stub_signatures_match_the_module():
    """Each stubbed function's parameters (names, order, which have defaults)
    are one of the signatures pybind11 gives the built function: a binding's
    new argument the stub lacks fails here (optimizer_parameters did)."""
    tree = ast.parse((REPO / "python" / "gradaccum" / "_C.pyi").read_text())
    checked = 0
    for node in tree.body:
        owner, functions = (getattr(_C, node.name), node.body) if isinstance(node, ast.ClassDef) else (_C, [node])
        for fn in functions:
            if not isinstance(fn, ast.FunctionDef) or any(
                    isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list):
                continue
            runtime = doc_signatures(getattr(owner, fn.name).__doc__, fn.name)
            assert runtime, f"{fn.name}: no signature in its __doc__"
            assert stub_signature(fn) in runtime, f"{fn.name}: stub {stub_signature(fn)}; module {runtime}"
            checked += 1
    assert checked >= 20  # (25 when written)


@pytest.fixture(scope="module")
def mypy_cache():
    """One mypy cache for every run on this machine, as ccache is for the
    compiles: reading torch's stubs is most of a cold run's minute. mypy's
    incremental mode checks each cached module against its source, and a
    module with errors is checked again, so a warm cache reports what a
    cold one does."""
    mypy = pytest.importorskip("mypy.version", reason="make deps installs mypy")
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    cache = base / "gradaccum-tests" / f"mypy-{mypy.__version__}-py{sys.version_info[0]}.{sys.version_info[1]}"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


@pytest.mark.slow
def test_examples_pass_mypy_strict(mypy_cache):
    run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", mypy_cache, "examples/python"], cwd=REPO)


@pytest.mark.slow
def test_any_object_with_step_types_as_an_optimizer(tmp_path, mypy_cache):
    """`optimizer` is typed as a Protocol with step(): a custom optimizer
    passes `mypy --strict`, and it trains."""
    script = tmp_path / "custom_optimizer.py"
    script.write_text(textwrap.dedent("""
        import torch
        import gradaccum


        class Sign:
            def __init__(self, params: list[torch.nn.Parameter]) -> None:
                self.params = params

            def step(self) -> None:
                with torch.no_grad():
                    for p in self.params:
                        if p.grad is not None:
                            p.add_(p.grad.sign(), alpha=-0.5)


        model = torch.nn.Linear(2, 1)
        before = float(model.bias)
        acc = gradaccum.Accumulator(model, Sign(list(model.parameters())), steps=2, process_group=False)
        for _ in range(2):
            acc.backward(model(torch.ones(3, 2)).sum())
        assert acc.step()
        assert abs(before - float(model.bias) - 0.5) < 1e-6  # d(sum)/d(bias) = 3 > 0: one signed step
    """))
    run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", mypy_cache,
         "--config-file", REPO / "pyproject.toml", script], cwd=tmp_path)
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.slow
def test_plain_pip_install_fails_at_once_saying_what_to_run(tmp_path):
    # Build isolation on: the isolated environment has no torch, and gets none.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp_path, REPO],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "pip install --no-build-isolation ." in out, out[-3000:]
    assert not re.search(r"(Collecting|Downloading) torch", out), out[-3000:]
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_wheel_is_the_cpp_sdk(tmp_path):
    env = dict(os.environ)
    for var in ("CMAKE_PREFIX_PATH", "Torch_DIR", "gradaccum_DIR", "PYTHONPATH"):
        env.pop(var, None)
    # the wheel, built from this checkout against the installed torch
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", tmp_path / "dist", REPO],
        env=env)
    (wheel,) = (tmp_path / "dist").glob("gradaccum-*.whl")
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
        for needed in ("gradaccum/lib/libgradaccum.so", "gradaccum/include/gradaccum/gradaccum.h",
                       "gradaccum/lib/cmake/gradaccum/gradaccum-config.cmake",
                       "gradaccum/lib/cmake/gradaccum/gradaccum-targets.cmake",
                       "gradaccum/py.typed", "gradaccum/_C.pyi", "gradaccum/lightning.py"):
            assert needed in files, needed
        assert not any(f.startswith("gradaccum/csrc") for f in files)
        # relocatable: no absolute path of this machine in the CMake package
        for name in files:
            if name.startswith("gradaccum/lib/cmake/"):
                text = z.read(name).decode()
                for absolute in (str(REPO), str(pathlib.Path(torch.__file__).parent), sys.prefix):
                    assert absolute not in text, f"{name} names {absolute}"
        metadata = z.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
        assert f"Requires-Dist: torch=={torch_line()}.*" in metadata

    # a fresh environment that sees this interpreter's torch (and its
    # setuptools: no pip of its own) after its own packages: a .pth names this
    # environment's site-packages (--system-site-packages would see the base
    # interpreter's, another torch when this one is itself a venv, as under
    # make check-cuda); --force-reinstall: a gradaccum outside it does not count
    # The venv and the consumer's build sit in the checkout's build folder,
    # at the same places every run: the consumer's compile, which names the
    # venv's headers, then hits ccache (Note [One compiler cache for every
    # checkout] in the Makefile).
    work = REPO / "build" / "wheel-sdk"
    shutil.rmtree(work, ignore_errors=True)
    venv = work / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    venv_site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    pathlib.Path(venv_site, "_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "--no-deps",
         "--force-reinstall", wheel], env=env)
    probe = ("import gradaccum, torch\n"
             "m = torch.nn.Linear(3, 1); acc = gradaccum.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), steps=2)\n"
             "[acc.backward(m(torch.randn(4, 3)).sum()) for _ in range(2)]\n"
             "assert acc.step()\n"
             "libs = {l.split()[-1] for l in open('/proc/self/maps') if 'libgradaccum' in l}\n"
             "print(gradaccum.__file__); print(sorted(libs))\n"
             "print(gradaccum.cmake_prefix_path + ';' + torch.utils.cmake_prefix_path)\n")
    package, libs, prefix_path = run([python, "-c", probe], env=env, cwd=tmp_path).stdout.strip().splitlines()
    site = pathlib.Path(package).parent
    assert site.is_relative_to(venv), package
    # _C runs the one library inside the package (no second copy of the code)
    assert libs == str([str(site / "lib" / "libgradaccum.so")]), libs
    if shutil.which("readelf"):
        for binary in [site / "lib" / "libgradaccum.so", *site.glob("_C*.so")]:
            dynamic = run(["readelf", "-d", binary]).stdout
            runpath = re.search(r"R(UN)?PATH.*\[(.*)\]", dynamic).group(2).split(":")
            # relative first; libgradaccum then falls back on the torch it was
            # built against (here torch is not beside it, as in a venv with
            # system site-packages): no build-tree path leaks in
            assert runpath[0].startswith("$ORIGIN"), f"{binary}: {runpath}"
            assert all(p.startswith("$ORIGIN") or os.path.realpath(p) == TORCH_LIB for p in runpath), f"{binary}: {runpath}"

    # a C++ user's project, with nothing but that pip install
    build = work / "consumer"
    configure = ["cmake", "-S", REPO / "tests" / "consumer", "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={prefix_path}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    run(configure, env=env)
    cache = (build / "CMakeCache.txt").read_text()
    assert f"gradaccum_DIR:PATH={site / 'lib' / 'cmake' / 'gradaccum'}" in cache
    run(["cmake", "--build", build, "-j", os.environ.get("MAX_JOBS", "2")], env=env)
    out = run([build / "consumer"], env=env).stdout
    assert f"consumer: gradaccum {header_version()}, stepped=1" in out, out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or not shutil.which("cmake"), reason="Linux, CMake")
def test_a_statically_linked_cxx_runtime_stays_private(tmp_path):
    """Some compilers (devtoolset-style GCCs; the /opt/gcc of the GPU machine)
    link libstdc++ statically into each shared object. Loaded after torch,
    such a library's exported runtime mixed with torch's: numbers vanished from
    error texts here, and on the GPU machine the first `stream << number`
    crashed. libgradaccum links with --exclude-libs,ALL (Note [Static runtime
    pieces stay private] in CMakeLists.txt): built with -static-libstdc++ (the
    sources hit ccache), swapped into a copy of the installed package, it must
    format numbers and reduce over a group as the normal build does."""
    # build/static-runtime: two levels below the checkout, as build/cmake,
    # so that its compiles hit ccache under the Makefile's CCACHE_BASEDIR
    # (Note [One compiler cache for every checkout] in the Makefile)
    build = REPO / "build" / "static-runtime"
    shutil.rmtree(build, ignore_errors=True)
    configure = ["cmake", "-S", REPO, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGRADACCUM_TEST=OFF",
                 "-DGRADACCUM_INSTALL=OFF", "-DGRADACCUM_PYTHON_PACKAGE=ON",
                 f"-DTorch_DIR={os.path.join(torch.utils.cmake_prefix_path, 'Torch')}",
                 "-DCMAKE_SHARED_LINKER_FLAGS=-static-libstdc++ -static-libgcc"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    run(configure)
    run(["cmake", "--build", build, "-j", os.environ.get("MAX_JOBS", "2"), "--target", "gradaccum"], timeout=1200)
    (lib,) = build.glob("libgradaccum.so*")
    if shutil.which("readelf"):
        assert "libstdc++" not in run(["readelf", "-d", lib]).stdout, "not linked statically"
    package = tmp_path / "pkg" / "gradaccum"
    shutil.copytree(pathlib.Path(gradaccum.__file__).parent, package)
    shutil.copy(lib, package / "lib" / "libgradaccum.so")
    probe = ("import torch, torch.distributed as dist, gradaccum\n"
             "assert gradaccum.__file__.startswith(%r), gradaccum.__file__\n"
             "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:%d', rank=0, world_size=1)\n"
             "m = torch.nn.Linear(3, 1)\n"
             "try:\n"
             "    gradaccum.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), steps=0)\n"
             "except ValueError as e:\n"
             "    print(e)\n"
             "acc = gradaccum.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), steps=2)\n"
             "for _ in range(4):\n"
             "    acc.backward(m(torch.ones(2, 3)).sum()); acc.step()\n"
             "print(acc.stats()['optimizer_steps'], acc.stats()['collectives'])\n"
             "dist.destroy_process_group()\n") % (str(package), _free_port())
    env = dict(os.environ, PYTHONPATH=str(package.parent), OMP_NUM_THREADS="1")
    out = run([sys.executable, "-c", probe], env=env, cwd=tmp_path).stdout.splitlines()
    assert "steps" in out[0] and "got 0" in out[0] or "steps: 0" in out[0], out
    assert out[1] == "2 2", out


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
