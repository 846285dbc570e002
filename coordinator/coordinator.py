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
* ``Cluster``        wires them: the queue, the workers and their clocks (the
                     bounded-staleness gate), the recovery and its pause, the
                     datasets (coordinator/cluster.py).
* ``ClusterCoordinator`` the small public facade (here): it delegates to its
                     Cluster.

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
  check), once per outage, and is still waited for; one that never answered
  is named at its first failed call when its host does not resolve or its
  port refuses connections (no slow start explains those).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable

from coordinator import elastic, ps_follow, variable_moves
from coordinator import metrics as _metrics
from coordinator.closures import (  # noqa: F401  (re-exported)
    ABANDONED,
    Closure,
    RemoteValue,
    RemoteValueStatus,
    StepRemoteValue,
)
from coordinator.cluster import Cluster
from coordinator.datasets import PerWorkerDataset
from coordinator.errors import StepFunctionError
from coordinator.sharded import ShardedDataset, ShardedSource
from coordinator.strategy import ParameterServerStrategy
from psserver.errors import Unavailable


def _setting(name: str) -> property:
    """An argument of the coordinator, kept on its Cluster (read and written there)."""
    return property(lambda self: getattr(self._cluster, name),
                    lambda self, value: setattr(self._cluster, name, value))


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
      elastic_servers: follow the cluster spec's parameter servers as its
        workers are followed: add each server it gains and drain each it
        loses, between steps (coordinator/ps_follow.py). None: on if
        ``PSTRAIN_ELASTIC_SERVERS=1`` (``coordinator run --ps-dns`` sets it).
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
                 ps_check_interval: float = 1.0, closures_per_worker: int = 1,
                 elastic_servers: bool | None = None):
        self._cluster = Cluster(
            strategy, closure_timeout=closure_timeout, membership_interval=membership_interval,
            checkpoint_manager=checkpoint_manager, ps_recovery_timeout=ps_recovery_timeout,
            recreate_lost_shards=recreate_lost_shards, ps_failover_after=ps_failover_after,
            ps_check_interval=ps_check_interval, closures_per_worker=closures_per_worker)
        self._cluster.start()
        if strategy.mode == "allreduce":   # (checkpoints take the replicas through it)
            strategy.replicas_from = weakref.ref(self)
        _metrics.track(self._cluster)   # the gauges; serves metrics if $PSTRAIN_METRICS_PORT says
        self._follower = ps_follow.ServerFollower(
            strategy, self.add_parameter_server, self.remove_parameter_server,
            membership_interval, busy=self._cluster.recovery.active,
        ).start() if ps_follow.wanted(elastic_servers) else None

    #: The arguments, as given (read and written on the Cluster, which uses them).
    strategy = _setting("strategy")
    closure_timeout = _setting("closure_timeout")
    closures_per_worker = _setting("closures_per_worker")
    checkpoint_manager = _setting("checkpoint_manager")
    ps_recovery_timeout = _setting("ps_recovery_timeout")
    recreate_lost_shards = _setting("recreate_lost_shards")
    ps_failover_after = _setting("ps_failover_after")

    @property
    def cluster(self) -> Cluster:
        """The Cluster behind this facade: its queue, workers (``membership``),
        parameter-server ``recovery`` and clocks, for tools and tests."""
        return self._cluster

    # -- public API --------------------------------------------------------------
    def schedule(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on a worker; return its RemoteValue.

        Returns at once (blocks only while the queue is full). Arguments are
        pickled now; a ``PerWorkerIterator`` among them becomes the running
        worker's own iterator. Runs at least once (see the module docstring).
        Raises TypeError if fn or its arguments cannot be sent.
        """
        return self._cluster.schedule(fn, args, kwargs)

    def replica_values(self, variables=None, worker: int | str = 0, *,
                       with_versions: bool = False, timeout: float | None = None) -> dict:
        """All-reduce mode: {name: value} of a worker's replicas of
        ``variables`` (default: every mirrored variable of the strategy),
        after the steps scheduled before this call ran there; ``worker``: its
        index in the cluster spec, or its address. With ``with_versions``:
        (values, {name: updates applied}). The replicas are bit-identical on
        every worker after each step, so any worker's are the model's.
        Unavailable if that worker is down (or does not run the call within
        ``timeout``, default cluster.TOOL_SECONDS); StepFunctionError if it
        has no replicas (it restarted)."""
        from coordinator import mirrored
        variables, address = self._replica_source(variables, worker, timeout)
        got = self._cluster.run_on(address, mirrored.values, (variables,), timeout)
        values = {n: v for n, (v, _) in got.items()}
        return (values, {n: k for n, (_, k) in got.items()}) if with_versions else values

    def replica_states(self, variables=None, source: int | str | None = None, *,
                       timeout: float | None = None) -> dict[str, tuple]:
        """All-reduce mode: {name: (value, slots, update count)} of one
        worker's replicas (``source``, default the live one that applied the
        most updates) after the steps scheduled before this call: what a
        checkpoint of the mirrored variables holds."""
        from coordinator import mirrored
        variables, source = self._replica_source(variables, source, timeout)
        return self._cluster.run_on(source, mirrored.whole_state, (variables,), timeout)

    def set_replicas(self, states: dict, variables=None, *,
                     timeout: float | None = None, skip: str | None = None) -> None:
        """All-reduce mode: make every worker's replicas ``states``
        (replica_states'), after the steps scheduled before this call; each
        worker checks them before it changes anything. If one fails, the
        others keep what they set: Unavailable names which did not, and
        replicas that differ refuse steps until this is run again."""
        from coordinator import mirrored
        variables = self._mirrored(variables)
        targets = [a for a in self.strategy.cluster_spec.worker if a != skip]
        failed = {}
        for a in targets:   # (one at a time: each worker's copy is sent once)
            try:
                self._cluster.run_on(a, mirrored.set_state, (variables, states), timeout)
            except (Unavailable, StepFunctionError) as exc:
                failed[a] = exc
        if failed:
            raise Unavailable(
                f"the replicas were set on {[a for a in targets if a not in failed]} but not "
                f"on {sorted(failed)} ({'; '.join(f'{a}: {e}' for a, e in failed.items())}): "
                "the replicas now differ and steps refuse; set them again (restore, or "
                "sync_replicas(source=a worker that was set)) once those are back")

    def sync_replicas(self, source: int | str | None = None, variables=None, *,
                      timeout: float | None = None) -> str:
        """All-reduce mode: make every worker's replicas of ``variables``
        (default: every mirrored variable) those of one worker: values,
        optimizer slots and update counts, after the steps scheduled before
        this call. ``source``: that worker (index in the cluster spec, or
        address); default the live one whose replicas applied the most
        updates (after a restore that did not reach every worker, name a
        worker it reached). Call it between steps (after ``join``). A
        step whose replicas differ (a worker restarted) makes the
        coordinator do this by itself (ReplicasDisagree: the ring is
        re-formed, coordinator/gang.py). Returns the source's address."""
        from coordinator import mirrored
        variables, source = self._replica_source(variables, source, timeout)
        states = self._cluster.run_on(source, mirrored.whole_state, (variables, True), timeout)
        self.set_replicas(states, variables, timeout=timeout, skip=source)
        return source

    def _mirrored(self, variables) -> list:
        from coordinator import mirrored
        variables = (self.strategy.mirrored_variables if variables is None
                     else list(variables))
        if not all(isinstance(v, mirrored.MirroredVariable) for v in variables):
            raise TypeError("these tools take mirrored variables (mode=\"allreduce\"); "
                            "read the others with read_variables")
        return variables

    def _replica_source(self, variables, source, timeout) -> tuple[list, str]:
        """(the variables, the address of the worker to take replicas from:
        ``source``, or the live worker whose replicas applied the most updates)."""
        from coordinator import mirrored
        variables = self._mirrored(variables)
        members = list(self.strategy.cluster_spec.worker)
        if source is None:
            counts = {}
            for a in members:
                try:   # (update counts only: no copy of the model from each)
                    counts[a] = sum(self._cluster.run_on(a, mirrored.versions, (variables,),
                                                         timeout).values())
                except (StepFunctionError, Unavailable):   # (none there, or it is down)
                    pass
            if not counts:
                raise Unavailable(
                    f"no live worker has replicas of all of {[v.name for v in variables]}: "
                    "a mirrored variable gets them at the first step that reads or pushes it "
                    "(and a worker that restarted has none until sync_replicas)")
            return variables, max(counts, key=counts.get)
        address = members[source] if isinstance(source, int) and 0 <= source < len(
            members) else source
        if address not in members:
            raise ValueError(f"{source!r} is not a worker of the cluster spec: {members}")
        return variables, address

    def add_parameter_server(self, address: str, timeout: float | None = 300.0) -> list:
        """Add the parameter server at ``address`` to the running job: each
        dynamic table moves about 1/(n+1) of its rows there, between two
        steps (closures in flight end first, within ``timeout``, and no
        closure starts during the move; queued ones are planned again on the
        new layout: none fails), then variable shards move there, whole,
        until it holds about an even share of the variable bytes (the most
        loaded servers' largest shards that fit: variable_moves.plan_spread;
        a shard move that fails is logged and ends that, the add stands),
        and variables and tables created from then on are placed over every
        server. Returns what moved: a TableMove per table, then a
        VariableMove per variable shard (with replication: backup copies
        move). ValueError, nothing changed, with replication in a job with
        dynamic tables (not supported yet), for an address
        the job has (unless an add or drain of it failed part way: then its
        shards are filled to their share), or for a server of the job named
        another way (the same process); coordinator/elastic.py says what
        moves and what a failure part-way leaves."""
        # (asked before the steps wait: one that does not answer holds nothing up)
        elastic.check_add(self.strategy, address, probe=self.strategy.connect_timeout)
        with self._copied_ahead(address, True, timeout) as ahead:
            moves = self.strategy.add_parameter_server(address)
            with elastic.LAYOUT_LOCK:   # (and variable shards, whole: variable_moves.py)
                moves += variable_moves.spread_to(self.strategy, address)
        return _with_ahead(moves, ahead)

    def remove_parameter_server(self, address: str, timeout: float | None = 300.0) -> list:
        """Drain the parameter server at ``address`` from the running job:
        each dynamic table moves its rows there to the other servers (each
        taking an even share), between two steps as add_parameter_server;
        then the job no longer uses that server, which may stop (its shards
        stay, refusing every key, so that an older description of a table
        learns the layout there); its variable shards move whole to the others
        (coordinator/variable_moves.py). Returns what moved: a VariableMove
        per variable shard copy, then a TableMove per table (with replication
        each shard keeps two copies on two servers: the primary role is
        handed over first). ValueError, nothing changed, with replication in
        a job with dynamic tables, for the last server, with
        replication where a copy would have no server left, for one holding
        variables this coordinator has not declared, or where a destination
        holds another variable of a moving shard's name. In sync and hybrid
        modes the pause comes between two whole steps (a step that started
        ends first)."""
        elastic.check_remove(self.strategy, address)
        with self._copied_ahead(address, False, timeout) as ahead:
            moves = self.strategy.remove_parameter_server(address)
        return _with_ahead(moves, ahead)

    @contextlib.contextmanager
    def _copied_ahead(self, address: str, adding: bool, timeout: float | None):
        """An add's or drain's moves (the body) between two steps, the tables'
        rows copied ahead first while training goes on (elastic.copy_ahead:
        the moves then send only the rows changed since). Saves wait for
        each (LAYOUT_LOCK), not for the steps to end in between (a recovery
        may need to restore meanwhile); a save in between writes no copied
        row (psserver/core/table_moves.py unstaged). Yields the copies."""
        with elastic.LAYOUT_LOCK:
            self._check_open()
            elastic.settle(self.strategy.tables)   # (what an earlier, failed call left)
            epochs = {t.name: t.layout_epoch for t in self.strategy.tables}
            try:
                ahead = elastic.copy_ahead(self.strategy, address, adding)
            except BaseException:
                elastic.drop_ahead(self.strategy, address, adding, epochs)
                raise
        try:
            with self._cluster.between_steps(timeout):
                self._check_open()
                yield ahead
                self._cluster.forget_function_refs()   # closures carry the new layout now
        except elastic.MoveUndetermined:   # (nothing is cleaned up: a person decides)
            raise
        except BaseException:   # (the moves did not run, or failed: the copies go)
            elastic.drop_ahead(self.strategy, address, adding, epochs)
            raise

    def _check_open(self) -> None:
        if self._cluster.closed:   # (a move waiting for steps when the job shut down)
            raise RuntimeError("this ClusterCoordinator was shut down; nothing moved")

    def join(self, timeout: float | None = None) -> None:
        """Block until every scheduled function has finished.

        Raises the first error a closure raised (StepFunctionError with the
        worker's traceback, or WorkerCallError), once. TimeoutError if
        ``timeout`` seconds pass first.
        """
        if not self._cluster.queue.wait(timeout):
            raise TimeoutError(f"scheduled closures still running after {timeout}s")
        self._cluster.recovery.wait(timeout)   # a server being restored is not done yet
        if not self._cluster.gangs.wait(timeout):   # nor an all-reduce ring being re-formed
            raise TimeoutError(f"an all-reduce ring was still being re-formed after {timeout}s")
        if not self._cluster.queue.wait(timeout):   # (the steps it issued again)
            raise TimeoutError(f"scheduled closures still running after {timeout}s")

    def done(self) -> bool:
        """Whether all scheduled functions finished (raises a pending error)."""
        return self._cluster.queue.done()

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
        return self._cluster.create_per_worker_dataset(dataset_fn)

    def create_sharded_dataset(self, source: ShardedSource, batch_size: int, *,
                               visitation: str = "exactly_once",
                               drop_remainder: bool = False) -> ShardedDataset:
        """A dataset whose batches the coordinator hands out: ``source`` (a
        ShardedSource) goes to every worker once (and to workers that start
        or restart later, before their first closure); each closure that
        takes ``iter(dataset)`` as an argument gets one batch when a worker
        takes it (in all-reduce mode each closure of a step: a batch per
        worker). ``visitation``: "exactly_once" (async, bounded and
        all-reduce modes) or "at_least_once"; see coordinator/sharded.py for what each
        guarantees. Raises ValueError for a bad argument, in sync or hybrid mode, or
        for a source too large to send (over 48 MiB pickled: read it on
        the workers instead, e.g. ShardedSource.from_generator)."""
        return self._cluster.create_sharded_dataset(source, batch_size, visitation,
                                                    drop_remainder)

    @property
    def num_workers(self) -> int:
        return self._cluster.num_workers

    def workers_alive(self) -> int:
        return self._cluster.workers_alive()

    def replicas_in_sync(self) -> int:
        """All-reduce mode: the workers the next step is issued to (each
        runs a replica and takes a batch of a sharded dataset), which follow
        the workers lost and joining (one the spec gained since the last
        step, or one left out that connected again, counted: the next step
        admits it); before the first step, the cluster spec's. Other modes:
        the strategy's ``num_replicas_in_sync``."""
        if self.strategy.mode != "allreduce":
            return self.strategy.num_replicas_in_sync
        gangs, spec = self._cluster.gangs, tuple(self.strategy.cluster_spec.worker)
        if gangs.members is None:
            return len(spec)
        return len(gangs.members) + gangs.joining(spec)   # (+ joiners, and those back)

    def pending(self) -> tuple[int, int]:
        """(queued, in flight) closures."""
        return self._cluster.queue.counts()

    def staleness_stats(self) -> dict:
        """Clocks (steps completed) per live worker, and the largest gap seen
        between a worker starting a step and the slowest live worker."""
        return self._cluster.staleness_stats()

    def shutdown(self, abort: bool = False) -> None:
        """Stop the worker threads. Closures in flight finish first, unless the
        job failed (a closure raised, or a parameter server was lost) or
        ``abort``: then their calls are cut off (their closures end
        CANCELLED, not re-queued), and the coordinator does not wait for
        steps that may be retrying against a lost server."""
        if self._follower is not None:   # (no more looks; one under way ends with the steps)
            self._follower.stop_soon()
        self._cluster.stop(abort=abort)
        if self._follower is not None:
            self._follower.stop()

    def __enter__(self) -> "ClusterCoordinator":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Shut down; a block left by KeyboardInterrupt (Ctrl-C) or another
        exception that is not an error of the job (SystemExit...) cuts the
        closures in flight instead of waiting for them."""
        self.shutdown(abort=exc_type is not None and not issubclass(exc_type, Exception))


def _with_ahead(moves: list, ahead: dict) -> list:
    """``moves`` with each TableMove's copy ahead (elastic.Ahead) attached."""
    for m in moves:
        if isinstance(m, elastic.TableMove):
            m.ahead = ahead.get(m.table)
    return moves
