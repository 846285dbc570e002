"""The hash index of a dynamic table shard (psserver/core/dynamic_table.py):
int64 key -> int64 row, all numpy, no Python object per key.

Buckets of 4 slots, each a key (int64) and the row it names (int64), linear
probing over buckets; at most half the slots are used (rebuilt past that),
so nearly every key is in its home bucket and a look-up of many keys is one
gather of their buckets. 2 to 4 slots of 16 bytes per key (load 0.25-0.5).
Keys are placed by ``psserver.contract.keys.mix64``. ``KeyCounter`` (a table's
admission counter) counts a bounded set of keys on one.
"""
from __future__ import annotations

import numpy as np

from psserver.contract.keys import mix64
from psserver.core import eviction

EMPTY, DELETED = -1, -2   # a slot's row when it holds no key
_BUCKET = 4
_TAIL = 8                # buckets a look-up past its home bucket takes at once
_MIN_SLOTS = 64


def _any4(b: np.ndarray) -> np.ndarray:
    """``b.any(axis=1)`` for a C-contiguous (n, 4) bool array, as one uint32
    per row (numpy's reduction over a short axis is ~5x slower)."""
    return np.ascontiguousarray(b).view(np.uint32)[:, 0] != 0


class KeyIndex:
    """int64 key -> int64 row: a hash table of buckets of 4 slots (a bucket's
    keys are 32 bytes: one cache line), linear probing over buckets,
    vectorized over arrays of keys.

    Per slot a key and a row; the row is EMPTY (-1) or DELETED (-2) when the
    slot holds no key. At most half the slots are used (empty slots are
    made anew past that), so nearly every key is in its home bucket and a
    look-up of many keys is one gather of their buckets. ``insert`` expects
    keys that are unique and absent (``find`` first)."""

    def __init__(self, slots: int = _MIN_SLOTS):
        self._alloc(max(_MIN_SLOTS, 1 << max(0, int(slots) - 1).bit_length()) // _BUCKET)
        self.size = 0      # slots holding a key
        self.used = 0      # ... and deleted ones (what look-ups walk past)

    def _alloc(self, buckets: int) -> None:
        self.keys = np.zeros((buckets, _BUCKET), np.int64)
        self.rows = np.full((buckets, _BUCKET), EMPTY, np.int64)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.rows.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (mix64(keys.view(np.uint64))
                & np.uint64(self.keys.shape[0] - 1)).astype(np.int64)

    def _locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bucket, slot, row) of each key; bucket and row -1 where it is
        absent. The home buckets of all keys are gathered at once (np.take:
        several times faster than fancy indexing here); the few keys whose
        home bucket is full and lacks them (~4% at half load) then look at
        the next _TAIL buckets at once, and so on."""
        keys = np.ascontiguousarray(keys, np.int64)
        n = keys.size
        if not n or not self.size:
            return np.full(n, -1, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64)
        mask = self.keys.shape[0] - 1
        home = self._home(keys)
        kb = np.take(self.keys, home, axis=0)
        rb = np.take(self.rows, home, axis=0)
        hit = kb == keys[:, None]
        hit &= rb >= 0
        found = _any4(hit)
        at = hit.argmax(axis=1)   # (a key is in one slot at most)
        # the rows of the slots found, by flat position (np.take: several
        # times faster than take_along_axis or fancy indexing)
        row = np.take(rb.reshape(-1), at + np.arange(0, n * _BUCKET, _BUCKET))
        if found.all():   # (the usual case: every key in its home bucket)
            return home, at, row
        row[~found] = -1
        bucket = np.where(found, home, -1)
        slot = np.where(found, at, 0)
        active = np.flatnonzero(~found & ~_any4(rb == EMPTY))   # full, and not there
        step = np.arange(1, _TAIL + 1)
        start = home[active]
        for _ in range(self.keys.shape[0] // _TAIL + 1):   # bounded: every bucket once
            if not active.size:
                break
            b = (start[:, None] + step) & mask                       # (m, _TAIL)
            kb = np.take(self.keys, b.reshape(-1), axis=0).reshape(active.size, -1)
            rb = np.take(self.rows, b.reshape(-1), axis=0).reshape(active.size, -1)
            hit = (kb == keys[active, None]) & (rb >= 0)
            found = hit.any(axis=1)
            at = hit.argmax(axis=1)
            idx = active[found]
            bucket[idx] = b[found, at[found] // _BUCKET]
            slot[idx] = at[found] % _BUCKET
            row[idx] = rb[found, at[found]]
            go_on = ~found & ~(rb == EMPTY).any(axis=1)
            active, start = active[go_on], start[go_on] + _TAIL
        return bucket, slot, row

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The row of each key, or -1 where the key is absent."""
        return self._locate(keys)[2]

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Add unique, absent ``keys`` naming ``rows``: each in the first
        free slot (empty or deleted) from its home bucket on."""
        keys = np.ascontiguousarray(keys, np.int64)
        rows = np.ascontiguousarray(rows, np.int64)
        if not keys.size:
            return
        if 2 * (self.used + keys.size) > self.keys.size:
            self._rebuild(self.size + keys.size)
        mask = self.keys.shape[0] - 1
        pos = self._home(keys)
        pending = np.arange(keys.size)
        while pending.size:
            order = np.argsort(pos[pending], kind="stable")
            pending = pending[order]
            b = pos[pending]
            starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
            rank = np.arange(b.size) - np.repeat(starts, np.diff(np.r_[starts, b.size]))
            free = self.rows[b] < 0
            fits = rank < free.sum(axis=1)
            # the rank-th free slot of the bucket
            nth = (np.cumsum(free, axis=1) == (rank + 1)[:, None]) & free
            slot = nth.argmax(axis=1)
            win, wb, ws = pending[fits], b[fits], slot[fits]
            self.used += int((self.rows[wb, ws] == EMPTY).sum())
            self.keys[wb, ws] = keys[win]
            self.rows[wb, ws] = rows[win]
            pending = pending[~fits]
            pos[pending] = (pos[pending] + 1) & mask
        self.size += keys.size

    def delete(self, keys: np.ndarray) -> np.ndarray:
        """Remove the keys that are present; their rows (the others: ignored)."""
        bucket, slot, _ = self._locate(keys)
        found = bucket >= 0
        bucket, slot = bucket[found], slot[found]
        rows = self.rows[bucket, slot].copy()
        self.rows[bucket, slot] = DELETED
        self.size -= rows.size
        return rows

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        full = self.rows >= 0
        return self.keys[full], self.rows[full]

    def _rebuild(self, need: int) -> None:
        keys, rows = self.items()
        n = _MIN_SLOTS
        while n < 2 * max(need, 1):
            n *= 2
        self._alloc(n // _BUCKET)
        self.size = self.used = 0
        self.insert(keys, rows)


class KeyCounter:
    """How often each of a bounded set of keys was seen, and when last: a
    dynamic table's admission counter (keys seen but not admitted yet).

    At most ``limit`` keys: past it, the keys seen longest ago are forgotten
    first (of a random sample past eviction.EXACT_ROWS keys: in time
    independent of the limit). Per key an index entry and 24 bytes (count,
    last seen, the key), in arrays that double when full; a forgotten key's
    entry is reused (its last seen: eviction.FREE)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.index = KeyIndex()
        self._count = np.zeros(64, np.int64)
        self._seen = np.zeros(64, np.int64)
        self._key = np.zeros(64, np.int64)
        self._n = 0                           # entries handed out (live + free)
        self._free: list[np.ndarray] = []     # forgotten entries, reused first
        self._rng = np.random.default_rng(0)  # forgetting's samples

    @property
    def size(self) -> int:
        return self.index.size

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self._count.nbytes + self._seen.nbytes + self._key.nbytes

    def clear(self) -> None:
        """Forget every key (the arrays are kept for reuse)."""
        self.index = KeyIndex()
        self._free, self._n = [], 0

    def counts(self, keys: np.ndarray) -> np.ndarray:
        """How often each of unique ``keys`` was seen (0: never, or forgotten)."""
        slot = self.index.find(keys)
        known = slot >= 0
        out = np.zeros(keys.size, np.int64)
        out[known] = self._count[slot[known]]
        return out

    def note(self, keys: np.ndarray, seen: np.ndarray, admitted: np.ndarray,
             tick: int) -> None:
        """Unique ``keys`` were seen ``seen`` times in all, at ``tick``: the
        ``admitted`` ones are forgotten (they have rows now), the others
        counted, new ones added (forgetting the keys seen longest ago past
        ``limit``)."""
        slot = self.index.find(keys)
        gone = admitted & (slot >= 0)
        if gone.any():
            self._forget(slot[gone])
        stay = ~admitted & (slot >= 0)
        self._count[slot[stay]] = seen[stay]
        self._seen[slot[stay]] = tick
        new = ~admitted & (slot < 0)
        if new.any():
            over = self.index.size + int(new.sum()) - self.limit
            if over > 0:   # forget the keys seen longest ago
                live = eviction.candidates(self._seen, self._n, self.index.size, over,
                                           self._rng, lambda: self.index.items()[1], first=0)
                self._forget(live[np.argsort(self._seen[live], kind="stable")[:over]])
            nk = keys[new]
            pr = self._take(nk.size)
            self.index.insert(nk, pr)
            self._count[pr] = seen[new]
            self._seen[pr] = tick
            self._key[pr] = nk

    def _forget(self, entries: np.ndarray) -> None:
        self.index.delete(self._key[entries])
        self._seen[entries] = eviction.FREE
        self._free.append(entries)

    def _take(self, n: int) -> np.ndarray:
        free = np.concatenate(self._free) if self._free else np.zeros(0, np.int64)
        got, rest = free[:n], free[n:]
        self._free = [rest] if rest.size else []
        more = n - got.size
        if more:
            if self._n + more > self._count.size:
                size = max(int(self._count.size * 2), self._n + more)
                for name in ("_count", "_seen", "_key"):
                    old = getattr(self, name)
                    new = np.zeros(size, old.dtype)
                    new[:old.size] = old
                    setattr(self, name, new)
            got = np.concatenate([got, np.arange(self._n, self._n + more)])
            self._n += more
        return got
