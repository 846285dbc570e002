"""The ids and keys of a step's look-ups, sorted once (coordinator/step_calls.py).

A look-up sorts its ids (a fixed table's: ``distinct``) or puts its keys
distinct and shard by shard (a dynamic table's: ``shard_order``, by the
table's layout), and keeps that for the thread (``_last``), so that the
push of the same ids' gradients that follows in the step sums into the same
order without sorting again (``known_order``, ``last_lookup``: only for the
very ids looked up, and for a table only while its layout is the same).
"""
from __future__ import annotations

import threading

import numpy as np


def int64_ids(ids) -> np.ndarray:
    """Row ids flattened, as int64; ValueError for any other kind than integers."""
    flat = np.asarray(ids).reshape(-1)
    if flat.dtype.kind not in "iu":
        raise ValueError(f"ids must be integers, got {flat.dtype.name}")
    return flat.astype(np.int64, copy=False)


def distinct(ids, remember_for=None) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct int64 ids, inverse: ids.reshape(-1) == uniq[inverse]),
    as np.unique gives them. ``remember_for``: the fixed table looked up; the
    ids' stable sort order is kept (this thread's last look-up) for a
    row-wise gradient of the same ids pushed next (one sort a step)."""
    flat = int64_ids(ids)
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    first = np.empty(flat.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(flat.size, dtype=np.intp)
    inverse[order] = np.cumsum(first) - 1
    if remember_for is not None:
        _last.sort = (remember_for, flat.copy(), order)   # a copy: the caller's may change
    return ordered[first], inverse


#: A thread's last look-ups: ``sort`` (fixed table, its ids, their stable sort
#: order), ``keys`` (dynamic table, its keys, unique keys, inverse or None).
_last = threading.local()


def known_order(variable, ids: np.ndarray) -> np.ndarray | None:
    """The stable sort order of ``ids`` if this thread's last look-up of
    ``variable`` was of exactly these ids (else None: sort them)."""
    last = getattr(_last, "sort", None)
    if last is not None and last[0] is variable and last[1].shape == ids.shape \
            and np.array_equal(last[1], ids):
        return last[2]
    return None


def last_lookup(table, keys: np.ndarray, epoch: int) -> tuple | None:
    """(keys distinct and put shard by shard, where each of ``keys`` lands
    among them, [(shard, lo, hi)]) from this thread's last look-up of
    ``table`` (one per table, for the last _KEPT tables: a step's several
    tables) when it was of these 1-D ``keys``, split by the table's layout
    ``epoch``; else None."""
    last = getattr(_last, "keys", {}).get(table.name)
    if last is not None and last[0] is table and last[1] == epoch and \
            last[2].shape == keys.shape and np.array_equal(last[2], keys):
        return last[3:]   # (split by the layout the table has now)
    return None


_KEPT = 16


def shard_order(table, keys: np.ndarray, with_counts: bool = False) -> tuple:
    """(the distinct ``keys`` (1-D) put shard by shard, where each of ``keys``
    lands among them, [(shard, lo, hi)], and with ``with_counts`` how often
    each occurs: None where every key occurs once): what a look-up sends
    and what a push of the same keys' rows sums into."""
    uniq, inverse, counts = _unique(keys)
    if uniq.size == keys.size:   # distinct: kept in the order given
        uniq, inverse, counts = keys, None, None
    order, runs = by_shard(table, uniq)
    rank = np.empty(order.size, np.intp)
    rank[order] = np.arange(order.size)   # where each distinct key lands
    where = rank if inverse is None else rank[inverse.reshape(-1)]
    counts = None if counts is None or not with_counts else counts[order]
    return uniq[order], where, runs, counts


def _unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """np.unique(keys, return_inverse=True, return_counts=True) of 1-D keys,
    from one unstable argsort (the result does not depend on how ties are
    ordered): a third less time than np.unique for a step's keys."""
    if keys.size == 0:
        return keys.copy(), np.empty(0, np.intp), np.empty(0, np.intp)
    order = np.argsort(keys)
    ordered = keys[order]
    first = np.empty(keys.size, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(keys.size, dtype=np.intp)
    inverse[order] = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    return ordered[starts], inverse, np.diff(starts, append=keys.size)


def by_shard(table, keys: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """(the order that puts ``keys`` shard by shard, [(shard, lo, hi)] of
    each shard's run in that order) of a dynamic table's keys."""
    n = table.num_shards
    if n == 1:
        return np.arange(keys.size), ([(0, 0, keys.size)] if keys.size else [])
    return by_shard_of(table.shard_of(keys), n)


def by_shard_of(which: np.ndarray, n: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """by_shard, given each key's shard (of n)."""
    if n <= 1 << 15:   # a radix sort: 4x faster than a stable sort of int64
        which = which.astype(np.int16, copy=False)
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(n + 1))
    return order, [(i, int(bounds[i]), int(bounds[i + 1])) for i in range(n)
                   if bounds[i + 1] > bounds[i]]
