"""PSClient: the Python client of one parameter-server task.

Workers and the coordinator reach every parameter server through this class.
Every method raises a subclass of ``psserver.errors.PSError`` on failure
(``InvalidArgument``, ``NotFound``, ``AlreadyExists``, ``ResourceExhausted``,
``Unauthenticated``, ``Unavailable``, ``DeadlineExceeded``...), carrying the
server's message. Nothing waits forever: every call has a deadline
(``timeout``, default 60 s; streamed transfers get extra time per byte).

Delivery: reads, gathers and metadata calls are retried by gRPC on
UNAVAILABLE (they are idempotent). Pushes and assigns are sent at most once
by this client: an ``Unavailable`` error means the update may or may not have
been applied.

Non-blocking use: the ``*_async`` methods return a ``Handle`` at once; its
``result()`` blocks for the value (or raises), as ps-lite's ``Wait(ts)``.

Tensors larger than one message (``max_message_bytes``, 64 MiB by default)
travel in frames over a stream; callers never see the difference.

PSClient is the parameter-server API; how its calls travel is below it:
psserver/channel.py (``ServerChannel``: gRPC, the route, the sockets, one
``_invoke``), psserver/client_shm.py (``SharedMemoryPath``: the same-host
layer), psserver/client_util.py (results and request helpers).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import numpy as np

from protos.pstrain.v1 import ps_pb2
from psserver import replication as R
from psserver import tensor as T
from psserver import buffers, methods, wire
from psserver.contract import (MESSAGE_OVERHEAD, Code, Initializer, InvalidArgument, PSError,
                               SyncSpec, VariableMeta)

from psserver.channel import ServerChannel
from psserver.client_shm import SharedMemoryPath
from psserver.client_tables import TableCalls
from psserver.transport import Pending
from psserver.client_util import (Handle, Snapshot, _as_ids, _fill, _halved, _meta_from_proto,
                                   _set_sync, _set_sync_read, _sync_info)

#: Dense pushes of at least this many bytes go over a socket from their
#: arrays (wire.SCATTER, one sendmsg) instead of being copied into a frame:
#: below it the copy costs less than the extra buffers.
SCATTER_BYTES = 1 << 20


class PSClient(SharedMemoryPath, TableCalls, ServerChannel):
    """Client of the parameter server at ``address`` ("host:port").

    Args:
      token: the cluster's auth token, sent on every call. None (or ""):
        ``$PSTRAIN_AUTH_TOKEN`` when it is set, as ParameterServerStrategy
        and the tasks take it; else no token.
      tls: a TLSConfig to connect with TLS (its CA to trust the server; its
        certificate and key for mutual TLS). None: plaintext.
      timeout: deadline in seconds of each call (None: no deadline).
      max_message_bytes: must match the server's; no message is larger.
      chunk_bytes: frame size of streamed uploads.
      stream_threshold_bytes: tensors above this size travel over streams
        even when they would fit one message (streams are faster for them).
      bulk: read and push through ParameterServerBulk (hand-framed messages,
        one copy of the tensor data per side; psserver/wire.py), falling back
        to the generated path on a server without it.
      wait_for_ready: queue calls until the server is up instead of failing
        with UNAVAILABLE at once (useful while a cluster starts).
      shared_memory: use the server's same-host socket and shared memory
        (psserver/ipc.py, psserver/shm.py) where its route allows
        (psserver/routing.py: same host, network namespace and user;
        segments also need the same pid namespace). ``PSTRAIN_SHM=0`` turns
        it off: the client then plans as if on another host.
      data_port: otherwise make reads, pushes, lookups and sparse pushes
        over the server's data port (psserver/ipc.py over TCP, with this
        client's TLS and token); ``PSTRAIN_DATA=0`` turns it off. False:
        gRPC only.

    The route is planned once, from the server's GetServerInfo (no call is
    made to find it out), and again after a socket breaks; ``route`` tells
    what it is.
    """

    # -- info ----------------------------------------------------------------
    def server_info(self, timeout: float | None = None) -> ps_pb2.ServerInfo:
        """The server's identity, version and what it holds (``timeout``: this
        call's deadline instead of the client's)."""
        return self._call(methods.SERVER_INFO, ps_pb2.ServerInfoRequest(), timeout=timeout)

    def get_meta(self, name: str, timeout: float | None = None) -> VariableMeta:
        m = _meta_from_proto(self._call(methods.META, ps_pb2.VariableRef(name=name),
                                        timeout=timeout))
        self._remember(name, m.nbytes, m.shape)
        return m

    def list_variables(self) -> list[VariableMeta]:
        reply = self._call(methods.LIST, ps_pb2.ListRequest())
        return [_meta_from_proto(m) for m in reply.variables]

    # -- create / delete -----------------------------------------------------
    def create_variable(self, name: str, shape: Sequence[int] | None = None,
                        dtype: str | np.dtype | None = None, *,
                        initial_value: np.ndarray | None = None,
                        initializer: Initializer | str | None = None,
                        optimizer: str = "sgd",
                        optimizer_params: Mapping[str, float] | None = None,
                        allow_nonfinite: bool = False,
                        exist_ok: bool = False,
                        slots: Mapping[str, np.ndarray] | None = None,
                        version: int = 0,
                        overwrite: bool = False,
                        applied_ids=(),
                        sync_steps: int = 0,
                        role: int = 0,
                        epoch: int = 0,
                        backup: "R.Peer | None" = None,
                        timeout: float | None = None) -> VariableMeta:
        """Create a variable on this server and return its metadata.

        Give either ``initial_value`` (shape and dtype then default to its
        own; dtype otherwise defaults to float32) or an ``initializer`` (an Initializer, or a kind name such as
        "zeros"); with neither the variable starts at zeros.
        Restoring: ``slots`` (every optimizer slot, by name), ``version``, and
        ``overwrite`` to replace an existing variable's state at once.
        Replication (psserver.replication): ``backup`` (a Peer) makes a
        primary that copies its state there before answering; ``role``,
        ``epoch`` and ``sync_steps`` are set by a primary copying its state.
        Raises InvalidArgument, AlreadyExists, ResourceExhausted.
        """
        req = ps_pb2.CreateVariableRequest(
            name=name, allow_nonfinite=allow_nonfinite, exist_ok=exist_ok,
            version=version, overwrite=overwrite, sync_steps=sync_steps, role=role,
            epoch=epoch,
            applied_ids=[int(i) for i in np.asarray(applied_ids, np.uint64).ravel()],
            optimizer=ps_pb2.OptimizerSpec(name=optimizer, params=dict(optimizer_params or {})))
        arrays = []
        if initial_value is not None:
            if initializer is not None:
                raise InvalidArgument("give initial_value or initializer, not both")
            arr = np.asarray(initial_value)
            if dtype is None:
                dtype = arr.dtype if arr.dtype.kind == "f" else np.float32
            arr = arr.astype(np.dtype(dtype), copy=False)
            if shape is None:
                shape = arr.shape
            arrays = [arr]
        if shape is None:
            raise InvalidArgument(f"create_variable({name!r}) needs a shape or an initial_value")
        dtype = "float32" if dtype is None else dtype
        req.dtype = np.dtype(dtype).name
        req.shape[:] = [int(d) for d in shape]
        if initializer is not None:
            init = Initializer(initializer) if isinstance(initializer, str) else initializer
            req.initializer.CopyFrom(ps_pb2.Initializer(**dataclasses.asdict(init)))
        if backup is not None:
            req.backup.CopyFrom(ps_pb2.ReplicaPeer(address=backup.address, name=backup.name))
        slot_items = [(k, np.asarray(v)) for k, v in (slots or {}).items()]
        tensors = arrays + [v for _, v in slot_items]
        streamed = not self._fits(sum(a.nbytes for a in tensors))
        if arrays:
            T.fill(req.initial_value, arrays[0], with_data=not streamed)
        for k, v in slot_items:
            T.fill(req.slots.add(name=k).tensor, v, with_data=not streamed)
        kw = {} if timeout is None else {"timeout": timeout}
        if streamed:
            meta = self._upload("create", req, tensors, **kw).created
        else:
            meta = self._call(methods.CREATE, req, **kw)
        m = _meta_from_proto(meta)
        self._remember(name, m.nbytes, m.shape)
        return m

    def delete_variable(self, name: str) -> None:
        self._call(methods.DELETE, ps_pb2.VariableRef(name=name))
        self._nbytes.pop(name, None)
        self._rows.pop(name, None)

    # -- reads ---------------------------------------------------------------
    def _snapshots(self, values, remember: bool = True) -> list[Snapshot]:
        """Snapshots of (name, version, array), remembering each size."""
        out = []
        for name, version, arr in values:
            if arr is None:   # (a value without its tensor: not a reply of ours)
                raise InvalidArgument(f"the read reply's value of {name!r} has no tensor "
                                      f"[{self.address}]")
            if remember:
                self._remember(name, arr.nbytes, arr.shape)
            out.append(Snapshot(name, version, arr))
        return out

    def _read_unary_post(self, reply: ps_pb2.ReadReply, remember: bool = True) -> list[Snapshot]:
        return self._snapshots(((v.name, v.version, T.decode(v.value)) for v in reply.values),
                               remember)

    def _read_many(self, names: Sequence[str], wait: bool, sync_step: int | None = None,
                   out: Sequence[np.ndarray | None] | None = None, value_dtype: str = "",
                   _into: Sequence[np.ndarray | None] | None = None):
        names = list(names)
        half = T.read_as(value_dtype) is not None
        if sync_step is None and self._direct_ok():
            got = self._direct_read(names, out)
            if got is not None:   # rounded here as the server would have
                got = _halved(got) if half else got
                return got if wait else Handle(Pending(lambda: got), target=self.address)
        known = [self._nbytes.get(n) for n in names]
        if None not in known and self._shm_for(sum(known)):
            got = self._shm_read(names, known, wait, sync_step, out=out)
            if not half:
                return got
            if wait:
                return _halved(got)
            return Handle(Pending(lambda: _halved(got.result()), got.done), target=self.address)
        if out is not None:   # the other paths fill it from what they return (over a
            # socket, each value's data is received into its out array: not copied again)
            got = self._read_many(names, wait, sync_step, value_dtype=value_dtype, _into=out)
            if wait:
                return _fill(got, out)
            return Handle(Pending(lambda: _fill(got.result(), out), got.done), target=self.address)
        bulk = self.bulk
        limit = self._tensor_limit(methods.BULK_READ if bulk else methods.READ)
        if None not in known and sum(known) > limit:
            return self._run(wait, self._read_stream, names, sync_step, value_dtype)

        def recover(exc: PSError):   # larger than a unary read should carry: stream it
            if exc.code == Code.RESOURCE_EXHAUSTED:
                return self._read_stream(names, sync_step, value_dtype)
            if bulk and exc.code == Code.UNIMPLEMENTED:   # an older server
                self.bulk = False
                return self._read_many(names, True, sync_step, value_dtype=value_dtype)
            raise exc
        req = ps_pb2.ReadRequest(names=names, max_bytes=max(1, limit), value_dtype=value_dtype)
        _set_sync_read(req, sync_step)
        # Values read as float16 are not the variables' sizes: not remembered.
        if bulk:
            want = list(zip(names, _into if _into is not None else [None] * len(names)))
            return self._invoke(wait, methods.BULK_READ, req,
                                lambda raw: self._snapshots(wire.decode_read_reply(raw), not half),
                                recover,
                                receiver=lambda recv_into, n: wire.receive_read_reply(
                                    recv_into, n, want))
        return self._invoke(wait, methods.READ, req,
                            lambda reply: self._read_unary_post(reply, not half), recover)

    def read_many_async(self, names: Sequence[str], *, sync_step: int | None = None,
                        out: Sequence[np.ndarray | None] | None = None,
                        value_dtype: str = "") -> Handle:
        """Read several variables in one call; ``result()`` is a list of Snapshot.

        Values are read-only arrays (``.copy()`` one to change it), or the
        arrays of ``out`` (one per name, None: a new one) when given with the
        value's shape and dtype: the value is copied into it (on this host,
        straight from shared memory: the only copy; from another host,
        received straight into it). A read that fails may have written
        some of them (their contents are then undefined). With ``sync_step`` (sync
        mode), the read waits while an earlier step is still being gathered
        on a variable (see psserver.sync).

        ``value_dtype="float16"``: float32/float64 values come rounded to
        float16 (clipped to +-65504), sent as float16 between hosts (half the
        bytes of float32) and rounded here on the same host, so every path
        gives the same numbers. They land in ``out``'s arrays (float32 there)
        where given, else they are float16 arrays.
        """
        return self._read_many(names, False, sync_step, out, value_dtype)

    def read_many(self, names: Sequence[str], *, sync_step: int | None = None,
                  out: Sequence[np.ndarray | None] | None = None,
                  value_dtype: str = "") -> list[Snapshot]:
        return self._read_many(names, True, sync_step, out, value_dtype)

    def read(self, name: str, *, with_version: bool = False):
        """The value of ``name`` (a read-only array), or (value, version)."""
        s = self.read_many([name])[0]
        return (s.value, s.version) if with_version else s.value

    def _gather_one(self, name: str, ids: np.ndarray, wait: bool = False, recover=None,
                    sync_step: int | None = None):
        req = ps_pb2.GatherRequest(name=name)
        T.fill(req.ids, ids)
        _set_sync_read(req, sync_step)
        return self._invoke(wait, methods.GATHER, req,
                            lambda r: (T.decode(r.rows), r.version), recover)

    def _gather_split(self, name: str, ids: np.ndarray,
                      sync_step: int | None = None) -> tuple[np.ndarray, int]:
        """A gather too big for one message, as several (each one consistent)."""
        meta = self.get_meta(name)
        row_bytes = max(1, meta.nbytes // meta.shape[0]) if meta.shape and meta.shape[0] else 1
        per_call = max(1, (self.max_message_bytes - MESSAGE_OVERHEAD) // row_bytes)
        flat = ids.reshape(-1)
        parts = [h.result() for h in [self._gather_one(name, flat[i:i + per_call],
                                                       sync_step=sync_step)
                                      for i in range(0, flat.size, per_call)]]
        rows = np.concatenate([p[0] for p in parts]) if parts else np.empty(
            (0,) + meta.shape[1:], meta.dtype)
        return rows.reshape(ids.shape + meta.shape[1:]), min((p[1] for p in parts), default=meta.version)

    def _gather(self, name: str, ids, wait: bool, sync_step: int | None = None,
                use_shm: bool = True):
        ids = _as_ids(ids, "gather")
        if use_shm and self._shm_for(0):   # the rows come back through shared memory
            got = self._read_and_gather([], [(name, ids)], wait, sync_step)
            if wait:
                return got[1][0]
            return Handle(Pending(lambda: got.result()[1][0], got.done), target=self.address)
        nbytes, rows = self._nbytes.get(name), self._rows.get(name)
        if nbytes is not None and rows and not self._fits_message(ids.size * (nbytes // rows)):
            return self._run(wait, self._gather_split, name, ids, sync_step)

        def recover(exc: PSError):   # too big for one message: split it
            if exc.code == Code.RESOURCE_EXHAUSTED:
                return self._gather_split(name, ids, sync_step)
            raise exc
        return self._gather_one(name, ids, wait, recover, sync_step)

    def gather_async(self, name: str, ids, *, sync_step: int | None = None) -> Handle:
        """Rows by id; ``result()`` is (rows, version).

        A gather whose rows exceed one message is split into several calls;
        each piece is a consistent snapshot and the version reported is the
        oldest piece's.
        """
        return self._gather(name, ids, False, sync_step)

    def gather(self, name: str, ids, *, with_version: bool = False,
               sync_step: int | None = None):
        """Rows ``value[ids]`` (shape ids.shape + row shape), or (rows, version)."""
        rows, version = self._gather(name, ids, True, sync_step)
        return (rows, version) if with_version else rows

    # -- updates ---------------------------------------------------------------
    def _dense(self, kind: str, updates: Mapping[str, np.ndarray] | Iterable, wait: bool,
               sync: SyncSpec | None = None, use_shm: bool = True):
        items = list(updates.items()) if isinstance(updates, Mapping) else list(updates)
        arrays = [np.asarray(item[1]) for item in items]
        uids = [item[2] if len(item) > 2 else 0 for item in items]
        msg_cls = ps_pb2.PushRequest if kind == "push" else ps_pb2.AssignRequest
        method = methods.PUSH if kind == "push" else methods.ASSIGN
        streamed = sum(a.nbytes for a in arrays) > self._tensor_limit(
            methods.BULK_PUSH if kind == "push" and self.bulk else method)

        def request(with_data: bool):
            req = msg_cls()
            if sync is not None:
                _set_sync(req, sync)
            for item, a, uid in zip(items, arrays, uids):
                T.fill(req.updates.add(name=item[0], update_id=uid).tensor, a, with_data)
            return req
        if kind == "push" and use_shm and self._shm_for(sum(a.nbytes for a in arrays)):
            def redo(exc: PSError):   # the server applied nothing: send it over gRPC
                return self._dense(kind, items, True, sync, use_shm=False)
            out = self._shm_push(items, arrays, uids, wait, sync, redo)
            if out is not None:
                return out
        if streamed:
            req = request(with_data=False)
            return self._run(wait, lambda: list(self._upload(kind, req, arrays).updated.versions))
        if kind == "push" and self.bulk:
            sync_raw = b"" if sync is None else _sync_info(sync).SerializeToString()
            over_socket = self._socket(methods.BULK_PUSH) is not None
            # Over a socket: large gradients sent from their arrays (sendmsg, no
            # copy; sent before this returns), small ones framed in a pooled buffer.
            into = (wire.SCATTER if sum(a.nbytes for a in arrays) >= SCATTER_BYTES
                    else buffers.take) if over_socket else None
            raw = wire.encode_push_request(
                [(item[0], a, uid) for item, a, uid in zip(items, arrays, uids)], sync_raw,
                into)

            def recover(exc: PSError):
                if exc.code == Code.UNIMPLEMENTED:   # an older server
                    self.bulk = False
                    return self._invoke(True, method, request(True), lambda r: list(r.versions))
                raise exc
            return self._invoke(wait, methods.BULK_PUSH, raw, lambda r: list(r.versions), recover)
        return self._invoke(wait, method, request(True), lambda r: list(r.versions))

    def push_many_async(self, grads, *, sync: SyncSpec | None = None) -> Handle:
        """Apply dense gradients ({name: grad}, [(name, grad)] or
        [(name, grad, update_id)]) in one call. A non-zero update_id makes the
        update idempotent: resending it after an error applies it at most once.

        ``result()`` is the list of versions after each update. The request is
        validated in full first: on an error nothing was applied. With
        ``sync`` (sync mode), the gradients join their step instead (see
        psserver.sync); a late one is dropped and counted on the server.
        """
        return self._dense("push", grads, False, sync)

    def push_many(self, grads, *, sync: SyncSpec | None = None) -> list[int]:
        return self._dense("push", grads, True, sync)

    def push(self, name: str, grad) -> int:
        """Apply one dense gradient; return the version after it."""
        return self.push_many([(name, grad)])[0]

    def assign_many_async(self, values) -> Handle:
        """Overwrite values ({name: value} or [(name, value)]) in one call."""
        return self._dense("assign", values, wait=False)

    def assign_many(self, values) -> list[int]:
        return self._dense("assign", values, wait=True)

    def assign(self, name: str, value) -> int:
        """Overwrite a variable's value (optimizer slots are kept)."""
        return self.assign_many([(name, value)])[0]

    def _push_sparse(self, name: str, ids, rows, wait: bool, sync: SyncSpec | None = None,
                     update_id: int = 0):
        ids = _as_ids(ids, "sparse push")
        rows = np.asarray(rows)
        streamed = ids.nbytes + rows.nbytes > self._tensor_limit(methods.PUSH_SPARSE)
        if not streamed:   # framed by hand: the arrays' memory goes out as it is
            raw = wire.encode_push_sparse_request(
                name, ids, rows, update_id,
                None if sync is None else _sync_info(sync).SerializeToString(), into=wire.SCATTER)
            return self._invoke(wait, methods.PUSH_SPARSE, raw, lambda r: r.versions[0])
        req = ps_pb2.PushSparseRequest(name=name, update_id=update_id)
        if sync is not None:
            _set_sync(req, sync)
        T.fill(req.ids, ids, with_data=False)
        T.fill(req.values, rows, with_data=False)
        return self._run(wait, lambda: self._upload(
            "push_sparse", req, [ids, rows]).updated.versions[0])

    def push_sparse_async(self, name: str, ids, rows, *, sync: SyncSpec | None = None,
                          update_id: int = 0) -> Handle:
        return self._push_sparse(name, ids, rows, False, sync, update_id)

    def push_sparse(self, name: str, ids, rows, *, sync: SyncSpec | None = None,
                    update_id: int = 0) -> int:
        """Apply a row-wise gradient (duplicate ids summed); return the version.

        A non-zero update_id makes it idempotent, as in push_many_async."""
        return self._push_sparse(name, ids, rows, True, sync, update_id)

    def save(self, directory: str, names: Sequence[str] = ()) -> list[ps_pb2.SavedFile]:
        """Have the server write variables (all by default) to its directory."""
        return list(self.save_incremental(directory, names).files)

    def save_incremental(self, directory: str, names: Sequence[str] = (), *, save_id: int = 0,
                         since: int = 0, incarnation: str = "", stream: str = "",
                         weights_only: bool = False) -> ps_pb2.SaveReply:
        """save(), as save point ``save_id`` and with each shard written as
        the changes since point ``since`` where the server can tell them
        (ps.proto SaveRequest). Returns the reply (files, incarnation)."""
        return self._call(methods.SAVE, ps_pb2.SaveRequest(
            directory=directory, names=list(names), save_id=save_id, since=since,
            incarnation=incarnation, stream=stream, weights_only=weights_only),
            timeout=max(self.timeout or 0, 600.0))

    def commit_save(self, save_id: int, stream: str, incarnation: str) -> ps_pb2.CommitSaveReply:
        """Save ``save_id`` is on disk for good: the server forgets what it took."""
        return self._call(methods.COMMIT_SAVE, ps_pb2.CommitSaveRequest(
            save_id=save_id, stream=stream, incarnation=incarnation))

    def abandon_step(self, step: int, replica: int) -> None:
        """Sync mode: replica will not push for step; stop waiting for it."""
        self._call(methods.ABANDON, ps_pb2.AbandonRequest(step=step, replica=replica))

    # -- replication (psserver.replication) -------------------------------------------
    def replicate(self, records: Sequence["R.Record"],
                  timeout: float | None = None) -> list[tuple[str, int, int]]:
        """A primary's records to this server (its backup): (name, version,
        status) per variable, as VariableStore.replicate. Framed by hand
        (psserver/wire.py: tensor bytes copied once), over the data port (or
        same-host socket) when there is one; records above the stream
        threshold take Upload's frames."""
        if self._fits(sum(r.nbytes for r in records)):
            reply = self._invoke(True, methods.REPLICATE, wire.encode_replicate_request(records))
        else:
            req = ps_pb2.ReplicateRequest()
            arrays = []
            for r in records:
                m = req.records.add(name=r.name, epoch=r.epoch, version=r.version,
                                    update_id=r.update_id, sync_steps=r.sync_steps, kind=r.kind)
                T.fill(m.tensor, r.tensor, with_data=False)
                arrays.append(r.tensor)
                for field in ("ids", "evicted"):
                    a = getattr(r, field)
                    if a is not None:
                        T.fill(getattr(m, field), a, with_data=False)
                        arrays.append(a)
            kw = {} if timeout is None else {"timeout": timeout}
            reply = self._upload("replicate", req, arrays, **kw).replicated
        return [(a.name, a.version, int(a.status)) for a in reply.acks]

    def reconfigure(self, changes: Sequence[tuple], timeout: float = 120.0) -> list[VariableMeta]:
        """The coordinator's role changes on this server: (name, action, epoch,
        backup Peer or None) each (see ReplicaChange in ps.proto); returns each
        copy's metadata after its change. A copy of state (PROMOTE with a
        backup, SET_BACKUP) or a hand-over (DEMOTE) may take up to ``timeout``."""
        req = ps_pb2.ReconfigureRequest(timeout=timeout)
        for name, action, epoch, peer in changes:
            c = req.changes.add(name=name, action=action, epoch=epoch)
            if peer is not None:
                c.backup.CopyFrom(ps_pb2.ReplicaPeer(address=peer.address, name=peer.name))
        reply = self._call(methods.RECONFIGURE, req, timeout=timeout + 10.0)
        return [_meta_from_proto(m) for m in reply.variables]
