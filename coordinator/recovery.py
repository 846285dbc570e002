"""Parameter-server failures: notice them, decide what to do, do it.

* ``_PSWatch`` looks at every parameter server's identity every
  ``ps_check_interval`` seconds and reports one that restarted or stopped
  answering to ``_PSRecovery`` (so do steps that failed on a server).
* ``_PSRecovery`` decides, then acts (one thread per server):

  Without replication, a server away stops training (dispatching pauses,
  steps resend their calls) until it answers again. If it answers as the
  same process, nothing was lost (the network); if it restarted empty, its
  shards come back from the latest checkpoint, or, if the user asked for it
  (``recreate_lost_shards=True``), as first created; otherwise the job fails
  with ``ParameterServerLost`` naming the shards and how to avoid it. While
  it waits it says, every ``REPORT_SECONDS``, which server is away, since
  when, and what it waits for (and the metrics say so too).

  With ``replication=True`` training does not wait: a server that restarted,
  or that has not answered for ``ps_failover_after`` seconds, is failed over
  (each shard whose primary it held is promoted on the other server; each
  primary whose backup it held goes on alone). When it answers again, every
  shard gets its backup there again (the primary copies its state), and the
  primaries it held when created are handed back (a planned hand-over, so
  the layout is as created and the load even). No acknowledged update is
  lost (psserver.core.replication).

The planners (``plan_failover``, ``plan_rebuild``, ``plan_failback``) are
pure functions of what the servers report (``Copies``), tested as tables;
``apply_changes`` sends their ``Change``s. ``_PSWatch`` and ``_PSRecovery``
get the Cluster (coordinator/cluster.py) and use its public methods and
attributes only: its settings, its queue, its pause.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Sequence

from coordinator import metrics as _metrics
from coordinator import ps_pool
from coordinator.errors import ParameterServerLost, WorkerCallError
from psserver.contract import (
    ACTION_NAMES,
    DEMOTE,
    DROP_BACKUP,
    PROMOTE,
    ROLE_BACKUP,
    ROLE_PRIMARY,
    SET_BACKUP,
    Peer,
)
from psserver.errors import PSError

log = logging.getLogger("coordinator")

#: Seconds between reports that a parameter server is still away.
REPORT_SECONDS = 30.0
#: Seconds one role change may take on a server (a state copy, a hand-over).
CHANGE_SECONDS = 120.0


# -- decide ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Copies:
    """One replicated shard: its two copies (``created``: v.shards[k], primary
    when created; ``other``: v.backups[k]) and what each server says of its copy
    now (VariableMeta; None: unreachable or missing)."""
    created: object   # coordinator.variables.Shard
    other: object
    created_meta: object = None
    other_meta: object = None

    def on(self, address: str):
        """(the copy on address, its meta, the other copy, its meta)."""
        if self.created.address == address:
            return self.created, self.created_meta, self.other, self.other_meta
        return self.other, self.other_meta, self.created, self.created_meta

    @property
    def epoch(self) -> int:
        return max([m.epoch for m in (self.created_meta, self.other_meta) if m is not None],
                   default=0)


@dataclasses.dataclass(frozen=True)
class Change:
    """A ReplicaChange to send to the server at ``address``."""
    address: str
    name: str
    action: int
    epoch: int
    peer: Peer | None = None


def _peer(shard) -> Peer:
    return Peer(shard.address, shard.name)


def plan_failover(pairs: Sequence[Copies], lost: str) -> list[Change]:
    """Server ``lost`` is gone (its copies too, or they are cut off): promote
    the other copy of every shard whose primary it held; tell every primary
    whose backup it held to go on alone. A shard with no copy left is skipped
    (nothing can be done for it; the caller reports it)."""
    out = []
    for p in pairs:
        here, _, there, there_meta = p.on(lost)
        if here.address != lost or there_meta is None:
            continue
        if there_meta.role == ROLE_BACKUP:
            out.append(Change(there.address, there.name, PROMOTE, p.epoch + 1))
        elif there_meta.backup is not None:
            out.append(Change(there.address, there.name, DROP_BACKUP, p.epoch + 1))
    return out


def plan_rebuild(pairs: Sequence[Copies], returned: str) -> list[Change]:
    """Server ``returned`` answers again: every shard whose primary lives
    elsewhere and has no backup gets one there (the primary copies its state
    over whatever copy ``returned`` still has). A shard whose primary is on
    ``returned`` itself (it was never failed over) keeps it."""
    out = []
    for p in pairs:
        here, here_meta, there, there_meta = p.on(returned)
        if here.address != returned or there_meta is None:
            continue
        there_primary = there_meta.role == ROLE_PRIMARY and (
            here_meta is None or here_meta.role != ROLE_PRIMARY
            or there_meta.epoch > here_meta.epoch)
        if there_primary and there_meta.backup is None:
            out.append(Change(there.address, there.name, SET_BACKUP, p.epoch + 1, _peer(here)))
    return out


def plan_failback(pairs: Sequence[Copies]) -> list[tuple[Change, Change]]:
    """Hand the primary role back to the copy created primary where the other
    copy holds it and the created one is its backup: (DEMOTE the other, then
    PROMOTE the created one with the other as its backup), each pair in order."""
    out = []
    for p in pairs:
        o, c = p.other_meta, p.created_meta
        if o is None or c is None or o.role != ROLE_PRIMARY or c.role != ROLE_BACKUP:
            continue
        if o.backup is None or (o.backup.address, o.backup.name) != (p.created.address,
                                                                     p.created.name):
            continue
        e = p.epoch + 1
        out.append((Change(p.other.address, p.other.name, DEMOTE, e),
                    Change(p.created.address, p.created.name, PROMOTE, e, _peer(p.other))))
    return out


# -- act ---------------------------------------------------------------------------------------
def read_copies(strategy, address: str | None = None) -> list[Copies]:
    """What both servers say of each replicated shard (that has a copy on
    ``address``, if given)."""
    ask = ps_pool.servers().meta_or_none
    out = []
    for v in strategy.variables + strategy.tables:   # dynamic tables' shards too
        for k, (c, o) in enumerate(zip(v.shards, v.backups)):
            if address is None or address in (c.address, o.address):
                out.append(Copies(c, o, ask(c), ask(o)))
    return out


def apply_changes(changes: Sequence[Change]) -> None:
    """Send changes, one Reconfigure per server (in the order given within it)."""
    client_for = ps_pool.client_for
    by_addr: dict[str, list[Change]] = {}
    for c in changes:
        by_addr.setdefault(c.address, []).append(c)
    for addr, cs in by_addr.items():
        log.info("replication: %s on %s", ", ".join(
            f"{ACTION_NAMES[c.action]} {c.name} (epoch {c.epoch})" for c in cs), addr)
        client_for(addr).reconfigure([(c.name, c.action, c.epoch, c.peer) for c in cs],
                                     timeout=CHANGE_SECONDS)


def _sync_routes(strategy) -> None:
    """This process's routes after changes it made (workers learn them by asking)."""
    pairs = [(v, k) for v in strategy.variables + strategy.tables
             for k in range(len(v.backups))]
    ps_pool.servers().refresh(pairs)


# -- the watcher and the recovery ------------------------------------------------------------
class _PSRecovery:
    """Decides, then acts, for each parameter server that a step or the
    watch reported (see the module docstring). ``recoveries`` counts servers
    brought back after a restart (a metric, and what tests wait for)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self._lock = threading.Lock()
        self._active: dict[str, threading.Thread] = {}
        # Closures waiting for the verdict on a server: (closure, code, error).
        self._pending: dict[str, list] = {}
        self.recoveries = 0
        # Replication: servers failed over and not back yet.
        self.lost: set[str] = set()
        # Servers whose recovery failed the job (the watch leaves them alone).
        self.given_up: set[str] = set()
        # Servers not answering now, and since when (time.time()), for the metrics.
        self.away_since: dict[str, float] = {}
        # Signalled when a recovery ends (wait_for_recoveries waits on it).
        self._ended = threading.Condition(self._lock)

    def wait_for_recoveries(self, count: int, timeout: float | None = None) -> bool:
        """Block until ``count`` restarts have been recovered and none is running."""
        with self._lock:
            return self._ended.wait_for(
                lambda: self.recoveries >= count and not self._active, timeout)

    def wait_failed_over(self, address: str, timeout: float | None = None) -> bool:
        """Block until address's shards have failed over (replication)."""
        with self._lock:
            return self._ended.wait_for(lambda: address in self.lost, timeout)

    def active(self, address: str) -> bool:
        """Whether a recovery of address is running."""
        with self._lock:
            return address in self._active

    def wait(self, timeout: float | None = None) -> None:
        """Block until no recovery is in progress."""
        with self._lock:
            threads = list(self._active.values())
        for t in threads:
            t.join(timeout)

    def report(self, address: str, closure=None, code: str = "UNAVAILABLE",
               error: BaseException | None = None) -> None:
        """A closure failed on ``address`` (or the watch saw it change):
        recover it, then decide the closure. The closure is re-run if the
        server was unreachable or had restarted; a NOT_FOUND from a server
        that did not restart fails it with ``error``."""
        with self._lock:
            if closure is not None:
                self._pending.setdefault(address, []).append((closure, code, error))
            if address in self._active:
                return
            replicated = self.cluster.strategy.replication
            t = threading.Thread(
                target=self._recover_replicated if replicated else self._recover,
                args=(address,), daemon=True, name=f"PSRecovery-{address}")
            self._active[address] = t
            if not replicated:   # without replicas nothing can go on meanwhile
                self.cluster.pause()
            t.start()

    def _decide(self, address: str, restarted: bool | None, error: BaseException | None) -> None:
        """Settle the closures that failed on address, until none is left.

        restarted None means the server could not be recovered: every such
        closure fails with ``error``. Runs until the pending list is empty
        *and* the recovery is deregistered, under one lock, so a closure
        reported meanwhile is never left waiting.
        """
        queue = self.cluster.queue
        while True:
            with self._lock:
                pending = self._pending.pop(address, [])
                if not pending:
                    del self._active[address]
                    if not self._active or self.cluster.strategy.replication:
                        self.cluster.resume()
                    self._ended.notify_all()
                    return
            for closure, code, closure_error in pending:
                if restarted is None:
                    queue.fail(closure, error)
                elif code == "NOT_FOUND" and not restarted:
                    queue.fail(closure, closure_error)
                else:
                    queue.put_back(closure)

    def _away(self, address: str, since: float, waiting_for: str, last: list) -> None:
        """Say (at once, then every REPORT_SECONDS) that address is away."""
        now = time.monotonic()
        if now - last[0] < REPORT_SECONDS:
            return
        first = last[0] == 0.0
        last[0] = now
        wall = time.strftime("%H:%M:%S", time.localtime(time.time() - (now - since)))
        log.warning("parameter server %s %s since %s (%.0f s); %s", address,
                    "is unreachable" if first else "is still unreachable", wall, now - since,
                    waiting_for)

    def _probe(self, address: str):
        return self.cluster.ps_watch.probe(address)

    def _recover(self, address: str) -> None:
        """Without replication: wait for the server, then restore what it lost."""
        cluster, strategy = self.cluster, self.cluster.strategy
        start = time.monotonic()
        deadline = start + cluster.ps_recovery_timeout
        restarted, error, last = None, None, [0.0]
        try:
            while True:   # until recovered; a server that fails again mid-restore is retried
                try:
                    info = self._probe(address)
                except PSError:
                    self.away_since.setdefault(address, time.time())
                    if time.monotonic() > deadline or cluster.closed:
                        raise
                    self._away(address, start, (
                        f"training is paused until it answers (up to ps_recovery_timeout="
                        f"{cluster.ps_recovery_timeout:.0f}s); ParameterServerStrategy("
                        "replication=True) would fail over to the backups instead"), last)
                    time.sleep(0.2)   # backoff between probes of a server that is down
                    continue
                self.away_since.pop(address, None)
                restarted = info.server_id != strategy.server_ids.get(address)
                outcome = "unchanged"
                if restarted:
                    try:
                        outcome = self._refill(address)
                    except PSError as exc:   # did it fail again mid-refill? then wait again
                        if time.monotonic() > deadline or cluster.closed or \
                                not self._gone_since(address, info.server_id):
                            raise
                        log.warning("parameter server %s went away again while its shards "
                                    "were being restored (%s); waiting for it", address, exc)
                        continue
                    strategy.server_ids[address] = info.server_id
                    self.recoveries += 1
                _metrics.PS_RECOVERIES.labels(outcome).inc()
                if time.monotonic() - start > 1.0:
                    log.warning("parameter server %s answers again after %.1f s (%s)",
                                address, time.monotonic() - start, outcome)
                break
        except Exception as exc:
            restarted = None
            _metrics.PS_RECOVERIES.labels("failed").inc()
            if isinstance(exc, ParameterServerLost):
                error = exc
            else:
                error = WorkerCallError(
                    f"parameter server {address} could not be recovered (waited up to "
                    f"{cluster.ps_recovery_timeout}s): {exc}")
            log.error("%s", error)
            self.given_up.add(address)
            with self._lock:
                nothing_pending = not self._pending.get(address)
            if nothing_pending:
                cluster.queue.mark_failed_external(error)
        finally:
            self.away_since.pop(address, None)
            self._decide(address, restarted, error)
            cluster.clocks_changed()

    def _gone_since(self, address: str, server_id: str) -> bool:
        """Whether the server at address is down, or another process than
        ``server_id`` (it restarted again)."""
        try:
            return self._probe(address).server_id != server_id
        except PSError:
            return True

    def _refill(self, address: str) -> str:
        """A restarted server's shards, from the latest checkpoint or (when the
        user asked) as first created. Raises ParameterServerLost otherwise."""
        cluster, strategy = self.cluster, self.cluster.strategy
        names = [s.name for _, s in strategy.shards_on(address)] + [
            f"dynamic table {t!r}" for t in strategy.tables_on(address)]
        if not names and not any(address in t.addresses for t in strategy.tables):
            # (e.g. a server whose add failed, restarted: it held nothing)
            log.warning("parameter server %s restarted; it held none of the job's shards: "
                        "nothing to restore", address)
            return "unchanged"
        ckpt = cluster.checkpoint_manager
        if ckpt is not None and ckpt.latest():
            log.warning("parameter server %s restarted; restoring its shards from %s",
                        address, ckpt.latest())
            strategy.recreate_tables(address)   # empty: the restore fills them
            ckpt.restore(address=address)
            return "restored"
        if cluster.recreate_lost_shards:
            log.warning("parameter server %s restarted and no checkpoint holds its shards; "
                        "creating %s again as first created (recreate_lost_shards=True): "
                        "their training so far is lost", address, names)
            strategy.recreate_shards(address)
            strategy.recreate_tables(address)
            return "recreated"
        raise ParameterServerLost(
            f"parameter server {address} restarted empty and nothing holds the state of its "
            f"shards {names}: stopping rather than training on with them reset. To survive "
            "this, use ParameterServerStrategy(replication=True) (no update lost) or a "
            "CheckpointManager passed to ClusterCoordinator(checkpoint_manager=...) (back to "
            "the latest checkpoint); or pass ClusterCoordinator(recreate_lost_shards=True) to "
            "re-create them from their initializers")

    def _recover_replicated(self, address: str) -> None:
        """With replication: fail over at once if the server restarted, or once
        it has been away ps_failover_after seconds; rebuild and hand back
        when it answers again. Training never pauses."""
        cluster, strategy = self.cluster, self.cluster.strategy
        start, last = time.monotonic(), [0.0]
        failed_over = address in self.lost
        restarted = False
        try:
            while not cluster.closed:
                try:
                    info = self._probe(address)
                except PSError:
                    self.away_since.setdefault(address, time.time())
                    if failed_over:
                        return   # the watch reports it again when it answers
                    if time.monotonic() - start >= cluster.ps_failover_after:
                        self._fail_over(address)
                        failed_over = True
                        return
                    self._away(address, start, f"failing over to the backups after "
                               f"{cluster.ps_failover_after:.1f}s", last)
                    time.sleep(0.1)
                    continue
                self.away_since.pop(address, None)
                restarted = info.server_id != strategy.server_ids.get(address)
                if not (restarted or failed_over):
                    _metrics.PS_RECOVERIES.labels("unchanged").inc()
                    return
                if restarted and not failed_over:   # its copies are gone: fail over first
                    self._fail_over(address)
                self._rebuild(address)
                strategy.server_ids[address] = info.server_id
                self.recoveries += 1
                _metrics.PS_RECOVERIES.labels("replicated").inc()
                return
        except Exception as exc:   # a change refused or a server away mid-change: retried
            log.warning("replication: recovering %s failed (%s: %s); it is tried again on "
                        "the next check", address, type(exc).__name__, exc)
        finally:
            self._decide(address, True, None)   # closures that failed meanwhile run again
            cluster.clocks_changed()

    def _fail_over(self, address: str) -> None:
        strategy = self.cluster.strategy
        changes = plan_failover(read_copies(strategy, address), address)
        log.warning("parameter server %s is gone; failing over %d shard(s) to their other "
                    "copies: training goes on without waiting for it", address, len(changes))
        apply_changes(changes)
        self.lost.add(address)
        _sync_routes(strategy)
        _metrics.PS_RECOVERIES.labels("failover").inc()

    def _rebuild(self, address: str) -> None:
        strategy = self.cluster.strategy
        changes = plan_rebuild(read_copies(strategy, address), address)
        log.warning("parameter server %s answers again; copying %d shard(s) back to it",
                    address, len(changes))
        apply_changes(changes)
        self.lost.discard(address)
        for demote, promote in plan_failback(read_copies(strategy, address)):
            apply_changes([demote])
            apply_changes([promote])
        _sync_routes(strategy)

    def unreachable(self) -> dict[str, float]:
        """Servers not answering now, with the time (time.time()) since when."""
        return dict(self.away_since)


class _PSWatch:
    """Looks at every parameter server's server_id every ``interval`` seconds
    (from ``start``) and hands one that restarted or stopped answering to the
    Cluster's _PSRecovery (with replication: also one that was failed over
    and answers again)."""

    def __init__(self, cluster, interval: float):
        self.cluster, self.interval = cluster, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="PSWatch")

    def start(self) -> None:
        self._thread.start()

    def probe(self, address: str):
        """The server's ServerInfo, asked with a short deadline over the
        process's connection (coordinator/ps_pool.py). Raises PSError."""
        return ps_pool.servers().probe(address)

    def _loop(self) -> None:
        strategy = self.cluster.strategy
        recovery = self.cluster.recovery
        while not self._stop.wait(self.interval):
            for address, known in list(strategy.server_ids.items()):
                if address in recovery.given_up:
                    continue
                try:
                    changed = self.probe(address).server_id != known
                    back = address in recovery.lost
                except PSError:
                    changed, back = address not in recovery.lost, False
                if (changed or back) and not self._stop.is_set():
                    recovery.report(address)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:   # started
            self._thread.join()
