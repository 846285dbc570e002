"""PSClient's calls too large for one message: gRPC's streams, or several calls.

psserver/client/data.py makes a data call in one message or frame where it
fits (``routing.form`` says STREAM where it does not, or the server answers
RESOURCE_EXHAUSTED); these are the other ways, each a blocking function of
the client, run on a kept thread when its caller wanted a Pending:

* ``read_stream``: values in ReadStream's frames (any size);
* ``push_streamed``: dense gradients in Upload's frames, then each row-wise one;
* ``gather_split``: a gather as calls of one message each;
* ``lookup_split``: a dynamic-table look-up as calls of one message each.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np

from protos.pstrain.v1 import ps_pb2
from psserver.client.results import (
    Snapshot,
    TableLookup,
    filled,
    set_sync,
    set_sync_read,
)
from psserver.contract import SyncSpec, routing
from psserver.errors import InvalidArgument
from psserver.link import methods
from psserver.link import tensor_proto as TP

if TYPE_CHECKING:
    from psserver.client.data import PSClient


def stream_timeout(timeout: float | None, nbytes: int) -> float | None:
    """A stream's deadline: the call's, and more per byte (20 MB/s is far
    below any link this runs on, so only a stuck transfer reaches it)."""
    return None if timeout is None else timeout + nbytes / 20e6


def _gathered_rows(reply) -> tuple[np.ndarray, int]:
    return TP.decode(reply.rows), reply.version


def read_stream(client: "PSClient", names: Sequence[str], sync_step: int | None, value_dtype: str,
                 out=None) -> list[Snapshot]:
    req = ps_pb2.ReadRequest(names=names, value_dtype=value_dtype)
    set_sync_read(req, sync_step)
    total = client._sizes.known(names) or 0
    got: list[Snapshot] = []
    buf = fill = cur = None
    for f in client.channel.read_stream(req, stream_timeout(client.timeout, total)):
        if f.HasField("value"):
            v = f.value
            dt, shape, n = TP.spec(v.value)
            buf = np.empty(n, np.uint8)
            fill = len(v.value.data)
            buf[:fill] = np.frombuffer(v.value.data, np.uint8)
            cur = (v.name, v.version, dt, shape)
        else:
            k = len(f.chunk)
            buf[fill:fill + k] = np.frombuffer(f.chunk, np.uint8)
            fill += k
        if fill == buf.size:
            name, version, dt, shape = cur
            got.append(Snapshot(name, version, buf.view(dt).reshape(shape)))
            if not value_dtype:   # float16 values are not the variable's size
                client._sizes.remember(name, buf.size, shape)
    return filled(got, out) if out is not None else got


def push_streamed(client: "PSClient", dense, sparse, sync: SyncSpec | None, tables=None):
    """Gradients too large for one call: the dense ones in Upload's frames,
    then each row-wise one, then each table's (a call of its own; None: no
    tables asked for): the versions, and (with ``tables``) the table results."""
    out = []
    if dense:
        req = ps_pb2.PushRequest()
        set_sync(req, sync)
        for name, a, uid in dense:
            TP.fill(req.updates.add(name=name, update_id=uid).tensor, a, with_data=False)
        out = list(client.channel.upload("push", req, [a for _, a, _ in dense],
                                       stream_timeout(client.timeout, sum(
                                           a.nbytes for _, a, _ in dense))).updated.versions)
    out += [client.push_sparse(name, ids, rows, sync=sync, update_id=uid)
            for name, ids, rows, uid in sparse]
    if tables is None:
        return out
    form = routing.FRAME if client.channel.plan.socket else routing.UNARY
    return out, [client._push_bulk([], [], None, form, t.nbytes, [t]).result()[1][0]
                 for t in tables]


def gather_split(client: "PSClient", name: str, ids: np.ndarray, sync_step: int | None):
    """A gather as calls of one message each (each one consistent):
    (rows, the oldest piece's version)."""
    meta = client.get_meta(name)
    row_bytes = max(1, meta.nbytes // meta.shape[0]) if meta.shape and meta.shape[0] else 1
    per_call = max(1, client.limits.message_bytes // row_bytes)
    sent = []
    for i in range(0, ids.size, per_call):
        req = ps_pb2.GatherRequest(name=name)
        TP.fill(req.ids, ids[i:i + per_call])
        set_sync_read(req, sync_step)
        sent.append(client.channel.send(methods.GATHER, req, post=_gathered_rows))
    parts = [p.result() for p in sent]
    rows = np.concatenate([p[0] for p in parts]) if parts else np.empty(
        (0,) + meta.shape[1:], meta.dtype)
    return rows, min((p[1] for p in parts), default=meta.version)


def lookup_split(client: "PSClient", t: TableLookup) -> np.ndarray:
    """A look-up too large for one reply, as several (each a message's
    worth of keys, or of bags)."""
    if t.row_bytes <= 0:
        raise InvalidArgument(f"a look-up of table {t.name!r} too large for one reply and "
                              "of rows of unknown size: look up fewer keys per call")
    per_call = max(1, client.limits.message_bytes // t.row_bytes)
    if t.offsets is None:
        flat = t.keys.reshape(-1)
        counts = None if t.counts is None else np.asarray(t.counts).reshape(-1)
        parts = [dataclasses.replace(t, keys=flat[i:i + per_call],
                                     counts=None if counts is None else counts[i:i + per_call])
                 for i in range(0, flat.size, per_call)]
        shape = t.keys.shape
    else:
        offsets = np.asarray(t.offsets, np.int64)
        parts = []
        for lo in range(0, offsets.size - 1, per_call):
            hi = min(lo + per_call, offsets.size - 1)
            a, b = offsets[lo], offsets[hi]
            parts.append(dataclasses.replace(
                t, keys=t.keys[a:b], offsets=offsets[lo:hi + 1] - a,
                weights=None if t.weights is None else t.weights[a:b]))
        shape = (offsets.size - 1,)
    got = [client.read_all_async(tables=[p]).result().tables[0] for p in parts]
    rows = np.concatenate(got) if got else np.zeros((0, 0), np.float32)
    return rows.reshape(shape + rows.shape[-1:])
