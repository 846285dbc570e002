"""One variable (or one shard of a sharded variable) on a parameter server:
its value, optimizer slots, version, idempotency keys, sync state and
replication role (``Variable``); how names, initial values and finiteness
are checked; what a store tells its observer (``StoreObserver``). Free of
grpc and protobuf, as psserver.store.
"""
from __future__ import annotations

import collections
import contextlib
import math
import re
import threading

import numpy as np

from psserver import optimizers as optim
from psserver import replication as R
from psserver import sync as S
from psserver.contract import Initializer, InvalidArgument, VariableMeta
from psserver.contract import ResourceExhausted

# Names are path-like so sharded variables can be called "dense/kernel/part_0".
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-/:]{1,256}$")

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


class Variable(R.CopyState):
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
        # Incremental saves (psserver.tracking): what changed since a save
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


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"invalid variable name {name!r}: use 1 to 256 characters from "
            "letters, digits and _ . - / :")
    return name


#: The Initializer fields each kind reads.
INITIALIZER_PARAMS = {"constant": ("value",), "random_normal": ("mean", "stddev"),
                      "truncated_normal": ("mean", "stddev"),
                      "random_uniform": ("minval", "maxval")}


def check_initializer(init: Initializer, allow_nonfinite: bool = False,
                      nonfinite_hint: str = "") -> tuple[str, ...]:
    """InvalidArgument unless ``init`` is a known kind with usable parameters
    (finite unless ``allow_nonfinite``; ``nonfinite_hint`` ends that message),
    as variables and dynamic tables need them. Returns the fields it reads."""
    if init.kind not in INITIALIZERS:
        raise InvalidArgument(f"unknown initializer {init.kind!r}; use one of {list(INITIALIZERS)}")
    used = INITIALIZER_PARAMS.get(init.kind, ())
    if not allow_nonfinite:
        bad = [f"{k}={getattr(init, k)}" for k in used if not math.isfinite(getattr(init, k))]
        if bad:
            raise InvalidArgument(
                f"initializer {init.kind} with {', '.join(bad)} would make NaN or Inf values; "
                f"give finite parameters{nonfinite_hint}")
    if init.kind in ("random_normal", "truncated_normal") and not init.stddev >= 0:
        raise InvalidArgument(f"initializer stddev must be >= 0, got {init.stddev}")
    if init.kind == "random_uniform" and not init.maxval >= init.minval:
        raise InvalidArgument(f"initializer needs minval <= maxval, got {init.minval} > {init.maxval}")
    return used


def make_initial_value(shape, dtype: np.dtype, init: Initializer,
                       allow_nonfinite: bool = False) -> np.ndarray:
    """A new array of shape/dtype filled as ``init`` says. Unless
    ``allow_nonfinite``, parameters that are NaN or Inf, or values that come
    out NaN or Inf in ``dtype`` (1e300 in float32, a uniform range wider than
    the largest float), are refused as a NaN in an initial value is."""
    used = check_initializer(init, allow_nonfinite,
                             " (or create the variable with allow_nonfinite=True)")
    with np.errstate(all="ignore"):   # an overflow is checked for below
        out = _initial_value(shape, dtype, init)
    if not allow_nonfinite and not all_finite(out):
        raise InvalidArgument(
            f"initializer {init.kind} ({', '.join(f'{k}={getattr(init, k)}' for k in used)}) "
            f"gives NaN or Inf in {dtype.name} (a value beyond its range, or a range wider than "
            "the largest float); use smaller parameters (or allow_nonfinite=True)")
    return out


def _initial_value(shape, dtype: np.dtype, init: Initializer) -> np.ndarray:
    """The array (``init`` checked by check_initializer first)."""
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
