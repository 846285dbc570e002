"""Plain numpy reference implementations of the server's five optimizers.

Written from the Keras 3 update rules (keras/src/optimizers/sgd.py,
adagrad.py, adam.py, ftrl.py), one readable statement per formula, with no import of
``psserver``: the end-to-end tests compare what a real parameter server
computes with what these give.

Conventions (those of the service, see docs of ``psserver.contract.optimizers``):

* Hyper-parameters are cast to the variable's dtype, arithmetic runs in it.
* ``momentum`` is Keras ``SGD(momentum=..., nesterov=...)``; ``nesterov`` is
  0 or 1.
* Adagrad adds ``epsilon`` inside the square root (Keras 3).
* Adam's step ``t`` counts the updates applied to *this* variable (dense or
  sparse, an empty sparse update included); ``alpha`` is computed in float64
  and rounded once to the variable's dtype.
* Sparse updates are lazy: duplicate ids are summed first, then only the rows
  named, and the same rows of the slots, are updated with the dense formula.

Usage::

    ref = ReferenceOptimizer("adam", {"learning_rate": 0.01}, initial_value)
    ref.apply_dense(grad)
    ref.apply_sparse(ids, rows)
    ref.assign(new_value)
    ref.value, ref.slots["m"], ref.version
"""
from __future__ import annotations

import math

import numpy as np

DEFAULTS = {
    "sgd": {"learning_rate": 0.01},
    "momentum": {"learning_rate": 0.01, "momentum": 0.9, "nesterov": 0.0},
    "adagrad": {"learning_rate": 0.001, "initial_accumulator_value": 0.1, "epsilon": 1e-7},
    "adam": {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
    "ftrl": {"learning_rate": 0.001, "learning_rate_power": -0.5,
             "initial_accumulator_value": 0.1, "l1_regularization_strength": 0.0,
             "l2_regularization_strength": 0.0, "l2_shrinkage_regularization_strength": 0.0,
             "beta": 0.0},
}


def sgd_step(var, g, slots, cfg, step):
    lr = var.dtype.type(cfg["learning_rate"])
    return var - g * lr


def momentum_step(var, g, slots, cfg, step):
    f = var.dtype.type
    lr, mu = f(cfg["learning_rate"]), f(cfg["momentum"])
    m = slots["momentum"] * mu - g * lr
    slots["momentum"] = m
    if cfg["nesterov"]:
        return var + (m * mu - g * lr)
    return var + m


def adagrad_step(var, g, slots, cfg, step):
    f = var.dtype.type
    lr, eps = f(cfg["learning_rate"]), f(cfg["epsilon"])
    acc = slots["accumulator"] + g * g
    slots["accumulator"] = acc
    return var - lr * g / np.sqrt(acc + eps)


def adam_step(var, g, slots, cfg, step):
    f = var.dtype.type
    b1, b2, eps = f(cfg["beta_1"]), f(cfg["beta_2"]), f(cfg["epsilon"])
    alpha = f(cfg["learning_rate"] * math.sqrt(1.0 - cfg["beta_2"] ** step)
              / (1.0 - cfg["beta_1"] ** step))
    m = slots["m"] + (g - slots["m"]) * (f(1) - b1)
    v = slots["v"] + (g * g - slots["v"]) * (f(1) - b2)
    slots["m"], slots["v"] = m, v
    return var - (m * alpha) / (np.sqrt(v) + eps)


def ftrl_step(var, g, slots, cfg, step):   # keras/src/optimizers/ftrl.py
    f = var.dtype.type
    lr, p = f(cfg["learning_rate"]), f(-cfg["learning_rate_power"])
    l1 = f(cfg["l1_regularization_strength"])
    l2_reg = f(cfg["l2_regularization_strength"]) + f(cfg["beta"]) / (f(2.0) * lr)
    grad_to_use = g + f(2 * cfg["l2_shrinkage_regularization_strength"]) * var
    accum = slots["accumulator"]
    new_accum = accum + g * g
    linear = slots["linear"] + (grad_to_use - (new_accum**p - accum**p) / lr * var)
    quadratic = new_accum**p / lr + f(2) * l2_reg
    slots["accumulator"], slots["linear"] = new_accum, linear
    return (np.clip(linear, -l1, l1) - linear) / quadratic


STEPS = {"sgd": sgd_step, "momentum": momentum_step, "adagrad": adagrad_step,
         "adam": adam_step, "ftrl": ftrl_step}


def initial_slots(name: str, cfg: dict, value: np.ndarray) -> dict[str, np.ndarray]:
    if name == "momentum":
        return {"momentum": np.zeros_like(value)}
    if name == "adagrad":
        return {"accumulator": np.full_like(value, cfg["initial_accumulator_value"])}
    if name == "adam":
        return {"m": np.zeros_like(value), "v": np.zeros_like(value)}
    if name == "ftrl":
        return {"accumulator": np.full_like(value, cfg["initial_accumulator_value"]),
                "linear": np.zeros_like(value)}
    return {}


def sum_duplicate_rows(ids, rows) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique ids, rows summed per id), by a plain loop."""
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    rows = np.asarray(rows)
    uniq = np.unique(ids)
    summed = np.zeros((uniq.size,) + rows.shape[1:], rows.dtype)
    for i, u in enumerate(uniq):
        for j in np.flatnonzero(ids == u):
            summed[i] += rows[j]
    return uniq, summed


class ReferenceOptimizer:
    """A variable's value, slots and version, updated by the reference rules."""

    def __init__(self, name: str, params: dict | None, initial_value: np.ndarray):
        unknown = set(params or {}) - set(DEFAULTS[name])
        assert not unknown, f"unknown hyper-parameters {unknown}"
        self.name = name
        self.cfg = {**DEFAULTS[name], **(params or {})}
        self.value = np.array(initial_value, copy=True)
        self.slots = initial_slots(name, self.cfg, self.value)
        self.version = 0       # updates and assigns applied (the server's version)
        self.iterations = 0    # optimizer steps applied: Adam's t is iterations + 1

    def apply_dense(self, grad) -> None:
        g = np.asarray(grad, dtype=self.value.dtype)
        assert g.shape == self.value.shape
        self.value = STEPS[self.name](self.value, g, self.slots, self.cfg, self.iterations + 1)
        self.iterations += 1
        self.version += 1

    def apply_sparse(self, ids, rows) -> None:
        uniq, summed = sum_duplicate_rows(ids, np.asarray(rows, dtype=self.value.dtype))
        row_slots = {k: s[uniq] for k, s in self.slots.items()}
        new_rows = STEPS[self.name](self.value[uniq], summed, row_slots, self.cfg,
                                    self.iterations + 1)
        self.value = self.value.copy()
        self.value[uniq] = new_rows
        for k, s in row_slots.items():
            self.slots[k] = self.slots[k].copy()
            self.slots[k][uniq] = s
        self.iterations += 1
        self.version += 1

    def assign(self, value) -> None:
        """Overwrite the value; slots and the step count are kept."""
        value = np.asarray(value, dtype=self.value.dtype)
        assert value.shape == self.value.shape
        self.value = value.copy()
        self.version += 1
