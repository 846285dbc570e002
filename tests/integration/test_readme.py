"""The README's and the guides' commands, run as written (issue 35).

Every ```bash and ```python block of README.md and docs/*.md is run here,
unless the line above it is a marker that says why not:

    <!-- not run by tests/integration/test_readme.py: REASON -->
    <!-- run by tests/integration/test_multihost.py::test_name -->

The first needs a reason a person can check (it downloads from outside, it
is the command that runs this suite, it is a fragment of an example that
its own test runs: name that test); the second names the test that runs the
block instead, which must exist. A block with neither is run: a bash block
with bash, a Python block with this interpreter, each in a directory of its
own that looks like the repository's root (`examples/` linked in, the
repository on PYTHONPATH, the install's commands on PATH), with nothing of
this test's environment (no PSTRAIN_* or TF_CONFIG), and every process it
started killed afterwards, also when it fails. README's first command, which
makes a virtual environment and installs the package, runs in a copy of the
repository instead.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!-- not run by tests/integration/test_readme\.py: (.{12,}?) -->")
ELSEWHERE = re.compile(r"<!-- run by (tests/[\w/]+\.py)::(\w+) -->")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclass
class Block:
    doc: Path
    line: int        # of the opening fence, 1-based
    lang: str
    code: str
    marker: str      # the line above the fence ("" if none)

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of ``doc``, with the marker line above each."""
    lines, out, i = doc.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        above = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        out.append(Block(doc, start + 1, lang, "\n".join(body) + "\n",
                         above if above.startswith("<!--") else ""))
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
RUNNABLE = [b for b in ALL if b.lang in ("bash", "python")]
TO_RUN = [b for b in RUNNABLE if not b.marker]


def test_every_block_is_run_or_says_why_not():
    """A marker is one of the two forms, with a reason or an existing test;
    a marker is only where a block follows (none left over from an edit)."""
    assert len(RUNNABLE) >= 15, [b.name for b in RUNNABLE]   # the parser found the docs' blocks
    for b in RUNNABLE:
        if not b.marker:
            continue
        skip, elsewhere = SKIP.fullmatch(b.marker), ELSEWHERE.fullmatch(b.marker)
        assert skip or elsewhere, f"{b.name}: unknown marker {b.marker!r}: {__doc__}"
        if elsewhere:
            path, test = elsewhere.groups()
            assert (ROOT / path).exists(), f"{b.name}: {path} does not exist"
            assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), \
                f"{b.name}: {path} has no test {test}"
    for doc in DOCS:   # every marker stands right above a block it describes
        marked = {b.line for b in ALL if b.doc == doc and b.marker}
        lines = doc.read_text().splitlines()
        for n, ln in enumerate(lines, 1):
            if SKIP.search(ln) or ELSEWHERE.search(ln) or "test_readme" in ln:
                following = next((k for k in range(n + 1, len(lines) + 1)
                                  if lines[k - 1].strip()), None)
                assert following in marked, f"{doc.name}:{n}: a marker with no block below it"


def test_the_blocks_to_run_are_the_ones_that_matter():
    """What this file runs: the README's main command and quick example and
    the one-machine guide (the five-machine guide runs on test hosts)."""
    names = {(b.doc.name, b.code.splitlines()[0] if b.code.strip() else "") for b in TO_RUN}
    assert ("README.md", "# 1. set up and run the main job (digits classifier on 2 parameter "
            "servers + 2 workers)") in names, names
    assert any(d == "several-machines.md" and "PSTRAIN_AUTH_TOKEN" in first
               for d, first in names), names
    assert sum(d == "README.md" for d, _ in names) >= 2, names


def _clean_env(path_first: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PSTRAIN_", "TF_CONFIG", "PYTHONPATH", "VIRTUAL_ENV"))}
    env["PATH"] = path_first + os.pathsep + os.environ.get("PATH", "")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _copy_of_the_repository(dest: Path) -> None:
    """The files a clone has (tracked and not ignored), uncommitted edits included."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _run(block: Block, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """(exit status, output) of the block; its output goes to a file, not a
    pipe, so tasks it left running cannot hold this test past its end."""
    argv = ["bash", "-euo", "pipefail", "-c", block.code] if block.lang == "bash" \
        else [sys.executable, "-c", block.code]
    log = cwd / ".block-output"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:   # the block's processes, background tasks included, whatever happened
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text(errors="replace")
    return rc, text + (f"\n[timed out after {timeout}s]" if rc is None else "")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", TO_RUN, ids=[b.name for b in TO_RUN])
def test_the_block_runs_as_written(block: Block, tmp_path):
    if block.doc.name == "README.md" and "pip install" in block.code:
        # it makes .venv and installs into it: a copy of the repository, a fresh shell
        _copy_of_the_repository(tmp_path)
        env = _clean_env(os.path.dirname(shutil.which("python3") or sys.executable))
        rc, out = _run(block, tmp_path, env, timeout=840)
    else:   # the repository's root as the guide has it: examples/ here, the package installed
        os.symlink(ROOT / "examples", tmp_path / "examples")
        env = _clean_env(os.path.dirname(sys.executable))
        env["PYTHONPATH"] = str(ROOT)
        rc, out = _run(block, tmp_path, env, timeout=600)
    assert rc == 0, f"{block.name} exited {rc}:\n{out[-6000:]}"
    if "digits.py" in block.code:   # the main job trained
        acc = re.findall(r"test accuracy: ([0-9.]+)", out)
        assert acc and float(acc[-1]) >= 0.90, out[-3000:]
    if "--checkpoint-dir" in block.code and "coordinator checkpoint list" in block.code:
        assert re.search(r"ckpt-0+500\b", out), out[-3000:]   # 10 epochs x 50 steps, listed
