"""coordinator/recovery.py's wait for a parameter server that restarted,
with fakes (no processes): a server killed again while its shards are
restored from a checkpoint is waited for again and restored, not given up
(the chaos test, tests/integration/test_fault_tolerance.py, met it once)."""
from __future__ import annotations

import threading
import types

import pytest

from coordinator.recovery import _PSRecovery
from psserver.errors import Unavailable


class FakeCheckpoints:
    def __init__(self, fail_first: int, server):
        self.fail_first, self.server, self.restores = fail_first, server, []

    def latest(self):
        return "/ckpt/ckpt-00000100"

    def restore(self, address):
        self.restores.append(self.server.id)
        if len(self.restores) <= self.fail_first:   # killed mid-restore: it restarts
            self.server.id = f"incarnation-{len(self.restores) + 1}"
            raise Unavailable(f"failed to connect to {address}")


def make(fail_first: int):
    server = types.SimpleNamespace(id="incarnation-1")
    probes = []

    def probe(address):
        probes.append(server.id)
        return types.SimpleNamespace(server_id=server.id)
    strategy = types.SimpleNamespace(server_ids={"ps:1": "incarnation-0"}, replication=False,
                                     recreate_tables=lambda address: None, tables=[],
                                     shards_on=lambda address: [(None, types.SimpleNamespace(
                                         name="w"))], tables_on=lambda address: [])
    failed = []
    cluster = types.SimpleNamespace(
        strategy=strategy, ps_recovery_timeout=30.0, closed=False,
        ps_watch=types.SimpleNamespace(probe=probe), recreate_lost_shards=False,
        checkpoint_manager=FakeCheckpoints(fail_first, server),
        queue=types.SimpleNamespace(mark_failed_external=failed.append),
        clocks_changed=lambda: None, pause=lambda: None, resume=lambda: None)
    r = _PSRecovery(cluster)
    r._active["ps:1"] = threading.current_thread()
    return r, cluster, failed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fail_first", [0, 1, 2])
def test_a_server_killed_again_mid_restore_is_restored_once_it_is_back(fail_first):
    r, cluster, failed = make(fail_first)
    r._recover("ps:1")
    assert failed == [] and "ps:1" not in r.given_up
    assert r.recoveries == 1
    # each incarnation restored in turn, the last one for good
    assert cluster.checkpoint_manager.restores == [f"incarnation-{i + 1}"
                                                   for i in range(fail_first + 1)]
    assert cluster.strategy.server_ids["ps:1"] == f"incarnation-{fail_first + 1}"


@pytest.mark.timeout(30)
def test_a_restore_that_fails_on_a_server_that_stays_up_is_given_up():
    """Not an outage: the same process answers, so the error is the job's."""
    r, cluster, failed = make(0)

    def broken(address):
        raise Unavailable("the restore itself is broken")
    cluster.checkpoint_manager.restore = broken
    r._recover("ps:1")
    assert "ps:1" in r.given_up and len(failed) == 1
    assert "could not be recovered" in str(failed[0])
