"""Training progress on the coordinator: a tqdm bar on a terminal, log lines elsewhere.

    progress = Progress(total=500, workers=lambda: (coord.workers_alive(), coord.num_workers))
    progress.scheduled(50)                 # steps handed to schedule()
    progress.update(1, loss=0.41)          # a step's result came back
    progress.write("epoch 1/10 ...")       # a line on stdout that does not break the bar
    progress.close()

On a terminal (``interactive``: by default whether the progress stream,
stderr, is one) it draws one tqdm bar for the whole run: steps done of the
total, steps/s, elapsed and remaining time, and the latest loss, live workers
and steps scheduled. Anywhere else (CI logs, containers, files) a redrawn bar
is noise, so it writes a plain line instead every ``log_every_seconds``
seconds and/or every ``log_every_steps`` steps, and a last line on close::

    progress: epoch 2/10  step 75/500  scheduled 100  12.3 steps/s  loss 0.4123  workers 2/2  elapsed 6s  eta 34s

``fit`` makes one of these for ``verbose=1`` (pass ``progress=Progress(...)``
to choose the options). Without tqdm installed it always writes lines.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable, TextIO

__all__ = ["Progress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """6s, 2m05s, 1h02m."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _columns(stream) -> int | None:
    """The terminal's width; 0 for a terminal of no size (where tqdm draws nothing)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return None


class Progress:
    """Steps done of steps scheduled / planned, with rate, loss and live workers.

    Args:
      total: steps planned for the run (None: unknown; the bar then counts up
        and lines show no ETA). Settable later (``progress.total = n``).
      initial: steps already done before this run (a resumed run).
      file: where progress goes (default: sys.stderr at the time of the first
        output, so test capture and redirection work).
      interactive: True for a tqdm bar, False for log lines; None (default):
        a bar when ``file`` is a terminal.
      log_every_seconds: lines mode: a line when this many seconds passed
        since the last (None: not by time). Lines come even when no step
        finished, so a stalled run shows it.
      log_every_steps: lines mode: a line every this many steps (None: not
        by steps).
      workers: a callable returning (alive, total) workers, read at each
        refresh (e.g. ``lambda: (coord.workers_alive(), coord.num_workers)``).
      clock: a monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(self, total: int | None = None, *, initial: int = 0, file: TextIO | None = None,
                 interactive: bool | None = None, log_every_seconds: float | None = 10.0,
                 log_every_steps: int | None = None,
                 workers: Callable[[], tuple[int, int]] | None = None,
                 desc: str = "", clock: Callable[[], float] = time.monotonic):
        if log_every_steps is not None and log_every_steps < 1:
            raise ValueError(f"log_every_steps must be >= 1 or None, got {log_every_steps}")
        self.total, self.initial = total, initial
        self.done = initial            # steps whose result came back
        self.scheduled_steps = initial  # steps handed to schedule()
        self.loss: float | None = None
        self.desc = desc
        self.file, self.interactive = file, interactive
        self.log_every_seconds, self.log_every_steps = log_every_seconds, log_every_steps
        self.workers_fn, self.clock = workers, clock
        self._bar = None
        self._opened = False
        self._closed = False
        self._t0 = 0.0
        self._last_line_time = 0.0
        self._last_line_done = initial

    # -- setup ----------------------------------------------------------------------------
    def _open(self) -> None:
        if self._opened:
            return
        self._opened = True
        if self.file is None:
            self.file = sys.stderr
        if self.interactive is None:
            self.interactive = _isatty(self.file) and _columns(self.file) != 0
        self._t0 = self._last_line_time = self.clock()
        if self.interactive:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                self.interactive = False
                return
            self._bar = tqdm(total=self.total, initial=self.initial, file=self.file,
                             unit="step", desc=self.desc or None, dynamic_ncols=True,
                             mininterval=0.2, leave=True)

    def __enter__(self) -> "Progress":
        self._open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- updates ------------------------------------------------------------------------------
    def set_initial(self, initial: int) -> None:
        """Steps done before this run (before the first output only)."""
        if self._opened:
            raise RuntimeError("set_initial() after the progress started")
        self.initial = self.done = self.scheduled_steps = self._last_line_done = initial

    def set_total(self, total: int | None) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def set_description(self, desc: str) -> None:
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description_str(desc, refresh=False)

    def scheduled(self, n: int = 1) -> None:
        """``n`` more steps were handed to schedule()."""
        self._open()
        self.scheduled_steps += n

    def update(self, n: int = 1, *, loss: float | None = None) -> None:
        """``n`` more steps finished; ``loss``: the latest step's loss."""
        self._open()
        self.done += n
        self.scheduled_steps = max(self.scheduled_steps, self.done)
        if loss is not None:
            self.loss = float(loss)
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(n)
        else:
            self._maybe_line()

    def tick(self) -> None:
        """No step finished, but time passed: refresh the bar / write a line if one is due."""
        self._open()
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.refresh()
        else:
            self._maybe_line()

    def write(self, line: str, file: TextIO | None = None) -> None:
        """Print a line (on stdout by default) without garbling the bar."""
        self._open()
        out = file if file is not None else sys.stdout
        if self._bar is not None:
            self._bar.write(line, file=out)
            out.flush()
        else:
            print(line, file=out, flush=True)

    def close(self) -> None:
        """End the bar, or write the last line (lines mode)."""
        if self._closed or not self._opened:
            self._closed = True
            return
        self._closed = True
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.close()
        else:
            elapsed = self.clock() - self._t0
            short = self.total is not None and self.done < self.total   # (interrupted, failed)
            self._emit(f"progress: {'stopped after' if short else 'done '} "
                       f"{self.done - self.initial} steps in "
                       f"{format_seconds(elapsed)}  {self._rate(elapsed):.1f} steps/s"
                       + (f"  loss {self.loss:.4f}" if self.loss is not None else ""))

    # -- lines mode -----------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return self.clock() - self._t0 if self._opened else 0.0

    def _rate(self, elapsed: float) -> float:
        return (self.done - self.initial) / elapsed if elapsed > 0 else 0.0

    def _workers(self) -> str | None:
        if self.workers_fn is None:
            return None
        try:
            alive, total = self.workers_fn()
        except Exception:   # a progress display must never break training
            return None
        return f"{alive}/{total}"

    def _postfix(self) -> str:
        parts = []
        if self.loss is not None:
            parts.append(f"loss={self.loss:.4f}")
        w = self._workers()
        if w is not None:
            parts.append(f"workers={w}")
        parts.append(f"scheduled={self.scheduled_steps}")
        return ", ".join(parts)

    def line(self) -> str:
        """The lines-mode line for now."""
        elapsed = self.clock() - self._t0
        rate = self._rate(elapsed)
        total = "?" if self.total is None else str(self.total)
        parts = []
        if self.desc:
            parts.append(self.desc)
        parts += [f"step {self.done}/{total}", f"scheduled {self.scheduled_steps}",
                  f"{rate:.1f} steps/s"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        w = self._workers()
        if w is not None:
            parts.append(f"workers {w}")
        parts.append(f"elapsed {format_seconds(elapsed)}")
        if self.total is not None and rate > 0:
            parts.append(f"eta {format_seconds(max(0, self.total - self.done) / rate)}")
        return "progress: " + "  ".join(parts)

    def _maybe_line(self) -> None:
        now = self.clock()
        due = (self.log_every_steps is not None
               and self.done - self._last_line_done >= self.log_every_steps)
        due = due or (self.log_every_seconds is not None
                      and now - self._last_line_time >= self.log_every_seconds)
        if due:
            self._emit(self.line())
            self._last_line_time, self._last_line_done = now, self.done

    def _emit(self, text: str) -> None:
        print(text, file=self.file, flush=True)
