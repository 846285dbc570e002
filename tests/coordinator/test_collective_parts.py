"""coordinator/collective.py's and collective_inbox.py's pure parts, in process: the inbox (keep,
take, room, expiry, a chunk sent twice), chunk bounds, a group of one, and
the chunk's wire form against protobuf's parser. The ring between real
workers: tests/integration/test_collective.py."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from coordinator.collective import (
    DIRECT_MAX_BYTES,
    DIRECT_MAX_MEMBERS,
    CollectiveGroup,
    choose_algorithm,
    chunk_bounds,
    group_id,
)
from coordinator.collective_inbox import Inbox
from protos.pstrain.v1 import worker_pb2
from psserver.contract import wire, wire_decode
from psserver.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)

G = bytes(range(16))
SOON = 30.0   # seconds a take may wait where its chunk is there or comes from this test


def _formed(**kw) -> tuple[Inbox, bytes, bytes]:
    """An inbox with a member of G formed, and the member id of the sender it
    takes chunks from (which asked first)."""
    inbox = Inbox(**kw)
    me = inbox.join(G)
    assert inbox.answer(G, b"s" * 16, rank=1) == me
    return inbox, me, b"s" * 16


def _take(inbox, op, step, sender, wait=SOON):
    return inbox.take(G, op, step, sender, time.monotonic() + wait, "worker w:1 (rank 1)")


def test_a_chunk_is_kept_for_its_member_until_taken_and_a_take_waits_for_it():
    inbox, me, them = _formed()
    inbox.deliver(G, 0, 0, 1, np.arange(3, dtype=np.float32), me, them, 77)
    assert inbox.held_bytes == 1024   # (each chunk counts as CHUNK_BYTES_MIN at least)
    data, sig = _take(inbox, 0, 0, 1)
    assert data.tolist() == [0, 1, 2] and sig == 77 and inbox.held_bytes == 0
    got = []
    taker = threading.Thread(target=lambda: got.append(_take(inbox, 0, 1, 1)))
    taker.start()
    inbox.deliver(G, 0, 1, 1, np.ones(2, np.float64), me, them)
    taker.join(10)
    assert not taker.is_alive() and got[0][0].dtype == np.float64


def test_chunks_for_no_member_here_or_from_another_sender_are_refused_and_kept_nowhere():
    inbox = Inbox()
    with pytest.raises(FailedPrecondition, match="no member of this collective group"):
        inbox.deliver(G, 0, 0, 1, np.ones(2, np.float32), b"m" * 16, b"s" * 16)
    assert inbox.answer(G, b"s" * 16) == b""   # not formed: ask again
    me = inbox.join(G)
    assert inbox.member(G) == me and inbox.member(b"x" * 16) == b""
    with pytest.raises(ValueError, match="formed on this worker already"):
        inbox.join(G)
    with pytest.raises(FailedPrecondition, match="another member"):   # nobody asked yet
        inbox.deliver(G, 0, 0, 1, np.ones(2, np.float32), me, b"s" * 16)
    # the first to ask is the one it takes chunks from; another asker is not answered
    assert inbox.answer(G, b"s" * 16, rank=1) == me and inbox.answer(G, b"s" * 16, rank=1) == me
    assert inbox.answer(G, b"t" * 16, rank=1) == b"" and inbox.answer(G, b"") == b""
    with pytest.raises(FailedPrecondition, match="no member"):   # an earlier member's id
        inbox.deliver(G, 0, 0, 1, np.ones(2, np.float32), b"m" * 16, b"s" * 16)
    inbox.deliver(G, 0, 0, 1, np.ones(2, np.float32), me, b"s" * 16)
    with pytest.raises(FailedPrecondition, match="another member"):
        inbox.deliver(G, 0, 1, 1, np.ones(2, np.float32), me, b"t" * 16)
    assert inbox.held_bytes == 1024
    inbox.leave(G, me)   # its chunks go, later ones are refused
    assert inbox.held_bytes == 0 and inbox.member(G) == b""
    with pytest.raises(FailedPrecondition):
        inbox.deliver(G, 0, 1, 1, np.ones(2, np.float32), me, b"s" * 16)
    again = inbox.join(G)   # formed anew: a new id, which any first asker may pin
    assert again != me and inbox.answer(G, b"t" * 16, rank=1) == again
    # the old member closing late drops nothing of the new one's
    inbox.deliver(G, 0, 0, 1, np.ones(2, np.float32), again, b"t" * 16)
    inbox.leave(G, me)
    assert inbox.member(G) == again and inbox.held_bytes == 1024


def test_each_rank_has_its_own_pinned_sender_and_none_delivers_as_another():
    """The direct all-reduce: a member takes chunks from every other rank, each
    rank's from the member that asked first as that rank, and from no one else."""
    inbox, me, them = _formed()   # "s" pinned as rank 1
    assert inbox.answer(G, b"u" * 16, rank=2) == me
    assert inbox.answer(G, b"v" * 16, rank=2) == b""   # rank 2 is pinned to "u"
    inbox.deliver(G, 0, 0, 1, np.ones(1, np.float32), me, them)
    inbox.deliver(G, 0, 0, 2, np.full(1, 2, np.float32), me, b"u" * 16)
    for rank, sender in ((2, them), (1, b"u" * 16), (3, them), (2, b"v" * 16)):
        with pytest.raises(FailedPrecondition, match=f"takes rank {rank}'s chunks from another"):
            inbox.deliver(G, 0, 1, rank, np.ones(1, np.float32), me, sender)
    assert inbox.held_bytes == 2048
    assert _take(inbox, 0, 0, 2, 0.0)[0].tolist() == [2.0]
    inbox.abort(G, me, b"u" * 16, "rank 2: failed")   # any pinned sender's abort counts
    with pytest.raises(FailedPrecondition, match="rank 2: failed"):
        _take(inbox, 0, 1, 1, 0.0)


def test_an_abort_from_the_previous_member_fails_the_take_at_once_and_later_chunks():
    inbox, me, them = _formed()
    inbox.abort(G, me, b"x" * 16, "not its sender: ignored")
    inbox.abort(G, b"y" * 16, them, "not this member: ignored")
    with pytest.raises(DeadlineExceeded):
        _take(inbox, 0, 0, 1, 0.0)
    t = threading.Thread(target=lambda: inbox.abort(G, me, them, "rank 0: InvalidArgument: x"))
    with pytest.raises(FailedPrecondition, match="worker w:1 .rank 1. failed, so this "
                                                 "operation does: rank 0: InvalidArgument"):
        t.start()
        _take(inbox, 0, 0, 1)
    t.join(10)
    with pytest.raises(FailedPrecondition, match="operation failed"):
        inbox.deliver(G, 0, 0, 1, np.ones(2, np.float32), me, them)
    raw = wire.joined(wire.encode_collective_chunk(G, 0, 0, 1, None, me, them, 0, "why"))
    assert inbox.deliver_bytes(raw) == b""


def test_the_same_chunk_twice_is_kept_once_and_another_under_its_key_is_refused():
    inbox, me, them = _formed()
    inbox.deliver(G, 3, 0, 1, np.ones(4, np.float32), me, them)
    inbox.deliver(G, 3, 0, 1, np.ones(4, np.float32), me, them)
    assert inbox.held_bytes == 1024
    for other in (np.zeros(4, np.float32), np.ones(4, np.float64)):
        with pytest.raises(InvalidArgument, match="arrived twice with different contents"):
            inbox.deliver(G, 3, 0, 1, other, me, them)
    np.testing.assert_array_equal(_take(inbox, 3, 0, 1, 0.0)[0], np.ones(4))


def test_a_full_inbox_waits_for_room_then_refuses_and_keeps_what_it_has():
    inbox, me, them = _formed(max_bytes=4096, max_chunks=3)
    inbox.deliver(G, 0, 0, 1, np.ones(600, np.float32), me, them)   # 2,400 bytes
    with pytest.raises(ResourceExhausted, match="inbox holds 2400 bytes in 1 chunks"):
        inbox.deliver(G, 0, 1, 1, np.ones(600, np.float32), me, them, room_seconds=0.05)
    assert inbox.held_bytes == 2400
    # a take makes room for a delivery waiting for it
    done = threading.Event()
    t = threading.Thread(target=lambda: (inbox.deliver(G, 0, 1, 1, np.ones(600, np.float32),
                                                       me, them, room_seconds=SOON), done.set()))
    t.start()
    _take(inbox, 0, 0, 1)
    t.join(10)
    assert done.is_set() and inbox.held_bytes == 2400
    _take(inbox, 0, 1, 1)
    big = np.ones(5000, np.float32)   # larger than the inbox: taken when it is empty
    inbox.deliver(G, 0, 2, 1, big, me, them)
    assert inbox.held_bytes == 20000
    _take(inbox, 0, 2, 1)
    # deliveries waiting for room hold at most max_bytes more: past that, refused at once
    inbox.deliver(G, 0, 3, 1, np.ones(900, np.float32), me, them)   # 3,600 bytes held
    waiting = threading.Thread(target=lambda: pytest.raises(
        ResourceExhausted, inbox.deliver, G, 0, 4, 1, np.ones(900, np.float32), me, them,
        room_seconds=2.0))
    waiting.start()
    while not inbox._waiting:   # (the delivery above is waiting for room)
        time.sleep(0.001)
    with pytest.raises(ResourceExhausted):   # 3,600 waiting already: no room to wait in
        inbox.deliver(G, 0, 5, 1, np.ones(900, np.float32), me, them, room_seconds=SOON)
    waiting.join(10)
    _take(inbox, 0, 3, 1)
    for step in range(3):   # empty chunks count too: at most max_chunks of them
        inbox.deliver(G, 1, step, 1, np.zeros(0, np.float32), me, them)
    with pytest.raises(ResourceExhausted, match="3 chunks"):
        inbox.deliver(G, 1, 3, 1, np.zeros(0, np.float32), me, them)


def test_a_take_names_what_it_waited_for_or_says_the_senders_error_at_once():
    inbox, me, them = _formed()
    assert inbox.answer(G, b"u" * 16, rank=2) == me
    inbox.deliver(G, 0, 0, 2, np.ones(1, np.float32), me, b"u" * 16)   # another sender's
    with pytest.raises(DeadlineExceeded, match="worker w:1 .rank 1.*further back round the ring"):
        _take(inbox, 0, 0, 1, 0.0)
    failed = []
    t = threading.Thread(target=lambda: (failed.append(ResourceExhausted("next is full")),
                                         inbox.wake()))
    with pytest.raises(ResourceExhausted, match="next is full"):
        t.start()
        inbox.take(G, 0, 0, 1, time.monotonic() + SOON, "x",
                   lambda: failed[0] if failed else None)
    t.join(10)


def test_a_request_counts_the_whole_buffer_that_holds_it():
    """A chunk padded with an unknown field holds its whole request: counted so."""
    inbox, me, them = _formed()
    raw = wire.joined(wire.encode_collective_chunk(G, 0, 0, 1, np.ones(1, np.float32), me, them))
    padded = raw + bytes([0x7A]) + bytes([0x80, 0x80, 0x04]) + bytes(65536)   # field 15, 64 KiB
    assert inbox.deliver_bytes(padded, 0.0) == me
    assert inbox.held_bytes >= len(padded)
    # a probe (no receiver) from the sender is answered with the member id, keeps nothing
    probe = wire.joined(wire.encode_collective_chunk(G, 0, 0, 1, None, b"", them))
    assert inbox.deliver_bytes(probe) == me and inbox.held_bytes >= len(padded)


def test_the_direct_all_reduce_is_chosen_for_small_arrays_in_small_groups():
    assert choose_algorithm(0, 3) == choose_algorithm(DIRECT_MAX_BYTES, 4) == "direct"
    assert choose_algorithm(1000, DIRECT_MAX_MEMBERS) == "direct"
    assert choose_algorithm(1000, 2) == "ring"   # (the same two steps)
    assert choose_algorithm(DIRECT_MAX_BYTES + 1, 3) == "ring"
    assert choose_algorithm(1000, DIRECT_MAX_MEMBERS + 1) == "ring"
    with pytest.raises(ValueError, match="algorithm must be one of"):
        CollectiveGroup("g", ["w:1"], 0).all_reduce(np.ones(2, np.float32), algorithm="tree")


@pytest.mark.parametrize("size,n", [(0, 3), (2, 3), (10, 3), (1_000_003, 4), (7, 7)])
def test_chunk_bounds_cover_the_array_in_near_equal_pieces(size, n):
    bounds = chunk_bounds(size, n)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_a_group_that_cannot_be_made_or_is_dropped_unclosed_leaves_no_member():
    import gc
    inbox = Inbox()
    with pytest.raises(TypeError):   # its channel cannot be made: not joined either
        CollectiveGroup("g", ["a:1", "b:1"], 0, tls="not a config", inbox=inbox)
    assert inbox.member(group_id("g")) == b""
    g = CollectiveGroup("g", ["a:1", "b:1"], 0, tls=False, inbox=inbox)
    assert inbox.member(group_id("g")) != b""
    del g
    gc.collect()
    assert inbox.member(group_id("g")) == b""
    with CollectiveGroup("g", ["a:1", "b:1"], 1, tls=False, inbox=inbox) as g:
        assert inbox.member(group_id("g")) == g._member
    assert inbox.member(group_id("g")) == b""


def test_a_group_of_one_returns_a_copy_and_checks_what_it_is_given():
    g = CollectiveGroup("solo", ["127.0.0.1:1"], 0)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = g.all_reduce(x)
    assert out is not x and out.shape == (2, 3)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(g.all_reduce(x, average=True), x)
    with pytest.raises(InvalidArgument, match="float16, float32 or float64"):
        g.all_reduce(np.arange(3))
    with pytest.raises(ValueError, match="rank 2 is not in"):
        CollectiveGroup("g", ["a:1", "b:1"], 2)
    with pytest.raises(ValueError, match="distinct worker addresses"):
        CollectiveGroup("g", ["a:1", "a:1"], 0)
    assert group_id("solo") == group_id("solo") != group_id("solo2")
    assert len(group_id("solo")) == 16


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_chunk_by_hand_reads_back_and_protobuf_reads_it_the_same(dtype):
    data = np.arange(5, dtype=dtype)
    ids = (b"r" * 16, b"m" * 16, 2**63 + 5)
    raw = wire.joined(wire.encode_collective_chunk(G, 2**40 + 1, 3, 2, data, *ids))
    group, op, step, sender, got, *rest = wire_decode.decode_collective_chunk(raw)
    assert (group, op, step, sender, *rest) == (G, 2**40 + 1, 3, 2, *ids, "")
    assert got.dtype == dtype and got.tolist() == data.tolist()
    msg = worker_pb2.CollectiveChunk.FromString(raw)
    assert (msg.group, msg.op, msg.step, msg.sender) == (G, 2**40 + 1, 3, 2)
    assert (msg.receiver, msg.member, msg.signature) == ids
    assert msg.data.dtype == np.dtype(dtype).name and list(msg.data.shape) == [5]
    # and what protobuf writes reads back by hand
    again = wire_decode.decode_collective_chunk(msg.SerializeToString())
    assert again[:4] == (G, 2**40 + 1, 3, 2) and again[4].tolist() == data.tolist()
    assert again[5:] == (*ids, "")
    # a probe: no receiver, no data
    probe = wire_decode.decode_collective_chunk(wire.joined(
        wire.encode_collective_chunk(G, 0, 0, 1, None)))
    assert probe[4] is None and probe[5] == b""
    abort = wire_decode.decode_collective_chunk(wire.joined(
        wire.encode_collective_chunk(G, 0, 0, 1, None, b"r" * 16, b"m" * 16, 0, "why")))
    assert abort[4] is None and abort[8] == "why"
    for bad, match in (((G, 0, 0, 1, data, b"r" * 3, b"m" * 16), "receiver and member ids"),
                       ((G, 0, 0, 1, data, b"r" * 16, b""), "receiver and member ids"),
                       ((G, 0, 0, 1, None, b"r" * 16, b"m" * 16), "needs its data"),
                       ((G, 0, 0, 1, None, b"r" * 16, b"m" * 16, 0, "x" * 1001), "at most 1000")):
        with pytest.raises(InvalidArgument, match=match):
            wire_decode.decode_collective_chunk(wire.joined(wire.encode_collective_chunk(*bad)))


def test_narrowing_to_float16_clips_finite_values_and_keeps_nan_and_inf():
    from coordinator.collective_parts import narrow
    a = np.array([1e5, -1e5, np.inf, -np.inf, np.nan, 1.5, 65504.0, 7e-9], np.float32)
    out = narrow(a, np.float16)
    assert out.dtype == np.float16
    assert out[:2].tolist() == [65504.0, -65504.0]
    assert np.isposinf(out[2]) and np.isneginf(out[3]) and np.isnan(out[4])
    assert out[5:7].tolist() == [1.5, 65504.0] and out[7] == 0.0


def test_fusion_batches_group_by_dtype_in_order_up_to_the_buffer():
    from coordinator.collective_parts import FUSION_BYTES, fusion_batches
    f32 = lambda n: np.zeros(n, np.float32)   # noqa: E731
    big = FUSION_BYTES // 4
    arrays = [f32(10), np.zeros(3), f32(big - 10), f32(1), f32(big + 1), np.zeros(1), f32(2)]
    assert fusion_batches(arrays) == [[0, 2], [3], [4], [6], [1, 5]]
    assert fusion_batches([]) == []
    assert fusion_batches([f32(10), f32(10), f32(10)], 80) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="compression must be one of"):
        CollectiveGroup("solo", ["a:1"], 0).all_reduce(f32(3), compression="int8")
    g = CollectiveGroup("solo", ["a:1"], 0)
    outs = g.all_reduce_many([f32(3).reshape(3, 1), np.ones(2)], average=True)
    assert [o.shape for o in outs] == [(3, 1), (2,)] and outs[1].tolist() == [1.0, 1.0]
    assert g.operations == 2


def test_a_probe_is_held_until_its_member_forms():
    """The long poll: a probe for a member not formed yet is answered the
    moment it forms (not after the asker's next poll), empty after the wait
    if it never does; one for a group whose member takes another sender's
    chunks (an earlier forming's) waits for that one to leave and a new one
    to form."""
    inbox = Inbox()
    got = []
    asker = threading.Thread(target=lambda: got.append(inbox.answer(G, b"s" * 16, SOON)))
    asker.start()
    while not inbox._cond._waiters:   # (the asker is waiting in the inbox)
        time.sleep(0.001)
    me = inbox.join(G)
    asker.join(SOON)
    assert got == [me]
    t = time.monotonic()
    assert inbox.answer(bytes(16), b"s" * 16, 0.05) == b""   # never formed: empty, bounded
    assert time.monotonic() - t >= 0.05
    assert inbox.answer(G, b"t" * 16, 0.05) == b""   # G's member takes "s"'s chunks
    got.clear()
    asker = threading.Thread(target=lambda: got.append(inbox.answer(G, b"t" * 16, SOON)))
    asker.start()
    while not inbox._cond._waiters:
        time.sleep(0.001)
    inbox.leave(G, me)
    again = inbox.join(G)
    asker.join(SOON)
    assert got == [again] and again != me
