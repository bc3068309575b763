"""The README's quickstart runs as written, in one process and under torchrun,
and the README and docs/ link only to files and headings that exist.

The quickstart is the first ```python block after the README's "Quickstart"
heading; it is written to a temporary folder and run from there.

    OMP_NUM_THREADS=1 python3 -m pytest tests/python/test_readme.py -q
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "TORCHELASTIC_RUN_ID")
# Not anchored to lines: two ranks' prints can land on one line of torchrun's merged output.
FINAL = re.compile(r"rank (\d+): final loss ([0-9.]+), (\d+) optimizer steps, (\d+) all-reduces")


def quickstart() -> str:
    text = README.read_text()
    heading = re.search(r"^#+ .*Quickstart.*$", text, re.M)
    assert heading, "README.md has no Quickstart heading"
    block = re.compile(r"^```python\n(.*?)^```$", re.M | re.S).search(text, heading.end())
    assert block, "no ```python block after the README's Quickstart heading"
    return block.group(1)


def clean_env() -> dict:
    """The test's environment without a launcher's variables (pytest may itself
    run under one), with one thread per process and Gloo on loopback."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for var in LAUNCH_VARS:
        env.pop(var, None)
    return env


def run(cmd, cwd):
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {int(m.group(1)): m.groups()[1:] for m in FINAL.finditer(proc.stdout)}, proc.stdout


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("readme") / "quickstart.py"
    path.write_text(quickstart())
    return path


def test_quickstart_is_about_25_lines():
    lines = quickstart().strip().splitlines()
    assert 15 <= len(lines) <= 40, len(lines)
    assert "gradaccum.Accumulator(" in quickstart()


def test_quickstart_runs_in_one_process(script):
    finals, out = run([sys.executable, str(script)], script.parent)
    assert list(finals) == [0], out
    loss, steps, collectives = finals[0]
    assert float(loss) < 0.2 and int(steps) > 0, out
    assert int(collectives) == 0, out  # one process: nothing to reduce


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="needs torch.distributed with Gloo")
def test_quickstart_runs_under_torchrun(script):
    finals, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(script)], script.parent)
    assert sorted(finals) == [0, 1], out
    assert finals[0][1] == finals[1][1], out  # optimizer steps, the same on both ranks
    # data parallel: at least one all-reduce per optimizer step, the same on both ranks
    assert finals[0][2] == finals[1][2] and int(finals[0][2]) >= int(finals[0][1]) > 0, out


def test_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= 320


def without_code(text: str) -> str:
    return re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)


def anchors(path: Path) -> set:
    """GitHub's anchors for a Markdown file's headings."""
    found = set()
    for heading in re.findall(r"^#+ (.*)$", without_code(path.read_text()), re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            missing.append(target)
    assert not missing, f"{page.name} links to missing files or headings: {missing}"
