"""Task processes started for a program end when that program dies."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ORPHANING_PARENT = ("from psserver.process import start_task\n"
                    "t = start_task('psserver', ['--port', '0'])\n"
                    "print(t.pid, flush=True)\n"
                    "import os; os._exit(0)   # dies without stopping its task\n")


def _gone(pid: int, within: float) -> bool:
    """Poll an unrelated process for exit: no notification exists for it."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(60)
def test_task_stops_when_the_process_that_started_it_dies():
    out = subprocess.run([sys.executable, "-c", ORPHANING_PARENT], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    pid = int(out.strip())
    try:
        assert _gone(pid, within=15), "the orphaned psserver kept running"
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
