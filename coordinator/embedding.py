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

Not yet: checkpoints and replication of dynamic tables, sync mode (their
updates apply on arrival, as in async mode), and resending a call after a
server restarts (a restarted server has lost its shards: recreate the
table).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from coordinator.calls import client_for
from psserver.dynamic_table import check_keys, shard_of


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
        ``admit=False`` (evaluation): no key is counted, admitted or evicted."""
        keys = check_keys(keys)
        flat = keys.reshape(-1)
        out = np.empty((flat.size, self.dim), np.dtype(self.dtype))
        parts = self._split(flat)
        handles = [client_for(self.addresses[i]).lookup_async(self.name, flat[pos], admit=admit)
                   for i, pos in parts]
        for (_, pos), h in zip(parts, handles):
            out[pos] = h.result()
        return out.reshape(keys.shape + (self.dim,))

    def push_gradient(self, keys, grads) -> tuple[int, int]:
        """Apply row gradients ``grads[i]`` of ``keys[i]`` (duplicates summed
        on the servers); (rows updated, gradient rows dropped: keys without
        a row)."""
        keys = check_keys(keys).reshape(-1)
        grads = np.asarray(grads)
        if grads.shape != (keys.size, self.dim):
            raise ValueError(f"gradient for table {self.name!r} has shape {grads.shape}, "
                             f"expected {(keys.size, self.dim)}")
        parts = self._split(keys)
        handles = [client_for(self.addresses[i]).update_table_async(self.name, keys[pos],
                                                                    grads[pos])
                   for i, pos in parts]
        done = [h.result() for h in handles]
        return sum(u for u, _ in done), sum(d for _, d in done)

    def stats(self) -> TableStats:
        """Counters summed over the shards (rows, admissions, evictions, hits...)."""
        infos = [client_for(a).table_info(self.name) for a in self.addresses]
        return TableStats(**{f.name: sum(getattr(i, f.name) for i in infos)
                             for f in dataclasses.fields(TableStats)})

    def __len__(self) -> int:
        return self.stats().rows
