"""Pooled bags of keys (an EmbeddingBag's sum): the checks and the arithmetic.

A look-up may ask for bags instead of rows: ``offsets[i]..offsets[i+1]`` are
bag i's keys (``keys`` in bag order, repeats allowed) and the answer is one
row per bag, the sum of its keys' rows, each times its weight when
``weights`` are given (a mean is weights 1/len(bag)). A gradient of bags is
one row per bag; each key gets its bag's row times its weight, summed over
the key's occurrences. Both sides of the wire use the same rule: a client
pooling its own rows (psserver/client) and a server pooling its shard's
(psserver/core/table_store.py) give the same sums.

Pure numpy, no state; free of grpc and protobuf.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from psserver.contract.rows import sum_duplicates
from psserver.errors import InvalidArgument

#: Bags one call may carry.
MAX_BAGS = 1 << 24


@dataclasses.dataclass(frozen=True)
class Bags:
    """Checked bags over ``keys``: each key's bag (``bag_of``), the number of
    bags, and the weights (None: 1 each)."""
    offsets: np.ndarray
    bag_of: np.ndarray
    n: int
    weights: np.ndarray | None

    def pool(self, per_key_rows: np.ndarray) -> np.ndarray:
        """(n, dim): each bag's keys' rows (one per key, in key order), times
        their weights, summed; zeros for an empty bag."""
        rows = per_key_rows if self.weights is None else \
            per_key_rows * self.weights[:, None].astype(per_key_rows.dtype, copy=False)
        out = np.zeros((self.n,) + rows.shape[1:], rows.dtype)
        starts = self.offsets[:-1]
        full = starts < self.offsets[1:]
        if full.any():
            out[full] = np.add.reduceat(rows, starts[full], axis=0)
        return out

    def spread(self, bag_grads: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(distinct keys, their gradient rows): each key's bag's row, times
        its weight, summed over the key's occurrences."""
        per_key = bag_grads[self.bag_of]
        if self.weights is not None:
            per_key = per_key * self.weights[:, None].astype(per_key.dtype, copy=False)
        return sum_duplicates(keys.astype(np.int64, copy=False), per_key)


def check_bags(keys: np.ndarray, offsets, weights, dtype, what: str) -> Bags:
    """Bags of 1-D ``keys`` from ``offsets`` (int64, n + 1 entries, from 0 to
    len(keys), non-decreasing) and ``weights`` (None, or one finite value of
    ``dtype`` per key); InvalidArgument saying what is wrong."""
    if keys.ndim != 1:
        raise InvalidArgument(f"{what}: the keys of bags must be 1-D, got shape "
                              f"{list(keys.shape)}")
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or offsets.size < 1:
        raise InvalidArgument(f"{what}: offsets must be a 1-D integer array of bags + 1 "
                              f"entries, got {offsets.dtype} {list(offsets.shape)}")
    if offsets.size - 1 > MAX_BAGS:
        raise InvalidArgument(f"{what}: {offsets.size - 1} bags in one call; send at most "
                              f"{MAX_BAGS}")
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] != 0 or offsets[-1] != keys.size or (np.diff(offsets) < 0).any():
        raise InvalidArgument(f"{what}: offsets must start at 0, end at the number of keys "
                              f"({keys.size}) and never decrease")
    if weights is not None:
        weights = np.asarray(weights)
        if weights.shape != keys.shape or weights.dtype != np.dtype(dtype):
            raise InvalidArgument(f"{what}: weights must be {np.dtype(dtype).name}, one per "
                                  f"key ({keys.size}), got {weights.dtype} "
                                  f"{list(weights.shape)}")
        if not np.isfinite(weights).all():
            raise InvalidArgument(f"{what}: weights have NaN or Inf")
    n = offsets.size - 1
    bag_of = np.repeat(np.arange(n, dtype=np.int64), np.diff(offsets))
    return Bags(offsets, bag_of, n, weights)
