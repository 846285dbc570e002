"""coordinator/collective.py's pure parts, in process: the inbox (keep,
take, room, expiry, a chunk sent twice), chunk bounds, a group of one, and
the chunk's wire form against protobuf's parser. The ring between real
workers: tests/integration/test_collective.py."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from coordinator.collective import CollectiveGroup, Inbox, chunk_bounds, group_id
from protos.pstrain.v1 import worker_pb2
from psserver.contract import wire, wire_decode
from psserver.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted

G = bytes(range(16))


def test_a_chunk_is_kept_until_taken_and_a_take_waits_for_it():
    inbox = Inbox()
    inbox.deliver(G, 0, 0, 1, np.arange(3, dtype=np.float32))
    assert inbox.held_bytes == 12
    np.testing.assert_array_equal(inbox.take(G, 0, 0, 1, time.monotonic() + 30, "x"), [0, 1, 2])
    assert inbox.held_bytes == 0
    got = []
    taker = threading.Thread(target=lambda: got.append(inbox.take(G, 0, 1, 1, time.monotonic() + 30, "x")))
    taker.start()
    inbox.deliver(G, 0, 1, 1, np.ones(2, np.float64))
    taker.join(10)
    assert not taker.is_alive() and got[0].dtype == np.float64 and got[0].tolist() == [1, 1]


def test_a_take_that_waits_too_long_names_what_it_waited_for():
    inbox = Inbox()
    inbox.deliver(G, 0, 0, 2, np.ones(1, np.float32))   # another sender's
    with pytest.raises(DeadlineExceeded, match="worker w:1 .rank 1"):
        inbox.take(G, 0, 0, 1, 0.0, "worker w:1 (rank 1)")
    assert inbox.held_bytes == 4


def test_the_same_chunk_twice_is_kept_once_and_another_under_its_key_is_refused():
    inbox = Inbox()
    inbox.deliver(G, 3, 0, 1, np.ones(4, np.float32))
    inbox.deliver(G, 3, 0, 1, np.ones(4, np.float32))
    assert inbox.held_bytes == 16
    with pytest.raises(InvalidArgument, match="arrived twice with different contents"):
        inbox.deliver(G, 3, 0, 1, np.zeros(4, np.float32))
    with pytest.raises(InvalidArgument, match="different contents"):
        inbox.deliver(G, 3, 0, 1, np.ones(4, np.float64))
    np.testing.assert_array_equal(inbox.take(G, 3, 0, 1, 0.0, "x"), np.ones(4))
    # taken: the key is free again (a group's name used again later)
    inbox.deliver(G, 3, 0, 1, np.zeros(4, np.float32))
    assert inbox.held_bytes == 16


def test_a_full_inbox_refuses_after_waiting_and_keeps_what_it_has():
    inbox = Inbox(max_bytes=16)
    inbox.deliver(G, 0, 0, 1, np.ones(3, np.float32))
    with pytest.raises(ResourceExhausted, match="inbox holds 12 bytes"):
        inbox.deliver(G, 0, 1, 1, np.ones(3, np.float32), room_seconds=0.0)
    assert inbox.held_bytes == 12
    inbox.take(G, 0, 0, 1, 0.0, "x")
    big = np.ones(100, np.float32)   # larger than the inbox: taken when it is empty
    inbox.deliver(G, 0, 1, 1, big, room_seconds=0.0)
    assert inbox.held_bytes == 400
    # room made by a take wakes a waiting delivery
    done = threading.Event()
    t = threading.Thread(target=lambda: (inbox.deliver(G, 0, 2, 1, np.ones(1, np.float32)),
                                         done.set()))
    t.start()
    inbox.take(G, 0, 1, 1, 0.0, "x")
    t.join(10)
    assert done.is_set() and inbox.held_bytes == 4


def test_chunks_nobody_takes_are_dropped_after_keep_seconds():
    now = [0.0]
    inbox = Inbox(keep_seconds=10.0, clock=lambda: now[0])
    inbox.deliver(G, 0, 0, 1, np.ones(3, np.float32))
    now[0] = 10.5
    inbox.deliver(G, 1, 0, 1, np.ones(1, np.float32))
    assert inbox.held_bytes == 4
    with pytest.raises(DeadlineExceeded):
        inbox.take(G, 0, 0, 1, 0.0, "x")


@pytest.mark.parametrize("size,n", [(0, 3), (2, 3), (10, 3), (1_000_003, 4), (7, 7)])
def test_chunk_bounds_cover_the_array_in_near_equal_pieces(size, n):
    bounds = chunk_bounds(size, n)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


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
    raw = wire.joined(wire.encode_collective_chunk(G, 2**40 + 1, 3, 2, data))
    group, op, step, sender, got = wire_decode.decode_collective_chunk(raw)
    assert (group, op, step, sender) == (G, 2**40 + 1, 3, 2)
    assert got.dtype == dtype and got.tolist() == data.tolist()
    msg = worker_pb2.CollectiveChunk.FromString(raw)
    assert (msg.group, msg.op, msg.step, msg.sender) == (G, 2**40 + 1, 3, 2)
    assert msg.data.dtype == np.dtype(dtype).name and list(msg.data.shape) == [5]
    # and what protobuf writes reads back by hand
    again = wire_decode.decode_collective_chunk(msg.SerializeToString())
    assert again[:4] == (G, 2**40 + 1, 3, 2) and again[4].tolist() == data.tolist()


def test_narrowing_to_float16_clips_finite_values_and_keeps_nan_and_inf():
    from coordinator.collective import _narrow
    a = np.array([1e5, -1e5, np.inf, -np.inf, np.nan, 1.5, 65504.0, 7e-9], np.float32)
    out = _narrow(a, np.float16)
    assert out.dtype == np.float16
    assert out[:2].tolist() == [65504.0, -65504.0]
    assert np.isposinf(out[2]) and np.isneginf(out[3]) and np.isnan(out[4])
    assert out[5:7].tolist() == [1.5, 65504.0] and out[7] == 0.0


def test_fusion_batches_group_by_dtype_in_order_up_to_the_buffer():
    from coordinator.collective import FUSION_BYTES, _fusion_batches
    f32 = lambda n: np.zeros(n, np.float32)   # noqa: E731
    big = FUSION_BYTES // 4
    arrays = [f32(10), np.zeros(3), f32(big - 10), f32(1), f32(big + 1), np.zeros(1), f32(2)]
    assert _fusion_batches(arrays) == [[0, 2], [3], [4], [6], [1, 5]]
    assert _fusion_batches([]) == []
    with pytest.raises(ValueError, match="compression must be one of"):
        CollectiveGroup("solo", ["a:1"], 0).all_reduce(f32(3), compression="int8")
    g = CollectiveGroup("solo", ["a:1"], 0)
    outs = g.all_reduce_many([f32(3).reshape(3, 1), np.ones(2)], average=True)
    assert [o.shape for o in outs] == [(3, 1), (2,)] and outs[1].tolist() == [1.0, 1.0]
    assert g.operations == 2
