"""Gradient compression on the wire (off by default).

Choose it on the strategy and pass it to ``push_gradients`` in the step
function::

    strategy = ParameterServerStrategy(cluster.spec, gradient_compression="fp16")
    spec = strategy.gradient_compression_spec        # small and picklable

    def train_step(iterator):
        ...
        push_gradients(zip(variables, grads), compression=spec)

The strategy itself never travels to the workers (only the step closure and
what it captures does), so the setting is an explicit argument: the step
closure captures ``spec`` like it captures the variables. Without it
(``compression=None``, the default) ``push_gradients`` is unchanged.

Compressors:

* ``"fp16"`` (``FP16()``): each dense gradient shard is clipped to
  +-65504 (float16's largest finite value, so that a large gradient is
  clipped rather than turned into Inf and rejected) and sent as float16:
  half the bytes of float32, a quarter of float64 (a gradient that already
  holds NaN or Inf is sent as is and rejected). The parameter server
  accepts a float16 gradient for a float32/float64 variable and applies it
  in the variable's dtype. Values below ~6e-8 flush to zero.
* ``"bf16"`` (``BF16()``): numpy has no bfloat16 dtype, and the wire carries
  only float16/32/64, so this *emulates* bfloat16: each float32 value is
  rounded (to nearest, ties to even) to 8 significant bits and sent as
  float32 with the low 16 bits zero. It shows bfloat16's effect on accuracy
  but saves **no bytes**. A float64 gradient is first cast to float32.
* ``TopK(ratio)``: per dense gradient shard of a variable with 2 or more
  dimensions, only the ``k = max(1, ceil(ratio * rows))`` rows with the
  largest L2 norm are sent (a sparse push: values and int64 ids); the rest
  is kept on this worker as a residual and added to the variable's next
  gradient (error feedback), so every gradient is applied eventually.
  Residuals live in this process (a dict keyed by variable name): each worker
  has its own, and they are lost if the worker restarts. 1-D and scalar
  variables (biases) are sent dense. Note: the servers' sparse updates are
  lazy: with Adam/Adagrad/momentum/FTRL only the sent rows and their slots
  advance (moments of unsent rows are not decayed), as for embedding
  gradients.

Compression applies to asynchronous pushes ("async" and "bounded" modes):
in sync mode the servers sum replicas' gradients in the first arrival's
dtype, and top-k residuals would outlive their step, so the strategy refuses
``mode="sync"`` and ``mode="hybrid"`` with compression and
``push_gradients`` raises ValueError in their steps.
"""
from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np

from psserver.contract import tensor as T

FLOAT16_MAX = float(np.finfo(np.float16).max)   # 65504


@dataclasses.dataclass(frozen=True)
class FP16:
    """Send dense gradients as float16 (clipped to +-65504)."""
    name = "fp16"


@dataclasses.dataclass(frozen=True)
class BF16:
    """Emulated bfloat16: float32 rounded to 8 significant bits (saves no bytes)."""
    name = "bf16"


@dataclasses.dataclass(frozen=True)
class TopK:
    """Send the top ``ratio`` of each shard's rows by L2 norm; keep the rest."""
    ratio: float = 0.01

    name = "topk"

    def __post_init__(self):
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"TopK ratio must be a number in (0, 1], got {r!r}")

    def k(self, rows: int) -> int:
        return min(rows, max(1, math.ceil(self.ratio * rows)))


Compression = FP16 | BF16 | TopK


def resolve(spec) -> Compression | None:
    """None, "fp16", "bf16", FP16(), BF16() or TopK(...) as a compressor (or None)."""
    if spec is None or isinstance(spec, (FP16, BF16, TopK)):
        return spec
    if isinstance(spec, str):
        if spec.lower() == "fp16":
            return FP16()
        if spec.lower() == "bf16":
            return BF16()
    raise ValueError(f'gradient_compression must be None, "fp16", "bf16" or TopK(ratio), '
                     f"got {spec!r}")


# -- the transforms ------------------------------------------------------------------
def to_fp16(grad: np.ndarray) -> np.ndarray:
    """``grad`` clipped to float16's finite range and cast to float16.

    Only finite values are clipped: NaN and +-Inf are sent as they are, so
    the server still rejects a gradient that was already non-finite."""
    g = np.asarray(grad)
    if g.dtype == np.float16:
        return g
    return T.as_float16(g)   # finite values clipped, NaN/Inf kept; fast for tiny values


def to_bf16(grad: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 precision (nearest, ties to even), as float32.

    NaN and Inf are kept (a NaN's payload is quieted, never rounded to Inf);
    a value that rounds past float32's largest becomes Inf, as in bfloat16.
    """
    g = np.ascontiguousarray(grad, dtype=np.float32)
    bits = g.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) \
        & np.uint32(0xFFFF0000)
    nan = np.isnan(g)
    if nan.any():
        rounded = np.where(nan, (bits | np.uint32(0x00400000)) & np.uint32(0xFFFF0000), rounded)
    return rounded.astype(np.uint32).view(np.float32)


def top_rows(grad: np.ndarray, k: int) -> np.ndarray:
    """Sorted row indices of the ``k`` rows of ``grad`` with the largest L2 norm."""
    rows = grad.shape[0]
    if k >= rows:
        return np.arange(rows, dtype=np.int64)
    norms = np.einsum("ij,ij->i", *(2 * [grad.reshape(rows, -1)]))
    idx = np.argpartition(norms, rows - k)[rows - k:]
    return np.sort(idx).astype(np.int64)


class Residuals:
    """Error feedback: what top-k did not send, per variable, in this process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._r: dict[str, np.ndarray] = {}

    def compensate_and_select(self, name: str, grad: np.ndarray,
                              row_ranges, topk: TopK) -> tuple[np.ndarray, list[np.ndarray]]:
        """(gradient + residual, [sorted ids local to each (offset, rows) range]).

        The residual becomes the compensated gradient with the chosen rows
        zeroed: ``sent + new residual == gradient + old residual`` exactly.
        """
        with self._lock:
            r = self._r.get(name)
            acc = grad.copy() if r is None or r.shape != grad.shape or r.dtype != grad.dtype \
                else grad + r
            picks, rest = [], acc.copy()
            for off, rows in row_ranges:
                ids = top_rows(acc[off:off + rows], topk.k(rows))
                picks.append(ids)
                rest[off + ids] = 0
            self._r[name] = rest
        return acc, picks

    def get(self, name: str) -> np.ndarray | None:
        with self._lock:
            r = self._r.get(name)
            return None if r is None else r.copy()

    def clear(self, name: str | None = None) -> None:
        with self._lock:
            if name is None:
                self._r.clear()
            else:
                self._r.pop(name, None)


#: This process's top-k residuals (on a worker: that worker's).
residuals = Residuals()


def wire_nbytes(variables, spec) -> int:
    """Gradient payload bytes one push of ``variables`` sends with ``spec``
    (values and sparse ids; backups and message framing not counted)."""
    spec = resolve(spec)
    total = 0
    for v in variables:
        itemsize = np.dtype(v.dtype).itemsize
        row = int(np.prod(v.shape[1:], dtype=np.int64)) if v.shape else 1
        for s in v.shards:
            n = (s.rows if v.shape else 1) * row
            if isinstance(spec, FP16):
                total += n * 2
            elif isinstance(spec, BF16):
                total += n * 4
            elif isinstance(spec, TopK) and len(v.shape) >= 2:
                k = spec.k(s.rows)
                total += k * row * itemsize + k * 8
            else:
                total += n * itemsize
    return total
