"""Callbacks for ``coordinator.fit.fit``, with Keras' names and call order.

    from coordinator.callbacks import CheckpointCallback, EarlyStopping, TensorBoard

    history = fit(coord, train_step, dataset_fn, epochs=20, steps_per_epoch=100,
                  validation_fn=evaluate,
                  callbacks=[CheckpointCallback(CheckpointManager(strategy, "ckpt")),
                             EarlyStopping(monitor="val_loss", patience=3),
                             TensorBoard("runs/tb")])

``fit`` calls, on every callback in list order::

    on_train_begin(logs)
      on_epoch_begin(epoch, logs)                 epoch counts from 0, as in Keras
        on_train_batch_begin(batch, logs)         when step ``batch`` of the epoch is scheduled
        on_train_batch_end(batch, logs)           when its result is back (in schedule order)
      on_epoch_end(epoch, logs)                   after join() and validation
      on_validation_end(epoch, logs)              background validation only: when the
                                                  validation of ``epoch`` ended (any time)
    on_train_end(logs)
    close()                                       always, also when fit raises

``on_train_batch_begin``/``_end`` call ``on_batch_begin``/``_end`` by default,
as Keras' do. Unlike Keras, the logs of ``on_train_batch_end`` are that one
step's own values ({"loss": x} or the dict the step returned), not running
means; ``on_epoch_end`` gets the epoch's means plus the validation metrics
(``val_``-prefixed). Steps run asynchronously: several may be scheduled
(``on_train_batch_begin``) before the first one ends.

A callback reads the run through ``self.fit_state`` (a ``FitState``: the
coordinator, epoch, global step, history) and stops training with
``self.fit_state.stop_training = True``; ``self.model`` is the same object,
so Keras-style ``self.model.stop_training = True`` works too.
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Any, Callable

__all__ = ["Callback", "CallbackList", "History", "LambdaCallback", "CheckpointCallback",
           "EarlyStopping", "TerminateOnNaN", "TensorBoard", "PlotHistory"]


class Callback:
    """Base class: subclass it and override the hooks you need (all no-ops here)."""

    fit_state: Any = None   # the running fit's FitState (set by fit before on_train_begin)
    model: Any = None       # the same object, for Keras-style ``self.model.stop_training``
    params: dict = {}       # {"epochs", "steps", "initial_epoch", "verbose"}

    def set_fit_state(self, state) -> None:
        self.fit_state = self.model = state

    def set_params(self, params: dict) -> None:
        self.params = params

    def on_train_begin(self, logs: dict | None = None) -> None:
        pass

    def on_train_end(self, logs: dict | None = None) -> None:
        pass

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        pass

    def on_validation_end(self, epoch: int, logs: dict | None = None) -> None:
        """With ``fit(..., background_validation=True)``: the validation of
        ``epoch`` ended; ``logs`` are its ``val_`` metrics. Called on fit's
        thread between steps, in the order validations ended."""

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.on_batch_begin(batch, logs=logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.on_batch_end(batch, logs=logs)

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        pass

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        pass

    def close(self) -> None:
        """Release files, writers... Called by fit when it returns or raises."""


class CallbackList:
    """Calls a hook on every callback, in order."""

    def __init__(self, callbacks, state, params: dict):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            cb.set_fit_state(state)
            cb.set_params(params)

    def __getattr__(self, hook: str) -> Callable:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args, **kwargs):
            for cb in self.callbacks:
                getattr(cb, hook)(*args, **kwargs)
        return call

    def close(self) -> None:
        errors = []
        for cb in self.callbacks:
            try:
                cb.close()
            except Exception as exc:   # close them all, then report the first
                errors.append(exc)
        if errors:
            raise errors[0]


class History(Callback):
    """What ``fit`` returns, as Keras' History.

    ``history``: {"loss": [one mean per epoch], "val_loss": [...], ...};
    ``epoch``: the epochs (0-based) those values belong to; ``epochs_of``: the
    epochs of each key (validation metrics can be rarer, ``validation_freq``).
    Per step: ``steps`` lists the global step numbers (1-based) in the order
    their results came back and ``step_history`` maps each key a step returned
    to its values, aligned with ``steps`` (NaN where a step did not return it).
    """

    def __init__(self):
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []
        self.epochs_of: dict[str, list[int]] = {}
        self.steps: list[int] = []
        self.step_history: dict[str, list[float]] = {}

    def on_train_begin(self, logs=None):
        self.epoch = []

    def on_train_batch_end(self, batch, logs=None):
        n = len(self.steps)
        self.steps.append(self.fit_state.step if self.fit_state is not None else n + 1)
        for k, v in (logs or {}).items():
            self.step_history.setdefault(k, [math.nan] * n).append(v)
        for k, values in self.step_history.items():
            if len(values) == n:
                values.append(math.nan)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        self._record(epoch, logs)

    def on_validation_end(self, epoch, logs=None):
        """Background validation: its metrics, under the epoch validated."""
        self._record(epoch, logs)

    def _record(self, epoch, logs) -> None:
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)
            self.epochs_of.setdefault(k, []).append(epoch)

    @property
    def steps_per_epoch(self) -> int | None:
        return self.params.get("steps") if self.params else None


class LambdaCallback(Callback):
    """A callback from plain functions, as Keras' LambdaCallback::

        LambdaCallback(on_epoch_end=lambda epoch, logs: print(epoch, logs))
    """

    _HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
              "on_validation_end", "on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")

    def __init__(self, **hooks: Callable):
        unknown = set(hooks) - set(self._HOOKS)
        if unknown:
            raise TypeError(f"LambdaCallback: unknown hooks {sorted(unknown)}; "
                            f"known: {list(self._HOOKS)}")
        for name, fn in hooks.items():
            if fn is not None:
                setattr(self, name, fn)


class CheckpointCallback(Callback):
    """Save a checkpoint every ``every_epochs`` epochs (Keras' ModelCheckpoint).

    Uses ``manager.save(step=<global step>, extra={"epoch": <epochs done>,
    "logs": <the epoch's logs>})`` after the epoch's join(), so the cut is
    consistent. ``extra["epoch"]`` is the ``initial_epoch`` to resume from::

        state = manager.restore()
        fit(..., initial_epoch=state["extra"]["epoch"])

    ``save_best_only``: save only when ``monitor`` improved (mode "min",
    "max", or "auto": max for accuracy-like names). ``saved`` lists the
    checkpoint paths written (and kept).

    With ``fit(..., background_validation=True)`` a ``val_`` monitor comes
    after the epoch has ended and training has gone on: each epoch's end is
    saved as a candidate (the state its validation reads), kept if its
    validation improved the monitor and removed otherwise (or when its
    validation was skipped); the best so far is never removed by the
    manager's ``max_to_keep`` meanwhile. (An incremental manager keeps a
    removed candidate that a later checkpoint's chain needs.)
    """

    def __init__(self, manager, every_epochs: int = 1, *, save_best_only: bool = False,
                 monitor: str = "val_loss", mode: str = "auto", verbose: int = 0):
        if every_epochs < 1:
            raise ValueError(f"every_epochs must be >= 1, got {every_epochs}")
        self.manager, self.every_epochs = manager, every_epochs
        self.save_best_only, self.monitor, self.verbose = save_best_only, monitor, verbose
        self._better = _comparator(monitor, mode, 0.0)
        self.best: float | None = None
        self.saved: list[str] = []
        self._candidates: dict[int, str] = {}   # background validation: epoch -> its save
        self._best_path: str | None = None

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        if (epoch + 1) % self.every_epochs:
            return
        if self.save_best_only and self.monitor not in logs and \
                self.monitor.startswith("val_") and \
                getattr(self.fit_state, "background_validation", False):
            path = self.manager.save(step=self.fit_state.step, candidate=True,
                                     extra={"epoch": epoch + 1, "logs": dict(logs)})
            self._candidates[epoch] = path   # judged by on_validation_end; kept till then
            self.manager.pinned.add(path)
            return
        if self.save_best_only:
            value = logs.get(self.monitor)
            if value is None:
                _warn_missing(self, self.monitor, logs)
                return
            if self.best is not None and not self._better(value, self.best):
                return
            self.best = value
        path = self.manager.save(step=self.fit_state.step,
                                 extra={"epoch": epoch + 1, "logs": dict(logs)})
        self.saved.append(path)
        if self.verbose:
            print(f"epoch {epoch + 1}: saved checkpoint {path}", flush=True)

    def on_validation_end(self, epoch, logs=None):
        """Background validation: keep ``epoch``'s candidate if it improved the
        monitor, else remove it; candidates of epochs never validated go too."""
        value = (logs or {}).get(self.monitor)
        path = self._candidates.pop(epoch, None)
        for skipped in [e for e in self._candidates if e < epoch]:
            self._drop(self._candidates.pop(skipped))
        if path is None:
            return
        if value is None:
            _warn_missing(self, self.monitor, logs or {})
        if value is None or (self.best is not None and not self._better(value, self.best)) \
                or not os.path.isdir(path):
            self._drop(path)
            return
        self.best = value
        if self._best_path is not None and self._best_path != path:
            self.manager.pinned.discard(self._best_path)   # retention may take it now
        self._best_path = path   # (pinned: the best, whatever max_to_keep removes)
        self.saved.append(path)
        if self.verbose:
            print(f"epoch {epoch + 1}: {self.monitor} improved to {value:.6g}; kept its "
                  f"checkpoint {path}", flush=True)

    def on_train_end(self, logs=None):
        for path in self._candidates.values():   # never validated
            self._drop(path)
        self._candidates.clear()

    def _drop(self, path: str) -> None:
        if path != self._best_path:
            self.manager.pinned.discard(path)
            self.manager.remove(path)   # (kept if another save of its step wants it)


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved for ``patience`` epochs (Keras' EarlyStopping).

    Args:
      monitor: a key of the epoch logs ("val_loss", "loss", "val_accuracy"...).
      min_delta: smallest change that counts as an improvement.
      patience: epochs without improvement before stopping.
      mode: "min", "max", or "auto" (max when the name holds "acc" or "auc").
      baseline: stop if the monitor does not beat this within ``patience`` epochs.
      restore_best: a ``CheckpointManager`` (its own directory; it saves each
        new best there) to restore the best epoch's variables when training
        ends on a worse one. None: keep the last variables.
      start_from_epoch: epochs to wait before watching at all.
    After the run: ``stopped_epoch`` (0-based; None if it never stopped),
    ``best``, ``best_epoch``, ``restored`` (the checkpoint path or None).
    """

    def __init__(self, monitor: str = "val_loss", *, min_delta: float = 0.0, patience: int = 0,
                 mode: str = "auto", baseline: float | None = None, restore_best=None,
                 start_from_epoch: int = 0, verbose: int = 0):
        self.monitor, self.patience, self.baseline = monitor, patience, baseline
        self.min_delta, self.verbose = abs(min_delta), verbose
        self.restore_best, self.start_from_epoch = restore_best, start_from_epoch
        self._better = _comparator(monitor, mode, self.min_delta)
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.best: float | None = self.baseline
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self.restored: str | None = None
        self._best_path: str | None = None
        self._last_epoch: int | None = None

    def on_train_begin(self, logs=None):
        self._reset()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        self._last_epoch = epoch
        if self.monitor not in logs and self.monitor.startswith("val_") and \
                getattr(self.fit_state, "background_validation", False):
            return   # on_validation_end brings it
        self._observe(epoch, logs)

    def on_validation_end(self, epoch, logs=None):
        """Background validation: watch the monitor as it comes."""
        if self.monitor in (logs or {}):
            self._observe(epoch, logs)

    def _observe(self, epoch: int, logs: dict) -> None:
        value = logs.get(self.monitor)
        if value is None:
            _warn_missing(self, self.monitor, logs)
            return
        if epoch < self.start_from_epoch:
            return
        self.wait += 1
        if self.best is None or self._better(value, self.best):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            if self.restore_best is not None:
                self._best_path = self.restore_best.save(
                    step=self.fit_state.step, extra={"epoch": epoch + 1, self.monitor: value})
            return
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            self.fit_state.stop_training = True
            if self.verbose:
                print(f"epoch {epoch + 1}: early stopping ({self.monitor} did not improve on "
                      f"{self.best:.4f} for {self.wait} epochs)", flush=True)

    def on_train_end(self, logs=None):
        if (self.restore_best is not None and self._best_path is not None
                and self.best_epoch != self._last_epoch):
            self.restore_best.restore(self._best_path)
            self.restored = self._best_path
            if self.verbose:
                print(f"restored the variables of epoch {self.best_epoch + 1} "
                      f"({self.monitor} {self.best:.4f})", flush=True)


class TerminateOnNaN(Callback):
    """Stop training when a step returns a NaN or infinite loss (Keras' TerminateOnNaN)."""

    def __init__(self, monitor: str = "loss"):
        self.monitor = monitor

    def on_train_batch_end(self, batch, logs=None):
        value = (logs or {}).get(self.monitor)
        if value is not None and not math.isfinite(value):
            print(f"step {self.fit_state.step}: invalid {self.monitor} {value}, "
                  "terminating training", file=sys.stderr, flush=True)
            self.fit_state.stop_training = True


class TensorBoard(Callback):
    """Scalars for TensorBoard, written with tensorboardX (no TensorFlow needed).

    Keras' layout: ``log_dir/train`` gets ``epoch_<name>`` per epoch (step =
    epoch) and ``batch_<name>`` per training step (step = global step);
    ``log_dir/validation`` gets the ``val_`` metrics as ``epoch_<name>``, so
    TensorBoard draws train and validation curves of a metric together.

    Args:
      log_dir: the run's directory (``tensorboard --logdir`` its parent).
      update_freq: "batch" (every step, default), "epoch" (no per-step
        scalars), or an int N (every N-th global step).
    Needs tensorboardX: ``pip install 'pstrain[viz]'``.
    """

    def __init__(self, log_dir: str = "runs/tensorboard", update_freq: str | int = "batch",
                 flush_secs: int = 10):
        if update_freq not in ("batch", "epoch") and not (isinstance(update_freq, int)
                                                          and update_freq >= 1):
            raise ValueError(f'update_freq must be "batch", "epoch" or an int >= 1, '
                             f"got {update_freq!r}")
        self.log_dir, self.update_freq, self.flush_secs = log_dir, update_freq, flush_secs
        self._writers: dict[str, Any] = {}

    def _writer(self, which: str):
        w = self._writers.get(which)
        if w is None:
            w = self._writers[which] = summary_writer(os.path.join(self.log_dir, which),
                                                      self.flush_secs)
        return w

    def on_train_begin(self, logs=None):
        self._writer("train")   # fail now, not after the first epoch, if tensorboardX is missing

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "epoch" or not logs:
            return
        step = self.fit_state.step
        if self.update_freq != "batch" and step % self.update_freq:
            return
        w = self._writer("train")
        for k, v in logs.items():
            w.add_scalar(f"batch_{k}", v, step)

    def on_epoch_end(self, epoch, logs=None):
        for k, v in (logs or {}).items():
            which, name = ("validation", k[4:]) if k.startswith("val_") else ("train", k)
            self._writer(which).add_scalar(f"epoch_{name}", v, epoch)
        for w in self._writers.values():
            w.flush()

    def on_validation_end(self, epoch, logs=None):
        """Background validation: its metrics at the epoch validated."""
        self.on_epoch_end(epoch, {k: v for k, v in (logs or {}).items() if k.startswith("val_")})

    def on_train_end(self, logs=None):
        self.close()

    def close(self):
        writers, self._writers = self._writers, {}
        for w in writers.values():
            w.close()


class PlotHistory(Callback):
    """Write the training curves as a PNG when training ends (``coordinator.plots``).

    A missing matplotlib or an unwritable path does not fail the run: it
    prints one line to stderr instead. ``path_written`` is the PNG or None.
    """

    def __init__(self, path: str = "runs/loss.png", *, per_step: bool = True,
                 title: str | None = None, verbose: int = 1):
        self.path, self.per_step, self.title, self.verbose = path, per_step, title, verbose
        self.path_written: str | None = None

    def on_train_end(self, logs=None):
        from coordinator.plots import try_plot_history

        self.path_written, message = try_plot_history(
            self.fit_state.history, self.path, per_step=self.per_step, title=self.title)
        if self.verbose or self.path_written is None:
            print(message, file=sys.stdout if self.path_written else sys.stderr, flush=True)


# -- helpers -----------------------------------------------------------------------------
def require_tensorboardx():
    """tensorboardX's SummaryWriter, or ImportError saying what to install."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ImportError("TensorBoard event files need tensorboardX, the viz extra: "
                          "pip install 'pstrain[viz]' (from a checkout of the repository: "
                          "pip install -e '.[viz]')") from None
    return SummaryWriter


def summary_writer(directory: str, flush_secs: int = 10, filename_suffix: str = ""):
    """A tensorboardX SummaryWriter into ``directory`` (ImportError saying
    what to install when tensorboardX is missing). Its events reach the file
    on a thread of its own: only close() makes sure they are there."""
    return require_tensorboardx()(directory, flush_secs=flush_secs,
                                  filename_suffix=filename_suffix)


def _comparator(monitor: str, mode: str, min_delta: float) -> Callable[[float, float], bool]:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f'mode must be "auto", "min" or "max", got {mode!r}')
    if mode == "auto":
        name = monitor.lower()
        mode = "max" if ("acc" in name or "auc" in name) else "min"
    if mode == "min":
        return lambda value, best: value < best - min_delta
    return lambda value, best: value > best + min_delta


def _warn_missing(cb: Callback, key: str, logs: dict) -> None:
    if getattr(cb, "_warned", False):
        return
    cb._warned = True
    warnings.warn(f"{type(cb).__name__}: {key!r} is not in the epoch logs "
                  f"(available: {sorted(logs)}); it does nothing until it is", stacklevel=3)
