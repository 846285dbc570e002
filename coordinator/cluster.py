"""The Cluster: what the coordinator's threads share, as TensorFlow's
cluster_coordinator.py has it (its ``Cluster``, between the workers and the
facade). It owns:

* the closure queue (``queue``, coordinator/closures.py), and how a scheduled
  function becomes closures (``schedule``: one, or one per replica in sync and
  hybrid modes);
* the workers (``membership``: one _WorkerThread per worker task and slot,
  coordinator/worker_channel.py), their clocks, and when a worker may take a
  closure (``may_start``, ``next_closure``: no parameter server is being
  recovered, and in bounded mode the worker is at most ``staleness`` steps
  ahead of the slowest live worker);
* the parameter-server watch and recovery (``ps_watch``, ``recovery``,
  coordinator/recovery.py) and the pause the recovery puts on dispatching;
* the datasets every worker makes (``datasets``) and the references of the
  functions sent to the workers (``function_ref``, cached per function).

_WorkerThread, _Membership, _PSWatch and _PSRecovery get the Cluster and use
its public methods and attributes only. ClusterCoordinator
(coordinator/coordinator.py) is the facade users see; its module docstring
states the guarantees.

Construction builds every part and starts no thread; ``start`` starts the
parameter-server watch, then the membership (whose first look at the cluster
spec starts the worker threads), so every thread finds the Cluster whole.
Waits are on conditions, not polls: a worker waits in the queue until a
closure is queued and ``may_start`` holds, and whatever changes what
``may_start`` reads (a clock, a worker's liveness, the pause, a worker
stopping) wakes it (``clocks_changed``, ``resume``, ``queue.wake``).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import socket
import threading
import time
import uuid
import weakref
from typing import Callable

from coordinator import serialization, sharded
from coordinator.closures import (
    FINISH_STEPS,
    Closure,
    RemoteValue,
    StepRemoteValue,
    SyncStep,
    _ClosureQueue,
)
from coordinator.datasets import PerWorkerDataset
from coordinator.errors import WorkerCallError
from coordinator.gang import Gangs
from coordinator.recovery import _PSRecovery, _PSWatch
from coordinator.sharded import ShardedDataset, ShardedSource
from coordinator.strategy import SYNC_MODES
from coordinator.worker_channel import _Membership, _WorkerThread
from protos.pstrain.v1 import worker_pb2
from psserver.errors import Unavailable

#: Largest pickled ShardedSource create_sharded_dataset sends (the workers'
#: gRPC messages are at most 64 MiB; room left for the rest of the call).
_MAX_SOURCE_BYTES = 48 << 20
#: Seconds a tool's call on one worker (ClusterCoordinator.replica_values and
#: the other all-reduce tools) may wait for it by default.
TOOL_SECONDS = 120.0
#: Most closures a worker runs at once: a psworker serves 4 gRPC calls at a
#: time by default (--threads), one left for its other calls; staleness grows
#: with each.
_MAX_CLOSURES_PER_WORKER = 3


def _closures_per_worker(k, mode: str) -> int:
    """k, checked: an int from 1 to _MAX_CLOSURES_PER_WORKER; above 1 in async mode only."""
    try:
        n = None if isinstance(k, bool) else operator.index(k)
    except TypeError:
        n = None
    if n is None or not 1 <= n <= _MAX_CLOSURES_PER_WORKER:
        raise ValueError(f"closures_per_worker must be an int from 1 to "
                         f"{_MAX_CLOSURES_PER_WORKER}, got {k!r}")
    if n > 1 and mode != "async":
        raise ValueError(
            f"closures_per_worker={n} needs the strategy's async mode "
            f"(this one is {mode!r}): sync and hybrid steps are one replica per "
            "worker, and bounded mode counts each worker's steps one at a time; "
            "use closures_per_worker=1")
    return n


def _refuses(address: str, timeout: float) -> bool:
    """Whether a TCP connection to ``address`` is refused (nothing listens
    there: the process is gone) or its name no longer resolves (a deleted
    pod's), not silent or unreachable (a network that may come back)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return False
    except (ConnectionRefusedError, socket.gaierror):
        return True
    except (OSError, ValueError):
        return False

class Cluster:
    """The queue, the workers, the clocks and the recoveries of one
    ClusterCoordinator (its arguments are documented there).

    ``make_worker`` builds the thread of one worker slot, with
    _WorkerThread's arguments (tests pass fakes).
    """

    def __init__(self, strategy, *, closure_timeout: float | None = None,
                 membership_interval: float = 1.0, checkpoint_manager=None,
                 ps_recovery_timeout: float = 300.0, recreate_lost_shards: bool = False,
                 ps_failover_after: float = 3.0, ps_check_interval: float = 1.0,
                 closures_per_worker: int = 1, make_worker: Callable = _WorkerThread):
        self.closures_per_worker = _closures_per_worker(closures_per_worker, strategy.mode)
        if strategy.mode == "allreduce" and closure_timeout is not None:
            raise ValueError(
                "closure_timeout does not apply to all-reduce mode: a step cut off here would "
                "go on running on its workers and apply there; the strategy's step_timeout "
                "bounds a step's all-reduce")
        self.strategy = strategy
        self.closure_timeout = closure_timeout
        self.checkpoint_manager = checkpoint_manager
        self.ps_recovery_timeout = ps_recovery_timeout
        self.recreate_lost_shards = recreate_lost_shards
        self.ps_failover_after = ps_failover_after
        self.closed = False
        # In bounded mode workers differ in whether they may take a closure.
        # (all-reduce mode: a closure is for one worker, so wake them all)
        self.queue = _ClosureQueue(wake_all=strategy.staleness is not None
                                   or strategy.mode == "allreduce")
        # Sync mode's global step counter, from the steps the servers applied
        # already (a restarted coordinator's adopted variables: sync_steps_done)
        # when the first step is scheduled.
        self._steps: itertools.count | None = None
        self.nonce = uuid.uuid4().hex[:12]   # (in all-reduce groups' names: this one's own)
        self.gangs = Gangs(self)
        self._steps_lock = threading.Lock()
        self._datasets: dict[str, worker_pb2.FunctionRef] = {}
        self._fn_refs: "weakref.WeakKeyDictionary[Callable, worker_pb2.FunctionRef]" = \
            weakref.WeakKeyDictionary()
        # Set while a parameter server is being recovered: no closure starts.
        self._paused = threading.Event()
        self._held = 0   # between_steps calls inside: no closure starts either
        # Notified when a clock or a worker's liveness changes, or the pause ends.
        self._changes = threading.Condition()
        self._max_clock_gap = 0
        self._membership_interval = membership_interval
        self._started = False
        self.recovery = _PSRecovery(self)
        self.ps_watch = _PSWatch(self, ps_check_interval)
        self.membership = _Membership(self, make_worker)

    def start(self) -> None:
        """Start the parameter-server watch, then the worker threads."""
        self._started = True
        self.ps_watch.start()
        self.membership.start(self._membership_interval, "ClusterMembership")

    def stop(self, abort: bool = False) -> None:
        """Stop the threads (ClusterCoordinator.shutdown says how); once."""
        if self.closed:
            return
        self.closed = True
        if self._started:
            self.ps_watch.stop()
            self.membership.stop(abort=abort or self.queue.failed)

    # -- closures ------------------------------------------------------------------------
    def schedule(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)``: one closure (a sync step: one per
        replica, combined by a StepRemoteValue). ClusterCoordinator.schedule
        says what it guarantees and raises."""
        if self.closed:
            raise RuntimeError("this ClusterCoordinator was shut down")
        ref = self.function_ref(fn)
        try:
            with sharded.collect_datasets() as found:
                payload = serialization.dumps((tuple(args), dict(kwargs or {})))
        except Exception as exc:
            raise TypeError(f"cannot send the arguments of {_name(fn)} to a worker: "
                            f"{type(exc).__name__}: {exc}") from exc
        if self.strategy.mode == "allreduce":   # (each closure binds its own batches)
            return self.gangs.schedule(ref, payload, _name(fn), tuple(found.values()))
        if found:   # sharded datasets refuse sync modes; their closures bind batches
            closure = Closure(ref, payload, _name(fn), datasets=tuple(found.values()))
            self.queue.put(closure)
            return closure.remote_value
        if self.strategy.mode in SYNC_MODES:
            with self._steps_lock:
                if self._steps is None:
                    self._steps = itertools.count(self.strategy.sync_steps_done())
                step = next(self._steps)
            closures = [Closure(ref, payload, f"{_name(fn)}[step {step} replica {i}]",
                                self.strategy.sync_spec(step, i))
                        for i in range(self.strategy.num_replicas)]
            together = SyncStep(step)   # (an add or a drain lets a started step end)
            for c in closures:
                c.sync_step = together
            self.queue.put_together(closures)
            return StepRemoteValue([c.remote_value for c in closures])
        closure = Closure(ref, payload, _name(fn))
        self.queue.put(closure)
        return closure.remote_value

    def schedule_on(self, address: str, fn: Callable, args: tuple = ()) -> Closure:
        """Queue ``fn(*args)`` for the worker at ``address`` and no other; its
        failure is its RemoteValue's alone (the queue goes on)."""
        closure = Closure(self.function_ref(fn), serialization.dumps((tuple(args), {})),
                          f"{_name(fn)}[on {address}]")
        closure.target, closure.quiet = address, True   # (its failure: the caller's alone)
        self.queue.put(closure)
        return closure

    def run_on(self, address: str, fn: Callable, args: tuple = (),
               timeout: float | None = None, reconnect: float = 0.0):
        """``fn(*args)`` on the worker at ``address`` (after the closures
        queued for it before), its value. Unavailable, at once, if that
        worker is not answering (``reconnect``: unless it reconnects within
        that many seconds before a reconnection fails: a call of it cut
        just now), or if it did not run it within ``timeout``
        (default TOOL_SECONDS; then it is taken off the queue if it had not
        started); a worker's failure to run it is Unavailable too, the
        function's own error its StepFunctionError."""
        worker = self.membership.workers.get(address)
        if worker is not None and not worker.worker_alive and worker.worker_id is not None \
                and not self._reconnects(worker, reconnect):
            raise Unavailable(f"worker {address} is not answering (its last call failed); "
                              "check it, or try again once it is back")
        closure = self.schedule_on(address, fn, args)
        wait = TOOL_SECONDS if timeout is None else timeout
        try:
            return closure.remote_value.fetch(wait)
        except TimeoutError:
            taken = not self.queue.withdraw(closure, f"not run within {wait} s")
            raise Unavailable(f"worker {address} did not {'finish' if taken else 'start'} "
                              f"{closure.name} within {wait} s: it is down or busy") from None
        except WorkerCallError as exc:
            raise Unavailable(str(exc)) from None

    def _reconnects(self, worker, seconds: float) -> bool:
        """Whether ``worker`` answers again within ``seconds``; no more
        waiting once a reconnection of it failed and nothing listens at its
        address any more (a TCP connection refused: its process is gone)."""
        deadline = time.monotonic() + seconds
        failed = worker.connects_failed
        while not worker.worker_alive:
            left = deadline - time.monotonic()
            if left <= 0 or not self.wait_for(
                    lambda: worker.worker_alive or worker.connects_failed > failed, left):
                break
            if not worker.worker_alive:
                failed = worker.connects_failed
                if _refuses(worker.address, min(1.0, left)):
                    break
        return worker.worker_alive

    def next_closure(self, worker) -> Closure | None:
        """Block until ``worker`` may start a closure (``may_start``) and one
        is queued, then take it; None once ``worker.stopping``."""
        closure = self.queue.get(lambda: self.may_start(worker), lambda: worker.stopping,
                                 worker.address)
        if closure is not None:
            gap = worker.clock - self.min_clock()
            with self._changes:
                self._max_clock_gap = max(self._max_clock_gap, gap)
        return closure

    def forget_function_refs(self) -> None:
        """Send functions by value anew from now on (pickled again: what they
        capture changed, a table's layout after a server was added)."""
        self._fn_refs.clear()

    def function_ref(self, fn: Callable) -> worker_pb2.FunctionRef:
        """How ``fn`` travels to the workers (serialization.encode_function),
        made once per function object. Raises TypeError if it cannot."""
        try:
            return self._fn_refs[fn]
        except (KeyError, TypeError):
            pass
        try:
            ref = serialization.encode_function(fn)
        except Exception as exc:
            raise TypeError(f"cannot send {_name(fn)} to the workers: {type(exc).__name__}: "
                            f"{exc}. A step function may capture variables and plain data, "
                            "not the strategy, the coordinator or open connections") from exc
        try:
            self._fn_refs[fn] = ref
        except TypeError:   # not weak-referenceable: just don't cache
            pass
        return ref

    # -- datasets ------------------------------------------------------------------------
    def datasets(self) -> dict[str, worker_pb2.FunctionRef]:
        """Every dataset a worker makes before its first closure: id -> function."""
        return dict(self._datasets)

    def create_per_worker_dataset(self, dataset_fn: Callable) -> PerWorkerDataset:
        """Register ``dataset_fn`` for every worker (ClusterCoordinator's docstring)."""
        ref = self.function_ref(dataset_fn)
        ds_id = _dataset_id()
        self._datasets[ds_id] = ref
        return PerWorkerDataset(ds_id, dataset_fn)

    def create_sharded_dataset(self, source: ShardedSource, batch_size: int, visitation: str,
                               drop_remainder: bool) -> ShardedDataset:
        """Check the arguments, register ``source`` for every worker
        (ClusterCoordinator.create_sharded_dataset says what it raises)."""
        if not isinstance(source, ShardedSource):
            raise TypeError(f"source must be a ShardedSource (ShardedSource.from_arrays, "
                            f".from_generator, or a subclass), got {type(source).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if visitation not in sharded.VISITATIONS:
            raise ValueError(f"visitation must be one of {sharded.VISITATIONS}, "
                             f"got {visitation!r}")
        if not isinstance(drop_remainder, bool):
            raise ValueError(f"drop_remainder must be True or False, got {drop_remainder!r}")
        if self.strategy.mode in SYNC_MODES:
            raise ValueError(
                f"sharded datasets run in async, bounded and allreduce modes, not "
                f"{self.strategy.mode!r}: "
                "there a step is one closure per replica, and a replica whose worker dies is "
                "abandoned rather than re-run, so its batch would be neither trained nor handed "
                "out again; use create_per_worker_dataset")
        ref = self.function_ref(functools.partial(sharded.source_of, source))
        if len(ref.pickled) > _MAX_SOURCE_BYTES:
            raise ValueError(
                f"the source pickles to {len(ref.pickled) / 2**20:.0f} MiB; it travels to each "
                f"worker in one message of at most {_MAX_SOURCE_BYTES >> 20} MiB. Read the "
                "data on the workers instead (ShardedSource.from_generator reading files, or "
                "a ShardedSource subclass)")
        ds_id = _dataset_id()
        dataset = ShardedDataset(ds_id, source, batch_size, visitation, drop_remainder)
        self._datasets[ds_id] = ref
        return dataset

    # -- workers and their clocks --------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return len(self.membership.workers)

    def live_workers(self) -> list:
        """Slot 0 of each worker that answered its last call (any slot did)."""
        return [w for w in list(self.membership.workers.values()) if w.worker_alive]

    def workers_alive(self) -> int:
        return len(self.live_workers())

    def min_clock(self, exclude=None) -> int:
        """The fewest closures completed by a live worker (other than exclude); 0 if none."""
        clocks = [w.clock for w in self.live_workers() if w is not exclude]
        return min(clocks) if clocks else 0

    def may_start(self, worker) -> bool | str:
        """Whether ``worker`` may start a closure now: no parameter server is
        being recovered, no server added or drained (in sync and hybrid
        modes FINISH_STEPS then: only replicas of a step that started), and
        in bounded mode (staleness s) its clock is at most s ahead of the
        slowest live worker's. Reads no lock (the queue calls it under its own)."""
        if self._paused.is_set() or self.gangs.paused:   # (a recovery)
            return False
        if self._held:   # (a move: in sync modes, replicas of a step that started go on)
            return FINISH_STEPS if self.strategy.mode in SYNC_MODES else False
        s = self.strategy.staleness
        return s is None or worker.clock - self.min_clock() <= s

    def clocks_changed(self) -> None:
        """A worker's clock or liveness changed, or a worker left: wake what
        waits on them (``wait_for``; in bounded mode, the workers' gate)."""
        with self._changes:
            self._changes.notify_all()
        if self.strategy.staleness is not None:
            self.queue.wake()

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until ``predicate()`` holds, checked again at each
        ``clocks_changed`` and ``resume``; False if ``timeout`` seconds pass first."""
        with self._changes:
            return self._changes.wait_for(predicate, timeout)

    def staleness_stats(self) -> dict:
        """Clocks (steps completed) per live worker, and the largest gap seen
        between a worker starting a step and the slowest live worker."""
        return {"clocks": {w.address: w.clock for w in self.live_workers()},
                "max_gap": self._max_clock_gap}

    def worker_count_and_index(self, address: str) -> tuple[int, int]:
        """(workers in the cluster spec, address's place among them; 0 if absent)."""
        spec = self.strategy.cluster_resolver.cluster_spec()
        workers = list(spec.worker)
        return len(workers), workers.index(address) if address in workers else 0

    # -- the pause a recovery puts on dispatching ------------------------------------------
    @property
    def paused(self) -> bool:
        """Whether dispatching is paused (a parameter server is being recovered)."""
        return self._paused.is_set()

    def pause(self) -> None:
        """No closure starts until ``resume`` (closures in flight go on)."""
        self._paused.set()

    @contextlib.contextmanager
    def between_steps(self, timeout: float | None):
        """Run the body while no closure runs: none starts, and those in
        flight end first (in sync and hybrid modes, every step that started:
        its other replicas run first, so no step is half gathered on the
        servers), TimeoutError, nothing done, if they do not within
        ``timeout``. A recovery's pause and resume go on meanwhile."""
        with self._steps_lock:
            self._held += 1
        try:
            if not self.queue.wait_idle(timeout, steps=self.strategy.mode in SYNC_MODES):
                raise TimeoutError(f"closures were still running after {timeout}s")
            yield
        finally:
            with self._steps_lock:
                self._held -= 1
            with self._changes:
                self._changes.notify_all()
            self.queue.wake()

    def resume(self) -> None:
        self._paused.clear()
        with self._changes:
            self._changes.notify_all()
        self.queue.wake()


def _dataset_id() -> str:
    return uuid.uuid4().hex[:12]


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
