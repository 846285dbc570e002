"""Row-wise array work shared by the optimizers' lazy updates, the stores'
gathers and sparse pushes, the dynamic tables and the client's step
planning: gather rows (``take_rows``), scatter them (``put_rows``) and sum
the rows of duplicate ids deterministically (``sum_duplicates``; ``sum_rows``
by a given inverse, as a step sums its rows before a push), so that a
client that sums a batch's rows gets the bits a server would.

Apart from psserver/contract/optimizers.py because they are not optimizer code: the
coordinator (coordinator/variables.py) and the tables use them without an
optimizer. Pure numpy; each function states the measurement behind its form.
"""
from __future__ import annotations

import numpy as np


def take_rows(a: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``a[ids]`` along axis 0 (ids of any shape, in range), a new array.

    ``np.take`` copies whole rows; numpy's fancy indexing of a 2-D array
    walks it element by element: 1,280 random rows of 64 float32 take 80 us
    against 234 us (bench: the embedding gathers and sparse updates)."""
    return np.take(a, ids, axis=0)


def put_rows(a: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """``a[ids] = rows`` along axis 0 (1-D ids in range), each row written as
    one block of bytes where ``a`` and ``rows`` are C-contiguous arrays of one
    dtype with rows of a few bytes or more (fancy assignment writes element by
    element: 1,280 rows of 64 float32 take 69 us against 159 us)."""
    cols = a.size // a.shape[0] if a.ndim > 1 and a.shape[0] else 0
    if cols * a.itemsize >= 8 and rows.dtype == a.dtype and a.flags.c_contiguous \
            and rows.flags.c_contiguous and a.flags.writeable \
            and rows.shape == (ids.size,) + a.shape[1:]:
        void = np.dtype((np.void, cols * a.itemsize))
        a.reshape(a.shape[0], cols).view(void)[ids.reshape(-1), 0] = \
            rows.reshape(ids.size, cols).view(void)[:, 0]
    else:
        a[ids] = rows


def sum_duplicates(ids: np.ndarray, rows: np.ndarray,
                   order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique int64 ids, rows summed per id), rows' dtype kept (the
    arrays given, not copies, when ids are sorted and distinct already).
    ``order``: ``np.argsort(ids, kind="stable")`` where the caller has it.

    Deterministic: the same input gives the same bits, on every client and
    server. An id seen once has its row copied; an id seen up to ``_FEW``
    times has its rows added one after another in the order given (a stable
    sort); an id seen more often is summed by ``np.add.reduceat`` (numpy's
    order: the first row plus the pairwise sum of the rest), whose cost is
    per id (~1.5 us), hence not used for every id.
    """
    ids = np.asarray(ids).astype(np.int64, copy=False).reshape(-1)
    rows = np.asarray(rows)
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids, rows   # sorted and distinct already (a client summed them): as they are
    if order is None:
        order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    first = np.empty(sorted_ids.size, dtype=bool)
    first[0] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    out = take_rows(rows, order[starts])   # each id's first row
    if starts.size == sorted_ids.size:
        return sorted_ids, out
    counts = np.diff(starts, append=sorted_ids.size)
    # Ids seen a few times: their k-th rows added to the sums, k = 1, 2, ...
    # (one vectorised add per k: ((r0 + r1) + r2) + ...); ids seen more
    # often: np.add.reduceat over their rows.
    few = np.flatnonzero((counts > 1) & (counts <= _FEW))
    for k in range(1, int(counts[few].max()) + 1 if few.size else 1):
        few = few[counts[few] > k]
        out[few] += take_rows(rows, order[starts[few] + k])
    many = np.flatnonzero(counts > _FEW)
    if many.size:
        n = counts[many]
        begin = np.cumsum(n) - n   # the rows of those ids, id after id, in order
        at = np.repeat(starts[many] - begin, n) + np.arange(int(n.sum()))
        out[many] = np.add.reduceat(take_rows(rows, order[at]), begin, axis=0)
    return sorted_ids[starts], out


#: sum_duplicates: ids seen up to this many times are summed k-th row by
#: k-th row, the others by np.add.reduceat (~1.5 us per id: its cost).
_FEW = 8


def sum_rows(inverse: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """out[j] = the sum of rows[i] with inverse[i] == j (n rows; summed in
    float64 in order of i, one np.bincount per column: faster than a sort
    and np.add.reduceat, or np.add.at), in rows' dtype. ``inverse`` takes
    every value below n (as np.unique's does)."""
    if rows.dtype.kind != "f":
        raise ValueError(f"gradient rows must be floating, got {rows.dtype}")
    if inverse.size == n:   # nothing to sum: each row to its place
        out = np.empty((n,) + rows.shape[1:], rows.dtype)
        put_rows(out, inverse, np.ascontiguousarray(rows))
        return out
    out = np.empty((rows.shape[1], n), rows.dtype)
    for j, col in enumerate(np.ascontiguousarray(rows.T)):
        out[j] = np.bincount(inverse, weights=col, minlength=n)
    return np.ascontiguousarray(out.T)
