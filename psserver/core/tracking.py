"""What changed in a shard since a save: the parameter server's side of
incremental checkpoints and serving exports (coordinator/checkpoint.py).

A shard (a Variable, a dynamic table shard) has no tracker until the first
save that names a save id; from then on every update marks what it changed
in the tracker's *current interval*: a variable's dense update or assignment
the whole variable, a row-wise one its rows (a bool per row: one vectorized
store per push); a table shard the rows made, updated or looked up (a bool
per table row) and the keys evicted. A save with id N takes the current
interval under the shard's lock, together with the copy it writes: that is
*save point* N, and a new interval starts. A save asked for the changes
``since`` point S gets the union of every interval after S (``ChangeLog``).

Crash safety: intervals are forgotten only when a save that covers them is
committed (``commit``: the coordinator renamed its manifest into place). A
save that failed leaves its point uncommitted: the next save since the
previous committed point takes its interval again. Points of each *stream*
(a checkpoint directory, an export) are committed separately, so two
streams never forget each other's changes.

When the tracker cannot prove what changed since S (no tracker yet; S is
not one of its points: the shard was created, overwritten by a restore,
copied whole from its primary, promoted or demoted after S; or S was
forgotten) ``take`` answers None and the caller writes the shard whole.
Changes are never guessed: a union is at worst a superset (rows written
again with their current values), never a subset.

Memory: a variable's tracker is a bool per row, now and in each of at most
MAX_POINTS points (at most 1 + MAX_POINTS bytes per row). A table shard's
evicted keys are kept at most ``evicted_limit`` (the shard's rows, at least
MIN_EVICTED_KEPT): past twice that they are made unique, and if still past
it the interval is marked ``whole`` (the next save writes the shard whole)
and the keys dropped. So a churning table with tracking started and no
save for a long time keeps a bounded number of keys, not 8 bytes per
eviction forever. Both count in their shard's bytes (``nbytes``), which
the server's --max-memory-bytes bounds.

Free of grpc and protobuf.
"""
from __future__ import annotations

import dataclasses

import numpy as np

#: Save points one shard remembers; past it the oldest uncommitted point's
#: interval is merged into the next one (a save since that point is then
#: written whole: correct, only larger).
MAX_POINTS = 16
#: A table shard keeps at least this many evicted keys before it gives up
#: and writes the shard whole at its next save (see the module).
MIN_EVICTED_KEPT = 4096
#: Batches of evicted keys kept apart before they are joined (each costs a
#: Python object of ~100 bytes).
_EVICTED_PARTS = 256


@dataclasses.dataclass
class Interval:
    """What changed between two save points: ``whole`` (every row), ``rows``
    (a bool per row of a variable, or None), ``keys`` (a table's keys, sorted
    unique int64, or None), ``touched`` (anything at all)."""
    whole: bool = False
    touched: bool = False
    rows: np.ndarray | None = None
    keys: np.ndarray | None = None

    def union(self, other: "Interval") -> "Interval":
        if self.whole or other.whole:   # every row: which ones is not kept
            return Interval(True, True)
        rows = self.rows if other.rows is None else (
            other.rows if self.rows is None else self.rows | other.rows)
        keys = self.keys if other.keys is None else (
            other.keys if self.keys is None else np.union1d(self.keys, other.keys))
        return Interval(False, self.touched or other.touched, rows, keys)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.rows, self.keys) if a is not None)


class ChangeLog:
    """A shard's save points, oldest first: [save id, stream, the interval
    that ended there]; and each stream's committed point (``anchors``)."""

    def __init__(self):
        self.points: list[list] = []
        self.anchors: dict[str, int] = {}

    def take(self, save_id: int, stream: str, since: int, current: Interval) -> Interval | None:
        """End the current interval at point ``save_id``; return what changed
        since point ``since`` (None: unknown, write the shard whole)."""
        ids = [p[0] for p in self.points]
        if save_id in ids:   # taken again (a resent save): as if the first never was
            old = self.points[ids.index(save_id)]
            if old is self.points[-1]:
                current = old[2].union(current)
                self.points.pop()
            else:
                self._forget(old)
            ids = [p[0] for p in self.points]
        out = None
        if since and since in ids:
            out = current
            for p in self.points[ids.index(since) + 1:]:
                out = p[2].union(out)
        self.points.append([save_id, stream, current])
        while len(self.points) > MAX_POINTS:
            self._forget(self._oldest_uncommitted())
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the points' intervals hold."""
        return sum(p[2].nbytes for p in self.points)

    def commit(self, save_id: int, stream: str) -> bool:
        """Point ``save_id`` of ``stream`` is on disk for good: points of that
        stream before it are merged away, and intervals no stream can ask
        for any more are dropped. False (nothing changed) if it is not one
        of this shard's points."""
        ids = [p[0] for p in self.points]
        if save_id not in ids:
            return False
        at = ids.index(save_id)
        self.anchors[stream] = save_id
        for p in self.points[:at]:
            if p[1] == stream:
                self._forget(p)
        ids = [p[0] for p in self.points]
        first = min(ids.index(a) for a in self.anchors.values() if a in ids)
        del self.points[:first]
        self.points[0][2] = Interval()   # nothing before the oldest anchor is asked for
        self.anchors = {s: a for s, a in self.anchors.items() if a in ids}
        return True

    def release(self, stream: str) -> None:
        """``stream`` asks for nothing more: its anchor goes (its points are
        dropped or merged as any uncommitted one's)."""
        self.anchors.pop(stream, None)

    def _oldest_uncommitted(self) -> list:
        """The point to merge away when there are too many (never the newest)."""
        anchored = set(self.anchors.values())
        older = self.points[:-1]
        return next((p for p in older if p[0] not in anchored), older[0])

    def _forget(self, point: list) -> None:
        """Drop a point (not the newest); its interval joins the next one's
        (the first point's interval is never asked for: dropped)."""
        i = self.points.index(point)
        del self.points[i]
        if i < len(self.points) and i > 0:
            self.points[i][2] = point[2].union(self.points[i][2])
        self.anchors = {s: a for s, a in self.anchors.items() if a != point[0]}


class VariableTracker:
    """A variable shard's changes: the current interval (``whole``,
    ``touched``, ``rows``) the update paths mark (lock held), and its log."""

    __slots__ = ("whole", "touched", "rows", "log", "_nrows")

    def __init__(self, shape: tuple):
        self._nrows = shape[0] if shape else None
        self.log = ChangeLog()
        self._fresh()

    def _fresh(self) -> None:
        self.whole = self.touched = False
        self.rows = None if self._nrows is None else np.zeros(self._nrows, bool)

    def mark_rows(self, ids: np.ndarray) -> None:
        """A row-wise update of rows ``ids`` (lock held)."""
        self.touched = True
        if self.rows is None:
            self.whole = True
        else:
            self.rows[ids] = True

    def mark_all(self) -> None:
        """A dense update or an assignment (lock held)."""
        self.whole = self.touched = True

    def take(self, save_id: int, stream: str, since: int) -> Interval | None:
        """Save point ``save_id`` (lock held, with the copy the save writes)."""
        current = Interval(True, True) if self.whole else \
            Interval(False, self.touched, self.rows)
        self._fresh()
        return self.log.take(save_id, stream, since, current)

    @property
    def nbytes(self) -> int:
        return (0 if self.rows is None else self.rows.nbytes) + self.log.nbytes


class TableTracker:
    """A dynamic table shard's changes: rows made, updated or looked up (a
    bool per table row, ``dirty``) and keys evicted (``note_evicted``;
    bounded: see the module), since the last point."""

    __slots__ = ("dirty", "evicted", "_evicted_n", "overflow", "log")

    def __init__(self, capacity: int):
        self.dirty = np.zeros(capacity, bool)
        self.log = ChangeLog()
        self._fresh()

    def _fresh(self) -> None:
        self.evicted: list[np.ndarray] = []
        self._evicted_n = 0
        self.overflow = False   # too many evicted keys kept: the interval is whole

    @property
    def evicted_limit(self) -> int:
        """Evicted keys one interval keeps at most (the shard's rows, or
        MIN_EVICTED_KEPT): a delta with more is no smaller than the shard."""
        return max(self.dirty.size, MIN_EVICTED_KEPT)

    def grow(self, capacity: int) -> None:
        grown = np.zeros(capacity, bool)
        grown[:self.dirty.size] = self.dirty
        self.dirty = grown

    def note_evicted(self, keys: np.ndarray) -> None:
        """The rows of ``keys`` were evicted (table lock held)."""
        if self.overflow or not keys.size:
            return
        self.evicted.append(keys)
        self._evicted_n += keys.size
        if self._evicted_n > 2 * self.evicted_limit or len(self.evicted) > _EVICTED_PARTS:
            kept = np.unique(np.concatenate(self.evicted))   # (a key evicted twice: once)
            if kept.size > self.evicted_limit:
                self._fresh()
                self.overflow = True
            else:
                self.evicted, self._evicted_n = [kept], kept.size

    @property
    def nbytes(self) -> int:
        return self.dirty.nbytes + 8 * self._evicted_n + self.log.nbytes

    def take(self, save_id: int, stream: str, since: int,
             row_key: np.ndarray) -> Interval | None:
        """Save point ``save_id`` (table lock held): the keys of the marked
        rows (``row_key``: the table's key of each row) and the evicted keys;
        what changed since ``since`` (keys live now: rows to write; the
        others: evicted; ``whole``: too many evictions were kept, write the
        shard whole), or None."""
        if self.overflow:
            current = Interval(True, True)
        else:
            parts = [row_key[np.flatnonzero(self.dirty)], *self.evicted]
            current = Interval(touched=True, keys=np.unique(np.concatenate(parts)))
        self.dirty = np.zeros(self.dirty.size, bool)
        self._fresh()
        return self.log.take(save_id, stream, since, current)
