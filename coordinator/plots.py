"""Training curves as a PNG, with matplotlib's Agg renderer (no display needed).

    from coordinator.plots import plot_history
    history = fit(...)
    plot_history(history, "runs/digits/loss.png")

One panel per quantity in the History: loss first, then each metric; a
metric's validation values (``val_<name>``) share its panel. The epoch
means are drawn at the end of their epoch (x = 1, 2, ...); with
``per_step=True`` the values of every step are drawn faintly behind them on
the same axis (step s at x = s / steps_per_epoch), so the spread within an
epoch shows. matplotlib comes with ``pip install 'pstrain[viz]'`` (or the
``examples`` extra); ``try_plot_history`` turns its absence into a message.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Mapping

__all__ = ["plot_history", "try_plot_history", "PlotUnavailable"]


class PlotUnavailable(ImportError):
    """matplotlib is not installed."""


def _series(history: Any):
    """(per-epoch {key: (xs, ys)}, per-step {key: (xs, ys)}) from a History or a dict."""
    if isinstance(history, Mapping):
        return {k: (list(range(1, len(v) + 1)), list(v)) for k, v in history.items()}, {}
    epochs_of = getattr(history, "epochs_of", {}) or {}
    epochs = {}
    for k, values in history.history.items():
        es = epochs_of.get(k) or list(range(len(values)))
        epochs[k] = ([e + 1 for e in es], list(values))
    steps = {}
    spe = getattr(history, "steps_per_epoch", None)
    if spe and getattr(history, "steps", None):
        xs = [s / spe for s in history.steps]
        for k, values in history.step_history.items():
            steps[k] = (xs, list(values))
    return epochs, steps


def _groups(keys) -> list[str]:
    bases = []
    for k in keys:
        base = k[4:] if k.startswith("val_") else k
        if base not in bases:
            bases.append(base)
    if "loss" in bases:
        bases.remove("loss")
        bases.insert(0, "loss")
    return bases


def plot_history(history: Any, path: str, *, per_step: bool = True, title: str | None = None,
                 dpi: int = 110) -> str:
    """Write the curves of ``history`` (a fit History, or {"loss": [...], ...}) to ``path``.

    Returns the absolute path of the PNG. Creates missing directories.
    Raises PlotUnavailable (an ImportError) without matplotlib, ValueError
    when the history is empty, OSError when the file cannot be written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable("matplotlib is not installed (pip install 'pstrain[viz]')") from None

    epochs, steps = _series(history)
    if not any(ys for _, ys in epochs.values()) and not any(ys for _, ys in steps.values()):
        raise ValueError("the history is empty: nothing to plot")
    groups = _groups(list(epochs) + (list(steps) if per_step else []))
    fig = Figure(figsize=(8, 2.2 + 2.6 * len(groups)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups), 1, sharex=True, squeeze=False)[:, 0]
    for ax, base in zip(axes, groups):
        if per_step and base in steps:
            xs, ys = steps[base]
            ax.plot(xs, ys, lw=0.8, alpha=0.35, color="C0", label=f"{base} (per step)")
        if base in epochs:
            xs, ys = epochs[base]
            ax.plot(xs, ys, "o-", color="C0", ms=4, label=f"{base} (epoch mean)"
                    if per_step and base in steps else base)
        if f"val_{base}" in epochs:
            xs, ys = epochs[f"val_{base}"]
            ax.plot(xs, ys, "s--", color="C1", ms=4, label=f"val_{base}")
        ax.set_ylabel(base)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("epoch")
    if title:
        fig.suptitle(title)
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}.png"
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def try_plot_history(history: Any, path: str, **kwargs) -> tuple[str | None, str]:
    """``plot_history`` that does not raise: (the PNG's path or None, a one-line message)."""
    try:
        written = plot_history(history, path, **kwargs)
    except (PlotUnavailable, ValueError) as exc:
        return None, f"plot: {exc}; no plot written"
    except OSError as exc:
        return None, f"plot: cannot write {path}: {type(exc).__name__}: {exc}"
    return written, f"loss curve: {written}"
