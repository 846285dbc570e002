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
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import threading
import time
import urllib.parse
from typing import Iterable, Mapping, Sequence

import numpy as np

from psserver import optimizers as optim
from psserver import replication as R
from psserver import sync as S
from psserver.contract import Initializer, VariableMeta  # noqa: F401
from psserver.contract import (AlreadyExists,
                             InvalidArgument, NotFound, NotPrimary, PermissionDenied,
                             ResourceExhausted)
from psserver.tensor import VALUE_DTYPES, check_dtype, check_shape, nbytes_of

# Names are path-like so sharded variables can be called "dense/kernel/part_0".
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-/:]{1,256}$")

#: Testing switch: a parameter server with this set dies in the middle of a
#: save (after writing a temporary file, before renaming it).
FAULT_CRASH_IN_SAVE_ENV = "PSTRAIN_FAULT_CRASH_IN_SAVE"

INITIALIZERS = ("zeros", "ones", "constant", "random_normal", "truncated_normal",
                "random_uniform")


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


class Variable:
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
        # The value in memory readers on this host map (psserver.shm.SharedValue), or None.
        self.shared = None
        # Replication (psserver.replication): this copy's role, its fencing
        # epoch, its link to its backup (a primary with one), and whether a
        # planned hand-over (DEMOTE) is draining it.
        self.role = R.ROLE_PRIMARY
        self.epoch = 0
        self.link: R.Link | None = None
        self.draining = False

    def writing(self):
        """Wrap every change of value and version (lock held): readers of a
        shared value see it as being written (its seqlock), then the new version."""
        return self.shared.writing(self) if self.shared is not None else contextlib.nullcontext()

    #: How many update keys a variable remembers: a resent update older than
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

    def record(self, kind: int, tensor: np.ndarray, ids: np.ndarray | None = None,
               update_id: int = 0, copy: bool = False, ahead: bool = False) -> None:
        """Hand an update (lock held) to the backup, if any: the one just
        applied, or with ``ahead`` the one about to be applied (version + 1),
        so that its forwarding overlaps this copy's own apply (see applying).
        ``copy``: the tensor may be the caller's memory (a shared segment)."""
        link = self.link
        if link is not None:
            link.add(R.Record(link.peer.name, self.epoch, self.version + bool(ahead),
                              update_id, self.sync_steps, kind,
                              tensor.copy() if copy else tensor, ids))

    @contextlib.contextmanager
    def applying(self):
        """Wrap an update whose record went ahead (lock held): the value's
        seqlock (writing), and, should the update fail half-way (a bug), a
        whole copy of the state for the backup, which had the record."""
        try:
            with self.writing():
                yield
        except BaseException:
            if self.link is not None:
                self.link.reset()
            raise

    def check_primary(self) -> None:
        """Raise NotPrimary unless this copy takes client updates now (lock held
        or not: a role read is atomic)."""
        if self.role != R.ROLE_PRIMARY or self.draining:
            what = "handing over to its other copy" if self.draining else "a backup copy"
            raise NotPrimary(
                f"{self.name!r} on this server is {what} (epoch {self.epoch}) and takes no "
                "client updates; nothing was applied. Send it to the primary copy (ask "
                "both copies' GetMeta for role and epoch; coordinator.variables does)")

    @property
    def slot_nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots.values())

    def meta(self) -> VariableMeta:
        return VariableMeta(self.name, self.value.dtype.name, self.value.shape,
                            self.version, self.optimizer.name,
                            self.optimizer.config(), self.value.nbytes,
                            self.slot_nbytes, self.allow_nonfinite,
                            self.sync_steps, self.dropped, self.role, self.epoch,
                            self.link.peer if self.link is not None else None)


def all_finite(a: np.ndarray) -> bool:
    """No NaN or Inf in a. Fast path: a sum of squares (BLAS dot product, 1.7x
    faster than np.sum here) is finite only if every term is (NaN and Inf
    propagate; squares cannot cancel), and costs no temporary; only one
    that overflowed needs the element-wise check."""
    with np.errstate(all="ignore"):
        if a.dtype in (np.float32, np.float64) and a.flags.c_contiguous:
            flat = a.reshape(-1)
            fast = np.dot(flat, flat)
        else:
            fast = np.sum(a, dtype=np.float64 if a.dtype == np.float16 else None)
        if np.isfinite(fast):
            return True
    return bool(np.isfinite(a).all())


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"invalid variable name {name!r}: use 1 to 256 characters from "
            "letters, digits and _ . - / :")
    return name


def make_initial_value(shape, dtype: np.dtype, init: Initializer,
                       allow_nonfinite: bool = False) -> np.ndarray:
    """A new array of shape/dtype filled as ``init`` says. Unless
    ``allow_nonfinite``, parameters that are NaN or Inf, or values that come
    out NaN or Inf in ``dtype`` (1e300 in float32, a uniform range wider than
    the largest float), are refused as a NaN in an initial value is."""
    if init.kind not in INITIALIZERS:
        raise InvalidArgument(f"unknown initializer {init.kind!r}; use one of {list(INITIALIZERS)}")
    used = {"constant": ("value",), "random_normal": ("mean", "stddev"),
            "truncated_normal": ("mean", "stddev"),
            "random_uniform": ("minval", "maxval")}.get(init.kind, ())
    if not allow_nonfinite:
        bad = [f"{k}={getattr(init, k)}" for k in used if not math.isfinite(getattr(init, k))]
        if bad:
            raise InvalidArgument(
                f"initializer {init.kind} with {', '.join(bad)} would make NaN or Inf values; "
                "give finite parameters (or create the variable with allow_nonfinite=True)")
    with np.errstate(all="ignore"):   # an overflow is checked for below
        out = _initial_value(shape, dtype, init)
    if not allow_nonfinite and not all_finite(out):
        raise InvalidArgument(
            f"initializer {init.kind} ({', '.join(f'{k}={getattr(init, k)}' for k in used)}) "
            f"gives NaN or Inf in {dtype.name} (a value beyond its range, or a range wider than "
            "the largest float); use smaller parameters (or allow_nonfinite=True)")
    return out


def _initial_value(shape, dtype: np.dtype, init: Initializer) -> np.ndarray:
    if init.kind in ("random_normal", "truncated_normal") and not init.stddev >= 0:
        raise InvalidArgument(f"initializer stddev must be >= 0, got {init.stddev}")
    if init.kind == "random_uniform" and not init.maxval >= init.minval:
        raise InvalidArgument(f"initializer needs minval <= maxval, got {init.minval} > {init.maxval}")
    try:
        if init.kind == "zeros":
            return np.zeros(shape, dtype)
        if init.kind == "ones":
            return np.ones(shape, dtype)
        if init.kind == "constant":
            return np.full(shape, init.value, dtype)
        rng = np.random.default_rng(init.seed)
        gen_dtype = np.float64 if dtype == np.float64 else np.float32
        if init.kind == "random_uniform":
            out = rng.random(shape, dtype=gen_dtype)
            out *= init.maxval - init.minval
            out += init.minval
        else:
            out = rng.standard_normal(shape, dtype=gen_dtype)
            if init.kind == "truncated_normal":   # resample beyond 2 stddev, as TF does
                bad = np.abs(out) > 2
                while bad.any():
                    out[bad] = rng.standard_normal(int(bad.sum()), dtype=gen_dtype)
                    bad = np.abs(out) > 2
            out *= init.stddev
            out += init.mean
        return out.astype(dtype, copy=False)
    except MemoryError:
        raise ResourceExhausted(
            f"not enough memory for a {list(shape)} {dtype.name} variable") from None


class VariableStore(R.ReplicaMethods):
    """All variables of one parameter-server task.

    Args:
      max_bytes: refuse creates that would make values and slots exceed this
        many bytes (RESOURCE_EXHAUSTED). None: no limit but the machine's.
    """

    def __init__(self, max_bytes: int | None = None, observer: StoreObserver | None = None,
                 checkpoint_dirs: Sequence[str] | None = None):
        self.max_bytes = max_bytes
        # Where save() may write: inside one of these (None: anywhere, for
        # in-process use; a psserver task sets what --checkpoint-dir says).
        self.checkpoint_dirs = None if checkpoint_dirs is None else tuple(
            os.path.realpath(d) for d in checkpoint_dirs)
        self.observer = observer or StoreObserver()
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

    def __len__(self) -> int:
        return len(self._vars)

    def variables_snapshot(self) -> list[Variable]:
        """The variables held now (for metrics: read sizes only, no values)."""
        with self._lock:
            return list(self._vars.values())

    def _barrier(self, var: Variable, step: int, deadline: float | None, op: str) -> None:
        """sync.wait_for_earlier_steps (lock held), timed for the observer."""
        start = time.monotonic()
        try:
            S.wait_for_earlier_steps(var, step, deadline)
        finally:
            self.observer.sync_wait(op, time.monotonic() - start)

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
        if self.max_bytes is not None and self.total_bytes() + need > self.max_bytes:
            raise ResourceExhausted(
                f"creating {name!r} needs {need} bytes with its slots, but this "
                f"server holds {self.total_bytes()} of its {self.max_bytes}-byte "
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
        check_name(peer.name)
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
            if var.link is not None:   # the backup gets the whole new state
                var.link.reset()
            var.cond.notify_all()
            return var.meta()

    def save(self, directory: str, names: Sequence[str] = ()) -> list[tuple[str, str, int, int]]:
        """Write variables to directory, one safetensors file each.

        Each file holds "value" and "slot/<name>" tensors and, in its
        metadata, the variable's name, version and optimizer. It is written
        under a temporary name and renamed, so a file that exists is whole.
        Each variable is copied under its lock first (a consistent snapshot of
        that variable; variables are taken one after another). Returns
        (name, file, version, bytes) per variable.
        """
        from safetensors.numpy import save_file

        directory = self._confined(directory)
        if not os.path.isdir(directory):
            raise InvalidArgument(f"checkpoint directory {directory!r} does not exist on this "
                                  "parameter server (it must see the same filesystem)")
        with self._lock:
            chosen = [self._get(n) for n in names] if names else list(self._vars.values())
        out = []
        for var in chosen:
            with var.lock:
                tensors = {"value": var.value.copy(),
                           **{f"slot/{k}": v.copy() for k, v in var.slots.items()},
                           "applied_ids": np.fromiter(var.applied, np.uint64, len(var.applied))}
                meta = {"name": var.name, "version": str(var.version),
                        "optimizer": var.optimizer.name,
                        "optimizer_params": json.dumps(var.optimizer.config()),
                        "allow_nonfinite": json.dumps(var.allow_nonfinite)}
                version = var.version
            file = urllib.parse.quote(var.name, safe="") + ".safetensors"
            path = os.path.join(directory, file)
            tmp = f"{path}.tmp{os.getpid()}"
            save_file(tensors, tmp, metadata=meta)
            if os.environ.get(FAULT_CRASH_IN_SAVE_ENV):   # fault injection for tests
                os._exit(3)
            _fsync_file(tmp)    # on disk before it gets its final name
            os.chmod(tmp, 0o644)   # safetensors writes 0600: let a coordinator of another user read it
            os.replace(tmp, path)
            out.append((var.name, file, version, os.path.getsize(path)))
        return out

    def _confined(self, directory: str) -> str:
        """``directory`` resolved (symbolic links, ``..``), if it lies in a
        checkpoint directory this server was given. Raises PermissionDenied."""
        if not isinstance(directory, str) or not directory or "\0" in directory:
            raise InvalidArgument("give the checkpoint directory as a path")
        real = os.path.realpath(directory)
        if self.checkpoint_dirs is None:
            return real
        if not self.checkpoint_dirs:
            raise PermissionDenied(
                "this parameter server writes no checkpoint files: it was started without "
                "--checkpoint-dir; start it with --checkpoint-dir DIR (a directory the "
                "coordinator's CheckpointManager writes under, on the same filesystem)")
        if not any(real == d or real.startswith(d.rstrip(os.sep) + os.sep)
                   for d in self.checkpoint_dirs):
            raise PermissionDenied(
                f"{directory!r} is outside this parameter server's checkpoint directories "
                f"({', '.join(self.checkpoint_dirs)}); nothing was written. Save under one of "
                "them, or start the server with --checkpoint-dir covering it")
        return real

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

    def meta(self, name: str) -> VariableMeta:
        var = self._get(name)
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
            return var.version, var.value[ids]

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
        """(variable, unique ids, summed rows): new arrays, nothing of the inputs kept."""
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
                var.record(R.SPARSE, summed, uniq, update_id, ahead=True)   # new arrays: no copy
                with var.applying():
                    var.optimizer.apply_sparse(var.value, var.slots, uniq, summed)
                    var.version += 1
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

    # -- synchronous mode (see psserver.sync) -----------------------------------
    def _abandoned_for(self, step: int) -> set[int]:
        with self._lock:
            return set(self._abandoned.get(step, ()))

    def push_sync(self, updates: Iterable[tuple[str, np.ndarray]], spec: S.SyncSpec,
                  deadline: float | None = None) -> list[tuple[int, bool]]:
        """Add one replica's dense gradients to their sync step.

        Validated in full first, like push. Returns (version, dropped) per
        update: the version after the call (one more than before when this
        gradient completed the step), and whether it came too late and was
        dropped. Raises DeadlineExceeded if an earlier step does not complete
        before ``deadline`` (time.monotonic()).
        """
        spec.validate()
        checked = []
        for name, grad in updates:
            var = self._get(name)
            if var.draining:
                var.check_primary()
            self._check_grad(var, grad, var.value.shape, "gradient")
            checked.append((var, grad))
        abandoned = self._abandoned_for(spec.step)
        out = []
        for var, grad in checked:
            with var.lock:
                dropped = self._sync_push(var, spec, grad, False, abandoned, deadline)
                out.append((var.version, dropped))
        return out

    def push_sparse_sync(self, name: str, ids: np.ndarray, rows: np.ndarray,
                         spec: S.SyncSpec, deadline: float | None = None) -> tuple[int, bool]:
        """Add one replica's row gradient to its sync step (an empty one counts)."""
        spec.validate()
        var = self._get(name)
        if var.draining:
            var.check_primary()
        if ids.ndim != 1:
            raise InvalidArgument(f"sparse push ids must be 1-D, got shape {list(ids.shape)}")
        ids = self._check_ids(var, ids, "sparse push")
        self._check_grad(var, rows, (ids.shape[0],) + var.value.shape[1:], "sparse gradient rows")
        abandoned = self._abandoned_for(spec.step)
        with var.lock:
            dropped = self._sync_push(var, spec, (ids, rows), True, abandoned, deadline)
            return var.version, dropped

    def _sync_push(self, var: Variable, spec: S.SyncSpec, grad, sparse: bool,
                   abandoned: set[int], deadline: float | None) -> bool:
        """sync.push (lock held), with its barrier wait timed and its outcome counted.

        Waits here first, so that sync.push's own wait finds nothing to wait for.
        """
        self._barrier(var, spec.step, deadline, "push")
        # Steps the variable moved past this gradient's step (applied, or begun
        # gathering): 0 on time; more: late (sync.push drops it).
        ahead = max(var.sync_steps, var.acc.step if var.acc is not None else 0)
        self.observer.sync_staleness(max(0, ahead - spec.step))
        dropped = S.push(var, spec, grad, sparse, abandoned, deadline)
        kind = "sparse" if sparse else "dense"
        if dropped:
            self.observer.dropped(kind)
        else:
            self.observer.gradients(kind, "sync")
        return dropped

    #: How many steps of abandoned replicas to remember.
    _ABANDONED_KEPT = 1024

    def abandon(self, step: int, replica: int) -> None:
        """Replica ``replica`` will not push for ``step``: stop waiting for it."""
        if not (0 <= step < S.MAX_COUNT and 0 <= replica < S.MAX_COUNT):
            raise InvalidArgument(f"bad step {step} or replica {replica}")
        with self._lock:
            self._abandoned.setdefault(step, set()).add(replica)
            while len(self._abandoned) > self._ABANDONED_KEPT:
                del self._abandoned[min(self._abandoned)]
            abandoned = set(self._abandoned[step])
            vs = list(self._vars.values())
        for var in vs:
            with var.lock:
                if var.acc is not None and var.acc.step == step:
                    S.maybe_complete(var, abandoned)
