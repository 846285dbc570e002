"""Replication (ParameterServerStrategy(replication=True)) on real clusters.

Chain replication (psserver/core/replication.py): copies bit-identical at every
acknowledged version, for every optimizer; restores rebuild the backups;
a lost server fails over without waiting, and comes back as it was.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    IndexedSlices,
    LocalCluster,
    ParameterServerStrategy,
    get_replica_context,
    push_gradients,
)
from coordinator.checkpoint import CheckpointManager
from psserver.client import PSClient
from psserver.contract import (
    DEMOTE,
    DROP_BACKUP,
    PROMOTE,
    ROLE_BACKUP,
    ROLE_PRIMARY,
    SET_BACKUP,
    Peer,
)

pytestmark = pytest.mark.timeout(180)

OPTIMIZERS = [("sgd", {"learning_rate": 0.1}), ("momentum", {"learning_rate": 0.1}),
              ("momentum", {"learning_rate": 0.1, "nesterov": 1.0}),
              ("adagrad", {"learning_rate": 0.1}), ("adam", {"learning_rate": 0.01}),
              ("ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01})]


def _copies_equal(cluster, var) -> list[tuple[int, int, bool]]:
    """(primary version, backup version, bit-identical values) per shard,
    read straight from each copy."""
    out = []
    for s, b in zip(var.shards, var.backups):
        with PSClient(s.address, token=cluster.token, tls=cluster.tls) as cp, \
                PSClient(b.address, token=cluster.token, tls=cluster.tls) as cb:
            vp, verp = cp.read(s.name, with_version=True)
            vb, verb = cb.read(b.name, with_version=True)
        out.append((verp, verb, vp.tobytes() == vb.tobytes()))
    return out


def noisy_step(w, seed_base):
    """A dense and a row-wise gradient, different on every call."""
    def step(i):
        rng = np.random.default_rng(seed_base + i)
        push_gradients([(w, IndexedSlices(rng.normal(size=(6, 8)).astype(np.float32),
                                          rng.integers(0, 64, 6)))])
        push_gradients([(w, rng.normal(size=(64, 8)).astype(np.float32))])
        return os.getpid()
    return step


@pytest.mark.parametrize("optimizer,params", OPTIMIZERS,
                         ids=["sgd", "momentum", "nesterov", "adagrad", "adam", "ftrl"])
def test_backup_is_bit_identical_to_its_primary_under_concurrent_pushes(optimizer, params):
    """Three workers push at once: each copy applies the same updates in the
    same order, so primary and backup agree to the bit (slots included: the
    values after further steps depend on them)."""
    with LocalCluster(num_ps=2, num_workers=3) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = strategy.create_variable("w", shape=(64, 8), initializer="random_normal",
                                     optimizer=optimizer, optimizer_params=params)
        with ClusterCoordinator(strategy) as coord:
            step = noisy_step(w, 1000)
            pids = coord.fetch([coord.schedule(step, args=(i,)) for i in range(60)])
            coord.join()
        assert len(set(pids)) > 1   # really concurrent: several workers
        for primary, backup, same in _copies_equal(cluster, w):
            # 60 dense pushes, and a row-wise one for each step with ids in the shard
            assert primary == backup and 60 < primary <= 120 and same


def test_sync_mode_backup_is_bit_identical_to_its_primary():
    """Sync steps: the primary sums the replicas in arrival order; the backup
    applies the primary's combined gradient, not its own sum."""
    with LocalCluster(num_ps=2, num_workers=3) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="sync", num_replicas=3,
                                           replication=True,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = strategy.create_variable("w", shape=(64, 8), initializer="random_normal",
                                     optimizer="adam", optimizer_params={"learning_rate": 0.01})
        t = strategy.create_variable("t", shape=(64, 8), initializer="random_normal",
                                     optimizer="adagrad", optimizer_params={"learning_rate": 0.1})

        def step(i):
            rng = np.random.default_rng(5000 + i + 1000 * get_replica_context().replica_id_in_sync_group)
            push_gradients([(t, IndexedSlices(rng.normal(size=(6, 8)).astype(np.float32),
                                              rng.integers(0, 64, 6))),
                            (w, rng.normal(size=(64, 8)).astype(np.float32))])
        with ClusterCoordinator(strategy) as coord:
            coord.fetch([coord.schedule(step, args=(i,)) for i in range(20)])
            coord.join()
        for var in (w, t):
            for primary, backup, same in _copies_equal(cluster, var):
                assert primary == backup == 20 and same   # one update per step


def counter(strategy, name="c"):
    return strategy.create_variable(name, initial_value=np.zeros((4, 2), np.float32),
                                    optimizer="sgd", optimizer_params={"learning_rate": 1.0})


def add_one(c):
    def step():
        push_gradients([(c, -np.ones((4, 2), np.float32))])
    return step


def test_restore_rebuilds_every_replica(tmp_path):
    """Save at 50, restore into a new replicated cluster, 10 more updates, lose
    a server: every row is at 60 (the backups were restored too)."""
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True,
                                           variable_partitioner=FixedShardsPartitioner(2))
        c = counter(strategy)
        for _ in range(50):
            add_one(c)()
        CheckpointManager(strategy, str(tmp_path / "ckpt")).save(step=50)
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True,
                                           variable_partitioner=FixedShardsPartitioner(2))
        c = counter(strategy)
        CheckpointManager(strategy, str(tmp_path / "ckpt")).restore()
        for primary, backup, same in _copies_equal(cluster, c):
            assert primary == backup == 50 and same
        with ClusterCoordinator(strategy, ps_check_interval=0.2) as coord:
            coord.fetch([coord.schedule(add_one(c)) for _ in range(10)])
            cluster.kill_ps(0)   # its primary and its backup copy are gone
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)
            value = c.read()
    np.testing.assert_array_equal(value, np.full((4, 2), 60, np.float32))


def test_lost_server_fails_over_without_waiting_and_loses_nothing(tmp_path):
    """A parameter server killed and not restarted: its shards' backups are
    promoted and training completes on the survivor, every acknowledged
    update there exactly once."""
    with LocalCluster(num_ps=2, num_workers=2, restart=()) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True,
                                           variable_partitioner=FixedShardsPartitioner(2))
        c = counter(strategy)
        table = strategy.create_embedding_table("t", 2)
        table.lookup(np.arange(100))
        with ClusterCoordinator(strategy, ps_check_interval=0.2, ps_failover_after=1.0,
                                ps_recovery_timeout=5.0) as coord:
            step = add_one(c)
            done = [coord.schedule(step) for _ in range(30)]
            cluster.kill_ps(1)
            done += [coord.schedule(step) for _ in range(30)]
            coord.fetch(done)   # would raise if recovery had timed out (5 s)
            coord.join()
            value = c.read()
            metas = c.meta()
            assert coord.cluster.recovery.lost == {cluster.spec.ps[1]}
            # The job's clean-up follows the routes (issue 33 item 10: it sent the
            # deletes to the lost server and failed after the job had succeeded).
            table.lookup(np.arange(100))   # (its shards failed over too)
            strategy.delete_variable(c)
            strategy.delete_embedding_table(table)
            with PSClient(cluster.spec.ps[0], token=cluster.token, tls=cluster.tls) as alive:
                assert alive.list_variables() == [] and alive.list_tables() == []
    np.testing.assert_array_equal(value, np.full((4, 2), 60, np.float32))
    assert [m.version for m in metas] == [60, 60]
    assert all(m.backup is None for m in metas)   # going on alone until it returns


TOKEN = "replication-secret"


def test_replication_calls_validate_what_they_receive_and_change_nothing(start_ps):
    """Replicate, Reconfigure and CreateVariable's replication fields: bad input
    is refused with the right code, nothing changes, and a caller without the
    token is refused before anything is read."""
    import grpc

    from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
    from psserver.contract import call_metadata
    from psserver.core import replication as R
    from psserver.errors import InvalidArgument, NotFound, NotPrimary, Unauthenticated
    from psserver.link import tensor_proto as TP

    env = {"PSTRAIN_AUTH_TOKEN": TOKEN}
    a, b = start_ps(env=env), start_ps(env=env)
    with PSClient(a.address, token=TOKEN) as ca, PSClient(b.address, token=TOKEN) as cb:
        ca.create_variable("w", (4, 2), backup=Peer(b.address, "_w"))
        ca.push_many([("w", np.ones((4, 2), np.float32), 1)])

        def state():
            return (ca.get_meta("w"), cb.get_meta("_w"),
                    ca.read("w").tobytes(), cb.read("_w").tobytes())
        before = state()

        def record(**kw):
            r = R.Record("_w", 0, 2, 0, 0, R.DENSE, np.ones((4, 2), np.float32))
            return dataclasses.replace(r, **kw)
        for bad in (record(tensor=np.ones((3, 2), np.float32)), record(kind=9),
                    record(tensor=np.ones((4, 2), np.int32)), record(version=-1),
                    record(kind=R.SPARSE, ids=np.array([7]), tensor=np.ones((1, 2), np.float32))):
            with pytest.raises(InvalidArgument):
                cb.replicate([bad])
        with pytest.raises(InvalidArgument, match="unknown replica change"):
            ca.reconfigure([("w", 9, 5, None)])
        with pytest.raises(InvalidArgument, match="needs the backup"):
            ca.reconfigure([("w", SET_BACKUP, 5, None)])
        with pytest.raises(NotPrimary, match="stale"):
            cb.reconfigure([("_w", PROMOTE, 0, None)])   # not above its epoch
        with pytest.raises(NotFound):
            ca.reconfigure([("nope", DROP_BACKUP, 1, None)])
        with pytest.raises(InvalidArgument, match="replica role"):
            ca.create_variable("x", (2,), role=7)
        with pytest.raises(InvalidArgument, match="address"):
            ca.create_variable("x", (2,), backup=Peer("", "_x"))
        with pytest.raises(InvalidArgument, match="primary's state"):
            ca.create_variable("x", (2,), role=ROLE_BACKUP)   # a backup needs a state
        # A stale primary's state copy does not overwrite a newer copy.
        cb.reconfigure([("_w", PROMOTE, 3, None)])
        with pytest.raises(NotPrimary, match="superseded"):
            cb.create_variable("_w", (4, 2), initial_value=np.zeros((4, 2), np.float32),
                               role=ROLE_BACKUP, epoch=1, overwrite=True)
        assert cb.get_meta("_w").version == before[1].version
        assert cb.read("_w").tobytes() == before[3]
        cb.reconfigure([("_w", DEMOTE, 4, None)])   # back to a backup, as it was
        assert state()[2:] == before[2:]
        assert [m.version for m in state()[:2]] == [before[0].version, before[1].version]

        # No token: refused before anything is parsed or changed.
        channel = grpc.insecure_channel(b.address)
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        req = ps_pb2.ReplicateRequest()
        r = req.records.add(name="_w", epoch=4, version=2)
        TP.fill(r.tensor, np.full((4, 2), 100, np.float32))
        for call, msg in ((stub.Replicate, req),
                          (stub.Reconfigure, ps_pb2.ReconfigureRequest(changes=[
                              ps_pb2.ReplicaChange(name="_w", epoch=9, action=PROMOTE)]))):
            with pytest.raises(grpc.RpcError) as caught:
                call(msg, metadata=call_metadata(None), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
        assert cb.get_meta("_w").role == ROLE_BACKUP and cb.read("_w").tobytes() == before[3]
        with PSClient(b.address, token="wrong") as intruder, pytest.raises(Unauthenticated):
            intruder.replicate([record()])


def test_partitioned_primary_is_fenced_and_nothing_acknowledged_is_lost():
    """ps0 cut off from the coordinator and the cluster's gRPC (its data port
    still answers workers: an asymmetric partition). Its shards fail over to
    ps1; its own copy, still alive, is fenced (its records refused), so no
    update is acknowledged by it alone. When the link returns, ps0 gets its
    copies back and its primaries are handed back: the layout is as created."""
    from proxy import CuttableProxy, spec_through

    from coordinator import ps_pool

    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        proxy = CuttableProxy(cluster.ps[0].address)
        try:
            spec = spec_through(cluster, proxy)
            strategy = ParameterServerStrategy(spec, replication=True,
                                               variable_partitioner=FixedShardsPartitioner(2))
            c = counter(strategy)
            with ClusterCoordinator(strategy, ps_check_interval=0.2,
                                    ps_failover_after=1.0) as coord:
                step = add_one(c)
                done = [coord.schedule(step) for _ in range(20)]
                coord.fetch(done)
                proxy.cut()
                # (Workers on this host still reach ps0 over its local socket: only
                # the coordinator and gRPC are cut off, so ps0's copy lives on.)
                assert coord.cluster.recovery.wait_failed_over(proxy.address, timeout=60)
                done += [coord.schedule(step) for _ in range(30)]
                coord.fetch(done)   # ps0's copy is fenced: its updates move to ps1
                proxy.restore()
                assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)
                done += [coord.schedule(step) for _ in range(10)]
                coord.fetch(done)
                coord.join()
                value = c.read()
            with PSClient(proxy.address, token=cluster.token, tls=cluster.tls) as c0, \
                    PSClient(spec.ps[1], token=cluster.token, tls=cluster.tls) as c1:
                created = [c0.get_meta(c.shards[0].name), c1.get_meta(c.shards[1].name)]
            roles = [(m.role, m.version, m.backup.name) for m in created]
            flipped = [ps_pool.servers().routes.route(c, k).flipped for k in range(2)]
            copies = _copies_equal(cluster, c)
        finally:
            proxy.close()
    np.testing.assert_array_equal(value, np.full((4, 2), 60, np.float32))
    assert roles == [(ROLE_PRIMARY, 60, "_backup/c/part_0"),
                     (ROLE_PRIMARY, 60, "_backup/c/part_1")]   # the layout as created
    assert flipped == [False, False]
    assert all(p == b == 60 and same for p, b, same in copies)
