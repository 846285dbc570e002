"""The DynamicTables service (protos/pstrain/v1/tables.proto): messages in,
psserver.core.table_store.TableStore calls, messages out.

Thin on purpose, as psserver/serve/servicer.py: the shards, their locks,
replication, sync steps, the memory budget, saves and imports are the
store's, with their guarantees (psserver/core/table_store.py). Handlers raise
its typed errors; each transport maps them once (psserver/serve/rpc.py for gRPC,
psserver/serve/ipc_server.py for sockets). The table's spec crosses here between
its message (TableSpec) and the store's plain ``TableSpec``, field for field.
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable

import numpy as np
from google.protobuf import json_format

from protos.pstrain.v1 import ps_pb2, tables_pb2
from psserver.contract import MAX_COUNT, TABLE_PREFIX, Initializer
from psserver.contract import tensor as T
from psserver.contract.keys import buckets_of_bitmap, check_keys
from psserver.core import table_moves as M
from psserver.core.shards import CopyState
from psserver.core.table_config import TableConfig
from psserver.core.table_copy import MOVED_IN_KEPT
from psserver.core.table_store import StateCopy, TableSpec, TableStatus, TableStore
from psserver.errors import FailedPrecondition, InvalidArgument
from psserver.link import tensor_proto as TP
from psserver.serve.handling import deadline_of, save_fields, sync_spec_of

_INT64_MAX = (1 << 63) - 1
#: Seconds a MoveBuckets may hold its shard at most (its caller's deadline, if sooner).
MOVE_SECONDS = 600.0
#: A server's address: host (a name, IPv4, or [IPv6]) and port.
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):[0-9]{1,5}")


#: TableSpec's fields that are TableConfig's (of the same names), but the initializer.
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(TableConfig) if f.name != "initializer")


def spec_of(msg: tables_pb2.TableSpec) -> TableSpec:
    """The store's TableSpec of a TableSpec message, field for field (not
    checked: the store checks it where it is used)."""
    i = msg.initializer
    return TableSpec(
        TableConfig(initializer=Initializer(i.kind, i.value, i.mean, i.stddev, i.minval,
                                            i.maxval, i.seed),
                    **{k: getattr(msg, k) for k in _CONFIG_FIELDS}),
        msg.optimizer.name, dict(msg.optimizer.params))


def spec_message(spec: TableSpec) -> tables_pb2.TableSpec:
    """The TableSpec message of the store's TableSpec, field for field."""
    return tables_pb2.TableSpec(
        initializer=ps_pb2.Initializer(**dataclasses.asdict(spec.given.initializer)),
        optimizer=ps_pb2.OptimizerSpec(name=spec.optimizer, params=spec.optimizer_params),
        **{k: getattr(spec.given, k) for k in _CONFIG_FIELDS})


def spec_json(spec: TableSpec) -> str:
    """A spec as a table's checkpoint metadata records it: protobuf JSON of
    its TableSpec message."""
    return json_format.MessageToJson(spec_message(spec), indent=None)


def _info(status: TableStatus) -> tables_pb2.TableInfo:
    s = status.stats
    return tables_pb2.TableInfo(
        name=status.name, spec=spec_message(status.spec), rows=status.rows, step=status.step,
        **{f.name: min(getattr(s, f.name), _INT64_MAX) for f in dataclasses.fields(s)},
        bytes=status.bytes, sync_steps=status.sync_steps, late=min(status.late, _INT64_MAX))


def _sync_read_step(request: tables_pb2.LookupRequest) -> int | None:
    """A sync look-up's step (None: not sync), checked."""
    if not request.HasField("sync"):
        return None
    step, timeout = request.sync.step, request.sync.step_timeout
    if not (0 <= step < MAX_COUNT and timeout >= 0):
        raise InvalidArgument(f"a sync look-up needs a step in [0, 2**62) and a step_timeout "
                              f">= 0, got step {step}, step_timeout {timeout}")
    return step


def _applied_of(groups) -> list[tuple]:
    """ImportTableRequest.applied as [(bool per bucket, update keys)], checked."""
    most = MOVED_IN_KEPT + CopyState.APPLIED_IDS_KEPT
    if len(groups) > most or sum(len(g.ids) for g in groups) > most:
        raise InvalidArgument(f"an import carries at most {most} applied update keys")
    return [(buckets_of_bitmap(g.buckets), list(g.ids)) for g in groups]


class TableServicer:
    """The DynamicTables service over ``store``: handlers take parsed
    requests (psserver/serve/rpc.py); a look-up's reply is held to
    ``max_message_bytes``."""

    def __init__(self, store: TableStore, max_message_bytes: int):
        self.store = store
        self.max_message_bytes = max_message_bytes
        # address -> a client of that server (with this server's token and
        # TLS): where MoveBuckets sends rows (psserver/serve/server.py sets it)
        self.peer: Callable[[str], object] | None = None
        self.server_id = ""   # this server's (ServerInfo.server_id)

    def Create(self, request, context):
        return self._with_layout(_info(self.store.create(request.name, spec_of(request.spec),
                                                         request.exist_ok)))

    def Lookup(self, request, context):
        keys = TP.decode(request.keys, T.ID_DTYPES, "lookup keys")
        counts = TP.decode(request.counts, T.ID_DTYPES, "lookup counts") \
            if request.HasField("counts") else None
        rows = self.store.lookup(request.name, keys, admit=not request.no_admit, counts=counts,
                                 sync_step=_sync_read_step(request),
                                 deadline=deadline_of(context),
                                 max_reply_bytes=self.max_message_bytes)
        reply = tables_pb2.LookupReply()
        TP.fill(reply.rows, rows)
        return reply

    def Update(self, request, context):
        done = self.store.update(
            request.name, TP.decode(request.keys, T.ID_DTYPES, "update keys"),
            TP.decode(request.grads, T.VALUE_DTYPES, "update grads"),
            update_id=int(request.update_id), sync=sync_spec_of(request),
            deadline=deadline_of(context))
        return tables_pb2.TableUpdateReply(updated=done.updated, dropped=done.dropped,
                                           step=done.step, late=done.late)

    def Info(self, request, context):
        return self._with_layout(_info(self.store.info(request.name)))

    def List(self, request, context):
        return tables_pb2.ListTablesReply(tables=[self._with_layout(_info(s))
                                                  for s in self.store.list()])

    def _with_layout(self, info: tables_pb2.TableInfo) -> tables_pb2.TableInfo:
        copy = self.store.registry.find(TABLE_PREFIX + info.name)
        info.layout = "" if copy is None else copy.layout   # (a str: read whole)
        return info

    def Delete(self, request, context):
        return tables_pb2.DeleteTableReply(deleted=self.store.delete(request.name))

    def Save(self, request, context):
        saved = self.store.save(request.name, request.directory, **save_fields(request))
        return tables_pb2.SaveTableReply(
            file=saved.file, rows=saved.rows, bytes=saved.bytes, step=saved.step,
            kind=saved.kind, evicted=saved.evicted, incarnation=saved.incarnation,
            crc32=saved.crc32)

    def Import(self, request, context):
        state = {"keys": TP.decode(request.keys, T.ID_DTYPES, "import keys")}
        for field in ("values", "age_seconds"):
            state[field] = TP.decode(getattr(request, field), T.VALUE_DTYPES, f"import {field}")
        for field in ("age_steps", "freq"):
            state[field] = TP.decode(getattr(request, field), T.ID_DTYPES, f"import {field}")
        for slot in request.slots:
            key = f"slot/{slot.name}"
            if key in state:
                raise InvalidArgument(f"import: slot {slot.name!r} given twice")
            state[key] = TP.decode(slot.tensor, T.WIRE_DTYPES, f"import slot {slot.name!r}")
        step = int(request.step)
        if request.HasField("replica"):
            r = request.replica
            rows = self.store.import_copy(request.name, state, step, request.reset, StateCopy(
                spec_of(r.spec), r.epoch, r.version, r.complete, list(r.applied_ids),
                r.sync_steps))
        else:
            if request.buckets:   # (a move's piece, or of its copy ahead)
                M.crash_point("ahead" if request.staged else "destination")
            if request.HasField("dropped") and not request.delta:
                raise InvalidArgument("an import names dropped keys only with delta")
            dropped = None if not request.delta else check_keys(TP.decode(
                request.dropped, T.ID_DTYPES, "import dropped")).reshape(-1) \
                if request.HasField("dropped") else np.zeros(0, np.int64)
            rows = self.store.import_rows(
                request.name, state, step, request.reset,
                request.capacity if request.HasField("capacity") else None,
                _applied_of(request.applied),
                (buckets_of_bitmap(request.buckets), int(request.layout_epoch))
                if request.buckets else None, staged=request.staged, dropped=dropped)
        return tables_pb2.ImportTableReply(rows=rows)

    def MoveBuckets(self, request, context):
        if request.fence:
            if any(request.buckets) or request.destination or request.layout or \
                    request.layout_only or request.HasField("capacity") or \
                    request.source_server_id or request.source_leaves:
                raise InvalidArgument("a fence names no buckets, destination, layout, "
                                      "capacity or source server, and drains nothing")
            moved = M.fence(self.store.registry.table(request.name), int(request.layout_epoch))
            return tables_pb2.MoveBucketsReply(moved=moved,
                                               held=self.store.info(request.name).rows)
        if request.layout_only:
            if any(request.buckets) or request.destination or request.HasField("capacity") \
                    or request.source_server_id or request.source_leaves:
                raise InvalidArgument("a layout_only move names no buckets, destination, "
                                      "capacity or source server, and drains nothing")
            dropped = M.set_layout(self.store.registry.table(request.name),
                                   int(request.layout_epoch), request.layout, int(request.shard))
            return tables_pb2.MoveBucketsReply(rows=dropped,
                                               held=self.store.info(request.name).rows)
        if request.precopy and (request.HasField("capacity") or request.layout or
                                request.source_leaves):
            raise InvalidArgument("a move's copy ahead (precopy) names no capacity of its own, "
                                  "layout or drain: the move does")
        mask = buckets_of_bitmap(request.buckets)
        capacity = request.capacity if request.HasField("capacity") else None
        theirs = request.destination_capacity if request.HasField("destination_capacity") \
            else None
        M.check_move(capacity, int(request.layout_epoch), request.layout, theirs,
                     layout_needed=not request.precopy)
        dest = request.destination
        if not _ADDRESS.fullmatch(dest):
            raise InvalidArgument(f"a move's destination is host:port, got {dest[:100]!r}")
        if self.peer is None:
            raise FailedPrecondition("this server sends no rows to other servers")
        if request.source_server_id and request.source_server_id != self.server_id:
            raise FailedPrecondition(
                f"table {request.name!r}: this server restarted since the move was planned "
                f"(it is {self.server_id[:100]!r}, the caller knew "
                f"{request.source_server_id[:100]!r}); nothing was moved. Let its recovery "
                "refill it, then plan the move again")
        copy = self.store.registry.table(request.name)
        deadline = deadline_of(context)   # (and at most MOVE_SECONDS: the shard waits meanwhile)
        end = min(time.monotonic() + MOVE_SECONDS, deadline or float("inf"))
        client = self.peer(dest)
        try:   # (the shard's lock is held while it sends: never to itself)
            if client.server_info(timeout=max(0.001, end - time.monotonic())).server_id == \
                    self.server_id:
                raise InvalidArgument(f"a move's destination {dest!r} is this server")
            incoming = (mask, int(request.layout_epoch))
            if request.precopy:   # (a destination without the table: refused before anything)
                client.table_info(request.name, timeout=max(0.001, end - time.monotonic()))
                rows, nbytes = M.precopy(copy, mask, dest, lambda state, step: client.import_table(
                    request.name, state, step, reset=True, staged=True, deadline=end,
                    capacity=theirs, incoming=incoming), int(request.layout_epoch))
                return tables_pb2.MoveBucketsReply(rows=rows, bytes=nbytes,
                                                   held=self.store.info(request.name).rows)
            rows, nbytes, held, sent = M.move_buckets(
                copy, mask, lambda state, step, applied, dropped: client.import_table(
                    request.name, state, step, reset=False, applied=applied, deadline=end,
                    capacity=theirs, incoming=incoming, dropped=dropped),
                capacity, int(request.layout_epoch), request.layout, end,
                leaves=request.source_leaves, destination=dest)
        finally:
            client.close()
        return tables_pb2.MoveBucketsReply(rows=rows, bytes=nbytes, held=held, sent=sent)
