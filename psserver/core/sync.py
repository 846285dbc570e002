"""Synchronous training on one shard copy: gather a step's gradients, apply once.

The step protocol of a shard copy (a variable, a dynamic table shard: each
a psserver.core.shards.CopyState; the functions here run with the copy's lock
held, waiting on its condition ``cond``), and ``StepGatherer``, the
variable store's sync-mode calls. The rules, per copy:

* A sync push belongs to ``(step, replica)``. The variable gathers the
  gradients of one step at a time in an ``Accumulation``. When ``required``
  distinct replicas have pushed or been abandoned, it applies the optimizer
  once, to the mean of the gradients received (or their sum), bumps its
  version by one and sets ``sync_steps = step + 1``.
* A read, gather or push for step ``t`` waits while a step before ``t`` is
  still being gathered: every replica of step t computes on the value after
  step t-1, and no gradient meets a newer value than the one it was computed
  on. A waiting call completes the pending step with the gradients that did
  arrive once ``step_timeout`` seconds have passed since that step's first
  push (0: never; the call's own deadline still applies).
* A gradient for a step already applied (a straggler beyond the backup
  workers, a replica that was abandoned), or a second one from the same
  replica, is dropped and counted in ``dropped``.
"""
from __future__ import annotations

import threading
import time
from typing import Iterable

import numpy as np

from psserver.contract import MAX_COUNT, ROLE_PRIMARY, SyncSpec
from psserver.contract.memory import mapped, owner_bytes
from psserver.contract.rows import sum_duplicates
from psserver.errors import DeadlineExceeded, InvalidArgument


class Accumulation:
    """The gradients of one step on one variable, until the step is applied."""

    def __init__(self, step: int, spec: SyncSpec, sparse: bool, buffer: np.ndarray | None):
        self.step, self.spec, self.sparse = step, spec, sparse
        self.first_time = time.monotonic()
        self.replicas: set[int] = set()
        # Dense: the running sum, in a variable-sized buffer kept by the
        # variable from step to step (no allocation per step).
        self.total = buffer
        self.parts: list[tuple[np.ndarray, np.ndarray]] = []   # sparse: (ids, rows)
        # The buffers the parts keep (id -> bytes; the parts keep them alive).
        self.buffers: dict[int, int] = {}

    def add(self, replica: int, grad) -> None:
        if self.sparse:
            self.parts.append(grad)
            self.buffers.update(_buffers(grad))
        elif not self.replicas:   # the first gradient: copy it in (no zeroing, no add)
            if self.total is None or self.total.shape != grad.shape:
                self.total = np.array(grad, copy=True)
            else:
                np.copyto(self.total, grad)
        else:
            np.add(self.total, grad, out=self.total)
        self.replicas.add(replica)

    @property
    def nbytes(self) -> int:
        """Bytes gathered so far: the buffers the row-wise parts keep
        (``buffer_bytes``); a dense step's sum buffer."""
        return sum(self.buffers.values()) + \
            (self.total.nbytes if self.total is not None else 0)

    def scale(self) -> float | None:
        """What the sum of the step's gradients is multiplied by: 1/n for the
        mean over the n replicas that pushed (None: the sum, or one replica)."""
        n = max(1, len(self.replicas))
        return None if self.spec.sum or n == 1 else 1.0 / n


def _timeout_at(var) -> float | None:
    acc = var.acc
    return acc.first_time + acc.spec.step_timeout if acc.spec.step_timeout > 0 else None


def wait_for_earlier_steps(var, step: int, deadline: float | None) -> None:
    """Block (lock held) while a step before ``step`` is pending on var."""
    while var.acc is not None and var.acc.step < step:
        now = time.monotonic()
        # A backup copy applies only its primary's records (which clear acc).
        timeout_at = _timeout_at(var) if var.role == ROLE_PRIMARY else None
        if timeout_at is not None and now >= timeout_at:
            apply(var, forced=True)
            continue
        if deadline is not None and now >= deadline:
            raise DeadlineExceeded(
                f"waited for sync step {var.acc.step} of {var.name!r} to complete until the "
                f"call's deadline; {len(var.acc.replicas)} of {var.acc.spec.required} "
                "replicas had pushed. A replica may be slow or gone: set a step_timeout, "
                "or backup workers")
        ends = [t for t in (timeout_at, deadline) if t is not None]
        var.cond.wait(min(ends) - now if ends else None)


def apply(var, forced: bool = False) -> None:
    """Apply the pending step once (lock held): the copy's own ``apply_step``
    (Variable.apply_step, TableShardCopy.apply_step). An apply that fails
    half-way (a bug) leaves which rows changed unknown: the next incremental
    save writes the copy whole, and a backup gets the whole state (each
    apply_step sees to it)."""
    try:
        var.apply_step()
    finally:   # (the step is gone either way: waiting calls look again)
        var.cond.notify_all()


def combined_rows(acc: Accumulation, row_shape: tuple, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A sparse step's (unique ids, their rows summed over the replicas,
    scaled for the mean): what the optimizer applies once."""
    if acc.parts:
        ids = np.concatenate([p[0] for p in acc.parts]).astype(np.int64, copy=False)
        rows = np.concatenate([p[1] for p in acc.parts])
    else:
        ids = np.empty(0, np.int64)
        rows = np.empty((0,) + tuple(row_shape), dtype)
    scale = acc.scale()
    with np.errstate(all="ignore"):
        uniq, summed = sum_duplicates(ids, rows)
        if scale is not None:
            summed *= summed.dtype.type(scale)
    return uniq, summed


def push(var, spec: SyncSpec, grad, sparse: bool, abandoned: set[int],
         deadline: float | None, budget=None) -> bool:
    """Add a replica's gradient to its step (lock held). Returns True if
    dropped. ``budget`` (psserver.core.shards.MemoryBudget): what the step
    gathers counts against --max-memory-bytes; past it ResourceExhausted,
    nothing changed (steps that never complete grew a server without bound)."""
    wait_for_earlier_steps(var, spec.step, deadline)
    late = spec.step < var.sync_steps or (var.acc is not None and spec.step < var.acc.step)
    if late or spec.replica in abandoned:
        var.dropped += 1
        return True
    acc = var.acc if var.acc is not None else \
        Accumulation(spec.step, spec, sparse, None if sparse else var.sync_buffer)
    if acc.sparse != sparse:
        raise InvalidArgument(
            f"{var.name!r} got dense and sparse gradients in sync step {spec.step}; push "
            "one kind per variable")
    if spec.replica in acc.replicas:   # a re-run of the same replica: first one wins
        var.dropped += 1
        return True
    if sparse:
        grad = _kept(grad)
    if budget is not None:   # (checked before the step is begun: a refusal changes nothing)
        budget.check(_adds(acc, grad), f"sync step {spec.step}'s gradient for {var.name!r}",
                     "the step has not completed (a replica missing?): lower the step's "
                     "required pushes, give up on the lost replicas (AbandonStep), or raise "
                     "--max-memory-bytes")
    var.acc = acc
    acc.add(spec.replica, grad)
    maybe_complete(var, abandoned)
    return False


def _buffers(arrays) -> dict[int, int]:
    """id -> bytes of the buffer each array keeps alive (its base's base...)."""
    return dict(owner_bytes(a) for a in arrays)


def buffer_bytes(arrays) -> int:
    """Bytes the arrays keep alive: each one's whole buffer, each buffer once."""
    return sum(_buffers(arrays).values())


#: A row-wise part is kept as received only if it is at least this share of
#: the buffer it views; else copied out (``_kept``).
KEEP_SHARE = 0.8


def _kept(part: tuple) -> tuple:
    """A row-wise part as a step keeps it until applied. As received, its
    arrays view their request's buffer, which may hold more: a large
    frame's buffer is rounded up to its size class (psserver/link/buffers.py,
    up to 1.4x a part of 8 MiB: resident memory passed what the parts
    counted, issue 33 item 3), or the request also carried a dense gradient
    or other tables' updates (each table would count the shared buffer).
    A part that fills nearly all of its buffer is kept as it is (the buffer
    counted whole: ``Accumulation.buffers``); any other is copied into
    arrays of its own (in mappings of their own when large), and the
    request's buffer is freed."""
    arrays = tuple(np.asarray(a) for a in part)
    if sum(a.nbytes for a in arrays) >= KEEP_SHARE * buffer_bytes(arrays):
        return arrays
    out = []
    for a in arrays:
        copy = mapped(a.shape, a.dtype)
        np.copyto(copy, a)
        out.append(copy)
    return tuple(out)


def _adds(acc: Accumulation, grad) -> int:
    """Bytes ``acc.add(grad)`` takes: a row-wise part (the buffers it keeps
    that the step does not keep already), or a dense sum buffer made."""
    if acc.sparse:
        return sum(n for k, n in _buffers(grad).items() if k not in acc.buffers)
    if not acc.replicas and (acc.total is None or acc.total.shape != grad.shape):
        return grad.nbytes
    return 0


def maybe_complete(var, abandoned: set[int]) -> None:
    acc = var.acc
    if acc is not None and var.role == ROLE_PRIMARY and \
            len(acc.replicas | abandoned) >= acc.spec.required:
        apply(var)


def check_rows_spec(spec: SyncSpec) -> SyncSpec:
    """Validate the SyncSpec of a row-wise sync push (a fixed table's, a
    dynamic table's): hybrid mode sends none (InvalidArgument)."""
    spec.validate()
    if spec.hybrid:
        raise InvalidArgument(
            "a row-wise gradient of a hybrid-mode step is applied on arrival: push it "
            "without sync info (coordinator.variables does); nothing was applied")
    return spec


class StepGatherer:
    """The variable store's sync-mode calls, and the replicas each step gave
    up on (AbandonStep) for every copy here: variables and table shards
    (``registry``: psserver.core.shards.ShardRegistry). ``observer`` (a
    psserver.core.variable.StoreObserver) hears of the variables' sync waits,
    staleness, gradients and drops.

    Locking: each call takes one variable's lock at a time; the abandoned
    replicas have a lock of their own, never held while a copy's is taken."""

    #: How many steps of abandoned replicas to remember.
    ABANDONED_KEPT = 1024

    def __init__(self, registry, observer, budget=None):
        self._registry = registry
        self._observer = observer
        self._budget = budget   # psserver.core.shards.MemoryBudget: a step's gradients count
        # step -> replicas that will not push for it (their worker died).
        self._abandoned: dict[int, set[int]] = {}
        self._lock = threading.Lock()   # guards _abandoned

    def barrier(self, var, step: int, deadline: float | None, op: str) -> None:
        """wait_for_earlier_steps (var's lock held), timed for the observer
        (``op``: read, gather, push)."""
        start = time.monotonic()
        try:
            wait_for_earlier_steps(var, step, deadline)
        finally:
            self._observer.sync_wait(op, time.monotonic() - start)

    def abandoned_for(self, step: int) -> set[int]:
        """The replicas given up on for ``step`` (a copy)."""
        with self._lock:
            return set(self._abandoned.get(step, ()))

    def complete(self, copy) -> None:
        """Apply ``copy``'s pending step if every replica it needs pushed or
        was given up on (lock held; a backup promoted to primary)."""
        if copy.acc is not None:
            maybe_complete(copy, self.abandoned_for(copy.acc.step))

    def push(self, updates: Iterable[tuple[str, np.ndarray]], spec: SyncSpec,
             deadline: float | None = None) -> list[tuple[int, bool]]:
        """Add one replica's dense gradients to their sync step.

        Validated in full first, like VariableStore.push. Returns (version,
        dropped) per update: the version after the call (one more than
        before when this gradient completed the step), and whether it came
        too late and was dropped. Raises DeadlineExceeded if an earlier step
        does not complete before ``deadline`` (time.monotonic())."""
        spec.validate()
        checked = []
        for name, grad in updates:
            var = self._registry.variable(name)
            if var.draining:
                var.check_primary()
            var.check_grad(grad, var.value.shape, "gradient")
            checked.append((var, grad))
        abandoned = self.abandoned_for(spec.step)
        out = []
        for var, grad in checked:
            with var.lock:
                dropped = self._gather(var, spec, grad, False, abandoned, deadline)
                out.append((var.version, dropped))
        return out

    def push_rows(self, name: str, ids: np.ndarray, rows: np.ndarray,
                  spec: SyncSpec, deadline: float | None = None) -> tuple[int, bool]:
        """Add one replica's row gradient to its sync step (an empty one counts).
        InvalidArgument for a hybrid-mode spec: row-wise gradients are applied
        on arrival there (pushed without a SyncSpec)."""
        check_rows_spec(spec)
        var = self._registry.variable(name)
        if var.draining:
            var.check_primary()
        ids = var.check_rows(ids, rows)
        abandoned = self.abandoned_for(spec.step)
        with var.lock:
            dropped = self._gather(var, spec, (ids, rows), True, abandoned, deadline)
            return var.version, dropped

    def _gather(self, var, spec: SyncSpec, grad, sparse: bool, abandoned: set[int],
                deadline: float | None) -> bool:
        """push (lock held), with its barrier wait timed and its outcome counted.

        Waits here first, so that push's own wait finds nothing to wait for.
        """
        self.barrier(var, spec.step, deadline, "push")
        # Steps the variable moved past this gradient's step (applied, or begun
        # gathering): 0 on time; more: late (push drops it).
        ahead = max(var.sync_steps, var.acc.step if var.acc is not None else 0)
        self._observer.sync_staleness(max(0, ahead - spec.step))
        dropped = push(var, spec, grad, sparse, abandoned, deadline, self._budget)
        kind = "sparse" if sparse else "dense"
        if dropped:
            self._observer.dropped(kind)
        else:
            self._observer.gradients(kind, "sync")
        return dropped

    def abandon(self, step: int, replica: int) -> None:
        """Replica ``replica`` will not push for ``step``: stop waiting for it
        (on every variable and dynamic table shard here)."""
        if not (0 <= step < MAX_COUNT and 0 <= replica < MAX_COUNT):
            raise InvalidArgument(f"bad step {step} or replica {replica}")
        with self._lock:
            self._abandoned.setdefault(step, set()).add(replica)
            while len(self._abandoned) > self.ABANDONED_KEPT:
                del self._abandoned[min(self._abandoned)]
            abandoned = set(self._abandoned[step])
        for copy in self._registry.copies():
            with copy.lock:
                if copy.acc is not None and copy.acc.step == step:
                    maybe_complete(copy, abandoned)
