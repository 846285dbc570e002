"""PSAdmin: the control calls of one parameter server (create, delete,
metadata, checkpoints, replication, dynamic tables' lifecycle).

Every call here is a blocking gRPC call on the client's TaskChannel
(psserver/link/channel.py) and raises the typed errors of
psserver.contract (``InvalidArgument``, ``NotFound``, ``AlreadyExists``,
``ResourceExhausted``, ``Unauthenticated``, ``Unavailable``,
``DeadlineExceeded``...) with the server's message. Nothing waits forever:
every call has a deadline (``timeout``, default 60 s). PSClient
(psserver/client/data.py) adds the data calls (reads, pushes, look-ups) on
the same channel.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

import numpy as np

from protos.pstrain.v1 import ps_pb2, tables_pb2
from psserver.client.results import SizeCache, meta_from_proto
from psserver.contract import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_STREAM_THRESHOLD_BYTES,
    MESSAGE_OVERHEAD,
    Initializer,
    Peer,
    VariableMeta,
    routing,
    wire,
)
from psserver.contract.keys import bitmap_of_buckets
from psserver.errors import InvalidArgument
from psserver.link import methods
from psserver.link import tensor_proto as TP
from psserver.link.channel import DEFAULT_TIMEOUT, TaskChannel
from psserver.link.frames import MAX_FRAME_BYTES
from psserver.tls import TLSConfig


def table_spec(dim: int, *, dtype: str = "float32",
               initializer: Initializer | str | None = None, optimizer: str = "sgd",
               optimizer_params: Mapping[str, float] | None = None, min_count: int = 1,
               probability: float = 1.0, capacity: int = 0, policy: str = "lru",
               max_age_steps: int = 0, max_age_seconds: float = 0.0,
               admission_capacity: int = 0, seed: int = 0) -> tables_pb2.TableSpec:
    """A TableSpec (see psserver/core/dynamic_table.py for what each field does)."""
    if isinstance(initializer, str):
        initializer = Initializer(kind=initializer)
    return tables_pb2.TableSpec(
        dim=dim, dtype=dtype,
        initializer=ps_pb2.Initializer(**dataclasses.asdict(initializer or Initializer())),
        optimizer=ps_pb2.OptimizerSpec(name=optimizer, params=dict(optimizer_params or {})),
        min_count=min_count, probability=probability, capacity=capacity, policy=policy,
        max_age_steps=max_age_steps, max_age_seconds=max_age_seconds,
        admission_capacity=admission_capacity, seed=seed)


#: Groups of applied update keys an import call carries at most (a move's:
#: 512 bytes of buckets and the keys each; a source's own keys are one group).
APPLIED_GROUPS_PER_CALL = 1024


class PSAdmin:
    """The control calls of the parameter server at ``address`` ("host:port").

    Args:
      token: the cluster's auth token, sent on every call. None (or ""):
        ``$PSTRAIN_AUTH_TOKEN`` when it is set, as ParameterServerStrategy
        and the tasks take it; else no token.
      tls: a TLSConfig to connect with TLS (its CA to trust the server; its
        certificate and key for mutual TLS). None (the default):
        ``$PSTRAIN_TLS_CERT``, ``$PSTRAIN_TLS_KEY`` and ``$PSTRAIN_TLS_CA``
        when set, as the tasks take them (plaintext when none is set).
        False: plaintext, whatever the environment says.
      timeout: deadline in seconds of each call (None: no deadline).
      max_message_bytes: must match the server's; no message is larger.
      chunk_bytes: frame size of streamed uploads.
      stream_threshold_bytes: dense tensors above this size travel over
        gRPC's streams even when they would fit one message (streams are
        faster for them).
      wait_for_ready: queue gRPC calls until the server is up instead of
        failing with UNAVAILABLE at once (useful while a cluster starts).
      shared_memory: use the server's same-host socket and shared memory
        where its route allows (psserver/contract/routing.py: same host, network
        namespace and user; segments also need the same pid namespace).
        ``PSTRAIN_SHM=0`` turns it off: the client then plans as if on
        another host.
      data_port: otherwise make the data calls over the server's data port
        (TCP, hand-framed, this client's TLS and token); ``PSTRAIN_DATA=0``
        turns it off. False: gRPC only.
      channel: a TaskChannel to use instead of making one (tests, and
        transports of your own: psserver/link/channel.py).
      diagnose: a call to a server that has not answered yet and cannot be
        reached fails with an error saying why and what to check (a wrong
        host, nothing listening at the port, a TLS mismatch:
        psserver/link/diagnose.py). False: gRPC's own words.

    The route is planned once, from the server's GetServerInfo (no call is
    made to find it out), and again after a socket breaks; ``route`` tells
    what it is.
    """

    def __init__(self, address: str, *, token: str | None = None,
                 tls: TLSConfig | bool | None = None, timeout: float | None = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 stream_threshold_bytes: int = DEFAULT_STREAM_THRESHOLD_BYTES,
                 wait_for_ready: bool = False, shared_memory: bool = True,
                 data_port: bool = True, channel: TaskChannel | None = None,
                 diagnose: bool = True):
        self.address = address
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        # A frame must fit in one message, whatever the two options say.
        self.stream_threshold_bytes = max(
            0, min(stream_threshold_bytes, max_message_bytes - MESSAGE_OVERHEAD))
        self.channel = channel if channel is not None else TaskChannel(
            address, role="ps", token=token, tls=tls, timeout=timeout,
            max_message_bytes=max_message_bytes, chunk_bytes=chunk_bytes,
            wait_for_ready=wait_for_ready, shared_memory=shared_memory, data_port=data_port,
            diagnose=diagnose)
        self._sizes = SizeCache()
        self.limits = routing.Limits(MAX_FRAME_BYTES - MESSAGE_OVERHEAD,
                                     self.stream_threshold_bytes,
                                     max_message_bytes - MESSAGE_OVERHEAD)

    @property
    def route(self) -> routing.Plan:
        """How calls reach the server (psserver/contract/routing.py): ``socket`` "unix",
        "tcp" or "" (gRPC only), ``shm``, and ``why``. Asks the server once."""
        return self.channel.plan

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the server answers (raises DeadlineExceeded after timeout)."""
        self.channel.wait_ready(timeout)

    def _call(self, method: methods.Method, request, timeout: float | None = None):
        return self.channel.grpc.call(method, request, self.timeout if timeout is None else timeout)

    def _fits(self, nbytes: int) -> bool:
        """Whether a tensor payload goes in one unary message (else a stream)."""
        return nbytes <= self.stream_threshold_bytes

    def _remember(self, name: str, nbytes: int, shape) -> None:
        self._sizes.check(self.channel.incarnation)
        self._sizes.remember(name, nbytes, shape)

    # -- info ----------------------------------------------------------------
    def server_info(self, timeout: float | None = None, drains: bool = False
                    ) -> ps_pb2.ServerInfo:
        """The server's identity, version and what it holds (``timeout``: this
        call's deadline instead of the client's); ``drains``: the caller drains
        the server if it is leaving (``.leaving``: psserver/serve/leave.py)."""
        return self._call(methods.SERVER_INFO, ps_pb2.ServerInfoRequest(drains=drains),
                          timeout)

    def get_meta(self, name: str, timeout: float | None = None) -> VariableMeta:
        m = meta_from_proto(self._call(methods.META, ps_pb2.VariableRef(name=name), timeout))
        self._remember(name, m.nbytes, m.shape)
        return m

    def list_variables(self) -> list[VariableMeta]:
        reply = self._call(methods.LIST, ps_pb2.ListRequest())
        return [meta_from_proto(m) for m in reply.variables]

    # -- create / delete -----------------------------------------------------
    def create_variable(self, name: str, shape: Sequence[int] | None = None,
                        dtype: str | np.dtype | None = None, *,
                        initial_value: np.ndarray | None = None,
                        initializer: Initializer | str | None = None,
                        optimizer: str = "sgd",
                        optimizer_params: Mapping[str, float] | None = None,
                        allow_nonfinite: bool = False, exist_ok: bool = False,
                        slots: Mapping[str, np.ndarray] | None = None, version: int = 0,
                        overwrite: bool = False, applied_ids=(), sync_steps: int = 0,
                        role: int = 0, epoch: int = 0, backup: Peer | None = None,
                        timeout: float | None = None) -> VariableMeta:
        """Create a variable on this server and return its metadata.

        Give either ``initial_value`` (shape and dtype then default to its
        own; dtype otherwise defaults to float32) or an ``initializer`` (an
        Initializer, or a kind name such as "zeros"); with neither the
        variable starts at zeros. Restoring: ``slots`` (every optimizer
        slot, by name), ``version``, and ``overwrite`` to replace an
        existing variable's state at once. Replication
        (psserver.core.replication): ``backup`` (a Peer) makes a primary that
        copies its state there before answering; ``role``, ``epoch`` and
        ``sync_steps`` are set by a primary copying its state.
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
        req.dtype = np.dtype("float32" if dtype is None else dtype).name
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
            TP.fill(req.initial_value, arrays[0], with_data=not streamed)
        for k, v in slot_items:
            TP.fill(req.slots.add(name=k).tensor, v, with_data=not streamed)
        if streamed:
            meta = self.channel.upload("create", req, tensors, timeout).created
        else:
            meta = self._call(methods.CREATE, req, timeout)
        m = meta_from_proto(meta)
        self._remember(name, m.nbytes, m.shape)
        return m

    def delete_variable(self, name: str) -> None:
        self._call(methods.DELETE, ps_pb2.VariableRef(name=name))
        self._sizes.forget([name])

    def assign_many(self, values) -> list[int]:
        """Overwrite values ({name: value} or [(name, value)]) in one call
        (optimizer slots are kept); the versions after. A replicated primary
        forwards it to its backup first."""
        items = list(values.items()) if isinstance(values, Mapping) else list(values)
        arrays = [np.asarray(v) for _, v in items]
        streamed = not self._fits(sum(a.nbytes for a in arrays))
        req = ps_pb2.AssignRequest()
        for (name, _), a in zip(items, arrays):
            TP.fill(req.updates.add(name=name).tensor, a, with_data=not streamed)
        if streamed:
            return list(self.channel.upload("assign", req, arrays).updated.versions)
        return list(self._call(methods.ASSIGN, req).versions)

    def assign(self, name: str, value) -> int:
        """Overwrite a variable's value (optimizer slots are kept)."""
        return self.assign_many([(name, value)])[0]

    # -- checkpoints -----------------------------------------------------------
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

    # -- replication (psserver.core.replication) -------------------------------------------
    def replicate(self, records: Sequence, timeout: float | None = None
                  ) -> list[tuple[str, int, int]]:
        """A primary's records to this server (its backup): (name, version,
        status) per variable, as VariableStore.replicate. Framed by hand
        (psserver/contract/wire.py: tensor bytes copied once), over the data port or
        the same-host socket where there is one (a frame's worth), else
        gRPC (past the stream threshold: Upload's frames)."""
        nbytes = sum(r.nbytes for r in records)
        if routing.form(routing.PUSH, nbytes, self.channel.plan, self.limits,
                        segments=False) != routing.STREAM:
            reply = self.channel.call(methods.REPLICATE, wire.encode_replicate_request(records),
                                      timeout)
        else:
            req = ps_pb2.ReplicateRequest()
            arrays = []
            for r in records:
                m = req.records.add(name=r.name, epoch=r.epoch, version=r.version,
                                    update_id=r.update_id, sync_steps=r.sync_steps, kind=r.kind)
                TP.fill(m.tensor, r.tensor, with_data=False)
                arrays.append(r.tensor)
                for field in ("ids", "evicted"):
                    a = getattr(r, field)
                    if a is not None:
                        TP.fill(getattr(m, field), a, with_data=False)
                        arrays.append(a)
            reply = self.channel.upload("replicate", req, arrays, timeout).replicated
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
        return [meta_from_proto(m) for m in reply.variables]

    # -- dynamic tables (protos/pstrain/v1/tables.proto) ------------------------------
    def create_table(self, name: str, dim: int, *, exist_ok: bool = False,
                     **spec) -> tables_pb2.TableInfo:
        """Create this server's shard of dynamic table ``name`` with rows of
        ``dim`` (keyword arguments: psserver.client.table_spec)."""
        return self._call(methods.TABLE_CREATE, tables_pb2.CreateTableRequest(
            name=name, spec=table_spec(dim, **spec), exist_ok=exist_ok))

    def table_info(self, name: str, timeout: float | None = None) -> tables_pb2.TableInfo:
        return self._call(methods.TABLE_INFO, tables_pb2.TableRef(name=name), timeout)

    def list_tables(self) -> list[tables_pb2.TableInfo]:
        return list(self._call(methods.TABLE_LIST, tables_pb2.ListTablesRequest()).tables)

    def delete_table(self, name: str) -> bool:
        return self._call(methods.TABLE_DELETE, tables_pb2.TableRef(name=name)).deleted

    def save_table(self, name: str, directory: str, **incremental) -> tables_pb2.SaveTableReply:
        """Write this server's shard of ``name`` to a file in ``directory``
        (under its --checkpoint-dir). ``incremental``: save_id, since,
        incarnation, stream, weights_only (tables.proto)."""
        return self._call(methods.TABLE_SAVE, tables_pb2.SaveTableRequest(
            name=name, directory=directory, **incremental))

    def import_table(self, name: str, state: Mapping[str, np.ndarray], step: int, *,
                     reset: bool = True, replica: Mapping | None = None,
                     capacity: int | None = None, applied: Sequence[tuple] = (),
                     timeout: float | None = None, deadline: float | None = None,
                     incoming: tuple | None = None, staged: bool = False,
                     dropped: np.ndarray | None = None) -> int:
        """Put rows (psserver.core.dynamic_table.DynamicTable.export's arrays) into
        this server's shard of ``name``, emptied first with ``reset``; sent in
        pieces that fit a message. Returns the rows the shard holds.
        ``replica`` (a primary's server copying its state to its backup:
        spec, epoch, version, applied_ids): make or replace the copy as a
        backup (tables.proto ReplicaCopy). ``capacity`` (with ``reset``): the
        shard's capacity from then on (its part of the whole table's).
        ``applied``: [(bool per bucket, update keys)] the rows' earlier
        shard applied to keys of those buckets (a move of buckets), sent
        after the rows (at most APPLIED_GROUPS_PER_CALL groups a call: each
        holds one key at least); ``incoming``: (bool per bucket, layout
        epoch) of a move, on every piece (tables.proto ImportTableRequest);
        ``staged``: the rows are a move's copy ahead (its first piece
        replaces what the shard held of those buckets); ``dropped`` (not
        None): the rows are a move's changes since its copy ahead, and these
        keys went since (sent with the first piece)."""
        keys = np.asarray(state["keys"], np.int64)
        per_row = sum(a.nbytes // max(1, keys.size) for a in state.values()
                      if np.ndim(a) and keys.size)
        per_call = max(1, (self.max_message_bytes - MESSAGE_OVERHEAD) // max(1, per_row))
        rows = 0
        for i, lo in enumerate(range(0, max(1, keys.size), per_call)):
            hi = lo + per_call
            req = tables_pb2.ImportTableRequest(name=name, reset=(reset or staged) and i == 0,
                                                step=step, staged=staged,
                                                delta=dropped is not None)
            if dropped is not None and i == 0:
                TP.fill(req.dropped, np.ascontiguousarray(dropped, np.int64))
            if capacity is not None and i == 0:
                req.capacity = capacity
            if replica is not None:
                req.replica.CopyFrom(tables_pb2.ReplicaCopy(complete=hi >= keys.size, **replica))
            _fill_rows(req, state, lo, hi, incoming)
            if deadline is not None:   # (time.monotonic(): the pieces together)
                timeout = max(0.001, deadline - time.monotonic())
            rows = self._call(methods.TABLE_IMPORT, req, timeout).rows
        for lo in range(0, len(applied), APPLIED_GROUPS_PER_CALL):   # (no rows: calls of their own)
            req = tables_pb2.ImportTableRequest(name=name, step=step, delta=dropped is not None)
            _fill_rows(req, state, 0, 0, incoming)
            for buckets, ids in applied[lo:lo + APPLIED_GROUPS_PER_CALL]:
                req.applied.add(buckets=bitmap_of_buckets(buckets), ids=ids)
            if deadline is not None:
                timeout = max(0.001, deadline - time.monotonic())
            rows = self._call(methods.TABLE_IMPORT, req, timeout).rows
        return rows

    def move_table_buckets(self, name: str, buckets: bytes, destination: str, *,
                           capacity: int | None = None, layout_epoch: int = 0,
                           layout: str = "", layout_only: bool = False, shard: int = 0,
                           fence: bool = False, destination_capacity: int | None = None,
                           source_server_id: str = "", source_leaves: bool = False,
                           precopy: bool = False,
                           timeout: float | None = None) -> tables_pb2.MoveBucketsReply:
        """This server's shard of ``name`` hands the rows of ``buckets`` (a
        bitmap: psserver.core.table_moves.bitmap_of_buckets) to the shard on
        ``destination`` and refuses their keys from then on (tables.proto
        MoveBuckets); ``capacity``: its part of the table's afterwards;
        ``layout``: the table's layout after the move (JSON), served by Info;
        ``layout_only``: move nothing, be shard ``shard`` of ``layout``
        (buckets b"", destination ""); ``fence``: move nothing, answer
        (``.moved``) whether a move of ``layout_epoch`` happened, and if not
        refuse one from now on; ``source_server_id``: this server's id as the
        caller knows it (one that restarted since refuses the move);
        ``source_leaves``: the shard holds no bucket after this move (a
        drain's last: a leaving server waits for it); ``precopy``: move
        nothing yet, copy the rows to ``destination`` ahead of the move of
        ``layout_epoch`` (no layout, capacity or drain), so that the move
        sends only what changed since."""
        req = tables_pb2.MoveBucketsRequest(name=name, buckets=buckets, destination=destination,
                                            layout_epoch=layout_epoch, layout=layout,
                                            layout_only=layout_only, shard=shard,
                                            fence=fence, source_server_id=source_server_id,
                                            source_leaves=source_leaves, precopy=precopy)
        if capacity is not None:
            req.capacity = capacity
        if destination_capacity is not None:
            req.destination_capacity = destination_capacity
        return self._call(methods.TABLE_MOVE, req, timeout)


def _fill_rows(req, state: Mapping[str, np.ndarray], lo: int, hi: int,
               incoming: tuple | None = None) -> None:
    """An ImportTableRequest's rows lo:hi of ``state`` (export()'s arrays),
    and the move's buckets and epoch they come with (``incoming``)."""
    if incoming is not None:
        req.buckets, req.layout_epoch = bitmap_of_buckets(incoming[0]), incoming[1]
    for field in ("keys", "values", "age_steps", "age_seconds", "freq"):
        TP.fill(getattr(req, field), np.ascontiguousarray(state[field][lo:hi]))
    for key, a in state.items():
        if key.startswith("slot/"):
            a = np.asarray(a)
            TP.fill(req.slots.add(name=key[5:]).tensor,   # (0-d stays 0-d: Adam's count)
                    a if a.ndim == 0 else np.ascontiguousarray(a[lo:hi]))
