"""One variable (or one shard of a sharded variable) on a parameter server:
its value, optimizer slots, version, idempotency keys, sync state and
replication role (``Variable``, a psserver.core.shards.CopyState), the checks of
what a call sends it (gradients, row ids, a primary's records); how initial
values and finiteness are checked; what a store tells its observer
(``StoreObserver``). Free of grpc and protobuf, as psserver.core.store.
"""
from __future__ import annotations

import collections
import contextlib
import threading

import numpy as np

from psserver.contract import ROLE_BACKUP, ROLE_PRIMARY, VariableMeta
from psserver.contract import optimizers as optim
from psserver.contract.initializers import (  # noqa: F401 (their names here too)
    INITIALIZER_PARAMS,
    INITIALIZERS,
    check_initializer,
    make_initial_value,
)
from psserver.contract.tensor import all_finite
from psserver.core import replication as R
from psserver.core import sync as S
from psserver.core.shards import CopyState
from psserver.errors import InvalidArgument


class StoreObserver:
    """What a VariableStore tells about its work as it happens (psserver.metrics
    counts it); these defaults do nothing. Called with a variable's lock held:
    keep them quick and never call back into the store."""

    def gradients(self, kind: str, mode: str, n: int = 1) -> None:
        """n gradients accepted: kind dense|sparse, mode async (applied) | sync (summed)."""

    def dropped(self, kind: str) -> None:
        """A sync gradient dropped (late, abandoned replica, or a replica's second)."""

    def sync_wait(self, op: str, seconds: float) -> None:
        """A sync call (op read|gather|push) waited this long for an earlier step."""

    def sync_staleness(self, steps: int) -> None:
        """A sync gradient arrived when its variable had applied this many steps past it."""


class Variable(CopyState):
    """One variable (or one shard of a sharded variable) and its slots."""

    def __init__(self, name, value: np.ndarray, optimizer: optim.Optimizer,
                 allow_nonfinite: bool):
        self.name = name
        self.value = value
        self.optimizer = optimizer
        self.slots = optimizer.create_slots(value)
        self.allow_nonfinite = allow_nonfinite
        self.version = 0
        # Held for every read and write of value, slots, version and sync state.
        self.lock = threading.Lock()
        # Signalled when a sync step is applied (sync.wait_for_earlier_steps waits on it).
        self.cond = threading.Condition(self.lock)
        self.sync_steps = 0                     # sync steps applied
        self.acc: S.Accumulation | None = None  # the sync step being gathered
        self.sync_buffer: np.ndarray | None = None   # sync mode's sum buffer, reused
        self.dropped = 0                        # late sync gradients dropped
        # Keys of the most recent updates applied (idempotent retries), oldest
        # first, each with the version it made (0: came with a copied state).
        self.applied: collections.OrderedDict[int, int] = collections.OrderedDict()
        # The value in memory readers on this host map (psserver.contract.shm.SharedValue), or None.
        self.shared = None
        # Replication (psserver.core.replication): this copy's role, its fencing
        # epoch, its link to its backup (a primary with one), and whether a
        # planned hand-over (DEMOTE) is draining it.
        self.role = ROLE_PRIMARY
        self.epoch = 0
        self.link: R.Link | None = None
        self.draining = False
        # Incremental saves (psserver.core.tracking): what changed since a save
        # point; None until a save names a save id.
        self.tracker = None

    def forget_changes(self) -> None:
        """The state was replaced or the copy changed role (lock held): what
        changed since a save point is unknown now (the next save writes it whole)."""
        self.tracker = None

    def writing(self):
        """Wrap every change of value and version (lock held): readers of a
        shared value see it as being written (its seqlock), then the new version."""
        return self.shared.writing(self) if self.shared is not None else contextlib.nullcontext()

    def record(self, kind: int, tensor: np.ndarray, ids: np.ndarray | None = None,
               update_id: int = 0, copy: bool = False, ahead: bool = False,
               deferred: bool = False) -> None:
        """Hand an update (lock held) to the backup, if any: the one just
        applied, or with ``ahead`` the one about to be applied (version + 1).
        ``copy``: the tensor may be the caller's memory (a shared segment).
        ``deferred``: the caller waits for the acknowledgement, which sends
        it (Link.add)."""
        link = self.link
        if link is not None:
            link.add(R.Record(link.peer.name, self.epoch, self.version + bool(ahead),
                              update_id, self.sync_steps, kind,
                              tensor.copy() if copy else tensor, ids), deferred)

    @contextlib.contextmanager
    def applying(self):
        """Wrap an update (lock held): the value's seqlock (writing), and,
        should the update fail half-way (a bug), a whole copy of the state
        for the backup (which had the record, if it went ahead, or will
        have none), and the whole variable in the next incremental save."""
        try:
            with self.writing():
                yield
        except BaseException:
            if self.link is not None:
                self.link.reset()
            self.forget_changes()   # (which rows changed is not known: saved whole next)
            raise

    @property
    def slot_nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots.values())

    @property
    def held_bytes(self) -> int:
        """Value, slots, change tracking (at most 1 + MAX_POINTS bytes a
        row: psserver/core/tracking.py) and what a sync step gathered (its
        row-wise parts, its sum buffer, kept between steps)."""
        tracker, acc, kept = self.tracker, self.acc, self.sync_buffer
        return self.value.nbytes + self.slot_nbytes + (0 if tracker is None else tracker.nbytes) \
            + (0 if acc is None else acc.nbytes) \
            + (0 if kept is None or (acc is not None and acc.total is kept) else kept.nbytes)

    # -- checks of what a call sends (no lock: shape and dtype do not change) -----------------
    def check_grad(self, grad: np.ndarray, shape, what: str) -> None:
        """InvalidArgument unless ``grad`` may update this variable: its dtype
        (float16 is accepted for float32/float64: wire compression,
        coordinator.compression, applied in the variable's dtype), ``shape``,
        and finite unless the variable allows otherwise."""
        if grad.dtype != self.value.dtype and not (
                grad.dtype == np.float16 and self.value.dtype in (np.float32, np.float64)):
            raise InvalidArgument(
                f"{what} for {self.name!r} is {grad.dtype.name} but the variable is "
                f"{self.value.dtype.name}; cast it before sending")
        if tuple(grad.shape) != tuple(shape):
            raise InvalidArgument(
                f"{what} for {self.name!r} has shape {list(grad.shape)} but must have "
                f"shape {list(shape)}")
        if not self.allow_nonfinite and not all_finite(grad):
            raise InvalidArgument(
                f"{what} for {self.name!r} contains NaN or Inf and was rejected; "
                "nothing was applied. Lower the learning rate or clip gradients, "
                "or create the variable with allow_nonfinite=True")

    def check_ids(self, ids: np.ndarray, what: str) -> np.ndarray:
        """``ids`` if they are integer row numbers of this variable, else InvalidArgument."""
        if ids.dtype.kind != "i":
            raise InvalidArgument(f"{what} ids must be int32 or int64, got {ids.dtype.name}")
        if self.value.ndim == 0:
            raise InvalidArgument(f"variable {self.name!r} is a scalar; it has no rows to {what}")
        rows = self.value.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            bad = ids[(ids < 0) | (ids >= rows)].ravel()[:5].tolist()
            raise InvalidArgument(
                f"{what} ids out of range for {self.name!r} with {rows} rows "
                f"(valid: 0..{rows - 1}); first bad ids: {bad}")
        return ids

    def check_rows(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """A row-wise gradient (rows[i] for row ids[i]) checked: its 1-D ids
        (returned), in range, and rows of the ids' count."""
        if ids.ndim != 1:
            raise InvalidArgument(f"sparse push ids must be 1-D, got shape {list(ids.shape)}")
        ids = self.check_ids(ids, "sparse push")
        self.check_grad(rows, (ids.shape[0],) + self.value.shape[1:], "sparse gradient rows")
        return ids

    # -- sync mode (psserver/core/sync.py) ------------------------------------------------------------
    def apply_step(self) -> None:
        """Apply the sync step gathered in ``acc`` once (lock held;
        psserver.core.sync.apply calls it): the optimizer on the replicas'
        gradients summed (scaled for their mean), one version, the record
        for the backup (Variable.applying: a failure half-way copies the
        whole state to the backup and the next save)."""
        with self.applying():
            acc, self.acc = self.acc, None
            scale = acc.scale()
            with np.errstate(all="ignore"):
                if acc.sparse:
                    uniq, summed = S.combined_rows(acc, self.value.shape[1:], self.value.dtype)
                    self.optimizer.apply_sparse(self.value, self.slots, uniq, summed)
                else:
                    if scale is not None:
                        acc.total *= acc.total.dtype.type(scale)
                    self.optimizer.apply_dense(self.value, self.slots, acc.total)
                    self.sync_buffer = acc.total   # reused by the next step
            self.version += 1
            self.sync_steps = acc.step + 1
            if self.tracker is not None:
                if acc.sparse:
                    self.tracker.mark_rows(uniq)
                else:
                    self.tracker.mark_all()
            if acc.sparse:   # the backup applies exactly this: new arrays, kept by the record
                self.record(R.SPARSE, summed, uniq)
            else:   # acc.total is reused by the next step: the record keeps a copy
                self.record(R.DENSE, acc.total, copy=True)

    # -- replication: the backup's side (psserver/core/replication.py) -----------------------------
    def check_record(self, rec: R.Record, what: str) -> None:
        """InvalidArgument unless a primary's record fits this variable."""
        if rec.kind == R.SPARSE:
            if rec.ids is None or rec.ids.ndim != 1 or rec.ids.dtype != np.int64:
                raise InvalidArgument(f"{what}: sparse record ids must be 1-D int64")
            self.check_ids(rec.ids, what)
            self.check_grad(rec.tensor, (rec.ids.size,) + self.value.shape[1:], f"{what} rows")
        elif rec.kind in (R.DENSE, R.ASSIGN):
            self.check_grad(rec.tensor, self.value.shape, what)
            if rec.kind == R.ASSIGN and rec.tensor.dtype != self.value.dtype:
                raise InvalidArgument(f"{what}: an assigned value must be "
                                      f"{self.value.dtype.name}")
        else:
            raise InvalidArgument(f"{what}: unknown record kind {rec.kind}")

    def fits(self, rec: R.Record) -> bool:
        """Whether a checked record still fits (the variable may have been
        replaced since it was checked)."""
        if rec.kind in R.TABLE_KINDS:
            return False
        rows = (rec.ids.size,) if rec.kind == R.SPARSE else ()
        want = rows + self.value.shape[len(rows):] if rows else self.value.shape
        return rec.tensor.shape == want

    def follow(self, rec: R.Record) -> bool:
        """The primary's update, applied the same way (lock held): the copies
        stay bit-identical. True (a variable's record always applies)."""
        with self.writing():
            if rec.kind == R.DENSE:
                self.optimizer.apply_dense(self.value, self.slots, rec.tensor)
            elif rec.kind == R.SPARSE:
                self.optimizer.apply_sparse(self.value, self.slots, rec.ids, rec.tensor)
            else:
                np.copyto(self.value, rec.tensor)
            self.version = rec.version
        if self.tracker is not None:   # (a backup tracks only if something saved from it)
            if rec.kind == R.SPARSE:
                self.tracker.mark_rows(rec.ids)
            else:
                self.tracker.mark_all()
        self.sync_steps = max(self.sync_steps, rec.sync_steps)
        if self.acc is not None and self.acc.step < self.sync_steps:
            self.acc = None   # the step this copy was gathering was applied by its primary
        self.remember(rec.update_id)
        self.cond.notify_all()
        return True

    def take_state(self, link: R.Link) -> dict:
        """The whole state, copied (lock held), as VariableStore.create takes
        it to make or replace the backup (role backup, this epoch); records
        up to its version are dropped from ``link`` (they are in it)."""
        link.state_taken(self.version)
        return dict(
            dtype=self.value.dtype.name, shape=self.value.shape,
            initial_value=self.value.copy(),
            slots={k: v.copy() for k, v in self.slots.items()},
            optimizer=self.optimizer.name, optimizer_params=self.optimizer.config(),
            allow_nonfinite=self.allow_nonfinite, version=self.version,
            applied_ids=np.fromiter(self.applied, np.uint64, len(self.applied)),
            sync_steps=self.sync_steps, role=ROLE_BACKUP, epoch=self.epoch, overwrite=True)

    def meta(self) -> VariableMeta:
        return VariableMeta(self.name, self.value.dtype.name, self.value.shape,
                            self.version, self.optimizer.name,
                            self.optimizer.config(), self.value.nbytes,
                            self.slot_nbytes, self.allow_nonfinite,
                            self.sync_steps, self.dropped, self.role, self.epoch,
                            self.link.peer if self.link is not None else None,
                            0 if self.acc is None else self.acc.step + 1)
