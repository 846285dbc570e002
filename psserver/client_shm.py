"""The same-host layer of PSClient: shared memory over the Unix socket.

A client whose route has shared memory (psserver/routing.py) reads and
pushes through segments it attaches (psserver/shm.py): the Unix socket
carries names, shapes and offsets, the tensor bytes never cross a socket.
Asynchronous reads copy straight from the server's memory (``_direct_read``,
a seqlock, no call). Reads, lookups, dense and sparse pushes of one step go
in one call (``read_and_gather``, ``push_dense_and_sparse``): here through
the segment, from another host in one ParameterServerBulk call
(``ReadRequest.gathers``, ``PushRequest.sparse``). Anything the
server refuses for a reason that concerns the segment (unknown after a
restart, too small) is made again without it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Sequence

import numpy as np

from protos.pstrain.v1 import ps_pb2
from psserver import tensor as T
from psserver import methods, shm, wire
from psserver.contract import Code, InvalidArgument, PSError, SyncSpec
from psserver.transport import Pending

from psserver.client_util import (Handle, Snapshot, _as_ids, _dest, _set_sync,
                                   _set_sync_read)

log = logging.getLogger(__name__)

#: The most variables one client maps for direct reads (each map holds a file
#: descriptor); further ones are read through their server.
MAX_MAPPED = 256

#: Codes a server answers with once it is done with a call's segment (any
#: other error may have come while it was still using it).
_SERVER_DONE = frozenset({
    Code.INVALID_ARGUMENT, Code.NOT_FOUND,
    Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION,
    Code.RESOURCE_EXHAUSTED, Code.UNAUTHENTICATED,
    Code.UNIMPLEMENTED, Code.OUT_OF_RANGE,
    Code.PERMISSION_DENIED})


def _together(sent: Sequence[Handle], combine, target: str) -> Handle:
    """One Handle over calls already sent: ``result()`` reads every reply (each
    holds a connection until read, so all are read even when one failed),
    then raises the first error or returns ``combine([results])``."""
    def collect():
        got, first = [], None
        for h in sent:
            try:
                got.append(h.result())
            except BaseException as exc:   # noqa: BLE001 (raised below, after the rest)
                first = first or exc
        if first is not None:
            raise first
        return combine(got)
    return Handle(Pending(collect, lambda: all(h.done() for h in sent)), target=target)


class SharedMemoryPath:
    """PSClient's same-host calls (a mixin over ServerChannel's state)."""

    #: Whether the server answers ReadRequest.gathers (False once one did not).
    _read_lookups = True

    def _direct_read(self, names: list[str], out) -> list[Snapshot] | None:
        """Snapshots copied from the server's shared values (psserver.shm: a
        seqlock, no call), or None: read through the server instead (a name
        not shared, one dead or always being written, or the server gone)."""
        ipc_client = self._ipc
        if ipc_client is None or not ipc_client.alive():
            self._unmap(list(self._direct))   # its memory is a dead process's now
            return None
        missing = [n for n in names if n not in self._direct]
        if missing:
            self._map(missing)
        snaps = []
        for i, name in enumerate(names):
            mapped = self._direct.get(name)
            if mapped is None:
                return None
            try:
                dest = _dest(out, i, mapped.value)
                got = mapped.read_into(dest)
            except (TypeError, AttributeError, ValueError):   # closed by another thread
                return None
            if not got:   # deleted (re-created?), or never still: ask the server
                if got is False:
                    self._unmap([name])
                return None
            version, arr = got
            if dest is None:
                arr.flags.writeable = False
            snaps.append((name, version, arr))
        return self._snapshots(snaps)

    def _map(self, names: list[str]) -> None:
        reply = self._call(methods.SHM_SHARE, ps_pb2.ShmShareRequest(names=names))
        for v in reply.variables:
            mapped = None
            if v.path and sum(m is not None for m in self._direct.values()) < MAX_MAPPED:
                try:
                    mapped = shm.MappedValue(v.path, v.dtype, list(v.shape), v.nbytes, v.tag)
                except OSError:   # not ours to open (another user, another pid namespace)
                    mapped = None
            with self._shm_lock:
                old = self._direct.get(v.name)
                self._direct[v.name] = mapped
            if old is not None:
                old.close()

    def _unmap(self, names: list[str]) -> None:
        with self._shm_lock:
            gone = [self._direct.pop(n, None) for n in names]
        for m in gone:
            if m is not None:
                m.close()

    def _direct_ok(self) -> bool:
        """Whether reads may copy straight from the server's memory (same host)."""
        return self._direct_on and self._ipc is not None and self._route().shm

    def _shm_for(self, nbytes: int) -> bool:
        """Whether a read or push goes through shared memory (then the
        same-host socket carries it, whatever its size)."""
        return self._route().shm

    def _shm_take(self, nbytes: int) -> shm.Segment | None:
        """A segment of nbytes or more, or None: use gRPC (turned off for good when
        the server does not take segments after all)."""
        if self._arena is None:
            with self._shm_lock:
                if self._arena is None:
                    self._arena = shm.Arena(self._shm_attach, self._shm_detach)
        try:
            return self._arena.take(nbytes)
        except PSError as exc:
            if exc.code in (Code.FAILED_PRECONDITION, Code.UNIMPLEMENTED):
                log.warning("parameter server %s takes no shared memory from this process "
                            "(%s); sending tensor bytes over its socket", self.address, exc)
                self._no_shm()
                return None
            raise
        except OSError:   # no memory for a segment: this transfer goes over gRPC
            return None

    def _no_shm(self) -> None:
        with self._shm_lock:
            if self._plan is not None:
                self._plan = dataclasses.replace(self._plan, shm=False)

    def _shm_attach(self, seg: shm.Segment) -> int:
        return self._call(methods.SHM_ATTACH, ps_pb2.ShmAttachRequest(
            name=seg.name, nbytes=seg.nbytes, pid=seg.pid, fd=seg.fd)).segment

    def _shm_detach(self, seg_id: int) -> None:
        self._call(methods.SHM_DETACH, ps_pb2.ShmDetachRequest(segment=seg_id), timeout=2.0)

    def _shm_invoke(self, wait: bool, method: methods.Method, req, seg: shm.Segment, finish,
                    fallback):
        """A SharedMemory call using ``seg`` (over the Unix socket, or gRPC if it
        broke): finish(reply) turns the reply into the result before the
        segment goes back; fallback(exc) answers an error that says the
        server lost the segment (by redoing the call without it)."""
        def on_error(exc: PSError):
            # Told apart by code alone: on a SharedMemory call FAILED_PRECONDITION
            # comes only from a segment the server does not know (restarted,
            # or expired it), found before anything is done, and OUT_OF_RANGE
            # from a segment too small for the read; the call is made again
            # without the segment. Any other error (RESOURCE_EXHAUSTED
            # included: a push may have applied part of its variables) is
            # the caller's, with its update keys.
            lost = exc.code == Code.FAILED_PRECONDITION
            # After a timeout or a lost connection the server may still be
            # using the segment: it is never lent again (not detached either:
            # a late call still finds its data; the server closes it when idle).
            uncertain = exc.code not in _SERVER_DONE
            self._arena.give(seg, broken=lost or uncertain)
            if lost:
                self._arena.forget()   # the server restarted or expired them: attach anew
                return fallback(exc)
            if exc.code == Code.UNIMPLEMENTED:
                self._no_shm()
                return fallback(exc)
            if exc.code == Code.OUT_OF_RANGE:
                return fallback(exc)
            raise exc

        def done(reply):
            try:
                return finish(reply)
            finally:
                self._arena.give(seg)
        if wait:
            try:
                reply = self._make(method, req)
            except PSError as exc:
                return on_error(exc)
            return done(reply)
        pending = self._send(method, req)   # sent now, its reply read in result()
        return Handle(Pending(lambda: done(pending.result()), pending.done),
                      target=self.address, recover=on_error)

    def _shm_read(self, names: list[str], known: list[int], wait: bool, sync_step: int | None,
                  gathers: Sequence[tuple[str, np.ndarray]] | None = None,
                  out: Sequence[np.ndarray | None] | None = None):
        """Read ``names`` (their sizes ``known``) through a segment: a list of
        Snapshot (values copied into ``out``'s arrays where given); with
        ``gathers`` ([(name, 1-D ids)], row sizes known too), (snapshots,
        [(rows, version)]) from the same call (an empty list of gathers too)."""
        paired = gathers is not None
        gathers = list(gathers or ())
        out_offset = sum(shm.align(ids.nbytes) for _, ids in gathers)
        need = out_offset + sum(shm.align(n) for n in known) + sum(
            shm.align(ids.size * self._row_bytes(name)) for name, ids in gathers)

        def fallback(exc: PSError | None = None):   # over gRPC, relearning the sizes
            self._forget_sizes(names)
            snaps = self._read_many(names, True, sync_step, out) if names else []
            if not paired:
                return snaps
            return snaps, [self._gather(name, ids, True, sync_step, use_shm=False)
                           for name, ids in gathers]
        seg = self._shm_take(need)
        if seg is None:
            return self._run(wait, fallback)
        req = ps_pb2.ShmReadRequest(segment=seg.seg_id, names=names, out_offset=out_offset)
        _set_sync_read(req, sync_step)
        off = 0
        for name, ids in gathers:
            seg.array[off:off + ids.nbytes] = ids.view(np.uint8)
            req.gathers.add(name=name, ids=ps_pb2.ShmTensor(
                dtype=T.dtype_name(ids.dtype), shape=ids.shape, offset=off))
            off += shm.align(ids.nbytes)

        def copy_out(t: ps_pb2.ShmTensor, i: int | None = None) -> np.ndarray:
            """t's array copied out of the segment (into out[i] when it fits)."""
            dt, shape, n = T.spec(t, T.WIRE_DTYPES, f"value of {t.name!r}")
            src = np.frombuffer(seg.array, dtype=dt, count=n // dt.itemsize,
                                offset=t.offset).reshape(shape)
            dest = _dest(out, i, src) if i is not None else None
            if dest is not None:
                np.copyto(dest, src)
                return dest
            arr = src.copy()
            arr.flags.writeable = False
            return arr

        def finish(reply: ps_pb2.ShmReadReply):
            snaps = self._snapshots([
                (v.name, v.version, copy_out(v, i))
                for i, v in enumerate(reply.values)])
            if not paired:
                return snaps
            return snaps, [(copy_out(g), g.version) for g in reply.gathered]
        return self._shm_invoke(wait, methods.SHM_READ, req, seg, finish, fallback)

    def _row_bytes(self, name: str) -> int:
        """Bytes of one row of ``name`` (asks the server the first time)."""
        if name not in self._nbytes or not self._rows.get(name):
            self._learn_size(name)
        rows = self._rows.get(name) or 1
        return self._nbytes[name] // rows

    def _learn_size(self, name: str) -> None:
        meta = self.get_meta(name)
        self._remember(name, meta.nbytes, meta.shape)

    def _forget_sizes(self, names: Sequence[str]) -> None:
        for n in names:
            self._nbytes.pop(n, None)

    def _shm_push(self, items, arrays, uids, wait: bool, sync: SyncSpec | None, fallback,
                  sparse: Sequence[tuple[str, np.ndarray, np.ndarray, int]] = ()):
        """Dense updates (and, async only, sparse ones) through a segment; None
        when there is no segment to be had (the caller uses gRPC)."""
        datas = [wire._contiguous_bytes(a) for a in arrays]
        sparse_datas = [(wire._contiguous_bytes(ids), wire._contiguous_bytes(rows))
                        for _, ids, rows, _ in sparse]
        sizes = [len(d) for d in datas] + [len(d) for pair in sparse_datas for d in pair]
        seg = self._shm_take(sum(shm.align(n) for n in sizes))
        if seg is None:
            return None
        req = ps_pb2.ShmPushRequest(segment=seg.seg_id)
        if sync is not None:
            _set_sync(req, sync)
        end = 0

        def put(d: memoryview, arr: np.ndarray, name: str = "") -> ps_pb2.ShmTensor:
            nonlocal end
            off = end
            seg.array[off:off + len(d)] = np.frombuffer(d, dtype=np.uint8)
            end = off + shm.align(len(d))
            return ps_pb2.ShmTensor(name=name, dtype=T.dtype_name(arr.dtype), shape=arr.shape,
                                    offset=off)
        for item, a, d, uid in zip(items, arrays, datas, uids):
            t = put(d, a, item[0])
            t.update_id = uid
            req.updates.append(t)
        for (name, ids, rows, uid), (di, dr) in zip(sparse, sparse_datas):
            req.sparse.add(name=name, ids=put(di, ids), rows=put(dr, rows), update_id=uid)
        return self._shm_invoke(wait, methods.SHM_PUSH, req, seg, lambda r: list(r.versions),
                                fallback)

    # -- a step's calls to one server, as one -----------------------------------------
    def read_and_gather(self, names: Sequence[str], gathers: Sequence[tuple[str, object]], *,
                        sync_step: int | None = None,
                        rows_out: Sequence[np.ndarray | None] | None = None):
        """Read variables and look up rows of others in one call (the separate
        calls where one reply would not carry them all): (snapshots,
        [(rows, version)]), rows shaped ids.shape + row shape, as gather. See
        read_many and gather. ``rows_out``: an array per gather (or None) of
        the rows' dtype and shape (C-contiguous, writable) that rows received
        from another host land in (returned as its rows); elsewhere they are
        new arrays."""
        return self._read_and_gather(names, gathers, True, sync_step, rows_out)

    def read_and_gather_async(self, names: Sequence[str], gathers: Sequence[tuple[str, object]],
                              *, sync_step: int | None = None,
                              rows_out: Sequence[np.ndarray | None] | None = None) -> Handle:
        return self._read_and_gather(names, gathers, False, sync_step, rows_out)

    def _read_and_gather(self, names, gathers, wait: bool, sync_step: int | None,
                         rows_out=None):
        names = list(names)
        shaped = [(name, _as_ids(ids, "gather")) for name, ids in gathers]
        flat = [(name, ids.reshape(-1)) for name, ids in shaped]

        direct = None   # the dense values, read straight from the server's memory
        if names and sync_step is None and self._direct_ok():
            direct = self._direct_read(names, None)
            if direct is not None:
                names = []

        def reshape(result):
            snaps, rows = result
            return direct or snaps, [(r.reshape(ids.shape + r.shape[1:]), v)
                                     for (r, v), (_, ids) in zip(rows, shaped)]

        def separate():   # the calls one by one, blocking
            snaps = direct or (self._read_many(names, True, sync_step) if names else [])
            return snaps, [self._gather(name, ids, True, sync_step, use_shm=False)
                           for name, ids in shaped]
        for n in names:   # the segment's size needs them
            if n not in self._nbytes:
                self._learn_size(n)
        known = [self._nbytes.get(n) for n in names]
        if self._shm_for(0) and None not in known:
            out = self._shm_read(names, known, wait, sync_step, flat)
            if wait:
                return reshape(out)
            return Handle(Pending(lambda: reshape(out.result()), out.done), target=self.address)

        if self.bulk and self._read_lookups and (names or shaped) and None not in known \
                and sum(known) + sum(ids.size * self._row_bytes(name) for name, ids in flat) \
                <= self._tensor_limit(methods.BULK_READ):
            # one call (a socket's frame or a unary gRPC reply): values and rows
            return self._read_and_gather_bulk(names, flat, wait, sync_step, reshape, separate,
                                              rows_out)
        if not wait and self.local:   # a socket: every call sent now, no thread
            read = [self._read_many(names, False, sync_step)] if names and not direct else []
            sent = read + [self._gather(name, ids, False, sync_step, use_shm=False)
                           for name, ids in shaped]
            return _together(sent, lambda got: (direct or (got[0] if read else []),
                                                 got[len(read):]), self.address)
        return self._run(wait, separate)

    def _read_and_gather_bulk(self, names: list[str], flat, wait: bool,
                              sync_step: int | None, post, separate, rows_out=None):
        """read_and_gather as one ParameterServerBulk.Read (ReadRequest.gathers):
        post((snapshots, [(rows, version)])); ``separate()`` (the calls one by
        one) where the server says it does not fit one reply (or cannot take
        lookups). Over a socket, rows are received straight into
        ``rows_out``'s arrays."""
        def done(raw):
            got = wire.decode_read_reply(raw)
            if len(got.gathered) != len(flat):   # a server from before ReadRequest.gathers
                self._read_lookups = False
                return separate()
            rows = []
            for (name, ids), (version, r) in zip(flat, got.gathered):
                if r is None or r.ndim < 1 or r.shape[0] != ids.size:
                    raise InvalidArgument(
                        f"the read reply's rows of {name!r} are not {ids.size} rows (got "
                        f"{None if r is None else r.shape}) [{self.address}]")
                rows.append((r, version))
            return post((self._snapshots(got), rows))

        def recover(exc: PSError):
            if exc.code == Code.RESOURCE_EXHAUSTED:   # larger than one reply carries
                return separate()
            if exc.code == Code.UNIMPLEMENTED:   # an older server: no bulk service
                self.bulk = False
                return separate()
            raise exc
        req = ps_pb2.ReadRequest(names=names, max_bytes=max(1, self._tensor_limit(
            methods.BULK_READ)))
        for name, ids in flat:
            T.fill(req.gathers.add(name=name).ids, ids)
        _set_sync_read(req, sync_step)
        want = [(name, None) for name in names]
        return self._invoke(wait, methods.BULK_READ, req, done, recover,
                            receiver=lambda recv_into, n: wire.receive_read_reply(
                                recv_into, n, want, rows_out or ()))

    def push_dense_and_sparse(self, dense, sparse: Sequence[tuple], *,
                              sync: SyncSpec | None = None) -> list[int]:
        """Dense updates ([(name, grad[, update_id])]) and row-wise ones
        ([(name, ids, rows, update_id)]) in one call (async, within one
        frame or message; otherwise the separate calls). Returns the
        versions after the dense updates, then after the sparse ones.
        Validated in full first when one call; see push_many and push_sparse."""
        return self._push_dense_and_sparse(dense, sparse, True, sync)

    def push_dense_and_sparse_async(self, dense, sparse: Sequence[tuple], *,
                                    sync: SyncSpec | None = None) -> Handle:
        return self._push_dense_and_sparse(dense, sparse, False, sync)

    def _push_dense_and_sparse(self, dense, sparse, wait: bool, sync: SyncSpec | None):
        items = list(dense.items()) if isinstance(dense, Mapping) else list(dense)
        sparse = [(name, _as_ids(ids, "sparse push").reshape(-1), np.asarray(rows), uid)
                  for name, ids, rows, uid in sparse]

        def separate(exc: PSError | None = None):
            versions = self._dense("push", items, True, sync, use_shm=False) if items else []
            return versions + [self._push_sparse(name, ids, rows, True, sync, uid)
                               for name, ids, rows, uid in sparse]
        if self._shm_for(0) and sync is None and (sparse or items):
            arrays = [np.asarray(item[1]) for item in items]
            uids = [item[2] if len(item) > 2 else 0 for item in items]
            out = self._shm_push(items, arrays, uids, wait, None, separate, sparse)
            if out is not None:
                return out
        total = sum(np.asarray(item[1]).nbytes for item in items) + sum(
            ids.nbytes + rows.nbytes for _, ids, rows, _ in sparse)
        if self.bulk and sync is None and sparse and total <= self._tensor_limit(
                methods.BULK_PUSH):
            return self._push_bulk(items, sparse, wait, separate)
        if not wait and self.local:   # a socket: every call sent now, no thread
            sent = ([self._dense("push", items, False, sync, use_shm=False)] if items else []) \
                + [self._push_sparse(name, ids, rows, False, sync, uid)
                   for name, ids, rows, uid in sparse]
            return _together(sent, lambda got: (got[0] if items else []) + got[bool(items):],
                             self.address)
        return self._run(wait, separate)

    def _push_bulk(self, items, sparse, wait: bool, separate):
        """push_dense_and_sparse (async) as one ParameterServerBulk.Push
        (PushRequest.sparse), its arrays' memory sent as it is over a socket."""
        uids = [item[2] if len(item) > 2 else 0 for item in items]
        raw = wire.encode_push_request(
            [(item[0], np.asarray(item[1]), uid) for item, uid in zip(items, uids)], b"",
            wire.SCATTER, sparse=sparse)

        def done(reply):
            versions = list(reply.versions)
            if len(versions) == len(items):   # a server from before PushRequest.sparse
                # applied the dense ones only: the rest apart (their keys kept)
                return versions + [self._push_sparse(name, ids, rows, True, None, uid)
                                   for name, ids, rows, uid in sparse]
            if len(versions) != len(items) + len(sparse):
                raise InvalidArgument(
                    f"the push reply has {len(versions)} versions for {len(items)} dense and "
                    f"{len(sparse)} row-wise updates [{self.address}]")
            return versions

        def recover(exc: PSError):
            if exc.code == Code.UNIMPLEMENTED:   # an older server: no bulk service
                self.bulk = False
                return separate()
            raise exc
        return self._invoke(wait, methods.BULK_PUSH, raw, done, recover)
