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

A dynamic table shard (psserver/tables.py) is a copy too (``CopyState``),
named ``TABLE_PREFIX + table``: its records say what a call changed (rows
evicted and made: TABLE_ROWS; rows updated: TABLE_UPDATE), which its
backup follows without deciding anything itself, and its state copies come
in pieces, swapped in whole by the last (a copy that never completed
cannot be promoted).

The network side (sending records, copying state) is ``psserver.forwarder``;
this module holds the state each copy keeps, under the copy's lock.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from psserver.contract import (ROLE_BACKUP, ROLE_PRIMARY, DeadlineExceeded,  # noqa: F401
                               FailedPrecondition, InvalidArgument, NotFound, NotPrimary, Peer)

ROLE_NAMES = {ROLE_PRIMARY: "primary", ROLE_BACKUP: "backup"}
#: ReplicaRecord.Kind in ps.proto (TABLE_*: a dynamic table shard's, psserver/tables.py).
DENSE, SPARSE, ASSIGN, TABLE_ROWS, TABLE_UPDATE = 0, 1, 2, 3, 4
TABLE_KINDS = (TABLE_ROWS, TABLE_UPDATE)
#: Replication names of dynamic table shards: "~table~<table name>" ("~" starts
#: no variable name), so GetMeta, Reconfigure and records reach tables too.
TABLE_PREFIX = "~table~"
#: ReplicaAck.Status in ps.proto.
OK, NEEDS_STATE, FENCED = 0, 1, 2
#: ReplicaChange.Action in ps.proto.
PROMOTE, SET_BACKUP, DROP_BACKUP, DEMOTE = 0, 1, 2, 3
ACTION_NAMES = {PROMOTE: "PROMOTE", SET_BACKUP: "SET_BACKUP", DROP_BACKUP: "DROP_BACKUP",
                DEMOTE: "DEMOTE"}

#: Epochs stay below this: a coordinator adds one per change, within int64.
MAX_EPOCH = 1 << 62
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


class CopyState:
    """What every copy of a replicated shard keeps (a Variable, a dynamic
    table shard: psserver/tables.py), guarded by its ``lock``: ``role``,
    ``epoch`` (its fencing token), ``link`` (a primary's to its backup),
    ``draining`` (a planned hand-over), ``version`` and the update keys
    applied (``applied``: key -> the version it made, oldest first)."""

    name: str
    version: int
    role: int
    epoch: int
    draining: bool
    applied: collections.OrderedDict

    #: How many update keys a copy remembers: a resent update older than
    #: this many later updates would be applied again. Retries come within
    #: seconds, when far fewer updates have happened.
    APPLIED_IDS_KEPT = 8192

    def applied_at(self, update_id: int) -> int | None:
        """The version update_id made, if it was applied already (lock held)."""
        return self.applied.get(update_id) if update_id else None

    def remember(self, update_id: int) -> None:
        """Record that update_id made the current version (lock held)."""
        if update_id:
            self.applied[update_id] = self.version
            if len(self.applied) > self.APPLIED_IDS_KEPT:
                self.applied.popitem(last=False)

    def forget_changes(self) -> None:
        """Drop what an incremental save would ask about (psserver.tracking;
        lock held): the state was replaced, or the copy changed role."""
        raise NotImplementedError

    def check_primary(self) -> None:
        """Raise NotPrimary unless this copy takes client updates now (lock held
        or not: a role read is atomic)."""
        if self.role != ROLE_PRIMARY or self.draining:
            what = "handing over to its other copy" if self.draining else "a backup copy"
            raise NotPrimary(
                f"{self.name!r} on this server is {what} (epoch {self.epoch}) and takes no "
                "client updates; nothing was applied. Send it to the primary copy (ask "
                "both copies' GetMeta for role and epoch; coordinator.routes does)")


class Link:
    """A primary's replication to its backup; guarded by the variable's lock,
    but for ``pending``, which has a lock of its own (the forwarder takes
    records while the primary applies the next one).

    ``acked``: the backup's version as last acknowledged (-1 until its state
    was copied). ``pending``: records not acknowledged yet, oldest first.
    ``needs_state``: the whole state must be copied before records can go.
    ``wake``: tells the forwarder there is work (records or a copy).
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

    def add(self, record: Record) -> None:
        with self._pending_lock:
            self.pending.append(record)
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
    """What a store needs from the network side (psserver.forwarder.Forwarder
    implements it): a wake function per peer address for new links, and
    stopping. A store without one cannot be a replicated primary."""

    def waker(self, store, var, peer: Peer) -> Callable[[], None]:   # pragma: no cover
        """A function that tells the sender to ``peer.address`` that var has work."""
        raise NotImplementedError

    def flusher(self, store, var, peer: Peer) -> Callable[[], None] | None:
        """A function that sends var's pending work now, on the calling thread
        (None: only the sender's own thread sends)."""
        return None

    def stop(self) -> None:   # pragma: no cover - interface
        pass


class ReplicaMethods:
    """The VariableStore's replication methods (mixed into it, so they run on
    its variables and locks). ``forwarding`` is set by the server that can
    reach other servers (psserver.forwarder); without it a store cannot make
    a replicated primary (FailedPrecondition)."""

    forwarding: Forwarding | None = None
    #: Finds a dynamic table shard's copy by its table name (set by
    #: psserver.tables.TableServicer; None: no tables here).
    table_copy: Callable[[str], CopyState | None] | None = None
    #: Every dynamic table shard's copy here (set with table_copy).
    table_copies: Callable[[], list] | None = None

    def _copy(self, name: str):
        """The copy ``name`` names: a variable, or (TABLE_PREFIX) a table shard."""
        found = self._find_copy(name)
        if found is None:
            if name.startswith(TABLE_PREFIX):
                raise NotFound(f"no dynamic table {name[len(TABLE_PREFIX):]!r} on this "
                               "parameter server")
            return self._get(name)   # its NotFound
        return found

    def _find_copy(self, name: str):
        if name.startswith(TABLE_PREFIX):
            find = self.table_copy
            return None if find is None else find(name[len(TABLE_PREFIX):])
        return self._vars.get(name)

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
        var = self._copy(name)
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
        self._wait_acked([(var, version)], deadline)

    def drop_backup(self, name: str, epoch: int) -> None:
        """The backup is gone: acknowledge updates without it from now on."""
        var = self._copy(name)
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
        var = self._copy(name)
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
                if var.acc is not None:
                    from psserver import sync
                    sync.maybe_complete(var, self._abandoned_for(var.acc.step))
                var.cond.notify_all()
        if peer is not None:
            self.set_backup(name, peer, epoch, deadline)

    def demote(self, name: str, epoch: int, deadline: float | None = None) -> None:
        """Primary -> backup, a planned hand-over: refuse client updates, wait
        until the backup acknowledged every version, then take records only.
        Raises DeadlineExceeded (then it stays primary and takes updates again)."""
        var = self._copy(name)
        deadline = _deadline_or_default(deadline)
        with var.lock:
            if var.role == ROLE_BACKUP and var.epoch == epoch:
                return
            _fence(var, epoch, allow_same=False)
            var.draining = True
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
            var = self._copy(name)
            if action not in ACTION_NAMES:
                raise InvalidArgument(f"unknown replica change {action}; use one of "
                                      f"{sorted(ACTION_NAMES.values())}")
            if not 0 <= epoch < MAX_EPOCH:
                raise InvalidArgument(f"epoch {epoch} out of range [0, 2**62)")
            if action == SET_BACKUP and peer is None:
                raise InvalidArgument("SET_BACKUP needs the backup's address and name")
            if peer is not None:
                self._check_peer(peer)
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
        copy = self._copy(name)
        with copy.lock:
            return copy.meta()

    def _wait_acked(self, pairs, deadline: float | None) -> None:
        """Block until each (variable, version)'s backup acknowledged it (or the
        variable has no backup). Raises NotPrimary if the copy was superseded
        before its backup had it, DeadlineExceeded if time runs out first:
        either way the update stays applied and queued, and a resend (same
        update keys) is not applied twice."""
        deadline = _deadline_or_default(deadline)
        for var, version in pairs:
            link = var.link
            if link is not None and link.acked < version and link.flush is not None:
                link.flush()   # this thread waits anyway: it sends (saves two thread switches)
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
            var = self._find_copy(rec.name)
            if var is not None:
                self._check_record(var, rec, f"record {i}")
                checked.add(rec.name)
        out = []
        for name, recs in groups.items():
            var = self._find_copy(name)
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
                            not _fits(var, rec):
                        status = NEEDS_STATE
                        break
                    if rec.version == var.version + 1 and not _apply_record(var, rec):
                        status = NEEDS_STATE
                        break
                out.append((name, var.version, status))
        return out

    def _check_record(self, var, rec: Record, what: str) -> None:
        if (rec.kind in TABLE_KINDS) != hasattr(var, "follow"):
            raise InvalidArgument(f"{what}: a record of kind {rec.kind} for {var.name!r}, "
                                  "which is " + ("a dynamic table" if hasattr(var, "follow")
                                                 else "a variable"))
        if rec.kind in TABLE_KINDS:
            var.check_record(rec, what)
        elif rec.kind == SPARSE:
            if rec.ids is None or rec.ids.ndim != 1 or rec.ids.dtype != np.int64:
                raise InvalidArgument(f"{what}: sparse record ids must be 1-D int64")
            self._check_ids(var, rec.ids, what)
            self._check_grad(var, rec.tensor, (rec.ids.size,) + var.value.shape[1:],
                             f"{what} rows")
        elif rec.kind in (DENSE, ASSIGN):
            self._check_grad(var, rec.tensor, var.value.shape, what)
            if rec.kind == ASSIGN and rec.tensor.dtype != var.value.dtype:
                raise InvalidArgument(f"{what}: an assigned value must be "
                                      f"{var.value.dtype.name}")
        else:
            raise InvalidArgument(f"{what}: unknown record kind {rec.kind}")
        if not (1 <= rec.version < MAX_EPOCH and 0 <= rec.epoch < MAX_EPOCH
                and 0 <= rec.sync_steps < MAX_EPOCH):
            raise InvalidArgument(f"{what}: version must be in [1, 2**62), epoch and "
                                  "sync_steps in [0, 2**62)")


def _fits(var, rec: Record) -> bool:
    """Whether a checked record still fits var (it may have been replaced since)."""
    if rec.kind in TABLE_KINDS:
        return hasattr(var, "follow")   # the table says when it applies (_apply_record)
    rows = (rec.ids.size,) if rec.kind == SPARSE else ()
    want = rows + var.value.shape[len(rows):] if rows else var.value.shape
    return rec.tensor.shape == want


def _apply_record(var, rec: Record) -> bool:
    """The primary's update, applied the same way (lock held); False (nothing
    changed) where a table's record does not fit its state (copy it whole)."""
    if rec.kind in TABLE_KINDS:
        return var.follow(rec)
    with var.writing():
        if rec.kind == DENSE:
            var.optimizer.apply_dense(var.value, var.slots, rec.tensor)
        elif rec.kind == SPARSE:
            var.optimizer.apply_sparse(var.value, var.slots, rec.ids, rec.tensor)
        else:
            np.copyto(var.value, rec.tensor)
        var.version = rec.version
    if var.tracker is not None:   # (a backup tracks only if something saved from it)
        if rec.kind == SPARSE:
            var.tracker.mark_rows(rec.ids)
        else:
            var.tracker.mark_all()
    var.sync_steps = max(var.sync_steps, rec.sync_steps)
    if var.acc is not None and var.acc.step < var.sync_steps:
        var.acc = None   # the step this copy was gathering was applied by its primary
    var.remember(rec.update_id)
    var.cond.notify_all()
    return True


def _fence(var, epoch: int, allow_same: bool) -> None:
    """Refuse a change whose epoch is older than the copy's (a superseded coordinator)."""
    if epoch < var.epoch or (epoch == var.epoch and not allow_same):
        raise NotPrimary(
            f"{var.name!r}: a change of epoch {epoch} is stale (this copy is at epoch "
            f"{var.epoch}); nothing changed. Read both copies' roles and epochs first")


def _deadline_or_default(deadline: float | None) -> float:
    return deadline if deadline is not None else time.monotonic() + DEFAULT_WAIT_SECONDS
