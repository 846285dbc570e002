"""Replication (ParameterServerStrategy(replication=True)) on real clusters.

Chain replication (psserver/replication.py): copies bit-identical at every
acknowledged version, for every optimizer; restores rebuild the backups;
a lost server fails over without waiting, and comes back as it was.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from coordinator import (ClusterCoordinator, FixedShardsPartitioner, IndexedSlices,
                         LocalCluster, ParameterServerStrategy, get_replica_context,
                         push_gradients)
from coordinator.checkpoint import CheckpointManager
from psserver.client import PSClient

pytestmark = pytest.mark.timeout(180)

OPTIMIZERS = [("sgd", {"learning_rate": 0.1}), ("momentum", {"learning_rate": 0.1}),
              ("momentum", {"learning_rate": 0.1, "nesterov": 1.0}),
              ("adagrad", {"learning_rate": 0.1}), ("adam", {"learning_rate": 0.01})]


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
                         ids=["sgd", "momentum", "nesterov", "adagrad", "adam"])
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
            assert coord._recovery.wait_for_recoveries(1, timeout=60)
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
            assert coord._recovery.lost == {cluster.spec.ps[1]}
    np.testing.assert_array_equal(value, np.full((4, 2), 60, np.float32))
    assert [m.version for m in metas] == [60, 60]
    assert all(m.backup is None for m in metas)   # going on alone until it returns
