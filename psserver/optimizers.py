"""Server-side optimizers: dense and lazy sparse updates, in place, pure numpy.

Each variable on a parameter server owns its optimizer *slots* (``momentum``,
``accumulator``, ``m``/``v``...), created by :meth:`Optimizer.create_slots`
with the variable's shape and dtype. ``apply_dense`` and ``apply_sparse``
update the live variable array and its slots in place.

Hyper-parameter names, defaults and update formulas follow
``tf.keras.optimizers`` in Keras 3, so that TensorFlow users get the numbers
they know:

========== ================================================= ==================
name       hyper-parameters (defaults)                       slots
========== ================================================= ==================
sgd        learning_rate=0.01                                (none)
momentum   learning_rate=0.01, momentum=0.9, nesterov=0      momentum
adagrad    learning_rate=0.001, initial_accumulator_value=0.1, accumulator
           epsilon=1e-7
adam       learning_rate=0.001, beta_1=0.9, beta_2=0.999,    m, v, iterations
           epsilon=1e-7
========== ================================================= ==================

Update rules (``g`` the gradient, ``lr`` the learning rate)::

    sgd       var -= lr * g
    momentum  m = momentum * m - lr * g
              var += momentum * m - lr * g   if nesterov else   var += m
    adagrad   accum += g * g
              var -= lr * g / sqrt(accum + epsilon)
    adam      t = iterations + 1
              alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
              m += (g - m) * (1 - beta_1)
              v += (g * g - v) * (1 - beta_2)
              var -= alpha * m / (sqrt(v) + epsilon)
              iterations += 1

Where this module differs from Keras 3, on purpose:

* ``momentum`` is its own optimizer (Keras: ``SGD(momentum=...)``); it keeps
  its ``momentum`` slot even with ``momentum=0``. ``nesterov`` travels as a
  float (hyper-parameters are a ``map<string, double>`` on the wire) and must
  be 0 or 1. ``momentum`` must lie in [0, 1) (Keras allows 1.0, which never
  forgets a gradient).
* Adagrad: ``epsilon`` is added *inside* the square root, as Keras 3 does
  (``keras/src/optimizers/adagrad.py``); Keras 2 / ``optimizer_v2`` added it
  outside (``sqrt(accum) + epsilon``).
* Adam's step count is per variable: the 0-d int64 slot ``iterations`` counts
  the ``apply_dense``/``apply_sparse`` calls made on *this* variable (Keras
  uses the optimizer's global ``iterations``). For sparse updates the bias
  correction therefore uses this per-variable count, where LazyAdam
  (TF-Addons) uses the global step; rows untouched by an update are not
  decayed (lazy), exactly as in LazyAdam. An empty sparse update still counts.
* Adam's bias-correction factor ``alpha`` is computed in float64 from the
  Python floats and rounded once to the variable's dtype (Keras computes it in
  the variable's dtype: identical up to rounding for float32/float64, and
  markedly more accurate for float16).
* Everything else is computed in the variable's dtype, with the
  hyper-parameters cast to it first, as Keras does. The order of the floating
  point operations is sometimes rearranged to work in one scratch buffer
  (e.g. ``(lr*g)/d`` becomes ``(g/d)*lr``), so results may differ from Keras
  in the last bit.
* Validation is stricter where Keras would silently produce NaN: Adam needs
  ``epsilon > 0`` (else an element whose gradients were all zero becomes 0/0),
  and Adagrad needs ``epsilon > 0`` or ``initial_accumulator_value > 0``.

Atomicity: an apply either fully succeeds or leaves the variable and slots
untouched. The caller validates ids, shapes, dtypes and finiteness before it
calls; inside, every allocation (scratch buffers, gathered rows) happens
before the first write, and the arithmetic runs under ``np.errstate(all=
"ignore")`` so a process-wide ``np.seterr(all="raise")`` cannot interrupt an
update half-way (an overflow, e.g. ``g*g`` in float16, yields inf, as in
Keras; the caller may check the result).

Memory: a dense apply allocates exactly one scratch array the size of the
variable (plus a cast copy of the gradient only if its dtype differs, which the
caller normally rules out). A sparse apply gathers the touched rows of the
variable and slots (copies), updates them with the same kernels, and scatters
them back.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

__all__ = [
    "Optimizer",
    "SGD",
    "Momentum",
    "Adagrad",
    "Adam",
    "OPTIMIZERS",
    "make_optimizer",
    "sum_duplicates",
]


class Optimizer:
    """Base class: hyper-parameters, slot creation, dense and sparse apply.

    Subclasses set ``name``, ``slot_names``, ``_defaults`` and implement
    ``_check`` (extra validation) and ``_kernel`` (the in-place update of
    ``x``/``slots`` given ``g``, on arrays of one shape).
    """

    name: ClassVar[str] = ""
    slot_names: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, float]] = {}

    def __init__(self, **params: float) -> None:
        unknown = sorted(set(params) - set(self._defaults))
        if unknown:
            raise ValueError(
                f"unknown hyper-parameter(s) {', '.join(map(repr, unknown))} "
                f"for optimizer {self.name!r}; valid ones are: "
                f"{', '.join(sorted(self._defaults))}"
            )
        cfg: dict[str, float] = {}
        for key, default in self._defaults.items():
            raw = params.get(key, default)
            if isinstance(raw, (bool, np.bool_)):
                raw = float(raw)
            if not isinstance(raw, (int, float, np.integer, np.floating)):
                raise ValueError(
                    f"{self.name}: hyper-parameter {key!r} must be a number, "
                    f"got {type(raw).__name__} {raw!r}"
                )
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError(
                    f"{self.name}: hyper-parameter {key!r} must be finite, got {value!r}"
                )
            cfg[key] = value
        if cfg.get("learning_rate", 1.0) <= 0.0:
            raise ValueError(
                f"{self.name}: learning_rate must be > 0, got {cfg['learning_rate']!r}"
            )
        if cfg.get("epsilon", 0.0) < 0.0:
            raise ValueError(f"{self.name}: epsilon must be >= 0, got {cfg['epsilon']!r}")
        self._check(cfg)
        self._config = cfg

    # -- subclass hooks ------------------------------------------------------
    def _check(self, cfg: dict[str, float]) -> None:
        """Extra validation of the (complete, finite) config; raise ValueError."""

    def _kernel(self, x: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray,
                scratch: np.ndarray, step: int) -> None:
        """Update ``x`` and ``slots`` in place (all of ``x``'s shape)."""
        raise NotImplementedError

    # -- public API ------------------------------------------------------------
    def config(self) -> dict[str, float]:
        """All hyper-parameters, defaults included (a copy)."""
        return dict(self._config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config.items())
        return f"{type(self).__name__}({args})"

    def create_slots(self, value: np.ndarray) -> dict[str, np.ndarray]:
        """New slot arrays for ``value`` (its shape and dtype)."""
        return {n: np.zeros_like(value) for n in self.slot_names}

    def _array_slots(self, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: slots[n] for n in self.slot_names}

    def _step(self, slots: Mapping[str, np.ndarray]) -> int:
        return 0

    def _count(self, slots: Mapping[str, np.ndarray]) -> None:
        pass

    def apply_dense(self, value: np.ndarray, slots: dict[str, np.ndarray],
                    grad: np.ndarray) -> None:
        """``value`` and ``slots`` updated in place by the whole gradient."""
        g = np.asarray(grad, dtype=value.dtype)
        arrays = self._array_slots(slots)
        step = self._step(slots)
        scratch = np.empty_like(value)  # every allocation before any write
        with np.errstate(all="ignore"):
            self._kernel(value, arrays, g, scratch, step)
            self._count(slots)

    def apply_sparse(self, value: np.ndarray, slots: dict[str, np.ndarray],
                     ids: np.ndarray, rows: np.ndarray) -> None:
        """Lazy row-wise update: only ``value[ids]`` and ``slot[ids]`` change.

        ``ids`` are unique, in range, 1-D int64; ``rows`` has shape
        ``(len(ids),) + value.shape[1:]``.
        """
        g = np.asarray(rows, dtype=value.dtype)
        arrays = self._array_slots(slots)
        step = self._step(slots)
        # Gather (copies), update the copies, then scatter back: every
        # allocation happens before the first write to a live array.
        x = value[ids]
        gathered = {n: a[ids] for n, a in arrays.items()}
        scratch = np.empty_like(x)
        with np.errstate(all="ignore"):
            self._kernel(x, gathered, g, scratch, step)
            value[ids] = x
            for n, a in arrays.items():
                a[ids] = gathered[n]
            self._count(slots)


class SGD(Optimizer):
    """Plain SGD: ``var -= learning_rate * g``."""

    name = "sgd"
    slot_names = ()
    _defaults = {"learning_rate": 0.01}

    def _kernel(self, x, slots, g, scratch, step):
        lr = x.dtype.type(self._config["learning_rate"])
        np.multiply(g, lr, out=scratch)
        np.subtract(x, scratch, out=x)


class Momentum(Optimizer):
    """Keras ``SGD(momentum=..., nesterov=...)``; slot ``momentum``."""

    name = "momentum"
    slot_names = ("momentum",)
    _defaults = {"learning_rate": 0.01, "momentum": 0.9, "nesterov": 0.0}

    def _check(self, cfg):
        if not 0.0 <= cfg["momentum"] < 1.0:
            raise ValueError(
                f"momentum: momentum must be in [0, 1), got {cfg['momentum']!r}"
            )
        if cfg["nesterov"] not in (0.0, 1.0):
            raise ValueError(
                f"momentum: nesterov must be 0 (off) or 1 (on), got {cfg['nesterov']!r}"
            )

    def _kernel(self, x, slots, g, scratch, step):
        t = x.dtype.type
        lr, mu = t(self._config["learning_rate"]), t(self._config["momentum"])
        m = slots["momentum"]
        np.multiply(g, lr, out=scratch)          # scratch = lr*g
        np.multiply(m, mu, out=m)
        np.subtract(m, scratch, out=m)           # m = mu*m - lr*g
        if self._config["nesterov"]:
            np.subtract(x, scratch, out=x)       # var += mu*m - lr*g
            np.multiply(m, mu, out=scratch)
            np.add(x, scratch, out=x)
        else:
            np.add(x, m, out=x)                  # var += m


class Adagrad(Optimizer):
    """Keras 3 Adagrad; slot ``accumulator`` starts at initial_accumulator_value."""

    name = "adagrad"
    slot_names = ("accumulator",)
    _defaults = {"learning_rate": 0.001, "initial_accumulator_value": 0.1,
                 "epsilon": 1e-7}

    def _check(self, cfg):
        if cfg["initial_accumulator_value"] < 0.0:
            raise ValueError(
                "adagrad: initial_accumulator_value must be >= 0, got "
                f"{cfg['initial_accumulator_value']!r}"
            )
        if cfg["initial_accumulator_value"] == 0.0 and cfg["epsilon"] == 0.0:
            raise ValueError(
                "adagrad: epsilon and initial_accumulator_value cannot both be 0 "
                "(a zero gradient would divide 0 by 0); make either one > 0"
            )

    def create_slots(self, value):
        return {"accumulator": np.full_like(
            value, self._config["initial_accumulator_value"])}

    def _kernel(self, x, slots, g, scratch, step):
        t = x.dtype.type
        lr, eps = t(self._config["learning_rate"]), t(self._config["epsilon"])
        acc = slots["accumulator"]
        np.multiply(g, g, out=scratch)
        np.add(acc, scratch, out=acc)            # accum += g*g
        np.add(acc, eps, out=scratch)
        np.sqrt(scratch, out=scratch)            # sqrt(accum + eps)
        np.divide(g, scratch, out=scratch)
        np.multiply(scratch, lr, out=scratch)
        np.subtract(x, scratch, out=x)           # var -= lr*g/sqrt(accum+eps)


class Adam(Optimizer):
    """Keras 3 Adam; slots ``m``, ``v`` and the per-variable ``iterations``."""

    name = "adam"
    slot_names = ("m", "v", "iterations")
    _defaults = {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999,
                 "epsilon": 1e-7}

    def _check(self, cfg):
        for key in ("beta_1", "beta_2"):
            if not 0.0 <= cfg[key] < 1.0:
                raise ValueError(f"adam: {key} must be in [0, 1), got {cfg[key]!r}")
        if cfg["epsilon"] <= 0.0:
            raise ValueError(
                f"adam: epsilon must be > 0, got {cfg['epsilon']!r} (with 0, an "
                "element whose gradients were all zero would become 0/0 = NaN)"
            )

    def create_slots(self, value):
        return {"m": np.zeros_like(value), "v": np.zeros_like(value),
                "iterations": np.zeros((), dtype=np.int64)}

    def _array_slots(self, slots):
        return {"m": slots["m"], "v": slots["v"]}

    def _step(self, slots):
        return int(slots["iterations"]) + 1

    def _count(self, slots):
        np.add(slots["iterations"], 1, out=slots["iterations"])

    def alpha(self, step: int) -> float:
        """The bias-corrected step size at 1-based ``step``, in float64."""
        c = self._config
        return (c["learning_rate"] * math.sqrt(1.0 - c["beta_2"] ** step)
                / (1.0 - c["beta_1"] ** step))

    def _kernel(self, x, slots, g, scratch, step):
        t = x.dtype.type
        c = self._config
        one = t(1)
        b1, b2, eps = t(c["beta_1"]), t(c["beta_2"]), t(c["epsilon"])
        alpha = t(self.alpha(step))
        m, v = slots["m"], slots["v"]
        np.subtract(g, m, out=scratch)
        np.multiply(scratch, one - b1, out=scratch)
        np.add(m, scratch, out=m)                # m += (g - m)*(1 - b1)
        np.multiply(g, g, out=scratch)
        np.subtract(scratch, v, out=scratch)
        np.multiply(scratch, one - b2, out=scratch)
        np.add(v, scratch, out=v)                # v += (g*g - v)*(1 - b2)
        np.sqrt(v, out=scratch)
        np.add(scratch, eps, out=scratch)
        np.divide(m, scratch, out=scratch)
        np.multiply(scratch, alpha, out=scratch)
        np.subtract(x, scratch, out=x)           # var -= alpha*m/(sqrt(v)+eps)


OPTIMIZERS: dict[str, type[Optimizer]] = {
    cls.name: cls for cls in (SGD, Momentum, Adagrad, Adam)
}


def make_optimizer(name: str, params: Mapping[str, float] | None = None) -> Optimizer:
    """The optimizer called ``name`` (case-insensitive) with ``params``."""
    cls = OPTIMIZERS.get(str(name).strip().lower())
    if cls is None:
        raise ValueError(
            f"unknown optimizer {name!r}; known ones are: {', '.join(OPTIMIZERS)}"
        )
    return cls(**dict(params or {}))


def sum_duplicates(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique int64 ids, rows summed per id), rows' dtype kept.

    The result is deterministic (a stable sort; the same input gives the same
    bits), though numpy may sum one id's rows in another order than a plain
    loop would (last-bit differences). Few duplicates: copy the first row of each id and
    ``np.add.at`` the rest; many: ``np.add.reduceat`` over the sorted rows
    (each is the faster one in its regime).
    """
    ids = np.asarray(ids).astype(np.int64, copy=False).reshape(-1)
    rows = np.asarray(rows)
    if ids.size == 0:
        return ids.copy(), rows[:0].copy()
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    first = np.empty(sorted_ids.size, dtype=bool)
    first[0] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    sorted_rows = rows[order]
    starts = np.flatnonzero(first)
    n_unique = starts.size
    if n_unique == sorted_ids.size:
        return sorted_ids, sorted_rows
    n_dup = sorted_ids.size - n_unique
    if n_dup < n_unique:
        out = sorted_rows[starts]
        dup = np.flatnonzero(~first)
        segment = np.cumsum(first) - 1
        np.add.at(out, segment[dup], sorted_rows[dup])
    else:
        out = np.add.reduceat(sorted_rows, starts, axis=0)
    return sorted_ids[starts], out
