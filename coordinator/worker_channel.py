"""The worker channel: a thread per worker task (per slot), feeding it closures.

* ``_WorkerThread``  connects to its worker (GetWorkerInfo; a restarted worker
  is noticed by its id and gets its datasets again), takes closures from the
  Cluster (coordinator/cluster.py: when it may start one), sends them on its
  TaskChannel (psserver/link/channel.py: the route psserver/contract/routing.py plans
  from what the worker announced: its Unix socket, its data port, or gRPC),
  and decides what a failure means: the worker gone (re-queue, or abandon a
  sync replica) or the step failed.
* ``_Membership``    keeps one _WorkerThread per worker in the cluster spec
  (``closures_per_worker`` of them: slots, async mode only, sharing
  ``_SharedWorker``: which datasets the worker process has).

Both get the Cluster and use its public methods and attributes only.

Every failure arrives as a typed error (psserver.errors), whichever way
the call went.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING

from coordinator import serialization
from coordinator.closures import ABANDONED, Closure
from coordinator.cluster_spec import Refreshing
from coordinator.errors import ClosureCancelled, StepFunctionError, WorkerCallError
from protos.pstrain.v1 import worker_pb2
from psserver.errors import Code, PSError
from psserver.link import methods
from psserver.link.channel import TaskChannel
from psserver.link.diagnose import UNREACHED, not_answering, reachability

if TYPE_CHECKING:
    from coordinator.cluster import Cluster

log = logging.getLogger("coordinator")

#: Codes that mean "the worker is gone, unreachable, or restarted" (ABORTED:
#: the fencing worker_id did not match), not "the step failed": the closure is
#: re-queued and the worker reconnected.
_WORKER_FAILURE_CODES = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED, Code.ABORTED)
#: Deadline of the calls that check a worker is up and create its datasets.
_CONTROL_TIMEOUT = 30.0
#: How long the probe of a worker whose first call failed waits for a TCP
#: connection: a refused one is known at once; no answer in this long is
#: left to the strategy's connect_timeout (it may be a slow network).
_FIRST_PROBE_SECONDS = 1.0


#: Function digests noted per worker process at most (it keeps 32 functions:
#: a function past this many goes by value, as one it let go would).
FUNCTIONS_NOTED = 64
NO_DIGESTS = b"-"   # noted for a worker process that takes no digests

# -- one thread per worker (per slot) ----------------------------------------------------
class _SharedWorker:
    """What the slots of one worker share: the datasets made on each of its
    processes (by worker id; ``creating``: one slot at a time makes them, so
    two slots meeting a fresh worker create each once), and its clock
    (closures completed by all its slots)."""

    def __init__(self):
        self.lock = threading.Lock()       # created and clock; held briefly
        self.creating = threading.Lock()   # held across CreateDataset calls
        self.created: dict[str, set[str]] = {}
        # the digests of functions each process was sent by value (then sent by digest alone)
        self.functions: dict[str, set[bytes]] = {}
        self.clock = 0
        self.slots: list["_WorkerThread"] = []

    def seen(self, worker_id: str, datasets) -> None:
        """A process answered GetWorkerInfo with the datasets it has."""
        with self.lock:
            self.created.setdefault(worker_id, set()).update(datasets)

    def has(self, worker_id: str | None, dataset_id: str) -> bool:
        with self.lock:
            return dataset_id in self.created.get(worker_id, ())

    def add(self, worker_id: str, dataset_id: str) -> None:
        with self.lock:
            self.created.setdefault(worker_id, set()).add(dataset_id)

    def has_function(self, worker_id: str | None, digest: bytes) -> bool:
        with self.lock:
            got = self.functions.get(worker_id, ())
            return digest in got and NO_DIGESTS not in got

    def note_function(self, worker_id: str, digest: bytes, has: bool) -> None:
        """``worker_id`` has (or not) the function of ``digest``; b"" and not:
        it takes no digests (a worker from before them)."""
        with self.lock:
            if worker_id not in self.functions:   # (a process restarted: the old one's go)
                self.functions.clear()
            got = self.functions.setdefault(worker_id, set())
            if not digest:
                got.add(NO_DIGESTS)
            elif has and len(got) < FUNCTIONS_NOTED:
                got.add(digest)
            elif not has:
                got.discard(digest)

    def tick(self) -> None:
        with self.lock:
            self.clock += 1


class _WorkerThread:
    """Feeds closures to one worker task, one at a time; reconnects when it
    fails. A worker with several slots has one _WorkerThread per slot (slot
    0 is the one counted: liveness, clocks, warnings)."""

    def __init__(self, cluster: "Cluster", address: str, index: int,
                 shared: _SharedWorker, slot: int):
        self.cluster, self.address, self.index = cluster, address, index
        self.slot = slot
        self._shared = shared
        shared.slots.append(self)
        self.alive = False            # answered its last call
        self.failed_connects = 0      # reconnections that failed (run_on's reconnect wait)
        self.made_connects = 0        # connections made (an all-reduce ring takes one back)
        self.worker_id: str | None = None   # the worker process this thread talks to
        # Since when (monotonic) the worker has not answered, whether that
        # was said, and whether its address was probed (_note_silence);
        # None: it answered its last probe.
        self._silent_since: float | None = None
        self._said_silent = self._probed = False
        self._stop = threading.Event()
        # One connection (a slot runs one closure at a time); no deadline of
        # its own: a closure's is closure_timeout, control calls' their own.
        # (The strategy's TLS, None: plaintext; silence is said by
        # _note_silence, once, not by every failed call.)
        self._channel = TaskChannel(address, role="worker", token=cluster.strategy.token,
                                    tls=cluster.strategy.tls or False, timeout=None, max_free=1,
                                    abortable=True, diagnose=False)
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"WorkerClosureProcessingLoop-{index}")

    @property
    def clock(self) -> int:
        """Closures the worker completed, all its slots (bounded mode's clock)."""
        return self._shared.clock

    @clock.setter
    def clock(self, value: int) -> None:
        with self._shared.lock:
            self._shared.clock = value

    @property
    def worker_alive(self) -> bool:
        """Any slot of the worker answered its last call."""
        return any(w.alive for w in self._shared.slots)

    @property
    def connects_made(self) -> int:
        """Connections of the worker's slots made so far."""
        return sum(w.made_connects for w in self._shared.slots)

    @property
    def connects_failed(self) -> int:
        """Reconnections of the worker's slots that failed so far."""
        return sum(w.failed_connects for w in self._shared.slots)

    @property
    def stopping(self) -> bool:
        """stop() or abort() was called: the thread takes no more closures."""
        return self._stop.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.cluster.queue.wake()   # out of a wait for a closure

    def abort(self) -> None:
        """Stop, cutting the call in flight (its closure is given up: gRPC
        calls end CANCELLED, socket calls UNAVAILABLE)."""
        self.stop()
        self._channel.abort()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        self._channel.close()

    def _connect(self) -> bool:
        """Check the worker is up; after a (re)start, create its datasets."""
        if self._silent_since is None:
            self._silent_since = time.monotonic()
        try:   # (a restarted worker's sockets are planned anew: TaskChannel.ask)
            info = self._channel.ask(1.0, wait_for_ready=True)
        except PSError as exc:
            self._note_silence(exc)
            self.failed_connects += 1
            self.cluster.clocks_changed()   # (a run_on waiting for it to come back)
            return False
        if self._said_silent:
            log.warning("worker %d at %s answers now", self._spec_index(), self.address)
        self._silent_since, self._said_silent, self._probed = None, False, False
        self._shared.seen(info.worker_id, info.datasets)
        if info.worker_id != self.worker_id:
            if self.worker_id is not None and self.slot == 0:
                log.warning("worker %s restarted; re-creating its datasets", self.address)
            self.worker_id = info.worker_id
        # A worker that (re)joins starts at the slowest live clock, not behind it.
        self.clock = max(self.clock, self.cluster.min_clock(exclude=self))
        self.made_connects += 1
        self.alive = True
        self.cluster.clocks_changed()
        return True

    def _spec_index(self) -> int:
        return self.cluster.worker_count_and_index(self.address)[1]

    def _note_silence(self, exc: PSError) -> None:
        """Once per outage: a warning naming the worker and what to check,
        after the strategy's connect_timeout; for a worker that never
        answered, at its first failed call when its host does not resolve or
        its port refuses connections (a probe tells at once: no slow start of
        a worker that is up). The thread keeps trying (a worker may start
        late, or restart)."""
        if self._said_silent or self.slot:
            return
        waited = time.monotonic() - self._silent_since
        limit = self.cluster.strategy.connect_timeout
        found = None
        if waited < limit:
            if self._probed or self.worker_id is not None or exc.code not in UNREACHED:
                return
            self._probed = True   # once per outage: a silent address costs the probe's wait
            found = reachability(self.address, _FIRST_PROBE_SECONDS)
            if found[0] not in ("dns", "closed"):
                return   # silent, or up and slow to answer: connect_timeout's to say
        self._said_silent = True
        what = f"worker {self._spec_index()}"
        if exc.code in UNREACHED:
            why = not_answering(what, self.address, None if found else limit,
                                self.cluster.strategy.tls, found=found)
        elif exc.code == Code.UNAUTHENTICATED:
            why = (f"{what} at {self.address} refuses the coordinator's auth token "
                   f"(UNAUTHENTICATED): give the strategy the token the tasks were started "
                   "with (token=..., or $PSTRAIN_AUTH_TOKEN)")
        else:
            why = f"{what} at {self.address} refuses to connect: {exc.code.name}: {exc}"
        log.warning("%s; still waiting for it", why)

    def _run_closure(self, closure: Closure) -> worker_pb2.ClosureReply:
        """One closure on the worker's route; a failure raises its typed error
        (psserver.contract), whichever way it went. A function sent by value
        goes by its digest alone to a worker process that had it (and by
        value again if that process let it go: NOT_FOUND)."""
        digest = closure.fn_ref.digest if closure.fn_ref.WhichOneof("kind") == "pickled" \
            else b""
        known = bool(digest) and self._shared.has_function(self.worker_id, digest)
        try:
            reply = self._channel.call(methods.RUN_CLOSURE, closure.request(
                self.worker_id, digest_only=known), self.cluster.closure_timeout)
        except PSError as exc:
            # NOT_FOUND: it let the function go; INVALID_ARGUMENT: a worker from
            # before digests ("no function in the request"): by value from now on
            if not (known and exc.code in (Code.NOT_FOUND, Code.INVALID_ARGUMENT)):
                raise
            if exc.code == Code.INVALID_ARGUMENT:
                self._shared.note_function(self.worker_id, b"", False)
            self._shared.note_function(self.worker_id, digest, False)
            reply = self._channel.call(methods.RUN_CLOSURE, closure.request(self.worker_id),
                                       self.cluster.closure_timeout)
        if digest:
            self._shared.note_function(self.worker_id, digest, True)
        return reply

    def _ensure_datasets(self) -> None:
        shared, wid = self._shared, self.worker_id
        if all(shared.has(wid, ds_id) for ds_id in self.cluster.datasets()):
            return   # the common case
        with shared.creating:   # another slot may be creating them: once each
            for ds_id, fn_ref in self.cluster.datasets().items():
                if not shared.has(wid, ds_id):
                    n, i = self.cluster.worker_count_and_index(self.address)
                    # Fenced by worker_id: a process that is not this one
                    # (restarted since) refuses (ABORTED: reconnect).
                    self._channel.call(methods.CREATE_DATASET, worker_pb2.CreateDatasetRequest(
                        dataset_id=ds_id, fn=fn_ref, worker_index=i, num_workers=n,
                        worker_id=wid), _CONTROL_TIMEOUT)
                    shared.add(wid, ds_id)

    def _loop(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            if not self.alive:
                if not self._connect():
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                backoff = 0.05
            closure = self.cluster.next_closure(self)   # waits: the gate, then a closure
            if closure is not None:
                self._run(closure)

    def _run(self, closure: Closure) -> None:
        queue = self.cluster.queue
        closure.attempts += 1
        closure.bind(self.address)   # sharded datasets: the batch is chosen now
        try:
            self._ensure_datasets()
            reply = self._run_closure(closure)
        except PSError as exc:
            if exc.code in _WORKER_FAILURE_CODES:
                self.alive = False
                self.cluster.clocks_changed()   # the live workers changed
                if self._stop.is_set():   # cut by shutdown after a failure: given up
                    queue.cancel(closure, ClosureCancelled(
                        f"closure {closure.name} cancelled: the coordinator shut down after "
                        "a failure"))
                elif closure.sync is not None:
                    self._abandon(closure, exc.code.name)
                elif closure.target is not None and closure.collective is None:
                    queue.fail(closure, WorkerCallError(   # (for it alone: no other may run it)
                        f"worker {self.address} failed running {closure.name} "
                        f"({exc.code.name})"))
                elif closure.gang is not None:   # the ring re-forms without it
                    self.cluster.gangs.failed(closure, WorkerCallError(
                        f"worker {self.address} failed running {closure.name} "
                        f"({exc.code.name})"), lost=True)
                else:
                    log.warning("worker %s failed running closure %s (%s); re-queueing it",
                                self.address, closure.name, exc.code.name)
                    queue.put_back(closure)
                return
            err = WorkerCallError(f"worker {self.address} refused closure {closure.name}: "
                                  f"{exc.code.name}: {exc}")
            if closure.gang is not None:   # (its step's others are told by the recovery)
                self.cluster.gangs.failed(closure, err, lost=False)
            else:
                queue.fail(closure, err)
            return
        if reply.WhichOneof("outcome") == "error":
            e = reply.error
            if closure.gang is not None:   # (AllReduceFailed: a member gone, or told of
                self.cluster.gangs.failed(closure, StepFunctionError(   # another's error)
                    e.type, e.message, e.traceback, self.address),
                    lost=e.type in ("AllReduceFailed", "ReplicasDisagree"))
                return
            if e.ps_address and closure.sync is None and closure.gang is None:
                # Said once per server: the recovery reports on the server itself.
                log.log(logging.DEBUG if self.cluster.recovery.active(e.ps_address)
                        else logging.WARNING,
                        "closure %s failed on parameter server %s (%s); checking that "
                        "server before deciding", closure.name, e.ps_address, e.ps_code)
                err = StepFunctionError(e.type, e.message, e.traceback, self.address)
                self.cluster.recovery.report(e.ps_address, closure, e.ps_code, err)
                return
            queue.fail(closure, StepFunctionError(e.type, e.message, e.traceback, self.address))
            return
        try:
            value = serialization.loads(reply.result, trusted=True)
        except Exception as exc:   # e.g. a result type the coordinator cannot import
            err = WorkerCallError(f"cannot unpickle the result of closure {closure.name}: "
                                  f"{type(exc).__name__}: {exc}")
            if closure.gang is not None:
                self.cluster.gangs.failed(closure, err, lost=False)
            else:
                queue.fail(closure, err)
            return
        self._shared.tick()   # before the closure is done: a join() sees the clock
        if closure.gang is not None:   # (its batches acknowledged before join() can return)
            closure.settle_batches(True)
        queue.finish(closure, value)
        if closure.gang is not None:
            self.cluster.gangs.succeeded(closure)
        self.cluster.clocks_changed()   # after: a wait_for sees the result

    def _abandon(self, closure: Closure, why: str) -> None:
        """A sync replica's worker failed: the step goes on without it."""
        sync = closure.sync
        log.warning("worker %s failed running replica %d of sync step %d (%s); abandoning "
                    "the replica so the step completes with the others",
                    self.address, sync.replica, sync.step, why)
        try:
            self.cluster.strategy.abandon(sync.step, sync.replica)
        except PSError as exc:
            self.cluster.queue.fail(closure, WorkerCallError(
                f"could not abandon replica {sync.replica} of step "
                f"{sync.step} on the parameter servers: {exc}"))
            return
        self.cluster.queue.finish(closure, ABANDONED)


class _Membership(Refreshing):
    """Keeps one _WorkerThread per worker address in the cluster spec (its
    slot 0, in ``workers``), and one more per further slot (``extra``).
    ``make_worker``: how a slot's thread is made (_WorkerThread's arguments).
    Starts nothing until ``start`` (Refreshing)."""

    def __init__(self, cluster: "Cluster", make_worker=_WorkerThread):
        self.cluster = cluster
        self.make_worker = make_worker
        self.workers: dict[str, _WorkerThread] = {}
        self.extra: dict[str, list[_WorkerThread]] = {}
        self._lock = threading.Lock()
        self._count = itertools.count()

    def refresh(self) -> None:
        try:
            spec = self.cluster.strategy.cluster_resolver.cluster_spec()
        except Exception as exc:   # a rewritten config file may be briefly invalid
            log.warning("cannot read the cluster spec: %s", exc)
            return
        wanted = list(spec.worker)
        with self._lock:
            for addr in wanted:
                if addr not in self.workers:
                    shared = _SharedWorker()
                    slots = [self.make_worker(self.cluster, addr, next(self._count), shared, k)
                             for k in range(self.cluster.closures_per_worker)]
                    self.workers[addr], self.extra[addr] = slots[0], slots[1:]
                    for w in slots:
                        w.start()
            left = [a for a in self.workers if a not in wanted]
            for addr in left:
                log.warning("worker %s left the cluster spec", addr)
                for w in [self.workers.pop(addr), *self.extra.pop(addr, [])]:
                    w.stop()   # its closure in flight finishes; then its connections close
                    threading.Thread(target=w.join, daemon=True,
                                     name=f"WorkerLeft-{w.index}").start()
        if left:
            self.cluster.clocks_changed()   # the slowest live worker may have left

    def stop(self, abort: bool = False) -> None:
        """Stop every worker thread; ``abort``: cut their calls in flight
        instead of letting their closures finish."""
        super().stop()
        with self._lock:
            workers = [*self.workers.values(), *(w for ws in self.extra.values() for w in ws)]
        for w in workers:
            w.abort() if abort else w.stop()
        for w in workers:
            w.join()
