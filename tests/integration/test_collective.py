"""coordinator/collective.py between real psworker processes: the ring
all-reduce over Worker.Collective (sockets, data port and gRPC, the
cluster's token and TLS), its bytes, its errors, and what a worker does
with chunks it should refuse."""
from __future__ import annotations

import concurrent.futures as futures
import re
import subprocess

import numpy as np
import pytest

from coordinator import LocalCluster, serialization
from coordinator.collective import PIECE_BYTES, chunk_bounds
from protos.pstrain.v1 import ps_pb2, worker_pb2
from psserver.contract import routing, wire
from psserver.errors import Code, PSError
from psserver.link import methods
from psserver.link.channel import TaskChannel

pytestmark = pytest.mark.timeout(180)


# -- run on the workers (imported there by name) -----------------------------------------
def _data(seed: int, rank: int, size: int, dtype: str, exact: bool) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    if exact:   # integers: every order of additions gives the same sum
        return rng.integers(-1000, 1000, size).astype(dtype)
    return rng.standard_normal(size).astype(dtype)


def member(name, addresses, rank, size, dtype, exact, average=False, timeout=60.0, seed=7,
           algorithm=None):
    """One member's all-reduce of its rank's array: (result, bytes it sent)."""
    from coordinator.collective import CollectiveGroup
    with CollectiveGroup(name, addresses, rank, timeout=timeout) as group:
        out = group.all_reduce(_data(seed, rank, size, dtype, exact), average=average,
                               algorithm=algorithm)
        return out, group.bytes_sent


def members_in_order(name, addresses, rank, sizes):
    """Several all-reduces in a row in one group (ops 0, 1, ...)."""
    from coordinator.collective import CollectiveGroup
    with CollectiveGroup(name, addresses, rank) as group:
        return [group.all_reduce(_data(k, rank, s, "float32", True)) for k, s in enumerate(sizes)]


def members_keeping_results(name, addresses, rank, size, calls):
    """Several all-reduces of large arrays in a row, every result kept (their
    memory comes from a pool), the inputs strided views: (results, whether
    every input is as given after all the calls)."""
    from coordinator.collective import CollectiveGroup
    inputs = [_data(k, rank, 2 * size, "float32", True)[::2] for k in range(calls)]
    before = [x.copy() for x in inputs]
    with CollectiveGroup(name, addresses, rank) as group:
        outs = [group.all_reduce(x) for x in inputs]
    return outs, all(np.array_equal(x, b) for x, b in zip(inputs, before))


def member_fp16(name, addresses, rank, size, algorithm=None):
    """A float32 all-reduce with chunks sent as float16: (result, bytes sent)."""
    from coordinator.collective import CollectiveGroup
    with CollectiveGroup(name, addresses, rank) as group:
        x = _data(7, rank, size, "float32", False)
        x[:3] = [np.nan, np.inf, 30000.0 * (rank + 1)]   # kept, kept, past float16: clipped
        return group.all_reduce(x, compression="fp16", algorithm=algorithm), group.bytes_sent


def member_many(name, addresses, rank, shapes):
    """all_reduce_many of arrays of these (shape, dtype): (results, rings made)."""
    from coordinator.collective import CollectiveGroup
    with CollectiveGroup(name, addresses, rank) as group:
        arrays = [_data(k, rank, int(np.prod(shape)), dt, True).reshape(shape)
                  for k, (shape, dt) in enumerate(shapes)]
        return group.all_reduce_many(arrays), group.operations


def member_of_size(name, addresses, rank, sizes, averages=(False,) * 4, timeout=3.0,
                   algorithms=(None,) * 4):
    """An all-reduce where each rank gives an array of its own size, or asks
    for the mean where others ask for the sum, or runs another algorithm
    (mistakes)."""
    from coordinator.collective import CollectiveGroup
    with CollectiveGroup(name, addresses, rank, timeout=timeout) as group:
        return group.all_reduce(np.ones(sizes[rank], np.float32), average=averages[rank],
                                algorithm=algorithms[rank])


def member_per_step(name, addresses, rank, steps, work):
    """A group formed anew for each step under one name, as a step function
    would: ``work[rank]`` seconds of other work inside each (a slower member
    still in the old group while the others form the new one)."""
    import time

    from coordinator.collective import CollectiveGroup
    out = []
    for k in range(steps):
        with CollectiveGroup(name, addresses, rank) as group:
            out.append(group.all_reduce(_data(k, rank, 1000, "float32", True)))
            time.sleep(work[rank])   # (that other work)
    return out


def member_of_shape(name, addresses, rank, shapes, many=False):
    """An all-reduce where each rank gives an array of its own shape (a
    mistake); ``many``: all_reduce_many of it and a scalar."""
    from coordinator.collective import CollectiveGroup
    with CollectiveGroup(name, addresses, rank, timeout=5.0) as group:
        x = np.ones(shapes[rank], np.float32)
        return group.all_reduce_many([x, np.ones((), np.float32)]) if many else \
            group.all_reduce(x)


def socket_bytes_to(address: str) -> int:
    """TCP payload bytes this host's sockets delivered to ``address``'s host
    (all connections; tcp_info's bytes_acked: a segment sent again, as TCP
    does when the two busy cores drop one, counts once)."""
    ip = address.rsplit(":", 1)[0]
    out = subprocess.run(["ss", "-tinH", "state", "established", "dst", ip],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(m) for m in re.findall(r"bytes_acked:(\d+)", out))


def member_on_host(name, addresses, rank, size):
    """Rank's all-reduce: (its result's checksum bits, bytes the group
    framed, bytes its sockets sent to the next member's host)."""
    from coordinator.collective import CollectiveGroup
    nxt = addresses[(rank + 1) % len(addresses)]
    before = socket_bytes_to(nxt)   # (no connection to it yet: 0)
    with CollectiveGroup(name, addresses, rank) as group:
        out = group.all_reduce(_data(7, rank, size, "float32", True))
        sent = socket_bytes_to(nxt) - before
        return out, group.bytes_sent, sent


def member_direct_on_host(name, addresses, rank, size):
    """Rank's direct all-reduce: (its result, bytes the group framed, bytes
    its sockets sent to every other member's host)."""
    from coordinator.collective import CollectiveGroup
    others = [a for i, a in enumerate(addresses) if i != rank]
    before = sum(socket_bytes_to(a) for a in others)
    with CollectiveGroup(name, addresses, rank) as group:
        out = group.all_reduce(_data(7, rank, size, "float32", True), algorithm="direct")
        sent = sum(socket_bytes_to(a) for a in others) - before
        return out, group.bytes_sent, sent


def abort_or_reduce(name, addresses, rank, late, timeout, algorithm):
    """Rank 0 forms the group and gives up at once (as a step that fails
    before its push does); the others form ``late[rank]`` seconds later
    (members reaching their push at other times) and all-reduce: their
    errors ("Type: message")."""
    import time

    from coordinator.collective import CollectiveGroup
    time.sleep(late[rank])   # (part of the case: this member comes later)
    try:
        with CollectiveGroup(name, addresses, rank, timeout=timeout) as group:
            if rank == 0:
                group.abort("its step failed")
                return "aborted"
            group.all_reduce(np.ones(30, np.float32), algorithm=algorithm)
            return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def reduce_with_a_small_inbox(name, addresses, rank, size, inbox_bytes, timeout, algorithm):
    """An all-reduce with this worker's inbox bounded to ``inbox_bytes`` (as
    one busy with other groups' chunks is): "ok" or the error."""
    from coordinator.collective import CollectiveGroup
    from coordinator.collective_inbox import INBOX
    saved, INBOX.max_bytes = INBOX.max_bytes, inbox_bytes
    try:
        with CollectiveGroup(name, addresses, rank, timeout=timeout) as group:
            group.all_reduce(np.ones(size, np.float32), algorithm=algorithm)
            return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        INBOX.max_bytes = saved


def inbox_bytes():
    from coordinator.collective_inbox import INBOX
    return INBOX.held_bytes


# -- the test side ----------------------------------------------------------------------
def _run(cluster, index: int, fn, *args):
    """fn(*args) as a closure on worker ``index``: its result, or PSError."""
    w = cluster.workers[index]
    with TaskChannel(w.address, role="worker", token=cluster.token, tls=cluster.tls) as ch:
        reply = ch.call(methods.RUN_CLOSURE, worker_pb2.ClosureRequest(
            fn=serialization.encode_function(fn), args=serialization.dumps((args, {}))), 120)
    if reply.HasField("error"):
        raise RuntimeError(f"{reply.error.type}: {reply.error.message}")
    return serialization.loads(reply.result, trusted=True)


def _on_all(cluster, fn, *args, ranks=None):
    """fn(name, addresses, rank, *args) on each worker at once (worker i is
    rank i; ``ranks``: the first so many workers only)."""
    ranks = range(len(cluster.workers)) if ranks is None else ranks
    addresses = [cluster.workers[r].address for r in ranks]
    with futures.ThreadPoolExecutor(len(addresses)) as pool:
        runs = [pool.submit(_run, cluster, r, fn, f"test-{fn.__name__}-{args}", addresses, r,
                            *args) for r in ranks]
        return [f.result() for f in runs]


def _failures(cluster, fn, name: str, ranks, *args) -> list[str]:
    """fn(name, addresses, rank, *args) on the workers of ``ranks`` at once
    (addresses: all the cluster's workers), each expected to fail: their
    errors ("Type: message"), in rank order."""
    addresses = [w.address for w in cluster.workers]
    with futures.ThreadPoolExecutor(len(ranks)) as pool:
        runs = [pool.submit(_run, cluster, r, fn, name, addresses, r, *args) for r in ranks]
        errors = []
        for f in runs:
            with pytest.raises(RuntimeError) as info:
                f.result()
            errors.append(str(info.value))
    return errors


@pytest.fixture(scope="module")
def three():
    with LocalCluster(num_ps=1, num_workers=3) as cluster:
        yield cluster


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("size,dtype", [(1_000_003, "float32"), (4099, "float64"),
                                        # chunks of 2, 2 and 1 pieces of PIECE_BYTES
                                        (3 * (PIECE_BYTES // 4) + 2, "float32"),
                                        (257, "float16"), (2, "float32"), (0, "float32")])
def test_an_all_reduce_sums_every_members_array_the_same_bits_on_each(three, size, dtype,
                                                                       algorithm):
    got = _on_all(three, member, size, dtype, True, False, 60.0, 7, algorithm)
    want = sum(_data(7, r, size, dtype, True) for r in range(3))
    for out, _ in got:
        assert out.dtype == np.dtype(dtype) and out.shape == (size,)
        np.testing.assert_array_equal(out, want)
    # random values: the order of additions matters, and every member has the same bits
    got = _on_all(three, member, size, dtype, False, False, 60.0, 7, algorithm)
    want = sum(_data(7, r, size, dtype, False).astype(np.float64) for r in range(3))
    assert all(out.tobytes() == got[0][0].tobytes() for out, _ in got)
    np.testing.assert_allclose(got[0][0], want, rtol=1e-2 if dtype == "float16" else 1e-5,
                               atol=1e-2 if dtype == "float16" else 1e-5)


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_each_member_sends_2_n_minus_1_over_n_of_the_bytes(three, algorithm):
    """The cost of either: each member sends n - 1 chunks in each phase
    (the ring: one to the next member a step; direct: the others' chunks,
    then its own to each), framing aside (under 128 bytes a piece of
    PIECE_BYTES, and a probe to each member it sends to), whatever n."""
    size, n = 1_000_003, 3
    sizes = [b - a for a, b in chunk_bounds(size, n)]
    per = PIECE_BYTES // 4
    got = _on_all(three, member, size, "float32", True, False, 60.0, 7, algorithm)
    for rank, (_, sent) in enumerate(got):
        chunks = [sizes[(rank - s) % n] for s in range(n - 1)] + \
            [sizes[(rank + 1 - s) % n] for s in range(n - 1)] if algorithm == "ring" else \
            [sizes[j] for j in range(n) if j != rank] + [sizes[rank]] * (n - 1)
        data, pieces = 4 * sum(chunks), sum(-(-c // per) for c in chunks)
        assert data <= sent <= data + 128 * (pieces + n - 1)
        assert abs(data / (4 * size) - 2 * (n - 1) / n) < 1e-5


def test_mean_and_several_operations_in_order(three):
    got = _on_all(three, member, 1000, "float64", True, True)
    want = sum(_data(7, r, 1000, "float64", True) for r in range(3)) / 3.0
    for out, _ in got:
        np.testing.assert_array_equal(out, want)
    sizes = [10, 100_000, 3, 7777]
    for outs in _on_all(three, members_in_order, sizes):
        for k, (out, s) in enumerate(zip(outs, sizes)):
            np.testing.assert_array_equal(out, sum(_data(k, r, s, "float32", True)
                                                   for r in range(3)))
    assert [_run(three, i, inbox_bytes) for i in range(3)] == [0, 0, 0]


def test_results_kept_are_never_overwritten_and_inputs_are_left_as_given(three):
    """A result's memory is a pooled buffer (no copy of the input first):
    one the caller keeps is not handed to a later all-reduce, and the
    caller's array (here strided) is only read."""
    size, calls = 3 * (PIECE_BYTES // 4) + 5, 3   # about 12 MiB: pooled, several pieces a chunk
    for outs, inputs_kept in _on_all(three, members_keeping_results, size, calls):
        assert inputs_kept
        for k, out in enumerate(outs):
            want = sum(_data(k, r, 2 * size, "float32", True)[::2] for r in range(3))
            np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("n,algorithm", [(2, "ring"), (3, "ring"), (3, "direct")])
def test_fp16_compression_halves_the_bytes_and_every_member_has_the_same_bits(three, n,
                                                                              algorithm):
    size = 300_001
    ranks = range(n)
    got = _on_all(three, member_fp16, size, algorithm, ranks=ranks)
    _, sent32 = _on_all(three, member, size, "float32", False, False, 60.0, 7, algorithm,
                        ranks=ranks)[0]
    for out, sent in got:
        assert out.dtype == np.float32 and out.tobytes() == got[0][0].tobytes()
        assert sent < 0.51 * sent32
    out = got[0][0]
    assert np.isnan(out[0]) and np.isinf(out[1])
    assert out[2] == np.float16(65504)   # 30000 + 60000 (+ 90000), clipped on the way
    want = sum(_data(7, r, size, "float32", False).astype(np.float64) for r in ranks)
    np.testing.assert_allclose(out[3:], want[3:], rtol=2e-3, atol=2e-3)


def test_many_arrays_fuse_into_few_rings_by_dtype(three):
    """Small gradients of two dtypes, one larger than the fusion buffer: a
    ring per dtype's buffer, each array's sum in its own shape."""
    from coordinator.collective import FUSION_BYTES
    big = FUSION_BYTES // 4 + 10
    shapes = [((3, 4), "float32"), ((5,), "float64"), ((), "float32"), ((7, 2), "float32"),
              ((big,), "float32"), ((1,), "float64")]
    got = _on_all(three, member_many, shapes)
    for outs, rings in got:
        # float32 up to the big one, then the big one (with what follows), float64
        assert rings == 3
        for k, ((shape, dt), out) in enumerate(zip(shapes, outs)):
            size = int(np.prod(shape))
            assert out.shape == shape and out.dtype == np.dtype(dt)
            np.testing.assert_array_equal(
                out, sum(_data(k, r, size, dt, True) for r in range(3)).reshape(shape))


def test_a_member_that_never_comes_is_named_after_the_groups_timeout(three):
    """Ranks 0 and 1 of a group of 3 run; rank 2 never does. Rank 0 waits for
    rank 2's chunk and says which worker it waited for."""
    addresses = [w.address for w in three.workers]
    errors = _failures(three, member, "lonely", (0, 1), 100, "float32", True, False, 2.0)
    assert "DeadlineExceeded" in errors[0] and addresses[2] in errors[0] and "rank 2" in errors[0]
    # the workers still serve, and a new group all-reduces
    got = _on_all(three, member, 10, "float32", True)
    np.testing.assert_array_equal(got[1][0], sum(_data(7, r, 10, "float32", True)
                                                 for r in range(3)))


@pytest.mark.parametrize("sizes,averages,algorithms", [
    ([30, 31, 30], (False,) * 3, ("ring",) * 3),
    ([30, 31, 30], (False,) * 3, ("direct",) * 3),
    ([30, 30, 30], (False, True, False), ("ring",) * 3),
    ([30, 30, 30], (False, True, False), ("direct",) * 3),
    ([30, 30, 30], (False,) * 3, ("ring", "direct", "ring")),
    ([30, 30, 30], (False,) * 3, ("direct", "direct", "ring"))])
def test_members_with_arrays_of_other_shapes_get_an_error_not_a_wrong_sum(three, sizes, averages,
                                                                          algorithms):
    """Rank 1's array is longer, or rank 1 asks for the mean, or the members
    run other algorithms: a member that receives a chunk of another
    operation says so, and the failure reaches every member (no member waits
    out its 30 s timeout); none returns a result, and no chunk is left
    behind."""
    errors = _failures(three, member_of_size, f"mismatch-{averages}-{algorithms}", range(3),
                       sizes, averages, 30.0, algorithms)
    assert any("differ in shape or dtype" in e for e in errors), errors
    assert all(e.split(":")[0] in ("InvalidArgument", "FailedPrecondition") for e in errors), errors
    assert [_run(three, i, inbox_bytes) for i in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_a_failure_reaches_members_that_come_later_than_the_one_told(three, algorithm):
    """Rank 0 gives up at once; rank 1 all-reduces at once and is told; rank 2
    comes half a second later, after rank 1 was told but before rank 1 had
    its id: rank 1 still tells it (its asks to pass a failure on are not
    cut short by its own failure), so rank 2 fails as told, not after its
    30 s timeout (review 11's first finding: it waited out its timeout)."""
    addresses = [w.address for w in three.workers]
    with futures.ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(_run, three, r, abort_or_reduce, f"late-{algorithm}", addresses, r,
                            [0.0, 0.0, 0.5], 30.0, algorithm) for r in range(3)]
        got = [f.result() for f in runs]
    assert got[0] == "aborted"
    for outcome in got[1:]:
        assert outcome.startswith("FailedPrecondition") and "its step failed" in outcome, got


def test_a_direct_chunk_refused_fails_the_operation_then_not_at_its_timeout(three):
    """Direct members send every chunk before they take any; with inboxes
    bounded below what arrives (a worker busy with other groups), a chunk
    is refused after the inbox's wait for room (10 s), and its sender sees
    the refusal while it waits for chunks (review 11's second finding: every
    member waited out its 60 s timeout, saying nothing of the refusal)."""
    size = 3 * (1 << 20)   # 12 MiB of float32: 8 MiB arrives at each member, in 4 MiB pieces
    got = _on_all(three, reduce_with_a_small_inbox, size, 6 << 20, 60.0, "direct")
    assert any(g.startswith("ResourceExhausted") for g in got), got
    assert not any(g.startswith("DeadlineExceeded") or g == "ok" for g in got), got
    # the ring takes the same array with the same inboxes (a piece in flight a sender)
    assert _on_all(three, reduce_with_a_small_inbox, size, 6 << 20, 60.0, "ring") == ["ok"] * 3
    with pytest.raises(RuntimeError, match="direct all-reduce takes arrays of up to"):
        _on_all(three, member, (16 << 20) // 4 + 1, "float32", True, False, 60.0, 7, "direct")
    assert [_run(three, i, inbox_bytes) for i in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("n", [2, 3])
def test_a_group_formed_anew_each_step_under_one_name(three, n):
    """The second review's repro: rank 1 does other work inside each step's
    group, so the others form the next step's group while it is still in
    the old one. Every step's sum is right."""
    addresses = [w.address for w in three.workers[:n]]
    work = [0.0, 0.3, 0.0][:n]
    with futures.ThreadPoolExecutor(n) as pool:
        runs = [pool.submit(_run, three, r, member_per_step, f"per-step-{n}", addresses, r, 4,
                            work) for r in range(n)]
        got = [f.result() for f in runs]
    for outs in got:
        for k, out in enumerate(outs):
            np.testing.assert_array_equal(out, sum(_data(k, r, 1000, "float32", True)
                                                   for r in range(n)))


def test_a_group_formed_again_after_a_failure_gets_the_right_sum(three):
    """Rank 0 of "again" runs alone and times out, its first chunk left
    with worker 1 (the review's repro: a leftover chunk summed into the
    next group of that name). Worker 1 refuses it: no member of that
    group was formed there. Then both form "again": the right sum."""
    addresses = [w.address for w in three.workers[:2]]
    with pytest.raises(RuntimeError, match="DeadlineExceeded"):
        _run(three, 0, member, "again", addresses, 0, 8, "float32", True, False, 1.0, 99)
    with futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_run, three, r, member, "again", addresses, r, 8, "float32", True)
                for r in (0, 1)]
        got = [f.result() for f in runs]
    want = sum(_data(7, r, 8, "float32", True) for r in range(2))
    for out, _ in got:
        np.testing.assert_array_equal(out, want)
    assert [_run(three, i, inbox_bytes) for i in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("many", [False, True])
def test_arrays_of_one_size_and_other_shapes_are_refused_not_summed(three, many):
    errors = _failures(three, member_of_shape, f"shapes-{many}", range(3),
                       [(2, 3), (3, 2), (2, 3)], many)
    assert any("differ in shape or dtype" in e for e in errors), errors
    assert [_run(three, i, inbox_bytes) for i in range(3)] == [0, 0, 0]


def _chunk(**over) -> bytes:
    fields = dict(group=bytes(16), op=0, step=0, sender=0, receiver=b"r" * 16, member=b"m" * 16,
                  data=ps_pb2.Tensor(dtype="float32", shape=[2],
                                                 data=np.ones(2, np.float32).tobytes()))
    fields.update(over)
    return worker_pb2.CollectiveChunk(**fields).SerializeToString()


BAD_CHUNKS = {
    "not a message": b"\xff\xff\xff",
    "short group id": _chunk(group=b"abc"),
    "integer data": _chunk(data=ps_pb2.Tensor(dtype="int64", shape=[1],
                                                           data=bytes(8))),
    "two dimensions": _chunk(data=ps_pb2.Tensor(dtype="float32", shape=[1, 2],
                                                             data=bytes(8))),
    "data of another size": _chunk(data=ps_pb2.Tensor(dtype="float32", shape=[3],
                                                                   data=bytes(8))),
    "no data": _chunk(data=None),
    "a receiver id of 3 bytes": _chunk(receiver=b"abc"),
    "no member id": _chunk(member=b""),
    # CollectiveChunk{group: 16 zero bytes, step: 2**32} (protobuf's parser would cut it to 0)
    "step past 32 bits": bytes([0x0A, 16, *bytes(16), 0x18, 0x80, 0x80, 0x80, 0x80, 0x10]),
}


@pytest.mark.parametrize("route", ["data port", "grpc"])
def test_malformed_chunks_are_refused_and_change_nothing(three, route):
    w = three.workers[0]
    with TaskChannel(w.address, role="worker", token=three.token, tls=three.tls,
                     shared_memory=False, data_port=route == "data port") as ch:
        for what, raw in BAD_CHUNKS.items():
            with pytest.raises(PSError) as info:
                ch.call(methods.COLLECTIVE, raw, 10)
            assert info.value.code == Code.INVALID_ARGUMENT, what
        # well formed, for a group with no member formed here: refused, nothing kept
        for_nobody = wire.encode_collective_chunk(bytes(range(16)), 5, 0, 1,
                                                  np.ones(3, np.float32), b"r" * 16, b"m" * 16)
        with pytest.raises(PSError) as info:
            ch.call(methods.COLLECTIVE, for_nobody, 10)
        assert info.value.code == Code.FAILED_PRECONDITION and "no member" in str(info.value)
        # a probe: answered (no member here), nothing kept
        probe = ch.call(methods.COLLECTIVE, wire.encode_collective_chunk(
            bytes(16), 0, 0, 1, None, b"", b"m" * 16))
        assert probe.member == b""
        assert _run(three, 0, inbox_bytes) == 0
        if route == "data port":
            assert ch.socket is not None and ch.socket.kind == routing.TCP


@pytest.mark.parametrize("route", ["data port", "grpc"])
def test_a_chunk_without_the_token_is_refused(three, route):
    w = three.workers[1]
    chunk = wire.joined(wire.encode_collective_chunk(bytes(16), 0, 0, 0, np.ones(2, np.float32)))
    before = _run(three, 1, inbox_bytes)
    for token in ("wrong", ""):
        with TaskChannel(w.address, role="worker", token=token, tls=three.tls,
                         shared_memory=False, data_port=route == "data port") as ch:
            with pytest.raises(PSError) as info:
                ch.call(methods.COLLECTIVE, chunk, 10)
            assert info.value.code in (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED), token
    assert _run(three, 1, inbox_bytes) == before


@pytest.mark.parametrize("route", ["data port", "grpc"])
def test_fuzzed_chunks_get_an_answer_never_internal_and_the_worker_goes_on(three, route):
    """Mutants of a valid chunk (fields perturbed, bytes flipped, cut,
    spliced, random): each is kept or refused with InvalidArgument, none
    gets INTERNAL or kills the worker, and an all-reduce works afterwards."""
    import random

    from test_fuzz import mutate

    rng = random.Random(36 + (route == "grpc"))
    templates = [worker_pb2.CollectiveChunk.FromString(wire.joined(wire.encode_collective_chunk(
        bytes(range(16)), op, step, sender, np.arange(k, dtype=dt), b"r" * 16, b"m" * 16, 9)))
        for op, step, sender, k, dt in ((0, 0, 1, 3, np.float32), (2**40, 5, 2, 0, np.float64),
                                        (7, 1, 0, 17, np.float16))] + [
        worker_pb2.CollectiveChunk.FromString(wire.joined(wire.encode_collective_chunk(
            bytes(range(16)), 0, 0, 1, None)))]
    codes = {}
    w = three.workers[2]
    with TaskChannel(w.address, role="worker", token=three.token, tls=three.tls,
                     shared_memory=False, data_port=route == "data port") as ch:
        for i in range(600):
            raw = mutate(rng, rng.choice(templates).SerializeToString(), worker_pb2.CollectiveChunk)
            try:
                ch.call(methods.COLLECTIVE, raw, 10)
                code = Code.OK
            except PSError as exc:
                code = exc.code
            codes[code] = codes.get(code, 0) + 1
    assert set(codes) <= {Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}, codes
    assert codes.get(Code.INVALID_ARGUMENT, 0) > 100, codes
    assert codes.get(Code.FAILED_PRECONDITION, 0) > 10, codes   # well formed, for nobody here
    assert _run(three, 2, inbox_bytes) == 0
    got = _on_all(three, member, 1000, "float32", True)
    np.testing.assert_array_equal(got[2][0], sum(_data(7, r, 1000, "float32", True)
                                                 for r in range(3)))


@pytest.mark.parametrize("route", ["data port", "grpc"])
def test_a_worker_without_a_token_takes_no_chunks(route):
    """A worker started with no token (and not --insecure-no-auth) runs no
    code and takes no chunks either: PermissionDenied saying what to set."""
    from psserver.process import start_task
    w = start_task("psworker", ["--port", "0"], env={"PSTRAIN_AUTH_TOKEN": ""})
    try:
        with TaskChannel(w.address, role="worker", token="", tls=False, shared_memory=False,
                         data_port=route == "data port") as ch:
            for chunk in (wire.encode_collective_chunk(bytes(16), 0, 0, 1, None, b"",
                                                       b"m" * 16),
                          wire.encode_collective_chunk(bytes(16), 0, 0, 1,
                                                       np.ones(2, np.float32), b"r" * 16,
                                                       b"m" * 16)):
                with pytest.raises(PSError) as info:
                    ch.call(methods.COLLECTIVE, chunk, 10)
                assert info.value.code == Code.PERMISSION_DENIED
                assert "PSTRAIN_AUTH_TOKEN" in str(info.value)
    finally:
        w.kill()
