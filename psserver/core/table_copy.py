"""A dynamic table's shard as one copy of a replicated shard
(``TableShardCopy``, a psserver.core.shards.CopyState as a variable is): its
table (psserver/core/dynamic_table.py), role, epoch, version, update keys and
sync state, and what replication and sync steps do to it, all under its
lock. The calls that reach it are psserver/core/table_store.py's: the copy and
the calls are apart as psserver/core/variable.py and psserver/core/store.py are.

A call that may change rows runs in ``changing``: with a backup, the
primary journals what the call changed, and ``changed`` makes it one
record (TABLE_ROWS: rows evicted and made; TABLE_UPDATE: rows updated),
which the backup follows without deciding anything itself (``follow``).
A failure half-way (a bug) sends the backup the whole state instead, and
the next incremental save writes the shard whole.
"""
from __future__ import annotations

import collections
import contextlib
import threading

import numpy as np

from psserver.contract import ROLE_PRIMARY, TABLE_PREFIX, VariableMeta
from psserver.contract.keys import bucket_of
from psserver.core import replication as R
from psserver.core import sync as S
from psserver.core.dynamic_table import DynamicTable
from psserver.core.shards import CopyState
from psserver.errors import InvalidArgument, NotPrimary

#: Moved-in update keys a shard keeps at most (the oldest go first): four
#: sources' whole memories.
MOVED_IN_KEPT = 4 * CopyState.APPLIED_IDS_KEPT


class TableShardCopy(CopyState):
    """A table shard on this server and, with replication, its copy's role
    (psserver.core.replication: the primary journals what each call changed and
    hands it to its backup as a record; the backup does the same to its
    rows). Replicated under the name ``TABLE_PREFIX + table_name``."""

    is_table = True

    def __init__(self, table_name: str, spec, table: DynamicTable):
        # spec: the table as its creator described it (table_store.TableSpec)
        self.table_name, self.name = table_name, TABLE_PREFIX + table_name
        self.spec, self.table = spec, table
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.version = 0      # changes made (look-ups that made or evicted rows, updates)
        self.role, self.epoch, self.draining = ROLE_PRIMARY, 0, False
        self.link: R.Link | None = None
        self.applied: collections.OrderedDict[int, int] = collections.OrderedDict()
        # Sync mode (psserver/core/sync.py): the step being gathered, the steps
        # applied, sync updates dropped whole (late), and the last applied
        # step's (rows updated, gradient rows dropped).
        self.acc: S.Accumulation | None = None
        self.sync_steps = 0
        self.dropped = 0
        self.step_counts = (0, 0)
        # A state copy arriving in pieces: (epoch, spec, table) until its last.
        self.staging: tuple | None = None
        # Elastic servers (psserver/core/table_moves.py): the buckets of the
        # key space this shard handed to other servers (bool per bucket; their
        # keys refused here from then on) and the table's layout epoch after
        # the last move; None: it handed none over since it was made or reset.
        self.moved: np.ndarray | None = None
        self.moved_epoch, self.layout = 0, ""   # (the layout: JSON, served by Info)
        # Whether a drain's last move left this shard no bucket (MoveBucketsRequest
        # .source_leaves): a leaving server stops once all its shards are
        # (psserver/serve/leave.py).
        self.drained = False
        # Update keys the shards that moved buckets here had applied: key ->
        # the buckets (bool per bucket) whose keys it was applied to there,
        # oldest first; and updates remembered here since the last move in.
        self.moved_in: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self.since_moved_in = 0
        # Buckets moved in: how many moves brought buckets here (``receives``),
        # and the one that brought each (None: none came); for update keys
        # applied here since, the moved-in buckets their keys were of
        # (``own``: packed bits; an update key covers those and the buckets
        # this shard always held, not others: its sender may have planned on
        # a layout that sent other moved-in buckets' keys elsewhere).
        self.receives, self.received_at = 0, None
        self.own: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._applying: tuple = (0, None)   # (update key, its keys' buckets: unapplied())
        # Fences (table_moves.fence): the epochs of moves made here (the last
        # few) and the highest epoch fenced (a move of it or before refused).
        self.move_epochs: collections.deque = collections.deque(maxlen=64)
        self.fenced_epoch, self.move_in_epoch = 0, 0
        # Moves' rows copied ahead (table_moves.precopy). As their destination:
        # epoch -> bool per bucket of each copy held here, not yet this shard's
        # (their keys refused, not saved; ``staged_mask``: their union, or None;
        # the table's ``guard``/``guard_hit`` say which lost a row since). As a
        # source: epoch -> (buckets, destination, the change point it was taken
        # at, its stream) of each copy that arrived whole.
        self.staged: dict[int, np.ndarray] = {}
        self.staged_base: dict[int, tuple[int, int]] = {}
        self.staged_mask: np.ndarray | None = None
        self.precopied: dict[int, tuple] = {}
        self.move_points = 0   # (the change points moves take: -1, -2, ...)

    @property
    def tracker(self):
        """The shard's change tracking (psserver.core.tracking), or None."""
        return self.table.tracker

    @property
    def held_bytes(self) -> int:
        """The shard's arrays (its tracking included) and a state copy being
        received (read without the lock: an estimate)."""
        staging, acc = self.staging, self.acc
        return self.table.nbytes + (staging[2].nbytes if staging else 0) + \
            (0 if acc is None else acc.nbytes)

    def meta(self) -> VariableMeta:
        t = self.table
        slots = sum(a.nbytes for a in t.slots.values())
        return VariableMeta(self.name, t.dtype.name, (len(t), t.config.dim), self.version,
                            t.optimizer.name, t.optimizer.config(), t.value.nbytes, slots,
                            False, self.sync_steps, self.dropped, self.role, self.epoch,
                            self.link.peer if self.link is not None else None,
                            0 if self.acc is None else self.acc.step + 1)

    def forget_changes(self) -> None:
        self.table.tracker = None

    def remember(self, update_id: int) -> None:
        super().remember(update_id)
        if self.receives and update_id:
            uid, b = self._applying
            touched = np.zeros(self.received_at.size, bool)
            if uid == update_id and b is not None:
                touched[b[self.received_at[b] > 0]] = True
            had = self.own.get(update_id)
            bits = np.packbits(touched)
            self.own[update_id] = bits if had is None else had | bits   # (order: as applied's)
            while self.own and next(iter(self.own)) not in self.applied:
                self.own.popitem(last=False)   # (gone from applied: past the window)
        self._applying = (0, None)
        if self.moved_in and update_id:   # (as old as the memory's window: forgotten)
            self.since_moved_in += 1
            if self.since_moved_in > self.APPLIED_IDS_KEPT:
                self.moved_in.clear()

    def forget_moves(self) -> None:
        """A restore (reset): no bucket moved out or in, no memory of them."""
        self.moved, self.layout, self.receives, self.received_at = None, "", 0, None
        self.drained = False
        self.move_in_epoch = 0
        self.unstage(None)
        self.precopied = {}
        self.moved_in.clear()
        self.own.clear()
        self.move_epochs.clear()

    def take_in(self, keys: np.ndarray, incoming: tuple | None, check: bool) -> None:
        """An import's rows (lock held), with ``check`` before they go in:
        NotPrimary for keys of buckets another shard holds unless the import
        brings those buckets (``incoming``: bool per bucket, the move's
        layout epoch), or for a move of an epoch the shard was told or passed
        (its piece came after the move failed); then (not ``check``) the
        buckets are taken: held here from now on."""
        if check:
            if incoming is not None and incoming[1] <= self.moved_epoch:
                raise NotPrimary(f"table {self.table_name!r}: this shard knows the table's "
                                 f"layout epoch {self.moved_epoch}; rows of a move of epoch "
                                 f"{incoming[1]} came too late and were not taken")
            self.check_here(keys, but=None if incoming is None else incoming[0])
            return
        if incoming is not None:
            mask, epoch = incoming
            self.unstage([e for e, m in self.staged.items() if (m & mask).any()])   # (held now,
            # or replaced: psserver/core/table_moves.py receive)
            self.drained = False   # (buckets came back: it holds some again)
            if self.received_at is None:
                self.received_at = np.zeros(mask.size, np.int64)
            if self.move_in_epoch != epoch:   # (a move's first piece)
                self.receives += 1
                self.move_in_epoch = epoch
            self.received_at[mask] = self.receives
            if self.moved is not None:   # (held here from now on)
                self.moved = self.moved & ~mask
                if not self.moved.any():
                    self.moved = None

    def stage(self, epoch: int, mask: np.ndarray, base: tuple[int, int]) -> None:
        """A copy ahead of the move of ``epoch`` of the buckets in ``mask`` is
        held here (lock held); ``base``: (how far this shard's step was past
        its source's, the source's step), at the copy (table_moves.rebase)."""
        self.staged[epoch] = mask.copy()
        self.staged_base[epoch] = base
        self.unstage(())

    def unstage(self, epochs) -> None:
        """Forget the copies ahead of the moves of ``epochs`` (None: every one;
        lock held): their rows went, or are this shard's now."""
        for e in list(self.staged) if epochs is None else epochs:
            self.staged.pop(e, None)
            self.staged_base.pop(e, None)
        self.staged_mask = None if not self.staged else \
            np.logical_or.reduce(list(self.staged.values()))
        t = self.table
        t.guard = self.staged_mask
        t.guard_hit &= self.staged_mask if self.staged_mask is not None else False

    def take_moved_in(self, groups) -> None:
        """Remember update keys applied where rows of these buckets came from:
        [(bool per bucket, keys)] (lock held); at most MOVED_IN_KEPT keys,
        the oldest forgotten first (as the shard's own, past its window)."""
        merged: dict[tuple[int, int], np.ndarray] = {}   # (one array per pair of bucket sets)
        for mask, ids in groups:
            for i in ids:
                i = int(i)
                had = self.moved_in.pop(i, None)
                if had is not None:
                    pair = (id(had), id(mask))
                    if pair not in merged:
                        merged[pair] = had | mask
                    mask_i = merged[pair]
                else:
                    mask_i = mask
                self.moved_in[i] = mask_i
        while len(self.moved_in) > MOVED_IN_KEPT:
            self.moved_in.popitem(last=False)
        if groups:
            self.since_moved_in = 0

    def export_applied(self, mask: np.ndarray) -> list[tuple[np.ndarray, list]]:
        """What a move of the buckets in ``mask`` carries of the update keys
        applied here: the shard's own (each for the buckets it held when it
        applied it), and those that moved here, each for its buckets in
        ``mask`` (grouped by bucket set)."""
        if self.received_at is None:
            out = [(mask, list(self.applied))] if self.applied else []
        else:
            by_cover: dict[bytes, tuple] = {}   # (update keys of one cover together)
            for i in self.applied:
                own = self.own.get(i)
                by_cover.setdefault(b"" if own is None else own.tobytes(), (own, []))[1].append(i)
            out = [(mask & self._covered(own), ids) for own, ids in by_cover.values()]
            out = [g for g in out if g[0].any()]
        groups: dict[int, tuple[np.ndarray, list]] = {}
        for i, m in self.moved_in.items():
            if id(m) not in groups:
                groups[id(m)] = (m & mask, [])
            groups[id(m)][1].append(i)
        return out + [g for g in groups.values() if g[0].any()]

    def unapplied(self, update_id: int, keys: np.ndarray, grads: np.ndarray):
        """(keys, grads) of an asynchronous update (not applied here: the
        caller checked) that it was not applied to yet: check_here's
        refusal first, then keys of buckets whose earlier shard applied
        this update before they moved here are left out (lock held)."""
        b = bucket_of(keys) if self.moved is not None or self.received_at is not None \
            or self.moved_in or self.staged else None   # (only if moves touched it)
        self.check_here(keys, buckets=b)
        if not update_id:
            return keys, grads
        done = self.moved_in.get(update_id) if self.moved_in else None
        if update_id in self.applied and self.received_at is not None:   # (what it covered)
            mine = self._covered(self.own.get(update_id))
            done = mine if done is None else done | mine
        if done is not None:
            keep = ~done[b]
            keys, grads, b = keys[keep], grads[keep], b[keep]
        self._applying = (update_id, b)   # (remember: the moved-in buckets it touches)
        return keys, grads

    def _covered(self, own: np.ndarray | None) -> np.ndarray:
        """The buckets an update key applied here covers: those this shard
        always held, and the moved-in ones its keys were of (``own``)."""
        out = self.received_at == 0
        if own is not None:
            out |= np.unpackbits(own)[:out.size].astype(bool)
        return out

    def check_here(self, keys: np.ndarray, buckets: np.ndarray | None = None,
                   but: np.ndarray | None = None) -> None:
        """NotPrimary (lock held; nothing changed) if one of ``keys``
        is of a bucket this shard handed to another server, or another holds
        (``but`` those: an import that brings them), or a copy of which is
        here ahead of its move (``staged_mask``): the caller's description of the
        table is older than the move, and a row served or made here would be
        a wrong one. ``buckets``: the keys' (bucket_of), if the caller has them."""
        refused = self.moved if self.staged_mask is None else self.staged_mask if \
            self.moved is None else self.moved | self.staged_mask
        if refused is not None and keys.size:
            b = bucket_of(keys.reshape(-1)) if buckets is None else buckets
            gone = refused[b] if but is None else refused[b] & ~but[b]
            if gone.any():
                raise NotPrimary(
                    f"table {self.table_name!r}: {int(gone.sum())} of these keys are of "
                    f"buckets this server's shard handed to another server, or another "
                    f"server holds (the table's layout epoch {self.moved_epoch}); nothing was "
                    "read or changed here. Read "
                    "the table's layout here (TableInfo.layout: coordinator/embedding.py "
                    "does) and send the keys where it says")

    # -- the primary ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def changing(self, refused: tuple = ()):
        """Run a call that may change rows (lock held), journaling what it
        changes if a backup follows: yields whether it journals (pass it to
        ``changed``). An exception of a ``refused`` type changed nothing (the
        call checks its input whole first): the journal is dropped. Any
        other is a failure half-way (a bug): which rows changed is unknown,
        so the next incremental save writes the shard whole and the backup
        gets the whole state."""
        journaled = self.link is not None
        if journaled:
            self.table.start_journal()
        try:
            yield journaled
        except refused:
            if journaled:
                self.table.take_journal()
            raise
        except BaseException:
            self.forget_changes()
            if journaled:
                self.table.take_journal()
                self.link.reset()
            raise

    def changed(self, journaled: bool, update_id: int = 0, update: bool = False,
                deferred: bool = False) -> int | None:
        """After a call (lock held): a new version if it changed rows, and its
        record for the backup (``deferred``: the caller waits for it, which
        sends it: Link.add). Returns the version the caller waits for its
        backup to have (None: nothing to wait for)."""
        evicted, created, applied = self.table.take_journal() if journaled else (None,) * 3
        if not update and not (journaled and (evicted.size or created.size)):
            return None   # (without a backup, a look-up's rows are the state copy's business)
        self.version += 1
        self.remember(update_id)
        if journaled:
            if update:
                keys, rows = applied if applied is not None else (
                    np.zeros(0, np.int64), np.zeros((0, self.table.config.dim), self.table.dtype))
                rec = R.Record(self.link.peer.name, self.epoch, self.version, update_id,
                               self.sync_steps, R.TABLE_UPDATE, rows, keys)
            else:
                rec = R.Record(self.link.peer.name, self.epoch, self.version, 0,
                               self.sync_steps, R.TABLE_ROWS, np.zeros(0, self.table.dtype),
                               created, evicted)
            self.link.add(rec, deferred)
        return self.version

    def apply_step(self) -> None:
        """Apply the sync step gathered in ``acc`` (lock held; psserver.core.sync
        calls it): the replicas' rows summed (or their mean), one table step,
        journaled for the backup like any update."""
        acc, self.acc = self.acc, None
        t = self.table
        keys, grads = S.combined_rows(acc, (t.config.dim,), t.dtype)
        dropped = t.stats.dropped
        with self.changing() as journaled:   # every part was checked when it came
            updated = t.apply_gradients(keys, grads)
        self.sync_steps = acc.step + 1
        self.step_counts = (updated, t.stats.dropped - dropped)
        self.changed(journaled, update=True)

    def take_state(self, link: R.Link) -> dict:
        """The whole shard for its backup (lock held; psserver.serve.forwarder)."""
        link.state_taken(self.version)
        return dict(spec=self.spec, rows=self.table.export(), step=self.table.step,
                    epoch=self.epoch, version=self.version, applied_ids=list(self.applied),
                    sync_steps=self.sync_steps)

    # -- the backup ----------------------------------------------------------------------------
    def check_record(self, rec: R.Record, what: str) -> None:
        """InvalidArgument unless a primary's record (TABLE_ROWS or
        TABLE_UPDATE) is well formed for this shard."""
        def int_keys(a, field):
            if a is None or a.ndim != 1 or a.dtype != np.int64:
                raise InvalidArgument(f"{what}: a table record's {field} must be 1-D int64")
        int_keys(rec.ids, "keys")
        if rec.kind == R.TABLE_ROWS:
            int_keys(rec.evicted if rec.evicted is not None else np.zeros(0, np.int64),
                     "evicted keys")
        elif rec.tensor.shape != (rec.ids.size, self.table.config.dim) or \
                rec.tensor.dtype != self.table.dtype or not np.isfinite(rec.tensor).all():
            raise InvalidArgument(f"{what}: a table update's rows must be finite "
                                  f"{self.table.dtype.name} of shape "
                                  f"{[rec.ids.size, self.table.config.dim]}")

    def fits(self, rec: R.Record) -> bool:
        """A table record's fit is known only when it applies (``follow``)."""
        return rec.kind in R.TABLE_KINDS

    def follow(self, rec: R.Record) -> bool:
        """Apply the primary's record (lock held); False (nothing changed) if
        it does not fit this copy's rows (the primary then copies it whole)."""
        try:
            if rec.kind == R.TABLE_ROWS:
                evicted = rec.evicted if rec.evicted is not None else np.zeros(0, np.int64)
                self.table.follow_rows(evicted, rec.ids)
            else:
                self.table.follow_update(rec.ids, rec.tensor)
        except InvalidArgument:
            return False
        self.version = rec.version
        self.remember(rec.update_id)
        self.synced_to(rec.sync_steps)
        self.cond.notify_all()
        return True

    def synced_to(self, sync_steps: int) -> None:
        """The primary applied sync steps before ``sync_steps`` (lock held):
        a step this copy was gathering is done there."""
        self.sync_steps = max(self.sync_steps, sync_steps)
        if self.acc is not None and self.acc.step < self.sync_steps:
            self.acc = None
