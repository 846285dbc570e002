"""The same-host data path of a PSClient: shared-memory segments and direct reads.

A client whose route has shared memory (psserver/contract/routing.py) reads and
pushes through segments it attaches (psserver/contract/shm.py): the Unix socket
carries names, shapes and offsets, and the tensor bytes never cross a
socket (``SegmentPath.read``, ``push``). Asynchronous reads copy straight
from the server's memory (``SegmentPath.direct``: a seqlock, no call).

Whatever refers to the server's process (attached segments, mapped
values) belongs to one incarnation of it (TaskChannel.incarnation): when
the server restarted, it is all dropped before anything is read (no value
of a dead process is ever served). A server that will not take this
process's segments (it cannot open its memory) is refused for good
(``TaskChannel.refuse(routing.SHM)``: the route is planned without them);
a call whose segment the server no longer knows (it restarted, or let it
expire) or finds too small is made again without the segment (``fallback``).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import numpy as np

from protos.pstrain.v1 import ps_pb2
from psserver.client.results import dest, set_sync, set_sync_read
from psserver.contract import SyncSpec, routing, shm, wire
from psserver.contract import tensor as T
from psserver.errors import Code, PSError
from psserver.link import methods
from psserver.link import tensor_proto as TP
from psserver.link.channel import TaskChannel
from psserver.link.pending import Pending

log = logging.getLogger(__name__)

#: The most variables one client maps for direct reads (each map holds a file
#: descriptor); further ones are read through their server.
MAX_MAPPED = 256

#: Codes a server answers with once it is done with a call's segment (any
#: other error may have come while it was still using it).
_SERVER_DONE = frozenset({
    Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION,
    Code.RESOURCE_EXHAUSTED, Code.UNAUTHENTICATED, Code.UNIMPLEMENTED, Code.OUT_OF_RANGE,
    Code.PERMISSION_DENIED})


class SegmentPath:
    """See the module. ``direct_on``: this client may map servers' values."""

    def __init__(self, channel: TaskChannel, direct_on: bool):
        self._channel = channel
        self._lock = threading.Lock()
        self._arena: shm.Arena | None = None
        self.direct_on = direct_on and shm.direct_reads_available()
        self._mapped: dict[str, shm.MappedValue | None] = {}
        self._incarnation = channel.incarnation

    # -- one incarnation of the server ------------------------------------------------
    def _current(self) -> None:
        """Drop what belongs to a process of the server that is gone."""
        if self._channel.incarnation == self._incarnation:
            return
        with self._lock:
            arena, self._arena = self._arena, None
            mapped, self._mapped = self._mapped, {}
            self._incarnation = self._channel.incarnation
        if arena is not None:
            arena.forget()
            arena.close()
        for m in mapped.values():
            if m is not None:
                m.close()

    def close(self) -> None:
        with self._lock:
            arena, self._arena = self._arena, None
            mapped, self._mapped = self._mapped, {}
        if arena is not None:
            if not self._channel.alive():
                arena.forget()   # its server is gone: no Detach to wait 2 s for each
            arena.close()
        for m in mapped.values():
            if m is not None:
                m.close()

    # -- direct reads ---------------------------------------------------------------------
    def direct(self, names: Sequence[str], out) -> list[tuple] | None:
        """[(name, version, array)] copied from the server's shared values (a
        seqlock, no call), or None: read through the server instead (a name
        not shared, one deleted or always being written, or the server gone)."""
        if not self._channel.alive():   # its memory is a dead process's now
            self._current()
            return None
        self._current()
        mapped = self._mapped
        if any(n not in mapped for n in names):
            self._map([n for n in names if n not in mapped])
        got = []
        for i, name in enumerate(names):
            m = mapped.get(name)
            if m is None:
                return None
            try:
                d = dest(out, i, m.value)
                read = m.read_into(d)
            except (TypeError, AttributeError, ValueError):   # closed by another thread
                return None
            if not read:   # deleted (re-created?), or never still: ask the server
                if read is False:
                    self._unmap([name])
                return None
            version, arr = read
            if d is None:
                arr.flags.writeable = False
            got.append((name, version, arr))
        return got

    def _map(self, names: list[str]) -> None:
        reply = self._channel.grpc.call(methods.SHM_SHARE, ps_pb2.ShmShareRequest(names=names),
                                        self._channel.timeout)
        for v in reply.variables:
            mapped = None
            if v.path and sum(m is not None for m in self._mapped.values()) < MAX_MAPPED:
                try:
                    mapped = shm.MappedValue(v.path, v.dtype, list(v.shape), v.nbytes, v.tag)
                except OSError:   # not ours to open (another user, another pid namespace)
                    mapped = None
            with self._lock:
                old = self._mapped.get(v.name)
                self._mapped[v.name] = mapped
            if old is not None:
                old.close()

    def _unmap(self, names: list[str]) -> None:
        with self._lock:
            gone = [self._mapped.pop(n, None) for n in names]
        for m in gone:
            if m is not None:
                m.close()

    # -- segments -----------------------------------------------------------------------
    def _take(self, nbytes: int) -> shm.Segment | None:
        """A segment of nbytes or more, or None: the caller goes without."""
        if self._channel.incarnation != self._incarnation:
            self._current()
        arena = self._arena
        if arena is None:
            with self._lock:
                if self._arena is None:
                    self._arena = shm.Arena(self._attach, self._detach)
                arena = self._arena
        try:
            return arena.take(nbytes)
        except PSError as exc:
            if exc.code in (Code.FAILED_PRECONDITION, Code.UNIMPLEMENTED):
                log.warning("parameter server %s takes no shared memory from this process "
                            "(%s); sending tensor bytes over its socket",
                            self._channel.address, exc)
                self._channel.refuse(routing.SHM)
                return None
            raise
        except OSError:   # no memory for a segment: this transfer goes another way
            return None

    def _attach(self, seg: shm.Segment) -> int:
        return self._channel.grpc.call(methods.SHM_ATTACH, ps_pb2.ShmAttachRequest(
            name=seg.name, nbytes=seg.nbytes, pid=seg.pid, fd=seg.fd),
            self._channel.timeout).segment

    def _detach(self, seg_id: int) -> None:
        self._channel.grpc.call(methods.SHM_DETACH, ps_pb2.ShmDetachRequest(segment=seg_id),
                                2.0)

    def _send(self, method: methods.Method, req, seg: shm.Segment, arena: shm.Arena, finish,
              fallback: Callable[[PSError], object]) -> Pending:
        """A SharedMemory call using ``seg``: ``finish(reply)`` makes the
        value before the segment goes back; ``fallback(error)`` answers an
        error that says the server lost the segment (the call made again
        without it)."""
        def done(reply):
            try:
                return finish(reply)
            finally:
                arena.give(seg)

        def on_error(exc: PSError):
            # Told apart by code alone: on a SharedMemory call FAILED_PRECONDITION
            # comes only from a segment the server does not know (restarted, or
            # expired it), found before anything is done, and OUT_OF_RANGE from
            # a segment too small for the read; the call is made again without
            # the segment. Any other error (RESOURCE_EXHAUSTED included: a push
            # may have applied part of its variables) is the caller's, with its
            # update keys. After a timeout or a lost connection the server may
            # still be using the segment: it is never lent again (nor detached:
            # a late call still finds its data; the server closes it when idle).
            lost = exc.code == Code.FAILED_PRECONDITION
            arena.give(seg, broken=lost or exc.code not in _SERVER_DONE)
            if lost:
                arena.forget()   # the server restarted or expired them: attach anew
            if lost or exc.code == Code.OUT_OF_RANGE:
                return fallback(exc)
            raise exc
        try:
            return self._channel.send(method, req, post=done, recover=on_error)
        except BaseException:
            arena.give(seg, broken=True)
            raise

    def read(self, names: list[str], known: list[int], sync_step: int | None,
             gathers: Sequence[tuple[str, np.ndarray, int]] | None, out, fallback,
             snapshots: Callable) -> Pending | None:
        """Read ``names`` (their sizes ``known``) through a segment: a list of
        Snapshot (values copied into ``out``'s arrays where given); with
        ``gathers`` ([(name, 1-D ids, row bytes)]), (snapshots, [(rows,
        version)]) from the same call. None: no segment to be had."""
        paired = gathers is not None
        gathers = list(gathers or ())
        out_offset = sum(shm.align(ids.nbytes) for _, ids, _ in gathers)
        need = out_offset + sum(shm.align(n) for n in known) + sum(
            shm.align(ids.size * row) for _, ids, row in gathers)
        seg = self._take(need)
        if seg is None:
            return None
        arena = self._arena
        req = ps_pb2.ShmReadRequest(segment=seg.seg_id, names=names, out_offset=out_offset)
        set_sync_read(req, sync_step)
        off = 0
        for name, ids, _ in gathers:
            seg.array[off:off + ids.nbytes] = ids.view(np.uint8)
            req.gathers.add(name=name, ids=ps_pb2.ShmTensor(
                dtype=T.dtype_name(ids.dtype), shape=ids.shape, offset=off))
            off += shm.align(ids.nbytes)

        def copy_out(t: ps_pb2.ShmTensor, i: int | None = None) -> np.ndarray:
            """t's array copied out of the segment (into out[i] when it fits)."""
            dt, shape, n = TP.spec(t, T.WIRE_DTYPES, f"value of {t.name!r}")
            src = np.frombuffer(seg.array, dtype=dt, count=n // dt.itemsize,
                                offset=t.offset).reshape(shape)
            d = dest(out, i, src) if i is not None else None
            if d is not None:
                np.copyto(d, src)
                return d
            arr = src.copy()
            arr.flags.writeable = False
            return arr

        def finish(reply: ps_pb2.ShmReadReply):
            snaps = snapshots([(v.name, v.version, copy_out(v, i))
                               for i, v in enumerate(reply.values)])
            if not paired:
                return snaps
            return snaps, [(copy_out(g), g.version) for g in reply.gathered]
        return self._send(methods.SHM_READ, req, seg, arena, finish, fallback)

    def push(self, dense: Sequence[tuple[str, np.ndarray, int]], sync: SyncSpec | None,
             sparse: Sequence[tuple[str, np.ndarray, np.ndarray, int]], fallback
             ) -> Pending | None:
        """Dense updates [(name, grad, update_id)] (and, async only, row-wise
        ones [(name, ids, rows, update_id)]) through a segment; the versions
        after each. None: no segment to be had."""
        arrays = []   # (dtype name, bytes: checked, little-endian, contiguous as a frame's)
        need = 0
        for _, a, _ in dense:
            nd = _bytes(a)
            arrays.append(nd)
            need += (nd[1].nbytes + _ALIGN1) & _ALIGN_MASK
        pairs = []
        for _, ids, rows, _ in sparse:
            pair = (_bytes(ids), _bytes(rows))
            pairs.append(pair)
            need += ((pair[0][1].nbytes + _ALIGN1) & _ALIGN_MASK) + (
                (pair[1][1].nbytes + _ALIGN1) & _ALIGN_MASK)
        seg = self._take(need)
        if seg is None:
            return None
        arena = self._arena
        req = ps_pb2.ShmPushRequest(segment=seg.seg_id)
        if sync is not None:
            set_sync(req, sync)
        buf, end = seg.array, 0
        add = req.updates.add
        for (name, a, uid), (dt, d) in zip(dense, arrays):
            n = d.nbytes
            buf[end:end + n] = d
            add(name=name, dtype=dt, shape=a.shape, offset=end, update_id=uid)
            end += (n + _ALIGN1) & _ALIGN_MASK
        for (name, ids, rows, uid), pair in zip(sparse, pairs):
            u = req.sparse.add(name=name, update_id=uid)
            for t, a, (dt, d) in zip((u.ids, u.rows), (ids, rows), pair):
                buf[end:end + d.nbytes] = d
                t.dtype, t.offset = dt, end
                t.shape[:] = a.shape
                end += (d.nbytes + _ALIGN1) & _ALIGN_MASK
        return self._send(methods.SHM_PUSH, req, seg, arena, _versions, fallback)


_ALIGN1, _ALIGN_MASK = shm.ALIGN - 1, ~(shm.ALIGN - 1)


def _bytes(a: np.ndarray) -> tuple[str, np.ndarray]:
    """(a's dtype name, its bytes as a flat uint8 array) as a frame carries
    them (checked: a wire dtype; made contiguous and little-endian where it
    is not)."""
    name = T.WIRE_NAMES.get(a.dtype)
    if name is not None and a.flags.c_contiguous:
        return name, a.reshape(-1).view(np.uint8)
    d = wire.contiguous_bytes(a)   # (refuses other dtypes)
    return T.dtype_name(a.dtype), np.frombuffer(d, np.uint8)


def _versions(reply) -> list[int]:
    return list(reply.versions)

