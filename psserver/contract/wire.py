"""Hand-framed protobuf for the bulk methods: tensor bytes copied once.

``ReadReply`` and ``PushRequest`` carry almost nothing but tensor bytes. The
generated code copies those bytes several times on each side (into the
message, out of it, through serialization): measured 182 us to serialize a
1.33 MB reply against 26 us to join its bytes. The ``ParameterServerBulk``
service (ps.proto) has the same messages; its server side and PSClient
write and read them here, in the protobuf wire format, so any generated
client still understands them:

* ``encode_read_reply`` joins each value's header and its array's memory in
  one copy (psserver/contract/wire_decode.py's ``decode_read_reply`` returns arrays
  that are views of the received bytes, ``receive_read_reply`` receives
  them straight into the caller's arrays).
* ``encode_push_request`` likewise for pushes (``decode_push_request``).

Both may carry a step's other calls to the same server: a read reply the
rows of row look-ups (``gathered``, GatherReply each) and of dynamic-table
look-ups (``table_rows``, TableRows each), a push row-wise gradients
(``sparse``, SparseUpdate each) and dynamic-table gradients
(``table_updates``, TableGradient each), so a step costs one round trip per
server each way, as on the same host.

Only the fields these messages have are written or read; a decoder skips
fields it does not know, as protobuf does.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import numpy as np

from psserver.contract.tensor import WIRE_DTYPES, WIRE_NAMES, dtype_name
from psserver.errors import InvalidArgument

_VARINT, _LEN = 0, 2


#: The varints of 0-16383 (every key, name and shape length and most
#: dimensions), made once: a message's header is mostly these.
_SMALL_VARINTS = [bytes((n,)) for n in range(128)] + [
    bytes((n & 0x7F | 0x80, n >> 7)) for n in range(128, 1 << 14)]


def _varint(n: int) -> bytes:
    if 0 <= n < 16384:
        return _SMALL_VARINTS[n]
    if n < 0:   # int64 fields: two's complement in 10 bytes, as protobuf writes it
        n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _len_field(field: int, payload_len: int) -> bytes:
    return _key(field, _LEN) + _varint(payload_len)


@functools.lru_cache(maxsize=4096)   # the same tensors go out step after step
def _tensor_head(dtype: str, shape: tuple[int, ...], nbytes: int,
                 pad: int | None = None) -> bytes:
    """Tensor's dtype and shape fields and the key + length of its data;
    ``pad``: the length of a padding field (number _PAD_FIELD) put before it."""
    dt = dtype.encode()
    head = _len_field(1, len(dt)) + dt
    if shape:
        packed = b"".join(_varint(int(d)) for d in shape)
        head += _len_field(2, len(packed)) + packed
    if pad is not None:
        head += _len_field(_PAD_FIELD, pad) + bytes(pad)
    return head + _len_field(3, nbytes)


#: Tensor data starts at a multiple of this from the start of the message, so
#: a receiver's views of it are aligned (its buffer is): numpy's BLAS dot and
#: SIMD loops fall back to slow paths on unaligned arrays (a dot 9-40x slower).
ALIGN = 64
#: Field number of the padding (unknown to every decoder: skipped). Reserved
#: in ps.proto's Tensor.
_PAD_FIELD = 15


def _aligned(pos: int, prefix_with) -> bytes:
    """prefix_with(pad) -> the bytes before a tensor's data; the one (of no
    padding, or a pad field of under 5 * ALIGN bytes) that ends at a multiple of
    ALIGN when written at pos."""
    prefix = prefix_with(None)
    need = -(pos + len(prefix)) % ALIGN
    if not need:
        return prefix
    # A pad field of p < 128 bytes takes 2 + p; the lengths around it may
    # grow by a byte each (two of them): try those first, then every size.
    # (A length crossing a varint boundary skips a residue, and two lengths may
    # skip the same one a round apart: hence several rounds.)
    for pad in (*((need - 2 - grew) % ALIGN for grew in (0, 1, 2)), *range(5 * ALIGN)):
        prefix = prefix_with(pad)
        if (pos + len(prefix)) % ALIGN == 0:
            return prefix
    raise AssertionError("no padding aligns the tensor")


def _string(field: int, text: str) -> bytes:
    raw = text.encode()
    return _len_field(field, len(raw)) + raw


def contiguous_bytes(arr: np.ndarray) -> memoryview:
    if dtype_name(arr.dtype) not in WIRE_DTYPES:
        raise InvalidArgument(
            f"cannot send dtype {arr.dtype.name!r}; use one of {sorted(WIRE_DTYPES)}")
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return memoryview(arr.reshape(-1).view(np.uint8))


class Scattered(tuple):
    """A message as the buffers that make it up, in order, not joined: a
    socket sends them with one sendmsg (psserver/ipc.py), so a large
    tensor's bytes go from its array to the kernel without a copy here.
    ``bytes(joined(msg))`` is the message; the arrays must not change until
    it is sent."""

    @property
    def nbytes(self) -> int:
        return sum(memoryview(p).nbytes for p in self)


#: ``into`` for the encoders: the parts as a Scattered message, not joined.
SCATTER = object()


def joined(msg):
    """``msg`` as one buffer (a Scattered message joined; anything else as it is)."""
    return b"".join(msg) if isinstance(msg, Scattered) else msg


def _join(parts: list, into) -> bytes | memoryview | Scattered:
    """parts joined: bytes, or with ``into`` (psserver/buffers.take) a
    memoryview of the buffer it gives (a socket's frame: used again), or
    with SCATTER not joined (a Scattered)."""
    if into is SCATTER:
        return Scattered(filter(len, parts))
    if into is None:
        return b"".join(parts)
    total = 0
    for p in parts:
        total += len(p)
    out = memoryview(into(total))
    pos = 0
    for p in parts:
        out[pos:pos + len(p)] = p
        pos += len(p)
    return out


def encode_read_reply(values: Sequence[tuple[str, int, np.ndarray]],
                      into: Callable[[int], np.ndarray] | None = None,
                      gathered: Sequence[tuple[int, np.ndarray]] = (),
                      table_rows: Sequence[np.ndarray] = ()) -> bytes | memoryview:
    """ReadReply{values: [VariableValue{name, version, value: Tensor}],
    gathered: [GatherReply{version, rows}], table_rows: [TableRows{rows}]}
    as bytes (see _join for ``into``).

    Call with the arrays' locks held: the join is the one copy of their data.
    """
    parts: list = []
    pos = 0
    for name, version, arr in values:
        data = contiguous_bytes(arr)
        n, dt = len(data), dtype_name(arr.dtype)
        fixed = _string(1, name) + (_key(2, _VARINT) + _varint(version) if version else b"")

        def prefix_with(pad, n=n, dt=dt, shape=arr.shape, fixed=fixed):
            tensor_head = _tensor_head(dt, shape, n, pad)
            vv_head = fixed + _len_field(3, len(tensor_head) + n) + tensor_head
            return _len_field(1, len(vv_head) + n) + vv_head
        prefix = _aligned(pos, prefix_with)
        parts += [prefix, data]
        pos += len(prefix) + n
    for version, rows in gathered:
        body = _gather_reply_parts(version, rows)
        parts += [_len_field(2, sum(len(b) for b in body)), *body]
    for rows in table_rows:
        body = _tensor_field(1, rows)
        parts += [_len_field(3, sum(len(b) for b in body)), *body]
    return _join(parts, into)


#: Push headers made (encode_push_request), by what they depend on; at most
#: this many are kept (a job pushes the same few shards over and over).
_PUSH_PREFIXES: dict[tuple, bytes] = {}
_PREFIXES_KEPT = 4096


def encode_push_request(updates: Sequence[tuple[str, np.ndarray, int]],
                        sync: bytes = b"", into=None,
                        sparse: Sequence[tuple[str, np.ndarray, np.ndarray, int]] = (),
                        tables: Sequence[tuple] = ()) -> bytes | memoryview | Scattered:
    """PushRequest{updates: [DenseUpdate{name, tensor, update_id}], sync,
    sparse: [SparseUpdate{name, ids, values, update_id}], table_updates:
    [TableGradient{name, keys, grads, update_id, sync, offsets, weights}]}
    as bytes (see _join for ``into``).

    ``sync`` is a serialized SyncInfo (b"": none); ``sparse``: (name, ids,
    rows, update_id) each (the server takes them only without ``sync``);
    ``tables``: (name, keys, grads, update_id, sync bytes or None, offsets
    or None, weights or None) each."""
    parts: list = []
    pos = 0
    for name, arr, uid in updates:
        dt = WIRE_NAMES.get(arr.dtype)
        if dt is not None and arr.flags.c_contiguous:   # (the common case, inline)
            data = arr.reshape(-1).view(np.uint8)
        else:
            data, dt = contiguous_bytes(arr), dtype_name(arr.dtype)
        n = len(data)
        tail = b"\x18" + _varint(uid) if uid else b""   # field 3, varint
        # The header before the data depends only on these: made once (the
        # same updates go out step after step).
        key = (name, dt, arr.shape, pos % ALIGN, len(tail))
        prefix = _PUSH_PREFIXES.get(key)
        if prefix is None:
            def prefix_with(pad, n=n, dt=dt, shape=arr.shape, name=name, tail=tail):
                tensor_head = _tensor_head(dt, shape, n, pad)
                head = _string(1, name) + _len_field(2, len(tensor_head) + n) + tensor_head
                return _len_field(1, len(head) + n + len(tail)) + head
            prefix = _aligned(pos, prefix_with)
            if len(_PUSH_PREFIXES) >= _PREFIXES_KEPT:
                _PUSH_PREFIXES.clear()
            _PUSH_PREFIXES[key] = prefix
        parts += (prefix, data, tail)
        pos += len(prefix) + n + len(tail)
    for name, ids, rows, uid in sparse:
        body = _sparse_parts(name, ids, rows, uid)
        parts += [_len_field(3, sum(len(b) for b in body)), *body]
    for name, keys, grads, uid, own_sync, offsets, weights in tables:
        body = [_string(1, name), *_tensor_field(2, keys), *_tensor_field(3, grads)]
        if uid:
            body.append(_key(4, _VARINT) + _varint(uid))
        if own_sync is not None:
            body += [_len_field(5, len(own_sync)), own_sync]
        if offsets is not None:
            body += _tensor_field(6, offsets)
        if weights is not None:
            body += _tensor_field(7, weights)
        parts += [_len_field(4, sum(len(b) for b in body)), *body]
    if sync:
        parts += [_len_field(2, len(sync)), sync]
    return _join(parts, into)


def _tensor_field(field: int, arr: np.ndarray) -> list:
    """A Tensor field's parts: its header, then arr's memory (not copied)."""
    data = contiguous_bytes(arr)
    head = _tensor_head(dtype_name(arr.dtype), arr.shape, len(data))
    return [_len_field(field, len(head) + len(data)), head, data]


def encode_collective_chunk(group: bytes, op: int, step: int, sender: int,
                            data: np.ndarray | None, receiver: bytes = b"",
                            member: bytes = b"", signature: int = 0,
                            abort: str = "") -> Scattered:
    """CollectiveChunk{group, op, step, sender, data, receiver, member,
    signature, abort} (worker.proto) as its parts (``data`` None: a probe
    or an abort, no data): ``data``'s memory is sent as it is (not copied),
    so it must not change until the call is answered."""
    reason = abort.encode()
    head = b"".join((_len_field(1, len(group)), group, _key(2, _VARINT), _varint(op),
                     _key(3, _VARINT), _varint(step), _key(4, _VARINT), _varint(sender),
                     _len_field(6, len(receiver)), receiver, _len_field(7, len(member)), member,
                     _key(8, _VARINT), _varint(signature),
                     _len_field(9, len(reason)) + reason if reason else b""))
    tensor = () if data is None else _tensor_field(5, data)
    return Scattered(p for p in (head, *tensor) if len(p))


def _gather_reply_parts(version: int, rows: np.ndarray) -> list:
    """GatherReply{version, rows}'s parts (the rows' memory not copied)."""
    return [_key(1, _VARINT) + _varint(version) if version else b"", *_tensor_field(2, rows)]


def encode_gather_reply(version: int, rows: np.ndarray) -> bytes:
    """GatherReply{version, rows} as bytes, the rows' data copied once (the
    generated code copies it three times: into the message, and twice
    serializing); any protobuf reader parses it."""
    return b"".join(_gather_reply_parts(version, rows))


def _sparse_parts(name: str, ids: np.ndarray, rows: np.ndarray, update_id: int,
                  sync: bytes | None = None) -> list:
    """PushSparseRequest's parts (a SparseUpdate's without ``sync``): the
    arrays' memory not copied."""
    parts = [_string(1, name), *_tensor_field(2, ids), *_tensor_field(3, rows)]
    if sync is not None:
        parts += [_len_field(4, len(sync)), sync]
    if update_id:
        parts += [_key(5, _VARINT), _varint(update_id)]
    return parts


def encode_push_sparse_request(name: str, ids: np.ndarray, rows: np.ndarray,
                               update_id: int = 0, sync: bytes | None = None,
                               into=None) -> bytes | memoryview | Scattered:
    """PushSparseRequest{name, ids, values, sync, update_id} (see _join for
    ``into``; with SCATTER the arrays' memory goes to the socket as it is);
    ``sync``: a serialized SyncInfo, None for none. The server parses it
    with the generated code, as any other writer's."""
    return _join(_sparse_parts(name, ids, rows, update_id, sync), into)


def encode_replicate_request(records) -> bytes:
    """ReplicateRequest{records: [ReplicaRecord]} (psserver.core.replication.Record
    each) as bytes: the tensor's data copied once (the receiver parses it
    with protobuf, which copies it anyway: no alignment padding)."""
    parts: list = []
    for r in records:
        data = contiguous_bytes(r.tensor)
        head = _string(1, r.name) + b"".join(
            _key(f, _VARINT) + _varint(v) for f, v in (
                (2, r.epoch), (3, r.version), (4, r.update_id), (5, r.sync_steps), (6, r.kind))
            if v)
        for field, a in ((8, r.ids), (9, getattr(r, "evicted", None))):
            if a is not None:
                raw = contiguous_bytes(a)
                a_head = _tensor_head(dtype_name(a.dtype), a.shape, len(raw))
                head += _len_field(field, len(a_head) + len(raw)) + a_head + bytes(raw)
        tensor_head = _tensor_head(dtype_name(r.tensor.dtype), r.tensor.shape, len(data))
        head += _len_field(7, len(tensor_head) + len(data)) + tensor_head
        parts += [_len_field(1, len(head) + len(data)), head, data]
    return b"".join(parts)
