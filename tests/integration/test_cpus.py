"""Binding tasks to CPUs: ``--cpus`` on psserver/psworker, LocalCluster(pin_workers=True)."""
from __future__ import annotations

import os

import pytest

from coordinator import LocalCluster
from psserver.process import start_task
from psserver.serve.task import parse_cpus

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


BOUND_CLIENT = """
import os, sys
import numpy as np
from psserver.client import PSClient
if sys.argv[2] != "-":
    os.sched_setaffinity(0, {int(sys.argv[2])})
with PSClient(sys.argv[1]) as c:
    c.create_variable("v", (4,), "float32", initializer="zeros", optimizer="sgd", exist_ok=True)
    c.push("v", np.ones(4, np.float32))   # same host: over the local socket
    print("pushed", flush=True)
    sys.stdin.readline()                  # connection kept open until told
"""


def _client_bound_to(ps, cpu):
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", BOUND_CLIENT, ps.address, cpu],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "pushed"
    return p


@pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs to tell bound from unbound")
@pytest.mark.timeout(60)
def test_local_calls_of_a_bound_client_are_served_on_its_cpu(ps):
    before = allowed_cpus(ps.pid)
    assert all(t == set(CPUS) for t in before)
    unbound = _client_bound_to(ps, "-")
    try:
        assert all(t == set(CPUS) for t in allowed_cpus(ps.pid))
    finally:
        unbound.communicate("\n", timeout=20)
    bound = _client_bound_to(ps, str(CPUS[-1]))
    try:
        # The thread serving its connection runs on the client's CPU; the rest do not.
        threads = allowed_cpus(ps.pid)
        assert {CPUS[-1]} in threads and set(CPUS) in threads, threads
    finally:
        bound.communicate("\n", timeout=20)
