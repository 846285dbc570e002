"""A worker's inbox of collective chunks (coordinator/collective.py's rules).

Chunks other members send this worker (``Worker.Collective``, psworker's
handler: ``INBOX.deliver_bytes``) wait here until the member they are for
takes them. The inbox holds the membership that makes a chunk acceptable:
each forming of a group registers a member id (``join``), the first member
to ask for it as a given rank (``answer``) is the only sender of that rank
it takes chunks from (the ring: one, the previous rank; the direct
all-reduce: every other rank), and a chunk is kept only for such a pair;
``leave`` drops a member's chunks, ``abort`` fails its operation. It holds
at most INBOX_BYTES (counting the buffer that really holds each chunk) and
MAX_CHUNKS chunks; a chunk past that waits up to ROOM_SECONDS (and its
call's deadline) for room, while the chunks waiting so hold at most
INBOX_BYTES more, then ResourceExhausted.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

import numpy as np

from psserver.contract import memory, wire_decode
from psserver.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)

#: Bytes of chunks a worker's inbox holds at most (counting each chunk's
#: whole request buffer; one larger chunk is taken when the inbox is empty).
INBOX_BYTES = 256 << 20
#: Chunks an inbox holds at most; each counts as at least CHUNK_BYTES_MIN.
MAX_CHUNKS = 4096
CHUNK_BYTES_MIN = 1024
#: Seconds a chunk waits for room in a full inbox (at most the call's own
#: deadline) before ResourceExhausted: a member is behind its predecessor.
ROOM_SECONDS = 10.0
#: Seconds a probe waits here for the member it asks for to be formed (a
#: long poll: it answers the moment the member forms; the asker asks again
#: after an empty answer).
PROBE_WAIT_SECONDS = 0.25


class Inbox:
    """The chunks delivered to this worker's members, until they take them."""

    def __init__(self, max_bytes: int = INBOX_BYTES, max_chunks: int = MAX_CHUNKS):
        self.max_bytes, self.max_chunks = max_bytes, max_chunks
        # group -> [member id, {sender rank: the sender's id, pinned by its first
        #           probe}, why a sender failed (an abort) or None]
        self._members: dict[bytes, list] = {}
        self._chunks: dict[tuple, tuple[np.ndarray, int, int]] = {}   # -> (data, signature, bytes)
        self._bytes = 0
        self._waiting = 0   # bytes of deliveries waiting for room (their requests alive)
        self._cond = threading.Condition()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    # -- membership ----------------------------------------------------------------------
    def join(self, group: bytes) -> bytes:
        """A new member id for ``group`` here. ValueError while one is formed."""
        with self._cond:
            if group in self._members:
                raise ValueError("a member of a group of this name is formed on this worker "
                                 "already: close it first (or name the new group otherwise)")
            member = os.urandom(wire_decode.COLLECTIVE_GROUP_BYTES)
            self._members[group] = [member, {}, None]
            self._cond.notify_all()   # (a probe waiting for it)
            return member

    def leave(self, group: bytes, member: bytes) -> None:
        """The member is gone: its chunks dropped, later ones refused (a
        newer member of the group, formed since, keeps its own)."""
        with self._cond:
            if self._members.get(group, [None])[0] == member:
                del self._members[group]
                self._drop(group)   # (every chunk of the group here is that member's)
            self._cond.notify_all()

    def _drop(self, group: bytes) -> None:
        for key in [k for k in self._chunks if k[0] == group]:
            self._bytes -= self._chunks.pop(key)[2]

    def member(self, group: bytes) -> bytes:
        """This worker's member id for ``group`` (b"": none formed)."""
        with self._cond:
            return self._members.get(group, [b""])[0]

    def answer(self, group: bytes, asker: bytes, wait: float = 0.0, rank: int = 0) -> bytes:
        """A probe from member ``asker`` of ``rank``: this worker's member id
        for ``group`` if it takes that rank's chunks from that asker: the
        first to ask as that rank (pinned now), none other (b"": not formed
        for it, ask again; an earlier group's member about to leave, say).
        Waits up to ``wait`` seconds for such a member to be formed."""
        if not asker:
            return b""
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                mine = self._members.get(group)
                if mine is not None and mine[1].get(rank, asker) == asker:
                    mine[1][rank] = asker
                    return mine[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    return b""
                self._cond.wait(left)

    def abort(self, group: bytes, receiver: bytes, sender: bytes, reason: str) -> None:
        """A member this one takes chunks from failed: its take raises (an
        abort for no member formed here, or from no sender of it, is ignored)."""
        with self._cond:
            mine = self._members.get(group)
            if mine is not None and mine[0] == receiver and sender in mine[1].values():
                mine[2] = reason or "(no reason given)"
                self._cond.notify_all()

    def failure(self, group: bytes, member: bytes) -> str | None:
        """Why a member this one takes chunks from failed (an abort), or
        None; "left" for a member no longer formed here."""
        with self._cond:
            mine = self._members.get(group)
            return "left" if mine is None or mine[0] != member else mine[2]

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- chunks --------------------------------------------------------------------------
    def deliver_bytes(self, raw, room_seconds: float = ROOM_SECONDS) -> bytes:
        """A Worker.Collective request (InvalidArgument if malformed): kept,
        or a probe answered; this worker's member id for the group."""
        group, op, step, sender, data, receiver, member, signature, abort = \
            wire_decode.decode_collective_chunk(raw)
        if not receiver:
            return self.answer(group, member, min(PROBE_WAIT_SECONDS, room_seconds), sender)
        if abort:
            self.abort(group, receiver, member, abort)
            return b""
        self.deliver(group, op, step, sender, data, receiver, member, signature,
                     memory.owner_bytes(data)[1], room_seconds)
        return receiver

    def deliver(self, group: bytes, op: int, step: int, sender: int, data: np.ndarray,
                receiver: bytes, member: bytes, signature: int = 0,
                held: int | None = None, room_seconds: float = 0.0) -> None:
        """Keep a chunk (the array given, not a copy: a view of the request,
        which nothing changes) for member ``receiver`` until it takes it.
        FailedPrecondition if that member is not formed here or takes chunks
        from another sender (``answer``) or failed; the same chunk again
        is dropped, another under its key is InvalidArgument; past the
        bounds it waits up to ``room_seconds`` for a take to make room (while
        the chunks waiting so hold at most max_bytes more), then
        ResourceExhausted. A refusal changes nothing."""
        key = (group, op, step, sender)
        held = max(CHUNK_BYTES_MIN, data.nbytes if held is None else held)
        deadline = time.monotonic() + room_seconds
        with self._cond:
            self._check_member(group, receiver, member, sender)
            if self._full(held) and self._waiting + held <= self.max_bytes:
                self._waiting += held
                try:
                    while self._full(held) and key not in self._chunks and \
                            self._members.get(group, [None])[0] == receiver and \
                            time.monotonic() < deadline:
                        self._cond.wait(deadline - time.monotonic())
                finally:
                    self._waiting -= held
                self._check_member(group, receiver, member, sender)   # (it may have left)
            got = self._chunks.get(key)
            if got is not None:
                if got[0].dtype == data.dtype and got[0].tobytes() == data.tobytes() \
                        and got[1] == signature:
                    return   # sent again
                raise InvalidArgument(
                    f"collective chunk (op {op}, step {step}, sender {sender}) arrived twice "
                    "with different contents")
            if self._full(held):
                raise ResourceExhausted(
                    f"this worker's collective inbox holds {self._bytes} bytes in "
                    f"{len(self._chunks)} chunks not taken yet (at most {self.max_bytes} bytes, "
                    f"{self.max_chunks} chunks): its members are behind. Retry the operation "
                    "with fewer groups at once")
            self._chunks[key] = (data, signature, held)
            self._bytes += held
            self._cond.notify_all()

    def _check_member(self, group: bytes, receiver: bytes, sender: bytes, rank: int) -> None:
        mine = self._members.get(group)
        if mine is None or mine[0] != receiver:
            raise FailedPrecondition(
                "no member of this collective group is formed on this worker now (it "
                "left, failed, or was formed anew): chunks of an earlier group are not kept")
        if mine[1].get(rank) != sender:
            raise FailedPrecondition(
                f"this member takes rank {rank}'s chunks from another member of its group "
                "(the one that asked first), or none: form the group anew on every member")
        if mine[2] is not None:
            raise FailedPrecondition(f"this member's operation failed: {mine[2]}")

    def _full(self, held: int) -> bool:
        return len(self._chunks) >= self.max_chunks or \
            bool(self._bytes and self._bytes + held > self.max_bytes)

    def take(self, group: bytes, op: int, step: int, sender: int, deadline: float, what: str,
             abort: Callable[[], BaseException | None] = lambda: None,
             poll: float | None = None) -> tuple[np.ndarray, int]:
        """(data, signature) of the chunk of that key once delivered;
        DeadlineExceeded (saying ``what`` it waited for) if it does not come
        by ``deadline``; ``abort()``'s error as soon as it has one (checked
        whenever the inbox is woken, and every ``poll`` seconds)."""
        key = (group, op, step, sender)
        with self._cond:
            while key not in self._chunks:
                err = abort()
                if err is not None:
                    raise err
                failed = self._members.get(group, [None, None, None])[2]
                if failed is not None:
                    raise FailedPrecondition(f"{what} failed, so this operation does: {failed}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(
                        f"no chunk came from {what} in time: that worker (or, in a ring, one "
                        "further back round the ring) is slow or stopped, or runs this "
                        "group's operations in another order")
                self._cond.wait(left if poll is None else min(left, poll))
            data, signature, held = self._chunks.pop(key)
            self._bytes -= held
            self._cond.notify_all()   # (a delivery waiting for room)
            return data, signature


#: This process's inbox: the worker's Collective handler delivers into it,
#: its groups take from it.
INBOX = Inbox()
