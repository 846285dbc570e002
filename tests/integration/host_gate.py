"""What every test module on test hosts (bench/hosts.py) starts with:
``pytestmark = host_gate.marks(seconds)``. Where test hosts cannot be made
here the module's tests are skipped with the reason, except under
PSTRAIN_REQUIRE_HOSTS=1 (.ci/run), where that is a failure, not a skip."""
from __future__ import annotations

import os

import pytest

from bench import hosts


def marks(timeout: float) -> list:
    """The module's marks: each test bounded by ``timeout`` seconds, and
    skipped where test hosts are not available (fails the module under
    PSTRAIN_REQUIRE_HOSTS=1)."""
    ok, why = hosts.available()
    if not ok and os.environ.get("PSTRAIN_REQUIRE_HOSTS") == "1":
        pytest.fail(f"PSTRAIN_REQUIRE_HOSTS=1, but {why}", pytrace=False)
    return [pytest.mark.timeout(timeout), pytest.mark.skipif(not ok, reason=why)]
