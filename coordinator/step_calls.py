"""A step's reads and pushes: ``read_variables``, ``push_gradients``.

One call per parameter server each way, whatever the step holds: dense
variables, rows of fixed tables by id (``Lookup`` of a ShardedVariable,
``IndexedSlices`` gradients) and dynamic embedding tables (``Lookup`` of a
DynamicEmbedding, ``IndexedSlices`` with keys as indices): a read's values,
row look-ups and table look-ups ride one ParameterServerBulk.Read (or the
server's shared memory and one socket frame on its host), a push's dense,
row-wise and table gradients one Push. Each distinct id or key crosses the
wire once; row gradients are summed here, as the server sums duplicates.

Calls go through this process's ParameterServers (coordinator/ps_pool.py):
sent to every server at once, resent on UNAVAILABLE / NOT_FOUND /
DEADLINE_EXCEEDED with the same update keys for up to
``PSTRAIN_RETRY_SECONDS``, and to a replicated shard's primary where it is
now after a failover. Variables and tables alike: every push part carries
an update key (random, or inside an exactly-once batch's step derived from
it: coordinator/sharded.py), so a resent update applies once.

Modes (coordinator.replica): in a sync step reads wait for the previous
step, dense pushes join the step on the servers, and every shard of a fixed
or dynamic table gets this replica's row-wise update (an empty one too),
both copies where replicated. In a hybrid step dense gradients join the
step and row-wise ones (fixed and dynamic tables) are applied on arrival
with update keys, as in async mode (a variable is one or the other:
``_check_hybrid_kinds``).
"""
from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from coordinator import layouts, mirrored
from coordinator.calls import keys_from_batch, new_update_id
from coordinator.key_order import (
    _KEPT,
    _last,
    by_shard,
    by_shard_of,
    distinct,
    last_lookup,
    shard_order,
)
from coordinator.mirrored import MirroredVariable
from coordinator.ps_pool import Op, servers
from coordinator.replica import current_sync, rows_sync
from coordinator.routes import key as routes_key
from psserver.client.results import TableGradient, TableLookup
from psserver.contract.keys import BucketMap, check_keys
from psserver.contract.rows import sum_rows, take_rows
from psserver.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class Lookup:
    """Rows of ``variable`` by id, to read with other variables in one call
    per server: ``read_variables([table.lookup(ids), w, b])`` (a
    ShardedVariable's rows, as ``gather(ids)`` gives them), or
    ``read_variables([Lookup(embedding, keys), w])`` (a DynamicEmbedding's
    rows, as ``lookup(keys)`` gives them; ``admit=False``: nothing counted,
    created or evicted)."""
    variable: object
    ids: np.ndarray
    admit: bool = True


class IndexedSlices(NamedTuple):
    """A row-wise gradient, as tf.IndexedSlices: ``values[i]`` is the gradient
    of row ``indices[i]`` (duplicates are summed). Pass it to push_gradients
    as a variable's gradient to push it with the dense ones, in one call per
    server (as ``variable.push_sparse(indices, values)`` would, alone); for
    a DynamicEmbedding, indices are keys (``push_gradient(keys, grads)``)."""
    values: np.ndarray
    indices: np.ndarray


def _is_table(v) -> bool:
    return getattr(v, "is_table", False)


#: Hybrid mode: the kind of gradient ("dense" or "row-wise") each variable
#: took in this process's hybrid steps, by (name, shards).
_hybrid_kinds: dict[tuple, str] = {}


def _check_hybrid_kinds(pairs: Iterable[tuple[object, str]]) -> None:
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


def _entry(by_addr: dict, address: str) -> list:
    """One server's part of a step's call: [dense, rows, tables, seen routes,
    pairs, dynamic tables (whose layout a refusal asks for: coordinator/layouts.py)]."""
    e = by_addr.get(address)
    if e is None:
        e = by_addr[address] = [[], [], [], [], [], []]
    return e


def _note_table(e: list, table, epoch: int) -> None:
    """The (table, layout epoch) an entry was planned on (unreplicated tables)."""
    if not table.backups and all(t is not table for t, _ in e[5]):
        e[5].append((table, epoch))


def _copies(routes, v, k: int, entry_of, sync: bool) -> list:
    """The copies shard k of v goes to now (its primary; with ``sync`` both
    copies of a replicated shard), each with its server's entry, the shard's
    route noted there (a changed route plans the step again)."""
    shard = v.shards[k]   # (a table's are made on each access: once here)
    if not v.backups:
        return [(shard, entry_of(shard.address))]
    r = routes.route(v, k)
    out = []
    for t in routes.targets_of(v, k, r, sync):
        e = entry_of(t.address)
        e[3].append((routes_key(shard), r))
        e[4].append((v, k))
        out.append((t, e))
    return out


# -- reads ---------------------------------------------------------------------------------
def read_variables(variables: Sequence, *, with_versions: bool = False, compression=None):
    """Read many variables: one call per parameter server, all at once.

    An item may be a ``Lookup``: a fixed table's rows by id
    (``table.lookup(ids)``) or a dynamic table's by key (``Lookup(table,
    keys)``), looked up in the same call to each server as the dense reads.

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

    Returns the values, or (values, versions) with ``with_versions``, where
    versions[i] lists the version of each shard of variables[i] as read (for
    a Lookup of a fixed table: of each shard rows were gathered from; of a
    dynamic table: none).
    """
    if any(isinstance(v, MirroredVariable) for v in variables):   # all-reduce mode's
        return mirrored.read_among(variables, with_versions,
                                   functools.partial(read_variables, compression=compression))
    value_dtype = read_value_dtype(compression)
    # an EmbeddingCollection's look-up is its group tables' (coordinator/embedding_collection.py)
    flat = [p for v in variables for p in getattr(v, "parts", (v,))]
    if value_dtype and any(isinstance(v, Lookup) for v in flat):
        raise ValueError("read compression applies to dense variables; read the lookups "
                         "in a read_variables call without compression")
    read = _Read(flat, value_dtype)
    got = read.finish(servers().settle(read.plan), with_versions)
    if not any(hasattr(v, "parts") for v in variables):
        return got
    values, versions = got if with_versions else (got, None)
    out, seen, at = [], [], 0
    for v in variables:
        parts = getattr(v, "parts", None)
        out.append(values[at] if parts is None else v.fold(values[at:at + len(parts)]))
        seen.append(versions[at] if parts is None and versions is not None else [])
        at += 1 if parts is None else len(parts)
    return (out, seen) if with_versions else out


def read_value_dtype(compression) -> str:
    """ReadRequest.value_dtype for read_variables' ``compression``."""
    if compression is None:
        return ""
    from coordinator.compression import FP16  # only when compression is used
    if compression == "fp16" or isinstance(compression, FP16):
        return "float16"
    raise ValueError(f'read compression must be None or "fp16", got {compression!r}')


def _unreadable(item) -> str:
    """What read_variables says of an item it cannot read."""
    if _is_table(item):
        return (f"dynamic table {item.name!r} is read by key: pass Lookup(table, keys) to "
                "read its rows in this call")
    what = ("a numpy array (a dynamic table's lookup(keys) reads at once and gives the "
            "rows: pass Lookup(table, keys) to read them in this call)"
            if isinstance(item, np.ndarray) else type(item).__name__)
    return f"read_variables takes variables and Lookup(...) items, got {what}"


class _Read:
    """One read_variables: its items prepared once (ids sorted, arrays made),
    ``plan`` (the calls on the current routes; called again when a route
    moved) and ``finish`` (the values from the calls' results)."""

    def __init__(self, items: Sequence, value_dtype: str = ""):
        sync, rows = current_sync(), rows_sync()
        self.step = sync.step if sync is not None else None
        self.table_step = rows.step if rows is not None else None   # (hybrid: none)
        self.items, self.value_dtype = list(items), value_dtype
        self.lookups: dict[int, tuple] = {}   # item -> (ids shape, inverse, parts, rows)
        for i, v in enumerate(self.items):
            if isinstance(v, Lookup):
                self.lookups[i] = self._prepare(v)
            elif _is_table(v) or not hasattr(v, "num_shards"):
                raise TypeError(_unreadable(v))
        # Without lookups each value lands in its final array (a slice of it
        # per shard): on this host the only copy, made straight from shared memory.
        self.full = None if self.lookups else [np.empty(v.shape, np.dtype(v.dtype))
                                               for v in self.items]
        self.planned = None

    @staticmethod
    def _prepare(v: Lookup) -> tuple:
        """(ids shape, inverse, parts, rows): the distinct ids (each asked for
        once), each server's part of them, and the array their rows land in
        (each server's run received straight into it)."""
        t = v.variable
        if not _is_table(t):
            ids = np.asarray(v.ids)
            uniq, inverse = distinct(ids, t)
            rows = np.empty((uniq.size,) + t.shape[1:], np.dtype(t.dtype))
            return ids.shape, inverse, t._runs(uniq), rows
        keys = check_keys(v.ids)
        flat = keys.reshape(-1)
        now = layouts.snapshot(t)   # (the layout the whole read is planned on)
        sorted_keys, where, runs, counts = shard_order(now, flat, with_counts=v.admit)
        # The push of this step's row gradients sums them in this order (_table_parts).
        kept = _last.__dict__.setdefault("keys", {})
        kept.pop(t.name, None)
        kept[t.name] = (t, now.layout_epoch, flat.copy(), sorted_keys, where, runs)
        if len(kept) > _KEPT:
            del kept[next(iter(kept))]
        rows = np.empty((sorted_keys.size, t.dim), np.dtype(t.dtype))
        parts = [(i, slice(lo, hi), sorted_keys[lo:hi],
                  None if counts is None else counts[lo:hi]) for i, lo, hi in runs]
        return keys.shape, where, parts, rows, now

    def plan(self) -> list[Op]:
        """One call per server on the current routes (a route asked once per shard)."""
        routes = servers().routes
        by_addr: dict[str, list] = {}
        entry_of = functools.partial(_entry, by_addr)
        prim = []   # each item's copies read, per shard
        for i, v in enumerate(self.items):
            if i in self.lookups and _is_table(v.variable):   # split by the layout known now
                layouts.current(v.variable)
                if self.lookups[i][4].layout_epoch != v.variable.layout_epoch:
                    self.lookups[i] = self._prepare(v)
            if i in self.lookups:
                parts = self.lookups[i][2]
                t = self.lookups[i][4] if _is_table(v.variable) else v.variable
                copies = []
                prim.append(copies)
                for part in parts:
                    k = part[0]
                    (copy, e), = _copies(routes, t, k, entry_of, False)
                    copies.append(copy)
                    if _is_table(t):   # (i, rows' slice, keys, counts) -> a TableLookup
                        _note_table(e, v.variable, t.layout_epoch)
                        _, run, keys, counts = part
                        e[2].append((i, run, TableLookup(
                            copy.table, keys, counts, v.admit, sync_step=self.table_step,
                            row_bytes=t.row_bytes)))
                    else:
                        _, run, local = part
                        e[1].append((i, run, copy, local))
                continue
            copies = []
            for k in range(v.num_shards):
                (copy, e), = _copies(routes, v, k, entry_of, False)
                e[0].append((i, copy))
                copies.append(copy)
            prim.append(copies)
        ops = []
        for addr, e in by_addr.items():
            ops.append(Op(addr, self._send(e), tuple(e[3]), tuple(e[4]), tuple(e[5])))
        self.planned = (prim, [by_addr[op.address] for op in ops])
        return ops

    def _send(self, e: list):
        dense, gathers, tables = e[0], e[1], e[2]
        names = [s.name for _, s in dense]
        step = self.step
        if self.full is not None:
            out = [_shard_view(self.full[i], s, self.items[i]) for i, s in dense]
            value_dtype = self.value_dtype
            return lambda c: c.read_many_async(names, sync_step=step, out=out,
                                               value_dtype=value_dtype)
        g = [(s.name, ids) for _, _, s, ids in gathers]
        rows_out = [self.lookups[i][3][run] for i, run, _, _ in gathers]
        t = [lookup for _, _, lookup in tables]
        t_out = [self.lookups[i][3][run] for i, run, _ in tables]
        return lambda c: c.read_all_async(names, g, t, sync_step=step, rows_out=rows_out,
                                          tables_out=t_out)

    def finish(self, results: list, with_versions: bool = False):
        prim, entries = self.planned
        parts: dict[tuple[int, str], np.ndarray] = {}
        versions: dict[int, dict[str, int]] = defaultdict(dict)
        for (dense, gathers, tables, *_), result in zip(entries, results):
            snaps, gathered, table_rows = (result, (), ()) if self.full is not None else result
            for (i, s), snap in zip(dense, snaps):
                parts[(i, s.name)], versions[i][s.name] = snap.value, snap.version
            for (i, run, s, _), (rows, version) in zip(gathers, gathered):
                _land(self.lookups[i][3], run, rows, s.name, s.address)
                versions[i][s.name] = version
            for (i, run, lookup), rows in zip(tables, table_rows):
                _land(self.lookups[i][3], run, rows, lookup.name, "a parameter server")
        out = []
        for i, v in enumerate(self.items):
            if self.full is not None:
                for s in prim[i]:   # a part the read did not write in place (the other paths)
                    part = parts[(i, s.name)]
                    if not np.may_share_memory(part, self.full[i]):
                        _shard_view(self.full[i], s, v)[...] = part
                out.append(self.full[i])
            elif i in self.lookups:
                shape, inverse, _, rows = self.lookups[i][:4]
                out.append(take_rows(rows, inverse).reshape(shape + rows.shape[1:]))
            elif v.num_shards == 1:
                out.append(parts[(i, prim[i][0].name)].copy())
            else:
                out.append(np.concatenate([parts[(i, s.name)] for s in prim[i]]))
        if not with_versions:
            return out
        return out, [[versions[i][s.name] for s in prim[i] if s.name in versions[i]]
                     for i in range(len(self.items))]


def _land(rows_out: np.ndarray, run, rows: np.ndarray, name: str, where: str) -> None:
    """Rows of a look-up's part into its place (unless received there)."""
    if np.may_share_memory(rows, rows_out):
        return
    want = rows_out[run]
    if (rows.dtype, rows.shape) != (want.dtype, want.shape):
        raise InvalidArgument(f"parameter server {where} sent rows of {name!r} as "
                              f"{rows.dtype.name} {rows.shape}, not {want.dtype.name} "
                              f"{want.shape}")
    want[...] = rows


def _shard_view(full: np.ndarray, s, v) -> np.ndarray:
    """The part of a variable's array that shard s holds (a view)."""
    return full if full.ndim == 0 or v.num_shards == 1 else full[s.offset:s.offset + s.rows]


# -- pushes --------------------------------------------------------------------------------
def push_gradients(pairs: Iterable[tuple[object, object]], *, compression=None) -> None:
    """Apply dense gradients to many variables: one call per parameter server.

    Each shard's update is atomic on its server; shards of one variable on
    different servers are updated independently (asynchronous training). A
    gradient may be ``IndexedSlices``: a fixed table's row gradients, or a
    dynamic table's by key (for a DynamicEmbedding), pushed in the same call
    to each server as the dense ones.

    ``compression`` (default None: gradients sent as they are) compresses
    them on the wire: "fp16", "bf16" or ``TopK(ratio)`` (see
    coordinator.compression). The strategy does not travel to the workers,
    so a step function passes it explicitly, capturing it like the variables::

        spec = strategy.gradient_compression_spec
        def step(it):
            ...
            push_gradients(zip(variables, grads), compression=spec)

    Compression applies to asynchronous pushes of fixed variables only:
    ValueError in a sync or hybrid step. In a hybrid step dense gradients
    join the step and ``IndexedSlices`` are applied on arrival (ValueError,
    nothing sent, for a variable that got the other kind before).
    """
    mine, pairs = mirrored.split(pairs)   # all-reduce mode's: which goes first, its docstring
    if mine and not keys_from_batch():
        mirrored.push(mine)
    if pairs or not mine:
        push = _Push([q for v, g in pairs   # a collection's: its group tables' (expand_push)
                      for q in (v.expand_push(g) if hasattr(v, "expand_push") else ((v, g),))],
                     compression)
        pool = servers()
        pool.settle(functools.partial(push.plan, pool.routes))
    if mine and keys_from_batch():
        mirrored.push(mine)


class _Push:
    """One push_gradients: split and keyed once (a push sent again after a
    route changed keeps its keys), ``plan`` (the calls on the current routes)
    and the table updates' counts from the calls' results (``table_counts``)."""

    def __init__(self, pairs, compression=None):
        sync, rows = current_sync(), rows_sync()
        self.sync, self.row_sync = sync, rows
        # (variable, shard index, part, key) / (variable, split parts) / (table, parts)
        self.dense, self.sparse, self.tables = [], [], []
        if compression is not None:
            self._compressed(pairs, compression)
            return
        pairs = list(pairs)
        if sync is not None and sync.hybrid:
            _check_hybrid_kinds([(v, "row-wise" if isinstance(g, IndexedSlices) else "dense")
                                 for v, g in pairs])
        dense = self.dense
        for v, g in pairs:
            if _is_table(v):
                self.tables.append((v, *_table_parts(v, g, rows)))
            elif isinstance(g, IndexedSlices):
                self.sparse.append((v, v._sparse_split(g.indices, g.values, rows)))
            else:
                g = np.asarray(g, dtype=v.dtype)
                if g.shape != v.shape:
                    raise ValueError(f"gradient for {v.name!r} has shape {g.shape}, expected "
                                     f"{v.shape}")
                if len(v.shards) == 1:
                    dense.append((v, 0, g, 0 if sync is not None else
                                  new_update_id(f"{v.name}#0")))
                    continue
                for k, s in enumerate(v.shards):
                    dense.append((v, k, g[s.offset:s.offset + s.rows],
                                  0 if sync is not None else new_update_id(f"{v.name}#{k}")))

    def plan(self, routes) -> list[Op]:
        """The calls on the current routes: one per server (dense, row-wise and
        table gradients together), but sync-mode row-wise pushes of fixed
        tables one per shard (every shard must count the replica), and in
        hybrid mode (``sync`` for the dense ones, ``row_sync`` None) the
        row-wise ones applied on arrival. A route is asked once per shard."""
        sync, row_sync = self.sync, self.row_sync
        by_addr: dict[str, list] = {}
        entry_of = functools.partial(_entry, by_addr)
        for v, k, part, uid in self.dense:
            for t, e in _copies(routes, v, k, entry_of, sync is not None):
                e[0].append((t.name, part, uid))
        ops = []
        for v, parts in self.sparse:
            if sync is not None:   # (a push with sync takes no row-wise part of a fixed table)
                ops += v._sparse_ops(parts, row_sync)
                continue
            for k, ids, rows, uid in parts:
                (t, e), = _copies(routes, v, k, entry_of, False)
                e[1].append((t.name, ids, rows, uid))
        for n, (table, parts, now) in enumerate(self.tables):
            layouts.current(table)
            if now.layout_epoch != table.layout_epoch:   # buckets moved since: split anew
                now = layouts.snapshot(table)
                parts = _split_again(now, parts)
                self.tables[n] = (table, parts, now)
            for k, keys, grads, uid in parts:
                for t, e in _copies(routes, now, k, entry_of, row_sync is not None):
                    _note_table(e, table, now.layout_epoch)
                    e[2].append(TableGradient(t.table, keys, grads, uid, row_sync))
        for addr, (d, sp, tables, seen, pairs, relaid) in by_addr.items():
            if tables:
                send = (lambda c, d=d, sp=sp, tables=tables: c.push_all_async(
                    d, sp, tables, sync=sync))
            elif sp:
                send = (lambda c, d=d, sp=sp: c.push_dense_and_sparse_async(d, sp))
            else:
                send = (lambda c, d=d: c.push_many_async(d, sync=sync))
            ops.append(Op(addr, send, tuple(seen), tuple(pairs), tuple(relaid)))
        return ops

    @staticmethod
    def table_counts(results: list) -> tuple[int, int]:
        """(rows updated, gradient rows dropped) of the table updates, summed."""
        updated = dropped = 0
        for r in results:
            if isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], list):
                for u, d, _, _ in r[1]:
                    updated, dropped = updated + u, dropped + d
        return updated, dropped

    def _compressed(self, pairs, compression) -> None:
        """Compressed once (top-k's error feedback changes with every call):
        dense parts fp16/bf16, or top-k's chosen rows (row-wise updates of
        their own, each keyed)."""
        from coordinator import compression as C  # only when compression is used
        spec = C.resolve(compression)
        if spec is None:
            self.__init__(pairs)
            return
        if self.sync is not None:
            raise ValueError("gradient compression applies to asynchronous pushes only, "
                             "not to a sync- or hybrid-mode step")
        for v, g in pairs:
            if _is_table(v):
                raise ValueError(f"gradient compression applies to variables, not to the "
                                 f"dynamic table {v.name!r}: push its gradient without")
            if isinstance(g, IndexedSlices):   # row-wise gradients go as they are
                self.sparse.append((v, v._sparse_split(g.indices, g.values)))
                continue
            g = v._check_dense(g, "gradient")
            if isinstance(spec, C.TopK) and g.ndim >= 2:
                acc, picks = C.residuals.compensate_and_select(
                    v.name, g, [(s.offset, s.rows) for s in v.shards], spec)
                self.sparse.append((v, [(k, ids, acc[s.offset + ids],
                                         new_update_id(v._key_label(k)))
                                        for k, (s, ids) in enumerate(zip(v.shards, picks))]))
                continue
            if isinstance(spec, C.FP16):
                g = C.to_fp16(g)
            elif isinstance(spec, C.BF16):
                g = C.to_bf16(g)
                if v.dtype != "float32":   # the server wants its own dtype (or float16)
                    g = g.astype(v.dtype)
            self.dense += [(v, k, part, new_update_id(v._key_label(k)))
                           for k, part in enumerate(v._split(g))]


def _table_parts(table, g, row_sync) -> tuple[list[tuple], object]:
    """A dynamic table's gradient (IndexedSlices by key) as [(shard, keys,
    summed rows, update key)]: each distinct key once (the rows of its
    duplicates summed here), every shard in a sync step (an empty update
    counts the replica); and the description (layouts.snapshot) they were
    split by. Keys this thread just looked up are not sorted again."""
    if not isinstance(g, IndexedSlices):
        raise ValueError(f"a dynamic table's gradient is row-wise: give "
                         f"IndexedSlices(rows, keys) for {table.name!r}")
    keys = check_keys(g.indices).reshape(-1)
    grads = np.asarray(g.values)
    if grads.shape != (keys.size, table.dim):
        raise ValueError(f"gradient for table {table.name!r} has shape {grads.shape}, "
                         f"expected {(keys.size, table.dim)}")
    now = layouts.snapshot(table)
    # Distinct keys shard by shard: as this thread just looked them up, else anew.
    keys, where, runs = last_lookup(table, keys, now.layout_epoch) or shard_order(now, keys)[:3]
    grads = sum_rows(where, grads, keys.size)
    have = {k: (keys[lo:hi], grads[lo:hi]) for k, lo, hi in runs}
    if row_sync is not None:   # every shard counts this replica (an empty update too)
        empty = (np.zeros(0, np.int64), np.zeros((0, now.dim), grads.dtype))
        return [(k, *have.get(k, empty), 0) for k in range(now.num_shards)], now
    # An update key per shard the table was created with (its keys' shard
    # then): a resend after a failover or a lost connection applies once, and
    # a re-run of an exactly-once batch sends the same keys, wherever moves of
    # buckets took the keys since (a shard that took buckets knows which
    # update keys their earlier shard applied to them: psserver/core/table_copy.py).
    label = now.shards[0].name
    if now.buckets == BucketMap.even(now.origin_shards or now.num_shards):   # (none moved)
        return [(k, ks, gs, new_update_id(f"{label}#{k}")) for k, (ks, gs) in have.items()], now
    created = BucketMap.even(now.origin_shards)
    parts = []
    for k, (ks, gs) in have.items():
        order, runs = by_shard_of(created.shard_of(ks), now.origin_shards)
        parts += [(k, c, ks[order[lo:hi]], gs[order[lo:hi]]) for c, lo, hi in runs]
    uids = {c: new_update_id(f"{label}#{c}") for c in sorted({p[1] for p in parts})}
    return [(k, ks, gs, uids[c]) for k, c, ks, gs in parts], now


def _split_again(table, parts: list[tuple]) -> list[tuple]:
    """An asynchronous update's parts split by ``table``'s layout (buckets
    moved since they were made), each piece keeping its part's update key;
    pieces of one key and shard merged (a server takes an update key once)."""
    pieces: dict[tuple[int, int], list] = {}
    for _, keys, grads, uid in parts:
        order, runs = by_shard(table, keys)
        for k, lo, hi in runs:
            pieces.setdefault((k, uid), []).append((keys[order[lo:hi]], grads[order[lo:hi]]))
    return [(k, *(got[0] if len(got) == 1 else (np.concatenate([a for a, _ in got]),
                                                 np.concatenate([b for _, b in got]))), uid)
            for (k, uid), got in pieces.items()]
