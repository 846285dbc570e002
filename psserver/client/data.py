"""PSClient: the Python client of one parameter-server task.

Workers and the coordinator reach every parameter server through this class:
the data calls (reads, pushes, row look-ups, dynamic tables) here, on top of
PSAdmin's control calls (psserver/client/admin.py), both over one
TaskChannel (psserver/link/channel.py). Every method raises a subclass of
``psserver.errors.PSError`` on failure, carrying the server's message.

Each data call is written once, non-blocking: ``x_async(...)`` sends the
request now and returns a ``Pending`` (psserver/link/pending.py) whose
``result()`` is the value, as ps-lite's ``Wait(ts)``; the blocking ``x(...)``
is ``x_async(...).result()``. How a call travels is decided once per call
by ``routing.form`` from the route the channel planned and the call's size
(psserver/contract/routing.py): straight from the server's memory, through a
shared-memory segment (psserver/client/segments.py), in one socket frame,
in one gRPC message, or in gRPC's streams (tensors of any size; callers
never see the difference).

Delivery: reads, gathers and metadata calls are idempotent, and are made
again over gRPC when a socket breaks under them (and retried by gRPC on
UNAVAILABLE). Pushes are sent at most once by this client: an
``Unavailable`` error means the update may or may not have been applied;
give it an update key (``update_id``) and resend it to apply it once.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from protos.pstrain.v1 import ps_pb2
from psserver.client import large
from psserver.client.admin import PSAdmin
from psserver.client.results import (
    Snapshot,
    StepRead,
    TableGradient,
    TableLookup,
    as_ids,
    filled,
    halved,
    set_sync,
    set_sync_read,
    sync_info,
)
from psserver.client.segments import SegmentPath
from psserver.contract import SyncSpec, routing, wire, wire_decode
from psserver.contract import tensor as T
from psserver.contract.routing import DIRECT, FRAME, SEGMENT, STREAM
from psserver.errors import Code, InvalidArgument, PSError
from psserver.link import buffers, methods
from psserver.link import tensor_proto as TP
from psserver.link.pending import Pending, gathered
from psserver.link.transport import background

#: Dense pushes of at least this many bytes go over a socket from their
#: arrays (wire.SCATTER, one sendmsg) instead of being copied into a frame:
#: below it the copy costs less than the extra buffers.
SCATTER_BYTES = 1 << 20


def _versions(reply) -> list[int]:
    return list(reply.versions)


class PSClient(PSAdmin):
    """Client of the parameter server at ``address`` ("host:port"): PSAdmin's
    arguments and calls, and the data calls below."""

    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self._segments = SegmentPath(self.channel, kwargs.get("shared_memory", True))

    def close(self) -> None:
        self._segments.close()
        super().close()

    # -- reads ---------------------------------------------------------------
    def _snapshots(self, values, remember: bool = True) -> list[Snapshot]:
        """Snapshots of (name, version, array), remembering each size."""
        out = []
        sizes = self._sizes
        for name, version, arr in values:
            if arr is None:   # (a value without its tensor: not a reply of ours)
                raise InvalidArgument(f"the read reply's value of {name!r} has no tensor "
                                      f"[{self.address}]")
            if remember:
                sizes.remember(name, arr.nbytes, arr.shape)
            out.append(Snapshot(name, version, arr))
        return out

    def _known(self, names: Sequence[str], learn: bool = False) -> int | None:
        """The bytes of ``names`` as last seen (asked now with ``learn``)."""
        self._sizes.check(self.channel.incarnation)
        known = self._sizes.known(names)
        if known is None and learn:
            for n in names:
                if n not in self._sizes.nbytes:
                    self.get_meta(n)
            known = self._sizes.known(names)
        return known

    def read_many_async(self, names: Sequence[str], *, sync_step: int | None = None,
                        out: Sequence[np.ndarray | None] | None = None,
                        value_dtype: str = "") -> Pending:
        """Read several variables in one call; ``result()`` is a list of Snapshot.

        Values are read-only arrays (``.copy()`` one to change it), or the
        arrays of ``out`` (one per name, None: a new one) when given with the
        value's shape and dtype: the value lands in it (on this host,
        straight from shared memory: the only copy; from another host,
        received straight into it). A read that fails may have written
        some of them (their contents are then undefined). With ``sync_step``
        (sync mode), the read waits while an earlier step is still being
        gathered on a variable (see psserver.core.sync).

        ``value_dtype="float16"``: float32/float64 values come rounded to
        float16 (clipped to +-65504), sent as float16 between hosts (half the
        bytes of float32) and rounded here on the same host, so every path
        gives the same numbers. They land in ``out``'s arrays (float32 there)
        where given, else they are float16 arrays.
        """
        names = list(names)
        half = T.read_as(value_dtype) is not None
        known = self._known(names)
        f = routing.form(routing.READ, known or 0, self.channel.plan, self.limits,
                         direct=self._segments.direct_on, sync=sync_step is not None)
        if f == DIRECT:
            got = self._segments.direct(names, out)
            if got is not None:   # rounded here as the server would have
                snaps = self._snapshots(got)
                return Pending.of(halved(snaps) if half else snaps)
            f = SEGMENT
        if f == SEGMENT:
            known = self._known(names, learn=True)
            sizes = self._sizes.nbytes
            sent = self._segments.read(
                names, [sizes[n] for n in names], sync_step, None, out,
                lambda exc: self._read_bulk(names, sync_step, out, "", routing.form(
                    routing.READ, known, self.channel.plan, self.limits,
                    segments=False) == FRAME).result(),
                self._snapshots)
            if sent is not None:
                return sent.then(halved) if half else sent
            f = routing.form(routing.READ, known, self.channel.plan, self.limits,
                             segments=False)
        if f == STREAM:
            return background(large.read_stream, self, names, sync_step, value_dtype, out)
        return self._read_bulk(names, sync_step, out, value_dtype, f == FRAME)

    def _read_bulk(self, names: list[str], sync_step, out, value_dtype: str,
                   frame: bool) -> Pending:
        """ParameterServerBulk.Read, each value received straight into out's
        array; a reply too large for one call is streamed instead."""
        half = T.read_as(value_dtype) is not None
        limit = self.limits.frame_bytes if frame else self.limits.stream_bytes
        req = ps_pb2.ReadRequest(names=names, max_bytes=max(1, limit), value_dtype=value_dtype)
        set_sync_read(req, sync_step)
        want = list(zip(names, out if out is not None else [None] * len(names)))

        def receive(recv_into, n):
            return wire_decode.receive_read_reply(recv_into, n, want)

        def post(values):   # values read as float16 are not the variables' sizes
            snaps = self._snapshots(values, not half)
            return filled(snaps, out) if out is not None else snaps

        def recover(exc: PSError):   # larger than one call carries: stream it
            if exc.code == Code.RESOURCE_EXHAUSTED:
                return large.read_stream(self, names, sync_step, value_dtype, out)
            raise exc
        return self.channel.send(methods.BULK_READ, req, post=post, recover=recover,
                                 receiver=receive)

    def read_many(self, names: Sequence[str], *, sync_step: int | None = None,
                  out: Sequence[np.ndarray | None] | None = None,
                  value_dtype: str = "") -> list[Snapshot]:
        return self.read_many_async(names, sync_step=sync_step, out=out,
                                    value_dtype=value_dtype).result()

    def read(self, name: str, *, with_version: bool = False):
        """The value of ``name`` (a read-only array), or (value, version)."""
        s = self.read_many([name])[0]
        return (s.value, s.version) if with_version else s.value

    # -- rows by id ----------------------------------------------------------------
    def gather_async(self, name: str, ids, *, sync_step: int | None = None) -> Pending:
        """Rows by id; ``result()`` is (rows, version). A gather whose rows
        exceed one message is split into several calls; each piece is a
        consistent snapshot and the version reported is the oldest piece's."""
        return self.read_and_gather_async([], [(name, ids)], sync_step=sync_step).then(
            _first_rows)

    def gather(self, name: str, ids, *, with_version: bool = False,
               sync_step: int | None = None):
        """Rows ``value[ids]`` (shape ids.shape + row shape), or (rows, version)."""
        rows, version = self.gather_async(name, ids, sync_step=sync_step).result()
        return (rows, version) if with_version else rows

    def read_and_gather_async(self, names: Sequence[str],
                              gathers: Sequence[tuple[str, object]], *,
                              sync_step: int | None = None,
                              rows_out: Sequence[np.ndarray | None] | None = None) -> Pending:
        """Read variables and look up rows of others in one call (the separate
        calls where one reply would not carry them all): (snapshots,
        [(rows, version)]), rows shaped ids.shape + row shape, as gather.
        ``rows_out``: an array per gather (or None) of the rows' dtype and
        shape (C-contiguous, writable) that rows received from another host
        land in (returned as its rows); elsewhere they are new arrays."""
        return self.read_all_async(names, gathers, sync_step=sync_step,
                                   rows_out=rows_out).then(_values_and_rows)

    def read_and_gather(self, names, gathers, *, sync_step: int | None = None,
                        rows_out=None):
        return self.read_and_gather_async(names, gathers, sync_step=sync_step,
                                          rows_out=rows_out).result()

    def read_all_async(self, names: Sequence[str] = (),
                       gathers: Sequence[tuple[str, object]] = (),
                       tables: Sequence[TableLookup] = (), *, sync_step: int | None = None,
                       rows_out: Sequence[np.ndarray | None] | None = None,
                       tables_out: Sequence[np.ndarray | None] | None = None) -> Pending:
        """A step's reads from this server in one call: variables' values,
        rows of others by id (as read_and_gather) and dynamic-table look-ups
        (TableLookup each: rows keys.shape + (dim,), or a bag's pooled row
        each); a StepRead. ``tables_out``: an array per look-up (or None)
        its rows land in, as ``rows_out``. On this host the values come
        straight from the server's memory where they can (the rest in one
        call); where one reply would not carry it all, separate calls."""
        names, tables = list(names), list(tables)
        shaped = [(name, as_ids(ids, "gather")) for name, ids in gathers]
        flat = [(name, ids.reshape(-1)) for name, ids in shaped]
        plan, sync = self.channel.plan, sync_step is not None
        direct = None   # the dense values, read straight from the server's memory
        if names and routing.form(routing.READ, 0, plan, self.limits,
                                  direct=self._segments.direct_on, sync=sync) == DIRECT:
            direct = self._segments.direct(names, None)
            if direct is not None:
                direct, names = self._snapshots(direct), []
        if not flat and not tables and direct is not None:
            return Pending.of(StepRead(direct, [], []))
        known = self._known(names, learn=True)
        rows = [self._row_bytes(name) for name, _ in flat]
        nbytes = known + sum(ids.size * r for (_, ids), r in zip(flat, rows)) + sum(
            t.nbytes for t in tables)
        # (dynamic tables take no segment: with them, one socket frame)
        f = routing.form(routing.TABLE if tables else routing.GATHER, nbytes, plan, self.limits)

        def shaped_rows(result):
            snaps, got, table_rows = result
            return StepRead(direct or snaps, [(r.reshape(ids.shape + r.shape[1:]), v)
                                              for (r, v), (_, ids) in zip(got, shaped)],
                            table_rows)

        def separate(exc=None):   # the calls one by one, blocking
            snaps = self.read_many(names, sync_step=sync_step) if names else []
            return (snaps, [large.gather_split(self, name, ids, sync_step) for name, ids in flat],
                    [large.lookup_split(self, t) for t in tables])
        if f == SEGMENT:
            sent = self._segments.read(names, [self._sizes.nbytes[n] for n in names], sync_step,
                                       [(n, ids, r) for (n, ids), r in zip(flat, rows)], None,
                                       separate, self._snapshots)
            if sent is not None:
                return sent.then(_with_no_tables).then(shaped_rows)
            f = routing.form(routing.GATHER, nbytes, self.channel.plan, self.limits,
                             segments=False)
        if f == STREAM:
            return background(separate).then(shaped_rows)
        req = ps_pb2.ReadRequest(names=names, max_bytes=max(1, self.limits.frame_bytes
                                                             if f == FRAME else
                                                             self.limits.message_bytes))
        for name, ids in flat:
            TP.fill(req.gathers.add(name=name).ids, ids)
        for t in tables:
            t.fill(req.table_lookups.add())
        set_sync_read(req, sync_step)
        want = [(name, None) for name in names]

        def receive(recv_into, n):
            return wire_decode.receive_read_reply(recv_into, n, want, rows_out or (),
                                                  tables_out or ())

        def post(got):
            if len(got.gathered) != len(flat) or len(got.tables) != len(tables):
                raise InvalidArgument(
                    f"the read reply has {len(got.gathered)} looked-up rows for {len(flat)} "
                    f"look-ups and {len(got.tables)} table rows for {len(tables)} "
                    f"[{self.address}]")
            for (name, ids), (_, r) in zip(flat, got.gathered):
                if r is None or r.ndim < 1 or r.shape[0] != ids.size:
                    raise InvalidArgument(
                        f"the read reply's rows of {name!r} are not {ids.size} rows (got "
                        f"{None if r is None else r.shape}) [{self.address}]")
            for t, r in zip(tables, got.tables):
                _check_table_rows(t, r, self.address)
            return shaped_rows((self._snapshots(got), [(r, v) for v, r in got.gathered],
                                got.tables))

        def recover(exc: PSError):   # larger than one reply carries: split (where it can)
            if exc.code == Code.RESOURCE_EXHAUSTED and all(t.row_bytes > 0 for t in tables):
                return shaped_rows(separate())
            raise exc   # (or the server's memory is full: a table's new rows)
        return self.channel.send(methods.BULK_READ, req, post=post, recover=recover,
                                 receiver=receive)

    def _row_bytes(self, name: str) -> int:
        """Bytes of one row of ``name`` (asks the server the first time)."""
        b = self._sizes.row_bytes(name)
        if b is None:
            self.get_meta(name)
            b = self._sizes.row_bytes(name) or 0
        return b

    # -- updates -------------------------------------------------------------
    def push_many_async(self, grads, *, sync: SyncSpec | None = None) -> Pending:
        """Apply dense gradients ({name: grad}, [(name, grad)] or
        [(name, grad, update_id)]) in one call. A non-zero update_id makes the
        update idempotent: resending it after an error applies it at most once.

        ``result()`` is the list of versions after each update. The request is
        validated in full first: on an error nothing was applied. With
        ``sync`` (sync mode), the gradients join their step instead (see
        psserver.core.sync); a late one is dropped and counted on the server.
        """
        return self._push(grads, (), sync)

    def push_many(self, grads, *, sync: SyncSpec | None = None) -> list[int]:
        return self._push(grads, (), sync).result()

    def push(self, name: str, grad) -> int:
        """Apply one dense gradient; return the version after it."""
        return self.push_many([(name, grad)])[0]

    def push_dense_and_sparse_async(self, dense, sparse: Sequence[tuple], *,
                                    sync: SyncSpec | None = None) -> Pending:
        """Dense updates ([(name, grad[, update_id])]) and row-wise ones
        ([(name, ids, rows, update_id)]) in one call (async, within one
        frame or message; otherwise the separate calls). ``result()``: the
        versions after the dense updates, then after the row-wise ones.
        Validated in full first when one call; see push_many and push_sparse."""
        return self._push(dense, sparse, sync)

    def push_dense_and_sparse(self, dense, sparse: Sequence[tuple], *,
                              sync: SyncSpec | None = None) -> list[int]:
        return self._push(dense, sparse, sync).result()

    def push_all_async(self, dense=(), sparse: Sequence[tuple] = (),
                       tables: Sequence[TableGradient] = (), *,
                       sync: SyncSpec | None = None) -> Pending:
        """A step's pushes to this server in one call: dense gradients and
        row-wise ones (as push_dense_and_sparse) and dynamic-table gradients
        (TableGradient each); ``result()`` is (versions of the dense, then the
        row-wise updates, [(rows updated, gradient rows dropped, the shard's
        step, late)] of the table updates). Validated in full before
        anything is applied; each update applies once per update key."""
        return self._push(dense, sparse, sync, list(tables))

    def _push(self, grads, sparse, sync: SyncSpec | None, tables=None) -> Pending:
        dense, nbytes = [], 0
        for item in (grads.items() if isinstance(grads, dict) else grads):
            a = item[1]
            if type(a) is not np.ndarray:
                a = np.asarray(a)
            dense.append((item[0], a, item[2] if len(item) > 2 else 0))
            nbytes += a.nbytes
        if sparse:
            sparse = [(name, as_ids(ids, "sparse push").reshape(-1), np.asarray(rows), uid)
                      for name, ids, rows, uid in sparse]
            if sync is not None:   # a sync row-wise gradient goes on its own
                return gathered([self._push(dense, (), sync, tables)] + [
                    self.push_sparse_async(name, ids, rows, sync=sync, update_id=uid)
                    for name, ids, rows, uid in sparse],
                    _joined if tables is None else _joined_with_tables)
            for _, ids, rows, _ in sparse:
                nbytes += ids.nbytes + rows.nbytes
        ch = self.channel
        if tables:   # (dynamic tables take no segment: with them, one socket frame)
            nbytes += sum(t.nbytes for t in tables)
            f = routing.form(routing.TABLE, nbytes, ch.current or ch.plan, self.limits)
        else:
            f = routing.form(routing.PUSH, nbytes, ch.current or ch.plan, self.limits)
        if f == SEGMENT:
            sent = self._segments.push(dense, sync, sparse, lambda exc: self._push_bulk(
                dense, sparse, sync, self._unsegmented(nbytes), nbytes, tables).result())
            if sent is not None:
                return sent if tables is None else sent.then(_with_no_table_counts)
            f = self._unsegmented(nbytes)
        return self._push_bulk(dense, sparse, sync, f, nbytes, tables)

    def _unsegmented(self, nbytes: int) -> str:
        """A push's form without shared memory (made again without its segment)."""
        return routing.form(routing.PUSH, nbytes, self.channel.plan, self.limits,
                            segments=False)

    def _push_bulk(self, dense, sparse, sync: SyncSpec | None, f: str, nbytes: int,
                   tables=None) -> Pending:
        """ParameterServerBulk.Push (framed by hand: over a socket, large
        gradients sent from their arrays, small ones framed in a pooled
        buffer), or its streamed form. ``tables`` (None: none asked for):
        the result is (versions, table results)."""
        if f == STREAM:
            return background(large.push_streamed, self, dense, sparse, sync, tables)
        into = (wire.SCATTER if nbytes >= SCATTER_BYTES or sparse or tables else buffers.take) \
            if f == FRAME else None
        raw = wire.encode_push_request(
            dense, b"" if sync is None else sync_info(sync).SerializeToString(), into,
            sparse=sparse, tables=[t.framed() for t in tables] if tables else ())
        if not sparse and tables is None:
            return self.channel.send(methods.BULK_PUSH, raw, post=_versions)
        want, n_tables = len(dense) + len(sparse), len(tables or ())

        def versions(reply):
            if len(reply.versions) != want or len(reply.tables) != n_tables:
                raise InvalidArgument(
                    f"the push reply has {len(reply.versions)} versions for {len(dense)} dense "
                    f"and {len(sparse)} row-wise updates, and {len(reply.tables)} table "
                    f"results for {n_tables} [{self.address}]")
            if tables is None:
                return list(reply.versions)
            return list(reply.versions), [(t.updated, t.dropped, t.step, t.late)
                                          for t in reply.tables]
        return self.channel.send(methods.BULK_PUSH, raw, post=versions)

    def push_sparse_async(self, name: str, ids, rows, *, sync: SyncSpec | None = None,
                          update_id: int = 0) -> Pending:
        """push_sparse, sent now; ``result()`` is the version after it."""
        ids = as_ids(ids, "sparse push")
        rows = np.asarray(rows)
        sync_raw = None if sync is None else sync_info(sync).SerializeToString()
        if self._unsegmented(ids.nbytes + rows.nbytes) != STREAM:   # framed by hand: the arrays' memory goes out as it is
            raw = wire.encode_push_sparse_request(name, ids, rows, update_id, sync_raw,
                                                  into=wire.SCATTER)
            return self.channel.send(methods.PUSH_SPARSE, raw, post=_first_version)
        req = ps_pb2.PushSparseRequest(name=name, update_id=update_id)
        set_sync(req, sync)
        TP.fill(req.ids, ids, with_data=False)
        TP.fill(req.values, rows, with_data=False)
        return background(lambda: self.channel.upload(
            "push_sparse", req, [ids, rows],
            large.stream_timeout(self.timeout, ids.nbytes + rows.nbytes)).updated.versions[0])

    def push_sparse(self, name: str, ids, rows, *, sync: SyncSpec | None = None,
                    update_id: int = 0) -> int:
        """Apply a row-wise gradient (duplicate ids summed); return the version.

        A non-zero update_id makes it idempotent, as in push_many_async."""
        return self.push_sparse_async(name, ids, rows, sync=sync, update_id=update_id).result()

    # -- dynamic tables ------------------------------------------------------------
    def lookup_async(self, name: str, keys, *, admit: bool = True, counts=None,
                     sync_step: int | None = None) -> Pending:
        """Rows of int64 ``keys`` (any shape; result keys.shape + (dim,));
        zeros for keys without a row. ``admit=False`` (evaluation, serving):
        nothing is counted, created or evicted. ``counts``: how often each
        key occurs in the caller's batch (it sends unique keys).
        ``sync_step`` (sync mode): first wait while an earlier step's
        updates are being gathered on the shard. (A look-up of several
        tables, or of bags, in one call: read_all_async.)"""
        return self.read_all_async(tables=[TableLookup(
            name, _keys(keys), None if counts is None else np.asarray(counts), admit,
            sync_step=sync_step)]).then(_first_table)

    def lookup(self, name: str, keys, *, admit: bool = True, counts=None,
               sync_step: int | None = None) -> np.ndarray:
        return self.lookup_async(name, keys, admit=admit, counts=counts,
                                 sync_step=sync_step).result()

    def update_table_async(self, name: str, keys, grads, *, update_id: int = 0,
                           sync: SyncSpec | None = None) -> Pending:
        """Apply row gradients (duplicate keys summed) with the table's
        optimizer; ``result()``: (rows updated, gradient rows dropped).
        ``update_id`` (non-zero): the update applies once however often it
        is sent (a resend answers (0, 0)). ``sync`` (sync mode): this
        replica's share of a step, gathered and applied with the others'
        once the step is complete; the counts are the step's if this update
        completed it, else (0, 0). (Several tables, or bags: push_all_async.)"""
        return self.push_all_async(tables=[TableGradient(
            name, _keys(keys).reshape(-1), np.asarray(grads), update_id, sync)]).then(
            _first_table_counts)

    def update_table(self, name: str, keys, grads, *, update_id: int = 0,
                     sync: SyncSpec | None = None) -> tuple[int, int]:
        return self.update_table_async(name, keys, grads, update_id=update_id,
                                       sync=sync).result()


def _first_rows(result):
    return result[1][0]


def _values_and_rows(result):
    return result[0], result[1]


def _with_no_tables(result):
    snaps, rows = result
    return snaps, rows, []


def _check_table_rows(t: TableLookup, rows, address: str) -> None:
    """InvalidArgument unless ``rows`` are a look-up's answer: one row per key
    (keys.shape + (dim,)), or per bag."""
    want = t.keys.shape if t.offsets is None else (max(0, len(t.offsets) - 1),)
    if rows is None or rows.ndim != len(want) + 1 or rows.shape[:-1] != tuple(want) \
            or rows.dtype.kind != "f":
        raise InvalidArgument(f"the read reply's rows of table {t.name!r} are not "
                              f"{list(want)} rows (got "
                              f"{None if rows is None else (rows.dtype, rows.shape)}) [{address}]")


def _first_version(reply) -> int:
    return reply.versions[0]


def _first_table(result) -> np.ndarray:
    return result.tables[0]


def _first_table_counts(result) -> tuple[int, int]:
    return result[1][0][:2]


def _with_no_table_counts(versions) -> tuple:
    return versions, []


def _joined_with_tables(results: list) -> tuple:
    """A push's (versions, table results) from its dense call's and each
    row-wise call's."""
    versions, tables = results[0]
    return list(versions) + list(results[1:]), tables


def _joined(results: list) -> list[int]:
    """A push's versions from its dense call's and each row-wise call's."""
    return list(results[0]) + list(results[1:])


def _keys(keys) -> np.ndarray:
    """Keys as sent: int64 (narrower integers widened); other dtypes are sent
    as they are and the server says what is wrong."""
    a = np.asarray(keys)
    return a.astype(np.int64) if a.dtype.kind in "iu" and a.dtype.itemsize < 8 else a
