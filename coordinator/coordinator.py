"""ClusterCoordinator: schedule step closures on workers, get futures back.

The ladder follows TensorFlow's cluster_coordinator.py:

* ``Closure``        one scheduled call: function, arguments, its RemoteValue
                     (coordinator/closures.py, with the futures).
* ``_ClosureQueue``  queued and in-flight closures and the first error
                     (coordinator/closures.py).
* ``_WorkerThread``  one named thread per worker task (per slot:
                     closures_per_worker), feeding it closures
                     (coordinator/worker_channel.py).
* ``_Membership``    keeps the _WorkerThreads of every worker in the cluster
                     spec (coordinator/worker_channel.py).
* ``_PSWatch``, ``_PSRecovery``  parameter-server failures, decided then acted
                     on (coordinator/recovery.py).
* ``ClusterCoordinator`` the small public facade (here).

Guarantees:

* ``schedule`` returns at once. In async and bounded modes a scheduled
  function runs on some worker **at least once**: if its worker dies or
  becomes unreachable mid-run, the closure goes back to the front of the
  queue and runs again elsewhere (or on the same worker when it returns).
  Write steps whose re-run is harmless, as with TensorFlow's
  ParameterServerStrategy.
* In sync and hybrid modes a scheduled step is ``num_replicas_in_sync`` closures, one
  per replica, in the queue together; the step's RemoteValue combines their
  results. A replica whose worker dies is **not** re-run: it is abandoned on
  every parameter server, and the step completes with the replicas that
  pushed (at most once per replica; the step counter never skips or
  repeats while any replica of a step pushes).
* In bounded mode (staleness s) a worker that has completed c steps starts
  another only while c - (the fewest steps completed by a live worker) <= s.
* The first closure that raises puts the coordinator in an error state: the
  closures still queued are cancelled (their ``fetch`` raises
  ``ClosureCancelled``), and the next ``join()`` or ``done()`` raises that
  error once, after which scheduling works again.
* A closure whose arguments hold a sharded dataset's iterator
  (``create_sharded_dataset``) gets its batch when a worker takes it, keeps
  it when re-queued, and acknowledges it when its result comes back;
  exactly-once visitation makes a re-run's pushes carry the same update keys
  (coordinator/sharded.py says what that covers).
* Workers listed in the cluster spec that are not up yet, that restart, or
  that are added to the spec later are picked up within ``membership_interval``
  seconds; they create every per-worker dataset before taking closures. One
  that does not answer for the strategy's ``connect_timeout`` (10 s) is named
  in a warning ("worker 1 at HOST:PORT does not answer ...", with what to
  check), once per outage, and is still waited for.
"""
from __future__ import annotations

import functools
import itertools
import logging
import operator
import threading
import uuid
import weakref
from typing import Callable

from coordinator import metrics as _metrics
from coordinator import serialization
from coordinator import sharded
from coordinator.datasets import PerWorkerDataset
from coordinator.sharded import ShardedDataset, ShardedSource
from coordinator.recovery import _PSRecovery, _PSWatch
from coordinator.strategy import SYNC_MODES, ParameterServerStrategy
from coordinator.closures import (ABANDONED, Closure, RemoteValue,  # noqa: F401  (re-exported)
                                  RemoteValueStatus, StepRemoteValue, _ClosureQueue)
from coordinator.worker_channel import _Membership, _WorkerThread
from protos.pstrain.v1 import worker_pb2
from psserver.server import call_metadata

log = logging.getLogger("coordinator")

#: Largest pickled ShardedSource create_sharded_dataset sends (the workers'
#: gRPC messages are at most 64 MiB; room left for the rest of the call).
_MAX_SOURCE_BYTES = 48 << 20
#: Most closures a worker runs at once: a psworker serves 4 gRPC calls at a
#: time by default (--threads), one left for its other calls; staleness grows
#: with each.
_MAX_CLOSURES_PER_WORKER = 3


# -- the facade ----------------------------------------------------------------------
class ClusterCoordinator:
    """Schedules functions on the workers of ``strategy``'s cluster.

    Args:
      strategy: the ParameterServerStrategy whose variables the steps use.
      closure_timeout: deadline in seconds of one closure on a worker; past it
        the worker counts as failed and the closure is re-queued (None: none).
      membership_interval: seconds between looks at the cluster spec for
        workers that joined or left.
      checkpoint_manager: a coordinator.checkpoint.CheckpointManager. Without
        replication, when a parameter server is away the coordinator pauses,
        waits for it (saying so every 30 s), and, if it restarted empty,
        restores its shards from the manager's latest checkpoint. Async and
        bounded modes; in sync and hybrid modes the step fails. (coordinator/recovery.py)
      ps_recovery_timeout: how long to wait for such a server (seconds).
      recreate_lost_shards: without replication or a checkpoint, a server that
        restarted empty stops the job with ParameterServerLost (its shards'
        state is gone); True re-creates them from their initializers instead.
      ps_failover_after: with ``replication=True``, seconds a parameter server
        may not answer before its shards fail over to their backups
        (training goes on meanwhile; a server that restarted fails over at once).
      ps_check_interval: seconds between looks at every parameter server's
        identity: one that restarted (or stopped answering) is recovered even
        while no step has failed on it yet (steps resend their calls
        meanwhile, see coordinator.variables).
      closures_per_worker: k, closures each worker runs at once, 1 to 3
        (async mode only). 1, as TensorFlow's ClusterCoordinator: a worker
        runs one closure, then gets the next. With 2, a worker computes one
        step while another waits on the network (its reads and pushes),
        which keeps the cores busy when the cluster's links are slow
        relative to its compute. The price is staleness: about ``workers x
        k`` steps run at once instead of ``workers``, so a step typically
        misses that many more concurrent updates (async mode bounds nothing;
        bounded mode, which does, takes k = 1). The step function runs in k
        threads of the worker at once: what it reads and pushes
        (read_variables, push_gradients, dynamic tables) and per-worker
        dataset iterators are safe for that; state of its own must be too.
        A closure's time on the worker includes sharing it with the others
        (``closure_timeout``). psworker serves 4 gRPC calls at once
        (``--threads``): keep it above k where closures go over gRPC.

    Use as a context manager, or call ``shutdown()``, to stop its threads.
    """

    def __init__(self, strategy: ParameterServerStrategy, *,
                 closure_timeout: float | None = None, membership_interval: float = 1.0,
                 checkpoint_manager=None, ps_recovery_timeout: float = 300.0,
                 recreate_lost_shards: bool = False, ps_failover_after: float = 3.0,
                 ps_check_interval: float = 1.0, closures_per_worker: int = 1):
        try:
            k = None if isinstance(closures_per_worker, bool) else operator.index(
                closures_per_worker)
        except TypeError:
            k = None
        if k is None or not 1 <= k <= _MAX_CLOSURES_PER_WORKER:
            raise ValueError(f"closures_per_worker must be an int from 1 to "
                             f"{_MAX_CLOSURES_PER_WORKER}, got {closures_per_worker!r}")
        closures_per_worker = k
        if closures_per_worker > 1 and strategy.mode != "async":
            raise ValueError(
                f"closures_per_worker={closures_per_worker} needs the strategy's async mode "
                f"(this one is {strategy.mode!r}): sync and hybrid steps are one replica per "
                "worker, and bounded mode counts each worker's steps one at a time; "
                "use closures_per_worker=1")
        self.closures_per_worker = closures_per_worker
        self.strategy = strategy
        self.closure_timeout = closure_timeout
        self.checkpoint_manager = checkpoint_manager
        self.ps_recovery_timeout = ps_recovery_timeout
        self.recreate_lost_shards = recreate_lost_shards
        self.ps_failover_after = ps_failover_after
        # Set while a parameter server is being recovered: no closure starts.
        self._paused = threading.Event()
        self._recovery = _PSRecovery(self)
        self._ps_watch = _PSWatch(self, ps_check_interval)
        self._metadata = call_metadata(strategy.token)
        self._queue = _ClosureQueue()
        self._datasets: dict[str, worker_pb2.FunctionRef] = {}
        self._fn_refs: "weakref.WeakKeyDictionary[Callable, worker_pb2.FunctionRef]" = weakref.WeakKeyDictionary()
        self._steps = itertools.count()   # sync mode's global step counter
        # Bounded mode: signalled when a worker's clock or liveness changes.
        self._clock_cond = threading.Condition()
        self._max_clock_gap = 0
        self._membership = _Membership(self, membership_interval)
        self._closed = False
        _metrics.track(self)   # the gauges; serves metrics if $PSTRAIN_METRICS_PORT says

    # -- public API --------------------------------------------------------------
    def schedule(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on a worker; return its RemoteValue.

        Returns at once (blocks only while the queue is full). Arguments are
        pickled now; a ``PerWorkerIterator`` among them becomes the running
        worker's own iterator. Runs at least once (see the module docstring).
        Raises TypeError if fn or its arguments cannot be sent.
        """
        if self._closed:
            raise RuntimeError("this ClusterCoordinator was shut down")
        ref = self._function_ref(fn)
        try:
            with sharded.collect_datasets() as found:
                payload = serialization.dumps((tuple(args), dict(kwargs or {})))
        except Exception as exc:
            raise TypeError(f"cannot send the arguments of {_name(fn)} to a worker: "
                            f"{type(exc).__name__}: {exc}") from exc
        if found:   # sharded datasets refuse sync modes; their closures bind batches
            closure = Closure(ref, payload, _name(fn), datasets=tuple(found.values()))
            self._queue.put(closure)
            return closure.remote_value
        if self.strategy.mode in SYNC_MODES:
            step = next(self._steps)
            closures = [Closure(ref, payload, f"{_name(fn)}[step {step} replica {i}]",
                                self.strategy.sync_spec(step, i))
                        for i in range(self.strategy.num_replicas)]
            for c in closures:
                self._queue.put(c)
            return StepRemoteValue([c.remote_value for c in closures])
        closure = Closure(ref, payload, _name(fn))
        self._queue.put(closure)
        return closure.remote_value

    def join(self, timeout: float | None = None) -> None:
        """Block until every scheduled function has finished.

        Raises the first error a closure raised (StepFunctionError with the
        worker's traceback, or WorkerCallError), once. TimeoutError if
        ``timeout`` seconds pass first.
        """
        if not self._queue.wait(timeout):
            raise TimeoutError(f"scheduled closures still running after {timeout}s")
        self._recovery.wait(timeout)   # a server being restored is not done yet

    def done(self) -> bool:
        """Whether all scheduled functions finished (raises a pending error)."""
        return self._queue.done()

    def fetch(self, values):
        """Fetch a RemoteValue, or a list/tuple/dict of them (structure kept)."""
        if isinstance(values, RemoteValue):
            return values.fetch()
        if isinstance(values, (list, tuple)):
            return type(values)(self.fetch(v) for v in values)
        if isinstance(values, dict):
            return {k: self.fetch(v) for k, v in values.items()}
        return values

    def create_per_worker_dataset(self, dataset_fn: Callable) -> PerWorkerDataset:
        """Make ``dataset_fn()`` (or ``dataset_fn(input_context)``) on every worker.

        Workers that start or restart later create it before their first closure.
        """
        ds_id = uuid.uuid4().hex[:12]
        self._datasets[ds_id] = self._function_ref(dataset_fn)
        return PerWorkerDataset(ds_id, dataset_fn)

    def create_sharded_dataset(self, source: ShardedSource, batch_size: int, *,
                               visitation: str = "exactly_once",
                               drop_remainder: bool = False) -> ShardedDataset:
        """A dataset whose batches the coordinator hands out: ``source`` (a
        ShardedSource) goes to every worker once (and to workers that start
        or restart later, before their first closure); each closure that
        takes ``iter(dataset)`` as an argument gets one batch when a worker
        takes it. ``visitation``: "exactly_once" (async and bounded modes)
        or "at_least_once"; see coordinator/sharded.py for what each
        guarantees. Raises ValueError for a bad argument, in sync or hybrid mode, or
        for a source too large to send (over 48 MiB pickled: read it on
        the workers instead, e.g. ShardedSource.from_generator)."""
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
                f"sharded datasets run in async and bounded modes, not {self.strategy.mode!r}: "
                "there a step is one closure per replica, and a replica whose worker dies is "
                "abandoned rather than re-run, so its batch would be neither trained nor handed "
                "out again; use create_per_worker_dataset")
        ref = self._function_ref(functools.partial(sharded.source_of, source))
        if len(ref.pickled) > _MAX_SOURCE_BYTES:
            raise ValueError(
                f"the source pickles to {len(ref.pickled) / 2**20:.0f} MiB; it travels to each "
                f"worker in one message of at most {_MAX_SOURCE_BYTES >> 20} MiB. Read the "
                "data on the workers instead (ShardedSource.from_generator reading files, or "
                "a ShardedSource subclass)")
        ds_id = uuid.uuid4().hex[:12]
        dataset = ShardedDataset(ds_id, source, batch_size, visitation, drop_remainder)
        self._datasets[ds_id] = ref
        return dataset

    @property
    def num_workers(self) -> int:
        return len(self._membership.workers)

    def workers_alive(self) -> int:
        return sum(w.worker_alive for w in list(self._membership.workers.values()))

    def pending(self) -> tuple[int, int]:
        """(queued, in flight) closures."""
        return self._queue.counts()

    def shutdown(self, abort: bool = False) -> None:
        """Stop the worker threads. Closures in flight finish first, unless the
        job failed (a closure raised, or a parameter server was lost) or
        ``abort``: then their calls are cut off (their closures end
        CANCELLED, not re-queued), and the coordinator does not wait for
        steps that may be retrying against a lost server."""
        if not self._closed:
            self._closed = True
            self._ps_watch.stop()
            self._membership.stop(abort=abort or self._queue.failed)

    def __enter__(self) -> "ClusterCoordinator":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Shut down; a block left by KeyboardInterrupt (Ctrl-C) or another
        exception that is not an error of the job (SystemExit...) cuts the
        closures in flight instead of waiting for them."""
        self.shutdown(abort=exc_type is not None and not issubclass(exc_type, Exception))

    # -- internals -------------------------------------------------------------------
    def _function_ref(self, fn: Callable) -> worker_pb2.FunctionRef:
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

    # -- bounded staleness ----------------------------------------------------------
    def _live(self):
        return [w for w in list(self._membership.workers.values()) if w.worker_alive] \
            if hasattr(self, "_membership") else []

    def _min_clock(self, exclude=None) -> int:
        clocks = [w.clock for w in self._live() if w is not exclude]
        return min(clocks) if clocks else 0

    def _clocks_changed(self) -> None:
        with self._clock_cond:
            self._clock_cond.notify_all()

    def _may_start(self, worker: _WorkerThread) -> bool:
        """Wait (briefly) while a parameter server is being recovered, and in
        bounded mode until worker is within the bound."""
        if self._paused.is_set():
            with self._clock_cond:
                self._clock_cond.wait(0.2)
            return False
        s = self.strategy.staleness
        if s is None:
            return True
        with self._clock_cond:
            return self._clock_cond.wait_for(
                lambda: worker.clock - self._min_clock() <= s, timeout=0.2)

    def _record_start(self, worker: _WorkerThread) -> None:
        gap = worker.clock - self._min_clock()
        with self._clock_cond:
            self._max_clock_gap = max(self._max_clock_gap, gap)

    def staleness_stats(self) -> dict:
        """Clocks (steps completed) per live worker, and the largest gap seen
        between a worker starting a step and the slowest live worker."""
        return {"clocks": {w.address: w.clock for w in self._live()},
                "max_gap": self._max_clock_gap}

    def _worker_count_and_index(self, address: str) -> tuple[int, int]:
        spec = self.strategy.cluster_resolver.cluster_spec()
        workers = list(spec.worker)
        return len(workers), workers.index(address) if address in workers else 0


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
