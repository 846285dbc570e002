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
ftrl       learning_rate=0.001, learning_rate_power=-0.5,    accumulator, linear
           initial_accumulator_value=0.1,
           l1_regularization_strength=0,
           l2_regularization_strength=0,
           l2_shrinkage_regularization_strength=0, beta=0
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
    ftrl      p = -learning_rate_power; l2_reg = l2 + beta / (2 * lr)
              new_accum = accum + g * g
              linear += g + 2 * l2_shrinkage * var - (new_accum**p - accum**p) / lr * var
              quadratic = new_accum**p / lr + 2 * l2_reg
              var = (clip(linear, -l1, l1) - linear) / quadratic
              accum = new_accum

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
* FTRL's sparse updates are lazy, as TensorFlow's sparse kernels
  (``ResourceSparseApplyFtrl[V2]``, which Keras 2 used): rows not named keep
  their value and slots. Keras 3 densifies an ``IndexedSlices`` gradient, so
  there every row takes a zero-gradient step, which recomputes its value from
  ``linear`` and its l2 shrinkage: without shrinkage a row already updated
  keeps its value and one never updated becomes 0 (so both agree on a
  zero-initialised variable); with shrinkage every row moves. Keras 3's
  TensorFlow backend also squares an ``IndexedSlices``' rows before it sums
  duplicate ids (its accumulator gets the sum of the squares); here duplicates
  are summed first, as for every optimizer.
* Validation is stricter where Keras would silently produce NaN: Adam needs
  ``epsilon > 0`` (else an element whose gradients were all zero becomes 0/0),
  and Adagrad needs ``epsilon > 0`` or ``initial_accumulator_value > 0``.
  FTRL refuses a negative ``beta`` (Keras does not check it; it would lower
  the l2 term, and can make ``quadratic`` 0 or negative).

Atomicity: an apply either fully succeeds or leaves the variable and slots
untouched. The caller validates ids, shapes, dtypes and finiteness before it
calls; inside, every allocation (scratch buffers, gathered rows) happens
before the first write, and the arithmetic runs under ``np.errstate(all=
"ignore")`` so a process-wide ``np.seterr(all="raise")`` cannot interrupt an
update half-way (an overflow, e.g. ``g*g`` in float16, yields inf, as in
Keras; the caller may check the result).

Memory: an apply never allocates anything the size of the variable. Value and
slots must be C-contiguous; a dense apply walks their flat views (and the
gradient's) in blocks of :data:`BLOCK_BYTES` (256 KiB: 64K float32 elements,
sized to stay in L2 between the kernel's passes) with one scratch buffer of
one block, allocated once per call. The gradient is only read, never written
(it may be a read-only ``np.frombuffer`` view); one of another dtype or not
C-contiguous is cast/gathered a block at a time through a buffered
``np.nditer`` (one more block-sized buffer), never copied whole. A sparse
apply gathers the touched rows of the variable and slots (copies,
``len(ids) * row`` elements each), updates them with the same blocked kernels,
and scatters them back (psserver/contract/rows.py: ``take_rows``, ``put_rows``).
Blocking does not change the arithmetic: every element goes through the same
operations in the same order as an unblocked update.

This module is the optimizers alone; the row gathers, scatters and duplicate
sums they share with the stores, the tables and the client are
psserver/contract/rows.py.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from psserver.contract.rows import put_rows, take_rows

__all__ = [
    "BLOCK_BYTES",
    "Optimizer",
    "SGD",
    "Momentum",
    "Adagrad",
    "Adam",
    "Ftrl",
    "OPTIMIZERS",
    "make_optimizer",
]


#: Bytes of one block of a dense apply (and the size of its scratch buffer):
#: 256 KiB = 64K float32 elements. The kernels make several passes over each
#: block (value, slots, gradient, scratch: up to 5 arrays of a block), which
#: this size keeps in L2. Measured on a 16M-element float32 variable, 64 KiB
#: blocks lose to per-ufunc-call overhead (momentum ~20% slower) and 1 MiB ones
#: to cache misses (Adam ~13% slower). Read at each call.
BLOCK_BYTES = 256 * 1024

# Gradient dtypes that the buffered iterator casts element-wise without any
# chance of failing half-way (anything else is converted whole, up front).
_CASTABLE_KINDS = "biuf"


def _flat(a: np.ndarray, what: str) -> np.ndarray:
    """The 1-D view of a live array the kernels may write into (never a copy)."""
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous numpy array")
    if not a.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return a.reshape(-1)


class Optimizer:
    """Base class: hyper-parameters, slot creation, dense and sparse apply.

    Subclasses set ``name``, ``slot_names``, ``_defaults`` and implement
    ``_check`` (extra validation), ``_constants`` (the hyper-parameters cast to
    the variable's dtype) and ``_kernel`` (the in-place, element-wise update of
    ``x``/``slots`` given ``g``, on 1-D arrays of one length).
    """

    name: ClassVar[str] = ""
    slot_names: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, float]] = {}
    #: Scratch blocks ``_kernel`` gets: 1 (an array), or more (a _Blocks whose
    #: ``[:m]`` gives that many arrays of length m).
    _scratch_blocks: ClassVar[int] = 1

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

    def _constants(self, dtype: np.dtype, step: int) -> tuple:
        """Hyper-parameters as scalars of ``dtype``, for ``_kernel``."""
        return ()

    def _kernel(self, x: np.ndarray, slots: dict[str, np.ndarray], g: np.ndarray,
                scratch: np.ndarray, c: tuple) -> None:
        """Update ``x`` and ``slots`` in place (1-D, all of ``x``'s length).

        ``g`` is read only; ``scratch`` (same length) is free to overwrite.
        """
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

    def array_slots(self, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The slots of ``slots`` shaped as the value (a row per row of it;
        not Adam's step count): what a row-wise update gathers and a
        dynamic table keeps per row."""
        return {n: slots[n] for n in self.slot_names}

    def _step(self, slots: Mapping[str, np.ndarray]) -> int:
        return 0

    def _count(self, slots: Mapping[str, np.ndarray]) -> None:
        pass

    def apply_dense(self, value: np.ndarray, slots: dict[str, np.ndarray],
                    grad: np.ndarray) -> None:
        """``value`` and ``slots`` updated in place by the whole gradient.

        ``value`` and the array slots must be C-contiguous and writeable;
        ``grad`` must have ``value``'s shape (it is never written to).
        """
        x = _flat(value, "value")
        arrays = {n: _flat(a, f"slot {n!r}") for n, a in self.array_slots(slots).items()}
        g = _gradient(grad, value.shape, value.dtype)
        step = self._step(slots)
        with np.errstate(all="ignore"):  # e.g. a float16 cast of lr may overflow
            consts = self._constants(value.dtype, step)
            self._run(x, arrays, g, consts)
            self._count(slots)

    def apply_sparse(self, value: np.ndarray, slots: dict[str, np.ndarray],
                     ids: np.ndarray, rows: np.ndarray) -> None:
        """Lazy row-wise update: only ``value[ids]`` and ``slot[ids]`` change.

        ``ids`` are unique, in range, 1-D int64; ``rows`` has shape
        ``(len(ids),) + value.shape[1:]``.
        """
        arrays = self.array_slots(slots)
        step = self._step(slots)
        # Gather (copies: C-contiguous, len(ids) rows each), update the copies
        # block by block, then scatter back: every allocation happens before
        # the first write to a live array.
        x = take_rows(value, ids)
        g = _gradient(rows, x.shape, value.dtype)
        gathered = {n: take_rows(a, ids) for n, a in arrays.items()}
        with np.errstate(all="ignore"):
            consts = self._constants(value.dtype, step)
            self._run(x.reshape(-1), {n: a.reshape(-1) for n, a in gathered.items()},
                      g, consts)
            put_rows(value, ids, x)
            for n, a in arrays.items():
                put_rows(a, ids, gathered[n])
            self._count(slots)

    def _run(self, x: np.ndarray, slots: dict[str, np.ndarray], grad: np.ndarray,
             consts: tuple) -> None:
        """``_kernel`` over the flat ``x``/``slots`` one block at a time.

        Allocates one block of scratch (and, for a gradient of another dtype or
        layout, one block of iterator buffer) before the first write; the
        caller holds ``np.errstate(all="ignore")``.
        """
        n = x.size
        block = max(1, min(n, BLOCK_BYTES // x.dtype.itemsize))
        k = self._scratch_blocks
        rows = np.empty((k, block), dtype=x.dtype)
        # One block of scratch, or k of them for a kernel that needs more (FTRL).
        scratch = rows[0] if k == 1 else _Blocks(rows)
        kernel = self._kernel
        if grad.dtype == x.dtype and grad.flags.c_contiguous:
            g = grad.reshape(-1)  # a view
            if n <= block:
                kernel(x, slots, g, scratch[:n], consts)
                return
            for lo in range(0, n, block):
                hi = min(lo + block, n)
                kernel(x[lo:hi], {k: a[lo:hi] for k, a in slots.items()} if slots else slots,
                       g[lo:hi], scratch[:hi - lo], consts)
            return
        # Another dtype or a strided gradient: read it in C order, cast a block
        # at a time into the iterator's own (block-sized) buffer.
        chunks = np.nditer(grad, flags=["external_loop", "buffered", "zerosize_ok"],
                           op_flags=[["readonly"]], op_dtypes=[x.dtype],
                           casting="unsafe", order="C", buffersize=block)
        lo = 0
        for chunk in chunks:
            for c0 in range(0, chunk.size, block):
                gk = chunk[c0:c0 + block]
                hi = lo + gk.size
                kernel(x[lo:hi], {k: a[lo:hi] for k, a in slots.items()}, gk,
                       scratch[:hi - lo], consts)
                lo = hi


class _Blocks:
    """Several scratch blocks: ``blocks[:m]`` is a tuple of arrays of length m
    (as ``scratch[:m]`` is one array for a one-block kernel)."""

    def __init__(self, rows: np.ndarray):
        self._rows = rows

    def __getitem__(self, cut: slice) -> tuple[np.ndarray, ...]:
        return tuple(self._rows[:, cut])


def _gradient(grad, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """``grad`` as an ndarray of ``shape`` (no copy for a numeric array)."""
    g = np.asarray(grad)
    if g.dtype.kind not in _CASTABLE_KINDS:
        # Object, string...: a cast could fail half-way, so convert it whole
        # now, before any write (the caller normally rules these out).
        g = np.asarray(g, dtype=dtype)
    if g.shape != tuple(shape):
        raise ValueError(f"gradient has shape {g.shape}, expected {tuple(shape)}")
    return g


class SGD(Optimizer):
    """Plain SGD: ``var -= learning_rate * g``."""

    name = "sgd"
    slot_names = ()
    _defaults = {"learning_rate": 0.01}

    def _constants(self, dtype, step):
        return (dtype.type(self._config["learning_rate"]),)

    def _kernel(self, x, slots, g, scratch, c):
        (lr,) = c
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

    def _constants(self, dtype, step):
        t = dtype.type
        return (t(self._config["learning_rate"]), t(self._config["momentum"]),
                bool(self._config["nesterov"]))

    def _kernel(self, x, slots, g, scratch, c):
        lr, mu, nesterov = c
        m = slots["momentum"]
        np.multiply(g, lr, out=scratch)          # scratch = lr*g
        np.multiply(m, mu, out=m)
        np.subtract(m, scratch, out=m)           # m = mu*m - lr*g
        if nesterov:
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

    def _constants(self, dtype, step):
        t = dtype.type
        return t(self._config["learning_rate"]), t(self._config["epsilon"])

    def _kernel(self, x, slots, g, scratch, c):
        lr, eps = c
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

    def array_slots(self, slots):
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

    def _constants(self, dtype, step):
        t = dtype.type
        c = self._config
        one = t(1)
        b1, b2, eps = t(c["beta_1"]), t(c["beta_2"]), t(c["epsilon"])
        return one - b1, one - b2, eps, t(self.alpha(step))

    def _kernel(self, x, slots, g, scratch, c):
        one_b1, one_b2, eps, alpha = c
        m, v = slots["m"], slots["v"]
        np.subtract(g, m, out=scratch)
        np.multiply(scratch, one_b1, out=scratch)
        np.add(m, scratch, out=m)                # m += (g - m)*(1 - b1)
        np.multiply(g, g, out=scratch)
        np.subtract(scratch, v, out=scratch)
        np.multiply(scratch, one_b2, out=scratch)
        np.add(v, scratch, out=v)                # v += (g*g - v)*(1 - b2)
        np.sqrt(v, out=scratch)
        np.add(scratch, eps, out=scratch)
        np.divide(m, scratch, out=scratch)
        np.multiply(scratch, alpha, out=scratch)
        np.subtract(x, scratch, out=x)           # var -= alpha*m/(sqrt(v)+eps)


class Ftrl(Optimizer):
    """Keras 3 Ftrl (Follow The Regularized Leader, the optimizer of
    click-through-rate models); slots ``accumulator`` (starts at
    initial_accumulator_value) and ``linear`` (zeros)."""

    name = "ftrl"
    slot_names = ("accumulator", "linear")
    _defaults = {"learning_rate": 0.001, "learning_rate_power": -0.5,
                 "initial_accumulator_value": 0.1, "l1_regularization_strength": 0.0,
                 "l2_regularization_strength": 0.0,
                 "l2_shrinkage_regularization_strength": 0.0, "beta": 0.0}
    _scratch_blocks = 3

    def _check(self, cfg):
        if cfg["learning_rate_power"] > 0.0:
            raise ValueError("ftrl: learning_rate_power must be <= 0 (as Keras), got "
                             f"{cfg['learning_rate_power']!r}")
        for key in ("initial_accumulator_value", "l1_regularization_strength",
                    "l2_regularization_strength", "l2_shrinkage_regularization_strength",
                    "beta"):
            if cfg[key] < 0.0:
                raise ValueError(f"ftrl: {key} must be >= 0, got {cfg[key]!r}")

    def create_slots(self, value):
        return {"accumulator": np.full_like(value, self._config["initial_accumulator_value"]),
                "linear": np.zeros_like(value)}

    def _constants(self, dtype, step):
        t = dtype.type
        c = self._config
        lr = t(c["learning_rate"])
        l2_reg = t(c["l2_regularization_strength"]) + t(c["beta"]) / (t(2.0) * lr)
        return (lr, t(-c["learning_rate_power"]), t(c["l1_regularization_strength"]),
                t(2) * l2_reg, t(2 * c["l2_shrinkage_regularization_strength"]))

    def _kernel(self, x, slots, g, scratch, c):
        lr, power, l1, two_l2, two_shrink = c
        acc, linear = slots["accumulator"], slots["linear"]
        new_acc, quad, tmp = scratch
        np.multiply(g, g, out=new_acc)
        np.add(acc, new_acc, out=new_acc)        # new_accum = accum + g*g
        np.power(new_acc, power, out=quad)       # new_accum ** -lr_power
        np.power(acc, power, out=acc)            # accum ** -lr_power (acc is replaced below)
        np.subtract(quad, acc, out=acc)
        np.divide(acc, lr, out=acc)
        np.multiply(acc, x, out=acc)             # sigma * var
        if two_shrink:
            np.multiply(x, two_shrink, out=tmp)
            np.add(g, tmp, out=tmp)              # grad_to_use = g + 2 * shrinkage * var
            np.subtract(tmp, acc, out=tmp)
        else:
            np.subtract(g, acc, out=tmp)
        np.add(linear, tmp, out=linear)          # linear += grad_to_use - sigma * var
        np.divide(quad, lr, out=quad)
        np.add(quad, two_l2, out=quad)           # quadratic = new_accum**p / lr + 2 * l2_reg
        np.clip(linear, -l1, l1, out=tmp)
        np.subtract(tmp, linear, out=tmp)
        np.divide(tmp, quad, out=x)              # var = (clip(linear, l1) - linear) / quadratic
        np.copyto(acc, new_acc)                  # accum = new_accum


OPTIMIZERS: dict[str, type[Optimizer]] = {
    cls.name: cls for cls in (SGD, Momentum, Adagrad, Adam, Ftrl)
}


def make_optimizer(name: str, params: Mapping[str, float] | None = None) -> Optimizer:
    """The optimizer called ``name`` (case-insensitive) with ``params``."""
    cls = OPTIMIZERS.get(str(name).strip().lower())
    if cls is None:
        raise ValueError(
            f"unknown optimizer {name!r}; known ones are: {', '.join(OPTIMIZERS)}"
        )
    return cls(**dict(params or {}))
