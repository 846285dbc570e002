"""Initial values as every role computes them: a variable's, from an
Initializer (the servers make a shard's; all-reduce mode's workers a
mirrored variable's, coordinator/mirrored.py), the same bits everywhere for
the same Initializer, shape and dtype."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from psserver.contract import Initializer
from psserver.contract.tensor import all_finite
from psserver.errors import InvalidArgument, ResourceExhausted

INITIALIZERS = ("zeros", "ones", "constant", "random_normal", "truncated_normal",
                "random_uniform")
INITIALIZER_PARAMS = {"constant": ("value",), "random_normal": ("mean", "stddev"),
                      "truncated_normal": ("mean", "stddev"),
                      "random_uniform": ("minval", "maxval")}


def check_initializer(init: Initializer, allow_nonfinite: bool = False,
                      nonfinite_hint: str = "") -> tuple[str, ...]:
    """InvalidArgument unless ``init`` is a known kind with usable parameters
    (finite unless ``allow_nonfinite``; ``nonfinite_hint`` ends that message),
    as variables and dynamic tables need them. Returns the fields it reads."""
    if init.kind not in INITIALIZERS:
        raise InvalidArgument(f"unknown initializer {init.kind!r}; use one of {list(INITIALIZERS)}")
    used = INITIALIZER_PARAMS.get(init.kind, ())
    if not allow_nonfinite:
        bad = [f"{k}={getattr(init, k)}" for k in used if not math.isfinite(getattr(init, k))]
        if bad:
            raise InvalidArgument(
                f"initializer {init.kind} with {', '.join(bad)} would make NaN or Inf values; "
                f"give finite parameters{nonfinite_hint}")
    if init.kind in ("random_normal", "truncated_normal") and not init.stddev >= 0:
        raise InvalidArgument(f"initializer stddev must be >= 0, got {init.stddev}")
    if init.kind == "random_uniform" and not init.maxval >= init.minval:
        raise InvalidArgument(f"initializer needs minval <= maxval, got {init.minval} > {init.maxval}")
    return used


def make_initial_value(shape, dtype: np.dtype, init: Initializer,
                       allow_nonfinite: bool = False) -> np.ndarray:
    """A new array of shape/dtype filled as ``init`` says. Unless
    ``allow_nonfinite``, parameters that are NaN or Inf, or values that come
    out NaN or Inf in ``dtype`` (1e300 in float32, a uniform range wider than
    the largest float), are refused as a NaN in an initial value is."""
    used = check_initializer(init, allow_nonfinite,
                             " (or create the variable with allow_nonfinite=True)")
    with np.errstate(all="ignore"):   # an overflow is checked for below
        out = _initial_value(shape, dtype, init)
    if not allow_nonfinite and not all_finite(out):
        raise InvalidArgument(
            f"initializer {init.kind} ({', '.join(f'{k}={getattr(init, k)}' for k in used)}) "
            f"gives NaN or Inf in {dtype.name} (a value beyond its range, or a range wider than "
            "the largest float); use smaller parameters (or allow_nonfinite=True)")
    return out


def _initial_value(shape, dtype: np.dtype, init: Initializer) -> np.ndarray:
    """The array (``init`` checked by check_initializer first)."""
    try:
        if init.kind == "zeros":
            return np.zeros(shape, dtype)
        if init.kind == "ones":
            return np.ones(shape, dtype)
        if init.kind == "constant":
            return np.full(shape, init.value, dtype)
        rng = np.random.default_rng(init.seed)
        gen_dtype = np.float64 if dtype == np.float64 else np.float32
        if init.kind == "random_uniform":
            out = rng.random(shape, dtype=gen_dtype)
            out *= init.maxval - init.minval
            out += init.minval
        else:
            out = rng.standard_normal(shape, dtype=gen_dtype)
            if init.kind == "truncated_normal":   # resample beyond 2 stddev, as TF does
                bad = np.abs(out) > 2
                while bad.any():
                    out[bad] = rng.standard_normal(int(bad.sum()), dtype=gen_dtype)
                    bad = np.abs(out) > 2
            out *= init.stddev
            out += init.mean
        return out.astype(dtype, copy=False)
    except MemoryError:
        raise ResourceExhausted(
            f"not enough memory for a {list(shape)} {dtype.name} variable") from None


def _fans(shape: Sequence[int]) -> tuple[float, float]:
    if len(shape) < 1:
        return 1.0, 1.0
    if len(shape) == 1:
        return float(max(1, shape[0])), float(max(1, shape[0]))
    receptive = math.prod(shape[:-2]) if len(shape) > 2 else 1
    # An empty dimension makes no fan: count it as 1 (Keras divides by zero).
    return float(max(1, shape[-2] * receptive)), float(max(1, shape[-1] * receptive))


def one_seed(init: Initializer, seed: int) -> Initializer:
    """``init`` with the call's seed: a ``seed=`` argument and an
    Initializer's own seed are one seed (whichever is given; 0: not given),
    and two different ones are a ValueError, not one silently ignored."""
    if seed and init.seed and seed != init.seed:
        raise ValueError(f"two seeds given, seed={seed} and Initializer(seed={init.seed}): they "
                         "are one seed; give it once (or the same value twice)")
    return dataclasses.replace(init, seed=seed) if seed and not init.seed else init


def resolve_initializer(init: Initializer | str | None, shape: Sequence[int],
                        seed: int = 0) -> Initializer:
    """A server-side Initializer for ``init`` (a kind name or an Initializer).

    "glorot_uniform" (Keras' default kernel initializer) becomes
    random_uniform(+-sqrt(6 / (fan_in + fan_out))); "he_normal" becomes
    truncated_normal(stddev=sqrt(2 / fan_in) / .8796) as Keras computes it.
    """
    if init is None:
        return Initializer("zeros")
    if isinstance(init, Initializer):
        return one_seed(init, seed)
    fan_in, fan_out = _fans(shape)
    if init == "glorot_uniform":
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return Initializer("random_uniform", minval=-limit, maxval=limit, seed=seed)
    if init == "he_normal":
        # Keras: truncated normal, stddev corrected for the truncation at 2 sigma.
        return Initializer("truncated_normal", stddev=math.sqrt(2.0 / fan_in) / 0.87962566103423978,
                           seed=seed)
    return Initializer(init, seed=seed)
