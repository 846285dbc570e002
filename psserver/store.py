"""VariableStore: the parameter server's state and logic, with no gRPC in it.

Guarantees (each method's docstring repeats the ones that concern it):

* Every request is validated in full before anything changes. A method that
  raises a ``PSError`` has left every variable, slot and version exactly as
  it was, also for requests that name several variables.
* An update (push, sparse push, assign) is applied atomically on its
  variable: it holds that variable's lock for the whole optimizer step. A read
  or gather takes its copy under the same lock, so it never sees half of an
  update, and reports the version its copy belongs to.
* ``version`` starts at 0 on create and grows by exactly one per applied
  update. Updates of one variable are applied one at a time, in the order
  they take its lock (asynchronous SGD: no update is lost, none is merged).

One variable is a psserver.variable.Variable; the store's sync-mode calls
are psserver.sync.SyncMethods, its replication calls
psserver.replication.ReplicaMethods, its checkpoint files
psserver.saving.SaveMethods (mixins over the store's state).
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from psserver import optimizers as optim
from psserver import replication as R
from psserver import sync as S
from psserver import tensor as T
from psserver.contract import Initializer, VariableMeta  # noqa: F401
from psserver.contract import (AlreadyExists, InvalidArgument, NotFound, NotPrimary,
                               ResourceExhausted)
from psserver.tensor import VALUE_DTYPES, check_dtype, check_shape, nbytes_of
from psserver.saving import SaveMethods
from psserver.variable import (StoreObserver, Variable, all_finite, check_name,  # noqa: F401
                               make_initial_value)

class VariableStore(R.ReplicaMethods, S.SyncMethods, SaveMethods):
    """All variables of one parameter-server task.

    Args:
      max_bytes: refuse creates that would make what the server holds
        (held_bytes: values, slots, change tracking, dynamic tables) exceed
        this many bytes (RESOURCE_EXHAUSTED). None: no limit but the machine's.
    """

    def __init__(self, max_bytes: int | None = None, observer: StoreObserver | None = None,
                 checkpoint_dirs: Sequence[str] | None = None):
        self.max_bytes = max_bytes
        # Where save() may write: inside one of these (None: anywhere, for
        # in-process use; a psserver task sets what --checkpoint-dir says).
        self.checkpoint_dirs = None if checkpoint_dirs is None else tuple(
            os.path.realpath(d) for d in checkpoint_dirs)
        self.observer = observer or StoreObserver()
        # Bytes the server's dynamic tables hold (psserver/tables.py sets it):
        # max_bytes bounds variables and tables together.
        self.table_bytes: Callable[[], int] = lambda: 0
        # The server's dynamic table shards (psserver/tables.py sets it):
        # commit_save reaches their trackers too.
        self.table_entries: Callable[[], list] = lambda: []
        self._init_saving()
        self._vars: dict[str, Variable] = {}
        self._lock = threading.Lock()   # guards _vars and _abandoned (not the variables)
        # Sync mode: step -> replicas that will not push for it (their worker died).
        self._abandoned: dict[int, set[int]] = {}

    # -- lookup ------------------------------------------------------------
    def _get(self, name: str) -> Variable:
        try:
            return self._vars[name]
        except KeyError:
            raise NotFound(
                f"no variable {name!r} on this parameter server; create it first "
                "(or check the name and which server holds it)") from None

    def total_bytes(self) -> int:
        with self._lock:
            vs = list(self._vars.values())
        return sum(v.value.nbytes + v.slot_nbytes for v in vs)

    def held_bytes(self) -> int:
        """What --max-memory-bytes bounds: variables' values and slots, their
        change tracking (psserver/tracking.py: at most 1 + MAX_POINTS bytes a
        row) and every dynamic table shard (its tracking included). An
        estimate while things change: taken without the variables' locks."""
        with self._lock:
            vs = list(self._vars.values())
        tracking = sum(t.nbytes for t in (v.tracker for v in vs) if t is not None)
        return self.total_bytes() + tracking + self.table_bytes()

    def __len__(self) -> int:
        return len(self._vars)

    def variables_snapshot(self) -> list[Variable]:
        """The variables held now (for metrics: read sizes only, no values)."""
        with self._lock:
            return list(self._vars.values())

    # -- create / delete / meta ---------------------------------------------
    def create(self, name: str, dtype: str, shape: Sequence[int], *,
               initial_value: np.ndarray | None = None,
               initializer: Initializer | None = None,
               optimizer: str = "sgd",
               optimizer_params: Mapping[str, float] | None = None,
               allow_nonfinite: bool = False,
               exist_ok: bool = False,
               slots: Mapping[str, np.ndarray] | None = None,
               version: int = 0,
               overwrite: bool = False,
               applied_ids: Sequence[int] = (),
               sync_steps: int = 0,
               role: int = R.ROLE_PRIMARY,
               epoch: int = 0,
               backup: R.Peer | None = None,
               deadline: float | None = None) -> VariableMeta:
        """Create a variable. Raises InvalidArgument, AlreadyExists, ResourceExhausted.

        With exist_ok, an existing variable of the same dtype, shape and
        optimizer is returned as it is (its value is not reset).

        Restoring a checkpoint: ``slots`` gives every optimizer slot and
        ``version`` the version to start at. With ``overwrite``, an existing
        variable of the same dtype, shape and optimizer gets the new value,
        slots and version at once (it is created if missing). A replicated
        primary then copies its new state to its backup before this returns;
        a backup copy is not restored this way (NotPrimary: restore its primary).

        Replication (psserver.replication): ``backup`` makes a primary that
        copies its state to that peer and forwards every update there; this
        returns once the backup holds the state (DeadlineExceeded after
        ``deadline``, the primary still being made). ``role=ROLE_BACKUP`` is
        a primary's copy of its state (with ``initial_value``, ``slots``,
        ``version``...): it replaces whatever copy of that name exists unless
        that copy has a newer epoch (NotPrimary: the sender was superseded).
        """
        check_name(name)
        dt = check_dtype(dtype, VALUE_DTYPES, "variable dtype")
        shape = check_shape(shape, "variable shape")
        try:
            opt = optim.make_optimizer(optimizer, optimizer_params or {})
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if initial_value is not None:
            if initial_value.dtype != dt or initial_value.shape != shape:
                raise InvalidArgument(
                    f"initial value of {name!r} is {initial_value.dtype.name} "
                    f"{list(initial_value.shape)} but the variable is declared "
                    f"{dt.name} {list(shape)}")
            if not allow_nonfinite and not all_finite(initial_value):
                raise InvalidArgument(
                    f"initial value of {name!r} contains NaN or Inf; pass "
                    "allow_nonfinite=True to keep such values")
        if not (0 <= version < S.MAX_COUNT and 0 <= sync_steps < S.MAX_COUNT
                and 0 <= epoch < R.MAX_EPOCH):
            raise InvalidArgument(f"version, sync_steps and epoch must be in [0, 2**62), got "
                                  f"{version}, {sync_steps}, {epoch}")
        if role not in R.ROLE_NAMES:
            raise InvalidArgument(f"unknown replica role {role}; use 0 (primary) or 1 (backup)")
        if role == R.ROLE_BACKUP and (backup is not None or initial_value is None):
            raise InvalidArgument("a backup copy is made from its primary's state: give "
                                  "initial_value (and slots), and no backup of its own")
        if backup is not None:
            backup = self._check_peer(backup)
            if backup.name.startswith(R.TABLE_PREFIX):
                raise InvalidArgument(f"a variable's backup must be a variable, not the table "
                                      f"shard {backup.name!r}")
        if slots is not None:
            slots = self._check_slots(name, opt, dt, shape, slots)
        with self._lock:
            existing = self._vars.get(name)
        if role == R.ROLE_BACKUP:
            return self._replace_copy(existing, name, dt, shape, opt, initial_value, slots,
                                      version, applied_ids, sync_steps, epoch,
                                      allow_nonfinite)
        if existing is not None and overwrite:
            meta = self._overwrite(existing, dt, shape, opt, initial_value, slots, version,
                                   applied_ids, sync_steps)
            if existing.link is not None:
                self._wait_acked([(existing, meta.version)], deadline)
            return existing.meta()
        if existing is not None:
            if exist_ok:
                m = existing.meta()
                if (m.dtype, m.shape, m.optimizer, dict(m.optimizer_params)) == (
                        dt.name, shape, opt.name, opt.config()):
                    if backup is not None and m.role == R.ROLE_PRIMARY and m.backup is None:
                        self.set_backup(name, backup, m.epoch, deadline)
                        return existing.meta()
                    return m
                raise AlreadyExists(
                    f"variable {name!r} exists as {m.dtype} {list(m.shape)} with "
                    f"{m.optimizer} {dict(m.optimizer_params)}, not as requested; "
                    "delete it first or use another name")
            raise AlreadyExists(
                f"variable {name!r} exists already; delete it first, use another "
                "name, or pass exist_ok=True to reuse it")
        need = nbytes_of(shape, dt) * (1 + len([s for s in opt.slot_names if s != "iterations"]))
        held = self.held_bytes()
        if self.max_bytes is not None and held + need > self.max_bytes:
            raise ResourceExhausted(
                f"creating {name!r} needs {need} bytes with its slots, but this "
                f"server holds {held} of its {self.max_bytes}-byte "
                "limit; shard the variable over more parameter servers or raise "
                "--max-memory-bytes")
        if initial_value is not None:
            try:
                value = np.array(initial_value, dtype=dt, copy=True)
            except MemoryError:
                raise ResourceExhausted(f"not enough memory for {name!r}") from None
        else:
            value = make_initial_value(shape, dt, initializer or Initializer(), allow_nonfinite)
        try:
            var = Variable(name, value, opt, allow_nonfinite)
        except MemoryError:
            raise ResourceExhausted(f"not enough memory for the slots of {name!r}") from None
        if slots is not None:
            for k, v in slots.items():
                np.copyto(var.slots[k], v)
        var.version, var.sync_steps, var.epoch = version, sync_steps, epoch
        var.applied = collections.OrderedDict.fromkeys((int(i) for i in applied_ids), 0)
        with self._lock:
            if name in self._vars:   # lost a race with another create
                raise AlreadyExists(f"variable {name!r} exists already")
            self._vars[name] = var
        if backup is not None:
            self.set_backup(name, backup, epoch, deadline)
        return var.meta()

    @staticmethod
    def _check_peer(peer: R.Peer) -> R.Peer:
        if not peer.address or len(peer.address) > 1024 or not peer.address.isprintable():
            raise InvalidArgument(f"a backup needs a server address (host:port), got "
                                  f"{peer.address!r}")
        # a variable's name, or a table shard's replication name (TABLE_PREFIX + table name)
        table = peer.name.startswith(R.TABLE_PREFIX)
        check_name(peer.name[len(R.TABLE_PREFIX):] if table else peer.name)
        return peer

    def _replace_copy(self, existing: Variable | None, name, dt, shape, opt, value, slots,
                      version, applied_ids, sync_steps, epoch, allow_nonfinite) -> VariableMeta:
        """A primary's state copied here as its backup (see create)."""
        if existing is not None:
            with existing.lock:
                stale = existing.epoch > epoch or (
                    existing.epoch == epoch and existing.role == R.ROLE_PRIMARY
                    and not (existing.link is not None and existing.link.fenced))
                if stale:
                    raise NotPrimary(
                        f"{name!r} here is at epoch {existing.epoch} "
                        f"({R.ROLE_NAMES[existing.role]}); a state copy of epoch {epoch} "
                        "comes from a superseded primary and was refused")
                same = (existing.value.dtype, existing.value.shape, existing.optimizer.name,
                        existing.optimizer.config()) == (dt, shape, opt.name, opt.config())
                if same:
                    with existing.writing():
                        np.copyto(existing.value, value)
                        fresh = slots if slots is not None else opt.create_slots(value)
                        for k in existing.slots:
                            np.copyto(existing.slots[k], fresh[k])
                        existing.version = version
                    existing.sync_steps, existing.acc = sync_steps, None
                    existing.applied = collections.OrderedDict.fromkeys(
                        (int(i) for i in applied_ids), 0)
                    existing.role, existing.epoch, existing.link = R.ROLE_BACKUP, epoch, None
                    existing.draining = False
                    existing.forget_changes()
                    existing.allow_nonfinite = allow_nonfinite
                    existing.cond.notify_all()
                    return existing.meta()
            self.delete(name)   # another shape or optimizer: the primary's wins
        self.create(name, dt.name, shape, initial_value=value, optimizer=opt.name,
                    optimizer_params=opt.config(), allow_nonfinite=allow_nonfinite,
                    slots=slots, version=version, applied_ids=applied_ids,
                    sync_steps=sync_steps, epoch=epoch)
        var = self._get(name)
        with var.lock:
            var.role = R.ROLE_BACKUP
            return var.meta()

    def _check_slots(self, name, opt, dt, shape, slots) -> dict[str, np.ndarray]:
        proto = opt.create_slots(np.zeros(shape if shape else (), dt)) if opt.slot_names else {}
        if set(slots) != set(proto):
            raise InvalidArgument(
                f"slots for {name!r} with optimizer {opt.name} must be exactly "
                f"{sorted(proto)}, got {sorted(slots)}")
        for k, v in slots.items():
            if v.dtype != proto[k].dtype or v.shape != proto[k].shape:
                raise InvalidArgument(
                    f"slot {k!r} of {name!r} must be {proto[k].dtype.name} "
                    f"{list(proto[k].shape)}, got {v.dtype.name} {list(v.shape)}")
        return dict(slots)

    def _overwrite(self, var: Variable, dt, shape, opt, value, slots, version,
                   applied_ids=(), sync_steps: int = 0) -> VariableMeta:
        var.check_primary()
        if (var.value.dtype, var.value.shape, var.optimizer.name) != (dt, shape, opt.name):
            raise InvalidArgument(
                f"cannot overwrite {var.name!r} ({var.value.dtype.name} {list(var.value.shape)}, "
                f"{var.optimizer.name}) with {dt.name} {list(shape)} {opt.name}; delete it first")
        if value is None:
            raise InvalidArgument(f"overwriting {var.name!r} needs an initial_value")
        with var.lock, var.writing():
            np.copyto(var.value, value)
            fresh = slots if slots is not None else opt.create_slots(var.value)
            for k in var.slots:
                np.copyto(var.slots[k], fresh[k])
            var.version, var.sync_steps = version, sync_steps
            var.acc = None
            var.applied = collections.OrderedDict.fromkeys((int(i) for i in applied_ids), 0)
            var.forget_changes()   # a restore: the next incremental save writes it whole
            if var.link is not None:   # the backup gets the whole new state
                var.link.reset()
            var.cond.notify_all()
            return var.meta()

    def delete(self, name: str) -> None:
        """Delete a variable. Raises NotFound."""
        with self._lock:
            var = self._get(name)
            del self._vars[name]
        with var.lock:
            if var.shared is not None:   # readers that map it see it dead
                var.value = var.value.copy()
                var.shared, shared = None, var.shared
                shared.retire()

    #: The most variables a store shares with readers on its host (each keeps
    #: two file descriptors open).
    MAX_SHARED = 1024

    def share(self, names: Sequence[str]) -> list:
        """Move each variable's value into memory readers on this host can map
        (psserver.shm.SharedValue), once; return (path, mapping bytes, dtype,
        shape) for each, or None where it cannot be shared (too many shared
        already, no memory). Raises NotFound."""
        from psserver import shm
        out = []
        for var in [self._get(n) for n in names]:
            with var.lock:
                with self._lock:
                    if self._vars.get(var.name) is not var:   # deleted meanwhile
                        raise NotFound(f"no variable {var.name!r}")
                if var.shared is None:
                    with self._lock:
                        count = sum(v.shared is not None for v in self._vars.values())
                    if count < self.MAX_SHARED:
                        try:
                            shared = shm.SharedValue(var.value, var.version)
                        except OSError:
                            shared = None
                        if shared is not None:
                            var.value, var.shared = shared.value, shared
                s = var.shared
                out.append(None if s is None else
                           (s.path, s.nbytes, var.value.dtype.name, var.value.shape, s.tag))
        return out

    def nbytes(self, name: str) -> int:
        """Bytes of a variable's value (NotFound as a read), without building its
        meta or waiting for its lock (a size check: an update in progress
        does not change it)."""
        return self._get(name).value.nbytes

    def rows_nbytes(self, name: str, n: int) -> int:
        """Bytes of n rows of a variable (what a gather of n ids returns;
        0 for a scalar, which has no rows), without reading any."""
        value = self._get(name).value   # (no lock: a size check, not a read of the data)
        shape = value.shape
        return value.nbytes // shape[0] * n if shape and shape[0] else 0

    def meta(self, name: str) -> VariableMeta:
        """A variable's metadata, or a dynamic table shard's (its replication
        name: psserver.replication.TABLE_PREFIX + table name)."""
        var = self._copy(name)
        with var.lock:
            return var.meta()

    def list(self) -> list[VariableMeta]:
        with self._lock:
            vs = sorted(self._vars.values(), key=lambda v: v.name)
        out = []
        for v in vs:
            with v.lock:
                out.append(v.meta())
        return out

    # -- reads -------------------------------------------------------------
    def snapshot(self, name: str, sync_step: int | None = None,
                 deadline: float | None = None) -> tuple[int, np.ndarray]:
        """(version, a private copy of the value), consistent. Raises NotFound.

        With ``sync_step``, first waits while an earlier sync step is pending
        (see psserver.sync); DeadlineExceeded if ``deadline`` passes first.
        """
        var = self._get(name)
        with var.lock:
            if sync_step is not None:
                self._barrier(var, sync_step, deadline, "read")
            return var.version, var.value.copy()

    @contextlib.contextmanager
    def locked_values(self, names: Sequence[str], sync_step: int | None = None,
                      deadline: float | None = None):
        """Yield [(name, version, live value array)] with all their locks held.

        For encoding a reply straight from the variables' memory (one copy):
        the caller must not keep the arrays past the ``with``. Locks are
        taken in name order (no deadlock with other multi-variable readers;
        updates take one lock at a time). With ``sync_step``, waits for
        earlier sync steps first (see snapshot).
        """
        vars_ = [self._get(n) for n in names]
        if sync_step is not None:
            for var in vars_:
                with var.lock:
                    self._barrier(var, sync_step, deadline, "read")
        unique = sorted({id(v): v for v in vars_}.values(), key=lambda v: v.name)
        with contextlib.ExitStack() as stack:
            for var in unique:
                stack.enter_context(var.lock)
            yield [(v.name, v.version, v.value) for v in vars_]

    def read_bytes(self, name: str, sync_step: int | None = None,
                   deadline: float | None = None) -> tuple[str, tuple[int, ...], int, bytes]:
        """(dtype, shape, version, raw bytes): one copy, taken under the lock."""
        var = self._get(name)
        with var.lock:
            if sync_step is not None:
                self._barrier(var, sync_step, deadline, "read")
            return var.value.dtype.name, var.value.shape, var.version, var.value.tobytes()

    def _check_ids(self, var: Variable, ids: np.ndarray, what: str) -> np.ndarray:
        if ids.dtype.kind != "i":
            raise InvalidArgument(f"{what} ids must be int32 or int64, got {ids.dtype.name}")
        if var.value.ndim == 0:
            raise InvalidArgument(f"variable {var.name!r} is a scalar; it has no rows to {what}")
        rows = var.value.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            bad = ids[(ids < 0) | (ids >= rows)].ravel()[:5].tolist()
            raise InvalidArgument(
                f"{what} ids out of range for {var.name!r} with {rows} rows "
                f"(valid: 0..{rows - 1}); first bad ids: {bad}")
        return ids

    def gather(self, name: str, ids: np.ndarray, sync_step: int | None = None,
               deadline: float | None = None) -> tuple[int, np.ndarray]:
        """(version, rows value[ids]) with shape ids.shape + value.shape[1:].

        Raises NotFound, InvalidArgument (ids not integer or out of range).
        """
        var = self._get(name)
        ids = self._check_ids(var, ids, "gather")
        with var.lock:
            if sync_step is not None:
                self._barrier(var, sync_step, deadline, "gather")
            return var.version, optim.take_rows(var.value, ids)

    # -- updates -----------------------------------------------------------
    def _check_grad(self, var: Variable, grad: np.ndarray, shape, what: str) -> None:
        # A float16 gradient is accepted for a float32/float64 variable (wire
        # compression: coordinator.compression) and applied in the variable's
        # dtype; every other mismatch is rejected.
        if grad.dtype != var.value.dtype and not (
                grad.dtype == np.float16 and var.value.dtype in (np.float32, np.float64)):
            raise InvalidArgument(
                f"{what} for {var.name!r} is {grad.dtype.name} but the variable is "
                f"{var.value.dtype.name}; cast it before sending")
        if tuple(grad.shape) != tuple(shape):
            raise InvalidArgument(
                f"{what} for {var.name!r} has shape {list(grad.shape)} but must have "
                f"shape {list(shape)}")
        if not var.allow_nonfinite and not all_finite(grad):
            raise InvalidArgument(
                f"{what} for {var.name!r} contains NaN or Inf and was rejected; "
                "nothing was applied. Lower the learning rate or clip gradients, "
                "or create the variable with allow_nonfinite=True")

    def push(self, updates: Iterable[tuple], deadline: float | None = None) -> list[int]:
        """Apply dense gradients with each variable's optimizer.

        ``updates``: (name, grad) or (name, grad, update_id). All updates are
        validated before any is applied: on an error nothing changed. Each is
        then applied atomically on its own variable, unless its update_id
        (non-zero) was applied before: then it is acknowledged and skipped
        (idempotent retries). Returns each variable's version after the call.

        Replication: a backup copy refuses (NotPrimary); a primary returns once
        its backup acknowledged each update (see ReplicaMethods._wait_acked
        for DeadlineExceeded and NotPrimary after ``deadline``).
        """
        return self.push_mixed(updates, (), deadline)

    def _apply_dense(self, var: Variable, grad: np.ndarray,
                     update_id: int) -> tuple[int, int]:
        """(version after the call, version its backup must acknowledge)."""
        with var.lock:
            var.check_primary()
            done = var.applied_at(update_id)
            if done is None:
                var.record(R.DENSE, grad, update_id=update_id, copy=True, ahead=True)
                with var.applying():
                    var.optimizer.apply_dense(var.value, var.slots, grad)
                    var.version += 1
                if var.tracker is not None:
                    var.tracker.mark_all()
                var.remember(update_id)
                self.observer.gradients("dense", "async")
                done = var.version
            return var.version, done

    def assign(self, updates: Iterable[tuple[str, np.ndarray]],
               deadline: float | None = None) -> list[int]:
        """Overwrite values (slots are kept). Validated in full first, like push."""
        checked = []
        for name, value in updates:
            var = self._get(name)
            var.check_primary()
            self._check_grad(var, value, var.value.shape, "assigned value")
            checked.append((var, value))
        done = []
        for var, value in checked:
            with var.lock:
                var.check_primary()
                var.record(R.ASSIGN, value, copy=True, ahead=True)
                with var.applying():
                    np.copyto(var.value, value)
                    var.version += 1
                if var.tracker is not None:
                    var.tracker.mark_all()
                done.append((var, var.version))
        self._wait_acked(done, deadline)
        return [v for _, v in done]

    def push_sparse(self, name: str, ids: np.ndarray, rows: np.ndarray,
                    update_id: int = 0, deadline: float | None = None) -> int:
        """Apply a row-wise gradient: rows[i] is the gradient of row ids[i].

        Duplicate ids are summed first. Lazy: only the rows named, and their
        slots, change. An update_id seen before is acknowledged and skipped,
        as in push. Returns the version after the update.
        """
        return self.push_mixed((), [(name, ids, rows, update_id)], deadline)[0]

    def _check_sparse(self, name: str, ids: np.ndarray,
                      rows: np.ndarray) -> tuple[Variable, np.ndarray, np.ndarray]:
        """(variable, unique ids, summed rows): the request's own arrays when
        its ids are sorted and distinct already (optim.sum_duplicates), else
        new ones. Kept as they are (by the replication record) either way:
        nothing changes a request's arrays afterwards (decoded from a
        message's immutable bytes or a frame of its own, which the buffer
        pool does not reuse while a view of it lives; the shared-memory path
        copies them out of the client's segment first, servicer.py; a caller
        in process must not change them after the call)."""
        var = self._get(name)
        if ids.ndim != 1:
            raise InvalidArgument(f"sparse push ids must be 1-D, got shape {list(ids.shape)}")
        ids = self._check_ids(var, ids, "sparse push")
        self._check_grad(var, rows, (ids.shape[0],) + var.value.shape[1:], "sparse gradient rows")
        uniq, summed = optim.sum_duplicates(ids.astype(np.int64, copy=False), rows)
        return var, uniq, summed

    def _apply_sparse(self, var: Variable, uniq: np.ndarray, summed: np.ndarray,
                      update_id: int) -> tuple[int, int]:
        with var.lock:
            var.check_primary()
            done = var.applied_at(update_id)
            if done is None:
                # no copy: arrays nothing changes afterwards (see _check_sparse)
                var.record(R.SPARSE, summed, uniq, update_id, ahead=True)
                with var.applying():
                    var.optimizer.apply_sparse(var.value, var.slots, uniq, summed)
                    var.version += 1
                if var.tracker is not None:
                    var.tracker.mark_rows(uniq)
                var.remember(update_id)
                self.observer.gradients("sparse", "async")
                done = var.version
            return var.version, done

    def push_mixed(self, dense: Iterable[tuple], sparse: Iterable[tuple],
                   deadline: float | None = None) -> list[int]:
        """Dense updates (as push) and row-wise ones ((name, ids, rows, update_id),
        as push_sparse) in one call: all validated before any is applied.
        Returns the versions after the dense updates, then the sparse ones."""
        checked = []
        for name, grad, *uid in dense:
            var = self._get(name)
            var.check_primary()
            if grad.dtype == np.float16 and var.value.dtype in (np.float32, np.float64):
                # compressed on the wire: applied (and replicated) in the variable's dtype
                grad = T.widen_float16(grad, var.value.dtype).reshape(grad.shape)
            self._check_grad(var, grad, var.value.shape, "gradient")
            checked.append((var, grad, uid[0] if uid else 0))
        sparse_checked = [(*self._check_sparse(name, ids, rows), uid)
                          for name, ids, rows, uid in sparse]
        for var, *_ in sparse_checked:
            var.check_primary()
        applied = [(var, self._apply_dense(var, grad, uid)) for var, grad, uid in checked]
        applied += [(item[0], self._apply_sparse(*item)) for item in sparse_checked]
        self._wait_acked([(var, done) for var, (_, done) in applied], deadline)
        return [version for _, (version, _) in applied]
