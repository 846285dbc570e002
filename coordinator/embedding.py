"""Dynamic embedding tables over the parameter servers: ``DynamicEmbedding``.

A table keyed by any int64 (hashes of feature strings), its keys spread
over every parameter server by a hash of the key
(psserver.dynamic_table.shard_of), each server holding its shard
(psserver/tables.py: admission, eviction, the optimizer's slots).
``ParameterServerStrategy.create_embedding_table`` makes one.

Like a ShardedVariable, a ``DynamicEmbedding`` is a small picklable
description that travels inside step closures to the workers and works the
same there: ``lookup(keys)`` returns dense rows (zeros for keys without a
row: not admitted yet, or evicted), and ``push_gradient(keys, grads)``
applies row gradients (duplicates summed) with the table's optimizer, both
one call per server, all at once.

With ``replication=True`` each shard has a backup on the next parameter
server (table name ``_backup/<name>`` there), which follows every change
its primary makes (psserver/tables.py); calls go to whichever copy is
primary now (coordinator.routes) and are resent there after a failover,
updates with their update key, so each applies once. Admission counters
of keys not admitted yet, and look-up statistics, are the primary's alone
(after a failover such a key counts again from zero).

Modes (coordinator.replica): in a sync step, look-ups wait for the
previous step on each shard, and every shard gets this replica's update
(an empty one counts), gathered with the other replicas' and applied once
(their sum, or mean: the strategy's aggregation) when the step is complete
(psserver/tables.py); with replication both copies get it. In async,
bounded and hybrid modes look-ups never wait and updates apply on arrival.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import numpy as np

from coordinator import calls
from coordinator.ps_pool import Op, servers
from coordinator.replica import rows_sync
from coordinator.routes import key as routes_key
from psserver.contract import BACKUP_PREFIX, TABLE_PREFIX
from psserver.keys import check_keys, shard_of
from psserver.link.pending import Pending



@dataclasses.dataclass(frozen=True)
class TableShard:
    """One copy of a table shard: the server, and its replication name
    (TABLE_PREFIX + its table name there), as coordinator.routes and
    coordinator.recovery take a variable's Shard."""
    address: str
    name: str

    @property
    def table(self) -> str:
        return self.name[len(TABLE_PREFIX):]


def sum_rows(inverse: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """out[j] = the sum of rows[i] with inverse[i] == j (n rows; summed in
    float64 in order of i, one np.bincount per column: faster than a sort
    and np.add.reduceat, or np.add.at), in rows' dtype."""
    if rows.dtype.kind != "f":
        raise ValueError(f"gradient rows must be floating, got {rows.dtype}")
    out = np.empty((rows.shape[1], n), rows.dtype)
    for j, col in enumerate(np.ascontiguousarray(rows.T)):
        out[j] = np.bincount(inverse, weights=col, minlength=n)
    return np.ascontiguousarray(out.T)


#: A thread's last look-up of a table: (table, its keys as sent, unique
#: keys, inverse or None when the keys were distinct already), so the step's
#: gradient push of the same keys sorts nothing again.
_last_lookup = threading.local()


def _unique_of(table, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(unique keys, inverse or None: ``keys`` are distinct) of 1-D ``keys``:
    from this thread's last look-up of ``table`` when it was of these keys,
    else computed."""
    last = getattr(_last_lookup, "of", None)
    if last is not None and last[0] is table and last[1].shape == keys.shape \
            and np.array_equal(last[1], keys):
        return last[2], last[3]
    uniq, inverse = np.unique(keys, return_inverse=True)
    return (keys, None) if uniq.size == keys.size and np.array_equal(uniq, keys) \
        else (uniq, inverse.reshape(-1))


@dataclasses.dataclass(frozen=True)
class TableStats:
    """A table's counters summed over its shards (protos tables.proto TableInfo)."""
    rows: int
    lookups: int
    hits: int
    admitted: int
    not_admitted: int
    evicted_capacity: int
    evicted_age: int
    updated: int
    dropped: int
    bytes: int
    late: int = 0   # sync mode: updates dropped whole (their step was applied, their
                    # replica abandoned, or the replica's second)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclasses.dataclass(frozen=True)
class DynamicEmbedding:
    """Table ``name`` with rows of ``dim`` values of ``dtype``, sharded over
    ``addresses`` (key k lives on addresses[shard_of(k, len(addresses))])."""

    name: str
    dim: int
    dtype: str
    addresses: tuple[str, ...]
    optimizer: str = "sgd"
    replicated: bool = False

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def shards(self) -> tuple[TableShard, ...]:
        """Each shard's copy that was created primary."""
        return tuple(TableShard(a, TABLE_PREFIX + self.name) for a in self.addresses)

    @property
    def backups(self) -> tuple[TableShard, ...]:
        """With replication, each shard's other copy, on the next server."""
        if not self.replicated:
            return ()
        n = len(self.addresses)
        return tuple(TableShard(self.addresses[(i + 1) % n],
                                TABLE_PREFIX + BACKUP_PREFIX + self.name) for i in range(n))

    def primaries(self) -> list[TableShard]:
        """Each shard's copy that takes calls now (the created one, unless a
        failover moved it: coordinator.routes)."""
        if not self.replicated:
            return list(self.shards)
        return servers().routes.primaries(self)

    def _ops(self, parts, send, sync: bool = False) -> Callable[[], list[Op]]:
        """A plan for settle: one call per (shard, positions) to the copy
        that is primary now (with ``sync``, to both copies), resent where it
        is after a failover, with the same update key (coordinator/ps_pool.py)."""
        def plan() -> list[Op]:
            routes = servers().routes
            ops = []
            for i, pos in parts:
                if not self.replicated:
                    ops.append(Op(self.addresses[i], lambda c, i=i, p=pos: send(c, self.name, i, p)))
                    continue
                r = routes.route(self, i)
                seen, pairs = ((routes_key(self.shards[i]), r),), ((self, i),)
                for t in routes.targets_of(self, i, r, sync):
                    ops.append(Op(t.address, lambda c, t=t.table, i=i, p=pos: send(c, t, i, p),
                                  seen, pairs))
            return ops
        return plan

    def _split(self, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(server index, positions of its keys) for each server with keys."""
        if len(self.addresses) == 1:
            return [(0, np.arange(keys.size))] if keys.size else []
        which = shard_of(keys, len(self.addresses))
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(self.addresses) + 1))
        return [(i, order[bounds[i]:bounds[i + 1]]) for i in range(len(self.addresses))
                if bounds[i + 1] > bounds[i]]

    def lookup(self, keys, *, admit: bool = True) -> np.ndarray:
        """Rows of ``keys`` (int64, any shape): shape keys.shape + (dim,).
        ``admit=False`` (evaluation): no key is counted, admitted or evicted.
        Each distinct key is sent once, with how often it occurs (admission
        and the statistics count every occurrence)."""
        return self.lookup_async(keys, admit=admit).result()

    def lookup_async(self, keys, *, admit: bool = True) -> "Pending":
        """lookup, sent now; ``result()`` waits for the rows (a step reads
        its dense variables meanwhile). With replication the calls run in
        result() (they may be resent to another copy)."""
        keys = check_keys(keys)
        sync = rows_sync()
        step = sync.step if sync is not None else None
        flat = keys.reshape(-1)
        uniq, inverse, counts = np.unique(flat, return_inverse=True, return_counts=True)
        if uniq.size == flat.size:
            uniq, inverse, counts = flat, None, None
        if not admit:
            counts = None
        rows_u = np.empty((uniq.size, self.dim), np.dtype(self.dtype))
        parts = self._split(uniq)
        _last_lookup.of = (self, flat.copy(), uniq, inverse)   # (the push sorts nothing again)

        def n(p):
            return None if counts is None else counts[p]
        sent = servers().start(self._ops(parts, lambda c, t, i, p: c.lookup_async(
            t, uniq[p], admit=admit, counts=n(p), sync_step=step)))

        def rows(replies):
            for (_, pos), r in zip(parts, replies):
                rows_u[pos] = r
            out = rows_u if inverse is None else rows_u[inverse]
            return out.reshape(keys.shape + (self.dim,))
        return sent.then(rows)

    def push_gradient(self, keys, grads) -> tuple[int, int]:
        """Apply row gradients ``grads[i]`` of ``keys[i]`` (duplicates summed
        here, each distinct key sent once); (rows updated, distinct keys
        whose gradient was dropped: they have no row). In a sync step the
        rows are updated once the step is complete: the counts are those of
        the steps this update completed on some shard (else 0)."""
        return self.push_gradient_async(keys, grads).result()

    def push_gradient_async(self, keys, grads, *, unique=None) -> "Pending":
        """push_gradient, sent now; ``result()`` waits for the servers (a step
        pushes its dense gradients meanwhile), resending a call that met a
        lost or failed-over server. Keys this thread last looked up in this
        table are not sorted again (``unique``: ignored, from older callers)."""
        keys = check_keys(keys).reshape(-1)
        grads = np.asarray(grads)
        if grads.shape != (keys.size, self.dim):
            raise ValueError(f"gradient for table {self.name!r} has shape {grads.shape}, "
                             f"expected {(keys.size, self.dim)}")
        uniq, inverse = _unique_of(self, keys)
        if inverse is not None:
            keys, grads = uniq, sum_rows(inverse, grads, uniq.size)
        parts = self._split(keys)
        sync = rows_sync()
        if sync is not None:   # every shard counts this replica (an empty update too)
            have = dict(parts)
            parts = [(i, have.get(i, np.zeros(0, np.int64))) for i in range(self.num_shards)]
        # An update key per shard: a resend after a failover or a lost
        # connection applies once, and a re-run of an exactly-once batch
        # (coordinator/sharded.py) sends the same. Sync updates are known by
        # step and replica instead (and go to both copies).
        uids = {i: calls.new_update_id(f"{TABLE_PREFIX}{self.name}#{i}") if sync is None else 0
                for i, _ in parts}
        sent = servers().start(self._ops(
            parts, lambda c, t, i, p: c.update_table_async(t, keys[p], grads[p],
                                                           update_id=uids[i], sync=sync),
            sync is not None))
        return sent.then(_summed_counts)

    def stats(self) -> TableStats:
        """Counters summed over the shards (rows, admissions, evictions, hits...),
        of the copies that are primary now."""
        pool = servers()
        infos = [pool.client(c.address).table_info(c.table) for c in self.primaries()]
        return TableStats(**{f.name: sum(getattr(i, f.name) for i in infos)
                             for f in dataclasses.fields(TableStats)})

    def __len__(self) -> int:
        return self.stats().rows


def _summed_counts(replies) -> tuple[int, int]:
    return sum(u for u, _ in replies), sum(d for _, d in replies)
