"""Sharded variables: one logical variable, its rows split over parameter servers.

A ``ShardedVariable`` is a small picklable description (name, shape, dtype,
where each shard lives). It travels inside step closures to the workers and
works the same there: every method talks to the parameter servers through
this process's connection pool. The caller never sees shards: ``read``
returns one array, ``push_gradient`` takes one gradient, and ``gather`` /
``push_sparse`` route each row id to the shard that owns it.

Reads and pushes of many variables at once (``read_variables``,
``push_gradients``) make one call per parameter server, issued concurrently:
a training step costs one round trip per server, not one per variable.

Calls ride out a parameter server that restarts: a read, gather or push
that fails with UNAVAILABLE, NOT_FOUND (a restarted server before the
coordinator restored it) or DEADLINE_EXCEEDED is sent again, for up to
``PSTRAIN_RETRY_SECONDS`` (default 120) seconds. Every push carries an
idempotency key (``update_id``), so a resent push is applied at most once:
random, or inside a step of an exactly-once sharded dataset derived from
its batch (coordinator/sharded.py), so a re-run of the batch sends the same.
With replication, a push goes to the shard's primary copy, which forwards it
to its backup and answers once the backup has it (psserver.replication); a
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
import functools
import threading
from collections import defaultdict
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from coordinator.calls import new_update_id
from coordinator.ps_pool import Op, servers
from coordinator.routes import key as routes_key
from coordinator.replica import current_sync, rows_sync
from psserver.contract import InvalidArgument
from psserver.link.transport import background
from psserver.rows import sum_duplicates, take_rows


# -- the variable ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shard:
    address: str   # the parameter server holding it
    name: str      # its variable name there
    offset: int    # first row (axis 0) of the logical variable it holds
    rows: int


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
        are summed here as a server would (psserver.optimizers.sum_duplicates:
        the same bits), so each shard gets sorted distinct ids. Made once per
        push: a push sent again after a route changed keeps its keys."""
        ids = _int64_ids(ids)
        rows = np.asarray(rows, dtype=self.dtype)
        if rows.shape != (ids.size,) + self.shape[1:]:
            raise ValueError(f"sparse gradient rows for {self.name!r} have shape {rows.shape}, "
                             f"expected {(ids.size,) + self.shape[1:]}")
        ids, rows = sum_duplicates(ids, rows, _known_order(self, ids))
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


def _int64_ids(ids) -> np.ndarray:
    """Row ids flattened, as int64; ValueError for any other kind than integers."""
    flat = np.asarray(ids).reshape(-1)
    if flat.dtype.kind not in "iu":
        raise ValueError(f"ids must be integers, got {flat.dtype.name}")
    return flat.astype(np.int64, copy=False)


def distinct(ids, remember_for: "ShardedVariable | None" = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct int64 ids, inverse: ids.reshape(-1) == uniq[inverse]),
    as np.unique gives them. ``remember_for``: the table looked up; the ids'
    stable sort order is kept (this thread's last look-up) for a row-wise
    gradient of the same ids pushed next (_sparse_split: one sort a step)."""
    flat = _int64_ids(ids)
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    first = np.empty(flat.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(flat.size, dtype=np.intp)
    inverse[order] = np.cumsum(first) - 1
    if remember_for is not None:
        _last_sort.of = (remember_for, flat.copy(), order)   # a copy: the caller's may change
    return ordered[first], inverse


#: A thread's last look-up: (table, its ids, their stable sort order).
_last_sort = threading.local()


def _known_order(variable: "ShardedVariable", ids: np.ndarray) -> np.ndarray | None:
    """The stable sort order of ``ids`` if this thread's last look-up of
    ``variable`` was of exactly these ids (else None: sort them)."""
    last = getattr(_last_sort, "of", None)
    if last is not None and last[0] is variable and last[1].shape == ids.shape \
            and np.array_equal(last[1], ids):
        return last[2]
    return None


#: Hybrid mode: the kind of gradient ("dense" or "row-wise") each variable
#: took in this process's hybrid steps, by (name, shards).
_hybrid_kinds: dict[tuple, str] = {}


def _check_hybrid_kinds(pairs: Iterable[tuple["ShardedVariable", str]]) -> None:
    """In a hybrid step: ValueError, before anything is sent, if a variable
    gets a kind of gradient other than the one it got before in this process
    (or in this call); then remember the kinds."""
    sync = current_sync()
    if sync is None or not sync.hybrid:
        return
    seen: dict[tuple, str] = {}
    for v, kind in pairs:
        key = (v.name, v.shards)
        before = seen.get(key) or _hybrid_kinds.get(key)
        if before is not None and before != kind:
            raise ValueError(
                f"{v.name!r} got a {kind} gradient in a hybrid-mode step after a {before} one. "
                'In mode="hybrid" a variable is dense (its gradients join the sync step) or '
                "an embedding table (row-wise gradients: IndexedSlices, push_sparse; applied "
                "on arrival), not both: give it one kind of gradient, or train in "
                'mode="sync". Nothing was pushed')
        seen[key] = kind
    _hybrid_kinds.update(seen)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """Rows of ``variable`` by id, to read with other variables in one call per
    server: ``read_variables([table.lookup(ids), w, b])`` (see
    ShardedVariable.lookup). Its value is ``table.gather(ids)``'s."""
    variable: "ShardedVariable"
    ids: np.ndarray


class IndexedSlices(NamedTuple):
    """A row-wise gradient, as tf.IndexedSlices: ``values[i]`` is the gradient
    of row ``indices[i]`` (duplicates are summed). Pass it to push_gradients
    as a variable's gradient to push it with the dense ones, in one call per
    server (as ``variable.push_sparse(indices, values)`` would, alone)."""
    values: np.ndarray
    indices: np.ndarray


def read_variables(variables: Sequence["ShardedVariable | Lookup"], *,
                   with_versions: bool = False, compression=None):
    """Read many variables: one call per parameter server, all at once.

    ``compression="fp16"`` (default None: values as they are): float32 and
    float64 values come rounded to float16 (clipped to +-65504) and are sent
    as float16 between hosts, half the bytes of float32; returned arrays keep
    the variables' dtypes. On the same host the values are rounded here, so
    every transport gives the same numbers. Dense variables only (a
    ``Lookup`` among them is ValueError). Like push_gradients' compression,
    a step function passes it explicitly::

        spec = strategy.read_compression_spec
        def step(it):
            params = read_variables(variables, compression=spec)

    An item may be a ``Lookup`` (``table.lookup(ids)``): its rows are gathered
    in the same call to each server as the dense reads (same host: one call;
    across hosts: a read and a gather per server).

    Returns the values, or (values, versions) with ``with_versions``, where
    versions[i] lists the version of each shard of variables[i] as read (for
    a Lookup: of each shard rows were gathered from).
    """
    value_dtype = read_value_dtype(compression)
    if value_dtype and any(isinstance(v, Lookup) for v in variables):
        raise ValueError("read compression applies to dense variables; read the lookups "
                         "in a read_variables call without compression")
    return _read_variables(variables, with_versions, value_dtype)


def read_value_dtype(compression) -> str:
    """ReadRequest.value_dtype for read_variables' ``compression``."""
    from coordinator.compression import FP16   # only when compression is used
    if compression is None:
        return ""
    if compression == "fp16" or isinstance(compression, FP16):
        return "float16"
    raise ValueError(f'read compression must be None or "fp16", got {compression!r}')


def _prepare_lookup(v: Lookup):
    """A Lookup's distinct ids (each asked for once), their positions, and
    the array their rows land in (each server's run received straight into
    it): (shape of ids, inverse, runs, rows)."""
    ids = np.asarray(v.ids)
    uniq, inverse = distinct(ids, v.variable)
    rows = np.empty((uniq.size,) + v.variable.shape[1:], np.dtype(v.variable.dtype))
    return ids.shape, inverse, v.variable._runs(uniq), rows


def _read_variables(variables, with_versions: bool, value_dtype: str = ""):
    sync = current_sync()
    step = sync.step if sync is not None else None
    pool = servers()
    routes = pool.routes
    targets = [v.variable if isinstance(v, Lookup) else v for v in variables]
    lookups = {i: _prepare_lookup(v) for i, v in enumerate(variables) if isinstance(v, Lookup)}
    # Without lookups each value lands in its final array (a slice of it per
    # shard): on this host that is the only copy, made straight from shared memory.
    full = None if lookups else [np.empty(v.shape, np.dtype(v.dtype)) for v in variables]
    planned = {}

    def plan() -> list[Op]:
        """One call per server on the current routes (a route asked once per shard)."""
        prim, by_addr = [], {}
        for i, v in enumerate(targets):
            if not v.backups:
                prim.append(v.shards)
                continue
            rs = [routes.route(v, k) for k in range(v.num_shards)]
            prim.append([routes.primary_of(v, k, r) for k, r in enumerate(rs)])
            for k, r in enumerate(rs):   # every shard a call of this read reaches
                entry = by_addr.setdefault(prim[i][k].address, [[], [], [], []])
                entry[2].append((routes_key(v.shards[k]), r))
                entry[3].append((v, k))
        for i, v in enumerate(targets):
            if i in lookups:
                for k, run, local in lookups[i][2]:
                    s = prim[i][k]
                    by_addr.setdefault(s.address, [[], [], [], []])[1].append((i, run, s, local))
            else:
                for s in prim[i]:
                    by_addr.setdefault(s.address, [[], [], [], []])[0].append((i, s))
        ops = []
        for addr, (dense, gathers, seen, pairs) in by_addr.items():
            if not (dense or gathers):
                continue
            names = [s.name for _, s in dense]
            if lookups:
                g = [(s.name, ids) for _, _, s, ids in gathers]
                o = [lookups[i][3][run] for i, run, _, _ in gathers]
                send = (lambda c, n=names, g=g, o=o: c.read_and_gather_async(
                    n, g, sync_step=step, rows_out=o))
            else:
                out = [_shard_view(full[i], s, variables[i]) for i, s in dense]
                send = (lambda c, n=names, o=out: c.read_many_async(
                    n, sync_step=step, out=o, value_dtype=value_dtype))
            ops.append(Op(addr, send, tuple(seen), tuple(pairs)))
        planned["plan"] = (prim, [by_addr[op.address] for op in ops])
        return ops
    results = pool.settle(plan)
    prim, entries = planned["plan"]
    parts: dict[tuple[int, str], np.ndarray] = {}
    versions: dict[int, dict[str, int]] = defaultdict(dict)
    for (dense, gathers, _, _), result in zip(entries, results):
        snaps, gathered = result if lookups else (result, ())
        for (i, s), snap in zip(dense, snaps):
            parts[(i, s.name)], versions[i][s.name] = snap.value, snap.version
        for (i, pos, s, _), (rows, version) in zip(gathers, gathered):
            rows_out = lookups[i][3]
            if not np.may_share_memory(rows, rows_out):   # (else received in place)
                want = rows_out[pos]
                if (rows.dtype, rows.shape) != (want.dtype, want.shape):
                    raise InvalidArgument(
                        f"parameter server {s.address} sent rows of {s.name!r} as "
                        f"{rows.dtype.name} {rows.shape}, not {want.dtype.name} {want.shape}")
                want[...] = rows
            versions[i][s.name] = version
    out = []
    for i, v in enumerate(variables):
        if full is not None:
            for s in prim[i]:   # a part the read did not write in place (the other paths)
                part = parts[(i, s.name)]
                if not np.may_share_memory(part, full[i]):
                    _shard_view(full[i], s, v)[...] = part
            out.append(full[i])
        elif i in lookups:
            shape, inverse, _, rows_out = lookups[i]
            out.append(take_rows(rows_out, inverse).reshape(shape + v.variable.shape[1:]))
        elif v.num_shards == 1:
            out.append(parts[(i, prim[i][0].name)].copy())
        else:
            out.append(np.concatenate([parts[(i, s.name)] for s in prim[i]]))
    if with_versions:
        return out, [[versions[i][s.name] for s in prim[i] if s.name in versions[i]]
                     for i in range(len(variables))]
    return out


def _shard_view(full: np.ndarray, s: "Shard", v: "ShardedVariable") -> np.ndarray:
    """The part of a variable's array that shard s holds (a view)."""
    return full if full.ndim == 0 or v.num_shards == 1 else full[s.offset:s.offset + s.rows]


def push_gradients(pairs: Iterable[tuple[ShardedVariable, object]], *,
                   compression=None) -> None:
    """Apply dense gradients to many variables: one call per parameter server.

    Each shard's update is atomic on its server; shards of one variable on
    different servers are updated independently (asynchronous training).

    ``compression`` (default None: gradients sent as they are) compresses
    them on the wire: "fp16", "bf16" or ``TopK(ratio)`` (see
    coordinator.compression). The strategy does not travel to the workers,
    so a step function passes it explicitly, capturing it like the variables::

        spec = strategy.gradient_compression_spec
        def step(it):
            ...
            push_gradients(zip(variables, grads), compression=spec)

    Compression applies to asynchronous pushes only: ValueError in a sync or
    hybrid step. In a hybrid step dense gradients join the step and
    ``IndexedSlices`` are applied on arrival (ValueError, nothing sent, for a
    variable that got the other kind before: see the module docstring).
    """
    sync, rows = current_sync(), rows_sync()
    if compression is not None:
        _push_compressed(pairs, compression, sync)
        return
    pairs = list(pairs)
    if sync is not None and sync.hybrid:
        _check_hybrid_kinds([(v, "row-wise" if isinstance(g, IndexedSlices) else "dense")
                             for v, g in pairs])
    # Split and keyed once: a push sent again after a route changed keeps its keys.
    dense, sparse = [], []   # (variable, shard index, part, key) / (variable, split parts)
    for v, g in pairs:
        if isinstance(g, IndexedSlices):
            sparse.append((v, v._sparse_split(g.indices, g.values, rows)))
            continue
        g = np.asarray(g, dtype=v.dtype)
        if g.shape != v.shape:
            raise ValueError(f"gradient for {v.name!r} has shape {g.shape}, expected {v.shape}")
        if len(v.shards) == 1:
            dense.append((v, 0, g, 0 if sync is not None else new_update_id(f"{v.name}#0")))
            continue
        for k, s in enumerate(v.shards):
            dense.append((v, k, g[s.offset:s.offset + s.rows],
                          0 if sync is not None else new_update_id(f"{v.name}#{k}")))
    pool = servers()
    pool.settle(functools.partial(_push_ops, pool.routes, dense, sparse, sync, rows))


def _push_ops(routes, dense: list, sparse: list, sync, row_sync) -> list[Op]:
    """push_gradients' calls on the current routes: one per server (dense and
    row-wise together), but sync-mode row-wise pushes one per shard (every
    shard must count the replica), and in hybrid mode (``sync`` for the dense
    ones, ``row_sync`` None) the row-wise ones apart, asynchronous. A route
    is asked once per shard (``routes``: the process's, coordinator/routes.py)."""
    by_addr: dict[str, list] = {}   # address -> [dense, sparse, seen routes, pairs]
    for v, k, part, uid in dense:
        if not v.backups:
            t = v.shards[k]
            by_addr.setdefault(t.address, [[], [], [], []])[0].append((t.name, part, uid))
            continue
        r = routes.route(v, k)
        for t in routes.targets_of(v, k, r, sync is not None):
            entry = by_addr.setdefault(t.address, [[], [], [], []])
            entry[0].append((t.name, part, uid))
            entry[2].append((routes_key(v.shards[k]), r))
            entry[3].append((v, k))
    ops = []
    for v, parts in sparse:
        if sync is not None:
            ops += v._sparse_ops(parts, row_sync)
            continue
        for k, ids, rows, uid in parts:
            r = routes.route(v, k)
            t = routes.primary_of(v, k, r)
            entry = by_addr.setdefault(t.address, [[], [], [], []])
            entry[1].append((t.name, ids, rows, uid))
            if v.backups:
                entry[2].append((routes_key(v.shards[k]), r))
                entry[3].append((v, k))
    for addr, (d, sp, seen, pairs) in by_addr.items():
        if sp:
            send = (lambda c, d=d, sp=sp: c.push_dense_and_sparse_async(d, sp))
        else:
            send = (lambda c, d=d: c.push_many_async(d, sync=sync))
        ops.append(Op(addr, send, tuple(seen), tuple(pairs)))
    return ops


def _push_compressed(pairs, compression, sync) -> None:
    """push_gradients with a compressor: dense pushes grouped per server as
    usual (fp16/bf16 parts, or top-k's 1-D variables), plus one sparse push
    per shard for top-k; all started at once, each with its own idempotency
    key. Compressed once (top-k's error feedback changes with every call),
    then sent on the current routes."""
    from coordinator import compression as C   # only when compression is used
    spec = C.resolve(compression)
    if spec is None:
        return push_gradients(pairs)
    if sync is not None:
        raise ValueError("gradient compression applies to asynchronous pushes only, "
                         "not to a sync- or hybrid-mode step")
    dense, sparse = [], []   # (variable, k, part, key) / (variable, k, ids, rows, key)
    for v, g in pairs:
        if isinstance(g, IndexedSlices):   # row-wise gradients go as they are
            sparse += [(v, k, i, r, uid) for k, i, r, uid in v._sparse_split(g.indices, g.values)]
            continue
        g = v._check_dense(g, "gradient")
        if isinstance(spec, C.TopK) and g.ndim >= 2:
            acc, picks = C.residuals.compensate_and_select(
                v.name, g, [(s.offset, s.rows) for s in v.shards], spec)
            sparse += [(v, k, ids, acc[s.offset + ids], new_update_id(v._key_label(k)))
                       for k, (s, ids) in enumerate(zip(v.shards, picks))]
            continue
        if isinstance(spec, C.FP16):
            g = C.to_fp16(g)
        elif isinstance(spec, C.BF16):
            g = C.to_bf16(g)
            if v.dtype != "float32":   # the server wants its own dtype (or float16)
                g = g.astype(v.dtype)
        dense += [(v, k, part, new_update_id(v._key_label(k)))
                  for k, part in enumerate(v._split(g))]

    pool = servers()
    pool.settle(functools.partial(_push_ops, pool.routes, dense, [
        (v, [(k, ids, rows, uid)]) for v, k, ids, rows, uid in sparse], None, None))
