"""``fit``: Keras-style epochs over a ClusterCoordinator.

Keras 3's ``model.fit`` does not run under ParameterServerStrategy; this is
the loop people write by hand instead, with Keras' shape::

    from coordinator.fit import fit
    from coordinator.callbacks import EarlyStopping

    def evaluate(epoch):                        # on the coordinator, after the epoch's join()
        params = read_variables(model.variables)
        return {"loss": ..., "accuracy": ...}    # recorded as val_loss, val_accuracy

    with ClusterCoordinator(strategy) as coord:
        history = fit(coord, train_step, dataset_fn, epochs=10, steps_per_epoch=100,
                      validation_fn=evaluate, callbacks=[EarlyStopping(patience=2)])
    history.history      # {"loss": [...one per epoch], "val_loss": [...], "val_accuracy": [...]}

Each epoch schedules ``steps_per_epoch`` calls ``train_step(iterator)`` on
the workers (``iterator``: one iterator over the per-worker dataset, made
once, so the data goes on where the last epoch stopped; or over a sharded
dataset, ``coord.create_sharded_dataset``, whose epoch is its batches, one
per step, so ``steps_per_epoch`` defaults to ``batches_per_epoch``), keeps up to
``max_pending_steps`` of them queued or running, takes their results back in
schedule order, then ``join()``s, so every epoch ends at a consistent cut
(checkpoints, validation). A step returns a float (the loss), a dict of
floats (``{"loss": ..., "accuracy": ...}``), or None; the epoch's logs are
the means over its steps, plus ``val_``-prefixed validation metrics, plus
for a sharded dataset ``rerun_batches`` (batches handed out again during
the epoch: see coordinator/sharded.py).

Validation runs after the epoch's join() on fit's thread (Keras' way), or
with ``background_validation=True`` on a thread of its own while training
goes on (coordinator/evaluation.py: skipped when the previous one still
runs, abandoned after ``validation_timeout``; its metrics reach callbacks
through ``on_validation_end``).
"""
from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
from collections import deque
from typing import Any, Callable, Iterable

from coordinator.callbacks import Callback, CallbackList, History
from coordinator.coordinator import ClusterCoordinator
from coordinator.datasets import PerWorkerDataset, PerWorkerIterator
from coordinator.evaluation import BackgroundValidation
from coordinator.evaluation import scalar as _scalar
from coordinator.evaluation import val_logs as _val_logs
from coordinator.progress import Progress
from coordinator.sharded import ShardedDataset, ShardedIterator

__all__ = ["fit", "FitState"]


@dataclasses.dataclass
class FitState:
    """The running fit, as callbacks see it (``callback.fit_state``).

    ``step`` counts the steps whose results came back, over the whole run
    (a run started at ``initial_epoch`` starts at ``initial_epoch *
    steps_per_epoch``). Set ``stop_training = True`` to stop: no more steps
    are scheduled, those in flight finish, the epoch ends as usual
    (validation, ``on_epoch_end``), and training ends.
    """
    coordinator: ClusterCoordinator
    epochs: int
    steps_per_epoch: int
    history: History
    epoch: int = 0
    step: int = 0
    steps_scheduled: int = 0
    stop_training: bool = False
    background_validation: bool = False
    validation: BackgroundValidation | None = None   # counters: skipped, abandoned, failed


def fit(coordinator: ClusterCoordinator, train_step: Callable,
        dataset_fn: Callable | PerWorkerDataset | PerWorkerIterator | ShardedDataset
        | ShardedIterator, *,
        epochs: int = 1, steps_per_epoch: int | None = None,
        validation_fn: Callable[..., dict | None] | None = None, validation_freq: int = 1,
        callbacks: Iterable[Callback] | None = None, verbose: int | str = "auto",
        initial_epoch: int = 0, progress: Progress | None = None,
        max_pending_steps: int = 256, background_validation: bool = False,
        validation_timeout: float | None = 600.0) -> History:
    """Train for ``epochs`` epochs of ``steps_per_epoch`` scheduled steps; return the History.

    Args:
      coordinator: the ClusterCoordinator to schedule on.
      train_step: ``train_step(iterator)`` run on a worker; returns a float
        loss, a dict of floats, or None.
      dataset_fn: made into a per-worker dataset once
        (``coordinator.create_per_worker_dataset``); or an existing
        PerWorkerDataset, or a PerWorkerIterator to go on with; or a
        ShardedDataset (``coordinator.create_sharded_dataset``) or its iterator.
      epochs: train until this epoch (counting ``initial_epoch``).
      steps_per_epoch: steps scheduled per epoch; required with a per-worker
        dataset; with a sharded one it defaults to its ``batches_per_epoch``
        (one step per batch: an epoch of fit is an epoch of the data); in
        all-reduce mode a step takes a batch on each member, and an epoch
        runs steps (first the batches over the members, rounded up; then
        as many as a lost member left) until every batch of its data epoch
        was trained, so members may come and go (its last step may take
        the first batches of the next data epoch).
      validation_fn: ``validation_fn(epoch)`` (or ``validation_fn()``), run on
        the coordinator after the epoch's join(); returns a dict of metrics,
        recorded with a ``val_`` prefix (kept if already there).
      validation_freq: validate every this many epochs (and after the last).
      background_validation: run validation_fn on a thread of its own while
        training goes on (coordinator/evaluation.py): a validation due while
        the previous one runs is skipped (``fit_state.validation.skipped``);
        one that raises is logged and counted, not raised; its metrics reach
        callbacks by ``on_validation_end(epoch, logs)`` (History records them
        under the epoch validated), not in the epoch's logs. After the last
        epoch fit waits for the running validation, then validates the last
        epoch if it was not, each up to ``validation_timeout``.
      validation_timeout: seconds a background validation may run before it
        is abandoned (reported, counted; None: no limit).
      callbacks: ``coordinator.callbacks.Callback`` instances, called in order.
      verbose: 0 silent; 1 (and "auto") a progress bar on a terminal or
        periodic lines otherwise (on stderr) plus one line per epoch (on
        stdout); 2 the epoch lines only.
      initial_epoch: the epoch to start at (resuming: the ``"epoch"`` that
        ``CheckpointCallback`` stored).
      progress: the Progress to drive with verbose=1 (to choose its options);
        default ``Progress()`` with the coordinator's live workers.
      max_pending_steps: steps scheduled ahead of the oldest unfinished one
        (bounds the queue; enough to keep every worker busy).

    Returns the History (``.history``, ``.epoch``, per step ``.steps`` and
    ``.step_history``). Raises the first step error (StepFunctionError with
    the worker's traceback), after which the coordinator can schedule again.
    """
    if epochs < 0 or not 0 <= initial_epoch:
        raise ValueError(f"need 0 <= initial_epoch and 0 <= epochs, got initial_epoch="
                         f"{initial_epoch}, epochs={epochs}")
    if isinstance(dataset_fn, ShardedIterator):
        dataset_fn = dataset_fn.dataset
    sharded = dataset_fn if isinstance(dataset_fn, ShardedDataset) else None
    # All-reduce mode over a sharded dataset: a step takes a batch per member,
    # and members change (a worker lost or joining): each epoch runs steps
    # until its data epoch is trained (``_steps_left``), not a count fixed here.
    follow = steps_per_epoch is None and sharded is not None \
        and coordinator.strategy.mode == "allreduce"
    if steps_per_epoch is None:
        if sharded is None:
            raise ValueError("steps_per_epoch is needed with a per-worker dataset (its "
                             "epochs have no end); a sharded dataset "
                             "(coordinator.create_sharded_dataset) gives its own")
        steps_per_epoch = sharded.batches_per_epoch
        strategy = coordinator.strategy
        if strategy.mode == "allreduce":   # a step takes a batch on each member (an
            n = max(1, coordinator.replicas_in_sync())   # estimate: ``follow``)
            steps_per_epoch = max(1, -(-steps_per_epoch // n))
    if not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be an int >= 1, got {steps_per_epoch!r}")
    if validation_freq < 1:
        raise ValueError(f"validation_freq must be >= 1, got {validation_freq}")
    if max_pending_steps < 1:
        raise ValueError(f"max_pending_steps must be >= 1, got {max_pending_steps}")
    if verbose == "auto":
        verbose = 1
    if verbose not in (0, 1, 2):
        raise ValueError(f'verbose must be 0, 1, 2 or "auto", got {verbose!r}')

    if isinstance(dataset_fn, PerWorkerIterator):
        iterator = dataset_fn
    elif isinstance(dataset_fn, (PerWorkerDataset, ShardedDataset)):
        iterator = iter(dataset_fn)
    else:
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    validate = _epoch_callable(validation_fn) if validation_fn is not None else None
    background = None
    if validate is not None and background_validation:
        background = BackgroundValidation(validate, validation_timeout)

    history = History()
    state = FitState(coordinator, epochs, steps_per_epoch, history,
                     epoch=initial_epoch, step=initial_epoch * steps_per_epoch,
                     background_validation=background is not None, validation=background)
    state.steps_scheduled = state.step
    params = {"epochs": epochs, "steps": steps_per_epoch, "initial_epoch": initial_epoch,
              "verbose": verbose}
    cbs = CallbackList([*(callbacks or ()), history], state, params)
    total = epochs * steps_per_epoch
    bar = None
    if verbose == 1:
        bar = progress or Progress()
        bar.set_initial(state.step)
        bar.set_total(total)
        if bar.workers_fn is None:
            bar.workers_fn = lambda: (coordinator.workers_alive(), coordinator.num_workers)
    tick = 0.5 if bar is None or bar.log_every_seconds is None else min(0.5, bar.log_every_seconds)
    warned: set = set()
    t0 = time.perf_counter()
    done_at_start = state.step

    def validations_ended(ended) -> None:
        for ep, val in ended:
            cbs.on_validation_end(ep, val)

    try:
        cbs.on_train_begin({})
        logs: dict[str, float] = {}
        for epoch in range(initial_epoch, epochs):
            state.epoch = epoch
            if bar is not None:
                bar.set_description(f"epoch {epoch + 1}/{epochs}")
            cbs.on_epoch_begin(epoch, {})
            sums: dict[str, list[float]] = {}
            pending: deque = deque()
            next_batch = 0
            reruns_before = sharded.stats().reruns if sharded is not None else 0
            data_epoch = sharded.epochs_completed if follow else None
            left_before = None
            target = _steps_left(coordinator, sharded, data_epoch) if follow else steps_per_epoch
            if follow:
                left_before = sharded.unacknowledged(data_epoch)
            while True:
                while (not state.stop_training and next_batch < target
                       and len(pending) < max_pending_steps):
                    cbs.on_train_batch_begin(next_batch, {})
                    pending.append((next_batch, coordinator.schedule(train_step,
                                                                     args=(iterator,))))
                    next_batch += 1
                    state.steps_scheduled += 1
                    if bar is not None:
                        bar.scheduled(1)
                if not pending:
                    more = _steps_left(coordinator, sharded, data_epoch, left_before) \
                        if follow and not state.stop_training else 0
                    if not more:
                        break
                    left_before = sharded.unacknowledged(data_epoch)
                    target += more   # (a member was lost: its batches are left)
                    if bar is not None:
                        total += more
                        bar.set_total(total)
                    continue
                batch, rv = pending[0]
                try:
                    value = rv.fetch(timeout=tick)
                except TimeoutError:
                    if bar is not None:
                        bar.tick()
                    if background is not None:
                        validations_ended(background.poll())
                    continue
                except Exception:   # StepFunctionError, ClosureCancelled, a PSError...
                    coordinator.join()   # raises the queue's first error (and clears it)
                    raise
                pending.popleft()
                step_logs = _step_logs(value, warned)
                for k, v in step_logs.items():
                    acc = sums.setdefault(k, [0.0, 0])
                    acc[0] += v
                    acc[1] += 1
                state.step += 1
                if bar is not None:
                    bar.update(1, loss=_headline(step_logs))
                cbs.on_train_batch_end(batch, step_logs)
            coordinator.join()
            logs = {k: s / n for k, (s, n) in sums.items()}
            if sharded is not None:
                logs["rerun_batches"] = float(sharded.stats().reruns - reruns_before)
            due = validate is not None and ((epoch + 1) % validation_freq == 0
                                            or epoch + 1 == epochs)
            if background is not None:
                validations_ended(background.poll())
                if due and epoch + 1 < epochs:
                    background.start(epoch)   # the last epoch's: after training, below
            elif due:
                logs.update(_val_logs(validate(epoch)))
            if verbose:
                rate = (state.step - done_at_start) / max(time.perf_counter() - t0, 1e-9)
                line = (f"epoch {epoch + 1}/{epochs}  steps {state.step}/{total}  "
                        + "".join(f"{k} {v:.4f}  " for k, v in logs.items())
                        + f"steps/s {rate:.1f}  workers {coordinator.workers_alive()}")
                if bar is not None:
                    bar.write(line)
                else:
                    print(line, flush=True)
            cbs.on_epoch_end(epoch, logs)
            if state.stop_training:
                break
        if background is not None:   # training is over: wait (bounded) for the last ones
            last = state.epoch if state.epoch + 1 == epochs and not state.stop_training \
                else None
            validations_ended(background.finish(last))
        if bar is not None:
            bar.close()
        cbs.on_train_end(logs)
    finally:
        try:
            if bar is not None:
                bar.close()
        finally:
            cbs.close()
    return history


# -- helpers -------------------------------------------------------------------------
def _epoch_callable(fn: Callable) -> Callable[[int], Any]:
    try:
        n = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n = 1
    return fn if n >= 1 else (lambda epoch: fn())


def _step_logs(value, warned: set) -> dict[str, float]:
    """A step's result as logs: a number -> {"loss": x}; a dict -> its scalar items."""
    if value is None:
        return {}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            f = _scalar(v)
            if f is None:
                if k not in warned:
                    warned.add(k)
                    warnings.warn(f"fit: the step returned {k!r} as {type(v).__name__}, not "
                                  "a number; it is not logged", stacklevel=3)
                continue
            out[str(k)] = f
        return out
    f = _scalar(value)
    if f is None:
        if "<result>" not in warned:
            warned.add("<result>")
            warnings.warn(f"fit: the step returned {type(value).__name__}; return a float "
                          "loss or a dict of floats to have it logged", stacklevel=3)
        return {}
    return {"loss": f}


def _headline(logs: dict[str, float]) -> float | None:
    if "loss" in logs:
        return logs["loss"]
    return next(iter(logs.values()), None)


def _steps_left(coordinator, sharded, data_epoch: int, left_before: int | None = None) -> int:
    """All-reduce steps that train what is left of ``data_epoch`` with the
    members now (a step takes one batch on each). RuntimeError where the
    steps run since ``left_before`` (batches then unacknowledged) trained
    none of them: those batches are held by closures that never ended."""
    coordinator.join()   # (every step scheduled so far acknowledged its batches)
    left = sharded.unacknowledged(data_epoch)
    if left and left_before is not None and left >= left_before:
        raise RuntimeError(
            f"fit: {left} batches of data epoch {data_epoch} stay unacknowledged though the "
            "steps run for them ended: their closures neither finished nor gave them back "
            f"({sharded.stats()}); create the sharded dataset again to start afresh")
    return -(-left // max(1, coordinator.replicas_in_sync())) if left else 0
