"""Binding tasks to CPUs: ``--cpus`` on psserver/psworker, LocalCluster(pin_workers=True)."""
from __future__ import annotations

import os

import pytest

from coordinator import LocalCluster
from psserver.process import start_task
from psserver.server import parse_cpus

CPUS = sorted(os.sched_getaffinity(0))


def allowed_cpus(pid: int) -> list[set[int]]:
    """The CPUs each thread of a process may run on."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(os.sched_getaffinity(int(tid)))
        except OSError:   # a thread that just ended
            pass
    return out


def test_parse_cpus():
    assert parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpus("5") == {5}
    assert parse_cpus(" 1 , 2-2") == {1, 2}
    for bad in ("", "a", "1-", "-1", "3-1", "1,,2", "0-x"):
        with pytest.raises(ValueError, match="--cpus"):
            parse_cpus(bad)


@pytest.mark.timeout(60)
def test_task_bound_to_its_cpus_and_bad_lists_refused():
    cpu = CPUS[-1]
    w = start_task("psworker", ["--port", "0", "--cpus", str(cpu)], timeout=20)
    try:
        threads = allowed_cpus(w.pid)
        assert len(threads) > 1 and all(t == {cpu} for t in threads), threads
    finally:
        w.kill()
    # A CPU this process may not use: exit 2, naming the ones it may.
    outside = max(CPUS) + 1000
    with pytest.raises(RuntimeError, match=f"CPU {outside} is not one this task may use"):
        start_task("psserver", ["--port", "0", "--cpus", str(outside)], timeout=20)
    with pytest.raises(RuntimeError, match="expected CPU numbers and ranges"):
        start_task("psworker", ["--port", "0", "--cpus", "first"], timeout=20)


@pytest.mark.timeout(90)
def test_local_cluster_pins_workers_round_robin_also_after_a_restart():
    with LocalCluster(num_ps=1, num_workers=3, tls=False, pin_workers=True) as cluster:
        for i, w in enumerate(cluster.workers):
            assert all(t == {CPUS[i % len(CPUS)]} for t in allowed_cpus(w.pid))
        # Parameter servers are not bound.
        assert all(t == set(CPUS) for t in allowed_cpus(cluster.ps[0].pid))
        cluster.restart_worker(1)
        assert all(t == {CPUS[1 % len(CPUS)]} for t in allowed_cpus(cluster.workers[1].pid))
    with LocalCluster(num_ps=1, num_workers=1, tls=False) as cluster:   # the default: unbound
        assert all(t == set(CPUS) for t in allowed_cpus(cluster.workers[0].pid))
