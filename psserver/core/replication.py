"""Primary-backup replication of a variable or a dynamic table shard, inside
the parameter server (no grpc).

With ``ParameterServerStrategy(replication=True)`` every shard has two copies
on two servers: a *primary*, which takes the clients' updates, and a
*backup*. The primary applies each update, then hands exactly what it applied
to its backup as a ``Record`` (the gradient as applied: for sync mode the
combined one; for sparse updates the summed unique rows), in version order.
The backup applies each record on top of version - 1 with the same optimizer
code, so the copies are bit-identical at every version both have, for every
optimizer (chain replication: the primary orders, the backup follows).

Guarantees:

* An update is acknowledged to its client only once the backup acknowledged
  it (``Link.acked >= version``), or once the coordinator dropped the backup
  (DROP_BACKUP: the primary is then the only copy). So a backup promoted after
  its primary died holds every acknowledged update.
* Roles change only by the coordinator's ``Reconfigure`` changes, each with an
  epoch above the copy's (a fencing token): a primary whose records a newer
  epoch refuses (its backup was promoted meanwhile) stops acknowledging, and
  its clients move to the other copy (``NotPrimary``).
* A backup that lacks the state a record builds on (it restarted, or missed
  records) answers NEEDS_STATE; the primary then copies its whole state
  (value, slots, version, update keys, sync steps) and goes on from there.

A dynamic table shard (psserver/core/table_copy.py) is a copy too (a
psserver.core.shards.CopyState, as a variable is), named ``TABLE_PREFIX + table``:
its records say what a call changed (rows evicted and made: TABLE_ROWS;
rows updated: TABLE_UPDATE), which its
backup follows without deciding anything itself, and its state copies come
in pieces, swapped in whole by the last (a copy that never completed
cannot be promoted).

The network side (sending records, copying state) is ``psserver.serve.forwarder``;
this module holds a primary's ``Link`` to its backup and the ``Replicator``,
which runs the replication calls on the copies of a psserver.core.shards.
ShardRegistry, under each copy's lock. What a record does to a copy is the
copy's own (``check_record``, ``fits``, ``follow``), so a variable and a
table shard are replicated by the same code.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from psserver.contract import (
    ACTION_NAMES,
    DEMOTE,
    DROP_BACKUP,
    MAX_EPOCH,
    PROMOTE,
    ROLE_BACKUP,
    ROLE_PRIMARY,
    SET_BACKUP,
    TABLE_PREFIX,
    Peer,
)
from psserver.core.shards import check_name
from psserver.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotPrimary,
)

#: ReplicaRecord.Kind in ps.proto (TABLE_*: a dynamic table shard's, psserver/core/table_store.py).
DENSE, SPARSE, ASSIGN, TABLE_ROWS, TABLE_UPDATE = 0, 1, 2, 3, 4
TABLE_KINDS = (TABLE_ROWS, TABLE_UPDATE)
#: ReplicaAck.Status in ps.proto.
OK, NEEDS_STATE, FENCED = 0, 1, 2
#: Seconds an update waits for its backup's acknowledgement when its call has
#: no deadline of its own. The update stays applied and queued for the backup
#: after that: the caller resends it (same update keys) to learn its fate.
DEFAULT_WAIT_SECONDS = 60.0


@dataclasses.dataclass
class Record:
    """One update as the primary applied it, for its backup."""
    name: str             # the backup copy's name
    epoch: int
    version: int          # after applying it
    update_id: int
    sync_steps: int       # after applying it
    kind: int             # DENSE, SPARSE, ASSIGN, TABLE_ROWS or TABLE_UPDATE
    tensor: np.ndarray    # the gradient, the summed rows, or the assigned value
    ids: np.ndarray | None = None   # SPARSE: unique int64 row ids; TABLE_*: keys
    evicted: np.ndarray | None = None   # TABLE_ROWS: keys whose rows went first

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.tensor, self.ids, self.evicted) if a is not None)


class Link:
    """A primary's replication to its backup; guarded by the variable's lock,
    but for ``pending``, which has a lock of its own (the forwarder takes
    records while the primary applies the next one).

    ``acked``: the backup's version as last acknowledged (-1 until its state
    was copied). ``pending``: records not acknowledged yet, oldest first.
    ``needs_state``: the whole state must be copied before records can go.
    ``wake``: tells the forwarder there is work (records or a copy);
    ``wake(False)``, where there is a ``flush``: notes the work without
    waking the sender's thread (the caller flushes).
    """

    def __init__(self, peer: Peer, wake: Callable[[], None]):
        self.peer = peer
        self.acked = -1
        self.pending: collections.deque[Record] = collections.deque()
        self._pending_lock = threading.Lock()
        self.needs_state = True
        # The other copy refused our records with a newer epoch: this one is stale.
        self.fenced = False
        # Bumped by reset(): an acknowledgement of a call sent before it is stale.
        self.generation = 0
        self.wake = wake
        # Sends the pending records now, on the calling thread (set by a
        # forwarding that can; called without the variable's lock).
        self.flush: Callable[[], None] | None = None

    def reset(self) -> None:
        """The state was replaced (a restore): copy it whole again, forget acks."""
        self.generation += 1
        self.acked = -1
        with self._pending_lock:
            self.pending.clear()
        self.needs_state = True
        self.wake()

    def add(self, record: Record, deferred: bool = False) -> None:
        """Queue ``record``. ``deferred``: the caller flushes the link soon
        (its update waits for the acknowledgement: Replicator.wait_acked), so
        where a flush can send, the sender's thread is told of the work but
        not woken: one call then carries all of an update's records, and no
        other thread takes the send half-way (measured: a push of 6
        variables made 1.5 Replicate calls and 2 thread switches more)."""
        with self._pending_lock:
            self.pending.append(record)
        if deferred and self.flush is not None:
            self.wake(False)
        else:
            self.wake()

    def records(self) -> list[Record]:
        """The pending records, oldest first (a copy)."""
        with self._pending_lock:
            return list(self.pending)

    def _drop_through(self, version: int) -> None:
        with self._pending_lock:
            while self.pending and self.pending[0].version <= version:
                self.pending.popleft()

    def acknowledge(self, version: int) -> None:
        """The backup is at ``version``: records up to it are done."""
        self.acked = max(self.acked, version)
        self._drop_through(self.acked)

    def state_taken(self, version: int) -> None:
        """The whole state at ``version`` is being copied: records up to it
        are in that copy."""
        self.needs_state = False
        self._drop_through(version)


class Forwarding:
    """What a Replicator needs from the network side (psserver.serve.forwarder.
    Forwarder implements it): a wake function per peer address for new
    links, and stopping. Without one no copy can be a replicated primary.
    The sender reports each answer with ``replicator.acknowledged``."""

    def waker(self, replicator, var, peer: Peer) -> Callable[..., None]:   # pragma: no cover
        """A function that tells the sender to ``peer.address`` that var has
        work; where ``flusher`` gives a function, it takes ``notify``
        (default True; False: note the work, a flush follows)."""
        raise NotImplementedError

    def flusher(self, replicator, var, peer: Peer) -> Callable[[], None] | None:
        """A function that sends var's pending work now, on the calling thread
        (None: only the sender's own thread sends)."""
        return None

    def stop(self) -> None:   # pragma: no cover - interface
        pass


@contextlib.contextmanager
def sent_on_failure(applied: list):
    """Updates' records are queued deferred (Link.add: their call flushes
    them while it waits for the acknowledgements); should the call fail
    before that, the sender's thread is woken for those already applied
    (``applied``: (copy, ...) pairs, appended as each is applied), so their
    backups do not wait for a next call."""
    try:
        yield
    except BaseException:
        for var, *_ in applied:
            link = var.link
            if link is not None:
                link.wake()
        raise


def check_peer(peer: Peer) -> Peer:
    """``peer`` if it names a backup copy: a server address (printable, at
    most 1024 characters) and a variable's name or a table shard's
    replication name (TABLE_PREFIX + table name); else InvalidArgument."""
    if not peer.address or len(peer.address) > 1024 or not peer.address.isprintable():
        raise InvalidArgument(f"a backup needs a server address (host:port), got "
                              f"{peer.address!r}")
    table = peer.name.startswith(TABLE_PREFIX)
    check_name(peer.name[len(TABLE_PREFIX):] if table else peer.name)
    return peer


class Replicator:
    """The replication calls on the copies of ``registry`` (variables and
    table shards alike): a primary's links to its backup and the
    coordinator's role changes, a backup's records and the wait for a
    backup's acknowledgement. ``steps`` (psserver.core.sync.StepGatherer)
    completes a sync step a promoted copy gathered.

    ``forwarding`` is set by the server that can reach other servers
    (psserver.serve.forwarder); without it no copy can become a replicated
    primary (FailedPrecondition). Each call takes one copy's lock at a time."""

    def __init__(self, registry, steps):
        self._registry = registry
        self._steps = steps
        self.forwarding: Forwarding | None = None

    # -- the primary's side ------------------------------------------------------------
    def set_backup(self, name: str, peer: Peer, epoch: int,
                   deadline: float | None = None) -> None:
        """Make ``name`` (a primary) copy its whole state to ``peer`` and then
        forward every update there; return once the peer holds the state.
        Raises NotPrimary (a backup, or an epoch older than the copy's),
        FailedPrecondition (no forwarding), DeadlineExceeded."""
        if self.forwarding is None:
            raise FailedPrecondition(
                "this parameter server cannot replicate (its store has no forwarding); "
                "run a psserver process, which can")
        var = self._registry.copy(name)
        with var.lock:
            _fence(var, epoch, allow_same=True)
            var.check_primary()
            link = var.link
            var.epoch = epoch   # before the copy starts: it carries the epoch
            if link is None or link.peer != peer or link.fenced:
                var.link = Link(peer, self.forwarding.waker(self, var, peer))
                var.link.flush = self.forwarding.flusher(self, var, peer)
                var.link.wake()
            version = var.version
        self.wait_acked([(var, version)], deadline)

    def drop_backup(self, name: str, epoch: int) -> None:
        """The backup is gone: acknowledge updates without it from now on."""
        var = self._registry.copy(name)
        with var.lock:
            _fence(var, epoch, allow_same=True)
            var.check_primary()
            var.link, var.epoch = None, epoch
            var.cond.notify_all()

    def promote(self, name: str, epoch: int, peer: Peer | None = None,
                deadline: float | None = None) -> None:
        """Backup -> primary (its primary is gone); then, with ``peer``, copy
        the state to a new backup there (as set_backup). A sync step whose
        gradients this copy gathered completes here if it can."""
        var = self._registry.copy(name)
        with var.lock:
            if var.version < 0:   # a table copy whose state copy never completed
                raise FailedPrecondition(
                    f"{var.name!r} here is an incomplete state copy and cannot become "
                    "primary; nothing changed. Restore the shard from a checkpoint")
            if not (var.role == ROLE_PRIMARY and var.epoch == epoch and not var.draining):
                _fence(var, epoch, allow_same=False)
                var.role, var.epoch, var.draining = ROLE_PRIMARY, epoch, False
                var.forget_changes()   # promoted: its next incremental save is whole
                if var.link is not None and var.link.fenced:
                    var.link = None
                self._steps.complete(var)
                var.cond.notify_all()
        if peer is not None:
            self.set_backup(name, peer, epoch, deadline)

    def demote(self, name: str, epoch: int, deadline: float | None = None) -> None:
        """Primary -> backup, a planned hand-over: refuse client updates, wait
        until the backup acknowledged every version, then take records only.
        Raises DeadlineExceeded (then it stays primary and takes updates again)."""
        var = self._registry.copy(name)
        deadline = _deadline_or_default(deadline)
        with var.lock:
            if var.role == ROLE_BACKUP and var.epoch == epoch:
                return
            _fence(var, epoch, allow_same=False)
            var.draining = True
            if var.link is not None and var.link.acked < var.version:
                var.link.wake()   # (its records may be queued deferred: Link.add)
            try:
                while var.link is not None and var.link.acked < var.version:
                    left = deadline - time.monotonic()
                    if left <= 0 or var.link.fenced:
                        raise DeadlineExceeded(
                            f"{var.name!r}: its backup has not acknowledged version "
                            f"{var.version} in time; it stays primary. Retry the hand-over")
                    var.cond.wait(left)
            finally:
                var.draining = False
            var.role, var.link, var.epoch = ROLE_BACKUP, None, epoch
            var.forget_changes()
            var.cond.notify_all()

    def reconfigure_all(self, changes, deadline: float | None = None) -> list:
        """Several ReplicaChanges (name, action, epoch, peer), each checked
        first: a change that names no variable, an unknown action, a missing
        or bad peer or a stale epoch refuses the whole call with nothing
        changed. Returns each copy's VariableMeta after the changes."""
        plan: dict[str, tuple[int, int]] = {}   # name -> (role, epoch) once its changes ran
        for name, action, epoch, peer in changes:
            var = self._registry.copy(name)
            if action not in ACTION_NAMES:
                raise InvalidArgument(f"unknown replica change {action}; use one of "
                                      f"{sorted(ACTION_NAMES.values())}")
            if not 0 <= epoch < MAX_EPOCH:
                raise InvalidArgument(f"epoch {epoch} out of range [0, 2**62)")
            if action == SET_BACKUP and peer is None:
                raise InvalidArgument("SET_BACKUP needs the backup's address and name")
            if peer is not None:
                check_peer(peer)
                if peer.name.startswith(TABLE_PREFIX) != name.startswith(TABLE_PREFIX):
                    raise InvalidArgument(f"{name!r} and its backup {peer.name!r} must both "
                                          "be variables or both table shards ("
                                          f"{TABLE_PREFIX}<table>)")
            with var.lock:
                role, current = plan.get(name, (var.role, var.epoch))
            idempotent = (action == PROMOTE and role == ROLE_PRIMARY
                          or action == DEMOTE and role == ROLE_BACKUP)
            same = action in (SET_BACKUP, DROP_BACKUP) or idempotent
            if epoch < current or (epoch == current and not same):
                raise NotPrimary(f"{name!r}: a change of epoch {epoch} is stale (the copy "
                                 f"is, or would be, at epoch {current}); nothing changed")
            if action in (SET_BACKUP, DROP_BACKUP) and role != ROLE_PRIMARY:
                raise NotPrimary(f"{name!r} here is a backup copy: {ACTION_NAMES[action]} "
                                 "applies to a primary; nothing changed")
            plan[name] = ({PROMOTE: ROLE_PRIMARY, DEMOTE: ROLE_BACKUP}.get(action, role), epoch)
        return [self.reconfigure(*change, deadline) for change in changes]

    def reconfigure(self, name: str, action: int, epoch: int, peer: Peer | None,
                    deadline: float | None = None):
        """One ReplicaChange; returns the copy's VariableMeta after it."""
        if action == PROMOTE:
            self.promote(name, epoch, peer, deadline)
        elif action == SET_BACKUP:
            if peer is None:
                raise InvalidArgument("SET_BACKUP needs the backup's address and name")
            self.set_backup(name, peer, epoch, deadline)
        elif action == DROP_BACKUP:
            self.drop_backup(name, epoch)
        elif action == DEMOTE:
            self.demote(name, epoch, deadline)
        else:
            raise InvalidArgument(f"unknown replica change {action}; use one of "
                                  f"{sorted(ACTION_NAMES.values())}")
        copy = self._registry.copy(name)
        with copy.lock:
            return copy.meta()

    def wait_acked(self, pairs, deadline: float | None) -> None:
        """Block until each (variable, version)'s backup acknowledged it (or the
        variable has no backup). Raises NotPrimary if the copy was superseded
        before its backup had it, DeadlineExceeded if time runs out first:
        either way the update stays applied and queued, and a resend (same
        update keys) is not applied twice."""
        deadline = _deadline_or_default(deadline)
        pairs = list(pairs)
        send_all(pairs)
        for var, version in pairs:
            with var.lock:
                while True:
                    link = var.link
                    if link is None or link.acked >= version:
                        break
                    if link.fenced:
                        raise NotPrimary(
                            f"{var.name!r} here was superseded by its other copy before "
                            f"that copy acknowledged version {version}: resend the call to "
                            "the primary (same update keys; ask both copies' GetMeta)")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceeded(
                            f"the backup of {var.name!r} ({link.peer.address}) has not "
                            f"acknowledged version {version} yet; the update is applied "
                            "here and queued for it. Resend the call (same update keys): "
                            "it is not applied twice")
                    var.cond.wait(left)

    # called by the forwarder, with the variable's lock held
    def acknowledged(self, var, link: Link, generation: int, version: int,
                     status: int) -> None:
        if var.link is not link or link.generation != generation:
            return   # reset or replaced meanwhile: that answer is stale
        if status == OK:
            link.acknowledge(version)
        elif status == NEEDS_STATE:
            link.needs_state = True
            link.wake()
        elif status == FENCED:   # the other copy was promoted: this one is stale
            link.fenced = True
            var.role = ROLE_BACKUP
            var.forget_changes()
            link.wake()
        var.cond.notify_all()

    # -- the backup's side ---------------------------------------------------------------
    def replicate(self, records: list[Record]) -> list[tuple[str, int, int]]:
        """Apply a primary's records; (name, version after, status) per
        variable, in first-seen order. Each variable's records are applied in
        order on top of version - 1; one it has is skipped; a gap, a missing
        copy or a newer epoch than its own asks for the whole state
        (NEEDS_STATE), an older epoch or a copy that is primary is FENCED.
        Raises InvalidArgument (nothing applied) for a record that does not
        fit its variable."""
        groups: dict[str, list[Record]] = {}
        checked = set()
        for i, rec in enumerate(records):
            groups.setdefault(rec.name, []).append(rec)
            var = self._registry.find(rec.name)
            if var is not None:
                self._check_record(var, rec, f"record {i}")
                checked.add(rec.name)
        out = []
        for name, recs in groups.items():
            var = self._registry.find(name)
            if var is None or name not in checked:   # (made meanwhile: its records unchecked)
                out.append((name, -1, NEEDS_STATE))
                continue
            with var.lock:
                status = OK
                for rec in recs:
                    if var.role != ROLE_BACKUP or rec.epoch < var.epoch:
                        status = FENCED
                        break
                    if rec.epoch > var.epoch or rec.version > var.version + 1 or \
                            not var.fits(rec):   # (it may have been replaced since its check)
                        status = NEEDS_STATE
                        break
                    if rec.version == var.version + 1 and not var.follow(rec):
                        status = NEEDS_STATE
                        break
                out.append((name, var.version, status))
        return out

    def _check_record(self, var, rec: Record, what: str) -> None:
        """InvalidArgument unless ``rec`` fits its copy (its kind, the copy's
        own check_record) and its counters are in range."""
        if (rec.kind in TABLE_KINDS) != var.is_table:
            raise InvalidArgument(f"{what}: a record of kind {rec.kind} for {var.name!r}, "
                                  "which is " + ("a dynamic table" if var.is_table
                                                 else "a variable"))
        var.check_record(rec, what)
        if not (1 <= rec.version < MAX_EPOCH and 0 <= rec.epoch < MAX_EPOCH
                and 0 <= rec.sync_steps < MAX_EPOCH):
            raise InvalidArgument(f"{what}: version must be in [1, 2**62), epoch and "
                                  "sync_steps in [0, 2**62)")


def send_all(pairs) -> None:
    """Before waiting for ``pairs``' backups (or before a call blocks on
    something else with records of its own queued: a sync step's barrier
    later in the same call): every backup server's sender is told to send
    now (records may be queued deferred, Link.add), before any wait can fail
    and leave them; one server's on this thread (it waits
    anyway: two thread switches saved), the others' on their own threads, so
    the calls to several servers overlap."""
    by_peer: dict[str, Link] = {}
    for var, version in pairs:
        link = var.link
        if link is not None and link.acked < version:
            by_peer.setdefault(link.peer.address, link)
    here = None
    for link in by_peer.values():
        if here is None and link.flush is not None:
            here = link
        else:
            link.wake()
    if here is not None:
        here.flush()


def _fence(var, epoch: int, allow_same: bool) -> None:
    """Refuse a change whose epoch is older than the copy's (a superseded coordinator)."""
    if epoch < var.epoch or (epoch == var.epoch and not allow_same):
        raise NotPrimary(
            f"{var.name!r}: a change of epoch {epoch} is stale (this copy is at epoch "
            f"{var.epoch}); nothing changed. Read both copies' roles and epochs first")


def _deadline_or_default(deadline: float | None) -> float:
    return deadline if deadline is not None else time.monotonic() + DEFAULT_WAIT_SECONDS
