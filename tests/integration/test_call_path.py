"""What one dense push costs in Python, and that it is planned once.

A push of a 2-shard variable on 2 parameter servers (real processes) is
counted, every Python ``call`` event in every thread of this process from
the call of ``push_gradients`` until it returns (sys.setprofile and
threading.setprofile), on the data-port route and on the shared-memory
route. The counts at 808e9e1, before the call path was redesigned (issue
31, measured with the same harness: tls off, a warm client), were 247 and
191; a push must now cost at most half of that.

"Planned once" means: the route (``routing.plan``) and the form of the call
(``routing.form``) are consulted at most once per server per call, and which
copy of a shard is primary (``Routes.route``) at most once per shard.
"""
from __future__ import annotations

import collections
import sys
import threading

import numpy as np
import pytest

from coordinator import (
    FixedShardsPartitioner,
    LocalCluster,
    ParameterServerStrategy,
    ps_pool,
    push_gradients,
)
from coordinator.routes import Routes
from psserver.contract import routing, shm

pytestmark = pytest.mark.timeout(120)

#: Python calls of one such push at 808e9e1 (see the module).
BEFORE = {"data": 247, "shm": 191}


@pytest.fixture(params=["data", "shm"])
def route(request, monkeypatch):
    if request.param == "shm" and not shm.available():
        pytest.skip("no sealed memfds on this system")
    ps_pool.close_clients()   # clients read the switches when made
    if request.param == "data":
        monkeypatch.setenv(routing.SHM_ENV, "0")   # the data port, as across hosts
    yield request.param
    ps_pool.close_clients()


def _count(fn) -> collections.Counter:
    """The Python functions called while fn() runs, every thread of this process."""
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def profile(frame, event, arg):
        if event == "call":
            with lock:
                counts[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return counts


def test_a_dense_push_costs_at_most_half_the_python_calls_it_did(route):
    with LocalCluster(num_ps=2, num_workers=0, tls=False) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        v = strategy.create_variable("w", initial_value=np.zeros((64, 8), np.float32),
                                     optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        assert len({s.address for s in v.shards}) == 2
        g = np.ones((64, 8), np.float32)
        for _ in range(3):   # warm: routes planned, segments attached, headers made
            push_gradients([(v, g)])
        kinds = {ps_pool.client_for(s.address).channel.socket.kind for s in v.shards}
        assert kinds == {"tcp" if route == "data" else "unix"}
        counts = _count(lambda: push_gradients([(v, g)]))
        total = sum(counts.values())
        top = ", ".join(f"{name} {n}" for (_, name), n in counts.most_common(8))
        assert total <= BEFORE[route] // 2, f"{total} calls ({top})"
        np.testing.assert_array_equal(v.read(), -4 * g)


def test_a_push_plans_its_route_and_form_once_per_server_and_asks_who_leads_once_per_shard(
        route, monkeypatch):
    with LocalCluster(num_ps=2, num_workers=0, tls=False) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True,
                                           variable_partitioner=FixedShardsPartitioner(2))
        v = strategy.create_variable("w", initial_value=np.zeros((64, 8), np.float32),
                                     optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        g = np.ones((64, 8), np.float32)
        push_gradients([(v, g)])   # warm
        asked = collections.Counter()

        def counted(name, fn):
            def wrapper(*a, **k):
                asked[name] += 1
                return fn(*a, **k)
            return wrapper
        monkeypatch.setattr(routing, "plan", counted("plan", routing.plan))
        monkeypatch.setattr(routing, "form", counted("form", routing.form))
        monkeypatch.setattr(Routes, "route", counted("route", Routes.route))
        push_gradients([(v, g)])
        servers = len({s.address for s in v.shards})
        assert asked["plan"] == 0   # planned when the client connected, not per call
        assert 1 <= asked["form"] <= servers
        assert asked["route"] == v.num_shards   # once per shard
        np.testing.assert_array_equal(v.read(), -2 * g)
