"""Draining a parameter server that holds variable shards (coordinator/
variable_moves.py), on real processes: each shard moves whole, with its
optimizer slots, version and memory of applied update keys, while workers
train; nothing is lost or applied twice, descriptions made before the move
(and the workers) follow it, and saves, restores, recovery and a
coordinator made again find the shards where they are now."""
from __future__ import annotations

import pickle
import time

import numpy as np
import pytest

from coordinator import (
    CheckpointManager,
    ClusterCoordinator,
    FixedShardsPartitioner,
    IndexedSlices,
    LocalCluster,
    Lookup,
    ParameterServerStrategy,
    ShardedSource,
    placement,
    ps_pool,
    push_gradients,
    read_variables,
)
from coordinator.variable_moves import VariableMove

pytestmark = pytest.mark.timeout(240)

SGD1 = {"learning_rate": 1.0}
ADAM = {"learning_rate": 0.01}
EXAMPLES, BATCH = 4800, 16


@pytest.fixture(autouse=True)
def _no_moves_left():
    yield
    placement.forget()   # (this process's table: the next test's job moved nothing)


def _epoch(coord, step, *args):
    """``step(*args, it)`` for every batch of an epoch of an exactly-once
    sharded dataset of EXAMPLES ids, scheduled: (dataset, steps, values)."""
    ds = coord.create_sharded_dataset(ShardedSource.from_arrays(
        np.arange(EXAMPLES), shard_sizes=[EXAMPLES // 2] * 2), batch_size=BATCH)
    it, steps = iter(ds), EXAMPLES // BATCH
    return ds, steps, [coord.schedule(step, args=(*args, it)) for _ in range(steps)]


def counting_step(counter, twins, w, it):
    """Each example's counter row +1 (exactly once), each of two identical
    Adam variables a constant gradient, w (sharded) -1 per step."""
    ids = np.asarray(next(it), np.int64)
    got, *_ = read_variables([Lookup(counter, ids), *twins, w])
    push_gradients([(counter, IndexedSlices(-np.ones_like(got), ids)),
                    *[(t, np.full(t.shape, 0.5, np.float32)) for t in twins],
                    (w, np.ones(w.shape, np.float32))])
    return ids.tolist()


def _job(spec, servers: int):
    strategy = ParameterServerStrategy(spec)
    counter = strategy.create_embedding_table("counter", 1, initializer="zeros",
                                              optimizer="sgd", optimizer_params=SGD1)
    twins = [strategy.create_variable(f"twin{i}", shape=(64, 8), initializer="ones",
                                      optimizer="adam", optimizer_params=ADAM,
                                      partitioner=None) for i in range(servers)]
    w = strategy.create_variable("w", shape=(servers * 4, 2), optimizer="sgd",
                                 optimizer_params=SGD1,
                                 partitioner=FixedShardsPartitioner(servers))
    return strategy, counter, twins, w


def test_a_server_holding_variable_shards_is_drained_while_workers_train():
    """Issue 34: a third of a job's variable shards on the server drained at
    half the steps, two workers training throughout: no step fails, every
    example counted once, w one update a step, and an Adam variable that
    moved equals its twin that did not, bit for bit (value, slots, version),
    read through a description pickled before the move too."""
    with LocalCluster(num_ps=3, num_workers=2) as cluster:
        strategy, counter, twins, w = _job(cluster.spec, 3)
        leaving = twins[0].shards[0].address
        stays = [t for t in twins if t.shards[0].address != leaving]
        assert len(stays) == 2 and any(s.address == leaving for s in w.shards)
        before = pickle.dumps(twins[0])
        with ClusterCoordinator(strategy) as coord:
            ds, steps, done = _epoch(coord, counting_step, counter, twins, w)
            done[steps // 2].fetch()
            moves = coord.remove_parameter_server(leaving)
            queued, _ = coord.pending()
            coord.join(timeout=180)
            assert ds.wait_epoch(0, timeout=30)
            assert sorted(i for d in done for i in d.fetch()) == list(range(EXAMPLES))
        assert queued > 0   # (steps ran after the drain)
        assert leaving not in strategy.parameter_servers
        moved = [m for m in moves if hasattr(m, "shard")]
        assert sorted(m.shard for m in moved) == sorted(
            ["twin0"] + [s.name for s in w.shards if s.made_at == leaving])
        assert all(m.destination != leaving and m.bytes > 0 for m in moved)
        assert not ps_pool.client_for(leaving).list_variables()
        np.testing.assert_array_equal(counter.lookup(np.arange(EXAMPLES), admit=False),
                                      np.ones((EXAMPLES, 1), np.float32))
        np.testing.assert_array_equal(w.read(), np.full(w.shape, -steps, np.float32))
        want = stays[0].read()
        assert not np.array_equal(want, np.ones((64, 8), np.float32))
        for t in (twins[0], pickle.loads(before)):
            np.testing.assert_array_equal(t.read(), want)
            assert t.versions() == stays[0].versions() == [steps]
        # the slots moved too: one more identical update keeps them equal
        push_gradients([(t, np.full((64, 8), 0.5, np.float32)) for t in twins])
        np.testing.assert_array_equal(twins[0].read(), stays[0].read())


def _single(strategy, name: str, **kw):
    return strategy.create_variable(name, shape=(4, 2), initializer="zeros", optimizer="sgd",
                                    optimizer_params=SGD1, partitioner=None, **kw)


def test_an_update_applied_before_the_move_and_resent_after_it_is_applied_once():
    """The shard's memory of applied update keys moves with it: a step run
    again after the drain, with the same update key, is not applied twice."""
    from coordinator.calls import update_key_scope
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        v = _single(strategy, "v")
        ones = np.ones((4, 2), np.float32)
        with ClusterCoordinator(strategy) as coord:
            with update_key_scope(b"batch-3"):
                push_gradients([(v, ones)])
            source = v.shards[0].address
            coord.remove_parameter_server(source)
            assert v.shards[0].address != source and v.shards[0].made_at == source
            for _ in range(2):
                with update_key_scope(b"batch-3"):
                    push_gradients([(v, ones)])
            np.testing.assert_array_equal(v.read(), -ones)
            assert v.versions() == [1]
            push_gradients([(v, ones)])   # (a new key: applied)
            np.testing.assert_array_equal(v.read(), -2 * ones)


def test_saves_restores_recovery_and_a_coordinator_made_again_find_moved_shards(tmp_path):
    """After a drain: the destination killed is recovered from a checkpoint
    saved after the move, the moved shard with the others; a coordinator
    made again (reuse_existing) adopts each shard where it is now, values
    kept (not made again from its initializer), and restores that checkpoint."""
    from coordinator.cluster_spec import ClusterSpec
    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        vs = [_single(strategy, f"v{i}") for i in range(3)]
        ckpt = CheckpointManager(strategy, str(tmp_path / "ckpt"))
        with ClusterCoordinator(strategy, checkpoint_manager=ckpt,
                                ps_check_interval=0.1) as coord:
            for i, v in enumerate(vs):
                v.assign(np.full((4, 2), i + 1, np.float32))
            leaving = vs[0].shards[0].address
            coord.remove_parameter_server(leaving)
            dest = vs[0].shards[0].address
            assert dest != leaving and not ps_pool.client_for(leaving).list_variables()
            ckpt.save(step=1)
            vs[0].assign(np.full((4, 2), 9, np.float32))   # (lost with its server below)
            cluster.kill_ps(cluster.spec.cluster_spec().ps.index(dest))
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)
            coord.join(timeout=60)
            np.testing.assert_array_equal(vs[0].read(), np.full((4, 2), 1, np.float32))
        full = cluster.spec.cluster_spec()
        left = ClusterSpec(ps=[a for a in full.ps if a != leaving], worker=full.worker,
                           token=full.token, tls=full.tls)
        again = ParameterServerStrategy(left, reuse_existing=True)
        adopted = [_single(again, f"v{i}") for i in range(3)]
        for i, v in enumerate(adopted):
            assert v.shards[0].address == vs[i].shards[0].address
            np.testing.assert_array_equal(v.read(), np.full((4, 2), i + 1, np.float32))
        for v in adopted:
            v.assign(np.full((4, 2), 7, np.float32))
        assert CheckpointManager(again, str(tmp_path / "ckpt")).restore()["step"] == 1
        for i, v in enumerate(adopted):
            np.testing.assert_array_equal(v.read(), np.full((4, 2), i + 1, np.float32))


def test_a_coordinator_made_again_after_an_add_adopts_variables_where_they_were_made():
    """The round-robin over a spec that gained a server places a shard on
    another server than the one it was made on; a coordinator made again
    (reuse_existing) adopts it where it is (before, it made a new one from
    its initializer there: the trained values silently lost)."""
    from coordinator.cluster_spec import ClusterSpec
    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        full = cluster.spec.cluster_spec()
        first = ClusterSpec(ps=full.ps[:2], worker=full.worker, token=full.token, tls=full.tls)
        strategy = ParameterServerStrategy(first)
        vs = [_single(strategy, f"v{i}") for i in range(4)]   # (on ps0, ps1, ps0, ps1)
        with ClusterCoordinator(strategy) as coord:
            coord.add_parameter_server(full.ps[2])   # (v2 moves there: an even share)
            for i, v in enumerate(vs):
                v.assign(np.full((4, 2), i + 1, np.float32))
        assert [v.shards[0].address for v in vs] == [full.ps[0], full.ps[1], full.ps[2],
                                                     full.ps[1]]
        again = ParameterServerStrategy(full, reuse_existing=True)
        for i in range(4):   # (the round-robin over three would put v3 on ps0)
            v = _single(again, f"v{i}")
            assert v.shards[0].address == vs[i].shards[0].address
            np.testing.assert_array_equal(v.read(), np.full((4, 2), i + 1, np.float32))


def test_a_move_refused_or_failed_leaves_each_shard_whole_where_it_was(monkeypatch):
    """A destination holding a variable of the name refuses the move before
    anything moves; a destination that dies during the copy fails the move
    after its timeout with the shard whole on the source (primary, no
    backup link left), which still trains."""
    from coordinator import variable_moves
    with LocalCluster(num_ps=3, num_workers=1, restart=()) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        v = _single(strategy, "v")
        source = v.shards[0].address
        others = [a for a in strategy.parameter_servers if a != source]
        ones = np.ones((4, 2), np.float32)
        with ClusterCoordinator(strategy) as coord:
            push_gradients([(v, ones)])
            ps_pool.client_for(others[0]).create_variable("v", shape=(1,))   # (not ours)
            with pytest.raises(ValueError, match="holds a variable named 'v' already"):
                coord.remove_parameter_server(source)
            assert v.shards[0].address == source and source in strategy.parameter_servers
            assert ps_pool.client_for(others[0]).get_meta("v").shape == (1,)
            ps_pool.client_for(others[0]).delete_variable("v")
            # the destination killed: the copy never completes
            monkeypatch.setattr(variable_moves, "COPY_SECONDS", 2.0)
            cluster.ps[cluster.spec.cluster_spec().ps.index(others[0])].kill()
            with pytest.raises(Exception):
                coord.remove_parameter_server(source)
            meta = ps_pool.client_for(source).get_meta("v")
            assert v.shards[0].address == source and meta.backup is None
            assert meta.role == 0 and meta.version == 1
            push_gradients([(v, ones)])
            np.testing.assert_array_equal(v.read(), -2 * ones)


def test_a_server_asked_to_stop_while_it_holds_variables_is_drained_then_stops():
    """SIGTERM with ``--leave-timeout``: a following coordinator drains the
    server's variable shards (and table rows) at once; it stops by itself."""
    import signal
    with LocalCluster(num_ps=3, num_workers=1, ps_args=("--leave-timeout", "120"),
                      restart=()) as cluster:
        strategy, counter, twins, w = _job(cluster.spec, 3)
        keys = np.arange(3000, dtype=np.int64)
        counter.lookup(keys)
        with ClusterCoordinator(strategy, elastic_servers=True, membership_interval=0.2):
            for t in twins:
                t.assign(np.full((64, 8), 3, np.float32))
            want = counter.lookup(keys, admit=False)
            leaving = twins[1].shards[0].address
            task = cluster.ps[cluster.spec.cluster_spec().ps.index(leaving)]
            task.signal(signal.SIGTERM)
            assert task.proc.wait(timeout=120) == 0
            out = task.output()
            assert "leaving: drained" in out and "not drained" not in out, out[-3000:]
            assert leaving not in strategy.parameter_servers
            for t in twins:
                assert t.shards[0].address != leaving
                np.testing.assert_array_equal(t.read(), np.full((64, 8), 3, np.float32))
            np.testing.assert_array_equal(counter.lookup(keys, admit=False), want)


def test_a_worker_refuses_closures_whose_moved_shards_are_malformed():
    """ClosureRequest.moved: a real worker takes the coordinator's table of
    moved shards and refuses a malformed one before it runs anything."""
    import grpc

    from coordinator import serialization
    from protos.pstrain.v1 import worker_pb2
    from tests.integration.test_elastic_leave import a_worker
    with a_worker("moved-token") as (stub, md, req):
        req.moved.add(made_at="a:1", name="v/part_0", address="b:2")
        assert serialization.loads(stub.RunClosure(req, metadata=md, timeout=10).result,
                                   True) == 5
        for field, bad in (("made_at", ""), ("name", ""), ("address", ""),
                           ("address", "x" * 2000), ("name", "v\n0")):
            bad_req = worker_pb2.ClosureRequest()
            bad_req.CopyFrom(req)
            setattr(bad_req.moved[0], field, bad)
            with pytest.raises(grpc.RpcError) as info:
                stub.RunClosure(bad_req, metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, bad)
            assert "ClosureRequest.moved" in info.value.details()
        info = stub.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), metadata=md, timeout=10)
        assert info.closures_run == 1
        with pytest.raises(grpc.RpcError) as info:   # (the token, as for every call)
            stub.RunClosure(req, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_drain_refuses_a_restarted_destination_and_variables_it_does_not_know(tmp_path):
    """Review 21: a destination that restarted empty before the watch
    noticed would take the shard, and its recovery would then roll it back
    to the checkpoint: refused, nothing moved, and after the recovery the
    drain goes through with the newer value kept. A coordinator made again
    that has not declared every variable on the server refuses to drain it
    (they would stay on a server that may stop), and one declared after a
    drain is adopted where it is now, never on the drained server."""
    import time

    from psserver.errors import FailedPrecondition
    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        vs = [_single(strategy, f"v{i}") for i in range(4)]   # (ps0, ps1, ps2, ps0)
        ps = list(strategy.parameter_servers)
        assert [v.shards[0].address for v in vs] == ps + ps[:1]
        ckpt = CheckpointManager(strategy, str(tmp_path / "ckpt"))
        with ClusterCoordinator(strategy, checkpoint_manager=ckpt,
                                ps_check_interval=15.0) as coord:
            for i, v in enumerate(vs):
                v.assign(np.full((4, 2), i + 1, np.float32))
            ckpt.save(step=1)
            old = ps_pool.client_for(ps[1]).server_info().server_id
            cluster.kill_ps(1)   # (restarted by LocalCluster; the watch looks every 15 s)
            deadline = time.monotonic() + 60
            while True:
                try:
                    if ps_pool.client_for(ps[1]).server_info(timeout=1).server_id != old:
                        break
                except Exception:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.1)
            with pytest.raises(FailedPrecondition, match="restarted since the job knew it"):
                coord.remove_parameter_server(ps[0])
            assert [v.shards[0].address for v in vs] == ps + ps[:1]
            coord.cluster.recovery.report(ps[1])   # (as the watch's next look would)
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)
            coord.join(timeout=60)
            vs[0].assign(np.full((4, 2), 5, np.float32))
            coord.remove_parameter_server(ps[0])
            assert vs[0].shards[0].address == ps[1]
            np.testing.assert_array_equal(vs[0].read(), np.full((4, 2), 5, np.float32))
        # a coordinator made again over the servers left, which declares v1 only
        from coordinator.cluster_spec import ClusterSpec
        full = cluster.spec.cluster_spec()
        left = ClusterSpec(ps=ps[1:], worker=full.worker, token=full.token, tls=full.tls)
        again = ParameterServerStrategy(left, reuse_existing=True)
        _single(again, "v1")
        with ClusterCoordinator(again) as coord:
            with pytest.raises(ValueError, match=r"does not know \(v0\)"):   # (v3: on ps2)
                coord.remove_parameter_server(ps[1])
            assert ps_pool.client_for(ps[1]).get_meta("v0").version > 0
            a0, a2, a3 = (_single(again, n) for n in ("v0", "v2", "v3"))
            coord.remove_parameter_server(ps[1])
            assert {a0.shards[0].address, a3.shards[0].address} == {ps[2]}
            np.testing.assert_array_equal(a0.read(), np.full((4, 2), 5, np.float32))
            again.delete_variable(a3)
            b3 = _single(again, "v3")   # (made again: on a server of the job)
            assert b3.shards[0].address == ps[2] and not b3.read().any()


def test_a_backup_copy_an_earlier_move_left_on_the_destination_is_replaced():
    """A source copy whose delete failed after its move stays as a backup
    copy (it refuses every call); a later move of that shard back there
    replaces it rather than being refused."""
    from psserver.contract import ROLE_BACKUP
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        v = _single(strategy, "v")
        source = v.shards[0].address
        other = next(a for a in strategy.parameter_servers if a != source)
        ps_pool.client_for(other).create_variable("v", initial_value=np.zeros(1, np.float32),
                                                  role=ROLE_BACKUP, epoch=1)
        v.assign(np.full((4, 2), 6, np.float32))
        with ClusterCoordinator(strategy) as coord:
            coord.remove_parameter_server(source)
        assert v.shards[0].address == other
        meta = ps_pool.client_for(other).get_meta("v")
        assert meta.shape == (4, 2) and meta.role == 0 and meta.version == 1
        np.testing.assert_array_equal(v.read(), np.full((4, 2), 6, np.float32))


def twins_step(counter, twins, it):
    """Each example's counter row +1 (exactly once); every twin the same
    constant gradient (Adam): they stay bit-identical wherever they are."""
    ids = np.asarray(next(it), np.int64)
    got, *_ = read_variables([Lookup(counter, ids), *twins])
    push_gradients([(counter, IndexedSlices(-np.ones_like(got), ids)),
                    *[(t, np.full(t.shape, 0.5, np.float32)) for t in twins]])
    return ids.tolist()


def test_a_server_added_takes_variable_shards_and_gives_them_back_when_drained():
    """An add moves variable shards to the new server, whole, until it
    holds about an even share (here one of four equal Adam variables); the
    drain at half the steps moves it back; workers train throughout: no
    step fails, every example counted once, the four variables equal bit for
    bit (value, slots, version) at the end; /metrics counts both moves."""
    from coordinator import metrics

    def sample(name, labels=None):
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0
    done0 = sample("pstrain_coordinator_variable_moves_total", {"outcome": "done"})
    bytes0 = sample("pstrain_coordinator_variable_moved_bytes_total")
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        counter = strategy.create_embedding_table("counter", 1, initializer="zeros",
                                                  optimizer="sgd", optimizer_params=SGD1)
        twins = [strategy.create_variable(f"t{i}", shape=(16, 8), initializer="ones",
                                          optimizer="adam", optimizer_params=ADAM,
                                          partitioner=None) for i in range(4)]
        with ClusterCoordinator(strategy) as coord:
            ds, steps, done = _epoch(coord, twins_step, counter, twins)
            done[steps // 4].fetch()
            added = cluster.add_ps()
            moves = coord.add_parameter_server(added)
            taken = [m for m in moves if hasattr(m, "shard")]
            assert len(taken) == 1 and taken[0].destination == added
            assert [t.shards[0].address for t in twins].count(added) == 1
            assert [m.name for m in ps_pool.client_for(added).list_variables()] == \
                [taken[0].shard]
            done[steps // 2].fetch()
            back = [m for m in coord.remove_parameter_server(added) if hasattr(m, "shard")]
            assert [m.shard for m in back] == [taken[0].shard]
            coord.join(timeout=180)
            assert ds.wait_epoch(0, timeout=30)
            assert sorted(i for d in done for i in d.fetch()) == list(range(EXAMPLES))
        np.testing.assert_array_equal(counter.lookup(np.arange(EXAMPLES), admit=False),
                                      np.ones((EXAMPLES, 1), np.float32))
        assert all(t.shards[0].address != added for t in twins)
        assert sample("pstrain_coordinator_variable_moves_total", {"outcome": "done"}) == \
            done0 + 2
        assert sample("pstrain_coordinator_variable_moved_bytes_total") == \
            bytes0 + taken[0].bytes + back[0].bytes > bytes0
        values = [t.read() for t in twins]
        assert not np.array_equal(values[0], np.ones((16, 8), np.float32))
        for t, value in zip(twins, values):
            np.testing.assert_array_equal(value, values[0])
            assert t.versions() == [steps]


def test_with_replication_an_add_and_a_drain_keep_every_shard_on_two_servers():
    """replication=True (variables only): the added server takes backup
    copies (an even share), the drained one hands its primaries over and
    gives its copies to servers holding neither copy of their shard; two
    workers train throughout: every example once (the counter a variable
    here: an exactly-once sparse push), the Adam twins equal, every shard's
    two copies on two servers (neither the drained one), bit-identical at
    the same version."""
    from psserver.client import PSClient
    with LocalCluster(num_ps=3, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        counter = strategy.create_variable("counter", shape=(EXAMPLES, 1), initializer="zeros",
                                           optimizer="sgd", optimizer_params=SGD1,
                                           partitioner=FixedShardsPartitioner(3))
        twins = [strategy.create_variable(f"t{i}", shape=(16, 8), initializer="ones",
                                          optimizer="adam", optimizer_params=ADAM,
                                          partitioner=None) for i in range(3)]
        with ClusterCoordinator(strategy) as coord:
            ds, steps, done = _epoch(coord, replicated_step, counter, twins)
            done[steps // 4].fetch()
            added = cluster.add_ps()
            taken = [m for m in coord.add_parameter_server(added) if hasattr(m, "shard")]
            assert taken and all(m.shard.startswith("_backup/") for m in taken)
            done[steps // 2].fetch()
            leaving = strategy.parameter_servers[0]
            gone = [m for m in coord.remove_parameter_server(leaving) if hasattr(m, "shard")]
            assert gone and all(m.source == leaving for m in gone)
            coord.join(timeout=180)
            assert ds.wait_epoch(0, timeout=30)
            assert sorted(i for d in done for i in d.fetch()) == list(range(EXAMPLES))
        np.testing.assert_array_equal(counter.read(), np.ones((EXAMPLES, 1), np.float32))
        values = [t.read() for t in twins]
        for value in values:
            np.testing.assert_array_equal(value, values[0])
        for v in [counter, *twins]:
            for s, b in zip(v.shards, v.backups):
                assert s.address != b.address and leaving not in (s.address, b.address)
                with PSClient(s.address, token=cluster.token, tls=cluster.tls) as cs, \
                        PSClient(b.address, token=cluster.token, tls=cluster.tls) as cb:
                    vs, ver_s = cs.read(s.name, with_version=True)
                    vb, ver_b = cb.read(b.name, with_version=True)
                assert ver_s == ver_b and vs.tobytes() == vb.tobytes(), s.name
        assert not ps_pool.client_for(leaving).list_variables()


def replicated_step(counter, twins, it):
    """Each example's row of a variable +1 (exactly once: the batch's update
    key), every twin a constant gradient."""
    ids = np.asarray(next(it), np.int64)
    read_variables(twins)
    push_gradients([(counter, IndexedSlices(-np.ones((ids.size, 1), np.float32), ids)),
                    *[(t, np.full(t.shape, 0.5, np.float32)) for t in twins]])
    return ids.tolist()


def test_with_replication_a_drain_refused_or_failed_keeps_two_copies(monkeypatch):
    """Two servers: no server is left for a copy (refused, nothing changed).
    Three, the destination killed during the copy: the move fails after its
    timeout, and the shard still has two copies (the backup link back to the
    old copy, which holds every version), which train on."""
    from coordinator import variable_moves
    with LocalCluster(num_ps=2, num_workers=1, restart=()) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        v = _single(strategy, "v")
        with ClusterCoordinator(strategy) as coord:
            with pytest.raises(ValueError, match="no server is left"):
                coord.remove_parameter_server(strategy.parameter_servers[0])
            assert len(strategy.parameter_servers) == 2
            push_gradients([(v, np.ones((4, 2), np.float32))])
            np.testing.assert_array_equal(v.read(), -np.ones((4, 2), np.float32))
    with LocalCluster(num_ps=3, num_workers=1, restart=()) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        v = _single(strategy, "v")   # (primary on ps0, backup on ps1)
        ps = list(strategy.parameter_servers)
        assert (v.shards[0].address, v.backups[0].address) == (ps[0], ps[1])
        with ClusterCoordinator(strategy) as coord:
            push_gradients([(v, np.ones((4, 2), np.float32))])
            monkeypatch.setattr(variable_moves, "COPY_SECONDS", 2.0)
            cluster.ps[2].kill()   # (the only server holding neither copy)
            with pytest.raises(Exception):
                coord.remove_parameter_server(ps[0])
            metas = [ps_pool.client_for(ps[i]).get_meta(n)
                     for i, n in ((0, v.shards[0].name), (1, v.backups[0].name))]
            assert sorted(m.role for m in metas) == [0, 1]   # (one primary, one backup)
            primary = next(m for m in metas if m.role == 0)
            assert primary.backup is not None and primary.version == 1
            push_gradients([(v, np.ones((4, 2), np.float32))])
            np.testing.assert_array_equal(v.read(), -2 * np.ones((4, 2), np.float32))
            versions = [ps_pool.client_for(ps[i]).get_meta(n).version
                        for i, n in ((0, v.shards[0].name), (1, v.backups[0].name))]
            assert versions == [2, 2]


def test_with_replication_a_drain_waits_for_a_failed_over_shard_to_be_rebuilt():
    """Review 22: the backup's server cut off (SIGSTOP) and failed over, the
    primary acknowledging alone, then back before the rebuild: a drain of the
    primary's server would hand the role to the stale backup (acknowledged
    updates lost): refused, nothing moved, every update kept."""
    import os
    import signal

    from psserver.errors import FailedPrecondition
    with LocalCluster(num_ps=3, num_workers=1, restart=()) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        v = _single(strategy, "v")
        ps = list(strategy.parameter_servers)
        assert v.backups[0].address == ps[1]
        ones = np.ones((4, 2), np.float32)
        with ClusterCoordinator(strategy, ps_failover_after=1.0, ps_check_interval=60) as coord:
            push_gradients([(v, ones)])
            task = cluster.ps[1]
            os.kill(task.task_pid, signal.SIGSTOP)
            try:
                coord.cluster.recovery.report(ps[1])   # (as the watch or a failed step does)
                assert coord.cluster.recovery.wait_failed_over(ps[1], timeout=30)
                for _ in range(3):   # (acknowledged by the primary alone)
                    push_gradients([(v, ones)])
            finally:
                os.kill(task.task_pid, signal.SIGCONT)
            with pytest.raises(FailedPrecondition, match="not a primary and its backup now"):
                coord.remove_parameter_server(ps[0])
            np.testing.assert_array_equal(v.read(), -4 * ones)
            assert v.shards[0].address == ps[0] and ps[0] in strategy.parameter_servers


def _slow_second_replica(step):
    """``step`` with its replica 1 slower (the workload: a straggler), so that
    replica 0 of the next step has run when an add or a drain begins."""
    def run(x_global, y_global):
        from coordinator.replica import get_replica_context
        if get_replica_context().replica_id_in_sync_group == 1:
            time.sleep(0.05)
        return step(x_global, y_global)
    return run


def test_in_hybrid_mode_variables_move_between_whole_steps_and_train_as_one_process():
    """A hybrid step's dense gradients gather on a shard across the step's
    closures: the add and the drain wait for the other replicas of a step
    that started (before: variables did not move in hybrid mode). Every
    step's replicas read one version, and the dense variables end as one
    process training on the global batches."""
    from tests.integration.test_sync import STEPS, make_data, make_step, reference_training
    x, y = make_data(2)
    sgd = {"learning_rate": 0.05}
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="hybrid")
        w_var = strategy.create_variable("w", initial_value=np.zeros((5, 1), np.float32),
                                         optimizer="sgd", optimizer_params=sgd)
        b_var = strategy.create_variable("b", initial_value=np.zeros((1,), np.float32),
                                         optimizer="sgd", optimizer_params=sgd)
        for i in range(3):   # (more shards for the added server's share)
            _single(strategy, f"pad{i}")
        with ClusterCoordinator(strategy) as coord:
            step = _slow_second_replica(make_step(w_var, b_var))
            results = [coord.schedule(step, args=(x[t], y[t])) for t in range(STEPS)]
            results[4].fetch()
            added = coord.add_parameter_server(cluster.add_ps())
            results[9].fetch()
            drained = coord.remove_parameter_server(w_var.shards[0].address)
            coord.join()
            per_replica = [[r.fetch() for r in rv.replicas] for rv in results]
            w, b = read_variables([w_var, b_var])
            metas = w_var.meta() + b_var.meta()
    assert [m for m in added if isinstance(m, VariableMove)]
    assert w_var.shards[0].name in [m.shard for m in drained if isinstance(m, VariableMove)]
    w_ref, b_ref = reference_training("sgd", sgd, x, y)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b, b_ref, rtol=1e-5, atol=1e-7)
    for t, replicas in enumerate(per_replica):   # (no step split by a move)
        assert [r["step"] for r in replicas] == [t, t]
        assert all(r["versions"] == [[t], [t]] for r in replicas)
    assert all(m.version == STEPS and m.sync_steps == STEPS and not m.gathering
               for m in metas)


def test_with_replication_a_coordinator_made_again_adopts_copies_where_they_moved():
    """Review 22: after a drain re-homed a shard's copies, a coordinator made
    again (reuse_existing, replication) finds both copies where they are now
    and reads the trained value (before: a fresh pair from the initializer)."""
    from coordinator.cluster_spec import ClusterSpec
    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        v = _single(strategy, "v")
        ps = list(strategy.parameter_servers)
        with ClusterCoordinator(strategy) as coord:
            coord.remove_parameter_server(ps[0])
            v.assign(np.full((4, 2), 5, np.float32))
        full = cluster.spec.cluster_spec()
        left = ClusterSpec(ps=ps[1:], worker=full.worker, token=full.token, tls=full.tls)
        placement.forget()   # (a new coordinator process knows no moves)
        again = ParameterServerStrategy(left, reuse_existing=True, replication=True)
        w = _single(again, "v")
        assert {w.shards[0].address, w.backups[0].address} == set(ps[1:])
        np.testing.assert_array_equal(w.read(), np.full((4, 2), 5, np.float32))
        assert sorted(m.name for a in ps[1:] for m in ps_pool.client_for(a).list_variables()) \
            == ["_backup/v", "v"]


def test_a_destination_lost_right_after_it_was_promoted_leaves_the_shard_at_its_source():
    """The destination dies after PROMOTE answered, before the source's copy
    is deleted: the move is rolled back (the demoted source, which holds
    every version, promoted again), nothing lost, training goes on there."""
    from psserver.contract import PROMOTE
    with LocalCluster(num_ps=3, num_workers=1, restart=()) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        v = _single(strategy, "v")
        source = v.shards[0].address
        ones = np.ones((4, 2), np.float32)
        with ClusterCoordinator(strategy) as coord:
            push_gradients([(v, ones)])
            dests = [a for a in strategy.parameter_servers if a != source]
            clients = [ps_pool.client_for(a) for a in dests]
            tasks = [cluster.ps[cluster.spec.cluster_spec().ps.index(a)] for a in dests]

            def dying(client, task, real):
                def reconfigure(changes, timeout=120.0):
                    out = real(changes, timeout=timeout)
                    if any(action == PROMOTE for _, action, _, _ in changes):
                        task.kill()
                        task.proc.wait(timeout=30)
                    return out
                return reconfigure
            for c, t in zip(clients, tasks):
                c.reconfigure = dying(c, t, c.reconfigure)
            try:
                with pytest.raises(Exception):
                    coord.remove_parameter_server(source)
            finally:
                for c in clients:
                    del c.reconfigure
            meta = ps_pool.client_for(source).get_meta("v")
            assert v.shards[0].address == source and meta.role == 0 and meta.version == 1
            push_gradients([(v, ones)])
            np.testing.assert_array_equal(v.read(), -2 * ones)


def test_a_drain_whose_later_shard_is_refused_moves_nothing():
    """Review 23: every destination is asked before any shard moves, so a
    clash at the second shard's destination leaves the first where it was
    too ("nothing moved" is true)."""
    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        a, b, c, d = (_single(strategy, n) for n in "abcd")   # (ps0, ps1, ps2, ps0)
        ps = list(strategy.parameter_servers)
        assert [v.shards[0].address for v in (a, d)] == [ps[0]] * 2
        ps_pool.client_for(ps[2]).create_variable("d", shape=(1,))   # (d would go there)
        with ClusterCoordinator(strategy) as coord:
            with pytest.raises(ValueError, match="holds a variable named 'd' already; nothing"):
                coord.remove_parameter_server(ps[0])
        assert a.shards[0].address == d.shards[0].address == ps[0]
        assert sorted(m.name for m in ps_pool.client_for(ps[0]).list_variables()) == ["a", "d"]
