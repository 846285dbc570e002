"""Sharded variables: one logical variable, its rows split over parameter servers.

A ``ShardedVariable`` is a small picklable description (name, shape, dtype,
where each shard lives). It travels inside step closures to the workers and
works the same there: every method talks to the parameter servers through
this process's connection pool. The caller never sees shards: ``read``
returns one array, ``push_gradient`` takes one gradient, and ``gather`` /
``push_sparse`` route each row id to the shard that owns it.

Reads and pushes of many variables at once (``read_variables``,
``push_gradients``, coordinator/step_calls.py) make one call per parameter
server, issued concurrently: a training step costs one round trip per
server, not one per variable.

Calls ride out a parameter server that restarts: a read, gather or push
that fails with UNAVAILABLE, NOT_FOUND (a restarted server before the
coordinator restored it) or DEADLINE_EXCEEDED is sent again, for up to
``PSTRAIN_RETRY_SECONDS`` (default 120) seconds. Every push carries an
idempotency key (``update_id``), so a resent push is applied at most once:
random, or inside a step of an exactly-once sharded dataset derived from
its batch (coordinator/sharded.py), so a re-run of the batch sends the same.
With replication, a push goes to the shard's primary copy, which forwards it
to its backup and answers once the backup has it (psserver.core.replication); a
call refused by a copy that is not primary (NotPrimary), or that cannot
reach its server, is sent where the primary is now (coordinator.routes), with
the same key.

In sync mode (inside a replica of a sync step, see coordinator.replica)
reads wait for the previous step to be applied, and pushes join the step's
gradients on the servers instead of being applied one by one. A sync sparse
push reaches every shard (an empty push counts as this replica's share).

In hybrid mode dense gradients join the step as in sync mode, and row-wise
ones (``IndexedSlices``, ``push_sparse``) are applied on arrival with
update keys, as in async mode. A variable is one or the other: a worker
process refuses (ValueError, nothing sent) a gradient of the other kind
for a variable it pushed before in a hybrid step. Only per process: two
workers giving one variable different kinds are not caught (its dense
pushes then wait for the others' until step_timeout: see
ParameterServerStrategy's mode "hybrid"). Reads and look-ups carry
the step: a server waits only on a variable that is gathering an earlier
step, which a table (no dense gradients) never is.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from coordinator import placement
from coordinator.calls import new_update_id
from coordinator.key_order import distinct, int64_ids, known_order
from coordinator.ps_pool import Op, servers
from coordinator.replica import current_sync, rows_sync
from coordinator.routes import key as routes_key
from coordinator.step_calls import (
    Lookup,
    _check_hybrid_kinds,
    push_gradients,
    read_variables,
)
from psserver.contract.rows import sum_duplicates, take_rows
from psserver.link.transport import background


# -- the variable ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shard:
    made_at: str   # the parameter server it was made on
    name: str      # its variable name there
    offset: int    # first row (axis 0) of the logical variable it holds
    rows: int

    @property
    def address(self) -> str:
        """The parameter server holding it now: where it was made, unless a
        drain moved it (coordinator/placement.py)."""
        return placement.MOVED.get((self.made_at, self.name), self.made_at) \
            if placement.MOVED else self.made_at


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedVariable:
    """A variable split along axis 0 into ``shards`` (one shard: not split)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    shards: tuple[Shard, ...]
    optimizer: str = "sgd"
    #: With replication: shard i's backup, on another parameter server.
    backups: tuple[Shard, ...] = ()

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def offsets(self) -> np.ndarray:
        """Row offsets: shard i holds rows offsets[i]:offsets[i+1]."""
        return np.array([s.offset for s in self.shards] + [self.shards[-1].offset + self.shards[-1].rows])

    def __repr__(self) -> str:
        return (f"ShardedVariable({self.name!r}, shape={self.shape}, dtype={self.dtype}, "
                f"shards={self.num_shards})")

    # -- dense -------------------------------------------------------------------
    def read(self) -> np.ndarray:
        """The whole value (a new array), assembled from consistent shard reads."""
        return read_variables([self])[0]

    def meta(self) -> list:
        """Each shard's VariableMeta (version, sync_steps, dropped_gradients...)."""
        pool = servers()
        return [pool.client(s.address).get_meta(s.name) for s in pool.routes.primaries(self)]

    def versions(self) -> list[int]:
        """Each shard's version (the number of updates it has applied)."""
        return [m.version for m in self.meta()]

    def push_gradient(self, grad) -> None:
        """Apply a dense gradient (split by rows; one push per shard)."""
        push_gradients([(self, grad)])

    def assign(self, value) -> None:
        """Overwrite the value (optimizer slots are kept), backups included
        (each primary forwards it to its backup)."""
        value = self._check_dense(value, "assigned value")
        parts = self._split(value)
        pool = servers()

        def plan():
            ops = []
            for k, p in enumerate(parts):
                r = pool.routes.route(self, k)
                t = pool.routes.primary_of(self, k, r)
                ops.append(Op(t.address, lambda c, t=t, p=p: background(c.assign_many, [(t.name, p)]),
                              *self._seen(k, r)))
            return ops
        pool.settle(plan)

    def _check_dense(self, arr, what: str) -> np.ndarray:
        arr = np.asarray(arr, dtype=self.dtype)
        if arr.shape != self.shape:
            raise ValueError(f"{what} for {self.name!r} has shape {arr.shape}, expected {self.shape}")
        return arr

    def _split(self, arr: np.ndarray) -> list[np.ndarray]:
        if arr.ndim == 0:
            return [arr]
        return [arr[s.offset:s.offset + s.rows] for s in self.shards]

    # -- sparse (rows by id) ---------------------------------------------------------
    def _runs(self, ids: np.ndarray) -> list[tuple[int, slice, np.ndarray]]:
        """(shard index, its run of ``ids``, those ids local to the shard) per
        shard with ids, for sorted ``ids`` (each shard's ids are one run: shards
        hold consecutive rows; int64, as distinct and sum_duplicates give them).
        Raises ValueError for ids out of range."""
        if not self.shape:
            raise ValueError(f"variable {self.name!r} is a scalar: it has no rows")
        if ids.size and (ids[0] < 0 or ids[-1] >= self.shape[0]):
            raise ValueError(f"ids out of range for {self.name!r} with {self.shape[0]} rows")
        bounds = np.searchsorted(ids, self.offsets)
        return [(k, slice(lo, hi), ids[lo:hi] - self.offsets[k])
                for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])) if hi > lo]

    def gather(self, ids) -> np.ndarray:
        """Rows ``value[ids]``: shape ids.shape + row shape, in the order of ids.
        Each distinct id is asked for once."""
        ids = np.asarray(ids)
        uniq, inverse = distinct(ids)
        runs = self._runs(uniq)
        out = np.empty((uniq.size,) + self.shape[1:], np.dtype(self.dtype))
        sync = current_sync()
        step = sync.step if sync is not None else None
        pool = servers()

        def plan():
            ops = []
            for k, _, local in runs:
                r = pool.routes.route(self, k)
                s = pool.routes.primary_of(self, k, r)
                ops.append(Op(s.address, lambda c, s=s, ids=local: c.gather_async(
                    s.name, ids, sync_step=step), *self._seen(k, r)))
            return ops
        for (_, run, _), (rows, _) in zip(runs, pool.settle(plan)):
            out[run] = rows
        return take_rows(out, inverse).reshape(ids.shape + self.shape[1:])

    def _seen(self, k: int, r) -> tuple[tuple, tuple]:
        """An Op's (routes, pairs) for shard k planned on route r: what
        makes settle plan it again when r changes (replicated shards only)."""
        if not self.backups:
            return (), ()
        return ((routes_key(self.shards[k]), r),), ((self, k),)

    def lookup(self, ids) -> "Lookup":
        """A request for ``gather(ids)``'s rows, to pass to read_variables with
        other variables: one call per server for all of them."""
        return Lookup(self, np.asarray(ids))

    def push_sparse(self, ids, rows) -> None:
        """Apply a row-wise gradient; duplicate ids are summed (here, before
        sending: each distinct id's row crosses the wire once). In a sync step
        it joins the step; in a hybrid step it is applied on arrival
        (ValueError if this variable took dense gradients in a hybrid step of
        this process)."""
        _check_hybrid_kinds([(self, "row-wise")])
        sync = rows_sync()
        parts = self._sparse_split(ids, rows, sync)
        servers().settle(lambda: self._sparse_ops(parts, sync))

    def _sparse_split(self, ids, rows, sync=None) -> list[tuple[int, np.ndarray, np.ndarray, int]]:
        """(shard index, local ids, rows, update_id) per shard with ids (every
        shard in sync mode: an empty push counts the replica). Duplicate ids
        are summed here as a server would (psserver.contract.optimizers.sum_duplicates:
        the same bits), so each shard gets sorted distinct ids. Made once per
        push: a push sent again after a route changed keeps its keys."""
        ids = int64_ids(ids)
        rows = np.asarray(rows, dtype=self.dtype)
        if rows.shape != (ids.size,) + self.shape[1:]:
            raise ValueError(f"sparse gradient rows for {self.name!r} have shape {rows.shape}, "
                             f"expected {(ids.size,) + self.shape[1:]}")
        ids, rows = sum_duplicates(ids, rows, known_order(self, ids))
        runs = {k: (run, local) for k, run, local in self._runs(ids)}
        out = []
        for k in range(self.num_shards):
            if k in runs or sync is not None:   # sync: every shard counts this replica
                run, local = runs.get(k, (slice(0, 0), ids[:0]))
                out.append((k, local, rows[run],
                            0 if sync is not None else new_update_id(self._key_label(k))))
        return out

    def _key_label(self, k: int) -> str:
        """What an update key of shard k is for (calls.new_update_id): the
        logical shard, whichever copy takes it."""
        return f"{self.name}#{k}"

    def _sparse_ops(self, parts, sync) -> list[Op]:
        """One call per target copy of each of _sparse_split's parts (a
        primary; in sync mode both copies: coordinator.routes)."""
        routes = servers().routes
        ops = []
        for k, i, rows, uid in parts:
            r = routes.route(self, k)
            for t in routes.targets_of(self, k, r, sync is not None):
                ops.append(Op(t.address, lambda c, t=t, i=i, rows=rows, uid=uid: c.push_sparse_async(
                    t.name, i, rows, sync=sync, update_id=uid), *self._seen(k, r)))
        return ops
