"""Reading the hand-framed bulk messages (psserver/contract/wire.py writes them).

``decode_read_reply`` returns a ReadReply's arrays as views of its bytes;
``receive_read_reply`` takes one off a socket with each value's data
received straight into the array it belongs in; ``decode_push_request``
reads a PushRequest the same way. Both sides of the wire use these: the
client its read replies, the server its push requests.

The decoders accept exactly what protobuf's own parser accepts for these
messages, and read the same content (tests/contract/test_wire.py checks it against
the generated parser on random and mutated encodings): field numbers 1 to
2**29 - 1 (0 too inside a group, as protobuf's parser skips one); every
wire type, groups matched, none running past its end;
fields of a wrong wire type skipped as unknown; strings UTF-8; a message
field seen twice merged (its scalars: the last wins; repeated ones: joined),
as parsing the two encodings one after the other would.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np

from psserver.contract.tensor import WIRE_DTYPES, check_dtype, check_shape, nbytes_of
from psserver.errors import InvalidArgument, ResourceExhausted

_VARINT, _LEN = 0, 2

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
    if wt == 3:   # a group: fields until its matching end (protobuf's parser
        while True:   # takes field number 0 in a group it skips: so do we)
            f, w, pos = _read_key(buf, pos, end, lowest=0)
            if w == 4:
                if f != field:
                    raise InvalidArgument("malformed message (a group ends with another number)")
                return pos
            pos = _skip(buf, pos, end, f, w)
    raise InvalidArgument(f"malformed message (wire type {wt} where a field starts)")


def _read_key(buf: memoryview, pos: int, end: int, lowest: int = 1) -> tuple[int, int, int]:
    key, pos = _read_varint(buf, pos, end)
    field, wt = key >> 3, key & 7
    if key >> 32 or not lowest <= field <= _MAX_FIELD:
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
#: A dynamic-table look-up's rows (TableRows: the tensor alone).
_TABLE_FIELDS = (0, 0, 1)
#: ReadReply's field number -> its entries' field numbers.
_READ_FIELDS = {1: _VALUE_FIELDS, 2: _GATHERED_FIELDS, 3: _TABLE_FIELDS}


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
    ``gathered`` [(version, rows array view of raw)] and its ``tables``
    [rows array view of raw] (None for rows where an entry has no tensor);
    a reply receive_read_reply took already: as it is."""
    if isinstance(raw, ReadValues):
        return raw
    buf = memoryview(raw)
    out = ReadValues()
    for field, wt, a, b in _fields(buf, 0, len(raw)):
        if field not in _READ_FIELDS or wt != _LEN:
            continue
        fields = _READ_FIELDS[field]
        name, version, spans = _nested(buf, a, b, *fields[:2], fields[2:])
        spans = spans[fields[2]]
        what = (f"value of {name!r}" if field == 1 else
                f"gathered rows {len(out.gathered)}" if field == 2 else
                f"table rows {len(out.tables)}")
        arr = _decode_tensor(raw, buf, spans, what) if spans else None
        if field == 1:
            out.append((name, _int64(version), arr))
        elif field == 2:
            out.gathered.append((_int64(version), arr))
        else:
            out.tables.append(arr)
    return out


class ReadValues(list):
    """[(name, version, array)] of a ReadReply decoded, its ``gathered``
    [(version, rows)] and its ``tables`` [rows]; one received and decoded
    already (``receive_read_reply``) ``decode_read_reply`` gives back as it is."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gathered: list[tuple[int, np.ndarray | None]] = []
        self.tables: list[np.ndarray | None] = []


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
            elif field == tensor_field and wt == _LEN:
                if d != end:   # the tensor is not the value's last field (or lies about
                    return None   # its length): received whole, decoded (and refused) as ever
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
                       want_rows: Sequence[np.ndarray | None] = (),
                       want_tables: Sequence[np.ndarray | None] = ()) -> ReadValues:
    """A ReadReply of n bytes taken off a socket (``recv_into(view)`` fills
    all of view) and decoded, each value's data received straight into its
    array: ``want[i]`` = (name asked for, array or None) for the i-th value
    (``want_rows[k]``, ``want_tables[k]``: array or None for the k-th rows
    looked up, of a variable, of a dynamic table); an array
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

    def fits(kind: int, i: int, name: str, dt, shape) -> np.ndarray | None:
        """The array offered for the i-th entry of field ``kind`` (1: values,
        2: gathered rows, 3: table rows), if it fits."""
        if kind == 1:
            arr = want[i][1] if i < len(want) and want[i][0] == name else None
        else:
            offered = want_rows if kind == 2 else want_tables
            arr = offered[i] if i < len(offered) else None
        if arr is None or arr.dtype != dt or arr.shape != tuple(shape) \
                or not arr.flags.c_contiguous or not arr.flags.writeable:
            return None
        return arr

    def decoded(raw: bytes) -> None:
        got = decode_read_reply(raw)
        for kind, entries, items in ((1, out, got), (2, out.gathered, got.gathered),
                                     (3, out.tables, [(a,) for a in got.tables])):
            for item in items:
                arr = item[-1]
                dest = None if arr is None else fits(
                    kind, len(entries), item[0] if kind == 1 else "", arr.dtype, arr.shape)
                if dest is not None:
                    dest[...] = arr
                got_arr = arr if dest is None else dest
                entries.append(got_arr if kind == 3 else (*item[:-1], got_arr))

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
        if field not in _READ_FIELDS or wt != _LEN:   # not ours: the rest decoded as it is
            if got < n:
                fetch(n - got)
            decoded(take(len(head)))
            return out
        # 1: a VariableValue, 2: a GatherReply (ReadReply.gathered), 3: TableRows
        entries = out if field == 1 else out.gathered if field == 2 else out.tables
        end = p + size
        if end > len(head) + (n - got):
            raise InvalidArgument("truncated message (a field runs past its end)")
        while True:
            try:
                with memoryview(head) as buf:
                    pre = _value_prefix(buf, p, end, len(head), _READ_FIELDS[field]) \
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
        what = (f"value of {name!r}" if field == 1 else f"gathered rows {len(out.gathered)}"
                if field == 2 else f"table rows {len(out.tables)}")
        dt = check_dtype(dtype, WIRE_DTYPES, f"{what} dtype")
        shape = check_shape(shape, f"{what} shape")
        if nbytes_of(shape, dt) != end - start:
            raise InvalidArgument(f"{what} data has {end - start} bytes but dtype "
                                  f"{dtype} and shape {list(shape)} need "
                                  f"{nbytes_of(shape, dt)}")
        arr = fits(field, len(entries), name, dt, shape)
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
        entries.append((name, version, arr) if field == 1 else (version, arr) if field == 2
                       else arr)
    return out


def parse_push_request(raw: bytes):
    """The structure of PushRequest bytes, as protobuf reads it, with no
    check of what it means: ([(name, (dtype, shape, data span) or None,
    update_id)], SyncInfo bytes (every occurrence, joined: merged when
    parsed; b"" when present but empty) or None, buf (raw's memoryview),
    [(name, ids spans, ids (dtype, shape, data span) or None, values spans,
    values (...) or None, update_id, SyncInfo bytes or None)] of each
    SparseUpdate, [(name, {field: (spans, parts or None)} for keys (2),
    grads (3), offsets (6), weights (7), update_id, SyncInfo bytes or None)]
    of each TableGradient). Raises InvalidArgument where protobuf's parser
    fails."""
    buf = memoryview(raw)
    updates, sync, sparse, tables = [], [], [], []
    for field, wt, a, b in _fields(buf, 0, len(raw)):
        if field == 1 and wt == _LEN:   # a DenseUpdate{name, tensor, update_id}
            name, uid, spans = _nested(buf, a, b, 1, 3, (2,))
            spans = spans[2]
            tensor = _tensor_parts(buf, spans, f"gradient of {name!r}") if spans else None
            updates.append((name, spans, tensor, uid))
        elif field == 2 and wt == _LEN:
            sync.append(_occurrence(buf, a, b))
        elif field == 3 and wt == _LEN:   # a SparseUpdate{name, ids, values, sync, update_id}
            name, uid, spans = _nested(buf, a, b, 1, 5, (2, 3, 4))
            ids, values, own_sync = spans[2], spans[3], spans[4]
            sparse.append((name, ids, _tensor_parts(buf, ids, f"ids of {name!r}") if ids else None,
                           values, _tensor_parts(buf, values, f"row gradient of {name!r}")
                           if values else None, uid, _joined(buf, own_sync)))
        elif field == 4 and wt == _LEN:   # a TableGradient
            name, uid, spans = _nested(buf, a, b, 1, 4, (2, 3, 5, 6, 7))
            tensors = {f: (spans[f], _tensor_parts(buf, spans[f], f"{what} of table {name!r}")
                           if spans[f] else None)
                       for f, what in ((2, "keys"), (3, "gradient"), (6, "offsets"),
                                       (7, "weights"))}
            tables.append((name, tensors, uid, _joined(buf, spans[5])))
    return updates, (b"".join(sync) if sync else None), buf, sparse, tables


def _joined(buf: memoryview, spans) -> bytes | None:
    """A message field's bytes, every occurrence joined (merged when parsed); None: absent."""
    return b"".join(_occurrence(buf, c, d) for c, d in spans) if spans else None


def _occurrence(buf: memoryview, a: int, b: int) -> bytes:
    """buf[a:b], one occurrence of a (scalar-only) message field, checked on
    its own as protobuf parses it: one cut short is refused even where the
    occurrences joined would parse."""
    for _ in _fields(buf, a, b):
        pass
    return bytes(buf[a:b])


def decode_push_request(raw: bytes):
    """([(name, array view of raw, update_id)], serialized SyncInfo or None,
    [(name, ids, rows, update_id, whether it carries a sync of its own)] of
    the row-wise updates, [(name, keys, grads, update_id, SyncInfo bytes or
    None, offsets or None, weights or None)] of the table updates: arrays
    are views of raw)."""
    updates, sync, buf, sparse, tables = parse_push_request(raw)
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
    done = []
    for name, tensors, uid, own_sync in tables:
        arrays = {}
        for f, what in ((2, "keys"), (3, "gradient"), (6, "offsets"), (7, "weights")):
            spans, parts = tensors[f]
            if not spans:
                if f in (2, 3):
                    raise InvalidArgument(f"the update of table {name!r} carries no {what}")
                arrays[f] = None
                continue
            arrays[f] = _decode_tensor(raw, buf, spans, f"{what} of table {name!r}", parts)
        done.append((name, arrays[2], arrays[3], uid, own_sync, arrays[6], arrays[7]))
    return out, sync, rows, done


#: A collective group's id (CollectiveChunk.group): bytes.
COLLECTIVE_GROUP_BYTES = 16
_CHUNK_DTYPES = ("float16", "float32", "float64")


def decode_collective_chunk(raw) -> tuple:
    """(group, op, step, sender, data, receiver, member, signature, abort)
    of CollectiveChunk bytes (worker.proto): ``data`` a 1-D float array
    viewing ``raw``, or None in a probe (no receiver) and an abort.
    InvalidArgument for anything else: ids not of 16 bytes (the member's
    may be empty in a probe), a step or sender past uint32, a chunk without
    data, data not one dimension of float16/32/64, an abort of more than
    1,000 bytes or not UTF-8."""
    buf = memoryview(raw).cast("B")
    group, op, step, sender, spans = b"", 0, 0, 0, []
    receiver, member, signature, abort = b"", b"", 0, ""
    for field, wt, a, b in _fields(buf, 0, len(buf)):
        if field == 1 and wt == _LEN:
            group = bytes(buf[a:b])
        elif field == 6 and wt == _LEN:
            receiver = bytes(buf[a:b])
        elif field == 7 and wt == _LEN:
            member = bytes(buf[a:b])
        elif field == 2 and wt == _VARINT:
            op = a
        elif field == 8 and wt == _VARINT:
            signature = a
        elif field in (3, 4) and wt == _VARINT:
            if a >> 32:
                raise InvalidArgument(f"a collective chunk's {'step' if field == 3 else 'sender'} "
                                      f"must fit in 32 bits, got {a}")
            step, sender = (a, sender) if field == 3 else (step, a)
        elif field == 5 and wt == _LEN:
            spans.append((a, b))
        elif field == 9 and wt == _LEN:
            if b - a > 1000:
                raise InvalidArgument(
                    f"a collective abort's reason has {b - a} bytes; at most 1000")
            abort = _text(buf, a, b, "a collective abort's reason")
    n = COLLECTIVE_GROUP_BYTES
    if len(group) != n:
        raise InvalidArgument(f"a collective chunk's group id must be {n} bytes, got {len(group)}")
    if len(member) not in (0, n) or (receiver and len(receiver) != n) or \
            (receiver and not member):
        raise InvalidArgument(f"a collective chunk's receiver and member ids must be {n} bytes, "
                              f"got {len(receiver)} and {len(member)}")
    if not receiver or abort:   # a probe (what the receiver's member id is), or an abort
        return group, op, step, sender, None, receiver, member, signature, abort
    if not spans:
        raise InvalidArgument("a collective chunk (one with a receiver) needs its data")
    parts = _tensor_parts(buf, spans, "the chunk")
    if parts[0] not in _CHUNK_DTYPES or len(parts[1]) != 1:
        raise InvalidArgument(f"a collective chunk holds one dimension of "
                              f"{', '.join(_CHUNK_DTYPES)}, got {parts[0] or 'no dtype'} of "
                              f"shape {parts[1]}")
    data = _decode_tensor(raw, buf, spans, "the chunk", parts)
    return group, op, step, sender, data, receiver, member, signature, ""
