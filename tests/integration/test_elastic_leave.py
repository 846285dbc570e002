"""A parameter server asked to stop while it holds tables' rows (SIGTERM with
``psserver --leave-timeout``: psserver/serve/leave.py), on real processes: a
coordinator that follows its servers drains it at once (every row kept), and
it stops then, by itself; without a follower it stops once nothing asks
about it; given a second signal, it stops at once. (A leaving server's
variable shards: tests/integration/test_variable_moves.py.)
This is what ``docker compose up --scale ps=N`` down or a StatefulSet scaled
down does to a server."""
from __future__ import annotations

import contextlib
import signal
import time

import grpc
import numpy as np
import pytest

from coordinator import ClusterCoordinator, LocalCluster, serialization
from protos.pstrain.v1 import worker_pb2, worker_pb2_grpc
from psserver.process import start_task
from psserver.tls import make_channel
from tests.integration.test_elastic import _job, _rows

pytestmark = pytest.mark.timeout(180)

KEYS = np.arange(20_000, dtype=np.int64)
LEAVE = ("--leave-timeout", "120")


def _filled(emb, counter) -> tuple:
    emb.lookup(KEYS)
    emb.push_gradient(KEYS, np.ones((KEYS.size, 4), np.float32))
    counter.lookup(KEYS)
    return emb.lookup(KEYS, admit=False), counter.lookup(KEYS, admit=False)


def _until(what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.05)


def test_a_server_asked_to_stop_is_drained_by_the_job_then_stops():
    with LocalCluster(num_ps=2, num_workers=1, ps_args=LEAVE, restart=()) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy, elastic_servers=True, membership_interval=0.2):
            want = _filled(emb, counter)
            added = cluster.add_ps()   # the spec gains it: the follower adds it
            _until(lambda: emb.num_shards == 3 and counter.num_shards == 3)
            assert _rows(emb.addresses, "emb")[2] > 0
            task = cluster.ps[2]
            task.signal(signal.SIGTERM)
            assert task.proc.wait(timeout=120) == 0   # (drained long before its 120 s)
            out = task.output()
            assert "leaving: drained" in out and "not drained" not in out, out[-3000:]
            assert added not in strategy.parameter_servers
            assert emb.num_shards == counter.num_shards == 2
            assert sum(_rows(emb.addresses, "emb")) == KEYS.size
            np.testing.assert_array_equal(emb.lookup(KEYS, admit=False), want[0])
            np.testing.assert_array_equal(counter.lookup(KEYS, admit=False), want[1])


def slow_step(emb, seconds: float) -> int:
    """A step in flight for ``seconds`` (a drain waits for it first)."""
    time.sleep(seconds)
    return len(emb.lookup(KEYS[:10], admit=False))


def test_a_server_drained_added_again_or_slow_to_drain_or_restarted_is_kept_whole():
    """Review 19's three: (1) a server drained, then added again, leaves as
    any other (it stopped at once, its rows with it: the drained mark was
    never cleared); (2) a drain that waits for a long step in flight is not
    cut off (the follower kept no one asking while it drained: the server
    stopped half way); (3) a server that comes back where one was drained as
    it left (a rolling restart) is added again (it stayed out for good)."""
    env = {"PSTRAIN_LEAVE_ASKED_SECONDS": "2"}
    with LocalCluster(num_ps=2, num_workers=1, ps_args=LEAVE, env=env,
                      restart=("ps",)) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy, elastic_servers=True,
                                membership_interval=0.2) as coord:
            want = _filled(emb, counter)
            added = cluster.add_ps()
            _until(lambda: emb.num_shards == 3)
            coord.remove_parameter_server(added)   # (drained by the API: its mark set)
            coord.add_parameter_server(added)      # (buckets back: the mark cleared)
            assert emb.num_shards == 3 and _rows(emb.addresses, "emb")[2] > 0
            first = cluster.ps[2]
            running = coord.schedule(slow_step, args=(emb, 5.0))   # (longer than 2 s)
            while coord.pending() != (0, 1):   # (taken by the worker)
                time.sleep(0.01)
            first.signal(signal.SIGTERM)
            assert first.proc.wait(timeout=120) == 0
            assert running.fetch() == 10
            out = first.output()
            assert "leaving: drained" in out and "no coordinator" not in out, out[-3000:]
            np.testing.assert_array_equal(emb.lookup(KEYS, admit=False), want[0])
            # LocalCluster starts it again on its port: a new process, added back
            _until(lambda: emb.num_shards == 3 and added in strategy.parameter_servers)
            assert cluster.ps[2] is not first and _rows(emb.addresses, "emb")[2] > 0
            np.testing.assert_array_equal(emb.lookup(KEYS, admit=False), want[0])
            np.testing.assert_array_equal(counter.lookup(KEYS, admit=False), want[1])


def test_two_servers_leaving_at_once_are_both_drained_while_a_long_step_runs():
    """Review 20: while the follower drained one leaving server (the drain
    waiting first for a 5 s step in flight) it asked only that one, so a
    second one leaving at the same time stopped undrained at its patience."""
    env = {"PSTRAIN_LEAVE_ASKED_SECONDS": "2"}
    with LocalCluster(num_ps=2, num_workers=1, ps_args=LEAVE, env=env,
                      restart=()) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy, elastic_servers=True,
                                membership_interval=0.2) as coord:
            want = _filled(emb, counter)
            cluster.add_ps()
            cluster.add_ps()
            _until(lambda: emb.num_shards == 4 and counter.num_shards == 4)
            running = coord.schedule(slow_step, args=(emb, 5.0))
            while coord.pending() != (0, 1):
                time.sleep(0.01)
            leaving = cluster.ps[2:]
            for task in leaving:
                task.signal(signal.SIGTERM)
            for task in leaving:
                out = _stops(task)
                assert "leaving: drained" in out and "no coordinator" not in out, out[-3000:]
            assert running.fetch() == 10 and emb.num_shards == counter.num_shards == 2
            np.testing.assert_array_equal(emb.lookup(KEYS, admit=False), want[0])
            np.testing.assert_array_equal(counter.lookup(KEYS, admit=False), want[1])


def _stops(task, timeout: float = 150.0) -> str:
    """The task's exit (0, by itself) and what it printed."""
    assert task.proc.wait(timeout=timeout) == 0
    return task.output()


def test_without_a_follower_or_at_a_second_signal_it_stops_by_itself():
    with LocalCluster(num_ps=2, num_workers=0, ps_args=LEAVE, restart=()) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        _filled(emb, counter)
        with ClusterCoordinator(strategy) as coord:
            coord.add_parameter_server(cluster.add_ps())   # (rows of both tables there)
        # nothing that drains servers asks about it: it stops, its rows with it
        cluster.ps[2].signal(signal.SIGTERM)
        out = _stops(cluster.ps[2])
        assert "leaving: waiting" in out and "no coordinator that follows" in out, out[-3000:]
        held = [bool(strategy.shards_on(t.address)) for t in cluster.ps[:2]]
        assert sorted(held) == [False, True]   # (w on one server, the tables on both)
        # holding variables (a drain moves them now): it waits too; a second signal stops it
        task = cluster.ps[held.index(True)]
        task.signal(signal.SIGTERM)
        _until(lambda: "leaving: waiting" in task.output())
        task.signal(signal.SIGTERM)
        out = _stops(task)
        assert "drained" not in out and "no coordinator" not in out, out[-3000:]
        # leaving, then a second signal: it stops at once
        task = cluster.ps[held.index(False)]
        task.signal(signal.SIGTERM)
        _until(lambda: "leaving: waiting" in task.output())
        task.signal(signal.SIGTERM)
        out = _stops(task)
        assert "drained" not in out and "no coordinator" not in out, out[-3000:]


def rows_sum(emb) -> float:
    """A step: the sum of the rows of KEYS (a look-up that admits nothing)."""
    return float(emb.lookup(KEYS, admit=False).sum())


def test_steps_scheduled_before_a_drain_reach_no_server_that_stopped_after_it():
    """Steps queued before a drain carry the table as it was then (pickled
    when scheduled); the drained server stops as soon as the drain is done.
    Each closure also carries the newest layouts the coordinator knows
    (ClosureRequest.layouts), so every step is planned on the servers left:
    none fails and each reads every row. (Before, the steps queued across
    the drain failed: their look-ups went to the stopped server.)"""
    with LocalCluster(num_ps=2, num_workers=1, restart=()) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        want = float(_filled(emb, counter)[0].sum())
        with ClusterCoordinator(strategy) as coord:
            added = cluster.add_ps()
            coord.add_parameter_server(added)
            values = [coord.schedule(rows_sum, args=(emb,)) for _ in range(300)]
            coord.remove_parameter_server(added)
            assert coord.pending()[0] > 0   # (steps pickled before the drain still queued)
            cluster.ps[2].terminate()
            assert [v.fetch() for v in values] == [want] * len(values)


@contextlib.contextmanager
def a_worker(token: str):
    """A real psworker with ``token``: (its stub, the call metadata, a
    ClosureRequest adding 2 and 3); killed after."""
    w = start_task("psworker", ["--port", "0"], env={"PSTRAIN_AUTH_TOKEN": token})
    try:
        req = worker_pb2.ClosureRequest(fn=worker_pb2.FunctionRef(qualified_name="operator:add"),
                                        args=serialization.dumps(((2, 3), {})))
        yield (worker_pb2_grpc.WorkerStub(make_channel(w.address, [], None)),
               (("authorization", f"Bearer {token}"),), req)
    finally:
        w.kill()


def test_a_worker_refuses_closures_whose_layouts_are_not_layouts():
    """ClosureRequest.layouts: a real worker takes a table's layout as the
    servers serve it and refuses anything else before it runs anything."""
    from psserver.contract.keys import BucketMap, layout_json
    with a_worker("layout-token") as (stub, md, req):
        good = layout_json(3, ("a:1", "b:2"), BucketMap.even(2))
        req.layouts.add(name="t", table_id="x", layout=good)
        assert serialization.loads(stub.RunClosure(req, metadata=md, timeout=10).result,
                                   True) == 5
        for bad in ("", "{", "[" * 60000, good.replace('"a:1"', "7"), "x" * 300_000,
                    good.replace('"epoch":3', '"epoch":-1')):
            req.layouts[0].layout = bad
            with pytest.raises(grpc.RpcError) as info:
                stub.RunClosure(req, metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad[:50]
            assert "not one" in info.value.details()
        info = stub.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), metadata=md, timeout=10)
        assert info.closures_run == 1


def test_the_leave_ends_at_the_drain_its_timeout_no_follower_or_a_second_signal(
        monkeypatch, caplog):
    """psserver/serve/leave.Leaving alone, on a registry of stand-in shards."""
    import threading
    import types

    from psserver.serve import leave as L
    shard = types.SimpleNamespace(table_name="t", drained=False, link=None, role=L.ROLE_PRIMARY)
    registry = types.SimpleNamespace(variables=lambda: [], tables=lambda: [shard])
    registry.copies = lambda: registry.variables() + registry.tables()
    monkeypatch.setattr(L, "ASKED_SECONDS", 0.3)

    def left(timeout: float, during=lambda: None, now=None) -> str:
        caplog.clear()
        leave = L.Leaving(registry, timeout)
        t = threading.Thread(target=leave.wait, args=((now or threading.Event()).is_set,))
        t.start()
        _until(lambda: leave.leaving, 10)
        during()
        t.join(30)
        assert not t.is_alive()
        return caplog.text

    assert "drained" in left(30, lambda: setattr(shard, "drained", True))
    shard.drained = False
    assert "not drained within" in left(0.2)
    assert "no coordinator that follows" in left(30)
    now = threading.Event()
    text = left(30, now.set, now)
    assert "drained" not in text and "no coordinator" not in text
    # a variable's copy is held too (a drain moves it)
    shard.drained = True
    var = types.SimpleNamespace(name="v", link=None)
    registry.variables = lambda: [var]
    assert "not drained within" in left(0.2) and "['v']" in caplog.text
    assert "drained" in left(30, lambda: setattr(registry, "variables", lambda: []))
    leave = L.Leaving(registry, 30)
    leave.wait()   # (nothing held: at once)
    assert not leave.leaving
    for link, role in ((object(), L.ROLE_PRIMARY), (None, 1 - L.ROLE_PRIMARY)):
        shard.link, shard.role = link, role   # (a replicated table's primary, or backup)
        caplog.clear()
        leave = L.Leaving(registry, 30)
        leave.wait()   # (not drained: at once)
        assert not leave.leaving and "replicated" in caplog.text
