"""The DynamicTables service (protos/pstrain/v1/tables.proto): this
server's shards of dynamic embedding tables (psserver/dynamic_table.py).

Tables live beside the variables, in a namespace of their own: none of the
variable calls (Read, Push, Assign, Save...) reach them, and these calls
reach nothing else; only replication's GetMeta, Reconfigure and Replicate
reach a table shard, by the name ``~table~<table>`` (psserver.replication),
which no variable can have. Each table has a lock: a look-up changes the
table too (it counts, admits and evicts), so calls on one table run one at
a time and calls on different tables in parallel. Every request is checked
whole before anything changes: a refused call leaves the table as it was.

With replication a shard's primary journals what each call changed and
hands it to its backup (``_backup/<table>`` on the next server) as a
record; look-ups and updates are answered once the backup has them.

Sync mode (an update carrying SyncInfo, a look-up carrying SyncRead): a
shard gathers a step's updates, one per replica, and applies their sum (or
mean) once, as one table step, when enough replicas sent theirs or were
abandoned; a look-up for step s waits while an earlier step is being
gathered (psserver/sync.py, shared with the variables; a late update is
dropped whole and counted in ``late``). The applied step is journaled and
replicated as any update; sync updates go to both copies of a replicated
shard (the backup gathers too, and drops what its primary's record
applied), so a promoted backup can finish the step.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
import urllib.parse

import numpy as np
from google.protobuf import json_format

from protos.pstrain.v1 import tables_pb2
from psserver import replication as R
from psserver import sync as S
from psserver import tensor as T
from psserver.contract import (MAX_COUNT, AlreadyExists, Initializer, InvalidArgument, NotFound,
                               NotPrimary, ResourceExhausted, SyncSpec, VariableMeta)
from psserver.dynamic_table import DynamicTable, TableConfig, check_counts
from psserver.optimizers import make_optimizer
from psserver.saving import DELTA, FULL, KIND_NAMES, save_fields, write_tensors
from psserver.variable import check_initializer, check_name

#: Keys one call may carry (a look-up's reply is keys x dim values: the
#: message limit checks that as well).
MAX_KEYS = 1 << 24
_INT64_MAX = (1 << 63) - 1
#: Names of backup copies of replicated table shards (coordinator.embedding);
#: replication makes them (ImportTable with ``replica``), Create refuses them.
BACKUP_PREFIX = "_backup/"


def config_from_spec(spec: tables_pb2.TableSpec) -> TableConfig:
    """The TableConfig a TableSpec asks for; InvalidArgument saying what is wrong."""
    i = spec.initializer
    init = Initializer(kind=i.kind or "zeros", value=i.value, mean=i.mean, stddev=i.stddev,
                       minval=i.minval, maxval=i.maxval, seed=i.seed)
    check_initializer(init)
    kind = init.kind
    dtype = spec.dtype or "float32"
    if dtype in ("float32", "float64"):   # else TableConfig.check names the dtype
        largest = float(np.finfo(dtype).max)
        reach = {"constant": abs(init.value),
                 "random_uniform": max(abs(init.minval), abs(init.maxval)),
                 "random_normal": abs(init.mean) + 40 * init.stddev,
                 "truncated_normal": abs(init.mean) + 2 * init.stddev}.get(kind, 0.0)
        if not reach < largest:
            raise InvalidArgument(f"initializer {kind} would make values beyond {dtype}'s "
                                  "range (Inf); give smaller parameters")
    return TableConfig(
        dim=int(spec.dim), dtype=spec.dtype or "float32",
        initializer=init,
        min_count=int(spec.min_count) or 1, probability=spec.probability or 1.0,
        capacity=int(spec.capacity), policy=spec.policy or "lru",
        max_age_steps=int(spec.max_age_steps), max_age_seconds=spec.max_age_seconds,
        admission_capacity=int(spec.admission_capacity), seed=int(spec.seed)).check()


def _optimizer(spec: tables_pb2.TableSpec):
    name = spec.optimizer.name or "sgd"
    try:
        return make_optimizer(name, dict(spec.optimizer.params))
    except ValueError as exc:
        raise InvalidArgument(f"table optimizer: {exc}") from None


class _Entry(R.CopyState):
    """A table shard on this server and, with replication, its copy's role
    (psserver.replication: the primary journals what each call changed and
    hands it to its backup as a record; the backup does the same to its
    rows). Replicated under the name ``TABLE_PREFIX + name``."""

    def __init__(self, name: str, spec: tables_pb2.TableSpec, table: DynamicTable):
        self.table_name, self.name = name, R.TABLE_PREFIX + name
        self.spec, self.table = spec, table
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.version = 0      # changes made (look-ups that made or evicted rows, updates)
        self.role, self.epoch, self.draining = R.ROLE_PRIMARY, 0, False
        self.link: R.Link | None = None
        self.applied: collections.OrderedDict[int, int] = collections.OrderedDict()
        # Sync mode (psserver/sync.py): the step being gathered, the steps
        # applied, sync updates dropped whole (late), and the last applied
        # step's (rows updated, gradient rows dropped).
        self.acc: S.Accumulation | None = None
        self.sync_steps = 0
        self.dropped = 0
        self.step_counts = (0, 0)
        # A state copy arriving in pieces: (epoch, spec, table) until its last.
        self.staging: tuple | None = None

    def meta(self) -> VariableMeta:
        t = self.table
        slots = sum(a.nbytes for a in t.slots.values())
        return VariableMeta(self.name, t.dtype.name, (len(t), t.config.dim), self.version,
                            t.optimizer.name, t.optimizer.config(), t.value.nbytes, slots,
                            False, self.sync_steps, self.dropped, self.role, self.epoch,
                            self.link.peer if self.link is not None else None)

    def forget_changes(self) -> None:
        self.table.tracker = None

    # -- the primary ---------------------------------------------------------------------------
    def journal(self) -> bool:
        """Start noting what the next call changes, if a backup follows (lock held)."""
        if self.link is None:
            return False
        self.table.start_journal()
        return True

    def changed(self, journaled: bool, update_id: int = 0, update: bool = False) -> int | None:
        """After a call (lock held): a new version if it changed rows, and its
        record for the backup. Returns the version the caller waits for its
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
            self.link.add(rec)
        return self.version

    def apply_step(self) -> None:
        """Apply the sync step gathered in ``acc`` (lock held; psserver.sync
        calls it): the replicas' rows summed (or their mean), one table step,
        journaled for the backup like any update."""
        acc, self.acc = self.acc, None
        t = self.table
        keys, grads = S.combined_rows(acc, (t.config.dim,), t.dtype)
        dropped = t.stats.dropped
        journaled = self.journal()
        try:   # every part was checked when it came: a failure here is a bug half-way
            updated = t.apply_gradients(keys, grads)
        except BaseException:
            self.forget_changes()   # (which rows changed is not known: saved whole next)
            if journaled:
                t.take_journal()
                self.link.reset()
            raise
        self.sync_steps = acc.step + 1
        self.step_counts = (updated, t.stats.dropped - dropped)
        self.changed(journaled, update=True)

    def take_state(self, link: R.Link) -> dict:
        """The whole shard for its backup (lock held; psserver.forwarder)."""
        link.state_taken(self.version)
        return dict(spec=self.spec, rows=self.table.export(), step=self.table.step,
                    epoch=self.epoch, version=self.version, applied_ids=list(self.applied),
                    sync_steps=self.sync_steps)

    @staticmethod
    def send_state(client, peer_name: str, state: dict, seconds_per_mib: float) -> None:
        mib = sum(a.nbytes for a in state["rows"].values()) / 2**20
        client.import_table(peer_name[len(R.TABLE_PREFIX):], state["rows"], state["step"],
                            replica=dict(spec=state["spec"], epoch=state["epoch"],
                                         version=state["version"],
                                         applied_ids=state["applied_ids"],
                                         sync_steps=state["sync_steps"]),
                            timeout=60.0 + mib * seconds_per_mib)

    # -- the backup ----------------------------------------------------------------------------
    def check_record(self, rec: R.Record, what: str) -> None:
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
        if not (1 <= rec.version < R.MAX_EPOCH and 0 <= rec.epoch < R.MAX_EPOCH
                and 0 <= rec.sync_steps < R.MAX_EPOCH):
            raise InvalidArgument(f"{what}: version must be in [1, 2**62), epoch and "
                                  "sync_steps in [0, 2**62)")

    def follow(self, rec: R.Record) -> bool:
        """Apply the primary's record (lock held); False if it does not fit."""
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


class TableServicer:
    """The DynamicTables service: handlers take parsed requests (psserver/rpc.py)."""

    def __init__(self, max_message_bytes: int, store=None):
        self.max_message_bytes = max_message_bytes
        self._tables: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        # The store's --max-memory-bytes bounds variables and tables together.
        self._store = store
        if store is not None:
            store.table_bytes = self.total_bytes
            store.table_entries = lambda: list(self._tables.values())   # (commit_save)
            store.table_copy = self._copy_of   # replication reaches table shards
            store.table_copies = self._copies   # so does a sync step's AbandonStep

    def _copy_of(self, name: str) -> _Entry | None:
        with self._lock:
            return self._tables.get(name)

    def _copies(self) -> list[_Entry]:
        with self._lock:
            return list(self._tables.values())

    def _abandoned_for(self, step: int) -> set[int]:
        return self._store._abandoned_for(step) if self._store is not None else set()

    def total_bytes(self) -> int:
        """Bytes every table shard here holds (an estimate while one changes;
        taken without locks: it is asked with a table's lock or the registry's
        held)."""
        entries = list(self._tables.values())   # a copy: atomic under the GIL
        return sum(e.table.nbytes + (e.staging[2].nbytes if e.staging else 0)
                   for e in entries)

    def _check_room(self, name: str, rows: int, row_bytes: int) -> None:
        """ResourceExhausted, before anything changes, when ``rows`` more rows
        of ``row_bytes`` could take the server past --max-memory-bytes."""
        limit = None if self._store is None else self._store.max_bytes
        if limit is None or not rows:
            return
        held = self._store.held_bytes()
        need = rows * row_bytes
        if held + need > limit:
            raise ResourceExhausted(
                f"table {name!r} may need {need} more bytes ({rows} new rows), but this "
                f"server holds {held} of its {limit}-byte limit (--max-memory-bytes); give "
                "the table a capacity, spread it over more parameter servers, or raise "
                "--max-memory-bytes")

    def _entry(self, name: str) -> _Entry:
        with self._lock:
            entry = self._tables.get(name)
        if entry is None:
            raise NotFound(f"no dynamic table {name!r} on this server; create it first "
                           "(ParameterServerStrategy.create_embedding_table, or "
                           "PSClient.create_table)")
        return entry

    def _info(self, name: str, entry: _Entry) -> tables_pb2.TableInfo:
        t = entry.table
        s = t.stats
        return tables_pb2.TableInfo(
            name=name, spec=entry.spec, rows=len(t), step=t.step,
            **{f.name: min(getattr(s, f.name), _INT64_MAX) for f in dataclasses.fields(s)},
            bytes=t.nbytes, sync_steps=entry.sync_steps, late=min(entry.dropped, _INT64_MAX))

    # -- calls ---------------------------------------------------------------------------------
    def Create(self, request, context):
        name = check_name(request.name)
        if name.startswith(BACKUP_PREFIX):
            raise InvalidArgument(f"table names starting {BACKUP_PREFIX!r} are the backup "
                                  "copies replication makes; choose another name")
        config = config_from_spec(request.spec)
        optimizer = _optimizer(request.spec)
        spec = tables_pb2.TableSpec()
        spec.CopyFrom(request.spec)
        with self._lock:
            entry = self._tables.get(name)
            if entry is not None:
                if request.exist_ok and entry.spec == spec:
                    return self._info(name, entry)
                raise AlreadyExists(
                    f"dynamic table {name!r} exists"
                    + (" with another spec" if request.exist_ok else "")
                    + "; delete it first, or create with exist_ok and the same spec")
            row_bytes = _row_bytes(config, optimizer)
            hint = max(16, min(1024, (1 << 20) // row_bytes))   # ~1 MiB to start
            self._check_room(name, hint, row_bytes)
            entry = self._tables[name] = _Entry(
                name, spec, DynamicTable(config, optimizer, initial_rows_hint=hint))
        with entry.lock:
            return self._info(name, entry)

    def Lookup(self, request, context):
        entry = self._entry(request.name)
        keys = T.decode(request.keys, T.ID_DTYPES, "lookup keys")
        if keys.size > MAX_KEYS:
            raise InvalidArgument(f"{keys.size} keys in one look-up; send at most {MAX_KEYS}")
        counts = check_counts(keys, T.decode(request.counts, T.ID_DTYPES, "lookup counts")) \
            if request.HasField("counts") else None
        dim, itemsize = entry.table.config.dim, entry.table.dtype.itemsize
        if keys.size * dim * itemsize > self.max_message_bytes:
            raise ResourceExhausted(
                f"a look-up of {keys.size} keys returns {keys.size * dim * itemsize} bytes, "
                f"over the {self.max_message_bytes}-byte message limit; look up fewer keys "
                "per call")
        sync_step = _sync_read_step(request)
        with entry.lock:
            # A look-up changes the shard (ages, admission): a backup only follows.
            # Checked before a sync look-up waits (a backup would wait for
            # its primary's steps, until the deadline, only to refuse), and
            # again after (the wait releases the lock: the copy may be demoted).
            entry.check_primary()
            if sync_step is not None:   # the rows after step sync_step - 1 (psserver/sync.py)
                S.wait_for_earlier_steps(entry, sync_step, _deadline(context))
                entry.check_primary()
            if not request.no_admit:   # at most every key new: room for that first
                self._check_room(request.name, keys.size,
                                 _row_bytes(entry.table.config, entry.table.optimizer))
            journaled = entry.journal()
            try:
                rows = entry.table.lookup(keys, admit=not request.no_admit, counts=counts)
            except BaseException:
                entry.forget_changes()   # (a bug half-way: saved whole next)
                if journaled:   # (checked first: a failure here is a bug half-way,
                    entry.table.take_journal()   # so the backup gets the whole state)
                    entry.link.reset()
                raise
            version = entry.changed(journaled)
            if version is None and entry.link is not None:
                version = entry.version   # rows another look-up made may not be there yet
        if version is not None and self._store is not None:
            # rows are returned once the backup has them: a gradient for them
            # after a failover finds them there
            self._store._wait_acked([(entry, version)], _deadline(context))
        reply = tables_pb2.LookupReply()
        T.fill(reply.rows, rows)
        return reply

    def Update(self, request, context):
        entry = self._entry(request.name)
        keys = T.decode(request.keys, T.ID_DTYPES, "update keys")
        grads = T.decode(request.grads, T.VALUE_DTYPES, "update grads")
        if keys.ndim != 1:
            raise InvalidArgument(f"update keys must be 1-D, got shape {list(keys.shape)}")
        if keys.size > MAX_KEYS:
            raise InvalidArgument(f"{keys.size} keys in one update; send at most {MAX_KEYS}")
        if request.HasField("sync"):
            return self._update_sync(entry, keys, grads, S.check_rows_spec(
                SyncSpec.of(request.sync)), context)
        uid = int(request.update_id)
        with entry.lock:
            entry.check_primary()
            t = entry.table
            version = entry.applied_at(uid)
            if version is not None:   # a resend: applied once already
                reply = tables_pb2.TableUpdateReply(step=t.step)
            else:
                dropped = t.stats.dropped
                journaled = entry.journal()
                try:   # it checks the gradient whole first: a refusal changes nothing
                    updated = t.apply_gradients(keys, grads)
                except InvalidArgument:
                    if journaled:
                        t.take_journal()
                    raise
                except BaseException:   # a failure half-way: the backup gets the whole state
                    entry.forget_changes()   # (and the next incremental save)
                    if journaled:
                        t.take_journal()
                        entry.link.reset()
                    raise
                entry.changed(journaled, uid, update=True)
                version = entry.version
                reply = tables_pb2.TableUpdateReply(
                    updated=updated, dropped=t.stats.dropped - dropped, step=t.step)
        if self._store is not None:   # acknowledged once its backup has it (if any)
            self._store._wait_acked([(entry, version)], _deadline(context))
        return reply

    def _update_sync(self, entry: _Entry, keys: np.ndarray, grads: np.ndarray,
                     spec: SyncSpec, context) -> tables_pb2.TableUpdateReply:
        """A replica's update for a sync step (spec checked): gathered, the
        step applied once complete (psserver.sync.push; a late one dropped
        whole). A backup copy gathers too (it finishes the step if promoted)
        and applies only its primary's records."""
        abandoned = self._abandoned_for(spec.step)
        deadline = _deadline(context)
        with entry.lock:
            if entry.draining:
                entry.check_primary()
            keys, grads = entry.table.check_gradients(keys, grads)   # now, not at the apply
            late = S.push(entry, spec, (keys, grads), True, abandoned, deadline)
            completed = not late and entry.sync_steps > spec.step   # by this update
            updated, dropped = entry.step_counts if completed else (0, 0)
            return tables_pb2.TableUpdateReply(updated=updated, dropped=dropped,
                                               step=entry.table.step, late=late)

    def Info(self, request, context):
        entry = self._entry(request.name)
        with entry.lock:
            return self._info(request.name, entry)

    def List(self, request, context):
        with self._lock:
            entries = sorted(self._tables.items())
        reply = tables_pb2.ListTablesReply()
        for name, entry in entries:
            with entry.lock:
                reply.tables.append(self._info(name, entry))
        return reply

    def Save(self, request, context):
        """The shard's rows to a safetensors file under the server's
        --checkpoint-dir (psserver/saving.py confines it), written under a
        temporary name and renamed. An incremental save (``save_id``,
        ``since``: psserver/saving.py) writes the rows of the keys changed
        since that save point and the keys evicted since ("evicted"), or
        the whole shard where it cannot tell; the metadata has "save":
        full or delta, the step and the clock the ages are taken at."""
        entry = self._entry(request.name)
        if self._store is None:
            raise InvalidArgument("this server keeps no checkpoint directories")
        spec = self._store.check_save(**save_fields(request))   # all checked, then
        directory = self._store.save_directory(request.directory)
        self._store.note_save(spec)                              # the save id noted
        with entry.lock:
            t = entry.table
            changes = t.take_changes(spec.save_id, spec.stream, spec.since) \
                if spec.save_id else None
            if changes is not None and changes.whole:
                changes = None   # (too many evictions kept since: written whole)
            now = t.clock()
            state = t.export(None if changes is None else changes.keys, now, spec.weights_only)
            step = t.step
        kind = FULL if changes is None else DELTA
        meta = {"name": request.name, "kind": "dynamic_table", "step": str(step),
                "clock": repr(now), "save": KIND_NAMES[kind],
                "spec": json_format.MessageToJson(entry.spec, indent=None)}
        file = table_file(request.name)
        nbytes = write_tensors(directory, file, state, meta, delta=kind == DELTA)
        return tables_pb2.SaveTableReply(
            file=file, rows=int(state["keys"].size), bytes=nbytes, step=step, kind=kind,
            evicted=int(state["evicted"].size) if "evicted" in state else 0,
            incarnation=self._store.incarnation)

    def Import(self, request, context):
        state = {"keys": T.decode(request.keys, T.ID_DTYPES, "import keys")}
        for field in ("values", "age_seconds"):
            state[field] = T.decode(getattr(request, field), T.VALUE_DTYPES, f"import {field}")
        for field in ("age_steps", "freq"):
            state[field] = T.decode(getattr(request, field), T.ID_DTYPES, f"import {field}")
        for slot in request.slots:
            key = f"slot/{slot.name}"
            if key in state:
                raise InvalidArgument(f"import: slot {slot.name!r} given twice")
            state[key] = T.decode(slot.tensor, T.WIRE_DTYPES, f"import slot {slot.name!r}")
        if request.HasField("replica"):
            return self._import_copy(request, state)
        entry = self._entry(request.name)
        t = entry.table
        with entry.lock:
            entry.check_primary()   # a backup takes its primary's state only
            self._check_room(request.name, state["keys"].size,
                             _row_bytes(t.config, t.optimizer))
            rows = t.import_rows(state, int(request.step), reset=request.reset)
            entry.version += 1
            if request.reset:   # a restored shard: no sync step applied or pending
                entry.acc, entry.sync_steps = None, 0
                entry.cond.notify_all()
            if entry.link is not None:   # the backup copies the new state whole
                entry.link.reset()
        return tables_pb2.ImportTableReply(rows=rows)

    def _import_copy(self, request, state: dict) -> tables_pb2.ImportTableReply:
        """A primary's whole state, a piece at a time, making or replacing
        this server's copy as its backup (ImportTableRequest.replica). The
        pieces go into a table of their own (``staging``): the copy here
        keeps its rows, role and version (it may be promoted meanwhile,
        should the primary die mid-copy) until the last piece swaps it in."""
        r = request.replica
        name = check_name(request.name)
        spec = tables_pb2.TableSpec()
        spec.CopyFrom(r.spec)
        config, optimizer = config_from_spec(spec), _optimizer(spec)
        if not (0 <= r.epoch < R.MAX_EPOCH and 0 <= r.version < R.MAX_EPOCH
                and 0 <= r.sync_steps < R.MAX_EPOCH):
            raise InvalidArgument("a table copy's epoch, version and sync_steps must be in "
                                  "[0, 2**62)")
        step, n = int(request.step), state["keys"].size
        row_bytes = _row_bytes(config, optimizer)
        if request.reset:   # checked whole, and built, before anything here changes
            self._check_room(name, n, row_bytes)
            fresh = DynamicTable(config, optimizer, initial_rows_hint=max(16, n))
            fresh.import_rows(state, step, reset=True)
        with self._lock:
            entry = self._tables.get(name)
            if entry is None:
                if not request.reset:
                    raise InvalidArgument(f"table copy {name!r}: a later piece came first; "
                                          "the copy starts with reset")
                entry = self._tables[name] = _Entry(name, spec, fresh)
                entry.role, entry.epoch, entry.version = R.ROLE_BACKUP, r.epoch, -1
                entry.staging = (r.epoch, spec, fresh)
        with entry.lock:
            stale = entry.epoch > r.epoch or (
                entry.epoch == r.epoch and entry.role == R.ROLE_PRIMARY
                and not (entry.link is not None and entry.link.fenced))
            if stale:
                raise NotPrimary(
                    f"table {name!r} here is at epoch {entry.epoch} "
                    f"({R.ROLE_NAMES[entry.role]}); a state copy of epoch {r.epoch} comes "
                    "from a superseded primary and was refused")
            if request.reset:
                entry.staging = (r.epoch, spec, fresh)
            elif entry.staging is None or entry.staging[0] != r.epoch:
                raise InvalidArgument(f"table copy {name!r}: a piece of a state copy that "
                                      "was not started (or is complete); start with reset")
            else:
                self._check_room(name, n, row_bytes)
                entry.staging[2].import_rows(state, step, reset=False)
            if r.complete:   # swap it in: a backup at the primary's version
                _, entry.spec, entry.table = entry.staging
                entry.staging = None
                entry.role, entry.epoch, entry.link, entry.draining = \
                    R.ROLE_BACKUP, r.epoch, None, False
                entry.version = r.version
                entry.applied = collections.OrderedDict.fromkeys(
                    (int(i) for i in r.applied_ids), 0)
                entry.sync_steps = 0
                entry.synced_to(int(r.sync_steps))
                entry.cond.notify_all()
            return tables_pb2.ImportTableReply(rows=len(entry.table))

    def Delete(self, request, context):
        with self._lock:
            gone = self._tables.pop(request.name, None)
        if gone is not None:
            with gone.lock:   # its forwarding stops (it would make its backup again)
                gone.link, gone.staging = None, None
                gone.role = R.ROLE_BACKUP   # a call still holding it is refused
                gone.cond.notify_all()
        return tables_pb2.DeleteTableReply(deleted=gone is not None)


def _sync_read_step(request: tables_pb2.LookupRequest) -> int | None:
    """A sync look-up's step (None: not sync), checked."""
    if not request.HasField("sync"):
        return None
    step, timeout = request.sync.step, request.sync.step_timeout
    if not (0 <= step < MAX_COUNT and timeout >= 0):
        raise InvalidArgument(f"a sync look-up needs a step in [0, 2**62) and a step_timeout "
                              f">= 0, got step {step}, step_timeout {timeout}")
    return step


def _deadline(context) -> float | None:
    remaining = context.time_remaining() if context is not None else None
    return None if remaining is None else time.monotonic() + remaining


def table_file(name: str) -> str:
    """A table shard's checkpoint file name: "~" cannot start a variable's
    (psserver/saving.py quotes names, and "~" is no character of a name)."""
    return "~table~" + urllib.parse.quote(name, safe="") + ".safetensors"


def _row_bytes(config: TableConfig, optimizer) -> int:
    """A row's bytes with its optimizer slots and per-key bookkeeping (the
    upper figure psserver/dynamic_table.py states)."""
    slots = len(optimizer._array_slots(optimizer.create_slots(np.zeros((1, 1)))))
    return config.dim * np.dtype(config.dtype).itemsize * (1 + slots) + 104


def rows_of(reply: tables_pb2.LookupReply) -> np.ndarray:
    """The rows a LookupReply carries (a writable copy)."""
    return T.decode(reply.rows, T.VALUE_DTYPES, "lookup rows").copy()
