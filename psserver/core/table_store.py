"""TableStore: this server's shards of dynamic embedding tables
(psserver/core/dynamic_table.py), with no gRPC or protobuf in it; psserver/serve/tables.py
serves it as the DynamicTables service.

Tables live beside the variables, in a namespace of their own (only
replication's GetMeta, Reconfigure and Replicate reach a table shard, by the
name ``~table~<table>``), in one ShardRegistry and one MemoryBudget. One
shard is a psserver.core.table_copy.TableShardCopy (its table, role and sync
state), as one variable is a psserver.core.variable.Variable.

Guarantees:

* Each shard has a lock: a look-up changes the shard too (it counts, admits
  and evicts), so calls on one table run one at a time and calls on
  different tables in parallel.
* Every call is checked whole before anything changes: a refused call
  (InvalidArgument, NotFound, NotPrimary, ResourceExhausted...) leaves the
  shard as it was.
* With replication a shard's primary journals what each call changed and
  hands it to its backup (``_backup/<table>`` on the next server) as a
  record; look-ups and updates return once the backup has them
  (psserver.core.replication: DeadlineExceeded or NotPrimary otherwise, the
  change staying applied and queued).

Sync mode (psserver/core/sync.py, shared with the variables): a shard
gathers a step's updates, one per replica, and applies their sum (or mean)
once, as one table step; a look-up for step s waits while an earlier step
is gathered; a late update is dropped whole (``late``). Keys of buckets
another server holds are refused (psserver/core/table_moves.py).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import numpy as np

from psserver.contract import (
    BACKUP_PREFIX,
    MAX_COUNT,
    MAX_EPOCH,
    ROLE_BACKUP,
    TABLE_PREFIX,
    SyncSpec,
    TableRead,
    TableWrite,
)
from psserver.contract.checkpoint_format import slot_layout, table_file
from psserver.contract.keys import check_keys
from psserver.core import replication as R
from psserver.core import sync as S
from psserver.core import table_moves as M
from psserver.core.bags import check_bags
from psserver.core.dynamic_table import DynamicTable
from psserver.core.save_files import write_tensors
from psserver.core.saving import DELTA, FULL, KIND_NAMES
from psserver.core.shards import check_name
from psserver.core.table_config import (  # noqa: F401 (TableSpec: its name here too)
    TableConfig,
    TableSpec,
    TableStats,
    check_counts,
    row_bytes,
)
from psserver.core.table_copy import TableShardCopy
from psserver.errors import AlreadyExists, InvalidArgument, ResourceExhausted

#: Keys one call may carry (a look-up's reply is keys x dim values: its
#: reply limit checks that as well).
MAX_KEYS = 1 << 24


@dataclasses.dataclass(frozen=True)
class TableStatus:
    """A shard as Info and List report it (taken under its lock)."""
    name: str
    spec: TableSpec
    rows: int
    step: int
    stats: TableStats
    bytes: int
    sync_steps: int
    late: int


@dataclasses.dataclass(frozen=True)
class TableUpdate:
    """What an update did: rows changed, gradient rows dropped (keys without
    a row), the shard's step after it, and (sync) whether it came late and
    was dropped whole. A sync update reports the step's counts only if it
    completed the step (else 0, 0)."""
    updated: int
    dropped: int
    step: int
    late: bool = False


@dataclasses.dataclass(frozen=True)
class SavedTable:
    """A shard's checkpoint file: its name in the directory, rows, bytes,
    step, kind (psserver.core.saving FULL or DELTA), a delta's evicted keys,
    the server incarnation that took the save point, and the file's CRC-32."""
    file: str
    rows: int
    bytes: int
    step: int
    kind: int
    evicted: int
    incarnation: str
    crc32: int | None = None


@dataclasses.dataclass(frozen=True)
class StateCopy:
    """A piece of a primary's whole state, copied to its backup (tables.proto
    ReplicaCopy): the spec, the primary's epoch, version, update keys and
    sync steps applied, and whether this is the last piece."""
    spec: TableSpec
    epoch: int
    version: int
    complete: bool
    applied_ids: Sequence[int] = ()
    sync_steps: int = 0


class TableStore:
    """This server's dynamic table shards (see the module), in ``registry``
    beside the variables, bounded by ``budget`` with them; ``replicator``
    (psserver.core.replication.Replicator) waits for a backup's acknowledgement,
    ``steps`` (psserver.core.sync.StepGatherer) knows the abandoned replicas,
    ``saver`` (psserver.core.saving.Saver) confines and notes saves.
    ``describe_spec`` writes a spec into a checkpoint's metadata ("spec";
    psserver/serve/tables.py: protobuf JSON of TableSpec); None: not recorded."""

    def __init__(self, registry, budget, *, replicator, steps, saver,
                 describe_spec: Callable[[TableSpec], str] | None = None):
        self.registry, self.budget = registry, budget
        self._replicator, self._steps, self._saver = replicator, steps, saver
        self._describe_spec = describe_spec

    @classmethod
    def beside(cls, store, **kwargs) -> "TableStore":
        """The table store sharing a VariableStore's registry, budget, replication and saves."""
        return cls(store.registry, store.budget, replicator=store.replicator,
                   steps=store.steps, saver=store.saver, **kwargs)

    def _check_room(self, name: str, rows: int, row_bytes: int) -> None:
        """ResourceExhausted, nothing changed, if ``rows`` more rows pass --max-memory-bytes."""
        if rows:
            self.budget.check(rows * row_bytes, f"table {name!r} ({rows} new rows)",
                               "give the table a capacity, spread it over more parameter "
                               "servers, or raise --max-memory-bytes")

    @staticmethod
    def _status(copy: TableShardCopy) -> TableStatus:
        t = copy.table   # (its bytes: the arrays, and what a sync step gathered)
        return TableStatus(copy.table_name, copy.spec, len(t), t.step,
                           dataclasses.replace(t.stats), copy.held_bytes, copy.sync_steps,
                           copy.dropped)

    # -- calls ---------------------------------------------------------------------------------
    def create(self, name: str, spec: TableSpec, exist_ok: bool = False) -> TableStatus:
        """Make this server's shard of table ``name``. An existing one is
        returned with ``exist_ok`` and the same spec but for its capacity (a
        restore may have moved capacity between shards: the coordinator
        checks their sum); else AlreadyExists.
        InvalidArgument (a bad spec, a backup copy's name), ResourceExhausted."""
        check_name(name)
        if name.startswith(BACKUP_PREFIX):
            raise InvalidArgument(f"table names starting {BACKUP_PREFIX!r} are the backup "
                                  "copies replication makes; choose another name")
        config, optimizer = spec.config(), spec.make_optimizer()
        copy = self.registry.find(TABLE_PREFIX + name)
        if copy is None:
            per_row = row_bytes(config.dim, config.dtype,
                                len(slot_layout(optimizer, config.dim, config.dtype)[1]))
            hint = max(16, min(1024, (1 << 20) // per_row))   # ~1 MiB to start
            self._check_room(name, hint, per_row)
            made = TableShardCopy(name, spec, DynamicTable(config, optimizer,
                                                           initial_rows_hint=hint))
            copy = self.registry.add(made)
            if copy is made:
                with copy.lock:
                    return self._status(copy)
        if exist_ok and copy.spec.with_capacity(0) == spec.with_capacity(0):
            with copy.lock:
                return self._status(copy)
        raise AlreadyExists(f"dynamic table {name!r} exists"
                            + (" with another spec" if exist_ok else "")
                            + "; delete it first, or create with exist_ok and the same spec")

    def lookup(self, name: str, keys: np.ndarray, *, admit: bool = True,
               counts: np.ndarray | None = None, sync_step: int | None = None,
               deadline: float | None = None, max_reply_bytes: int | None = None) -> np.ndarray:
        """Rows of ``keys`` (psserver.core.dynamic_table.DynamicTable.lookup; a
        primary only: NotPrimary). ``sync_step``: first wait while an earlier
        step is being gathered (DeadlineExceeded after ``deadline``).
        ResourceExhausted, before anything changes, for rows over
        ``max_reply_bytes`` or past the memory budget. Returns once a backup
        has the rows made (a gradient for them after a failover finds them)."""
        return self.read_all([TableRead(name, keys, counts, admit, sync_step=sync_step)],
                             deadline, max_reply_bytes)[0]

    def read_all(self, reads: Sequence["TableRead"], deadline: float | None = None,
                 max_reply_bytes: int | None = None) -> list[np.ndarray]:
        """The rows of each look-up (a read's ReadRequest.table_lookups, any
        number of tables): every one checked (its table here and primary,
        keys, counts, bags, the reply's size against ``max_reply_bytes``)
        before any is made, each then made as ``lookup`` says (pooled bags:
        one row per bag, psserver/core/bags.py)."""
        return self.make_reads(self.check_reads(reads, max_reply_bytes), deadline)

    def check_reads(self, reads: Sequence["TableRead"],
                    max_reply_bytes: int | None = None) -> list[tuple]:
        """read_all's checks, all of them, nothing changed: what make_reads takes."""
        planned = [self._plan_read(r) for r in reads]
        nbytes = sum(p[4] for p in planned)
        if max_reply_bytes is not None and nbytes > max_reply_bytes:
            raise ResourceExhausted(
                f"the look-ups return {nbytes} bytes, over the {max_reply_bytes}-byte "
                "message limit; look up fewer keys per call")
        for p in planned:   # (a role read is atomic: checked again under each lock)
            p[0].check_primary()
        return planned

    def make_reads(self, checked: list[tuple], deadline: float | None = None
                   ) -> list[np.ndarray]:
        """The look-ups check_reads checked, made one after another; returns
        once the backups have the rows they made (one wait for all: their
        records go in one call)."""
        made, acked = [], []
        with R.sent_on_failure(acked):
            for p in checked:
                if p[-1].sync_step is not None:   # (it may wait at a barrier: sent first)
                    R.send_all(acked)
                rows, version = self._read(p, deadline)
                made.append(rows)
                if version is not None:
                    acked.append((p[0], version))
        self._replicator.wait_acked(acked, deadline)
        out = []
        for (*_, bags, _, _), rows in zip(checked, made):
            if bags is not None:
                found, inverse = bags
                rows = found.pool(rows[inverse])
            out.append(rows)
        return out

    def _plan_read(self, r: "TableRead") -> tuple:
        """(copy, keys to look up, counts, bags and their inverse, reply bytes,
        read): checked, nothing changed."""
        copy = self.registry.table(r.name)
        keys = check_keys(r.keys)
        if keys.size > MAX_KEYS:
            raise InvalidArgument(f"{keys.size} keys in one look-up; send at most {MAX_KEYS}")
        if r.sync_step is not None and not 0 <= r.sync_step < MAX_COUNT:
            raise InvalidArgument(f"a sync look-up needs a step in [0, 2**62), got "
                                  f"{r.sync_step}")
        t = copy.table
        bags = None
        if r.offsets is not None:
            if r.counts is not None:
                raise InvalidArgument(f"a look-up of bags of table {r.name!r} counts every "
                                      "occurrence of its keys itself: send no counts")
            found = check_bags(keys, r.offsets, r.weights, t.dtype, f"table {r.name!r}")
            uniq, inverse = np.unique(keys, return_inverse=True)
            counts = np.bincount(inverse.reshape(-1), minlength=uniq.size) if r.admit else None
            bags, keys, rows_out = (found, inverse.reshape(-1)), uniq, found.n
        else:
            if r.weights is not None:
                raise InvalidArgument(f"weights of a look-up of table {r.name!r} need offsets")
            counts = check_counts(keys, r.counts) if r.counts is not None else None
            rows_out = keys.size
        return copy, keys, counts, bags, rows_out * t.config.dim * t.dtype.itemsize, r

    def _read(self, planned: tuple, deadline: float | None) -> tuple[np.ndarray, int | None]:
        """(the rows of the keys, the version the backup must have first or None)."""
        copy, keys, counts, _, _, r = planned
        with copy.lock:
            # A look-up changes the shard (ages, admission): a backup only follows.
            # Checked before a sync look-up waits (a backup would wait for
            # its primary's steps, until the deadline, only to refuse), and
            # again after (the wait releases the lock: the copy may be demoted).
            copy.check_primary()
            if r.sync_step is not None:   # the rows after step sync_step - 1 (psserver/core/sync.py)
                S.wait_for_earlier_steps(copy, r.sync_step, deadline)
                copy.check_primary()
            copy.check_here(keys)   # (not a bucket handed to another server)
            t = copy.table
            if r.admit:   # at most every key new: room for that first
                self._check_room(r.name, keys.size, t.row_bytes)
            with copy.changing() as journaled:   # (checked first: a failure is a bug)
                rows = t.lookup(keys, admit=r.admit, counts=counts)
            version = copy.changed(journaled, deferred=True)
            if version is None and copy.link is not None:
                version = copy.version   # rows another look-up made may not be there yet
        return rows, version

    def update(self, name: str, keys: np.ndarray, grads: np.ndarray, *, update_id: int = 0,
               sync: SyncSpec | None = None, deadline: float | None = None) -> TableUpdate:
        """Apply row gradients (DynamicTable.apply_gradients; a primary only:
        NotPrimary), once per non-zero ``update_id`` (a resend is answered
        with the step only). ``sync``: this replica's part of a step (see the
        module; a hybrid-mode spec is InvalidArgument: row-wise gradients are
        applied on arrival there). Returns once a backup has it."""
        return self.update_all([TableWrite(name, keys, grads, update_id, sync)], deadline)[0]

    def update_all(self, writes: Sequence["TableWrite"],
                   deadline: float | None = None) -> list[TableUpdate]:
        """Each update (a push's PushRequest.table_updates, any number of
        tables): every one checked (its table here and primary, keys,
        gradients, bags, sync info) before any is applied, each then applied
        as ``update`` says (gradients of bags spread over their keys,
        psserver/core/bags.py); returns once the backups have them all."""
        return self.apply_writes(self.check_writes(writes), deadline)

    def check_writes(self, writes: Sequence["TableWrite"]) -> list[tuple]:
        """update_all's checks, all of them, nothing changed: what apply_writes takes."""
        planned = [self._plan_write(w) for w in writes]
        for copy, _, _, w in planned:
            if w.sync is None or copy.draining:
                copy.check_primary()
        return planned

    def apply_writes(self, checked: list[tuple], deadline: float | None = None,
                     acked: list | None = None) -> list[TableUpdate]:
        """The updates check_writes checked, applied one after another;
        returns once the backups have them, or, given ``acked``, adds there
        what to wait for (Replicator.wait_acked: the caller waits once for
        this and more)."""
        done, waits = [], [] if acked is None else acked
        with R.sent_on_failure(waits):
            for copy, keys, grads, w in checked:
                if w.sync is not None:
                    R.send_all(waits)   # (not held until its barrier passes: sent now)
                    done.append(self._update_sync(copy, keys, grads, w.sync, deadline))
                    continue
                result, version = self._apply(copy, keys, grads, w.update_id)
                done.append(result)
                waits.append((copy, version))
        if acked is None:
            self._replicator.wait_acked(waits, deadline)   # once the backups have them
        return done

    def _plan_write(self, w: "TableWrite") -> tuple:
        """(copy, keys, gradient rows, write): checked, nothing changed."""
        copy = self.registry.table(w.name)
        keys = check_keys(w.keys)
        if keys.ndim != 1:
            raise InvalidArgument(f"update keys must be 1-D, got shape {list(keys.shape)}")
        if keys.size > MAX_KEYS:
            raise InvalidArgument(f"{keys.size} keys in one update; send at most {MAX_KEYS}")
        t = copy.table
        grads = w.grads
        if w.offsets is not None:
            bags = check_bags(keys, w.offsets, w.weights, t.dtype, f"table {w.name!r}")
            grads = np.asarray(grads)
            if grads.shape != (bags.n, t.config.dim) or grads.dtype.kind != "f":
                raise InvalidArgument(
                    f"the gradient of {bags.n} bags of table {w.name!r} must be floating of "
                    f"shape {[bags.n, t.config.dim]}, got {grads.dtype} {list(grads.shape)}")
            keys, grads = bags.spread(grads, keys)
        elif w.weights is not None:
            raise InvalidArgument(f"weights of an update of table {w.name!r} need offsets")
        keys, grads = t.check_gradients(keys, grads)
        if w.sync is not None:
            S.check_rows_spec(w.sync)
        return copy, keys, grads, w

    def _apply(self, copy: TableShardCopy, keys: np.ndarray, grads: np.ndarray,
               update_id: int) -> tuple[TableUpdate, int]:
        """An asynchronous update (checked) under the shard's lock: its
        result and the version its backup must acknowledge."""
        with copy.lock:
            copy.check_primary()
            t = copy.table
            version = copy.applied_at(update_id)   # a resend: applied once (moved-in keys aside)
            keys, grads = (keys[:0], grads[:0]) if version is not None and \
                copy.received_at is None else copy.unapplied(update_id, keys, grads)
            if version is not None and not keys.size:
                return TableUpdate(0, 0, t.step), version
            dropped = t.stats.dropped
            # it checks the gradient whole first: a refusal changes nothing
            with copy.changing(refused=InvalidArgument) as journaled:
                # _plan_write checked them: again only if the shard was
                # replaced since by one of another shape (a restore)
                updated = t.apply_gradients(keys, grads, checked=grads.dtype == t.dtype
                                            and grads.shape[1:] == (t.config.dim,))
            copy.changed(journaled, update_id, update=True, deferred=True)
            return TableUpdate(updated, t.stats.dropped - dropped, t.step), copy.version

    def _update_sync(self, copy: TableShardCopy, keys: np.ndarray, grads: np.ndarray,
                     spec: SyncSpec, deadline: float | None) -> TableUpdate:
        """A replica's update for a sync step (spec checked): gathered, the
        step applied once complete (psserver.core.sync.push; a late one dropped
        whole). A backup copy gathers too (it finishes the step if promoted)
        and applies only its primary's records."""
        abandoned = self._steps.abandoned_for(spec.step)
        with copy.lock:
            if copy.draining:
                copy.check_primary()
            keys, grads = copy.table.check_gradients(keys, grads)   # now, not at the apply
            copy.check_here(keys)
            late = S.push(copy, spec, (keys, grads), True, abandoned, deadline, self.budget)
            completed = not late and copy.sync_steps > spec.step   # by this update
            updated, dropped = copy.step_counts if completed else (0, 0)
            return TableUpdate(updated, dropped, copy.table.step, late)

    def info(self, name: str) -> TableStatus:
        copy = self.registry.table(name)
        with copy.lock:
            return self._status(copy)

    def list(self) -> list[TableStatus]:
        """Every shard here, by table name."""
        out = []
        for copy in sorted(self.registry.tables(), key=lambda c: c.table_name):
            with copy.lock:
                out.append(self._status(copy))
        return out

    def delete(self, name: str) -> bool:
        """Drop table ``name``'s shard; whether there was one. A call still
        holding it is refused (NotPrimary) and its replication stops."""
        gone = self.registry.find(TABLE_PREFIX + name)
        if gone is None or not self.registry.remove(gone):
            return False
        with gone.lock:   # its forwarding stops (it would make its backup again)
            gone.link, gone.staging = None, None
            gone.role = ROLE_BACKUP   # a call still holding it is refused
            gone.cond.notify_all()
        return True

    def save(self, name: str, directory: str, **fields) -> SavedTable:
        """The shard's rows to a safetensors file in ``directory`` (confined
        to the server's --checkpoint-dir: psserver.core.saving), written under a
        temporary name and renamed. ``fields``: an incremental save's
        (save_id, since, incarnation, stream, weights_only: Saver.check_save):
        the rows of the keys changed since that save point and the keys
        evicted since ("evicted"), or the whole shard where it cannot tell;
        the metadata has "save": full or delta, the step and the clock the
        ages are taken at. A refused save notes nothing and writes nothing."""
        copy = self.registry.table(name)
        spec = self._saver.check_save(**fields)                  # all checked, then
        with self._saver.save_directory(directory) as target:
            self._saver.note_save(spec)                          # the save id noted
            return self._write(copy, name, spec, target)

    def _write(self, copy, name: str, spec, target) -> SavedTable:
        with copy.lock:
            t = copy.table
            M.expire_copies(copy)   # (a copy ahead's change point no move came for)
            changes = t.take_changes(spec.save_id, spec.stream, spec.since) \
                if spec.save_id else None
            if changes is not None and changes.whole:
                changes = None   # (too many evictions kept since: written whole)
            now = t.clock()
            state = M.unstaged(copy, t.export(None if changes is None else changes.keys, now,
                                              spec.weights_only))
            step, table_spec = t.step, copy.spec
        kind = FULL if changes is None else DELTA
        meta = {"name": name, "kind": "dynamic_table", "step": str(step),
                "clock": repr(now), "save": KIND_NAMES[kind]}
        if self._describe_spec is not None:
            meta["spec"] = self._describe_spec(table_spec)
        file = table_file(name)
        nbytes, crc = write_tensors(target, file, state, meta, delta=kind == DELTA)
        return SavedTable(file, int(state["keys"].size), nbytes, step, kind,
                          int(state["evicted"].size) if "evicted" in state else 0,
                          self._saver.incarnation, crc)

    def import_rows(self, name: str, state: dict, step: int, reset: bool,
                    capacity: int | None = None, applied: Sequence[tuple] = (),
                    incoming: tuple | None = None, staged: bool = False,
                    dropped: np.ndarray | None = None) -> int:
        """Put rows (DynamicTable.export's arrays) into the shard, emptied
        first with ``reset`` (a primary only: a backup takes its primary's
        state only, NotPrimary); ``capacity``: the
        shard's capacity from now on (a first piece's), set before the rows go in;
        ``applied``: [(buckets, update keys)] the rows' earlier shard applied
        (a move: TableShardCopy.take_moved_in); ``incoming``: the buckets a
        move brings and its epoch (TableShardCopy.take_in); ``staged``, a
        piece of a move's copy ahead (``reset``: its first), ``dropped``, the
        keys gone since it (a piece of the move's changes on top of it):
        psserver/core/table_moves.py receive. Returns the rows
        held. The backup, if any, copies the new state whole."""
        if capacity is not None and not 0 <= capacity < 1 << 40:
            raise InvalidArgument("an import's capacity is an integer in [0, 2**40)")
        copy = self.registry.table(name)
        with copy.lock:
            copy.check_primary()
            t = copy.table
            self._check_room(name, state["keys"].size, t.row_bytes)
            replace = None
            if (staged or dropped is not None) and (incoming is None or reset and not staged):
                raise InvalidArgument("a move's copy ahead or changes come with its buckets "
                                      "and epoch, and never empty the shard")
            if staged:   # (reset: the copy's first piece, not the shard emptied)
                first, reset = reset, False
            else:
                first = incoming is not None and copy.move_in_epoch != incoming[1]
            if not reset:   # (no key another shard holds, but for a move's)
                copy.take_in(check_keys(state["keys"]).reshape(-1), incoming, True)
                if incoming is not None:
                    replace = M.receive(copy, state, incoming, first, staged, dropped, step,
                                        capacity)
            before = t.config.capacity
            watched = M.watch(copy, incoming[0]) if staged and first else None
            if capacity is not None:
                t.set_capacity(capacity)
            shift = M.shift_of(copy, incoming, step, dropped) if first else 0
            try:
                rows = t.import_rows(state, step, reset=reset, replace=replace, staged=staged)
            except BaseException:   # refused whole: the capacity as it was
                t.set_capacity(before)
                if watched is not None:
                    M.unwatch(copy, watched)
                raise
            if staged:   # (its buckets not held here yet)
                M.staged_in(copy, incoming, first, step)
                if capacity is not None:
                    copy.spec = copy.spec.with_capacity(capacity)
                copy.version += 1
                return rows
            if first and dropped is not None:   # (the copy's other rows as the rows whole)
                M.rebase(copy, incoming[0], state["keys"], shift)
            if capacity is not None:
                copy.spec = copy.spec.with_capacity(capacity)
            copy.version += 1
            if reset:   # a restored shard: no sync step applied or pending, no bucket moved
                copy.acc, copy.sync_steps = None, 0
                copy.forget_moves()
                copy.cond.notify_all()
            copy.take_in(None, incoming, False)
            copy.take_moved_in(applied)
            if copy.link is not None:   # the backup copies the new state whole
                copy.link.reset()
        return rows

    def import_copy(self, name: str, state: dict, step: int, reset: bool,
                    piece: StateCopy) -> int:
        """A primary's whole state, a piece at a time, making or replacing
        this server's copy as its backup. The pieces go into a table of their
        own (``staging``): the copy here keeps its rows, role and version (it
        may be promoted meanwhile, should the primary die mid-copy) until the
        last piece swaps it in. NotPrimary for a copy of a superseded
        primary (CopyState.accept_state_copy); returns the rows held."""
        check_name(name)
        config, optimizer = piece.spec.config(), piece.spec.make_optimizer()
        if not (0 <= piece.epoch < MAX_EPOCH and 0 <= piece.version < MAX_EPOCH
                and 0 <= piece.sync_steps < MAX_EPOCH):
            raise InvalidArgument("a table copy's epoch, version and sync_steps must be in "
                                  "[0, 2**62)")
        n = state["keys"].size
        per_row = row_bytes(config.dim, config.dtype,
                            len(slot_layout(optimizer, config.dim, config.dtype)[1]))
        if reset:   # checked whole, and built, before anything here changes
            self._check_room(name, n, per_row)
            fresh = DynamicTable(config, optimizer, initial_rows_hint=max(16, n))
            fresh.import_rows(state, step, reset=True)
        copy = self.registry.find(TABLE_PREFIX + name)
        if copy is None:
            if not reset:
                raise InvalidArgument(f"table copy {name!r}: a later piece came first; "
                                      "the copy starts with reset")
            made = TableShardCopy(name, piece.spec, fresh)
            made.role, made.epoch, made.version = ROLE_BACKUP, piece.epoch, -1
            made.staging = (piece.epoch, piece.spec, fresh)
            copy = self.registry.add(made)
        with copy.lock:
            copy.accept_state_copy(piece.epoch)
            if reset:
                copy.staging = (piece.epoch, piece.spec, fresh)
            elif copy.staging is None or copy.staging[0] != piece.epoch:
                raise InvalidArgument(f"table copy {name!r}: a piece of a state copy that "
                                      "was not started (or is complete); start with reset")
            else:
                self._check_room(name, n, per_row)
                copy.staging[2].import_rows(state, step, reset=False)
            if piece.complete:   # swap it in: a backup at the primary's version
                _, copy.spec, copy.table = copy.staging
                copy.staging = None
                copy.role, copy.epoch, copy.link, copy.draining = \
                    ROLE_BACKUP, piece.epoch, None, False
                copy.version = piece.version
                copy.applied = collections.OrderedDict.fromkeys(
                    (int(i) for i in piece.applied_ids), 0)
                copy.sync_steps = 0
                copy.synced_to(int(piece.sync_steps))
                copy.cond.notify_all()
            return len(copy.table)
