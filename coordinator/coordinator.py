"""ClusterCoordinator: schedule step closures on workers, get futures back.

The ladder follows TensorFlow's cluster_coordinator.py:

* ``Closure``        one scheduled call: function, arguments, its RemoteValue.
* ``_ClosureQueue``  queued and in-flight closures and the first error.
* ``_WorkerThread``  one named thread per worker task, feeding it closures.
* ``_Membership``    keeps one _WorkerThread per worker in the cluster spec.
* ``ClusterCoordinator`` the small public facade.

Guarantees:

* ``schedule`` returns at once. In async and bounded modes a scheduled
  function runs on some worker **at least once**: if its worker dies or
  becomes unreachable mid-run, the closure goes back to the front of the
  queue and runs again elsewhere (or on the same worker when it returns).
  Write steps whose re-run is harmless, as with TensorFlow's
  ParameterServerStrategy.
* In sync mode a scheduled step is ``num_replicas_in_sync`` closures, one
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
* Workers listed in the cluster spec that are not up yet, that restart, or
  that are added to the spec later are picked up within ``membership_interval``
  seconds; they create every per-worker dataset before taking closures.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
import threading
import time
import uuid
import weakref
from typing import Any, Callable

import grpc

from coordinator import metrics as _metrics
from coordinator import serialization
from coordinator.datasets import PerWorkerDataset
from coordinator.errors import (ClosureCancelled, CoordinatorError, ParameterServerLost,
                                StepFunctionError, WorkerCallError)
from coordinator.recovery import _PSRecovery, _PSWatch
from coordinator.strategy import ParameterServerStrategy
from protos.pstrain.v1 import ps_pb2, worker_pb2, worker_pb2_grpc
from psserver import ipc, methods, routing
from psserver.contract import Code
from psserver.errors import PSError, from_rpc_error
from psserver.contract import SyncSpec
from psserver.tls import make_channel
from psserver.server import call_metadata, grpc_options
from psserver.servicer import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger("coordinator")

#: Bound on queued closures: ``schedule`` blocks beyond it, so a fast loop of
#: schedule() calls cannot hold unbounded arguments in memory (TF uses 256 per
#: worker for the same reason).
_CLOSURE_QUEUE_MAX_SIZE = 256 * 8
#: gRPC codes that mean "the worker is gone, unreachable, or restarted" (ABORTED:
#: the fencing worker_id did not match), not "the step failed": the closure is
#: re-queued and the worker reconnected.
_WORKER_FAILURE_CODES = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED, Code.ABORTED)
#: Deadline of the calls that check a worker is up and create its datasets.
_CONTROL_TIMEOUT = 30.0


# -- futures -------------------------------------------------------------------------
class RemoteValueStatus(enum.Enum):
    """PENDING -> READY (value set) | FAILED (error set) | CANCELLED."""
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RemoteValue:
    """The future result of a scheduled function."""

    def __init__(self):
        self._done = threading.Event()   # set once, on leaving PENDING
        self._status = RemoteValueStatus.PENDING
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def status(self) -> RemoteValueStatus:
        return self._status

    def _set_value(self, value) -> None:
        self._value, self._status = value, RemoteValueStatus.READY
        self._done.set()
        _metrics.closure_result(abandoned=value is ABANDONED)

    def _set_error(self, error: BaseException, cancelled: bool = False) -> None:
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


class Closure:
    _ids = itertools.count()

    def __init__(self, fn_ref: worker_pb2.FunctionRef, args_payload: bytes, name: str,
                 sync: SyncSpec | None = None):
        self.closure_id = f"{next(self._ids)}"
        self.fn_ref, self.args_payload, self.name = fn_ref, args_payload, name
        self.sync = sync
        self.remote_value = RemoteValue()
        self.attempts = 0

    def request(self, worker_id: str) -> worker_pb2.ClosureRequest:
        req = worker_pb2.ClosureRequest(closure_id=self.closure_id, fn=self.fn_ref,
                                        args=self.args_payload, worker_id=worker_id)
        if self.sync is not None:
            req.sync.CopyFrom(ps_pb2.SyncInfo(**dataclasses.asdict(self.sync)))
        return req


# -- the queue -------------------------------------------------------------------------
class _ClosureQueue:
    def __init__(self, max_size: int = _CLOSURE_QUEUE_MAX_SIZE):
        self._lock = threading.Lock()
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._max_size = max_size
        # Signalled when a closure is queued (workers wait on it).
        self._closures_queued = threading.Condition(self._lock)
        # Signalled when the queue has room again (schedule waits on it).
        self._free_slot = threading.Condition(self._lock)
        # Signalled when queued+inflight may have reached 0 or an error arrived (join).
        self._stop_waiting = threading.Condition(self._lock)

    def put(self, closure: Closure) -> None:
        with self._lock:
            self._free_slot.wait_for(lambda: len(self._queue) < self._max_size)
            self._queue.append(closure)
            self._closures_queued.notify()
        _metrics.CLOSURES_SCHEDULED.inc()

    def get(self, timeout: float) -> Closure | None:
        with self._lock:
            if not self._closures_queued.wait_for(lambda: self._queue, timeout):
                return None
            closure = self._queue.popleft()
            self._inflight += 1
            self._free_slot.notify()
            return closure

    def put_back(self, closure: Closure) -> None:
        """Re-queue an in-flight closure whose worker failed (at the front)."""
        with self._lock:
            self._inflight -= 1
            if self._error is not None:
                closure.remote_value._set_error(ClosureCancelled(
                    f"closure {closure.name} cancelled: an earlier closure failed"), True)
                self._stop_waiting.notify_all()
            else:
                self._queue.appendleft(closure)
                self._closures_queued.notify()
                _metrics.CLOSURES_RETRIED.inc()

    def mark_finished(self) -> None:
        with self._lock:
            self._inflight -= 1
            if not self._queue and self._inflight == 0:   # what wait() waits for: a
                self._stop_waiting.notify_all()           # join wakes once, not per closure

    def mark_failed(self, error: BaseException) -> None:
        """A closure failed: keep the first error, cancel everything queued."""
        with self._lock:
            self._inflight -= 1
            if self._error is None:
                self._error = error
            while self._queue:
                c = self._queue.popleft()
                c.remote_value._set_error(ClosureCancelled(
                    f"closure {c.name} cancelled: an earlier closure failed with "
                    f"{type(error).__name__}"), True)
            self._free_slot.notify_all()
            self._stop_waiting.notify_all()

    def mark_failed_external(self, error: BaseException) -> None:
        """An error outside any closure (a server that never came back)."""
        with self._lock:
            self._inflight += 1
        self.mark_failed(error)

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

    def done(self) -> bool:
        with self._lock:
            self._raise_error_locked()
            return not self._queue and self._inflight == 0

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return len(self._queue), self._inflight


# -- one thread per worker ---------------------------------------------------------------
class _WorkerThread:
    """Feeds closures to one worker task; reconnects when it fails."""

    def __init__(self, coord: "ClusterCoordinator", address: str, index: int):
        self.coord, self.address, self.index = coord, address, index
        self.alive = False            # answered its last call
        self.clock = 0                # closures completed (bounded mode's clock)
        self.worker_id: str | None = None
        self._created: set[str] = set()   # datasets made on the current worker process
        self._stop = threading.Event()
        self._channel = make_channel(address, grpc_options(DEFAULT_MAX_MESSAGE_BYTES),
                                     coord.strategy.tls)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._ipc: ipc.IpcClient | None = None   # the worker's local socket, same host
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"WorkerClosureProcessingLoop-{index}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        self._channel.close()
        if self._ipc is not None:
            self._ipc.close()

    def _kw(self, timeout):
        return {"timeout": timeout, "metadata": self.coord._metadata}

    def _connect(self) -> bool:
        """Check the worker is up; after a (re)start, create its datasets."""
        try:
            info = self._stub.GetWorkerInfo(worker_pb2.WorkerInfoRequest(),
                                            wait_for_ready=True, **self._kw(1.0))
        except grpc.RpcError:
            return False
        if info.worker_id != self.worker_id:
            if self.worker_id is not None:
                log.warning("worker %s restarted; re-creating its datasets", self.address)
            self.worker_id, self._created = info.worker_id, set(info.datasets)
            self._use_socket(None, "")   # the old process's sockets are gone
        if self._ipc is None:
            self._use_socket(routing.offer_of(info.host),
                             f"{info.protocol_version}:{info.worker_id}")
        # A worker that (re)joins starts at the slowest live clock, not behind it.
        self.clock = max(self.clock, self.coord._min_clock(exclude=self))
        self.alive = True
        self.coord._clocks_changed()
        return True

    def _use_socket(self, offer: routing.Offer | None, identity: str) -> None:
        """Send closures over the socket psserver/routing.py picks from what
        the worker announced (its local socket on this host and network
        namespace, else its data port; PSTRAIN_DATA=0: not), else over gRPC."""
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None
        if offer is None:
            return
        strategy = self.coord.strategy
        p = routing.plan(routing.this_host(), offer, same_host_ok=ipc.available(),
                         data_ok=ipc.data_available())
        try:
            if p.socket == routing.UNIX:
                client = ipc.IpcClient(offer.ipc_socket, strategy.token, self.address,
                                       max_free=1, identity=identity)
            elif p.socket == routing.TCP:
                host = self.address.rsplit(":", 1)[0]
                client = ipc.IpcClient(
                    "", strategy.token, self.address, max_free=1, tcp=(host, offer.data_port),
                    ssl_context=strategy.tls.ssl_client_context() if strategy.tls else None,
                    identity=identity)
            else:
                return
            client.connect()
        except (OSError, ValueError, PSError) as exc:   # a firewall, a NetworkPolicy
            log.warning("worker %s: cannot use its %s (%s); sending closures over gRPC",
                        self.address, "local socket" if p.socket == routing.UNIX
                        else "data port", exc)
            return
        self._ipc = client

    def _grpc(self, method, request, timeout):
        try:
            return method(request, **self._kw(timeout))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from exc

    def _run_closure(self, request: worker_pb2.ClosureRequest) -> worker_pb2.ClosureReply:
        """One closure over the worker's socket, or gRPC; a failure raises its
        typed error (psserver.contract), whichever way it went."""
        timeout = self.coord.closure_timeout
        if self._ipc is None:
            return self._grpc(self._stub.RunClosure, request, timeout)
        try:
            return worker_pb2.ClosureReply.FromString(
                self._ipc.call(methods.RUN_CLOSURE.id, request.SerializeToString(), timeout))
        except PSError as exc:
            if getattr(exc, "not_sent", False) or exc.code in _WORKER_FAILURE_CODES:
                self._ipc.close()
                self._ipc = None
            if getattr(exc, "not_sent", False):   # never reached the worker: gRPC is safe
                return self._grpc(self._stub.RunClosure, request, timeout)
            raise

    def _ensure_datasets(self) -> None:
        for ds_id, fn_ref in list(self.coord._datasets.items()):
            if ds_id not in self._created:
                n, i = self.coord._worker_count_and_index(self.address)
                self._grpc(self._stub.CreateDataset, worker_pb2.CreateDatasetRequest(
                    dataset_id=ds_id, fn=fn_ref, worker_index=i, num_workers=n,
                    worker_id=self.worker_id), _CONTROL_TIMEOUT)
                self._created.add(ds_id)

    def _loop(self) -> None:
        queue = self.coord._queue
        backoff = 0.05
        while not self._stop.is_set():
            if not self.alive:
                if not self._connect():
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                backoff = 0.05
            if not self.coord._may_start(self):
                continue
            closure = queue.get(timeout=0.2)
            if closure is None:
                continue
            self.coord._record_start(self)
            self._run(closure)

    def _run(self, closure: Closure) -> None:
        queue = self.coord._queue
        closure.attempts += 1
        try:
            self._ensure_datasets()
            reply = self._run_closure(closure.request(self.worker_id))
        except PSError as exc:
            if exc.code in _WORKER_FAILURE_CODES:
                self.alive = False
                if closure.sync is not None:
                    self._abandon(closure, exc.code.name)
                else:
                    log.warning("worker %s failed running closure %s (%s); re-queueing it",
                                self.address, closure.name, exc.code.name)
                    queue.put_back(closure)
                return
            err = WorkerCallError(f"worker {self.address} refused closure {closure.name}: "
                                  f"{exc.code.name}: {exc}")
            closure.remote_value._set_error(err)
            queue.mark_failed(err)
            return
        if reply.WhichOneof("outcome") == "error":
            e = reply.error
            if e.ps_address and closure.sync is None:
                # Said once per server: the recovery reports on the server itself.
                log.log(logging.DEBUG if self.coord._recovery.active(e.ps_address)
                        else logging.WARNING,
                        "closure %s failed on parameter server %s (%s); checking that "
                        "server before deciding", closure.name, e.ps_address, e.ps_code)
                err = StepFunctionError(e.type, e.message, e.traceback, self.address)
                self.coord._recovery.report(e.ps_address, closure, e.ps_code, err)
                return
            err = StepFunctionError(e.type, e.message, e.traceback, self.address)
            closure.remote_value._set_error(err)
            queue.mark_failed(err)
            return
        try:
            value = serialization.loads(reply.result, trusted=True)
        except Exception as exc:   # e.g. a result type the coordinator cannot import
            err = WorkerCallError(f"cannot unpickle the result of closure {closure.name}: "
                                  f"{type(exc).__name__}: {exc}")
            closure.remote_value._set_error(err)
            queue.mark_failed(err)
            return
        closure.remote_value._set_value(value)
        self.clock += 1
        self.coord._clocks_changed()
        queue.mark_finished()

    def _abandon(self, closure: Closure, why: str) -> None:
        """A sync replica's worker failed: the step goes on without it."""
        sync = closure.sync
        log.warning("worker %s failed running replica %d of sync step %d (%s); abandoning "
                    "the replica so the step completes with the others",
                    self.address, sync.replica, sync.step, why)
        try:
            self.coord.strategy.abandon(sync.step, sync.replica)
        except PSError as exc:
            err = WorkerCallError(f"could not abandon replica {sync.replica} of step "
                                  f"{sync.step} on the parameter servers: {exc}")
            closure.remote_value._set_error(err)
            self.coord._queue.mark_failed(err)
            return
        closure.remote_value._set_value(ABANDONED)
        self.coord._queue.mark_finished()


class _Membership:
    """Keeps one _WorkerThread per worker address in the cluster spec."""

    def __init__(self, coord: "ClusterCoordinator", interval: float):
        self.coord, self.interval = coord, interval
        self.workers: dict[str, _WorkerThread] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._count = itertools.count()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ClusterMembership")
        self._thread.start()

    def refresh(self) -> None:
        try:
            spec = self.coord.strategy.cluster_resolver.cluster_spec()
        except Exception as exc:   # a rewritten config file may be briefly invalid
            log.warning("cannot read the cluster spec: %s", exc)
            return
        wanted = list(spec.worker)
        with self._lock:
            for addr in wanted:
                if addr not in self.workers:
                    w = self.workers[addr] = _WorkerThread(self.coord, addr, next(self._count))
                    w.start()
            for addr in [a for a in self.workers if a not in wanted]:
                log.warning("worker %s left the cluster spec", addr)
                self.workers.pop(addr).stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            w.stop()
        for w in workers:
            w.join()


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
        bounded modes; in sync mode the step fails. (coordinator/recovery.py)
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

    Use as a context manager, or call ``shutdown()``, to stop its threads.
    """

    def __init__(self, strategy: ParameterServerStrategy, *,
                 closure_timeout: float | None = None, membership_interval: float = 1.0,
                 checkpoint_manager=None, ps_recovery_timeout: float = 300.0,
                 recreate_lost_shards: bool = False, ps_failover_after: float = 3.0,
                 ps_check_interval: float = 1.0):
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
            payload = serialization.dumps((tuple(args), dict(kwargs or {})))
        except Exception as exc:
            raise TypeError(f"cannot send the arguments of {_name(fn)} to a worker: "
                            f"{type(exc).__name__}: {exc}") from exc
        if self.strategy.mode == "sync":
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

    @property
    def num_workers(self) -> int:
        return len(self._membership.workers)

    def workers_alive(self) -> int:
        return sum(w.alive for w in list(self._membership.workers.values()))

    def pending(self) -> tuple[int, int]:
        """(queued, in flight) closures."""
        return self._queue.counts()

    def shutdown(self) -> None:
        """Stop the worker threads (closures in flight finish first)."""
        if not self._closed:
            self._closed = True
            self._ps_watch.stop()
            self._membership.stop()

    def __enter__(self) -> "ClusterCoordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

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
        return [w for w in list(self._membership.workers.values()) if w.alive] \
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
