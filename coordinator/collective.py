"""Collective operations among workers: all-reduce over a ring.

A group is a fixed list of workers, their addresses in rank order, each
member running the group's operations in the same order, each on a thread
of its own worker (a step closure)::

    group = CollectiveGroup("job-7/step-3", addresses, rank)
    total = group.all_reduce(grad)                # the sum over the members
    mean = group.all_reduce(grad, average=True)

Every member gets the same bits. This is the first part of issue 36 (the
all-reduce strategy, its failures and its benchmarks build on it).

The ring (Patarasuk and Yuan's bandwidth-optimal all-reduce, as Baidu's
ring-allreduce, Horovod and NCCL run it): the flat array is cut into n
chunks. In n - 1 reduce-scatter steps member r sends chunk (r - s) mod n to
the next member and adds the chunk (r - s - 1) mod n it receives from the
previous one into its own; member r then holds the whole sum of chunk
(r + 1) mod n. In n - 1 all-gather steps those sums go round, each copied
as it arrives. Each member sends 2(n - 1)/n of the array's bytes (and each
chunk's framing, under 64 bytes), whatever n. Each chunk's sum is made by
one chain of additions in ring order and then copied: the members' results
are bit-identical.

Chunks travel as ``Worker.Collective`` calls on the link layer (the
worker's Unix socket, data port or gRPC, planned as for any call; the
cluster's token and TLS), answered once the receiving worker holds the
chunk in its inbox (``Inbox.deliver``), so a member sends without waiting
for the next one to reach that step. An inbox holds at most INBOX_BYTES
(a chunk that does not fit waits for room, then ResourceExhausted), and
drops chunks nobody took within KEEP_SECONDS (an operation abandoned
half-way). A chunk's call is not made again when its connection breaks
(it is not idempotent): the operation fails (Unavailable) on that member
and times out on the others, and the group is formed anew.

A chunk is keyed by (group, operation, step, sender) until it is taken: a
group's name must not be used by two groups at once (a name used again
later, once the first group's operations are over, is fine).
"""
from __future__ import annotations

import hashlib
import queue
import threading
import time
from typing import Sequence

import numpy as np

from psserver.contract import wire, wire_decode
from psserver.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from psserver.link import methods
from psserver.link.channel import TaskChannel

#: Bytes of chunks a worker's inbox holds at most (one larger chunk is
#: taken when the inbox is empty).
INBOX_BYTES = 256 << 20
#: Seconds a delivered chunk waits for room before ResourceExhausted.
ROOM_SECONDS = 30.0
#: Seconds a chunk nobody takes is kept.
KEEP_SECONDS = 600.0
#: Bytes of a piece: a ring step's chunk goes in pieces of this size, each
#: sent on while the next arrives (pipelining: the additions overlap the
#: transfers).
PIECE_BYTES = 4 << 20
#: Array dtypes an all-reduce takes.
DTYPES = (np.float16, np.float32, np.float64)
#: all_reduce's compressions: the dtype chunks travel in (None: the array's).
COMPRESSIONS = {None: None, "fp16": np.dtype(np.float16)}
#: Bytes of arrays all_reduce_many fuses into one buffer at most (Horovod's
#: default fusion threshold).
FUSION_BYTES = 64 << 20


class Inbox:
    """The chunks delivered to this worker, until its members take them."""

    def __init__(self, max_bytes: int = INBOX_BYTES, keep_seconds: float = KEEP_SECONDS,
                 clock=time.monotonic):
        self.max_bytes, self.keep_seconds, self._clock = max_bytes, keep_seconds, clock
        self._chunks: dict[tuple, tuple[np.ndarray, float]] = {}
        self._bytes = 0
        self._cond = threading.Condition()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def deliver_bytes(self, raw, room_seconds: float = ROOM_SECONDS) -> None:
        """A Worker.Collective request (InvalidArgument if malformed)."""
        self.deliver(*wire_decode.decode_collective_chunk(raw), room_seconds=room_seconds)

    def deliver(self, group: bytes, op: int, step: int, sender: int, data: np.ndarray,
                room_seconds: float = ROOM_SECONDS) -> None:
        """Keep a chunk (the array given, not a copy: a view of the
        request, which nothing changes) until ``take`` asks for it. The same chunk
        again while held is dropped; another with the same key is
        InvalidArgument (and changes nothing); ResourceExhausted if no room
        comes within ``room_seconds``."""
        key = (group, op, step, sender)
        with self._cond:
            deadline = self._clock() + room_seconds
            while True:
                if self._same(key, data):
                    return
                self._expire()
                if not self._bytes or self._bytes + data.nbytes <= self.max_bytes:
                    break
                left = deadline - self._clock()
                if left <= 0:
                    raise ResourceExhausted(
                        f"this worker's collective inbox holds {self._bytes} bytes of chunks "
                        f"not taken yet (at most {self.max_bytes}): its members are behind or "
                        "gone. Retry the operation, with smaller arrays or fewer at once")
                self._cond.wait(left)
            self._chunks[key] = (data, self._clock())
            self._bytes += data.nbytes
            self._cond.notify_all()

    def _same(self, key: tuple, data: np.ndarray) -> bool:
        held = self._chunks.get(key)
        if held is None:
            return False
        if held[0].dtype == data.dtype and np.array_equal(held[0], data):
            return True   # sent again
        raise InvalidArgument(
            f"collective chunk (op {key[1]}, step {key[2]}, sender {key[3]}) arrived twice "
            "with different contents: two groups share an id, or a member runs other "
            "operations than the others")

    def _expire(self) -> None:
        old = self._clock() - self.keep_seconds
        for key in [k for k, (_, at) in self._chunks.items() if at < old]:
            self._bytes -= self._chunks.pop(key)[0].nbytes

    def take(self, group: bytes, op: int, step: int, sender: int, deadline: float,
             what: str) -> np.ndarray:
        """The chunk of that key, once delivered; DeadlineExceeded (saying
        ``what`` it waited for) if it does not come by ``deadline``."""
        key = (group, op, step, sender)
        with self._cond:
            while key not in self._chunks:
                left = deadline - self._clock()
                if left <= 0:
                    raise DeadlineExceeded(
                        f"no chunk came from {what} in time: that worker is slow, stopped, "
                        "or not running this group's operations in the same order")
                self._cond.wait(left)
            data, _ = self._chunks.pop(key)
            self._bytes -= data.nbytes
            self._cond.notify_all()
            return data


#: This process's inbox: the worker's Collective handler delivers into it,
#: its groups take from it.
INBOX = Inbox()


def group_id(name: str) -> bytes:
    """The 16-byte id every member derives from a group's name."""
    return hashlib.blake2b(name.encode(), digest_size=wire_decode.COLLECTIVE_GROUP_BYTES).digest()


def chunk_bounds(size: int, n: int) -> list[tuple[int, int]]:
    """n contiguous chunks of ``size`` elements, sizes differing by one at most."""
    edges = [size * i // n for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


class CollectiveGroup:
    """This worker's membership of a group: ``addresses`` in rank order (every
    member gives the same list), ``rank`` its own place. ``timeout``:
    seconds an operation may take. Token and TLS: the worker's own (its
    environment), as for its calls to the parameter servers."""

    def __init__(self, name: str, addresses: Sequence[str], rank: int, *,
                 timeout: float = 60.0, token: str | None = None, tls=None,
                 inbox: Inbox | None = None):
        addresses = list(addresses)
        if not addresses or len(set(addresses)) != len(addresses) or \
                not all(isinstance(a, str) and a for a in addresses):
            raise ValueError(f"a group needs distinct worker addresses, got {addresses}")
        if not 0 <= rank < len(addresses):
            raise ValueError(f"rank {rank} is not in [0, {len(addresses)})")
        self.name, self.addresses, self.rank, self.size = name, addresses, rank, len(addresses)
        self.id = group_id(name)
        self.timeout = timeout
        self._inbox = INBOX if inbox is None else inbox
        self._op = 0
        self.bytes_sent = 0   # request bytes this member sent (chunks and their framing)
        self._next = None if self.size == 1 else TaskChannel(
            addresses[(rank + 1) % self.size], role="worker", token=token, tls=tls,
            timeout=timeout)

    @property
    def operations(self) -> int:
        """Operations this member ran in the group (rings made, fused ones once)."""
        return self._op

    def close(self) -> None:
        if self._next is not None:
            self._next.close()

    def __enter__(self) -> "CollectiveGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def all_reduce(self, array, average: bool = False,
                   compression: str | None = None) -> np.ndarray:
        """The element-wise sum (``average``: mean) of every member's
        ``array`` (same shape and dtype on each: float16, float32 or
        float64), a new array of its shape, the same bits on every member.

        ``compression="fp16"``: the chunks travel as float16 (half the
        bytes of float32), summed in the array's dtype; each hop's value is
        rounded to float16 (finite values beyond +-65504 clipped to it, NaN
        and Inf kept), the result too, on every member alike."""
        a = np.asarray(array)
        if a.dtype not in DTYPES:
            raise InvalidArgument(f"all_reduce takes float16, float32 or float64 arrays, "
                                  f"got {a.dtype}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, "
                             f"got {compression!r}")
        out = np.array(a, copy=True, order="C")
        op, self._op = self._op, self._op + 1
        if self.size > 1:
            self._ring(op, out.reshape(-1), COMPRESSIONS[compression] or out.dtype)
        if average:
            out /= out.dtype.type(self.size)
        return out

    def all_reduce_many(self, arrays: Sequence, average: bool = False,
                        compression: str | None = None) -> list[np.ndarray]:
        """``all_reduce`` of each array, fused (as Horovod's fusion buffer):
        arrays of one dtype go end to end in buffers of up to FUSION_BYTES
        (a larger array alone), one ring each, so many small gradients make
        few collective calls. Every member passes arrays of the same shapes
        and dtypes in the same order."""
        arrays = [np.asarray(a) for a in arrays]
        for a in arrays:
            if a.dtype not in DTYPES:
                raise InvalidArgument(f"all_reduce_many takes float16, float32 or float64 "
                                      f"arrays, got {a.dtype}")
        out: list = [None] * len(arrays)
        for batch in _fusion_batches(arrays):
            flat = self.all_reduce(np.concatenate([arrays[i].reshape(-1) for i in batch]),
                                   average, compression)
            at = 0
            for i in batch:
                out[i] = flat[at:at + arrays[i].size].reshape(arrays[i].shape)
                at += arrays[i].size
        return out

    def _ring(self, op: int, flat: np.ndarray, wire_dtype) -> None:
        n, r = self.size, self.rank
        wire_dtype = np.dtype(wire_dtype)
        lossy = wire_dtype != flat.dtype
        chunks = [flat[a:b] for a, b in chunk_bounds(flat.size, n)]
        per = max(1, PIECE_BYTES // flat.itemsize)   # elements a piece
        pieces = max(1, -(-max(c.size for c in chunks) // per))   # per chunk at most: keys' stride
        split = (lambda c: [c[a:a + per] for a in range(0, c.size, per)] or [c])
        deadline = time.monotonic() + self.timeout
        prev = f"worker {self.addresses[(r - 1) % n]} (rank {(r - 1) % n} of group {self.name!r})"
        with _Sender(self, op, deadline, wire_dtype) as sender:
            for p, piece in enumerate(split(chunks[r])):
                sender.put(p, piece)
            # Steps 0 .. n-2 reduce (their chunks added into ours), n-1 .. 2n-3
            # gather (copied); each piece goes on to the next member as soon
            # as it is final for the step (while the next piece arrives).
            for s in range(2 * (n - 1)):
                reducing = s < n - 1
                into = chunks[(r - s - 1) % n]   # (in both phases)
                for p, piece in enumerate(split(into)):
                    got = self._inbox.take(self.id, op, s * pieces + p, (r - 1) % n,
                                           deadline, prev)
                    _check(got, piece, wire_dtype, prev)
                    if reducing:
                        piece += got
                        if lossy and s == n - 2:   # its sum is made: as the others will have it
                            piece[...] = _narrow(piece, wire_dtype)
                    else:
                        piece[...] = got
                    if s < 2 * (n - 1) - 1:
                        sender.put((s + 1) * pieces + p, piece)


class _Sender:
    """Sends a group's pieces to the next member in order, on a thread of
    its own (so that sending one piece overlaps adding the next); leaving
    the ``with`` waits for every answer and raises the first error. A piece's memory is
    not changed until the next member has it (a piece is changed again only
    once the ring brings it back, which needs this send first)."""

    def __init__(self, group: CollectiveGroup, op: int, deadline: float, wire_dtype):
        self._group, self._op, self._deadline = group, op, deadline
        self._wire = wire_dtype
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"collective-{group.name}")
        self._error: BaseException | None = None
        self._thread.start()

    def put(self, step: int, piece: np.ndarray) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((step, piece))

    def _run(self) -> None:
        g, sent = self._group, []
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    break
                piece = item[1] if item[1].dtype == self._wire else _narrow(item[1], self._wire)
                msg = wire.encode_collective_chunk(g.id, self._op, item[0], g.rank, piece)
                g.bytes_sent += msg.nbytes
                sent.append(g._next.send(methods.COLLECTIVE, msg,
                                         max(0.001, self._deadline - time.monotonic())))
                while sent and sent[0].done():
                    sent.pop(0).result()
            for p in sent:
                p.result()
        except BaseException as exc:   # the member's next put or close raises it
            self._error = exc

    def __enter__(self) -> "_Sender":
        return self

    def __exit__(self, *exc) -> None:
        self._queue.put(None)
        self._thread.join(max(0.0, self._deadline - time.monotonic()) + 5.0)
        if exc[0] is None:
            if self._thread.is_alive():
                g = self._group
                raise DeadlineExceeded(f"sending to worker {g.addresses[(g.rank + 1) % g.size]} "
                                       f"(group {g.name!r}) did not finish in time")
            if self._error is not None:
                raise self._error


def _check(got: np.ndarray, into: np.ndarray, wire_dtype, sender: str) -> None:
    if got.dtype != wire_dtype or got.shape != into.shape:
        raise InvalidArgument(
            f"{sender} sent a chunk of {got.dtype} {list(got.shape)} where this member expects "
            f"{wire_dtype} {list(into.shape)}: the members' arrays (or compressions) differ in "
            "shape or dtype")


def _narrow(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype`` (float16), finite values beyond its range clipped
    to its largest (not turned into Inf), NaN and Inf kept."""
    with np.errstate(over="ignore"):
        out = a.astype(dtype)
    over = np.isinf(out) & np.isfinite(a)
    if over.any():
        out[over] = np.copysign(np.finfo(dtype).max, a[over])
    return out


def _fusion_batches(arrays: list) -> list[list[int]]:
    """Indexes of ``arrays`` in fusion buffers: one dtype each, in order,
    at most FUSION_BYTES (an array larger than that alone)."""
    out, open_ = [], {}   # dtype -> (indexes, bytes) of its buffer being filled
    for i, a in enumerate(arrays):
        batch = open_.get(a.dtype)
        if batch is not None and batch[1] + a.nbytes > FUSION_BYTES:
            out.append(batch[0])
            batch = None
        if batch is None:
            batch = open_[a.dtype] = ([], 0)
        batch[0].append(i)
        open_[a.dtype] = (batch[0], batch[1] + a.nbytes)
    out += [b for b, _ in open_.values()]
    return out
