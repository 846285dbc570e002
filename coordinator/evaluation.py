"""Evaluation beside training, which never pauses it.

Two ways:

* In ``fit``: ``fit(..., validation_fn=evaluate, validation_freq=2,
  background_validation=True)`` runs ``evaluate(epoch)`` on a thread of its
  own (``BackgroundValidation``) while the next epochs train; its metrics
  reach the callbacks' ``on_validation_end(epoch, logs)`` (History,
  TensorBoard, EarlyStopping), and Prometheus. A validation that is due
  while the previous one still runs is skipped and counted; one that runs
  past ``validation_timeout`` seconds is abandoned (reported, counted; its
  thread is left to end on its own: Python cannot stop a thread) and the
  next one due starts on a new thread. After the last epoch fit waits for
  the running validation and the last epoch's (each up to the timeout).
* As a process of its own: ``coordinator evaluate CKPT_DIR --fn
  MODULE:FUNCTION --logdir DIR`` follows a checkpoint directory
  (``Sidecar``): each time a newer complete checkpoint appears, it reads its
  variables from the files (no parameter server is asked) and calls
  ``FUNCTION(checkpoint)`` with a ``Checkpoint`` (step, path, extra,
  variables: {name: array}); the metrics go to TensorBoard event files in
  DIR/evaluation (tags ``eval_<name>``, step = the checkpoint's step) and,
  with ``--metrics-port``, to Prometheus. Training does not know it
  exists: killing, hanging or restarting it changes nothing there.
  Checkpoints are evaluated once each, newest first: ones that appeared
  while an evaluation ran, older than the newest, are skipped and counted.
  DIR/evaluator_state.json records the last step evaluated (after its
  events are flushed), so a restarted sidecar goes on after it (a sidecar
  killed mid-evaluation evaluates that checkpoint again).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import numbers
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np

from coordinator import metrics as _metrics
from coordinator.shard_files import read_small, write_new

log = logging.getLogger("coordinator.evaluation")

STATE_FILE = "evaluator_state.json"


# -- metric values ---------------------------------------------------------------------------
def scalar(v) -> float | None:
    """v as a float if it is a real number (or a 0-d / 1-element array), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, numbers.Real):
        return float(v)
    if getattr(v, "ndim", None) == 0 or getattr(v, "shape", None) == (1,):
        try:
            return float(v)
        except (TypeError, ValueError):
            return None
    return None


def metric_values(metrics, what: str = "validation_fn") -> dict[str, float]:
    """An evaluation's dict of metrics as floats; TypeError for anything else."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(f"{what} must return a dict of metrics (or None), got "
                        f"{type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        f = scalar(v)
        if f is None:
            raise TypeError(f"{what}: metric {k!r} is {type(v).__name__}, not a number")
        out[str(k)] = f
    return out


def val_logs(metrics) -> dict[str, float]:
    """Validation metrics with a ``val_`` prefix (kept if already there)."""
    return {k if k.startswith("val_") else f"val_{k}": v
            for k, v in metric_values(metrics).items()}


# -- in fit: a thread of its own ------------------------------------------------------------
class _Run:
    def __init__(self, epoch: int, timeout: float | None):
        self.epoch = epoch
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.done = threading.Event()
        self.logs: dict[str, float] | None = None
        self.error: BaseException | None = None
        self.error_text = ""


class BackgroundValidation:
    """Runs ``fn(epoch)`` on a daemon thread, one at a time, for fit.

    ``start(epoch)``: begin now, or (one still running) skip and count.
    ``poll()``: the (epoch, val_ logs) of validations that ended since the
    last poll, in order; one past its deadline is abandoned here. Neither
    blocks. ``finish(epoch)``: at the end of training, wait for the running
    one, then validate ``epoch`` (if given and not done) and wait for it,
    each up to the timeout. Counters: ``skipped``, ``abandoned``, ``failed``.
    A validation that raises is logged with its traceback and counted; it
    does not stop training.
    """

    def __init__(self, fn: Callable[[int], Any], timeout: float | None = 600.0,
                 source: str = "fit"):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"validation_timeout must be > 0 seconds or None, got {timeout!r}")
        self.fn, self.timeout, self.source = fn, timeout, source
        self.skipped = self.abandoned = self.failed = 0
        self._running: _Run | None = None
        self._ended: list[_Run] = []
        self.last_epoch: int | None = None   # the last epoch a validation started for

    def start(self, epoch: int) -> bool:
        """Start validating ``epoch`` unless one is running (then: skipped)."""
        self._check()
        if self._running is not None:
            self.skipped += 1
            _metrics.evaluation(self.source, "skipped")
            log.warning("validation of epoch %d skipped: the validation of epoch %d is still "
                        "running", epoch + 1, self._running.epoch + 1)
            return False
        run = self._running = _Run(epoch, self.timeout)
        self.last_epoch = epoch
        threading.Thread(target=self._body, args=(run,), daemon=True,
                         name=f"validation-epoch-{epoch}").start()
        return True

    def _body(self, run: _Run) -> None:
        try:
            run.logs = val_logs(self.fn(run.epoch))
        except BaseException as exc:   # reported by poll(); the thread just ends
            run.error, run.error_text = exc, traceback.format_exc()
        run.done.set()

    def _check(self) -> None:
        """Move a finished run to the ended list; abandon one past its deadline."""
        run = self._running
        if run is None:
            return
        if run.done.is_set():
            self._running = None
            self._ended.append(run)
        elif run.deadline is not None and time.monotonic() >= run.deadline:
            self._running = None
            self.abandoned += 1
            _metrics.evaluation(self.source, "abandoned")
            log.error("validation of epoch %d abandoned: still running after %gs "
                      "(validation_timeout); training goes on, its thread is left to end on "
                      "its own", run.epoch + 1, self.timeout)

    def poll(self) -> list[tuple[int, dict[str, float]]]:
        self._check()
        out = []
        for run in self._ended:
            if run.error is not None:
                self.failed += 1
                _metrics.evaluation(self.source, "failed")
                log.error("validation of epoch %d failed (training goes on):\n%s",
                          run.epoch + 1, run.error_text)
                continue
            _metrics.evaluation(self.source, "ok", time.monotonic() - run.started, run.epoch,
                                run.logs)
            out.append((run.epoch, run.logs))
        self._ended.clear()
        return out

    def _wait(self) -> None:
        run = self._running
        if run is not None:
            left = None if run.deadline is None else max(0.0, run.deadline - time.monotonic())
            run.done.wait(left)
            self._check()

    def finish(self, epoch: int | None = None) -> list[tuple[int, dict[str, float]]]:
        self._wait()
        out = self.poll()
        if epoch is not None and self.last_epoch != epoch:
            self.start(epoch)
            self._wait()
            out += self.poll()
        return out


# -- as a process of its own: `coordinator evaluate` ------------------------------------------
@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as an evaluation function gets it: its variables'
    values, and its dynamic tables' rows (``lookup``)."""
    step: int
    path: str
    extra: dict
    variables: dict[str, np.ndarray]
    tables: dict = dataclasses.field(default_factory=dict)   # serving.lookup_rows's

    def lookup(self, name: str, keys) -> np.ndarray:
        """Rows of ``keys`` (any shape; a trailing dim): of dynamic table
        ``name``, zeros for keys without a row (as the servers answer a
        look-up that does not admit: examples/ctr.py evaluate_checkpoint);
        of a variable (a fixed table), its rows ``keys``. KeyError for an
        unknown name."""
        from coordinator.serving import lookup_rows
        return lookup_rows(self.variables, self.tables, name, keys, f"checkpoint {self.path}")


def read_checkpoint(path: str) -> Checkpoint:
    """Every variable's value and every dynamic table's rows in checkpoint
    ``path``, read from its files (an incremental checkpoint composed with
    its chain; each file checked against its manifest: CheckpointError)."""
    from coordinator.checkpoint_files import chain_of, load_variable
    from coordinator.serving import _spec, table_rows  # what the loaders need

    chain = chain_of(path)
    manifest = chain[-1][1]
    values = {name: load_variable(_spec(name, info), chain)["value"]
              for name, info in manifest["variables"].items()}
    tables = {name: table_rows(chain, name, info)
              for name, info in manifest.get("tables", {}).items()}
    return Checkpoint(int(manifest["step"]), path, manifest.get("extra", {}), values, tables)


def load_function(name: str) -> Callable[[Checkpoint], Any]:
    """``"module:function"`` imported here."""
    module, _, qualname = name.partition(":")
    if not module or not qualname:
        raise ValueError(f"--fn must be MODULE:FUNCTION, got {name!r}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{name} is not a function")
    return obj


class Sidecar:
    """Follows ``ckpt_dir``: evaluates each newer checkpoint once with
    ``fn(Checkpoint) -> {name: number}`` (see the module docstring).
    ``logdir`` holds the events and the state file. Raises ImportError at
    once, saying what to install, when tensorboardX (the viz extra) is
    missing: not after the first evaluation, before its state is written."""

    def __init__(self, ckpt_dir: str, fn: Callable[[Checkpoint], Any], logdir: str, *,
                 timeout: float | None = 600.0):
        from coordinator.callbacks import require_tensorboardx
        require_tensorboardx()
        self.ckpt_dir, self.fn, self.logdir, self.timeout = ckpt_dir, fn, logdir, timeout
        os.makedirs(logdir, exist_ok=True)
        self.state_path = os.path.join(logdir, STATE_FILE)
        self.last_step = self._read_state()
        self.evaluated = self.failed = self.skipped = self.abandoned = 0
        self.unreadable: set[str] = set()   # checkpoints whose files could not be read

    def _read_state(self) -> int:
        try:
            return int(json.loads(read_small(self.state_path))["last_step"])
        except FileNotFoundError:
            return -1
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read {self.state_path} ({exc}): remove it to evaluate "
                             "every checkpoint again") from None

    def _write_state(self) -> None:
        tmp = f"{self.state_path}.tmp-{secrets.token_hex(8)}"   # new, no link followed
        write_new(tmp, json.dumps({"last_step": self.last_step, "time": time.time()}).encode())
        os.replace(tmp, self.state_path)

    def pending(self) -> list[str]:
        """Complete checkpoints newer than the last one evaluated, oldest first."""
        from coordinator.checkpoint_files import find_checkpoints
        return [p for p in find_checkpoints(self.ckpt_dir)
                if _step_of(p) > self.last_step and p not in self.unreadable]

    def step_once(self) -> int | None:
        """Evaluate the newest pending checkpoint (skipping older pending
        ones); its step, or None when there was none."""
        todo = self.pending()
        if not todo:
            return None
        path = todo[-1]
        if len(todo) > 1:
            self.skipped += len(todo) - 1
            for _ in todo[:-1]:
                _metrics.evaluation("sidecar", "skipped")
        step = _step_of(path)
        start = time.monotonic()
        outcome, values, text = self._evaluate(path)
        seconds = time.monotonic() - start
        name = os.path.basename(path)
        if outcome == "unreadable":   # its step is not to be trusted: nothing recorded, so
            self.unreadable.add(path)   # checkpoints of lower steps still count (issue 33)
            self.failed += 1
            _metrics.evaluation("sidecar", "failed", seconds, step, {})
            print(f"coordinator evaluate: {name} cannot be read, skipped (the checkpoints "
                  f"after it are evaluated as they come):\n{text}", file=sys.stderr, flush=True)
            return step
        if outcome == "ok":
            self._write_events(step, values)
        _metrics.evaluation("sidecar", outcome, seconds, step, values)
        self.last_step = step   # once each, whatever the outcome; said once recorded
        self._write_state()
        if outcome == "ok":
            self.evaluated += 1
            print(f"coordinator evaluate: {name} (step {step}): "
                  + "  ".join(f"{k} {v:.6g}" for k, v in values.items())
                  + f"  ({seconds:.2f}s)", flush=True)
        elif outcome == "failed":
            self.failed += 1
            print(f"coordinator evaluate: {name} (step {step}) failed:\n{text}",
                  file=sys.stderr, flush=True)
        else:
            self.abandoned += 1
            print(f"coordinator evaluate: {name} (step {step}) abandoned: still running after "
                  f"{self.timeout:g}s (--timeout); going on with the next checkpoint",
                  file=sys.stderr, flush=True)
        return step

    def _write_events(self, step: int, values: dict[str, float]) -> None:
        """An event file of its own per evaluation, closed before the state
        says it was done (tensorboardX writes on a thread: only close() makes
        sure the events are in the file)."""
        from coordinator.callbacks import summary_writer
        writer = summary_writer(os.path.join(self.logdir, "evaluation"),
                                filename_suffix=f".step{step}.{os.getpid()}")
        try:
            for k, v in values.items():
                writer.add_scalar(f"eval_{k}", v, step)
        finally:
            writer.close()

    def _evaluate(self, path: str) -> tuple[str, dict[str, float], str]:
        """("ok" | "failed" | "unreadable" | "abandoned", metrics, error
        text), run on a daemon thread so a hang is abandoned after the timeout."""
        from coordinator.checkpoint_files import CheckpointError
        box: dict[str, Any] = {}
        done = threading.Event()

        def body():
            try:
                try:
                    checkpoint = read_checkpoint(path)
                except (CheckpointError, OSError, ValueError, KeyError, TypeError) as exc:
                    box["unreadable"] = f"{type(exc).__name__}: {exc}"
                else:
                    box["values"] = metric_values(self.fn(checkpoint), "the --fn function")
            except BaseException:
                box["error"] = traceback.format_exc()
            done.set()
        threading.Thread(target=body, daemon=True, name="evaluate").start()
        if not done.wait(self.timeout):
            return "abandoned", {}, ""
        if "unreadable" in box:
            return "unreadable", {}, box["unreadable"]
        if "error" in box:
            return "failed", {}, box["error"]
        return "ok", box["values"], ""

    def run(self, *, interval: float = 10.0, until_step: int | None = None,
            once: bool = False, stop: threading.Event | None = None) -> None:
        """Evaluate as checkpoints appear, every ``interval`` seconds; return
        after one look (``once``), after evaluating a step >= ``until_step``,
        or when ``stop`` is set."""
        stop = stop or threading.Event()
        while True:
            step = self.step_once()
            if once or (until_step is not None and self.last_step >= until_step):
                return
            if step is None and stop.wait(interval):
                return

    def close(self) -> None:
        """(Nothing is held between evaluations.)"""


def _step_of(path: str) -> int:
    return int(os.path.basename(path).split("-", 1)[1])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="CKPT_DIR",
                   help="the checkpoint directory to follow (CheckpointManager's)")
    p.add_argument("--fn", required=True, metavar="MODULE:FUNCTION",
                   help="the evaluation: FUNCTION(checkpoint) -> {metric: number}, imported "
                        "here (checkpoint: coordinator.evaluation.Checkpoint: step, path, "
                        "extra, variables, lookup(table, keys))")
    p.add_argument("--logdir", required=True, metavar="DIR",
                   help="TensorBoard event files go to DIR/evaluation; DIR/"
                        f"{STATE_FILE} records the last step evaluated")
    p.add_argument("--interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between looks for a new checkpoint (default 10)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="an evaluation running longer is abandoned and reported (default 600)")
    p.add_argument("--until-step", type=int, metavar="N",
                   help="exit 0 once a checkpoint of step >= N was evaluated")
    p.add_argument("--once", action="store_true",
                   help="evaluate the newest new checkpoint, if any, and exit")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this port (0: a free one, printed); "
                        "host: $PSTRAIN_METRICS_HOST, default 127.0.0.1")


def main(args) -> int:
    """`coordinator evaluate`: 0 when done, 1 when the function cannot be
    loaded, 2 for bad arguments or without tensorboardX (the viz extra)."""
    if args.interval <= 0 or args.timeout <= 0:
        print("coordinator evaluate: --interval and --timeout must be > 0", file=sys.stderr)
        return 2
    try:
        fn = load_function(args.fn)
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"coordinator evaluate: cannot load --fn {args.fn}: {type(exc).__name__}: {exc}. "
              "Run where the module imports (PYTHONPATH)", file=sys.stderr)
        return 1
    try:
        sidecar = Sidecar(os.path.abspath(args.directory), fn, args.logdir, timeout=args.timeout)
    except (ValueError, OSError, ImportError) as exc:
        print(f"coordinator evaluate: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        host, port = _metrics.serve(args.metrics_port)
        print(f"coordinator evaluate: metrics on {host}:{port}", flush=True)
    print(f"coordinator evaluate: following {sidecar.ckpt_dir} (after step {sidecar.last_step})",
          flush=True)
    try:
        sidecar.run(interval=args.interval, until_step=args.until_step, once=args.once)
    except KeyboardInterrupt:   # Ctrl-C: one line and 130, as the other commands
        print(f"coordinator evaluate: interrupted after step {sidecar.last_step}",
              file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    finally:
        sidecar.close()
    return 0
