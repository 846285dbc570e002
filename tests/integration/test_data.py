"""Sharded datasets: dispatch, visitation, update keys; on real clusters,
uneven shards, a slow worker and a worker SIGKILLed mid-epoch."""
from __future__ import annotations

import collections
import functools
import heapq
import os
import signal
import time

import grpc
import numpy as np
import pytest

from coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    IndexedSlices,
    LocalCluster,
    ParameterServerStrategy,
    ShardedSource,
    StepFunctionError,
    calls,
    datasets,
    fit,
    push_gradients,
    serialization,
    sharded,
    sources,
)
from coordinator.sharded import _Dispatch
from coordinator.sources import Batch
from protos.pstrain.v1 import worker_pb2, worker_pb2_grpc
from psserver.errors import FailedPrecondition, InvalidArgument
from psserver.process import start_task
from psserver.tls import make_channel

pytestmark = pytest.mark.timeout(180)

SIZES = [40, 100, 200]   # uneven shards, 1:5
BATCH = 8


# -- dispatch, as pure logic ----------------------------------------------------------------
def simulate(sizes, batch, seconds: dict[str, float]):
    """Workers taking closures as they become free (one batch each, a
    closure per batch of one epoch), on a simulated clock: (time the epoch
    ended, {worker: [batches]}, the dispatch)."""
    now = [0.0]
    d = _Dispatch(sizes, batch, False, clock=lambda: now[0])
    free = [(0.0, i, w) for i, w in enumerate(seconds)]
    running, left, took = {}, d.batches_per_epoch, collections.defaultdict(list)
    while free:
        t, i, w = heapq.heappop(free)
        now[0] = t
        if w in running:
            d.ack(running.pop(w))
        if left:
            b = d.take(w)
            left -= 1
            running[w] = b
            took[w].append(b)
            heapq.heappush(free, (t + seconds[w] * b.count / batch, i, w))
    return now[0], took, d


def test_late_binding_gives_every_batch_once_and_balances_uneven_shards_and_speeds():
    seconds = {"fast0": 1.0, "fast1": 1.0, "slow": 3.0}
    end, took, d = simulate(SIZES, BATCH, seconds)
    got = [(b.shard, b.start) for bs in took.values() for b in bs]
    want = [(s, i) for s, n in enumerate(SIZES) for i in range(0, n, BATCH)]
    assert sorted(got) == sorted(want)                         # each batch once
    assert sum(b.count for bs in took.values() for b in bs) == sum(SIZES)
    assert d.completed() == 1 and d.stats().positions == tuple(SIZES)
    # Close to the ideal: the work over the summed speeds, plus one slow batch.
    work = sum(SIZES) / BATCH
    ideal = work / sum(1 / s for s in seconds.values())
    assert end <= ideal + 3.0, (end, ideal)
    # Each worker first as fixed shards would have it (the slow one on the
    # largest): the largest shard alone takes the slow worker 75 s.
    assert end < SIZES[2] / BATCH * 3.0 / 2
    # Locality: a worker reads runs of consecutive batches of one shard.
    jumps = sum(1 for bs in took.values() for a, b in zip(bs, bs[1:])
                if (b.shard, b.start) != (a.shard, a.start + BATCH))
    assert jumps <= 12, jumps
    assert len(took["slow"]) < len(took["fast0"])


def test_given_back_and_taken_again_batches_are_reruns_of_the_same_batch():
    d = _Dispatch([10, 5], 4, False)
    assert d.batches_per_epoch == 5                          # 4+4+2, 4+1
    a = d.take("w0")
    d.release(a)                                             # its closure failed
    again = d.take("w1")
    assert again == a and d.reruns == 1
    d.again(again, "w2")                                     # re-queued with its closure
    assert d.reruns == 2
    rest = [d.take("w1") for _ in range(4)]
    assert sorted((b.shard, b.start, b.count) for b in [again, *rest]) == \
        [(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 4), (1, 4, 1)]
    for b in rest:
        d.ack(b)
    assert d.completed() == 0 and d.stats().in_flight == 1
    nxt = d.take("w0")                                       # all handed out: the next epoch
    assert nxt.epoch == 1
    d.ack(again)
    d.ack(again)                                             # a second ack changes nothing
    assert d.completed() == 1 and d.acknowledged == 5
    assert d.wait_epoch(0, 0) and not d.wait_epoch(1, 0)


def test_drop_remainder_and_bad_sizes():
    assert _Dispatch([10, 5], 4, True).batches_per_epoch == 3
    with pytest.raises(ValueError, match="lower batch_size"):
        _Dispatch([3, 2], 4, True)
    for bad in ([], [0, 0], [-1, 4], [2.5]):
        with pytest.raises(ValueError, match="shard_sizes"):
            ShardedSource(bad)


# -- update keys ------------------------------------------------------------------------------
def test_update_keys_are_derived_from_the_batch_inside_a_scope_and_random_outside():
    def keys(seed):
        with calls.update_key_scope(seed):
            return [calls.new_update_id("w#0"), calls.new_update_id("w#1"),
                    calls.new_update_id("w#0")]
    a, b = keys(b"ds/0/1/16"), keys(b"ds/0/1/16")
    assert a == b and len(set(a)) == 3 and all(0 < k < 2**63 for k in a)
    assert not set(a) & set(keys(b"ds/0/1/24")) and not set(a) & set(keys(b"ds/1/1/16"))
    with calls.update_key_scope(b"x"):
        with calls.update_key_scope(None):                   # a step without one: random
            r = {calls.new_update_id("w#0") for _ in range(3)}
        assert calls.new_update_id("w#0") == keys(b"x")[0]   # the outer scope is back
    assert len(r) == 3 and calls.new_update_id("w#0") != calls.new_update_id("w#0")


def test_batch_scope_binds_batches_and_keys_on_the_worker_side():
    src = ShardedSource.from_arrays(np.arange(30), shard_sizes=[10, 20], shuffle=False)
    datasets.register_dataset("dsX", src)
    a = worker_pb2.BatchAssignment(dataset_id="dsX", epoch=2, shard=1, start=5, count=3,
                                   exactly_once=True)
    it = sources._bound_iterator("dsX")
    with sources.batch_scope([a]):
        assert list(next(it)) == [15, 16, 17]
        with pytest.raises(RuntimeError, match="twice"):
            next(it)
        first = calls.new_update_id("v#0")
        assert sources.current_batch() == Batch(2, 1, 5, 3)
    with sources.batch_scope([a]):
        assert calls.new_update_id("v#0") == first
    at_least = worker_pb2.BatchAssignment(dataset_id="dsX", epoch=2, shard=1, start=5, count=3)
    with sources.batch_scope([at_least]):
        assert calls.new_update_id("v#0") != first
    with pytest.raises(LookupError, match="argument of schedule"):
        next(it)


def test_malformed_batch_assignments_are_refused_with_what_to_do():
    datasets.register_dataset("dsY", ShardedSource.from_arrays(np.arange(6), num_shards=2))
    datasets.register_dataset("pw", [1, 2, 3])
    A = worker_pb2.BatchAssignment
    sources.check_assignments([A(dataset_id="dsY", shard=1, start=0, count=3)])
    cases = [([A(dataset_id="nope", shard=0, count=1)], FailedPrecondition, "not created"),
             ([A(dataset_id="pw", shard=0, count=1)], InvalidArgument, "per-worker"),
             ([A(dataset_id="dsY", shard=2, count=1)], InvalidArgument, "shard 2 does not"),
             ([A(dataset_id="dsY", shard=0, start=2, count=2)], InvalidArgument, r"\[2, 4\)"),
             ([A(dataset_id="dsY", shard=0, count=0)], InvalidArgument, "count must be"),
             ([A(dataset_id="dsY", shard=0, count=1)] * 2, InvalidArgument, "two batches")]
    for assignments, error, words in cases:
        with pytest.raises(error, match=words):
            sources.check_assignments(assignments)


# -- sources ------------------------------------------------------------------------------
def test_array_source_shards_and_shuffles_each_epoch_the_same_on_every_worker():
    x = np.arange(12) * 10
    src = ShardedSource.from_arrays(x, np.arange(12), shard_sizes=[4, 8], seed=3)
    assert src.offsets == (0, 4) and ShardedSource.from_arrays(x, num_shards=5).shard_sizes == \
        (3, 3, 2, 2, 2)

    def epoch_of(e, s=src):
        a = worker_pb2.BatchAssignment(dataset_id="z", epoch=e, shard=1, start=0, count=8)
        datasets.register_dataset("z", s)
        with sources.batch_scope([a]):
            return next(sources._bound_iterator("z"))
    xs, ids = epoch_of(0)
    assert sorted(ids) == list(range(4, 12)) and (xs == ids * 10).all()
    assert (epoch_of(0, serialization.loads(serialization.dumps(src), True))[1] == ids).all()
    assert not (epoch_of(1)[1] == ids).all()
    for bad, words in (({"shard_sizes": [4, 4]}, "sum to 8"), ({}, "one of them"),
                       ({"num_shards": 13}, "num_shards"), ({"num_shards": 2.0}, "num_shards"),
                       ({"num_shards": True}, "num_shards"),
                       # refused here: every worker's read used to fail instead
                       ({"num_shards": 2, "seed": -1}, "seed"),
                       ({"num_shards": 2, "seed": 1.5}, "seed"),
                       ({"num_shards": 2, "seed": "1"}, "seed"),
                       ({"num_shards": 2, "shuffle": "no"}, "shuffle")):
        with pytest.raises(ValueError, match=words):
            ShardedSource.from_arrays(x, **bad)
    with pytest.raises(ValueError, match="aligned"):
        ShardedSource.from_arrays(x, np.arange(3), num_shards=2)
    big = ShardedSource.from_arrays(x, np.arange(12), num_shards=np.int64(2),
                                    seed=np.uint64(2**63))
    assert sorted(epoch_of(0, big)[1]) == list(range(6, 12))   # (a large seed reads)


def test_generator_source_goes_on_skips_ahead_and_restarts():
    made = []

    def gen(shard):
        made.append(shard)
        for i in range(10):
            yield (np.full(2, shard * 100 + i), i)
    src = ShardedSource.from_generator(gen, [10, 10])
    xs, ys = src.read(1, 0, 3)
    assert xs.shape == (3, 2) and list(ys) == [0, 1, 2]
    assert list(src.read(1, 3, 3)[1]) == [3, 4, 5] and made == [1]     # went on
    assert list(src.read(1, 8, 2)[1]) == [8, 9] and src.skipped == 2   # skipped 6, 7
    assert list(src.read(1, 1, 1)[1]) == [1] and made == [1, 1]        # behind: made again
    short = ShardedSource.from_generator(lambda s: iter(range(3)), [5])
    with pytest.raises(ValueError, match="ended before example 3"):
        short.read(0, 2, 3)


# -- real clusters --------------------------------------------------------------------------------
def _counter(strategy, name, n, shards=1):
    return strategy.create_variable(
        name, initial_value=np.zeros((n, 1), np.float32), optimizer="sgd",
        optimizer_params={"learning_rate": 1.0},
        partitioner=FixedShardsPartitioner(shards) if shards > 1 else "default")


def _slowed(cluster, factor=3.0, base=0.004):
    """Seconds of simulated compute per batch on each worker: worker 0 is
    ``factor`` times slower (the step sleeps them: the work it stands for)."""
    return {cluster.workers[0].pid: base * factor}, base


def test_an_epoch_visits_every_example_once_with_a_slow_worker_and_uneven_shards():
    n = sum(SIZES)
    with LocalCluster(num_ps=1, num_workers=3) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        seen = _counter(strategy, "seen", n, shards=2)
        delays, base = _slowed(cluster)

        def step(it):
            ids = next(it)
            time.sleep(delays.get(os.getpid(), base) * len(ids) / BATCH)
            push_gradients([(seen, IndexedSlices(-np.ones((len(ids), 1), np.float32), ids))])
            return ids

        def fit_step(it):
            step(it)
            return 0.0
        src = ShardedSource.from_arrays(np.arange(n), shard_sizes=SIZES)
        with ClusterCoordinator(strategy) as coord:
            with pytest.raises(TypeError, match="ShardedSource"):
                coord.create_sharded_dataset(np.arange(3), 4)
            with pytest.raises(ValueError, match="visitation"):
                coord.create_sharded_dataset(src, 4, visitation="twice")
            with pytest.raises(ValueError, match="batch_size"):
                coord.create_sharded_dataset(src, 0)
            with pytest.raises(ValueError, match="drop_remainder"):
                coord.create_sharded_dataset(src, 4, drop_remainder="no")
            ds = coord.create_sharded_dataset(src, BATCH)
            it = iter(ds)
            with pytest.raises(TypeError, match="on a worker"):
                next(it)
            rvs = [coord.schedule(step, args=(it,)) for _ in range(ds.batches_per_epoch)]
            coord.join()
            ids = np.concatenate(coord.fetch(rvs))
            assert collections.Counter(ids.tolist()) == collections.Counter(range(n))
            assert ds.epochs_completed == 1 and ds.stats().reruns == 0
            np.testing.assert_array_equal(seen.read(), np.ones((n, 1)))
            # fit: steps_per_epoch is the epoch's batches; its logs count reruns
            history = fit(coord, fit_step, ds, epochs=2, initial_epoch=1, verbose=0)
            assert history.history["rerun_batches"] == [0.0]
            assert len(history.steps) == ds.batches_per_epoch
            assert ds.epochs_completed == 2
            np.testing.assert_array_equal(seen.read(), np.full((n, 1), 2.0))
            for mode in ("sync", "hybrid"):   # a dead replica is abandoned there, not re-run
                with ClusterCoordinator(ParameterServerStrategy(cluster.spec,
                                                                mode=mode)) as other:
                    with pytest.raises(ValueError, match=f"not '{mode}'"):
                        other.create_sharded_dataset(src, BATCH)
            # a step that calls next() twice fails with a clear error
            bad = coord.schedule(lambda it: (next(it), next(it)), args=(it,))
            with pytest.raises(StepFunctionError, match="twice in one step"):
                coord.join()
            assert bad.status.name == "FAILED"


def kill_once(marker: str) -> bool:
    """True the first time any process gets here (a marker file decides)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


@pytest.mark.parametrize("visitation", ["exactly_once", "at_least_once"])
def test_a_worker_killed_mid_epoch_after_some_pushes(tmp_path, visitation):
    """The step pushes to ``before`` (a sharded variable) and to a dynamic
    table, SIGKILLs its own worker at one batch mid-epoch (once), then pushes
    to ``after``: counters of how often each example was applied (SGD, lr 1,
    gradient -1). Exactly once: every count is 1, on the servers. At least
    once: the batch re-run is counted, and exactly its examples were applied
    twice where the first run had pushed."""
    n = sum(SIZES)
    victim = SIZES[0] + SIZES[1] + SIZES[2] // 2          # mid-shard 2, mid-epoch
    marker = str(tmp_path / "killed")
    with LocalCluster(num_ps=2, num_workers=3) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        before, after = _counter(strategy, "before", n, 2), _counter(strategy, "after", n)
        table = strategy.create_embedding_table("seen", 1, initializer="zeros",
                                                optimizer_params={"learning_rate": 1.0})
        delays, base = _slowed(cluster)

        def step(it):
            ids = next(it)
            time.sleep(delays.get(os.getpid(), base))
            ones = -np.ones((len(ids), 1), np.float32)
            table.lookup(ids)                                  # makes their rows
            push_gradients([(before, IndexedSlices(ones, ids))])
            table.push_gradient(ids, ones)
            if victim in ids and kill_once(marker):
                os.kill(os.getpid(), signal.SIGKILL)
            push_gradients([(after, IndexedSlices(ones, ids))])
            return ids
        src = ShardedSource.from_arrays(np.arange(n), shard_sizes=SIZES, shuffle=False)
        with ClusterCoordinator(strategy) as coord:
            ds = coord.create_sharded_dataset(src, BATCH, visitation=visitation)
            it = iter(ds)
            rvs = [coord.schedule(step, args=(it,)) for _ in range(ds.batches_per_epoch)]
            coord.join()
            ids = np.concatenate(coord.fetch(rvs))
            assert ds.epochs_completed == 1
            stats = ds.stats()
            counts = [before.read()[:, 0], table.lookup(np.arange(n), admit=False)[:, 0],
                      after.read()[:, 0]]
    assert os.path.exists(marker) and cluster.workers[0] is not None
    assert collections.Counter(ids.tolist()) == collections.Counter(range(n))
    assert stats.reruns == 1 and stats.acknowledged == ds.batches_per_epoch
    (rerun,) = ds.rerun_batches
    offset = sum(SIZES[:rerun.shard])
    twice = np.arange(offset + rerun.start, offset + rerun.start + rerun.count)
    assert victim in twice
    np.testing.assert_array_equal(counts[2], np.ones(n))     # pushed after the kill: once
    for c in counts[:2]:                                     # pushed before it
        if visitation == "exactly_once":
            np.testing.assert_array_equal(c, np.ones(n))
        else:
            assert sorted(np.flatnonzero(c == 2)) == list(twice)
            assert c.sum() - n == stats.reruns * rerun.count    # the extra applications
            assert set(np.unique(c)) == {1.0, 2.0}


def test_a_worker_refuses_malformed_batches_over_grpc():
    """A real worker: batches of a dataset it does not have, of shards or
    examples its source lacks, are refused before anything runs."""
    token = "data-token"
    w = start_task("psworker", ["--port", "0"], env={"PSTRAIN_AUTH_TOKEN": token})
    try:
        stub = worker_pb2_grpc.WorkerStub(make_channel(w.address, [], None))
        md = (("authorization", f"Bearer {token}"),)
        src = ShardedSource.from_arrays(np.arange(6), shard_sizes=[2, 4])
        ref = serialization.encode_function(functools.partial(sharded.source_of, src))
        stub.CreateDataset(worker_pb2.CreateDatasetRequest(dataset_id="d", fn=ref),
                           metadata=md, timeout=10)
        A = worker_pb2.BatchAssignment
        good = worker_pb2.ClosureRequest(
            fn=worker_pb2.FunctionRef(qualified_name="operator:add"),
            args=serialization.dumps(((2, 3), {})), batches=[A(dataset_id="d", shard=1, count=4)])
        assert serialization.loads(stub.RunClosure(good, metadata=md, timeout=10).result,
                                   True) == 5
        for batch, code in ((A(dataset_id="x", shard=0, count=1),
                             grpc.StatusCode.FAILED_PRECONDITION),
                            (A(dataset_id="d", shard=9, count=1), grpc.StatusCode.INVALID_ARGUMENT),
                            (A(dataset_id="d", shard=0, start=1, count=2),
                             grpc.StatusCode.INVALID_ARGUMENT),
                            (A(dataset_id="d", shard=0, start=2**63, count=1),
                             grpc.StatusCode.INVALID_ARGUMENT)):
            req = worker_pb2.ClosureRequest()
            req.CopyFrom(good)
            del req.batches[:]
            req.batches.append(batch)
            with pytest.raises(grpc.RpcError) as info:
                stub.RunClosure(req, metadata=md, timeout=10)
            assert info.value.code() == code, info.value.details()
        info = stub.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), metadata=md, timeout=10)
        assert info.closures_run == 1
    finally:
        w.kill()
