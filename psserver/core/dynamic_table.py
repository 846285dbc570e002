"""Dynamic embedding tables: rows keyed by arbitrary int64 ids, created on
first sight (subject to admission), evicted by capacity or age.

A parameter server shard holds one ``DynamicTable`` per table (the keys it
owns by bucket: psserver.contract.keys.BucketMap). It is the data structure only; the server's
store wraps calls to it in its locks, and the optimizer updates its rows
through the same ``apply_sparse`` as a fixed table's.

Layout (all numpy, no Python object per key):

* a hash index (psserver.core.key_index.KeyIndex): buckets of 4 slots, each a
  key (int64) and the row it names (int64), linear probing over buckets; at
  most half the slots are used (rebuilt past that);
* the rows, the optimizer's slots and per-row bookkeeping in arrays that
  grow by a quarter when full (pages never written stay unresident), with
  freed rows (evicted) reused first;
* per row: its key, the table step and time of its last update (age
  eviction), the step of its last use (LRU) and how often it was looked up
  (LFU).

Per-key overhead beyond the row and its slots: 2 to 4 index slots of 16
bytes (load 0.25-0.5) and 40 bytes of bookkeeping (key, two steps, a time,
a count), so 72 to 104 bytes, plus an admission counter entry (24 bytes and
its 32 to 64 bytes of index, only for keys seen but not yet admitted).

Admission: a key gets a row once it was looked up ``min_count`` times
(counted in a bounded table of its own, oldest forgotten first), and then
only with probability ``probability`` per look-up past that; until then a
look-up returns the default row (zeros) and a gradient for it is dropped.
Both are counted. Eviction (its cost independent of the shard's size:
psserver/core/eviction.py): ``capacity`` rows at most (LRU: least recently
looked up first; LFU: least often looked up, admission's look-ups counted,
then LRU; ties to the least recently updated, then the smaller key; exact
up to 4,096 rows, the worst of a random sample beyond), never a row the
same look-up found (new keys get the rows left, the last keys first); and
rows not updated for ``max_age_steps`` table steps (a step: one applied
gradient batch) or ``max_age_seconds``: absent from then on (gradients
dropped, zeros to any look-up), their memory freed by a sweep of 4,096 rows
per admitting look-up, or the look-up that finds one. An evicted key
forgets everything: seen again, it starts over (admission included).

New rows are initialized from (the initializer's seed, key) alone
(psserver.contract.keys.initial_rows), so a key's first value does not depend on the order
keys arrive in, or on the shard: a table resharded or re-created gives the
same rows. (``TableConfig.seed`` seeds probability admission's draws.)
The file format of a shard's rows (export/import) is psserver/contract/checkpoint_format.py.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import numpy as np

from psserver.contract import keys as K
from psserver.contract.checkpoint_format import check_rows, slot_layout
from psserver.contract.keys import check_keys, initial_rows
from psserver.contract.memory import give_back_memory, grow_rows, mapped
from psserver.contract.rows import sum_duplicates
from psserver.core import eviction
from psserver.core.key_index import KeyCounter, KeyIndex
from psserver.core.table_config import TableConfig, TableStats, check_counts, row_bytes
from psserver.core.tracking import TableTracker
from psserver.errors import InvalidArgument

#: Look-ups whose rows a shard remembers for the updates that follow them
#: (_rows_of): a step's update follows its look-up and a few other workers'.
_RECENT_LOOKUPS = 4
_GROW = 1.25             # rows arrays grow by this factor when full
#: Look-up counts (LFU) saturate here: one look-up adds < 2**62, so they never wrap.
MAX_FREQ = 1 << 62


class DynamicTable:
    """One shard of a dynamic embedding table: see the module docstring.

    ``optimizer`` is a psserver.contract.optimizers.Optimizer (its slots live here,
    a row each); ``clock`` gives seconds (time.monotonic by default; tests
    pass their own)."""

    def __init__(self, config: TableConfig, optimizer, *,
                 clock: Callable[[], float] = time.monotonic, initial_rows_hint: int = 1024):
        self.config = config.check()
        self.dtype = np.dtype(config.dtype)
        self.optimizer = optimizer
        self.clock = clock
        self.stats = TableStats()
        self.step = 0                 # applied gradient batches
        self.index = KeyIndex(2 * initial_rows_hint)
        self._n = 1                   # rows handed out (live + free); row 0: the default
                                      # row (zeros), never handed out, so a look-up is one gather
        self._free: list[np.ndarray] = []   # freed row numbers, reused first
        cap = max(16, initial_rows_hint)
        self.value = mapped((cap, config.dim), self.dtype)   # (grown in place: _grow)
        # The optimizer's slots: a row per table row for its per-element
        # slots, and as they are for the others (Adam's step count).
        self._slot_init, self._row_slots = slot_layout(optimizer, config.dim, self.dtype)
        #: What one more row may cost this shard (the server's memory check).
        self.row_bytes = row_bytes(config.dim, self.dtype, len(self._row_slots))
        self.slots = dict(self._slot_init)
        for n in self._row_slots:
            self.slots[n] = mapped((cap, config.dim), self.dtype)
        #: Bytes a row's values and per-row slots take (what a move reports).
        self.moved_row_bytes = config.dim * self.dtype.itemsize * (1 + len(self._row_slots))
        #: Bytes a row takes in the arrays above and below (nbytes).
        self._array_row_bytes = config.dim * self.dtype.itemsize * (1 + len(self._row_slots)) \
            + 5 * 8
        self._rows = cap
        self.row_key = mapped((cap,), np.int64)
        self.updated_step = mapped((cap,), np.int64)
        self.updated_time = mapped((cap,), np.float64)
        self.used_step = mapped((cap,), np.int64)
        self.freq = mapped((cap,), np.int64)
        self._tick = 0                # look-up batches (LRU's clock)
        # Admission: keys seen but not admitted, and how often.
        self.pending = KeyCounter(config.admission_capacity or (
            4 * config.capacity if config.capacity else 1 << 20))
        self._rng = np.random.default_rng(config.seed)
        self._sampler = np.random.default_rng([config.seed, 1])   # capacity's samples
        self._cursor = 1              # where the next age sweep starts
        # Replication (psserver/core/table_copy.py): while not None, the keys whose rows
        # were evicted and created, in order, and the last update's effect.
        self._journal: tuple[list, list] | None = None
        self._last_update: tuple[np.ndarray, np.ndarray] | None = None
        # The rows of recent look-ups' keys, valid while no row is evicted
        # (a key keeps its row until then; rows made since are found anew):
        # the update of a step finds its rows here, not in the index again.
        self._evictions = 0
        self._recent: collections.deque = collections.deque(maxlen=_RECENT_LOOKUPS)
        # Incremental saves (psserver.core.tracking): rows made, updated or looked
        # up and keys evicted since a save point; None until a save names one.
        self.tracker: TableTracker | None = None
        # Moves' copies ahead held here (psserver/core/table_moves.py): their
        # buckets (bool per bucket, or None), and which lost a row since (by
        # capacity or age, not a move's drop: its move sends the rows whole).
        self.guard: np.ndarray | None = None
        self.guard_hit = np.zeros(K.BUCKETS, bool)

    # -- sizes -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.index.size

    @property
    def nbytes(self) -> int:
        """Bytes of every array this shard holds (resident or not), its
        change tracking's included."""
        # From the row count, not the arrays: read without the shard's lock
        # (MemoryBudget.held), while _grow may be swapping them.
        tracking = 0 if self.tracker is None else self.tracker.nbytes
        return self._rows * self._array_row_bytes + self.index.nbytes + \
            self.pending.nbytes + tracking

    # -- look-ups ----------------------------------------------------------------------------
    def lookup(self, keys, *, admit: bool = True, counts: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``keys`` (any shape of int64; the result has a trailing
        dim): existing rows, rows created for keys admitted now, and the
        default row (zeros) for the others. ``admit=False`` (evaluation,
        serving): nothing is counted, created, evicted or touched (a row past
        its age reads as absent). ``counts`` (int64 >= 1, one per key): each
        key stands for that many occurrences (a caller that sent its batch's
        unique keys), for admission, LFU and the statistics alike."""
        keys = check_keys(keys)
        flat = keys.reshape(-1)
        if counts is not None:
            counts = check_counts(keys, counts).reshape(-1)
        if not admit:
            rows = self.index.find(flat)
            rows[self._stale(rows)] = -1
        else:
            if self._ages:
                now = self.clock()
                self._sweep(now)
            rows = self.index.find(flat)
            if self._ages:
                old = self._stale(rows, now)
                if old.any():   # past its age, not swept yet: gone now
                    self._expire_rows(np.unique(rows[old]))
                    rows[old] = -1
            self._tick += 1
            found = rows >= 0
            every = bool(found.all())   # (the usual case: hit and counts whole, no copies)
            hit = rows if every else rows[found]
            seen = 1 if counts is None else counts if every else counts[found]
            self.stats.lookups += flat.size if counts is None else int(counts.sum())
            self.stats.hits += hit.size if counts is None else int(seen.sum())
            self.used_step[hit] = self._tick   # (also: _create evicts none of them)
            if self.tracker is not None:   # (their look-up counts change)
                self.tracker.dirty[hit] = True
            if hit.size < 2 or bool((flat[1:] > flat[:-1]).all()):
                # distinct keys (a client sends its batch's keys sorted and
                # unique): one row each, so a plain sum (np.add.at: ~40x slower)
                self.freq[hit] = np.minimum(self.freq[hit] + seen, MAX_FREQ)
            else:
                np.add.at(self.freq, hit, seen)
                self.freq[hit] = np.minimum(self.freq[hit], MAX_FREQ)
            if not every:
                missing = ~found
                new_keys, inverse = np.unique(flat[missing], return_inverse=True)
                evicted = self.stats.evicted_capacity
                times = np.bincount(inverse, minlength=new_keys.size) if counts is None else \
                    np.bincount(inverse, weights=counts[missing],
                                minlength=new_keys.size).astype(np.int64)
                made = self._admit(new_keys, times,
                                   np.unique(hit).size if self.config.capacity else 0)
                rows[missing] = made[inverse]
                if self.stats.evicted_capacity != evicted:   # a row hit above may be gone
                    rows = self.index.find(flat)
            self._recent.append((flat, rows, self._evictions))
        out = np.take(self.value, np.maximum(rows, 0), axis=0)   # -1: row 0, the default row
        return out.reshape(keys.shape + (self.config.dim,))

    def _rows_of(self, keys: np.ndarray) -> np.ndarray:
        """index.find(keys), from a recent look-up of the same keys where no
        row was evicted since (those without a row then are looked for again)."""
        for seen, rows, evictions in reversed(self._recent):
            if evictions == self._evictions and seen.shape == keys.shape and \
                    np.array_equal(seen, keys):
                rows = rows.copy()
                missing = rows < 0
                if missing.any():
                    rows[missing] = self.index.find(keys[missing])
                return rows
        return self.index.find(keys)

    def _admit(self, keys: np.ndarray, times: np.ndarray, hits: int) -> np.ndarray:
        """Rows for unique absent ``keys`` seen ``times`` more times now (-1:
        not admitted yet) by a look-up that found ``hits`` rows."""
        c = self.config
        seen = times.astype(np.int64)
        if c.min_count > 1:
            seen = np.minimum(seen + self.pending.counts(keys), MAX_FREQ)
        ok = seen >= c.min_count
        if c.probability < 1.0:
            ok &= self._rng.random(keys.size) < c.probability
        rows = np.full(keys.size, -1, np.int64)
        if ok.any():   # a new row's look-up count: every look-up of its key so far
            rows[ok] = self._create(keys[ok], freq=np.minimum(seen[ok], MAX_FREQ), hits=hits)
        made = rows >= 0
        self.stats.not_admitted += int(times[~made].sum())
        if c.min_count > 1:
            self.pending.note(keys, seen, made, self._tick)
        return rows

    def _create(self, keys: np.ndarray, exact: bool = False,
                freq: np.ndarray | int = 1, hits: int = 0) -> np.ndarray:
        """Rows for new unique ``keys`` looked up ``freq`` times so far.
        Over capacity the policy's victims go first, never one of the ``hits``
        rows this look-up found (its tick); -1 for keys beyond the rows left
        (the last keys get rows). Not with ``exact``: a backup makes the rows
        its primary made."""
        c = self.config
        out = np.full(keys.size, -1, np.int64)
        take = np.arange(keys.size)
        if c.capacity and self.index.size + keys.size > c.capacity and not exact:
            room = c.capacity - hits   # rows new keys may have
            take = take[keys.size - max(0, min(keys.size, room)):]
            over = self.index.size + take.size - c.capacity
            if over > 0:
                self._evict_for(over, protect=True)
        if not isinstance(freq, int):
            freq = freq[take]
        keys = keys[take]
        rows = self._take_rows(keys.size)
        self.value[rows] = initial_rows(keys, c.dim, self.dtype, c.initializer)
        for name in self._row_slots:
            self.slots[name][rows] = self._slot_init[name][0]
        self.row_key[rows] = keys
        self.updated_step[rows] = self.step
        self.updated_time[rows] = self.clock()
        self.used_step[rows] = self._tick
        self.freq[rows] = freq
        self.index.insert(keys, rows)
        self.stats.admitted += keys.size
        if self.tracker is not None:
            self.tracker.dirty[rows] = True
        if self._journal is not None:
            self._journal[1].append(keys.copy())
        out[take] = rows
        return out

    def _take_rows(self, n: int) -> np.ndarray:
        """n rows: freed ones first (from the last freed: no copy of the
        others), then new ones."""
        got, have = [], 0
        while self._free and have < n:
            a = self._free.pop()
            if a.size > n - have:
                self._free.append(a[n - have:])
                a = a[:n - have]
            got.append(a)
            have += a.size
        more = n - have
        if more:
            if self._n + more > self._rows:   # (every array has _rows rows at least)
                self._grow(self._n + more)
            got.append(np.arange(self._n, self._n + more))
            self._n += more
        return np.concatenate(got) if got else np.zeros(0, np.int64)

    def _grow(self, need: int) -> None:
        size = max(need, int(self._rows * _GROW) + 1)
        # Each array enlarged in place where it has a mapping of its own
        # (psserver.contract.memory.grow_rows: no copy), else copied one at a
        # time, the old one's pages given back before the next grows (tasks
        # keep freed memory otherwise): resident memory passes what the table
        # holds by one small array's old rows at most while it grows. One that
        # fails (MemoryError) leaves each array with _rows rows at least, and
        # _rows as it was: the table as before, the call refused.
        for holder, names in ((self.__dict__, ("value",)), (self.slots, self._row_slots),
                              (self.__dict__, ("row_key", "updated_step", "updated_time",
                                               "used_step", "freq"))):
            for name in names:
                grow_rows(holder, name, size, self._n)
                give_back_memory()
        self._rows = size
        if self.tracker is not None:
            self.tracker.grow(size)
        give_back_memory()

    # -- eviction ----------------------------------------------------------------------------
    def _evict_rows(self, rows: np.ndarray, own: bool = False) -> None:
        """Evict ``rows``; ``own``: a move's drop (not a loss to a copy ahead)."""
        self._evictions += 1   # rows looked up before may belong to other keys now
        if self.guard is not None and not own and rows.size:
            b = K.bucket_of(self.row_key[rows])
            self.guard_hit[b[self.guard[b]]] = True
        if self._journal is not None and rows.size:
            self._journal[0].append(self.row_key[rows])
        if self.tracker is not None and rows.size:
            self.tracker.note_evicted(self.row_key[rows])
        self.index.delete(self.row_key[rows])
        self.used_step[rows] = eviction.FREE
        self._free.append(rows.astype(np.int64))

    def _evict_for(self, n: int, protect: bool = False) -> None:
        """Evict ``n`` rows by the policy (psserver/core/eviction.py), with
        ``protect`` none this look-up found."""
        live = eviction.candidates(
            self.used_step, self._n, self.index.size, n, self._sampler,
            lambda: self.index.items()[1],
            keep=(lambda rows: self.used_step[rows] != self._tick) if protect else None)
        stale = self._stale(live)
        order = eviction.worst_first(self.config.policy, stale, self.used_step[live],
                                     self.freq[live], self.updated_step[live],
                                     self.row_key[live])[:n]
        self._evict_rows(live[order])
        self.stats.evicted_age += int(stale[order].sum())
        self.stats.evicted_capacity += int(order.size - stale[order].sum())

    @property
    def _ages(self) -> bool:
        """Whether rows expire by age (else _stale is all False)."""
        return bool(self.config.max_age_steps or self.config.max_age_seconds)

    def _stale(self, rows: np.ndarray, now: float | None = None) -> np.ndarray:
        """Which of ``rows`` (-1: none) are past their age (absent, till evicted)."""
        c = self.config
        old = np.zeros(rows.shape, bool)
        if not (c.max_age_steps or c.max_age_seconds) or not rows.size:
            return old
        r = np.maximum(rows, 0)
        if c.max_age_steps:
            old |= self.step - self.updated_step[r] >= c.max_age_steps
        if c.max_age_seconds:
            now = self.clock() if now is None else now
            old |= now - self.updated_time[r] >= c.max_age_seconds
        return old & (rows >= 0)

    def _expire_rows(self, rows: np.ndarray) -> int:
        if self.guard is not None and rows.size:   # (a copy ahead's: the source expires them)
            rows = rows[~self.guard[K.bucket_of(self.row_key[rows])]]
        if rows.size:
            self._evict_rows(rows)
            self.stats.evicted_age += rows.size
        return rows.size

    def _sweep(self, now: float) -> None:
        """Evict the rows past their age among the next eviction.SWEEP rows."""
        if self.config.max_age_steps or self.config.max_age_seconds:
            rows, self._cursor = eviction.sweep(self._cursor, self._n)
            rows = rows[self.used_step[rows] != eviction.FREE]
            self._expire_rows(rows[self._stale(rows, now)])

    def expire(self) -> int:
        """Evict every row not updated for max_age_steps steps or
        max_age_seconds (look-ups sweep a part at a time); how many."""
        _, live = self.index.items()
        return self._expire_rows(live[self._stale(live)])

    # -- updates -----------------------------------------------------------------------------
    def check_gradients(self, keys, grads) -> tuple[np.ndarray, np.ndarray]:
        """(1-D int64 keys, grads) as apply_gradients takes them, or
        InvalidArgument saying what is wrong (nothing changes either way)."""
        keys = check_keys(keys).reshape(-1)
        grads = np.asarray(grads)
        if grads.shape != (keys.size, self.config.dim):
            raise InvalidArgument(
                f"dynamic table: gradient has shape {grads.shape}, expected "
                f"({keys.size}, {self.config.dim}) for {keys.size} keys of dim {self.config.dim}")
        if grads.dtype.kind != "f":
            raise InvalidArgument(f"dynamic table: gradient dtype must be floating, got "
                                  f"{grads.dtype}")
        with np.errstate(over="ignore"):   # checked as applied: in the table's dtype
            grads = grads.astype(self.dtype, copy=False)
        if not np.isfinite(grads).all():
            raise InvalidArgument(
                f"dynamic table: gradient has NaN or Inf, or values beyond {self.dtype.name}'s "
                f"range (+-{np.finfo(self.dtype).max:.3g}), the table's dtype; nothing "
                "applied. Lower the learning rate or clip gradients")
        return keys, grads

    def apply_gradients(self, keys, grads, *, checked: bool = False) -> int:
        """Apply row gradients (duplicate keys summed) with the optimizer, to
        the keys that have rows (not past their age); the rest are dropped
        and counted. One table step. Returns how many rows changed.
        ``checked``: keys and grads are what ``check_gradients`` returned."""
        if not checked:
            keys, grads = self.check_gradients(keys, grads)
        with np.errstate(over="ignore"):   # (a DynamicEmbedding sends them summed)
            ukeys, summed = sum_duplicates(keys, grads)
        if ukeys.size < keys.size and not np.isfinite(summed).all():
            raise InvalidArgument(
                f"dynamic table: a repeated key's gradients sum beyond {self.dtype.name}'s "
                "range; nothing applied. Lower the learning rate or clip gradients")
        rows = self._rows_of(ukeys)
        if self._ages:   # past its age: as good as evicted, its gradient dropped
            rows[self._stale(rows)] = -1
        have = rows >= 0
        n_have = int(have.sum())
        self.stats.dropped += ukeys.size - n_have
        self.step += 1
        if n_have:
            r = rows[have] if n_have < rows.size else rows
            order = np.argsort(r)
            r = r[order]
            g = (summed[have] if n_have < rows.size else summed)[order]   # (the table's dtype)
            self._update_rows(r, g)
            if self._journal is not None:
                self._last_update = (ukeys[have][order], g)
        elif self._journal is not None:
            self._last_update = (np.zeros(0, np.int64), np.zeros((0, self.config.dim),
                                                                  self.dtype))
        return n_have

    def _update_rows(self, rows: np.ndarray, grads: np.ndarray) -> None:
        """The optimizer on unique ``rows`` (one table step), their ages and tracking."""
        self.optimizer.apply_sparse(self.value, self.slots, rows, grads)
        self.updated_step[rows] = self.step
        self.updated_time[rows] = self.clock()
        self.stats.updated += rows.size
        if self.tracker is not None:
            self.tracker.dirty[rows] = True

    # -- replication: a primary's effects, followed by its backup (psserver/core/table_copy.py) ---
    # A backup makes no decisions of its own (admission, eviction, ages): it
    # does what its primary did, so both hold the same keys, values and slots.
    # Admission counters and look-up statistics are the primary's alone.
    def start_journal(self) -> None:
        """Note from now on the keys whose rows are evicted and created."""
        self._journal, self._last_update = ([], []), None

    def take_journal(self) -> tuple[np.ndarray, np.ndarray, tuple | None]:
        """(evicted keys, created keys, the last update's (keys, rows) or
        None) since start_journal; journaling stops."""
        ev, made = self._journal or ([], [])
        update, self._journal, self._last_update = self._last_update, None, None
        cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64))
        return cat(ev), cat(made), update

    def follow_rows(self, evicted: np.ndarray, created: np.ndarray) -> None:
        """What a primary's look-up changed: the rows of ``evicted`` keys
        gone, then rows made for ``created`` keys (initialized as the
        primary's were). InvalidArgument, nothing changed, if they do not fit
        this copy (it lacks a key to evict, or holds one to create)."""
        rows = self.index.find(evicted)
        held = created[self.index.find(created) >= 0]
        if (rows < 0).any() or np.unique(evicted).size != evicted.size or \
                np.unique(created).size != created.size or \
                not np.isin(held, evicted).all():
            raise InvalidArgument("dynamic table: a primary's changes do not fit this copy")
        self._tick += 1
        self._evict_rows(rows)
        if created.size:
            self._create(created, exact=True)

    def follow_update(self, keys: np.ndarray, grads: np.ndarray) -> None:
        """A primary's update as applied: ``grads`` (the table's dtype) to
        the rows of unique ``keys`` in that order (InvalidArgument, nothing
        changed, if a key has no row here). One table step, as there."""
        rows = self.index.find(keys)
        if (rows < 0).any() or grads.shape != (keys.size, self.config.dim) or \
                grads.dtype != self.dtype:
            raise InvalidArgument("dynamic table: a primary's update does not fit this copy")
        self.step += 1
        if rows.size:
            self._update_rows(rows, grads)

    # -- state (checkpoints, resharding) -------------------------------------------------------
    def export(self, keys: np.ndarray | None = None, now: float | None = None,
               weights_only: bool = False) -> dict[str, np.ndarray]:
        """Every live row, sorted by key: keys, values, per-row slots
        ("slot/<name>"), scalar slots as they are, and bookkeeping relative
        to ``now`` (default: the clock now) (age_steps, age_seconds: clocks
        and step counts differ between servers), freq. With ``keys`` (sorted,
        unique): only the rows of those that have one, and "evicted": the
        others. ``weights_only``: keys and values (and evicted) only."""
        now = self.clock() if now is None else now
        if keys is None:
            keys, rows = self.index.items()
            order = np.argsort(keys)
            keys, rows, gone = keys[order], rows[order], None
        else:
            rows = self.index.find(keys)
            live = rows >= 0
            keys, rows, gone = keys[live], rows[live], keys[~live]
        out = {"keys": keys, "values": self.value[rows]}
        if gone is not None:
            out["evicted"] = gone
        if weights_only:
            return out
        out.update({"age_steps": self.step - self.updated_step[rows],
                    "age_seconds": now - self.updated_time[rows],
                    "freq": self.freq[rows]})
        for name, slot in self.slots.items():
            out[f"slot/{name}"] = slot[rows] if name in self._row_slots else np.array(slot)
        return out

    def drop(self, keys: np.ndarray) -> None:
        """Remove the rows of ``keys`` (those that have one), not counted as
        evictions: they moved to another server (psserver/core/table_moves.py).
        Change tracking notes them gone."""
        rows = self.index.find(keys)
        rows = rows[rows >= 0]
        if rows.size:
            self._evict_rows(rows, own=True)

    def take_changes(self, save_id: int, stream: str, since: int):
        """Save point ``save_id`` of this shard (see psserver.core.tracking): the
        keys changed since point ``since`` (an Interval), or None or an
        Interval marked ``whole`` (unknown, or too many evictions kept: save
        it whole). Starts tracking on the first call."""
        if self.tracker is None:
            self.tracker = TableTracker(self._rows)
        return self.tracker.take(save_id, stream, since, self.row_key)

    def set_capacity(self, capacity: int, evict: bool = False) -> None:
        """The shard's capacity from now on (its part of the table's, which a
        restore sets); the admission counter's default bound (4x) follows it.
        ``evict``: rows past it go now, by the policy (else at the next
        admissions)."""
        self.config = dataclasses.replace(self.config, capacity=capacity)
        if not self.config.admission_capacity:
            self.pending.limit = 4 * capacity if capacity else 1 << 20
        if evict and capacity and self.index.size > capacity:
            self._evict_for(self.index.size - capacity)

    def import_rows(self, state: dict[str, np.ndarray], step: int, *, reset: bool,
                    replace: np.ndarray | None = None, staged: bool = False) -> int:
        """Put rows ``state`` (export()'s arrays, any subset of keys) into this
        shard; ``reset`` empties it first; ``replace``: keys whose rows go first
        (those held already: a move's, core/table_moves.py); ``staged``: a copy
        ahead (the step and scalar slots stay: its move brings them). Checked
        whole first (InvalidArgument). Over capacity afterwards, the policy's
        victims are evicted. Returns the rows held."""
        c = self.config
        keys, values, age_steps, age_seconds, freq, slots = check_rows(
            state, step, c.dim, self.dtype, self._slot_init, self._row_slots)
        n = keys.size
        if not reset and replace is None and (self.index.find(keys) >= 0).any():
            raise InvalidArgument("dynamic table import: keys this shard holds already "
                                  "(import into an emptied shard: reset)")
        # Checked: from here on nothing fails.
        self.tracker = None   # a restore: its next incremental save is whole
        if replace is not None and replace.size:
            self.drop(replace)
        if reset:
            _, live = self.index.items()
            self._evict_rows(live)
            self.pending.clear()
        if not staged:
            self.step = step if reset else max(self.step, step)
            for name in self.slots:
                if name not in self._row_slots:   # scalar (Adam's count): the largest
                    self.slots[name][...] = slots[name] if reset else \
                        np.maximum(self.slots[name], slots[name])
        rows = self._take_rows(n)
        self.value[rows] = values
        for name in self._row_slots:
            self.slots[name][rows] = slots[name]
        self.row_key[rows] = keys
        self.updated_step[rows] = max(self.step, step) - age_steps
        self.updated_time[rows] = self.clock() - age_seconds
        self.used_step[rows] = self._tick
        self.freq[rows] = np.minimum(freq, MAX_FREQ)
        self.index.insert(keys, rows)
        if c.capacity and self.index.size > c.capacity:
            self._evict_for(self.index.size - c.capacity)
        return self.index.size
