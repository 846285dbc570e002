"""A client and a task of different protocol versions refuse each other,
saying which versions (psserver.contract.PROTOCOL_VERSION); nothing either
sends is acted on. Real processes: the other version is this code with its
PROTOCOL_VERSION set otherwise (other_version.py)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from psserver.client import PSClient
from psserver.contract import PROTOCOL_VERSION
from psserver.errors import FailedPrecondition
from psserver.process import child_env, start_task

OTHER = "tests.integration.other_version"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("theirs", [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1])
def test_a_client_and_a_server_of_different_versions_refuse_each_other(start_ps, theirs):
    other = start_task(OTHER, [str(theirs), "psserver", "--port", "0"])
    try:
        with PSClient(other.address, timeout=20) as c:
            for call in (c.server_info,
                         lambda: c.create_variable("v", initial_value=np.zeros(2, np.float32)),
                         lambda: c.read("v")):
                with pytest.raises(FailedPrecondition) as info:
                    call()
                msg = str(info.value)
                assert f"protocol {PROTOCOL_VERSION}" in msg and f"speaks {theirs}" in msg \
                    or f"protocol {theirs}" in msg and f"speaks {PROTOCOL_VERSION}" in msg, msg
                assert "older" in msg and "install the same pstrain version" in msg
    finally:
        other.kill()
    # The other way round: a client of that version and a server of this one.
    ours = start_ps()
    out = subprocess.run([sys.executable, "-m", OTHER, str(theirs), "client", ours.address],
                         env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("refused FailedPrecondition"), out.stdout + out.stderr
    assert f"protocol {theirs}" in out.stdout and str(PROTOCOL_VERSION) in out.stdout
    with PSClient(ours.address) as c:   # this version's client is served, and nothing was made
        assert c.list_variables() == []


@pytest.mark.timeout(90)
def test_a_worker_of_another_version_is_refused_by_the_coordinators_channel():
    from psserver.link.channel import (
        TaskChannel,  # as coordinator/worker_channel.py holds it
    )
    other = start_task(OTHER, [str(PROTOCOL_VERSION + 1), "psworker", "--port", "0"])
    try:
        ch = TaskChannel(other.address, role="worker")
        try:
            with pytest.raises(FailedPrecondition) as info:
                ch.ask(timeout=20)
            assert f"protocol {PROTOCOL_VERSION}" in str(info.value) \
                or f"protocol {PROTOCOL_VERSION + 1}" in str(info.value)
        finally:
            ch.close()
    finally:
        other.kill()
