"""Which rows of a dynamic-table shard (psserver/core/dynamic_table.py) go,
in time independent of the shard's size (issue 32 item 7: a full scan and
sort per look-up cost 9-17 ms at 300k rows).

* Capacity: a shard of at most ``EXACT_ROWS`` rows handed out picks its
  victims among all its live rows (exact LRU/LFU); a larger one among a
  random sample of ``SAMPLE`` live rows (or 8x the victims needed), as
  Redis' approximate LRU/LFU does: the victims are the policy's worst of the
  sample, so a look-up that evicts costs the same at 10M rows as at 10k.
* Age: a row past its age is absent at once (DynamicTable._stale: its
  look-up and its gradients see it gone); its memory comes back by a sweep
  of ``SWEEP`` rows per admitting look-up, resumed where the last one
  stopped (all of a shard of at most SWEEP rows), and by the look-up that
  finds it.

Row numbers: 1 .. handed-1 (row 0 is the default row); a freed row's
``used_step`` is -1 (``FREE``), a live row's >= 0.
"""
from __future__ import annotations

import numpy as np

EXACT_ROWS = 4096
SAMPLE = 1024
SWEEP = 4096
FREE = -1


def candidates(used_step: np.ndarray, handed: int, live: int, want: int,
               rng: np.random.Generator, all_live, first: int = 1, keep=None) -> np.ndarray:
    """Distinct live rows (``first`` .. handed-1; ``keep(rows)``: a mask of
    the ones that may go) to choose ``want`` victims among: every live row of
    a small shard, else a random sample of max(SAMPLE, 8 * want) of them;
    every live row (``all_live()``) for a shard too sparse to sample, or
    where the sample holds fewer than ``want`` (nearly every row goes).
    (The admission counter's entries too: KeyCounter, from 0, ``used_step``
    its last-seen ticks.)"""
    def kept(rows):
        return rows if keep is None else rows[keep(rows)]
    k = max(SAMPLE, 8 * want)
    share = live / max(1, handed - first)
    if handed - first <= EXACT_ROWS:
        rows = np.flatnonzero(used_step[first:handed] != FREE) + first
    elif k >= live or share < 0.05:
        rows = all_live()
    else:
        draw = rng.integers(first, handed, size=int(k / share * 1.25) + 16)
        rows = np.unique(draw[used_step[draw] != FREE])
    rows = kept(rows)
    return rows if rows.size >= want else kept(all_live())


def worst_first(policy: str, stale, used_step, freq, updated_step, row_key) -> np.ndarray:
    """The order of rows to evict (arrays of the candidates): rows past
    their age first, then LRU (least recently looked up) or LFU (least often,
    then least recently), then the least recently updated, then the smaller key."""
    keys = (row_key, updated_step, used_step) + ((freq,) if policy == "lfu" else ())
    return np.lexsort(keys + (~stale,))


def sweep(cursor: int, handed: int) -> tuple[np.ndarray, int]:
    """(the row numbers to check for age now, the cursor after them)."""
    if handed - 1 <= SWEEP:
        return np.arange(1, handed), 1
    lo = cursor if 1 <= cursor < handed else 1
    hi = min(handed, lo + SWEEP)
    return np.arange(lo, hi), (hi if hi < handed else 1)
