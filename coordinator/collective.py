"""Collective operations among workers: all-reduce over a ring.

A group is a fixed list of workers, their addresses in rank order, each
member running the group's operations in the same order, each on a thread
of its own worker (a step closure)::

    with CollectiveGroup("job-7/ring-3", addresses, rank) as group:
        total = group.all_reduce(grad)                # the sum over the members
        mean = group.all_reduce(grad, average=True)

Every member gets the same bits. This is the first part of issue 36 (the
all-reduce strategy, its failures and its benchmarks build on it). Two
algorithms, both bandwidth-optimal: the ring (below) and, for small arrays,
a direct one in two steps (``choose_algorithm``, ``_direct``).

The ring (Patarasuk and Yuan's bandwidth-optimal all-reduce, as Baidu's
ring-allreduce, Horovod and NCCL run it): the flat array is cut into n
chunks. In n - 1 reduce-scatter steps member r sends chunk (r - s) mod n to
the next member and adds the chunk (r - s - 1) mod n it receives from the
previous one into its own; member r then holds the whole sum of chunk
(r + 1) mod n. In n - 1 all-gather steps those sums go round, each copied
as it arrives. Each member sends 2(n - 1)/n of the array's bytes (and each
piece's framing, under 100 bytes), whatever n. Each chunk's sum is made by
one chain of additions in ring order and then copied: the members' results
are bit-identical. A step's chunk goes in pieces of PIECE_BYTES, each sent
on (by a thread of the member's) while the next arrives.

Chunks travel as ``Worker.Collective`` calls on the link layer (the
worker's Unix socket, data port or gRPC, planned as for any call; the
cluster's token and TLS), one at a time to the next member, in order, each
answered once the receiving worker holds it in its inbox
(coordinator/collective_inbox.py).

Membership. Forming a group on a worker registers a member id, new each
time, in that worker's inbox. Before its first chunk a member asks the next
worker for its id, sending its own; the inbox answers the first member to
ask and no other (an earlier group's member still there answers none but
its own sender: the asker asks again until the new one is formed; the
worker holds an ask up to a quarter of a second until it can answer it,
so a member is answered the moment the next one forms). Every
chunk names both ids, and the inbox keeps it only for the member it names
from the sender that member answered: a chunk from an earlier group of the
same name, from a member that re-formed alone, or for no group at all is
refused (FailedPrecondition), so it can never be summed into another
group's result. A member whose operation fails tells the next member (whose
operation fails at once and tells its own next: the failure goes round the
ring), drops its chunks and is out: the group is over, form it anew.
``close`` (or a group collected unclosed) leaves too. A name used again is
safe against everything an earlier group left behind, but not against a
member of an earlier forming that is still running late: if it asks first,
the new member takes its chunks. Give each forming a name of its own where
members can start that late (a job's membership epoch in the name). Each chunk carries a hash of its operation's shapes, dtype,
compression and mean, so that members calling with different arrays get
InvalidArgument, not a sum of misaligned data.
An inbox holds at most INBOX_BYTES (counting what really holds each
chunk's memory) and MAX_CHUNKS chunks; a chunk past that waits up to
ROOM_SECONDS (and its call's deadline) for its member to take others,
then ResourceExhausted. Each member sends one chunk at a time, so a
member behind its predecessor holds up one call of it at most.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from typing import Sequence

import numpy as np

from coordinator.collective_inbox import INBOX, Inbox
from coordinator.collective_parts import (  # noqa: F401 (ALGORITHMS ...: this module's API too)
    ALGORITHMS,
    COMPRESSIONS,
    DIRECT_LIMIT_BYTES,
    DIRECT_MAX_BYTES,
    DIRECT_MAX_MEMBERS,
    DIRECT_POLL_SECONDS,
    DTYPES,
    FUSION_BYTES,
    check_chunk,
    choose_algorithm,
    chunk_bounds,
    chunk_signature,
    first_refusal,
    fusion_batches,
    group_id,
    narrow,
)
from psserver.contract import wire
from psserver.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from psserver.link import buffers, methods
from psserver.link.channel import TaskChannel

#: Bytes of a piece: a ring step's chunk goes in pieces of this size, each
#: sent on while the next arrives (pipelining: the additions overlap the
#: transfers). Just under a socket's 4 MiB eager frame, so that a piece's
#: frame is received into a buffer of its own size.
PIECE_BYTES = (4 << 20) - (4 << 10)
#: Seconds between a member's asks for the next member's id where the
#: worker answers an ask at once that it is not formed for it (the worker
#: holds an ask up to collective_inbox.PROBE_WAIT_SECONDS until it forms).
PROBE_SECONDS = 0.02
#: Seconds a failed member gives telling the next one, and its own send thread to stop.
ABORT_SECONDS = 2.0
def _leave(inbox: Inbox, group: bytes, member: bytes) -> None:
    inbox.leave(group, member)


#: Channels to other workers, kept across groups (a step forms its group
#: anew; a connection's set-up cost more than a small model's all-reduce), at
#: most CHANNELS of them, the least recently used closed first. A channel
#: plans its route again when the worker behind its address restarts.
CHANNELS = 64
_channels: "collections.OrderedDict[tuple, TaskChannel]" = collections.OrderedDict()
_channels_lock = threading.Lock()


def _channel_to(address: str, token, tls) -> TaskChannel:
    key = (address, token, repr(tls))
    with _channels_lock:
        ch = _channels.get(key)
        if ch is None:
            ch = _channels[key] = TaskChannel(address, role="worker", token=token, tls=tls,
                                              timeout=None)
            while len(_channels) > CHANNELS:
                _channels.popitem(last=False)[1].close()
        _channels.move_to_end(key)
        return ch


class CollectiveGroup:
    """This worker's membership of a group: ``addresses`` in rank order (every
    member gives the same list), ``rank`` its own place. ``timeout``:
    seconds an operation may take (the first one also waits that long for
    the next member to be formed). Token and TLS: the worker's own (its
    environment), as for its calls to the parameter servers. A failed
    operation ends the group (form a new one)."""

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
        self._failed: BaseException | None = None
        self.bytes_sent = 0   # request bytes this member sent (chunks and their framing)
        self._ids: dict[int, bytes] = {}   # other members' ids, by rank, once asked
        self._sent: list = []   # a direct run's sends (Pendings)
        self._peers: dict[int, TaskChannel] = {}   # channels to them, by rank
        self._token, self._tls = token, tls
        self._member, self._next = b"", None
        if self.size > 1:   # (joined last: nothing after it can fail)
            self._next = self._peer((rank + 1) % self.size)
            self._member = self._inbox.join(self.id)
            # a group dropped without close() leaves too, once collected
            self._leave = weakref.finalize(self, _leave, self._inbox, self.id, self._member)

    @property
    def operations(self) -> int:
        """Operations this member ran in the group (rings made, fused ones once)."""
        return self._op

    def close(self) -> None:
        """Leave the group: this member's chunks dropped, later ones refused."""
        if self._next is not None:
            self._leave()
            self._next = None

    def __enter__(self) -> "CollectiveGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def abort(self, reason: str) -> None:
        """This member will not run the operation the others run: they fail
        at once (the next member is told, and tells its own next; with a
        direct all-reduce run, every member) rather than wait out their
        timeout; the group is over here."""
        if self._failed is None and self._next is not None:
            self._failed = FailedPrecondition(reason)
            self._abort_others(reason)
            self._inbox.leave(self.id, self._member)

    def all_reduce(self, array, average: bool = False, compression: str | None = None,
                   *, agree: bytes = b"", algorithm: str | None = None,
                   _shapes: tuple | None = None) -> np.ndarray:
        """The element-wise sum (``average``: mean) of every member's
        ``array`` (same shape and dtype on each: float16, float32 or
        float64), a new array of its shape, the same bits on every member.
        ``array`` is read while the call runs (not copied first): change it
        only once the call has returned (after a failed ring, a send of it to
        a next member that stopped reading may outlast the call, up to the
        group's timeout: pass a copy where the array changes after a failure).

        ``compression="fp16"``: the chunks travel as float16 (half the
        bytes of float32), summed in the array's dtype; each hop's value is
        rounded to float16 (finite values beyond +-65504 clipped to it, NaN
        and Inf kept), the result too, on every member alike.

        ``agree``: bytes every member must give alike (a member giving
        others fails, as for arrays of other shapes: InvalidArgument).

        ``algorithm``: "ring" or "direct" (see ``choose_algorithm``, which
        None takes; "direct" up to DIRECT_LIMIT_BYTES); every member must
        run the same one (InvalidArgument otherwise). Each gives every
        member the same bits, but not the same bits as the other (the
        additions go in another order)."""
        a = np.asarray(array)
        if a.dtype not in DTYPES:
            raise InvalidArgument(f"all_reduce takes float16, float32 or float64 arrays, "
                                  f"got {a.dtype}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, "
                             f"got {compression!r}")
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {list(ALGORITHMS)} or None, "
                             f"got {algorithm!r}")
        if algorithm == "direct" and a.nbytes > DIRECT_LIMIT_BYTES:
            raise ValueError(f"the direct all-reduce takes arrays of up to "
                             f"{DIRECT_LIMIT_BYTES} bytes (it sends every chunk before it "
                             f"takes any), got {a.nbytes}: use the ring")
        if self._failed is not None:
            raise FailedPrecondition(f"an operation of group {self.name!r} failed here "
                                     f"({self._failed}): form the group anew")
        if self.size > 1 and self._next is None:
            raise FailedPrecondition(f"group {self.name!r} is closed here")
        op, self._op = self._op, self._op + 1
        if self.size == 1:
            out = np.array(a, copy=True, order="C")
        else:   # the ring writes every element of out: no copy of ``a`` first
            out = buffers.take(a.nbytes).view(a.dtype).reshape(a.shape)
            wire_dtype = COMPRESSIONS[compression] or out.dtype
            algorithm = algorithm or choose_algorithm(a.nbytes, self.size)
            run = self._direct if algorithm == "direct" else self._ring
            try:
                run(op, np.ascontiguousarray(a).reshape(-1), out.reshape(-1), wire_dtype,
                    chunk_signature(_shapes or a.shape, a.dtype, wire_dtype, average, agree,
                               algorithm))
            except BaseException as exc:   # the group is over: the others are told, this
                # member's chunks go, later ones are refused (kept without its
                # traceback: its frames hold the pooled result, which a cycle
                # through the traceback would keep until the collector runs)
                self._failed = FailedPrecondition(f"{type(exc).__name__}: {exc}")
                self._abort_others(f"{type(exc).__name__}: {exc}")
                self._inbox.leave(self.id, self._member)
                raise
        if average:
            out /= out.dtype.type(self.size)
        return out

    def all_reduce_many(self, arrays: Sequence, average: bool = False,
                        compression: str | None = None, *, agree: bytes = b"",
                        algorithm: str | None = None) -> list[np.ndarray]:
        """``all_reduce`` of each array, fused (as Horovod's fusion buffer):
        arrays of one dtype go end to end in buffers of up to FUSION_BYTES
        (a larger array alone), one all-reduce each (``algorithm``: as
        all_reduce takes it, for each buffer; "direct" fuses up to
        DIRECT_LIMIT_BYTES), so many small gradients make
        few collective calls. Every member passes arrays of the same shapes
        and dtypes in the same order."""
        arrays = [np.asarray(a) for a in arrays]
        for a in arrays:
            if a.dtype not in DTYPES:
                raise InvalidArgument(f"all_reduce_many takes float16, float32 or float64 "
                                      f"arrays, got {a.dtype}")
        out: list = [None] * len(arrays)
        limit = DIRECT_LIMIT_BYTES if algorithm == "direct" else FUSION_BYTES
        for batch in fusion_batches(arrays, limit):
            flat = self.all_reduce(np.concatenate([arrays[i].reshape(-1) for i in batch]),
                                   average, compression, agree=agree, algorithm=algorithm,
                                   _shapes=tuple(arrays[i].shape for i in batch))
            at = 0
            for i in batch:
                out[i] = flat[at:at + arrays[i].size].reshape(arrays[i].shape)
                at += arrays[i].size
        return out

    def _ring(self, op: int, flat: np.ndarray, out: np.ndarray, wire_dtype: np.dtype,
              signature: int) -> None:
        """The sum of every member's ``flat`` into ``out`` (1-D, of its size
        and dtype; ``flat`` is only read): every element of ``out`` is written,
        each chunk once it has a sum or once a sum arrives."""
        n, r = self.size, self.rank
        lossy = wire_dtype != flat.dtype
        bounds = chunk_bounds(flat.size, n)
        per = max(1, PIECE_BYTES // flat.itemsize)   # elements a piece
        pieces = max(1, -(-max(b - a for a, b in bounds) // per))   # per chunk at most
        split = (lambda c: [c[a:a + per] for a in range(0, c.size, per)] or [c])
        deadline = time.monotonic() + self.timeout
        prev = f"worker {self.addresses[(r - 1) % n]} (rank {(r - 1) % n} of group {self.name!r})"
        with _Sender(self, op, deadline, wire_dtype, signature) as sender:
            a, b = bounds[r]
            for p, piece in enumerate(split(flat[a:b])):
                sender.put(p, piece)
            # Steps 0 .. n-2 reduce (the chunk received plus ours, into out),
            # n-1 .. 2n-3 gather (copied into out); each piece goes on to the
            # next member as soon as it is final for the step (while the next
            # piece arrives). Chunk r is written when its sum comes round,
            # chunk r + 1 when this member makes its sum, the others both times.
            for s in range(2 * (n - 1)):
                reducing = s < n - 1
                a, b = bounds[(r - s - 1) % n]   # (in both phases)
                for p, (piece, mine) in enumerate(zip(split(out[a:b]), split(flat[a:b]))):
                    got, sig = self._inbox.take(self.id, op, s * pieces + p, (r - 1) % n,
                                                deadline, prev, sender.error)
                    check_chunk(got, sig, piece, wire_dtype, signature, prev)
                    if reducing:
                        np.add(mine, got, out=piece)
                        if lossy and s == n - 2:   # its sum is made: as the others will have it
                            piece[...] = narrow(piece, wire_dtype)
                    else:
                        piece[...] = got
                    if s < 2 * (n - 1) - 1:
                        sender.put((s + 1) * pieces + p, piece)

    def _direct(self, op: int, flat: np.ndarray, out: np.ndarray, wire_dtype: np.dtype,
                signature: int) -> None:
        """The sum of every member's ``flat`` into ``out`` in two steps (see
        ``choose_algorithm``): chunk j of ``flat`` to member j, every
        other member at once; this member's chunk summed over the members in
        rank order (the others' as they sent it, this one's as it is), then
        that sum to every other member, and theirs copied into ``out``. Each
        chunk's sum is made once, by its member: every member gets its bits."""
        n, r = self.size, self.rank
        lossy = wire_dtype != flat.dtype
        bounds = chunk_bounds(flat.size, n)
        per = max(1, PIECE_BYTES // flat.itemsize)   # elements a piece
        pieces = max(1, -(-max(b - a for a, b in bounds) // per))   # a step's keys
        split = (lambda c: [c[a:a + per] for a in range(0, c.size, per)] or [c])
        deadline = time.monotonic() + self.timeout
        others = [(r + k) % n for k in range(1, n)]   # (each member starts at its next)
        sent: list = []
        self._sent = sent   # (_take looks at their answers while it waits)
        try:
            for j in others:
                sent += self._send(j, op, 0, split(flat[slice(*bounds[j])]), wire_dtype,
                                   signature, deadline)
            a, b = bounds[r]
            mine = list(zip(split(out[a:b]), split(flat[a:b])))
            for p, (piece, own) in enumerate(mine):
                for k in range(n):
                    got = own if k == r else self._take(op, p, k, piece, wire_dtype,
                                                        signature, deadline)
                    if k == 0:
                        piece[...] = got
                    else:
                        piece += got
                if lossy:   # as the others will have it
                    piece[...] = narrow(piece, wire_dtype)
            for j in others:
                sent += self._send(j, op, pieces, [piece for piece, _ in mine], wire_dtype,
                                   signature, deadline)
            for k in others:
                a, b = bounds[k]
                for p, piece in enumerate(split(out[a:b])):
                    piece[...] = self._take(op, pieces + p, k, piece, wire_dtype, signature,
                                            deadline)
        finally:   # every call answered (or failed) before the arrays it sent may change
            errors = []
            for pending in sent:
                try:
                    pending.result()
                except Exception as exc:
                    errors.append(exc)
            self._sent = []   # (a failed send's traceback would hold this call's arrays)
        if errors:
            raise errors[0]

    def _send(self, rank: int, op: int, step: int, pieces: list, wire_dtype, signature: int,
              deadline: float) -> list:
        """Pieces sent to member ``rank`` now, as steps ``step``, ``step`` + 1,
        ... (their answers: the Pendings; the calls go out on this thread, one
        after another, and are answered while the next ones go)."""
        receiver, out = self._id_of(rank, deadline, threading.Event()), []
        for p, piece in enumerate(pieces):
            if piece.dtype != wire_dtype:
                piece = narrow(piece, wire_dtype)
            msg = wire.encode_collective_chunk(self.id, op, step + p, self.rank, piece,
                                               receiver, self._member, signature)
            self.bytes_sent += msg.nbytes
            out.append(self._peer(rank).send(methods.COLLECTIVE, msg,
                                             max(0.001, deadline - time.monotonic())))
        return out

    def _take(self, op: int, step: int, rank: int, like: np.ndarray, wire_dtype,
              signature: int, deadline: float) -> np.ndarray:
        """Member ``rank``'s piece of that step, once delivered, checked."""
        what = f"worker {self.addresses[rank]} (rank {rank} of group {self.name!r})"
        got, sig = self._inbox.take(self.id, op, step, rank, deadline, what,
                                    lambda: first_refusal(self._sent), DIRECT_POLL_SECONDS)
        check_chunk(got, sig, like, wire_dtype, signature, what)
        return got

    def _peer(self, rank: int) -> TaskChannel:
        ch = self._peers.get(rank)
        if ch is None:
            ch = self._peers[rank] = _channel_to(self.addresses[rank], self._token, self._tls)
        return ch

    def _abort_others(self, reason: str) -> None:
        """Tell the next member this one failed (its operation fails at
        once, and it tells its own next), and every other member whose id
        this one has (a direct all-reduce's). A member that failed before it
        had the next one's id asks for it now, for up to ABORT_SECONDS
        (members started together form within that; one formed later times
        out)."""
        rank = f"worker {self.addresses[self.rank]} (rank {self.rank})"
        nxt = (self.rank + 1) % self.size
        known = list(self._ids)   # (a copy: a late sender thread may add to it)
        # the members it knows first, then (asked for up to ABORT_SECONDS) the next
        for k in [*(k for k in known if k != nxt), nxt]:
            try:
                member = self._id_of(k, time.monotonic() + ABORT_SECONDS, threading.Event(),
                                     told_fails=False)
            except Exception:   # (not formed in time, or gone)
                continue
            msg = wire.encode_collective_chunk(self.id, 0, 0, self.rank, None, member,
                                               self._member, 0, f"{rank}: {reason}"[:900])
            try:
                self._peer(k).call(methods.COLLECTIVE, msg, ABORT_SECONDS)
            except Exception:   # (it gone too: its own next times out, as without this)
                pass

    def _id_of(self, rank: int, deadline: float, stop: threading.Event,
               told_fails: bool = True) -> bytes:
        """Member ``rank``'s id, asked of its worker until it is formed
        there and takes chunks from this member. ``told_fails``: raise once
        this member was told of a failure (an operation's asks; not the
        asks that pass a failure on)."""
        member = self._ids.get(rank, b"")
        while not member and not stop.is_set():
            failed = self._inbox.failure(self.id, self._member) if told_fails else None
            if failed is not None and self._member:   # (told while it asks: a direct run)
                raise FailedPrecondition(f"a member of group {self.name!r} failed, so this "
                                         f"operation does: {failed}")
            probe = wire.encode_collective_chunk(self.id, 0, 0, self.rank, None, b"",
                                                 self._member)
            asked = time.monotonic()   # (the worker holds a probe until the member forms)
            late = DeadlineExceeded(f"worker {self.addresses[rank]} (rank {rank}) did not form "
                                    f"group {self.name!r} in time")
            try:
                member = self._peer(rank).call(methods.COLLECTIVE, probe, max(
                    0.001, deadline - asked)).member
            except DeadlineExceeded:   # (the probe's own deadline: the group's)
                raise late from None
            if not member:
                if time.monotonic() + PROBE_SECONDS > deadline:
                    raise late
                if time.monotonic() - asked < PROBE_SECONDS:   # (answered at once: a
                    stop.wait(PROBE_SECONDS)                     # worker that holds no probe)
        if not member:
            raise FailedPrecondition("the operation failed on this member")
        self._ids[rank] = member
        return member


class _Sender:
    """Sends a member's pieces to the next member, one call at a time in
    order, on a thread of its own (so that sending one piece overlaps adding
    the next). Leaving the ``with`` waits for the last answer and raises
    its error where the member had none or only timed out waiting
    (``error()`` says it as soon as there is one, and the inbox is woken for
    it). A piece's memory is not changed until the next member has it (a
    piece is changed again only once the ring brings it back, which needs
    this send first)."""

    def __init__(self, group: CollectiveGroup, op: int, deadline: float, wire_dtype,
                 signature: int):
        self._group, self._op, self._deadline = group, op, deadline
        self._wire, self._signature = wire_dtype, signature
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._stop = threading.Event()   # the member failed: stop asking for the next id
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"collective-{group.name}")
        self._thread.start()

    def error(self) -> BaseException | None:
        return self._error

    def put(self, step: int, piece: np.ndarray) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((step, piece))

    def _run(self) -> None:
        g = self._group
        try:
            receiver = g._id_of((g.rank + 1) % g.size, self._deadline, self._stop)
            while True:
                item = self._queue.get()
                if item is None or self._stop.is_set():   # (failed: the rest is not sent)
                    return
                step, piece = item
                if piece.dtype != self._wire:
                    piece = narrow(piece, self._wire)
                msg = wire.encode_collective_chunk(g.id, self._op, step, g.rank, piece,
                                                   receiver, g._member, self._signature)
                g.bytes_sent += msg.nbytes
                g._next.call(methods.COLLECTIVE, msg,
                             max(0.001, self._deadline - time.monotonic()))
        except BaseException as exc:   # the member's take, put and exit raise it
            self._error = exc
            g._inbox.wake()

    def __enter__(self) -> "_Sender":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:   # the member failed: no more sends, and no long wait
            self._stop.set()
        self._queue.put(None)
        self._thread.join(ABORT_SECONDS if exc[0] is not None else
                          max(0.0, self._deadline - time.monotonic()) + 5.0)
        if self._error is not None and exc[1] is not self._error and \
                (exc[1] is None or isinstance(exc[1], DeadlineExceeded)):
            raise self._error from exc[1]   # (why this member waited in vain: its own send)
        if exc[0] is None and self._thread.is_alive():
            g = self._group
            raise DeadlineExceeded(f"sending to worker {g.addresses[(g.rank + 1) % g.size]} "
                                   f"(group {g.name!r}) did not finish in time")
