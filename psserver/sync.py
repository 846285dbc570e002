"""Synchronous training on one variable: gather a step's gradients, apply once.

Used by ``VariableStore`` (all functions here run with the variable's lock
held, through its condition ``var.cond``). The rules, per variable:

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

import time

import numpy as np

from psserver import optimizers as optim
from psserver.contract import (MAX_COUNT, DeadlineExceeded, InvalidArgument,  # noqa: F401
                               SyncSpec)
from psserver.replication import DENSE, ROLE_PRIMARY, SPARSE



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

    def add(self, replica: int, grad) -> None:
        if self.sparse:
            self.parts.append(grad)
        elif not self.replicas:   # the first gradient: copy it in (no zeroing, no add)
            if self.total is None or self.total.shape != grad.shape:
                self.total = np.array(grad, copy=True)
            else:
                np.copyto(self.total, grad)
        else:
            np.add(self.total, grad, out=self.total)
        self.replicas.add(replica)


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
    """Apply the pending step's combined gradient (lock held)."""
    with var.writing():
        _apply(var)
    var.cond.notify_all()


def _apply(var) -> None:
    acc, var.acc = var.acc, None
    n = max(1, len(acc.replicas))
    scale = None if acc.spec.sum or n == 1 else 1.0 / n
    with np.errstate(all="ignore"):
        if acc.sparse:
            if acc.parts:
                ids = np.concatenate([p[0] for p in acc.parts]).astype(np.int64, copy=False)
                rows = np.concatenate([p[1] for p in acc.parts])
            else:
                ids = np.empty(0, np.int64)
                rows = np.empty((0,) + var.value.shape[1:], var.value.dtype)
            uniq, summed = optim.sum_duplicates(ids, rows)
            if scale is not None:
                summed *= summed.dtype.type(scale)
            var.optimizer.apply_sparse(var.value, var.slots, uniq, summed)
        else:
            if scale is not None:
                acc.total *= acc.total.dtype.type(scale)
            var.optimizer.apply_dense(var.value, var.slots, acc.total)
            var.sync_buffer = acc.total   # reused by the next step
    var.version += 1
    var.sync_steps = acc.step + 1
    if acc.sparse:   # the backup applies exactly this: new arrays, kept by the record
        var.record(SPARSE, summed, uniq)
    else:   # acc.total is reused by the next step: the record keeps a copy
        var.record(DENSE, acc.total, copy=True)


def push(var, spec: SyncSpec, grad, sparse: bool, abandoned: set[int],
         deadline: float | None) -> bool:
    """Add a replica's gradient to its step (lock held). Returns True if dropped."""
    wait_for_earlier_steps(var, spec.step, deadline)
    late = spec.step < var.sync_steps or (var.acc is not None and spec.step < var.acc.step)
    if late or spec.replica in abandoned:
        var.dropped += 1
        return True
    if var.acc is None:
        var.acc = Accumulation(spec.step, spec, sparse, None if sparse else var.sync_buffer)
    elif var.acc.sparse != sparse:
        raise InvalidArgument(
            f"{var.name!r} got dense and sparse gradients in sync step {spec.step}; push "
            "one kind per variable")
    if spec.replica in var.acc.replicas:   # a re-run of the same replica: first one wins
        var.dropped += 1
        return True
    var.acc.add(spec.replica, grad)
    maybe_complete(var, abandoned)
    return False


def maybe_complete(var, abandoned: set[int]) -> None:
    acc = var.acc
    if acc is not None and var.role == ROLE_PRIMARY and \
            len(acc.replicas | abandoned) >= acc.spec.required:
        apply(var)
