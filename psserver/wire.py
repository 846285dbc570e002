"""Hand-framed protobuf for the bulk methods: tensor bytes copied once.

``ReadReply`` and ``PushRequest`` carry almost nothing but tensor bytes. The
generated code copies those bytes several times on each side (into the
message, out of it, through serialization): measured 182 us to serialize a
1.33 MB reply against 26 us to join its bytes. The ``ParameterServerBulk``
service (ps.proto) has the same messages; its server side and PSClient
write and read them here, in the protobuf wire format, so any generated
client still understands them:

* ``encode_read_reply`` joins each value's header and its array's memory in
  one copy; ``decode_read_reply`` returns arrays that are views of the
  received bytes (no copy).
* ``encode_push_request`` / ``decode_push_request`` likewise for pushes.

Both may carry a step's other calls to the same server: a read reply the
rows of row lookups (``gathered``, GatherReply each), a push row-wise
gradients (``sparse``, SparseUpdate each), so a step costs one round trip per
server each way, as on the same host.

Only the fields these messages have today are written or read; a decoder
skips fields it does not know, as protobuf does.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterator, Sequence

import numpy as np

from psserver.contract import InvalidArgument, ResourceExhausted
from psserver.tensor import (WIRE_DTYPES, WIRE_NAMES, check_dtype, check_shape, dtype_name,
                             nbytes_of)

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
                      gathered: Sequence[tuple[int, np.ndarray]] = ()) -> bytes | memoryview:
    """ReadReply{values: [VariableValue{name, version, value: Tensor}],
    gathered: [GatherReply{version, rows}]} as bytes (see _join for ``into``).

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
    return _join(parts, into)


#: Push headers made (encode_push_request), by what they depend on; at most
#: this many are kept (a job pushes the same few shards over and over).
_PUSH_PREFIXES: dict[tuple, bytes] = {}
_PREFIXES_KEPT = 4096


def encode_push_request(updates: Sequence[tuple[str, np.ndarray, int]],
                        sync: bytes = b"", into=None,
                        sparse: Sequence[tuple[str, np.ndarray, np.ndarray, int]] = ()
                        ) -> bytes | memoryview | Scattered:
    """PushRequest{updates: [DenseUpdate{name, tensor, update_id}], sync,
    sparse: [SparseUpdate{name, ids, values, update_id}]} as bytes (see
    _join for ``into``).

    ``sync`` is a serialized SyncInfo (b"": none); ``sparse``: (name, ids,
    rows, update_id) each (the server takes them only without ``sync``)."""
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
    if sync:
        parts += [_len_field(2, len(sync)), sync]
    return _join(parts, into)


def _tensor_field(field: int, arr: np.ndarray) -> list:
    """A Tensor field's parts: its header, then arr's memory (not copied)."""
    data = contiguous_bytes(arr)
    head = _tensor_head(dtype_name(arr.dtype), arr.shape, len(data))
    return [_len_field(field, len(head) + len(data)), head, data]


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
    """ReplicateRequest{records: [ReplicaRecord]} (psserver.replication.Record
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


# -- decoding ------------------------------------------------------------------------------
# The decoders accept exactly what protobuf's own parser accepts for these
# messages, and read the same content (tests/test_wire.py checks it against
# the generated parser on random and mutated encodings): field numbers 1 to
# 2**29 - 1; every wire type, groups matched, none running past its end;
# fields of a wrong wire type skipped as unknown; strings UTF-8; a message
# field seen twice merged (its scalars: the last wins; repeated ones: joined),
# as parsing the two encodings one after the other would.
_MAX_FIELD = (1 << 29) - 1
_U64 = (1 << 64) - 1


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= end:
            raise InvalidArgument("truncated message (a varint runs past its end)")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n & _U64, pos
        shift += 7
        if shift >= 70:
            raise InvalidArgument("malformed message (a varint is longer than 10 bytes)")


def _int64(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


def _skip(buf: memoryview, pos: int, end: int, field: int, wt: int) -> int:
    """The position after a field's value (of any wire type, groups included)."""
    if wt == _VARINT:
        return _read_varint(buf, pos, end)[1]
    if wt == _LEN:
        n, pos = _read_varint(buf, pos, end)
        if n > end - pos:
            raise InvalidArgument("truncated message (a field runs past its end)")
        return pos + n
    if wt in (1, 5):
        size = 8 if wt == 1 else 4
        if size > end - pos:
            raise InvalidArgument("truncated message (a fixed-size field runs past its end)")
        return pos + size
    if wt == 3:   # a group: fields until its matching end
        while True:
            f, w, pos = _read_key(buf, pos, end)
            if w == 4:
                if f != field:
                    raise InvalidArgument("malformed message (a group ends with another number)")
                return pos
            pos = _skip(buf, pos, end, f, w)
    raise InvalidArgument(f"malformed message (wire type {wt} where a field starts)")


def _read_key(buf: memoryview, pos: int, end: int) -> tuple[int, int, int]:
    key, pos = _read_varint(buf, pos, end)
    field, wt = key >> 3, key & 7
    if key >> 32 or not 1 <= field <= _MAX_FIELD:
        raise InvalidArgument(f"malformed message (field number {field})")
    return field, wt, pos


def _fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field, wire type, value or start, end) for each varint and
    length-delimited field in buf[pos:end]; the others are checked and skipped."""
    while pos < end:
        b = buf[pos]
        if 8 <= b < 0x80:   # a one-byte key (fields 1-15): most of them, read inline
            field, wt, pos = b >> 3, b & 7, pos + 1
        else:
            field, wt, pos = _read_key(buf, pos, end)
        if wt == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            yield field, wt, value, pos
        elif wt == _LEN:
            if pos < end and buf[pos] < 0x80:   # a one-byte length
                n, start = buf[pos], pos + 1
            else:
                n, start = _read_varint(buf, pos, end)
            if n > end - start:
                raise InvalidArgument("truncated message (a field runs past its end)")
            pos = start + n
            yield field, wt, start, pos
        else:
            pos = _skip(buf, pos, end, field, wt)


def _text(buf: memoryview, a: int, b: int, what: str) -> str:
    try:
        return bytes(buf[a:b]).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{what} is not valid UTF-8 text") from None


def _tensor_parts(buf: memoryview, spans: list[tuple[int, int]], what: str):
    """(dtype, shape, (data start, end)) of a Tensor message whose encoding is
    the given spans, merged in order."""
    dtype, shape, data = "", [], (0, 0)
    for pos, end in spans:
        for field, wt, a, b in _fields(buf, pos, end):
            if field == 1 and wt == _LEN:
                dtype = _text(buf, a, b, f"{what} dtype")
            elif field == 2 and wt == _LEN:   # packed
                p = a
                while p < b:
                    d, p = _read_varint(buf, p, b)
                    shape.append(_int64(d))
            elif field == 2 and wt == _VARINT:   # unpacked, as some writers send
                shape.append(_int64(a))
            elif field == 3 and wt == _LEN:
                data = (a, b)
    return dtype, shape, data


def _decode_tensor(raw: bytes, buf: memoryview, spans: list[tuple[int, int]],
                   what: str, parts=None) -> np.ndarray:
    """The array a Tensor (its encoding: spans of buf) holds, a view of raw;
    ``parts``: its _tensor_parts, when read already."""
    dtype, shape, data = _tensor_parts(buf, spans, what) if parts is None else parts
    dt = check_dtype(dtype, WIRE_DTYPES, f"{what} dtype")
    shape = check_shape(shape, f"{what} shape")
    n = nbytes_of(shape, dt)
    if data[1] - data[0] != n:
        raise InvalidArgument(f"{what} data has {data[1] - data[0]} bytes but dtype {dtype} and "
                              f"shape {list(shape)} need {n}")
    return np.frombuffer(raw, dtype=dt, count=n // dt.itemsize, offset=data[0]).reshape(shape)


#: (name, version, tensor) field numbers of a ReadReply's entries: its
#: values (VariableValue) and its looked-up rows (GatherReply, no name).
_VALUE_FIELDS, _GATHERED_FIELDS = (1, 2, 3), (0, 1, 2)


def _nested(buf: memoryview, a: int, b: int, name_field: int, varint_field: int,
            span_fields: Sequence[int]) -> tuple[str, int, dict[int, list[tuple[int, int]]]]:
    """A nested message of buf[a:b] with a name (a string field; 0: none), a
    varint and length-delimited fields kept as spans (a tensor's, merged
    later): (name, varint (unsigned), {field: [(start, end)]}), the last
    occurrence of a scalar winning, as protobuf has it."""
    name, value, spans = "", 0, {f: [] for f in span_fields}
    for field, wt, c, d in _fields(buf, a, b):
        if wt == _LEN:
            if field == name_field:
                name = _text(buf, c, d, "a variable name")
            elif field in spans:
                spans[field].append((c, d))
        elif field == varint_field:
            value = c
    return name, value, spans


def decode_read_reply(raw: bytes) -> "ReadValues":
    """[(name, version, array view of raw)] from ReadReply bytes, its
    ``gathered`` [(version, rows array view of raw)] (None for rows where a
    GatherReply has no tensor); a reply receive_read_reply took already: as
    it is."""
    if isinstance(raw, ReadValues):
        return raw
    buf = memoryview(raw)
    out = ReadValues()
    for field, wt, a, b in _fields(buf, 0, len(raw)):
        if field not in (1, 2) or wt != _LEN:
            continue
        fields = _VALUE_FIELDS if field == 1 else _GATHERED_FIELDS
        name, version, spans = _nested(buf, a, b, *fields[:2], fields[2:])
        spans = spans[fields[2]]
        what = f"value of {name!r}" if field == 1 else f"gathered rows {len(out.gathered)}"
        arr = _decode_tensor(raw, buf, spans, what) if spans else None
        if field == 1:
            out.append((name, _int64(version), arr))
        else:
            out.gathered.append((_int64(version), arr))
    return out


class ReadValues(list):
    """[(name, version, array)] of a ReadReply decoded, and ``gathered``
    [(version, rows)]; one received and decoded already
    (``receive_read_reply``) ``decode_read_reply`` gives back as it is."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gathered: list[tuple[int, np.ndarray | None]] = []


#: A read reply's bytes are taken off the socket this many at a time until a
#: value's data starts; its data then goes straight into its array.
_STREAM_CHUNK = 4096
#: A value whose data has not started after this many bytes is received whole.
_STREAM_PREFIX_MAX = 64 << 10
#: Bytes received whole are taken at most this many at a time (memory grows
#: with what arrives, not with what a header claims).
_WHOLE_CHUNK = 1 << 20


class _Short(Exception):
    """More bytes are needed before the prefix can be read."""


class _Whole(Exception):
    """The value is not laid out for streaming: receive and decode it whole."""


def _partial_fields(buf: memoryview, p: int, end: int, have: int):
    """(field, wire type, value or start, end) of each varint and
    length-delimited field of buf[p:end] whose key and length are within
    buf[:have] (a field's body may not have arrived yet); raises _Short
    where the next key is not, _Whole at any other wire type or a length
    past ``end``."""
    while p < end:
        if p >= have:
            raise _Short
        field, wt, q = _read_key(buf, p, min(have, end))
        if wt == _VARINT:
            v, p = _read_varint(buf, q, min(have, end))
            yield field, wt, v, p
        elif wt == _LEN:
            n, c = _read_varint(buf, q, min(have, end))
            if n > end - c:
                raise _Whole   # truncated: the whole decode says so
            p = c + n
            yield field, wt, c, p
        else:
            raise _Whole


def _value_prefix(buf: memoryview, a: int, end: int, have: int, fields=_VALUE_FIELDS):
    """The VariableValue (or with _GATHERED_FIELDS, GatherReply) in
    buf[a:end], of which buf[:have] has arrived: (name, version, dtype,
    shape, data start) when its Tensor's data is the last thing in it (our
    servers write it so: its data can go straight to its array), None when
    not (it is received and decoded whole). Raises _Short while what has
    arrived cannot tell."""
    def need(k: int) -> None:
        if k > have:
            raise _Short
    name_field, version_field, tensor_field = fields
    name, version = "", 0
    try:
        for field, wt, c, d in _partial_fields(buf, a, end, have):
            if field == version_field and wt == _VARINT:
                version = _int64(c)
            elif field == name_field and wt == _LEN:
                need(d)
                name = _text(buf, c, d, "a variable name")
            elif field == tensor_field and wt == _LEN:   # (data ending at end: so does the tensor)
                dtype, shape = "", []
                for f2, wt2, s, e in _partial_fields(buf, c, end, have):
                    if wt2 == _VARINT:
                        if f2 == 2:   # unpacked, as some writers send
                            shape.append(_int64(s))
                    elif f2 == 3:
                        return (name, version, dtype, shape, s) if e == end else None
                    else:
                        need(e)
                        if f2 == 1:
                            dtype = _text(buf, s, e, "a value's dtype")
                        elif f2 == 2:
                            k = s
                            while k < e:
                                v, k = _read_varint(buf, k, e)
                                shape.append(_int64(v))
                return None
        return None
    except _Whole:
        return None
    except InvalidArgument:
        if have < end:   # a varint cut off where the bytes so far end
            raise _Short from None
        return None


def receive_read_reply(recv_into: Callable[[memoryview], None], n: int,
                       want: Sequence[tuple[str, np.ndarray | None]],
                       want_rows: Sequence[np.ndarray | None] = ()) -> ReadValues:
    """A ReadReply of n bytes taken off a socket (``recv_into(view)`` fills
    all of view) and decoded, each value's data received straight into its
    array: ``want[i]`` = (name asked for, array or None) for the i-th value
    (``want_rows[k]``: array or None for the k-th looked-up rows); an array
    of that value's dtype and shape (C-contiguous, writable) is
    filled in place and returned; any other value gets a new array. A value's
    data goes from the socket to its array with no copy once it starts past
    the first few KiB taken (our servers' values always do, after a short
    header); a value written otherwise (another field after its data) is
    received whole, decoded, then copied in. On an error (a reply refused
    part-way) the arrays' contents are undefined: values before the bad one
    may have landed (the connection must be dropped: where the next reply
    starts is unknown)."""
    out = ReadValues()
    head = bytearray()
    got = 0

    def fits(i: int, name: str | None, dt, shape) -> np.ndarray | None:
        """The array offered for the i-th value (name None: i-th rows), if it fits."""
        if name is None:
            arr = want_rows[i] if i < len(want_rows) else None
        else:
            arr = want[i][1] if i < len(want) and want[i][0] == name else None
        if arr is None or arr.dtype != dt or arr.shape != tuple(shape) \
                or not arr.flags.c_contiguous or not arr.flags.writeable:
            return None
        return arr

    def decoded(raw: bytes) -> None:
        got = decode_read_reply(raw)
        for entries, items, named in ((out, got, True), (out.gathered, got.gathered, False)):
            for item in items:
                arr = item[-1]
                dest = None if arr is None else fits(
                    len(entries), item[0] if named else None, arr.dtype, arr.shape)
                if dest is not None:
                    dest[...] = arr
                entries.append((*item[:-1], arr if dest is None else dest))

    def fetch(k: int = _STREAM_CHUNK) -> None:
        nonlocal got
        k = min(k, n - got)
        if k <= 0:
            raise InvalidArgument("truncated message (a read reply ends inside a value)")
        while k > 0:
            chunk = bytearray(min(k, _WHOLE_CHUNK))
            recv_into(memoryview(chunk))
            head.extend(chunk)
            got += len(chunk)
            k -= len(chunk)

    def take(end: int) -> bytearray | bytes:
        """head's first end bytes, taken out of it (all of head: not copied)."""
        nonlocal head
        if len(head) == end:
            raw, head = head, bytearray()
            return raw
        raw = bytes(head[:end])
        del head[:end]
        return raw

    while got < n or head:
        while True:   # the top-level field's key and length
            try:
                with memoryview(head) as buf:   # (released: head grows)
                    field, wt, p = _read_key(buf, 0, len(head))
                    if wt == _LEN:
                        size, p = _read_varint(buf, p, len(head))
                break
            except InvalidArgument:
                if got == n:
                    raise
                fetch()
        if field not in (1, 2) or wt != _LEN:   # not ours: everything left decoded as it is
            if got < n:
                fetch(n - got)
            decoded(take(len(head)))
            return out
        rows = field == 2   # a GatherReply (ReadReply.gathered), else a VariableValue
        end = p + size
        if end > len(head) + (n - got):
            raise InvalidArgument("truncated message (a field runs past its end)")
        while True:
            try:
                with memoryview(head) as buf:
                    pre = _value_prefix(buf, p, end, len(head),
                                        _GATHERED_FIELDS if rows else _VALUE_FIELDS) \
                        if len(head) < end else None
                break
            except _Short:
                if len(head) - p > _STREAM_PREFIX_MAX:
                    pre = None
                    break
                fetch(max(_STREAM_CHUNK, len(head) - p))   # doubling: parsed O(prefix) times
        if pre is None:   # received whole, decoded as ever
            if len(head) < end:
                fetch(end - len(head))
            decoded(take(end))
            continue
        name, version, dtype, shape, start = pre
        what = f"gathered rows {len(out.gathered)}" if rows else f"value of {name!r}"
        dt = check_dtype(dtype, WIRE_DTYPES, f"{what} dtype")
        shape = check_shape(shape, f"{what} shape")
        if nbytes_of(shape, dt) != end - start:
            raise InvalidArgument(f"{what} data has {end - start} bytes but dtype "
                                  f"{dtype} and shape {list(shape)} need "
                                  f"{nbytes_of(shape, dt)}")
        arr = fits(len(out.gathered), None, dt, shape) if rows else \
            fits(len(out), name, dt, shape)
        if arr is None:
            try:   # (pages are committed as bytes arrive)
                arr = np.empty(shape, dt)
            except MemoryError:
                raise ResourceExhausted(f"no memory for {what} ({end - start} "
                                        "bytes) of a read reply") from None
        target = memoryview(arr.reshape(-1).view(np.uint8))
        k = min(len(head) - start, end - start)
        target[:k] = head[start:start + k]
        if k < len(target):
            recv_into(target[k:])
            got += len(target) - k
        del head[:start + k]
        if rows:
            out.gathered.append((version, arr))
        else:
            out.append((name, version, arr))
    return out


def parse_push_request(raw: bytes):
    """The structure of PushRequest bytes, as protobuf reads it, with no
    check of what it means: ([(name, (dtype, shape, data span) or None,
    update_id)], SyncInfo bytes (every occurrence, joined: merged when
    parsed; b"" when present but empty) or None, buf (raw's memoryview),
    [(name, ids spans, ids (dtype, shape, data span) or None, values spans,
    values (...) or None, update_id, SyncInfo bytes or None)] of each
    SparseUpdate). Raises InvalidArgument where protobuf's parser fails."""
    buf = memoryview(raw)
    updates, sync, sparse = [], [], []
    for field, wt, a, b in _fields(buf, 0, len(raw)):
        if field == 1 and wt == _LEN:   # a DenseUpdate{name, tensor, update_id}
            name, uid, spans = _nested(buf, a, b, 1, 3, (2,))
            spans = spans[2]
            tensor = _tensor_parts(buf, spans, f"gradient of {name!r}") if spans else None
            updates.append((name, spans, tensor, uid))
        elif field == 2 and wt == _LEN:
            sync.append(bytes(buf[a:b]))
        elif field == 3 and wt == _LEN:   # a SparseUpdate{name, ids, values, sync, update_id}
            name, uid, spans = _nested(buf, a, b, 1, 5, (2, 3, 4))
            ids, values, own_sync = spans[2], spans[3], spans[4]
            sparse.append((name, ids, _tensor_parts(buf, ids, f"ids of {name!r}") if ids else None,
                           values, _tensor_parts(buf, values, f"row gradient of {name!r}")
                           if values else None, uid,
                           b"".join(bytes(buf[c:d]) for c, d in own_sync) if own_sync else None))
    return updates, (b"".join(sync) if sync else None), buf, sparse


def decode_push_request(raw: bytes) -> tuple[list[tuple[str, np.ndarray, int]], bytes | None,
                                             list[tuple[str, np.ndarray, np.ndarray, int,
                                                        bool]]]:
    """([(name, array view of raw, update_id)], serialized SyncInfo or None,
    [(name, ids, rows, update_id, whether it carries a sync of its own)] of
    the row-wise updates: views of raw)."""
    updates, sync, buf, sparse = parse_push_request(raw)
    out = []
    for name, spans, parts, uid in updates:
        if not spans:
            raise InvalidArgument(f"update of {name!r} carries no tensor")
        out.append((name, _decode_tensor(raw, buf, spans, f"gradient of {name!r}", parts), uid))
    rows = []
    for name, id_spans, id_parts, value_spans, value_parts, uid, own_sync in sparse:
        if not id_spans or not value_spans:
            raise InvalidArgument(f"row-wise update of {name!r} carries no "
                                  f"{'ids' if not id_spans else 'values'}")
        rows.append((name, _decode_tensor(raw, buf, id_spans, f"ids of {name!r}", id_parts),
                     _decode_tensor(raw, buf, value_spans, f"row gradient of {name!r}",
                                    value_parts), uid, own_sync is not None))
    return out, sync, rows
