"""Closures and their futures, as TensorFlow's cluster_coordinator.py has them.

* ``RemoteValue`` / ``StepRemoteValue``  what ``schedule`` returns (a sync step's
  combines its replicas' results).
* ``Closure``        one scheduled call: function, arguments, its RemoteValue.
* ``_ClosureQueue``  queued and in-flight closures and the first error; its
  ``finish``, ``fail`` and ``cancel`` end a closure taken from it (they set
  its RemoteValue and take it off the closures in flight, together).
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
import threading
import time
from typing import Any, Callable

from coordinator import layouts, placement
from coordinator import metrics as _metrics
from coordinator.errors import ClosureCancelled
from coordinator.replica import CollectiveSpec
from protos.pstrain.v1 import ps_pb2, worker_pb2
from psserver.contract import SyncSpec

log = logging.getLogger("coordinator")

#: Bound on queued closures: ``schedule`` blocks beyond it, so a fast loop of
#: schedule() calls cannot hold unbounded arguments in memory (TF uses 256 per
#: worker for the same reason).
_CLOSURE_QUEUE_MAX_SIZE = 256 * 8


# -- futures -------------------------------------------------------------------------
class RemoteValueStatus(enum.Enum):
    """PENDING -> READY (value set) | FAILED (error set) | CANCELLED."""
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RemoteValue:
    """The future result of a scheduled function.

    Users read it (``status``, ``done``, ``fetch``). ``set_value`` and
    ``set_error`` are the producer's side, as ``set_result`` is for a
    concurrent.futures.Future: the closure queue calls them, once.
    ``on_done`` is called with whether a result came back, before fetch()
    sees the end (a closure's sharded-dataset batches are acknowledged or
    given back).
    """

    def __init__(self, on_done: Callable[[bool], None] | None = None):
        self._done = threading.Event()   # set once, on leaving PENDING
        self._status = RemoteValueStatus.PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._on_done = on_done

    @property
    def status(self) -> RemoteValueStatus:
        return self._status

    def set_value(self, value) -> None:
        """PENDING -> READY with value (``ABANDONED``: a sync replica given up)."""
        if self._on_done is not None:
            self._on_done(value is not ABANDONED)
        self._value, self._status = value, RemoteValueStatus.READY
        self._done.set()
        _metrics.closure_result(abandoned=value is ABANDONED)

    def set_error(self, error: BaseException, cancelled: bool = False) -> None:
        """PENDING -> FAILED (or CANCELLED) with error, which fetch() raises."""
        if self._on_done is not None:
            self._on_done(False)
        self._error = error
        self._status = RemoteValueStatus.CANCELLED if cancelled else RemoteValueStatus.FAILED
        self._done.set()
        _metrics.closure_error(error, cancelled)

    def fetch(self, timeout: float | None = None):
        """Block until the function has run; return its value or raise its error.

        Raises StepFunctionError, ClosureCancelled, WorkerCallError, or
        TimeoutError when ``timeout`` seconds pass first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the closure did not finish within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return self._done.is_set()


#: The value of a sync replica that was abandoned (its worker died).
ABANDONED = object()


def reduce_mean(values: list):
    """Mean of numbers or arrays, per key for dicts; other values as a list."""
    if not values:
        return None
    first = values[0]
    if isinstance(first, dict):
        return {k: reduce_mean([v[k] for v in values]) for k in first}
    try:
        import numpy as np
        out = np.mean(np.stack([np.asarray(v, dtype=float) for v in values]), axis=0)
        return float(out) if out.ndim == 0 else out
    except (TypeError, ValueError):
        return list(values)


class StepRemoteValue(RemoteValue):
    """The future of a sync step: done when all its replicas are.

    ``fetch()`` returns the mean of the replicas' results (numbers, arrays,
    or dicts of them, per key; other results as a list), over the replicas
    that ran; None if every replica was abandoned. It raises the first
    replica error. ``replicas`` holds the per-replica RemoteValues.
    """

    def __init__(self, replicas: list[RemoteValue]):
        super().__init__()
        self.replicas = replicas

    @property
    def status(self) -> RemoteValueStatus:
        states = [r.status for r in self.replicas]
        for st in (RemoteValueStatus.FAILED, RemoteValueStatus.CANCELLED, RemoteValueStatus.PENDING):
            if st in states:
                return st
        return RemoteValueStatus.READY

    def done(self) -> bool:
        return all(r.done() for r in self.replicas)

    def fetch(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        values = []
        for r in self.replicas:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            values.append(r.fetch(left))
        return reduce_mean([v for v in values if v is not ABANDONED])


#: What Cluster.may_start answers while an add or a drain waits for the
#: steps to end in sync and hybrid modes: no closure starts but the
#: replicas of a sync step another replica of which started (the step
#: ends whole before the servers change: _ClosureQueue._first_for).
FINISH_STEPS = "finish-steps"


class SyncStep:
    """The closures of one sync or hybrid step: whether one was taken."""
    __slots__ = ("step", "started")

    def __init__(self, step: int):
        self.step, self.started = step, False


class Closure:
    """``datasets``: the sharded datasets (coordinator/sharded.py) whose
    iterators the arguments hold. Each binds a batch to the closure when a
    worker's thread takes it (``bind``), the first time; the closure keeps
    it when re-queued, and acknowledges it when its result comes back or
    gives it back when it ends otherwise."""

    _ids = itertools.count()

    def __init__(self, fn_ref: worker_pb2.FunctionRef, args_payload: bytes, name: str,
                 sync: SyncSpec | None = None, datasets: tuple = (),
                 collective: CollectiveSpec | None = None):
        self.closure_id = f"{next(self._ids)}"
        self.fn_ref, self.args_payload, self.name = fn_ref, args_payload, name
        self.sync = sync
        # All-reduce mode: the step's group; the closure runs on its member
        # of this rank and no other worker (``target``).
        self.collective = collective
        self.target = None if collective is None else collective.members[collective.rank]
        self.quiet = False   # a failure is its caller's alone (ClusterCoordinator's tools)
        self.gang = None     # all-reduce mode: its step (coordinator/gang.py)
        self.sync_step: SyncStep | None = None   # sync and hybrid modes: its step's closures
        self.remote_value = RemoteValue(self.settle_batches if datasets else None)
        self.attempts = 0
        self.datasets = datasets
        self.batches: dict = {}   # dataset_id -> its Batch, once bound

    def bind(self, worker: str) -> None:
        """Taken by ``worker``'s thread: bind a batch of each sharded dataset
        (or, re-queued, run the bound one again)."""
        for ds in self.datasets:
            b = self.batches.get(ds.dataset_id)
            if b is None:
                self.batches[ds.dataset_id] = ds.take(worker)
            else:
                ds.again(b, worker)

    def settle_batches(self, ok: bool) -> None:
        """Acknowledge the bound batches (``ok``: trained) or give them back.
        Called as the RemoteValue is set; an all-reduce step's closures
        (whose RemoteValues are the step's) by coordinator/gang.py."""
        for ds in self.datasets:
            b = self.batches.get(ds.dataset_id)
            if b is not None:
                ds.ack(b) if ok else ds.release(b)

    def request(self, worker_id: str, digest_only: bool = False) -> worker_pb2.ClosureRequest:
        """The RunClosure request; ``digest_only``: the function by its digest
        alone (the worker process was sent it by value before)."""
        fn = worker_pb2.FunctionRef(digest=self.fn_ref.digest) if digest_only else self.fn_ref
        req = worker_pb2.ClosureRequest(closure_id=self.closure_id, fn=fn,
                                        args=self.args_payload, worker_id=worker_id)
        if self.sync is not None:
            req.sync.CopyFrom(ps_pb2.SyncInfo(**dataclasses.asdict(self.sync)))
        if self.collective is not None:
            req.collective.CopyFrom(worker_pb2.CollectiveInfo(**self.collective.message()))
        for ds in self.datasets:
            req.batches.append(ds.assignment(self.batches[ds.dataset_id]))
        for name, table_id, layout in layouts.known():   # (tables whose buckets moved)
            req.layouts.add(name=name, table_id=table_id, layout=layout)
        for made_at, name, address in placement.known():   # (variable shards a drain moved)
            req.moved.add(made_at=made_at, name=name, address=address)
        return req


# -- the queue -------------------------------------------------------------------------
def _always() -> bool:
    return True


def _never() -> bool:
    return False


class _ClosureQueue:
    """Queued closures, the count of those in flight, and the first error.

    ``wake_all``: whether takers differ in what they may take (bounded
    staleness: a worker ahead may not take while a slower one may), so that a
    closure queued wakes every waiting taker rather than one.
    """

    def __init__(self, max_size: int = _CLOSURE_QUEUE_MAX_SIZE, wake_all: bool = False):
        self._lock = threading.Lock()
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self.failed = False   # a closure failed at some time (sticky, unlike _error)
        self._max_size = max_size
        self._wake_all = wake_all
        # Signalled when a closure is queued, or what a taker waits for may
        # have changed (wake): workers wait on it.
        self._closures_queued = threading.Condition(self._lock)
        # Signalled when the queue has room again (schedule waits on it).
        self._free_slot = threading.Condition(self._lock)
        # Signalled when queued+inflight may have reached 0 or an error arrived (join).
        self._stop_waiting = threading.Condition(self._lock)

    def put(self, closure: Closure, wait: bool = True) -> None:
        """Queue a closure, waiting while the queue is full (``wait``: else
        at once, past the bound: all-reduce recovery issuing steps again)."""
        with self._lock:
            if wait:
                self._free_slot.wait_for(lambda: len(self._queue) < self._max_size)
            self._queue.append(closure)
            self._queued_locked()
        _metrics.CLOSURES_SCHEDULED.inc()

    def put_together(self, closures: list[Closure]) -> None:
        """Queue a sync step's closures at once, waiting while the queue has
        no room for all (a step's replicas are never part queued: an add's
        pause between whole steps counts on it, Cluster.between_steps)."""
        with self._lock:
            room = max(self._max_size - len(closures), 0)
            self._free_slot.wait_for(lambda: len(self._queue) <= room)
            self._queue.extend(closures)
            for _ in closures:
                self._queued_locked()
        _metrics.CLOSURES_SCHEDULED.inc(len(closures))

    def _queued_locked(self) -> None:
        if self._wake_all:
            self._closures_queued.notify_all()
        else:
            self._closures_queued.notify()

    def get(self, may_take: Callable[[], bool] = _always,
            give_up: Callable[[], bool] = _never, taker: str | None = None) -> Closure | None:
        """Take the first queued closure (in flight from now on) once one is
        queued and ``may_take()`` holds; None as soon as ``give_up()`` holds.
        A closure with a ``target`` (all-reduce mode) goes to the taker of
        that address only.

        Blocks without polling: whoever changes what ``may_take`` or
        ``give_up`` reads calls ``wake``. Both are called with the queue's
        lock held, so they must not take locks of their own.
        """
        with self._lock:
            while not give_up():
                at = self._first_for(taker, may_take()) if self._queue else None
                if at is not None:
                    closure = self._queue[at]
                    del self._queue[at]
                    if closure.gang is not None:   # (its other members may run in a pause)
                        closure.gang.started = True
                    if closure.sync_step is not None:   # (its other replicas: FINISH_STEPS)
                        closure.sync_step.started = True
                    self._inflight += 1
                    self._free_slot.notify()
                    return closure
                self._closures_queued.wait()
            if self._queue:   # a put may have woken this taker, which leaves: pass it on
                self._queued_locked()
            return None

    def _first_for(self, taker: str | None, may: bool) -> int | None:
        """The first closure ``taker`` may take: any of its own while it may
        start closures; while it may not (a pause), a tool's, or one of an
        all-reduce step whose other members started (they wait for it), or
        with ``may`` FINISH_STEPS one of a sync step another replica of which
        started."""
        finishing, may = may == FINISH_STEPS, may is True
        for i, c in enumerate(self._queue):
            if (c.target is None or c.target == taker) and (
                    may or c.quiet or (c.gang is not None and c.gang.started) or
                    (finishing and c.sync_step is not None and c.sync_step.started)):
                return i
        return None

    def wake(self) -> None:
        """Make every waiting taker check its ``may_take``/``give_up`` again."""
        with self._lock:
            self._closures_queued.notify_all()

    def take_out(self, which: Callable[[Closure], bool]) -> list[Closure]:
        """Take the queued closures ``which`` holds for off the queue, in
        order, their RemoteValues untouched (all-reduce recovery issues
        them again)."""
        with self._lock:
            out = [c for c in self._queue if which(c)]
            for c in out:
                self._queue.remove(c)
            self._free_slot.notify_all()
            return out

    def release(self, closure: Closure) -> None:
        """An in-flight closure ends without a result of its own (all-reduce
        recovery: another closure was issued for it, or it was given up)."""
        self._mark_finished()

    def withdraw(self, closure: Closure, why: str) -> bool:
        """Take a closure off the queue if no worker has taken it yet: it
        ends CANCELLED (``why``); False if it was taken already."""
        with self._lock:
            try:
                self._queue.remove(closure)
            except ValueError:
                return False
            self._free_slot.notify()
            if not self._queue and self._inflight == 0:
                self._stop_waiting.notify_all()
        closure.remote_value.set_error(ClosureCancelled(f"closure {closure.name}: {why}"), True)
        return True

    def put_back(self, closure: Closure) -> None:
        """Re-queue an in-flight closure whose worker failed (at the front)."""
        with self._lock:
            self._inflight -= 1
            if self._error is not None:
                closure.remote_value.set_error(ClosureCancelled(
                    f"closure {closure.name} cancelled: an earlier closure failed"), True)
                self._stop_waiting.notify_all()
            else:
                self._queue.appendleft(closure)
                self._queued_locked()
                _metrics.CLOSURES_RETRIED.inc()
            if self._inflight == 0:
                self._stop_waiting.notify_all()

    def finish(self, closure: Closure, value) -> None:
        """An in-flight closure's result came back (``ABANDONED``: a sync
        replica given up): its RemoteValue gets it, and it is done."""
        closure.remote_value.set_value(value)
        self._mark_finished()

    def fail(self, closure: Closure, error: BaseException) -> None:
        """An in-flight closure failed with ``error``: its RemoteValue raises
        it, and the queue takes the error state (``_mark_failed``), but for
        a ``quiet`` closure (a tool's: its caller alone hears of it)."""
        closure.remote_value.set_error(error)
        if closure.quiet:
            self._mark_finished()
        else:
            self._mark_failed(error)

    def cancel(self, closure: Closure, error: BaseException) -> None:
        """An in-flight closure is given up without a result (the
        coordinator shut down after a failure): CANCELLED with ``error``,
        and done; the queue takes no error state."""
        closure.remote_value.set_error(error, cancelled=True)
        self._mark_finished()

    def _mark_finished(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:   # what wait() and wait_idle() wait for: a join
                self._stop_waiting.notify_all()   # wakes once, not per closure

    def _mark_failed(self, error: BaseException) -> None:
        """A closure failed: keep the first error, cancel everything queued."""
        with self._lock:
            self._inflight -= 1
            self.failed = True
            if self._error is None:
                self._error = error
            while self._queue:
                c = self._queue.popleft()
                c.remote_value.set_error(ClosureCancelled(
                    f"closure {c.name} cancelled: an earlier closure failed with "
                    f"{type(error).__name__}"), True)
            self._free_slot.notify_all()
            self._stop_waiting.notify_all()

    def mark_failed_external(self, error: BaseException) -> None:
        """An error outside any closure (a server that never came back)."""
        with self._lock:
            self._inflight += 1
        self._mark_failed(error)

    def _raise_error_locked(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or in flight; raise the first error."""
        with self._lock:
            ok = self._stop_waiting.wait_for(
                lambda: self._error is not None or (not self._queue and self._inflight == 0),
                timeout)
            self._raise_error_locked()
            return ok

    def wait_idle(self, timeout: float | None = None, steps: bool = False) -> bool:
        """Block until no closure is in flight (queued ones may wait: while
        none may start; ``steps``: and none of a sync step that started is
        queued); whether that happened within ``timeout``."""
        def idle() -> bool:
            return self._inflight == 0 and not (steps and any(
                c.sync_step is not None and c.sync_step.started for c in self._queue))
        with self._lock:
            return self._stop_waiting.wait_for(idle, timeout)

    def done(self) -> bool:
        with self._lock:
            self._raise_error_locked()
            return not self._queue and self._inflight == 0

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return len(self._queue), self._inflight
