"""What a client's calls give back and the small pieces of their requests:
``Snapshot`` (a value read), ``meta_from_proto``, sync fields, the arrays a
read lands in, and ``SizeCache`` (what a client knows of the sizes of a
server's variables, which picks the form of its calls)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from protos.pstrain.v1 import ps_pb2
from psserver.contract import Peer, SyncSpec, TableRead, TableWrite, VariableMeta
from psserver.contract import tensor as T
from psserver.errors import InvalidArgument
from psserver.link import tensor_proto as TP


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A variable's value as read, with the version it belongs to."""
    name: str
    version: int
    value: np.ndarray


@dataclasses.dataclass(frozen=True)
class TableLookup(TableRead):
    """A look-up of this server's shard of dynamic table ``name`` (a read's
    ReadRequest.table_lookups entry): ``keys`` (int64, any shape) and
    ``counts`` (how often each occurs in the batch); or bags of ``keys``
    (1-D): ``offsets`` (n + 1) and ``weights`` (one per key), pooled by the
    server (psserver/core/bags.py). ``admit=False``: nothing counted, created or
    evicted; ``sync_step``: wait for earlier steps first; ``row_bytes``: a
    row's bytes, if known (the call's size is planned with it)."""
    row_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """The bytes of its rows (0: row_bytes not given)."""
        n = self.keys.size if self.offsets is None else max(0, len(self.offsets) - 1)
        return n * self.row_bytes

    def fill(self, msg) -> None:
        """Fill a TableLookup message (ps.proto)."""
        msg.name, msg.no_admit = self.name, not self.admit
        TP.fill(msg.keys, self.keys)
        for field in ("counts", "offsets", "weights"):
            a = getattr(self, field)
            if a is not None:
                TP.fill(getattr(msg, field), np.asarray(a))
        if self.sync_step is not None:
            msg.sync.step = self.sync_step


@dataclasses.dataclass(frozen=True)
class TableGradient(TableWrite):
    """Row gradients of this server's shard of dynamic table ``name`` (a
    push's PushRequest.table_updates entry): one row per key of ``keys``
    (1-D int64), or one per bag (``offsets``, ``weights``: psserver/core/bags.py);
    applied once per non-zero ``update_id``; ``sync``: this replica's share
    of a step."""

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + np.asarray(self.grads).nbytes

    def framed(self) -> tuple:
        """The entry as wire.encode_push_request takes it."""
        return (self.name, np.asarray(self.keys), np.asarray(self.grads), self.update_id,
                None if self.sync is None else sync_info(self.sync).SerializeToString(),
                None if self.offsets is None else np.asarray(self.offsets),
                None if self.weights is None else np.asarray(self.weights))


class StepRead(tuple):
    """What one read of a step gives (PSClient.read_all_async): ``values``
    [Snapshot], ``rows`` [(rows, version)] of the row look-ups, ``tables``
    [rows] of the dynamic-table look-ups."""

    def __new__(cls, values, rows, tables):
        return tuple.__new__(cls, (values, rows, tables))

    values = property(lambda self: self[0])
    rows = property(lambda self: self[1])
    tables = property(lambda self: self[2])


def meta_from_proto(m: ps_pb2.VariableMeta) -> VariableMeta:
    backup = Peer(m.backup.address, m.backup.name) if m.HasField("backup") else None
    return VariableMeta(m.name, m.dtype, tuple(m.shape), m.version, m.optimizer.name,
                        dict(m.optimizer.params), m.nbytes, m.slot_nbytes, m.allow_nonfinite,
                        m.sync_steps, m.dropped_gradients, int(m.role), m.epoch, backup,
                        m.gathering)


def sync_info(sync: SyncSpec) -> ps_pb2.SyncInfo:
    """The SyncInfo message of a SyncSpec."""
    return ps_pb2.SyncInfo(**dataclasses.asdict(sync))


def set_sync(req, sync: SyncSpec | None) -> None:
    if sync is not None:
        req.sync.CopyFrom(sync_info(sync))


def set_sync_read(req, sync_step: int | None) -> None:
    if sync_step is not None:
        req.sync.step = sync_step


def dest(out: Sequence[np.ndarray | None] | None, i: int, like,
         widen: bool = False) -> np.ndarray | None:
    """out[i] when the caller gave it with ``like``'s shape and dtype (with
    ``widen``, also a float dtype when ``like`` is float16: a value read as
    float16), else None (the value goes into a new array)."""
    d = out[i] if out is not None and i < len(out) else None
    if d is None or d.shape != like.shape:
        return None
    if d.dtype == like.dtype or (widen and like.dtype == np.float16 and d.dtype.kind == "f"):
        return d
    return None


def halved(snaps: list[Snapshot]) -> list[Snapshot]:
    """Snapshots with float values rounded to float16 (as a read with
    value_dtype "float16" sends them): in place where the value is the
    caller's array, else as a new float16 array."""
    done = []
    for s in snaps:
        v = s.value
        if v.dtype.kind == "f" and v.dtype.itemsize > 2:
            if v.flags.writeable:
                np.copyto(v, T.as_float16(v))
            else:
                s = Snapshot(s.name, s.version, T.as_float16(v))
        done.append(s)
    return done


def filled(snaps: list[Snapshot], out: Sequence[np.ndarray | None]) -> list[Snapshot]:
    """Snapshots with their values copied into out's arrays (where given and
    fitting; a float16 value into a wider float array)."""
    done = []
    for i, s in enumerate(snaps):
        d = dest(out, i, s.value, widen=True)
        if d is not None and d is not s.value:   # (received into it already: as is)
            if s.value.dtype == np.float16 and d.dtype != np.float16:
                T.widen_float16(s.value, d.dtype, out=d)
            else:
                np.copyto(d, s.value)
            s = Snapshot(s.name, s.version, d)
        done.append(s)
    return done


def as_ids(ids, what: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} ids must be integers, got {ids.dtype.name}")
    if ids.dtype.kind == "u" or ids.dtype.itemsize not in (4, 8):
        ids = ids.astype(np.int64)
    return ids


class SizeCache:
    """The sizes (bytes, rows) of one server's variables as this client last
    saw them (reads, creates, metadata): they pick unary calls or streams and
    size segments. Kept for one incarnation of the server (``check``)."""

    def __init__(self):
        self.incarnation = 0
        self.nbytes: dict[str, int] = {}
        self.rows: dict[str, int] = {}

    def check(self, incarnation: int) -> None:
        """Forget everything if the server restarted since."""
        if incarnation != self.incarnation:
            self.nbytes, self.rows, self.incarnation = {}, {}, incarnation

    def remember(self, name: str, nbytes: int, shape: Sequence[int]) -> None:
        self.nbytes[name] = nbytes
        self.rows[name] = shape[0] if len(shape) else 0

    def forget(self, names) -> None:
        for n in names:
            self.nbytes.pop(n, None)
            self.rows.pop(n, None)

    def known(self, names: Sequence[str]) -> int | None:
        """The bytes of all of ``names``, or None if one is unknown."""
        total = 0
        for n in names:
            b = self.nbytes.get(n)
            if b is None:
                return None
            total += b
        return total

    def row_bytes(self, name: str) -> int | None:
        rows, b = self.rows.get(name), self.nbytes.get(name)
        return None if not rows or b is None else b // rows
