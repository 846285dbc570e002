"""The ParameterServer, ParameterServerBulk and SharedMemory services: wire
messages in, psserver.core.store.VariableStore calls, wire messages out.

Thin on purpose: validation and state live in the store and its parts
(``store.steps``, ``store.replicator``, ``store.saver``); handlers convert
messages, raise the store's typed errors (each transport maps them once:
psserver/serve/rpc.py, psserver/serve/ipc_server.py), reassemble uploaded streams
(``_assemble``) and lay replies out in shared-memory segments. The
DynamicTables service beside them is psserver/serve/tables.py.
"""
from __future__ import annotations

import logging
import time
from typing import Iterator

import numpy as np

from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
from psserver.contract import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Initializer,
    Peer,
    SyncSpec,
    TableRead,
    TableWrite,
    VariableMeta,
    routing,
    shm,
    wire,
    wire_decode,
)
from psserver.contract import tensor as T
from psserver.core import replication as R
from psserver.core.store import VariableStore
from psserver.core.table_store import TableStore
from psserver.errors import InvalidArgument, OutOfRange, ResourceExhausted
from psserver.link import tensor_proto as TP
from psserver.serve import rpc
from psserver.serve.handling import deadline_of, save_fields, sync_spec_of
from psserver.serve.leave import Leaving
from psserver.serve.tables import TableServicer, spec_json

log = logging.getLogger(__name__)



def meta_to_proto(m: VariableMeta) -> ps_pb2.VariableMeta:
    return ps_pb2.VariableMeta(
        name=m.name, dtype=m.dtype, shape=m.shape, version=m.version,
        optimizer=ps_pb2.OptimizerSpec(name=m.optimizer, params=m.optimizer_params),
        nbytes=m.nbytes, slot_nbytes=m.slot_nbytes, allow_nonfinite=m.allow_nonfinite,
        sync_steps=m.sync_steps, dropped_gradients=m.dropped_gradients, role=m.role,
        epoch=m.epoch, backup=_peer_to_proto(m.backup), gathering=m.gathering)


def _peer_to_proto(peer: Peer | None) -> ps_pb2.ReplicaPeer | None:
    return None if peer is None else ps_pb2.ReplicaPeer(address=peer.address, name=peer.name)


def _peer(msg, field: str = "backup") -> Peer | None:
    """The ReplicaPeer in msg.<field>, or None when unset."""
    if not msg.HasField(field):
        return None
    p = getattr(msg, field)
    return Peer(p.address, p.name)


def _records(request: ps_pb2.ReplicateRequest, arrays) -> list[R.Record]:
    """The records of a Replicate request, their tensors already decoded in
    tensors_of's order."""
    it = iter(arrays)
    out = []
    for r in request.records:
        tensor = next(it)
        ids = next(it) if r.HasField("ids") else None
        evicted = next(it) if r.HasField("evicted") else None
        out.append(R.Record(r.name, r.epoch, r.version, r.update_id, r.sync_steps,
                            int(r.kind), tensor, ids, evicted))
    return out


def _sparse_ids(ids: np.ndarray, name: str) -> np.ndarray:
    if T.dtype_name(ids.dtype) not in T.ID_DTYPES:
        raise InvalidArgument(f"sparse push ids of {name!r} must be int32 or int64, got "
                              f"{ids.dtype.name}")
    return ids


def _push_updates(store: VariableStore, dense: list, rows: list, sync: SyncSpec | None,
                  deadline: float | None, acked: list | None = None) -> ps_pb2.UpdateReply:
    """A push applied (Push, Upload, the bulk push and the shared-memory push
    all come here): ``dense`` [(name, gradient, update_id)] and row-wise
    ``rows`` [(name, ids, rows, update_id, own_sync)] (``own_sync``: the
    entry carries sync info of its own). Row-wise updates in a push are
    asynchronous, the one place this rule is kept: a push with ``sync`` set,
    or an entry with its own, that carries them is refused whole
    (InvalidArgument, nothing applied); sync row-wise gradients go in
    PushSparse, one variable per call. ``acked``: as VariableStore.push's
    (asynchronous updates only)."""
    if rows:
        sparse = []
        for name, ids, values, update_id, own_sync in rows:
            if sync is not None or own_sync:
                raise InvalidArgument(
                    f"the row-wise update of {name!r} comes with sync info, but row-wise "
                    "gradients in a push are asynchronous; nothing was applied. Send sync "
                    "ones with PushSparse, one variable per call")
            sparse.append((name, _sparse_ids(ids, name), values, update_id))
        return ps_pb2.UpdateReply(versions=store.push(dense, sparse, deadline, acked))
    if sync is None:
        return ps_pb2.UpdateReply(versions=store.push(dense, (), deadline, acked))
    out = store.steps.push([(n, a) for n, a, _ in dense], sync, deadline)
    return ps_pb2.UpdateReply(versions=[v for v, _ in out], dropped=[d for _, d in out])


def _sync_step(request) -> int | None:
    return request.sync.step if request.HasField("sync") else None


def _table_read(i: int, t: ps_pb2.TableLookup) -> TableRead:
    """ReadRequest.table_lookups[i] as the table store takes it (decoded, not checked)."""
    what = f"table_lookups[{i}] ({t.name!r})"

    def opt(field: str, dtypes):
        return TP.decode(getattr(t, field), dtypes, f"{what} {field}") if t.HasField(field) \
            else None
    return TableRead(t.name, TP.decode(t.keys, T.ID_DTYPES, f"{what} keys"),
                     opt("counts", T.ID_DTYPES), not t.no_admit, opt("offsets", T.ID_DTYPES),
                     opt("weights", T.VALUE_DTYPES), _sync_step(t))


def _table_write(name: str, keys, grads, update_id: int, sync_raw: bytes | None, offsets,
                 weights) -> TableWrite:
    """A PushRequest.table_updates entry (wire_decode) as the table store takes it."""
    sync = None if sync_raw is None else SyncSpec.of(rpc.parse(ps_pb2.SyncInfo, sync_raw))
    return TableWrite(name, keys, grads, int(update_id), sync, offsets, weights)


def tensors_of(request) -> list[ps_pb2.Tensor]:
    """The Tensor fields of a request, in their wire order (see UploadFrame)."""
    if isinstance(request, ps_pb2.CreateVariableRequest):
        first = [request.initial_value] if request.HasField("initial_value") else []
        return first + [s.tensor for s in request.slots]
    if isinstance(request, ps_pb2.PushRequest):
        return [u.tensor for u in request.updates] + [
            t for u in request.sparse for t in (u.ids, u.values)]
    if isinstance(request, ps_pb2.AssignRequest):
        return [u.tensor for u in request.updates]
    if isinstance(request, ps_pb2.PushSparseRequest):
        return [request.ids, request.values]
    if isinstance(request, ps_pb2.ReplicateRequest):
        return [t for r in request.records
                for t in [r.tensor] + [getattr(r, f) for f in ("ids", "evicted")
                                       if r.HasField(f)]]
    raise InvalidArgument(f"no tensors in a {type(request).__name__}")


def _assemble(first_tensors: list[ps_pb2.Tensor], frames: Iterator[ps_pb2.UploadFrame],
              max_bytes: int) -> list[np.ndarray]:
    """Complete each tensor's data from the chunks of the frames that follow."""
    specs = [TP.spec(t, what=f"tensor {i}") for i, t in enumerate(first_tensors)]
    total = sum(n for _, _, n in specs)
    if total > max_bytes:
        raise ResourceExhausted(
            f"upload declares {total} bytes of tensors, over this server's limit of "
            f"{max_bytes}; split the variable into more shards")
    bufs = [np.empty(n, np.uint8) for _, _, n in specs]
    fill = [0] * len(specs)
    for i, t in enumerate(first_tensors):
        if len(t.data) > specs[i][2]:
            raise InvalidArgument(f"tensor {i} carries more bytes than its shape needs")
        bufs[i][:len(t.data)] = np.frombuffer(t.data, np.uint8)
        fill[i] = len(t.data)
    cur = 0
    for frame in frames:
        if frame.WhichOneof("request") is not None:
            raise InvalidArgument("only the first upload frame may carry a request")
        chunk = np.frombuffer(frame.chunk, np.uint8)
        while chunk.size:
            while cur < len(specs) and fill[cur] == specs[cur][2]:
                cur += 1
            if cur == len(specs):
                raise InvalidArgument("upload sent more bytes than its tensors declare")
            take = min(chunk.size, specs[cur][2] - fill[cur])
            bufs[cur][fill[cur]:fill[cur] + take] = chunk[:take]
            fill[cur] += take
            chunk = chunk[take:]
    for i, (_, _, n) in enumerate(specs):
        if fill[i] != n:
            raise InvalidArgument(
                f"upload ended after {fill[i]} of the {n} bytes tensor {i} declares; "
                "nothing was applied")
    return [b.view(dt).reshape(shape) for b, (dt, shape, _) in zip(bufs, specs)]


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, store: VariableStore, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_upload_bytes: int = 1 << 40):
        self.store = store
        self.max_message_bytes = max_message_bytes
        # A frame must fit in one message, whatever the two options say.
        self.chunk_bytes = max(1, min(chunk_bytes, max_message_bytes))
        self.max_upload_bytes = max_upload_bytes
        self.server_id = store.saver.incarnation   # random per process start
        self.shared_memory = SharedMemoryServicer(store)
        # dynamic embedding tables: beside the variables, in the same registry and budget
        self.tables = TableServicer(TableStore.beside(store, describe_spec=spec_json),
                                    max_message_bytes)
        self.data_port = 0   # set by create_server when it serves one (psserver/ipc.py)
        self.leave = Leaving(store.registry, 0.0)   # (its timeout: psserver --leave-timeout)

    # -- plumbing (handlers raise typed errors; each transport maps them once:
    # psserver/serve/rpc.py for gRPC, psserver/serve/ipc_server.py for sockets) ----------
    def _decoded(self, request) -> list[np.ndarray]:
        return [TP.decode(t, what=f"tensor {i}") for i, t in enumerate(tensors_of(request))]

    # -- handlers shared by the unary and the Upload paths -----------------
    def _create(self, req: ps_pb2.CreateVariableRequest, arrays,
                context=None) -> ps_pb2.VariableMeta:
        init = None
        if req.HasField("initializer"):
            i = req.initializer
            init = Initializer(i.kind, i.value, i.mean, i.stddev, i.minval, i.maxval, i.seed)
        opt = req.optimizer
        has_value = req.HasField("initial_value")
        value = arrays[0] if has_value else None
        slot_arrays = arrays[1:] if has_value else arrays
        slots = {s.name: a for s, a in zip(req.slots, slot_arrays)} if req.slots else None
        if slots is not None and len(slots) != len(req.slots):
            raise InvalidArgument("a slot name appears twice")
        meta = self.store.create(
            req.name, req.dtype, req.shape,
            initial_value=value, initializer=init,
            optimizer=opt.name or "sgd", optimizer_params=dict(opt.params),
            allow_nonfinite=req.allow_nonfinite, exist_ok=req.exist_ok,
            slots=slots, version=req.version, overwrite=req.overwrite,
            applied_ids=list(req.applied_ids), sync_steps=req.sync_steps, role=int(req.role),
            epoch=req.epoch, backup=_peer(req), deadline=deadline_of(context))
        return meta_to_proto(meta)

    def _replicate(self, req: ps_pb2.ReplicateRequest, arrays,
                   context=None) -> ps_pb2.ReplicateReply:
        acks = self.store.replicator.replicate(_records(req, arrays))
        return ps_pb2.ReplicateReply(acks=[ps_pb2.ReplicaAck(name=n, version=v, status=s)
                                           for n, v, s in acks])

    def _push(self, req, arrays, context=None) -> ps_pb2.UpdateReply:
        if req.table_updates:   # (refused before anything is applied)
            raise InvalidArgument("Push and Upload do not update dynamic tables "
                                  "(table_updates): use ParameterServerBulk.Push")
        k = len(req.updates)
        updates = [(u.name, a, u.update_id) for u, a in zip(req.updates, arrays[:k])]
        rows = [(u.name, ids, values, u.update_id, u.HasField("sync"))
                for u, ids, values in zip(req.sparse, arrays[k::2], arrays[k + 1::2])]
        return _push_updates(self.store, updates, rows, sync_spec_of(req), deadline_of(context))

    def _assign(self, req, arrays, context=None) -> ps_pb2.UpdateReply:
        return ps_pb2.UpdateReply(versions=self.store.assign(
            zip([u.name for u in req.updates], arrays), deadline_of(context)))

    def _push_sparse(self, req, arrays, context=None) -> ps_pb2.UpdateReply:
        ids, values = arrays
        _sparse_ids(ids, req.name)
        spec = sync_spec_of(req)
        if spec is None:
            return ps_pb2.UpdateReply(versions=self.store.push(
                (), [(req.name, ids, values, req.update_id)], deadline_of(context)))
        version, dropped = self.store.steps.push_rows(req.name, ids, values, spec,
                                                      deadline_of(context))
        return ps_pb2.UpdateReply(versions=[version], dropped=[dropped])

    # -- RPCs ----------------------------------------------------------------
    def GetServerInfo(self, request, context):
        self.leave.asked(request.drains)
        return ps_pb2.ServerInfo(
            leaving=self.leave.leaving,
            protocol_version=PROTOCOL_VERSION, server_id=self.server_id,
            max_message_bytes=self.max_message_bytes,
            num_variables=len(self.store), total_bytes=self.store.total_bytes(),
            host=routing.announce(
                ps_pb2.HostInfo(), ipc_socket=self.shared_memory.ipc_socket,
                shared_memory=bool(self.shared_memory.ipc_socket), data_port=self.data_port))

    def CreateVariable(self, request, context):
        return self._create(request, self._decoded(request), context)

    def Replicate(self, request, context):
        return self._replicate(request, self._decoded(request))

    def Reconfigure(self, request, context):
        if not request.timeout >= 0:
            raise InvalidArgument(f"timeout must be >= 0, got {request.timeout}")
        deadline = deadline_of(context)
        if request.timeout > 0:
            own = time.monotonic() + request.timeout
            deadline = own if deadline is None else min(deadline, own)
        metas = self.store.replicator.reconfigure_all(
            [(c.name, int(c.action), c.epoch, _peer(c)) for c in request.changes], deadline)
        return ps_pb2.ReconfigureReply(variables=[meta_to_proto(m) for m in metas])

    def DeleteVariable(self, request, context):
        self.store.delete(request.name)
        return ps_pb2.DeleteReply()

    def GetMeta(self, request, context):
        return meta_to_proto(self.store.meta(request.name))

    def ListVariables(self, request, context):
        return ps_pb2.ListReply(variables=[meta_to_proto(m) for m in self.store.list()])

    def _read_limit(self, request, context=None, rows: int = 0) -> tuple[int, int]:
        """(the bytes a Read may return, its values' bytes); ResourceExhausted
        (before anything is read) when its values and ``rows`` bytes of
        looked-up rows exceed it."""
        # a socket's context allows a frame's worth (psserver/serve/ipc_server.py)
        T.read_as(request.value_dtype)   # refused before anything is read
        limit = getattr(context, "max_message_bytes", self.max_message_bytes)
        if request.max_bytes > 0:
            limit = min(limit, request.max_bytes)
        total = sum(self.store.nbytes(name) for name in request.names)
        if total + rows > limit:
            also = f" and {rows} bytes of looked-up rows" if request.gathers else ""
            raise ResourceExhausted(
                f"reading {list(request.names)} returns {total} bytes{also}, more than "
                f"this call allows ({limit}); use ReadStream and Gather (PSClient does "
                "so by itself)")
        return limit, total

    def _lookups(self, request, context, step, deadline) -> tuple[list, int, int]:
        """A Read's row lookups (ReadRequest.gathers) as [(version, rows)], its
        limit (_read_limit) and the bytes its values and rows take of it:
        every lookup's ids decoded and the reply's size checked before any
        row is copied (each lookup's ids are checked against its variable as
        it is made; a refusal changes nothing)."""
        ids = [(g.name, TP.decode(g.ids, T.ID_DTYPES, f"gathers[{i}] ids ({g.name!r})"))
               for i, g in enumerate(request.gathers)]
        rows = sum(self.store.rows_nbytes(name, i.size) for name, i in ids)
        limit, values = self._read_limit(request, context, rows)
        return [self.store.gather(name, i, step, deadline) for name, i in ids], limit, \
            values + rows

    def bulk_read(self, request, context):
        """ParameterServerBulk.Read: the reply framed by hand, one copy of the
        data. Everything is checked before anything is read: the values, the
        rows looked up (gathers: read first, they change nothing) and the
        dynamic-table look-ups (made next: they count and admit; all
        checked before any is made), then the values are read."""
        step, deadline = _sync_step(request), deadline_of(context)
        reads = [_table_read(i, t) for i, t in enumerate(request.table_lookups)]
        gathered, limit, used = self._lookups(request, context, step, deadline)
        tables = self.tables.store
        rows = tables.make_reads(tables.check_reads(reads, limit - used), deadline) \
            if reads else ()
        with self.store.locked_values(list(request.names), step, deadline) as values:
            if T.read_as(request.value_dtype) is not None:   # converted under the locks
                values = [(name, version, T.as_float16(arr)) for name, version, arr in values]
            return wire.encode_read_reply(values, getattr(context, "reply_buffer", None),
                                          gathered, rows)

    def bulk_push(self, raw: bytes, context):
        """ParameterServerBulk.Push: the request read by hand, its arrays views
        of it (a socket's frame is not used again while a view of it lives:
        the store may keep a row-wise update's arrays). Its dynamic-table
        updates are checked with the rest before anything is applied, and
        applied after the variables' (each once per update key)."""
        updates, sync_raw, rows, table_updates = wire_decode.decode_push_request(raw)
        sync = None if sync_raw is None else \
            SyncSpec.of(rpc.parse(ps_pb2.SyncInfo, sync_raw))   # present, maybe empty
        deadline = deadline_of(context)
        if not table_updates:
            return _push_updates(self.store, updates, rows, sync, deadline)
        tables = self.tables.store
        checked = tables.check_writes([_table_write(*u) for u in table_updates])
        acked: list = []   # one wait for the variables' and the tables' backups: one call each
        with R.sent_on_failure(acked):
            reply = _push_updates(self.store, updates, rows, sync, deadline, acked) \
                if updates or rows else ps_pb2.UpdateReply()
            for done in tables.apply_writes(checked, deadline, acked):
                reply.tables.add(updated=done.updated, dropped=done.dropped, step=done.step,
                                 late=done.late)
        self.store.replicator.wait_acked(acked, deadline)
        return reply

    def _read(self, request, context=None):
        step, deadline = _sync_step(request), deadline_of(context)
        if request.table_lookups:
            raise InvalidArgument("Read does not look up dynamic tables (table_lookups): use "
                                  "ParameterServerBulk.Read")
        gathered, limit, _ = self._lookups(request, context, step, deadline)
        half = T.read_as(request.value_dtype) is not None
        reply, total = ps_pb2.ReadReply(), 0
        for name in request.names:
            dtype, shape, version, data = self.store.read_bytes(name, step, deadline)
            if half:
                arr = T.as_float16(np.frombuffer(data, T.check_dtype(dtype)))
                dtype, data = T.dtype_name(arr.dtype), arr.tobytes()
            total += len(data)
            if total > limit:   # a concurrent re-create grew it
                raise ResourceExhausted(
                    f"reading {list(request.names)} returns over {limit} bytes; use "
                    "ReadStream (PSClient does so by itself)")
            v = reply.values.add(name=name, version=version)
            v.value.dtype = dtype
            v.value.shape.extend(shape)
            v.value.data = data
        for version, rows in gathered:
            TP.fill(reply.gathered.add(version=version).rows, rows)
        return reply

    def Read(self, request, context):
        return self._read(request, context)

    def ReadStream(self, request, context):
        if request.gathers or request.table_lookups:
            raise InvalidArgument("ReadStream does not look up rows (gathers, table_lookups): "
                                  "use ParameterServerBulk.Read, or Gather, for them")
        step = self.chunk_bytes
        half = T.read_as(request.value_dtype) is not None
        sync_step, deadline = _sync_step(request), deadline_of(context)
        for name in request.names:
            version, arr = self.store.snapshot(name, sync_step, deadline)
            if half:
                arr = T.as_float16(arr)
            flat = memoryview(arr.reshape(-1).view(np.uint8))
            yield ps_pb2.ReadFrame(value=ps_pb2.VariableValue(
                name=name, version=version,
                value=ps_pb2.Tensor(dtype=T.dtype_name(arr.dtype), shape=arr.shape,
                                    data=bytes(flat[:step]))))
            for off in range(step, len(flat), step):
                yield ps_pb2.ReadFrame(chunk=bytes(flat[off:off + step]))

    def Push(self, request, context):
        return self._push(request, self._decoded(request), context)

    def Assign(self, request, context):
        return self._assign(request, self._decoded(request))

    def Gather(self, request, context):
        ids = TP.decode(request.ids, T.ID_DTYPES, "gather ids")
        nbytes = self.store.rows_nbytes(request.name, ids.size)   # before any row is copied
        if nbytes > self.max_message_bytes:
            raise ResourceExhausted(
                f"gather of {ids.size} rows returns {nbytes} bytes, over the "
                f"{self.max_message_bytes}-byte message limit; gather fewer ids per "
                "call (PSClient splits large gathers by itself)")
        version, rows = self.store.gather(request.name, ids, _sync_step(request),
                                          deadline_of(context))
        return wire.encode_gather_reply(version, rows)   # a GatherReply, framed by hand

    def PushSparse(self, request, context):
        return self._push_sparse(request, self._decoded(request), context)

    def Save(self, request, context):
        saved = self.store.saver.save_point(request.directory, list(request.names),
                                            **save_fields(request))
        return ps_pb2.SaveReply(
            files=[ps_pb2.SavedFile(name=s.name, file=s.file, version=s.version, bytes=s.bytes,
                                    kind=s.kind, rows=s.rows, crc32=s.crc32) for s in saved],
            incarnation=self.store.saver.incarnation)

    def CommitSave(self, request, context):
        nvars, ntables = self.store.saver.commit_save(request.save_id, request.stream,
                                                      request.incarnation)
        return ps_pb2.CommitSaveReply(variables=nvars, tables=ntables)

    def AbandonStep(self, request, context):
        self.store.steps.abandon(request.step, request.replica)
        return ps_pb2.AbandonReply()

    def Upload(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("request") is None:
            raise InvalidArgument("the first upload frame must carry a request")
        kind = first.WhichOneof("request")
        req = getattr(first, kind)
        arrays = _assemble(tensors_of(req), request_iterator, self.max_upload_bytes)
        if kind == "create":
            return ps_pb2.UploadReply(created=self._create(req, arrays, context))
        if kind == "replicate":
            return ps_pb2.UploadReply(replicated=self._replicate(req, arrays))
        handler = {"push": self._push, "assign": self._assign,
                   "push_sparse": self._push_sparse}[kind]
        return ps_pb2.UploadReply(updated=handler(req, arrays, context))


class SharedMemoryServicer(ps_pb2_grpc.SharedMemoryServicer):
    """Same-host reads and pushes through client segments (psserver/contract/shm.py)."""

    def __init__(self, store: VariableStore, segments: shm.Segments | None = None):
        self.store = store
        self.segments = segments if segments is not None else shm.Segments()
        self.ipc_socket = ""   # set by create_server when it serves its Unix socket

    def Attach(self, request, context):
        return ps_pb2.ShmAttachReply(
            segment=self.segments.attach(request.name, request.nbytes, request.pid, request.fd))

    def Share(self, request, context):
        reply = ps_pb2.ShmShareReply()
        if not shm.direct_reads_available():
            for name in request.names:
                self.store.meta(name)   # NotFound as on any platform
                reply.variables.add(name=name)
            return reply
        for name, shared in zip(request.names, self.store.share(list(request.names))):
            v = reply.variables.add(name=name)
            if shared is not None:
                v.path, v.nbytes, v.dtype = shared[:3]
                v.shape[:], v.tag = shared[3], shared[4]
        return reply

    def Detach(self, request, context):
        self.segments.detach(request.segment)
        return ps_pb2.ShmDetachReply()

    def Read(self, request, context):
        with self.segments.mapped(request.segment) as buf:
            return self._read_into(request, buf, context)

    def _read_into(self, request: ps_pb2.ShmReadRequest, buf: memoryview,
                   context) -> ps_pb2.ShmReadReply:
        names, step, deadline = list(request.names), _sync_step(request), deadline_of(context)
        # The ids are copied out first: the client's memory may change under us.
        gathers = [(g.name, _segment_array(g.ids, buf, f"gather {i} ids ({g.name!r})",
                                           T.ID_DTYPES).copy())
                   for i, g in enumerate(request.gathers)]
        if not 0 <= request.out_offset <= len(buf):
            raise InvalidArgument(f"out_offset {request.out_offset} is outside the "
                                  f"{len(buf)}-byte segment")
        seg = np.frombuffer(buf, dtype=np.uint8)
        reply = ps_pb2.ShmReadReply()
        end = shm.align(request.out_offset)

        def place(arr: np.ndarray, what: str) -> int:
            nonlocal end
            off = end
            if off + arr.nbytes > seg.size:
                raise OutOfRange(
                    f"shared-memory segment of {seg.size} bytes is {shm.TOO_SMALL} of "
                    f"{what} (it needs {off + arr.nbytes}); attach a larger one")
            seg[off:off + arr.nbytes] = arr.reshape(-1).view(np.uint8)
            end = shm.align(off + arr.nbytes)
            return off
        try:
            if names:
                with self.store.locked_values(names, step, deadline) as values:
                    for name, version, arr in values:
                        reply.values.add(name=name, dtype=T.dtype_name(arr.dtype), shape=arr.shape,
                                         offset=place(arr, repr(name)), version=version)
            for name, ids in gathers:
                version, rows = self.store.gather(name, ids, step, deadline)
                reply.gathered.add(name=name, dtype=T.dtype_name(rows.dtype), shape=rows.shape,
                                   offset=place(rows, f"the rows of {name!r}"),
                                   version=version)
        finally:   # the array over the segment goes before the segment is unmapped
            seg = None  # noqa: F841 (the closure's cell: place() holds it too)
        return reply

    def Push(self, request, context):
        with self.segments.mapped(request.segment) as buf:
            updates = _segment_updates(request, buf)
            sparse = [(u.name,
                       _segment_array(u.ids, buf, f"sparse update {i} ids ({u.name!r})",
                                      T.ID_DTYPES).copy(),
                       _segment_array(u.rows, buf, f"sparse update {i} rows ({u.name!r})"
                                      ).copy(),
                       u.update_id, False)   # (no sync field of its own)
                      for i, u in enumerate(request.sparse)]
            try:
                # Applied before the segment is unmapped; the store keeps no
                # reference to a dense gradient (sync mode adds it into its
                # own sum); a sparse one is copied out above (its arrays may
                # be kept as they are: the replication record).
                return _push_updates(self.store, updates, sparse, sync_spec_of(request),
                                     deadline_of(context))
            finally:
                updates.clear()
                sparse.clear()


def _segment_array(t: ps_pb2.ShmTensor, buf: memoryview, what: str,
                   allowed=T.WIRE_DTYPES) -> np.ndarray:
    """The array a ShmTensor describes, viewing buf (checked to lie inside it)."""
    dt, shape, n = TP.spec(t, allowed, what)
    if t.offset < 0 or t.offset % dt.itemsize or t.offset + n > len(buf):
        raise InvalidArgument(
            f"{what}: {n} bytes at offset {t.offset} do not lie in the "
            f"{len(buf)}-byte segment at a multiple of {dt.itemsize}")
    return np.frombuffer(buf, dtype=dt, count=n // dt.itemsize, offset=t.offset).reshape(shape)


def _segment_updates(request: ps_pb2.ShmPushRequest, buf: memoryview) -> list:
    """[(name, array viewing buf, update_id)] for a ShmPushRequest's dense updates."""
    return [(u.name, _segment_array(u, buf, f"update {i} ({u.name!r})"), u.update_id)
            for i, u in enumerate(request.updates)]
