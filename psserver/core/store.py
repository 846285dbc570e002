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

One variable is a psserver.core.variable.Variable. The store is built from
parts it holds as public attributes, each a class of its own over the same
psserver.core.shards.ShardRegistry (``registry``: every shard copy on the server,
dynamic table shards too, psserver/core/table_store.py):

* ``budget``, the psserver.core.shards.MemoryBudget (``--max-memory-bytes``);
* ``steps``, the sync-mode calls (psserver.core.sync.StepGatherer);
* ``replicator``, the replication calls (psserver.core.replication.Replicator);
* ``saver``, the checkpoint files and save points (psserver.core.saving.Saver).

Callers use those parts directly (``store.steps.push``,
``store.replicator.reconfigure_all``, ``store.saver.save_point``...); the
store itself creates, deletes, reads and updates variables asynchronously.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterable, Mapping, Sequence

import numpy as np

from psserver.contract import (
    MAX_COUNT,
    MAX_EPOCH,
    ROLE_BACKUP,
    ROLE_PRIMARY,
    TABLE_PREFIX,
    Initializer,
    Peer,
    VariableMeta,
)
from psserver.contract import optimizers as optim
from psserver.contract import tensor as T
from psserver.contract.memory import MAPPED_BYTES, give_back_memory
from psserver.contract.rows import sum_duplicates, take_rows
from psserver.contract.tensor import (
    VALUE_DTYPES,
    all_finite,
    check_dtype,
    check_shape,
    nbytes_of,
)
from psserver.core import replication as R
from psserver.core.saving import Saver
from psserver.core.shards import ROLE_NAMES, MemoryBudget, ShardRegistry, check_name
from psserver.core.sync import StepGatherer
from psserver.core.variable import StoreObserver, Variable, make_initial_value
from psserver.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted


class VariableStore:
    """All variables of one parameter-server task.

    Args:
      max_bytes: refuse creates that would make what the server holds
        (``budget.held()``: values, slots, change tracking, dynamic tables)
        exceed this many bytes (RESOURCE_EXHAUSTED). None: no limit but the
        machine's. Ignored when ``budget`` is given.
      observer: told of the updates as they happen (psserver.metrics).
      checkpoint_dirs: where saves may write (psserver.core.saving.Saver).
      registry, budget: the server's shard copies and memory budget, to
        share with its table store (new ones when not given).
    """

    def __init__(self, max_bytes: int | None = None, observer: StoreObserver | None = None,
                 checkpoint_dirs: Sequence[str] | None = None, *,
                 registry: ShardRegistry | None = None, budget: MemoryBudget | None = None):
        self.registry = registry if registry is not None else ShardRegistry()
        self.budget = budget if budget is not None else MemoryBudget(max_bytes, self.registry)
        # Given once: the parts that tell it of their work hold it too.
        self.observer = observer or StoreObserver()
        self.steps = StepGatherer(self.registry, self.observer, self.budget)
        self.replicator = R.Replicator(self.registry, self.steps)
        self.saver = Saver(self.registry, checkpoint_dirs)
        # A variable by name, NotFound if none (the registry's: bound once,
        # as it is called per variable per push).
        self._get = self.registry.variable

    @property
    def max_bytes(self) -> int | None:
        """The --max-memory-bytes limit (budget.limit)."""
        return self.budget.limit

    def total_bytes(self) -> int:
        """Bytes the variables hold: values, slots, change tracking and what
        their sync steps gathered (ServerInfo.total_bytes; Variable.held_bytes)."""
        return sum(v.held_bytes for v in self.registry.variables())

    def __len__(self) -> int:
        return self.registry.variable_count()

    def variables_snapshot(self) -> list[Variable]:
        """The variables held now (for metrics: read sizes only, no values)."""
        return self.registry.variables()

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
               role: int = ROLE_PRIMARY,
               epoch: int = 0,
               backup: Peer | None = None,
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

        Replication (psserver.core.replication): ``backup`` makes a primary that
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
        if not (0 <= version < MAX_COUNT and 0 <= sync_steps < MAX_COUNT
                and 0 <= epoch < MAX_EPOCH):
            raise InvalidArgument(f"version, sync_steps and epoch must be in [0, 2**62), got "
                                  f"{version}, {sync_steps}, {epoch}")
        if role not in ROLE_NAMES:
            raise InvalidArgument(f"unknown replica role {role}; use 0 (primary) or 1 (backup)")
        if role == ROLE_BACKUP and (backup is not None or initial_value is None):
            raise InvalidArgument("a backup copy is made from its primary's state: give "
                                  "initial_value (and slots), and no backup of its own")
        if backup is not None:
            backup = R.check_peer(backup)
            if backup.name.startswith(TABLE_PREFIX):
                raise InvalidArgument(f"a variable's backup must be a variable, not the table "
                                      f"shard {backup.name!r}")
        if slots is not None:
            slots = self._check_slots(name, opt, dt, shape, slots)
        existing = self.registry.find(name)
        if role == ROLE_BACKUP:
            return self._replace_copy(existing, name, dt, shape, opt, initial_value, slots,
                                      version, applied_ids, sync_steps, epoch,
                                      allow_nonfinite)
        if existing is not None and overwrite:
            meta = self._overwrite(existing, dt, shape, opt, initial_value, slots, version,
                                   applied_ids, sync_steps)
            if existing.link is not None:
                self.replicator.wait_acked([(existing, meta.version)], deadline)
            return existing.meta()
        if existing is not None:
            if exist_ok:
                m = existing.meta()
                if (m.dtype, m.shape, m.optimizer, dict(m.optimizer_params)) == (
                        dt.name, shape, opt.name, opt.config()):
                    if backup is not None and m.role == ROLE_PRIMARY and m.backup is None:
                        self.replicator.set_backup(name, backup, m.epoch, deadline)
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
        self.budget.check(need, f"creating {name!r} with its slots",
                          "shard the variable over more parameter servers or raise "
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
        if self.registry.add(var) is not var:   # lost a race with another create
            raise AlreadyExists(f"variable {name!r} exists already")
        if backup is not None:
            self.replicator.set_backup(name, backup, epoch, deadline)
        return var.meta()

    def _replace_copy(self, existing: Variable | None, name, dt, shape, opt, value, slots,
                      version, applied_ids, sync_steps, epoch, allow_nonfinite) -> VariableMeta:
        """A primary's state copied here as its backup (see create)."""
        if existing is not None:
            with existing.lock:
                existing.accept_state_copy(epoch)
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
                    existing.role, existing.epoch, existing.link = ROLE_BACKUP, epoch, None
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
            var.role = ROLE_BACKUP
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
        var = self._get(name)
        if not self.registry.remove(var):   # another delete was first
            raise NotFound(f"no variable {name!r} on this parameter server")
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
        (psserver.contract.shm.SharedValue), once; return (path, mapping bytes, dtype,
        shape) for each, or None where it cannot be shared (too many shared
        already, no memory). Raises NotFound."""
        from psserver.contract import shm
        out, moved = [], False
        for var in [self._get(n) for n in names]:
            with var.lock:
                if self.registry.find(var.name) is not var:   # deleted meanwhile
                    raise NotFound(f"no variable {var.name!r}")
                if var.shared is None:
                    count = sum(v.shared is not None for v in self.registry.variables())
                    if count < self.MAX_SHARED:
                        try:
                            shared = shm.SharedValue(var.value, var.version)
                        except OSError:
                            shared = None
                        if shared is not None:
                            moved = moved or var.value.nbytes >= MAPPED_BYTES
                            var.value, var.shared = shared.value, shared
                s = var.shared
                out.append(None if s is None else
                           (s.path, s.nbytes, var.value.dtype.name, var.value.shape, s.tag))
        if moved:   # the values' old arrays are free: their pages go back
            give_back_memory()
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
        name: psserver.contract.TABLE_PREFIX + table name)."""
        var = self.registry.copy(name)
        with var.lock:
            return var.meta()

    def list(self) -> list[VariableMeta]:
        vs = sorted(self.registry.variables(), key=lambda v: v.name)
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
        (see psserver.core.sync); DeadlineExceeded if ``deadline`` passes first.
        """
        var = self._get(name)
        with var.lock:
            if sync_step is not None:
                self.steps.barrier(var, sync_step, deadline, "read")
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
                    self.steps.barrier(var, sync_step, deadline, "read")
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
                self.steps.barrier(var, sync_step, deadline, "read")
            return var.value.dtype.name, var.value.shape, var.version, var.value.tobytes()

    def gather(self, name: str, ids: np.ndarray, sync_step: int | None = None,
               deadline: float | None = None) -> tuple[int, np.ndarray]:
        """(version, rows value[ids]) with shape ids.shape + value.shape[1:].

        Raises NotFound, InvalidArgument (ids not integer or out of range).
        """
        var = self._get(name)
        ids = var.check_ids(ids, "gather")
        with var.lock:
            if sync_step is not None:
                self.steps.barrier(var, sync_step, deadline, "gather")
            return var.version, take_rows(var.value, ids)

    # -- updates -----------------------------------------------------------
    def push(self, dense: Iterable[tuple] = (), sparse: Iterable[tuple] = (),
             deadline: float | None = None, acked: list | None = None) -> list[int]:
        """Apply gradients asynchronously, each with its variable's optimizer:
        ``dense`` (name, grad) or (name, grad, update_id), and row-wise ones
        ``sparse`` (name, ids, rows, update_id): rows[i] is the gradient of
        row ids[i], duplicate ids summed first, and only the rows named (and
        their slots) change (lazy). Returns the versions after the call, the
        dense updates' then the sparse ones'.

        All updates are validated before any is applied: on an error
        (InvalidArgument, NotFound, NotPrimary) nothing changed. Each is
        then applied atomically on its own variable, unless its update_id
        (non-zero) was applied before: then it is acknowledged and skipped
        (idempotent retries).

        Replication: a backup copy refuses (NotPrimary); a primary returns once
        its backup acknowledged each update (see Replicator.wait_acked for
        DeadlineExceeded and NotPrimary after ``deadline``), or, given
        ``acked``, adds there what to wait for (the caller waits once for
        this and more: one call to each backup).
        """
        checked = []
        for name, grad, *uid in dense:
            var = self._get(name)
            var.check_primary()
            if grad.dtype == np.float16 and var.value.dtype in (np.float32, np.float64):
                # compressed on the wire: applied (and replicated) in the variable's dtype
                grad = T.widen_float16(grad, var.value.dtype).reshape(grad.shape)
            var.check_grad(grad, var.value.shape, "gradient")
            checked.append((var, grad, uid[0] if uid else 0))
        sparse_checked = [(*self._check_sparse(name, ids, rows), uid)
                          for name, ids, rows, uid in sparse]
        for var, *_ in sparse_checked:
            var.check_primary()
        versions, waits = [], [] if acked is None else acked
        with R.sent_on_failure(waits):   # (one by one: a failure wakes those applied before it)
            for var, grad, uid in checked:
                version, done = self._apply_dense(var, grad, uid)
                versions.append(version)
                waits.append((var, done))
            for item in sparse_checked:
                version, done = self._apply_sparse(*item)
                versions.append(version)
                waits.append((item[0], done))
        if acked is None:
            self.replicator.wait_acked(waits, deadline)
        return versions

    def _apply_dense(self, var: Variable, grad: np.ndarray,
                     update_id: int) -> tuple[int, int]:
        """(version after the call, version its backup must acknowledge)."""
        with var.lock:
            var.check_primary()
            done = var.applied_at(update_id)
            if done is None:
                var.record(R.DENSE, grad, update_id=update_id, copy=True, ahead=True,
                           deferred=True)
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
            var.check_grad(value, var.value.shape, "assigned value")
            checked.append((var, value))
        done = []
        with R.sent_on_failure(done):
            for var, value in checked:
                self._assign_one(var, value, done)
        self.replicator.wait_acked(done, deadline)
        return [v for _, v in done]

    @staticmethod
    def _assign_one(var: Variable, value: np.ndarray, done: list) -> None:
        with var.lock:
            var.check_primary()
            var.record(R.ASSIGN, value, copy=True, ahead=True, deferred=True)
            with var.applying():
                np.copyto(var.value, value)
                var.version += 1
            if var.tracker is not None:
                var.tracker.mark_all()
            done.append((var, var.version))

    def _check_sparse(self, name: str, ids: np.ndarray,
                      rows: np.ndarray) -> tuple[Variable, np.ndarray, np.ndarray]:
        """(variable, unique ids, summed rows): the request's own arrays when
        its ids are sorted and distinct already (psserver.contract.rows.sum_duplicates), else
        new ones. Kept as they are (by the replication record) either way:
        nothing changes a request's arrays afterwards (decoded from a
        message's immutable bytes or a frame of its own, which the buffer
        pool does not reuse while a view of it lives; the shared-memory path
        copies them out of the client's segment first, servicer.py; a caller
        in process must not change them after the call)."""
        var = self._get(name)
        ids = var.check_rows(ids, rows)
        uniq, summed = sum_duplicates(ids.astype(np.int64, copy=False), rows)
        return var, uniq, summed

    def _apply_sparse(self, var: Variable, uniq: np.ndarray, summed: np.ndarray,
                      update_id: int) -> tuple[int, int]:
        with var.lock:
            var.check_primary()
            done = var.applied_at(update_id)
            if done is None:
                # no copy: arrays nothing changes afterwards (see _check_sparse)
                var.record(R.SPARSE, summed, uniq, update_id, ahead=True, deferred=True)
                with var.applying():
                    var.optimizer.apply_sparse(var.value, var.slots, uniq, summed)
                    var.version += 1
                if var.tracker is not None:
                    var.tracker.mark_rows(uniq)
                var.remember(update_id)
                self.observer.gradients("sparse", "async")
                done = var.version
            return var.version, done

