"""The Cluster (coordinator/cluster.py) without processes: the bounded-staleness
gate and the clocks, the pause, the dataset registry, the membership
bookkeeping, scheduling into the queue, and the queue's ways to end a closure.

Workers are fakes with _WorkerThread's surface (``make_worker``); the strategy
is a fake with the attributes the Cluster reads. Nothing is started unless a
test says so, and every wait is on an event the code under test sets.
"""
from __future__ import annotations

import functools
import threading
import types

import numpy as np
import pytest

from coordinator import cluster as cluster_mod
from coordinator.closures import (
    ABANDONED,
    FINISH_STEPS,
    Closure,
    RemoteValueStatus,
    StepRemoteValue,
    SyncStep,
    _ClosureQueue,
)
from coordinator.cluster import Cluster
from coordinator.errors import ClosureCancelled
from coordinator.sources import ShardedSource
from coordinator.worker_channel import _SharedWorker, _WorkerThread
from protos.pstrain.v1 import worker_pb2
from psserver.contract import SyncSpec

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0   # seconds a test waits for an event that must come


class FakeResolver:
    def __init__(self, workers):
        self.workers = list(workers)

    def cluster_spec(self):
        return types.SimpleNamespace(worker=list(self.workers), ps=["ps0:1"])


class FakeStrategy:
    """What the Cluster reads of a ParameterServerStrategy."""

    def __init__(self, workers=("w0:1", "w1:1"), mode="async", staleness=None, num_replicas=1,
                 steps_done=0):
        self.mode, self.staleness, self.num_replicas = mode, staleness, num_replicas
        self.steps_done = steps_done   # sync steps its servers applied already
        self.token = self.tls = None
        self.replication = False
        self.connect_timeout = 10.0
        self.server_ids: dict[str, str] = {}
        self.cluster_resolver = FakeResolver(workers)

    def sync_spec(self, step, replica):
        return SyncSpec(step, replica, self.num_replicas, self.num_replicas)

    def sync_steps_done(self) -> int:
        return self.steps_done


class FakeWorker:
    """A worker slot with _WorkerThread's constructor and the surface the
    Cluster uses; its clock is shared by its slots, as the real one's."""

    def __init__(self, cluster, address, index, shared, slot):
        self.cluster, self.address, self.index, self.slot = cluster, address, index, slot
        self._shared = shared
        shared.slots.append(self)
        self.alive = True
        self.started = self.stopped = False
        self.checked_stop = threading.Event()   # set each time the queue asks `stopping`

    clock = _WorkerThread.clock
    worker_alive = _WorkerThread.worker_alive

    @property
    def stopping(self) -> bool:
        self.checked_stop.set()
        return self.stopped

    def start(self):
        self.started = True

    def stop(self):
        self.stopped = True
        self.cluster.queue.wake()

    abort = stop

    def join(self, timeout=None):
        pass


def make(strategy=None, **kwargs) -> Cluster:
    """A Cluster over fake workers, its membership read once (no thread started)."""
    c = Cluster(strategy or FakeStrategy(), make_worker=FakeWorker, **kwargs)
    c.membership.refresh()
    return c


def workers(c: Cluster) -> list[FakeWorker]:
    return list(c.membership.workers.values())


def closure(name="c") -> Closure:
    return Closure(worker_pb2.FunctionRef(qualified_name="m:f"), b"", name)


class Taker(threading.Thread):
    """cluster.next_closure(worker) on a thread of its own; ``got`` is what it returned."""

    def __init__(self, c: Cluster, worker):
        super().__init__(daemon=True)
        self.c, self.worker, self.got = c, worker, "nothing yet"

    def run(self):
        self.got = self.c.next_closure(self.worker)


def gate_spy(c: Cluster) -> threading.Event:
    """An event set whenever the cluster's gate says no (the taker then waits)."""
    said_no = threading.Event()
    real = c.may_start

    def may_start(worker):
        ok = real(worker)
        if not ok:
            said_no.set()
        return ok
    c.may_start = may_start
    return said_no


def gated_taker(strategy: FakeStrategy):
    """A bounded cluster (staleness 0) whose fast worker (clock 1, the slow
    one's 0) waits for the closure queued, its gate shut: (cluster, fast,
    slow, the Taker)."""
    c = make(strategy)
    fast, slow = workers(c)
    fast.clock = 1
    said_no = gate_spy(c)
    c.queue.put(closure())
    taker = Taker(c, fast)
    taker.start()
    assert said_no.wait(WAIT)
    assert c.queue.counts() == (1, 0)   # still queued: the gate said no
    return c, fast, slow, taker


def add(a, b):
    return a + b


# -- the gate -------------------------------------------------------------------------------
def test_a_worker_more_than_staleness_ahead_of_the_slowest_live_worker_may_not_start():
    c = make(FakeStrategy(mode="bounded", staleness=1))
    fast, slow = workers(c)
    fast.clock = 2
    assert not c.may_start(fast) and c.may_start(slow)
    fast.clock = 1
    assert c.may_start(fast)
    fast.clock = 3
    slow.alive = False   # a dead worker does not hold the others back
    assert c.min_clock() == 3 and c.may_start(fast)


def test_without_a_bound_every_worker_may_start_until_the_pause():
    c = make()
    fast, slow = workers(c)
    fast.clock = 1000
    assert c.may_start(fast) and not c.paused
    c.pause()
    assert c.paused and not c.may_start(fast) and not c.may_start(slow)
    c.resume()
    assert c.may_start(fast)


def test_min_clock_is_over_live_workers_and_leaves_out_the_one_asking():
    c = make(FakeStrategy(workers=("a:1", "b:1", "c:1")))
    a, b, d = workers(c)
    a.clock, b.clock, d.clock = 5, 3, 7
    assert c.min_clock() == 3 and c.min_clock(exclude=b) == 5
    b.alive = False
    assert c.min_clock() == 5 and c.workers_alive() == 2 and c.num_workers == 3
    assert c.staleness_stats()["clocks"] == {"a:1": 5, "c:1": 7}
    for w in (a, d):
        w.alive = False
    assert c.min_clock() == 0 and c.live_workers() == []


def test_a_worker_ahead_waits_for_the_slowest_then_takes_the_closure():
    c, _, slow, taker = gated_taker(FakeStrategy(mode="bounded", staleness=0))
    slow.clock = 1
    c.clocks_changed()                  # what a worker does when its clock moves
    taker.join(WAIT)
    assert isinstance(taker.got, Closure) and c.queue.counts() == (0, 1)
    assert c.staleness_stats()["max_gap"] == 0


def test_a_queued_closure_goes_to_the_waiting_worker_the_gate_lets_through():
    """Both wait on an empty queue, the one ahead first: the closure must not
    be left queued because the worker woken for it may not take it."""
    c = make(FakeStrategy(mode="bounded", staleness=1))
    fast, slow = workers(c)
    fast.clock = 2
    takers = []
    for w in (fast, slow):
        w.checked_stop.clear()
        t = Taker(c, w)
        t.start()
        assert w.checked_stop.wait(WAIT)   # it holds the queue's lock until it waits
        takers.append(t)
    c.queue.put(closure())
    takers[1].join(WAIT)
    assert isinstance(takers[1].got, Closure)
    assert takers[0].is_alive()           # the fast one still waits: the gate is shut
    fast.stop()
    takers[0].join(WAIT)
    assert takers[0].got is None


def test_the_pause_holds_every_worker_until_resume():
    c = make()
    w = workers(c)[0]
    said_no = gate_spy(c)
    c.pause()
    c.queue.put(closure())
    taker = Taker(c, w)
    taker.start()
    assert said_no.wait(WAIT)
    assert c.queue.counts() == (1, 0)
    c.resume()
    taker.join(WAIT)
    assert isinstance(taker.got, Closure)


def test_a_taker_that_leaves_when_woken_for_a_closure_passes_it_on():
    """Async mode wakes one taker per closure; if that one is stopping, the
    closure must reach the next."""
    c = make()
    leaving, staying = workers(c)
    takers = []
    for w in (leaving, staying):   # the leaving one waits first: the first woken
        w.checked_stop.clear()
        t = Taker(c, w)
        t.start()
        assert w.checked_stop.wait(WAIT)
        takers.append(t)
    leaving.stopped = True   # no wake: the put is what wakes it
    c.queue.put(closure())
    for t in takers:
        t.join(WAIT)
    assert takers[0].got is None and isinstance(takers[1].got, Closure)


def test_a_stopped_worker_thread_stops_waiting_for_a_closure():
    """The real _WorkerThread: stop() (here abort(), which also closes its
    never-used channel) wakes its wait in the queue."""
    c = make()
    w = _WorkerThread(c, "127.0.0.1:1", 99, _SharedWorker(), 0)
    taker = Taker(c, w)
    taker.start()
    w.abort()
    taker.join(WAIT)
    assert taker.got is None and w.stopping


def test_the_largest_gap_is_recorded_when_a_worker_takes_a_closure():
    c = make(FakeStrategy(mode="bounded", staleness=5))
    fast, slow = workers(c)
    fast.clock, slow.clock = 3, 1
    c.queue.put(closure())
    assert c.next_closure(fast) is not None
    assert c.staleness_stats() == {"clocks": {"w0:1": 3, "w1:1": 1}, "max_gap": 2}


def test_wait_for_is_checked_again_when_clocks_change():
    c = make()
    w = workers(c)[0]
    result = []
    checked = threading.Event()

    def ticked():
        checked.set()
        return w.clock >= 1
    t = threading.Thread(target=lambda: result.append(c.wait_for(ticked, 3 * WAIT)),
                         daemon=True)   # (wait_for checks once more at its timeout)
    t.start()
    assert checked.wait(WAIT)   # it holds the lock of wait_for until it waits
    w.clock = 1
    c.clocks_changed()
    t.join(WAIT)
    assert result == [True]
    assert c.wait_for(lambda: False, timeout=0) is False


# -- membership -------------------------------------------------------------------------------
def test_membership_makes_every_slot_of_each_worker_and_starts_them():
    c = make(FakeStrategy(workers=("a:1", "b:1")), closures_per_worker=2)
    m = c.membership
    assert sorted(m.workers) == ["a:1", "b:1"] and all(len(m.extra[a]) == 1 for a in m.workers)
    a0, (a1,) = m.workers["a:1"], m.extra["a:1"]
    assert (a0.slot, a1.slot) == (0, 1) and a0._shared is a1._shared
    assert a0.started and a1.started
    a1.clock = 4   # the slots share one clock (closures of the whole worker)
    assert a0.clock == 4
    a0.alive = False
    assert a0.worker_alive   # another slot answered
    assert c.num_workers == 2


def test_a_worker_added_to_the_spec_is_picked_up_and_one_removed_is_stopped():
    strategy = FakeStrategy(workers=("a:1", "b:1"))
    c = make(strategy)
    a, b = workers(c)
    strategy.cluster_resolver.workers = ["a:1", "c:1"]
    c.membership.refresh()
    assert sorted(c.membership.workers) == ["a:1", "c:1"]
    assert b.stopped and not a.stopped and c.membership.workers["a:1"] is a


def test_a_slow_worker_leaving_the_spec_lets_the_others_go_on():
    strategy = FakeStrategy(mode="bounded", staleness=0)
    c, _, _, taker = gated_taker(strategy)
    checked, seen = threading.Event(), []

    def min_clock_is_one():
        checked.set()
        return c.min_clock() == 1
    waiter = threading.Thread(target=lambda: seen.append(c.wait_for(min_clock_is_one, 3 * WAIT)),
                              daemon=True)   # (wait_for checks once more at its timeout)
    waiter.start()
    assert checked.wait(WAIT)   # it holds the lock of wait_for until it waits
    strategy.cluster_resolver.workers = ["w0:1"]
    c.membership.refresh()   # the slowest left: the gate opens, wait_for hears of it
    taker.join(WAIT)
    waiter.join(WAIT)
    assert isinstance(taker.got, Closure) and seen == [True]


def test_the_worker_count_and_index_come_from_the_spec():
    c = make(FakeStrategy(workers=("a:1", "b:1", "c:1")))
    assert c.worker_count_and_index("c:1") == (3, 2)
    assert c.worker_count_and_index("gone:1") == (3, 0)


@pytest.mark.parametrize("k, mode, match", [
    (0, "async", "from 1 to 3"), (4, "async", "from 1 to 3"), (True, "async", "from 1 to 3"),
    (1.0, "async", "from 1 to 3"), (2, "sync", "needs the strategy's async mode"),
    (2, "bounded", "needs the strategy's async mode")])
def test_closures_per_worker_is_checked(k, mode, match):
    with pytest.raises(ValueError, match=match):
        Cluster(FakeStrategy(mode=mode, staleness=0 if mode == "bounded" else None),
                closures_per_worker=k)


# -- datasets and function references ----------------------------------------------------------
def test_a_per_worker_dataset_is_registered_once_with_its_function():
    c = make()
    ds = c.create_per_worker_dataset(add)
    assert c.datasets() == {ds.dataset_id: c.function_ref(add)}
    c.datasets().clear()   # a copy: the registry is the Cluster's
    assert list(c.datasets()) == [ds.dataset_id]
    other = c.create_per_worker_dataset(add)
    assert other.dataset_id != ds.dataset_id and len(c.datasets()) == 2


def test_a_function_reference_is_made_once_per_function():
    c = make()
    assert c.function_ref(add) is c.function_ref(add)
    assert c.function_ref(add).qualified_name == f"{__name__}:add"
    with pytest.raises(TypeError, match="cannot send .* to the workers"):
        c.function_ref(functools.partial(add, threading.Lock()))   # a lock does not pickle


def test_sharded_datasets_are_checked_before_they_are_registered(monkeypatch):
    c = make()
    source = ShardedSource.from_arrays(np.arange(8), num_shards=2)
    with pytest.raises(TypeError, match="ShardedSource"):
        c.create_sharded_dataset([1, 2], 2, "exactly_once", False)
    with pytest.raises(ValueError, match="batch_size"):
        c.create_sharded_dataset(source, 0, "exactly_once", False)
    with pytest.raises(ValueError, match="visitation"):
        c.create_sharded_dataset(source, 2, "twice", False)
    monkeypatch.setattr(cluster_mod, "_MAX_SOURCE_BYTES", 16)
    with pytest.raises(ValueError, match="pickles to"):
        c.create_sharded_dataset(source, 2, "exactly_once", False)
    assert c.datasets() == {}
    monkeypatch.undo()
    ds = c.create_sharded_dataset(source, 2, "exactly_once", False)
    assert list(c.datasets()) == [ds.dataset_id]
    sync = make(FakeStrategy(mode="sync", num_replicas=2))
    with pytest.raises(ValueError, match="not 'sync'"):
        sync.create_sharded_dataset(source, 2, "exactly_once", False)


# -- scheduling ----------------------------------------------------------------------------------
def test_an_async_step_is_one_closure_and_a_sync_step_one_per_replica():
    c = make()
    rv = c.schedule(add, (1, 2))
    assert c.queue.counts() == (1, 0) and rv.status is RemoteValueStatus.PENDING
    sync = make(FakeStrategy(mode="sync", num_replicas=3))
    step = sync.schedule(add, (1, 2))
    assert isinstance(step, StepRemoteValue) and len(step.replicas) == 3
    taken = [sync.queue.get() for _ in range(3)]
    assert [(t.sync.step, t.sync.replica) for t in taken] == [(0, 0), (0, 1), (0, 2)]
    sync.schedule(add, (1, 2))
    assert sync.queue.get().sync.step == 1
    # a coordinator that restarted on servers that applied 5 steps goes on from step 5
    again = make(FakeStrategy(mode="sync", num_replicas=2, steps_done=5))
    again.schedule(add, (1, 2))
    assert [again.queue.get().sync.step for _ in range(2)] == [5, 5]


def test_schedule_refuses_what_cannot_be_sent_and_a_stopped_cluster():
    c = make()
    with pytest.raises(TypeError, match="cannot send the arguments of add"):
        c.schedule(add, (threading.Lock(), 1))
    assert c.queue.counts() == (0, 0)
    c.stop()   # never started: nothing to join
    assert c.closed
    with pytest.raises(RuntimeError, match="shut down"):
        c.schedule(add, (1, 2))


# -- the queue: how a closure taken from it ends -----------------------------------------------
def test_finish_fail_and_cancel_end_a_closure_in_flight():
    q = _ClosureQueue()
    done, failed, cut, behind = (closure(n) for n in ("done", "failed", "cut", "behind"))
    for c in (done, failed, cut):
        q.put(c)
    taken = [q.get() for _ in range(3)]
    assert taken == [done, failed, cut] and q.counts() == (0, 3)
    q.finish(done, 42)
    q.cancel(cut, ClosureCancelled("cut"))
    assert done.remote_value.fetch() == 42 and q.counts() == (0, 1)
    assert cut.remote_value.status is RemoteValueStatus.CANCELLED and not q.failed
    q.put(behind)
    q.fail(failed, ValueError("boom"))
    assert failed.remote_value.status is RemoteValueStatus.FAILED and q.failed
    assert behind.remote_value.status is RemoteValueStatus.CANCELLED   # queued: cancelled
    with pytest.raises(ValueError, match="boom"):
        q.wait(0)
    assert q.wait(0) and q.done()   # the error is raised once


def test_an_abandoned_replica_finishes_with_the_marker():
    q = _ClosureQueue()
    c = closure()
    q.put(c)
    q.finish(q.get(), ABANDONED)
    assert c.remote_value.status is RemoteValueStatus.READY and q.done()


def test_a_closure_put_back_goes_to_the_front():
    q = _ClosureQueue()
    first, second = closure("first"), closure("second")
    q.put(first)
    q.put(second)
    q.put_back(q.get())
    assert q.get() is first and q.get() is second


# -- the recovery's pause -------------------------------------------------------------------------
def test_a_server_recovery_pauses_dispatching_and_puts_the_closure_back():
    """Without replication: a closure failed on a server that answers again as
    the same process (the network) runs again, and dispatching resumes."""
    strategy = FakeStrategy()
    strategy.server_ids["ps0:1"] = "same"
    c = make(strategy)
    asked, answer = threading.Event(), threading.Event()
    paused_while_asking = []

    def probe(address):
        paused_while_asking.append(c.paused)
        asked.set()
        assert answer.wait(WAIT)
        return types.SimpleNamespace(server_id="same")
    c.ps_watch.probe = probe
    c.queue.put(closure())
    failed = c.queue.get()
    c.recovery.report("ps0:1", failed, "UNAVAILABLE", RuntimeError("lost"))
    assert asked.wait(WAIT)
    assert c.paused and c.recovery.active("ps0:1")
    answer.set()
    c.recovery.wait(WAIT)
    assert paused_while_asking == [True]
    assert not c.paused and not c.recovery.active("ps0:1")
    assert c.queue.counts() == (1, 0) and c.queue.get() is failed   # to be run again


def test_while_an_add_waits_only_the_replicas_of_a_started_step_start():
    """FINISH_STEPS (Cluster.may_start while an add or a drain waits in sync
    and hybrid modes): the other replicas of a step one replica of which was
    taken may start, a new step's may not; the wait ends only once none of a
    started step is queued or in flight."""
    q = _ClosureQueue()
    steps = [SyncStep(0), SyncStep(1)]
    cs = [closure(f"s{t}r{r}") for t in (0, 1) for r in (0, 1)]
    for c, t in zip(cs, (0, 0, 1, 1)):
        c.sync_step = steps[t]
        q.put(c)
    first = q.get()   # (replica 0 of step 0, before the hold)
    assert first is cs[0] and steps[0].started and not steps[1].started
    q.finish(first, 1)
    assert not q.wait_idle(0.05, steps=True)   # (step 0's replica 1 is still queued)
    assert q.wait_idle(0.05)                   # (what the wait was: nothing in flight)
    assert q.get(lambda: FINISH_STEPS) is cs[1]
    assert q._first_for(None, FINISH_STEPS) is None   # (step 1: not started)
    q.finish(cs[1], 2)
    assert q.wait_idle(0.05, steps=True) and q.counts() == (2, 0)
    assert q._first_for(None, False) is None   # (a recovery's pause: none at all)
    assert q.get(lambda: True) is cs[2]


def test_a_sync_steps_replicas_are_queued_together_or_not_at_all():
    """Review 26: replicas queued one at a time on a full queue could leave a
    step part queued, replica 0 run and replica 1 not queued yet: an add's
    wait then ended mid-step. put_together waits for room for all."""
    q = _ClosureQueue(max_size=2)
    tool, r0, r1 = closure("tool"), closure("r0"), closure("r1")
    q.put(tool)
    putter = threading.Thread(target=q.put_together, args=([r0, r1],), daemon=True)
    putter.start()
    putter.join(0.2)
    assert putter.is_alive() and q.counts() == (1, 0)   # (room for one only: none put)
    assert q.get() is tool
    putter.join(WAIT)
    assert not putter.is_alive() and q.counts() == (2, 1)
    assert [q.get(), q.get()] == [r0, r1]
