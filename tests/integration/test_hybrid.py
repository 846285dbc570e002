"""Hybrid mode (ParameterServerStrategy(mode="hybrid")): dense variables
synchronous, embedding tables asynchronous, on real clusters.

Dense variables: one combined update per global step, equal to one process
training on the global batch (as tests/integration/test_sync.py checks sync mode).
Tables, fixed (IndexedSlices) and dynamic: each replica's row gradient is
applied on arrival, on its own (the optimizer runs once per push, not once
per step), including those of a replica whose dense gradients come too late.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from reference_optimizers import ReferenceOptimizer
from test_sync import (
    BATCH,
    N_FEATURES,
    STEPS,
    linear_grads,
    make_data,
    reference_training,
)

from coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    IndexedSlices,
    LocalCluster,
    ParameterServerStrategy,
)
from coordinator.replica import get_replica_context, replica_scope
from coordinator.step_calls import push_gradients, read_variables
from psserver.client import PSClient
from psserver.contract import SyncSpec
from psserver.contract.keys import BucketMap
from psserver.core.store import VariableStore
from psserver.errors import DeadlineExceeded

pytestmark = pytest.mark.timeout(180)

DIM = 3
ADAGRAD = {"learning_rate": 0.5}
ROWS = {0: [0, 1, 2], 1: [2, 3, 4]}              # fixed table rows; row 2 from both replicas
KEYS = {0: [100, 101, 102], 1: [102, 103, 104]}  # dynamic table keys; 102 from both


def row_grads(ids) -> np.ndarray:
    """The same gradient for a row from every replica, every step (so the
    order pushes arrive in does not matter): what differs between modes is
    how often the optimizer runs."""
    ids = np.asarray(ids)
    return np.repeat(0.1 * (ids % 7 + 1)[:, None], DIM, axis=1).astype(np.float32)


def adagrad_times(initial: np.ndarray, grad: np.ndarray, n: int) -> np.ndarray:
    ref = ReferenceOptimizer("adagrad", ADAGRAD, initial.astype(np.float32))
    for _ in range(n):
        ref.apply_dense(grad)
    return ref.value


def make_step(w_var, b_var, emb, dyn):
    def step(x_global, y_global):
        ctx = get_replica_context()
        r = ctx.replica_id_in_sync_group
        x, y = x_global[r * BATCH:(r + 1) * BATCH], y_global[r * BATCH:(r + 1) * BATCH]
        ids, keys = np.array(ROWS[r]), np.array(KEYS[r], np.int64)
        looking_up = dyn.lookup_async(keys)
        (w, b, _), versions = read_variables([w_var, b_var, emb.lookup(ids)],
                                             with_versions=True)
        looking_up.result()
        gw, gb = linear_grads(w, b, x, y)
        push_gradients([(w_var, gw.astype(np.float32)), (b_var, gb.astype(np.float32)),
                        (emb, IndexedSlices(row_grads(ids), ids))])
        dyn.push_gradient(keys, row_grads(keys))
        return {"step": ctx.step, "versions": versions[:2]}
    return step


def test_hybrid_dense_equals_the_large_batch_run_and_tables_take_each_push():
    x, y = make_data(2)
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="hybrid")
        assert strategy.num_replicas_in_sync == 2
        w_var = strategy.create_variable("w", initial_value=np.zeros((N_FEATURES, 1), np.float32),
                                         optimizer="adam", optimizer_params={"learning_rate": 0.01})
        b_var = strategy.create_variable("b", initial_value=np.zeros((1,), np.float32),
                                         optimizer="adam", optimizer_params={"learning_rate": 0.01})
        emb = strategy.create_variable("emb", initial_value=np.ones((6, DIM), np.float32),
                                       optimizer="adagrad", optimizer_params=ADAGRAD,
                                       partitioner=FixedShardsPartitioner(2))
        dyn = strategy.create_embedding_table("dyn", DIM, initializer="ones",
                                              optimizer="adagrad", optimizer_params=ADAGRAD)
        with ClusterCoordinator(strategy) as coord:
            step = make_step(w_var, b_var, emb, dyn)
            results = [coord.schedule(step, args=(x[t], y[t])) for t in range(STEPS)]
            coord.join()
            per_replica = [[r.fetch() for r in rv.replicas] for rv in results]
        w, b, emb_value = read_variables([w_var, b_var, emb])
        dense_metas = w_var.meta() + b_var.meta()
        emb_versions = emb.versions()
        keys = np.arange(100, 105)
        dyn_value = dyn.lookup(keys, admit=False)
        infos = [PSClient(a, token=cluster.token, tls=cluster.tls).table_info("dyn")
                 for a in dyn.addresses]

    # Dense: exactly sync mode's large-batch equality and step discipline.
    w_ref, b_ref = reference_training("adam", {"learning_rate": 0.01}, x, y)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b, b_ref, rtol=1e-5, atol=1e-7)
    for t, replicas in enumerate(per_replica):
        assert [r["step"] for r in replicas] == [t, t]
        assert all(r["versions"] == [[t], [t]] for r in replicas)
    assert all(m.version == STEPS and m.sync_steps == STEPS and m.dropped_gradients == 0
               for m in dense_metas)

    # Fixed table: every push applied once, on its own. Shard 0 (rows 0-2) takes
    # both replicas' pushes each step, shard 1 (rows 3-5) replica 1's.
    assert emb_versions == [2 * STEPS, STEPS]
    pushes = {0: STEPS, 1: STEPS, 2: 2 * STEPS, 3: STEPS, 4: STEPS, 5: 0}
    one = np.ones(DIM, np.float32)
    for row, n in pushes.items():
        np.testing.assert_allclose(emb_value[row], adagrad_times(one, row_grads([row])[0], n),
                                   rtol=1e-6)
    # ...not sync mode's one update of the replicas' mean per step:
    as_sync = adagrad_times(one, row_grads([2])[0], STEPS)
    assert np.abs(emb_value[2] - as_sync).min() > 0.1

    # Dynamic table: the same, key by key; no sync step on its shards.
    for i, key in enumerate(keys):
        n = 2 * STEPS if key == 102 else STEPS
        np.testing.assert_allclose(dyn_value[i], adagrad_times(one, row_grads([key])[0], n),
                                   rtol=1e-6)
    shards_hit = sum(len(set(BucketMap.even(2).shard_of(np.array(KEYS[r])).tolist())) for r in (0, 1))
    assert sum(i.step for i in infos) == STEPS * shards_hit   # one table step per push
    assert all(i.sync_steps == 0 and i.late == 0 for i in infos)


def test_a_late_replicas_rows_stay_applied_and_its_dense_gradient_is_dropped(tmp_path):
    """backup_workers=1: the step completes without the straggler; the row
    gradients it pushed before its dense ones were applied on arrival and
    stay; its dense gradients come late and are dropped and counted."""
    x, y = make_data(2)
    fifo = str(tmp_path / "release")
    os.mkfifo(fifo)
    with LocalCluster(num_ps=1, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="hybrid", backup_workers=1)
        w_var = strategy.create_variable("w", initial_value=np.zeros((N_FEATURES, 1), np.float32),
                                         optimizer="sgd", optimizer_params={"learning_rate": 0.05})
        emb = strategy.create_variable("emb", initial_value=np.ones((6, DIM), np.float32),
                                       optimizer="adagrad", optimizer_params=ADAGRAD)

        def step(x_global, y_global, release):
            r = get_replica_context().replica_id_in_sync_group
            ids = np.array(ROWS[r])
            (w,) = read_variables([w_var])
            push_gradients([(emb, IndexedSlices(row_grads(ids), ids))])
            if r == 1:
                with open(release) as f:   # the test lets it go once the step is done
                    f.read()
            gw, _ = linear_grads(w, 0.0, x_global[r * BATCH:(r + 1) * BATCH],
                                 y_global[r * BATCH:(r + 1) * BATCH])
            push_gradients([(w_var, gw.astype(np.float32))])
            return r
        with ClusterCoordinator(strategy) as coord:
            rv = coord.schedule(step, args=(x[0], y[0], fifo))
            assert rv.replicas[0].fetch(timeout=60) == 0      # done without replica 1
            assert w_var.versions() == [1]
            with open(fifo, "w") as f:   # returns once the straggler waits: its rows went
                assert emb.versions() == [2]
                f.write("go")
            coord.join()
        meta = w_var.meta()[0]
        emb_value = emb.read()
    assert (meta.version, meta.dropped_gradients) == (1, 1)
    one = np.ones(DIM, np.float32)
    np.testing.assert_allclose(emb_value[2], adagrad_times(one, row_grads([2])[0], 2), rtol=1e-6)
    np.testing.assert_allclose(emb_value[3], adagrad_times(one, row_grads([3])[0], 1), rtol=1e-6)


def test_a_variable_is_dense_or_a_table_not_both():
    """In hybrid steps (run here as a worker runs them, in replica_scope):
    row-wise gradients apply at once while the dense step waits for its
    other replica; table look-ups do not wait for it; a variable given the
    other kind of gradient than before is refused with nothing sent."""
    with LocalCluster(num_ps=1, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="hybrid", num_replicas=2)
        w = strategy.create_variable("w", initial_value=np.zeros((2, DIM), np.float32))
        emb = strategy.create_variable("emb", initial_value=np.ones((4, DIM), np.float32),
                                       optimizer="adagrad", optimizer_params=ADAGRAD)
        ids, g = np.array([1, 3]), np.ones((2, DIM), np.float32)
        with replica_scope(strategy.sync_spec(0, 0)):
            push_gradients([(w, g), (emb, IndexedSlices(g, ids))])
        assert (w.versions(), emb.versions()) == ([0], [1])   # rows applied, dense waiting
        with replica_scope(strategy.sync_spec(1, 0)):   # step 0 still pending on w
            (rows,) = read_variables([emb.lookup(ids)])
            np.testing.assert_array_equal(rows, emb.read()[ids])
            for pairs in ([(emb, g[:1].repeat(4, 0))], [(w, IndexedSlices(g, ids - 1))],
                          [(emb, IndexedSlices(g, ids)), (w, IndexedSlices(g, ids))]):
                with pytest.raises(ValueError, match="dense .* or an embedding table"):
                    push_gradients(pairs)
            with pytest.raises(ValueError, match="not both"):
                w.push_sparse(ids, g)
        assert (w.versions(), emb.versions()) == ([0], [1])   # nothing was sent
        with replica_scope(strategy.sync_spec(0, 1)):
            push_gradients([(w, g)])
        assert w.versions() == [1]


def test_dense_reads_wait_for_the_step_and_table_reads_do_not():
    """The rule the servers apply (psserver/core/sync.py): a read for step s waits
    while its variable gathers an earlier step; a table never gathers one in
    hybrid mode (its row gradients come without a step), so its look-ups
    and row pushes go through while the dense step is pending."""
    store = VariableStore()
    store.create("w", "float32", (2,))
    store.create("emb", "float32", (4, DIM), optimizer="adagrad", optimizer_params=ADAGRAD)
    store.steps.push([("w", np.ones(2, np.float32))], SyncSpec(0, 0, 2, 2, hybrid=True))
    with pytest.raises(DeadlineExceeded, match="step 0"):
        store.read_bytes("w", sync_step=1, deadline=time.monotonic() + 0.1)
    store.push(sparse=[("emb", np.array([1]), np.ones((1, DIM), np.float32), 7)])
    version, rows = store.gather("emb", np.array([1, 2]), sync_step=1,
                                 deadline=time.monotonic() + 0.1)
    assert version == 1 and rows[0, 0] != 0
    assert store.meta("w").version == 0


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_dense_step_applies_the_exact_mean_of_its_replicas(hybrid):
    """Issue 33 item 12(b): a wrong mean scale in hybrid mode (1/(n+1)) went
    unseen: the hybrid test's dense variables use Adam, which barely reacts
    to the gradient's scale. With SGD at learning rate 1 the value is minus
    the replicas' mean, to the bit, in hybrid and in sync mode alike."""
    store = VariableStore()
    store.create("w", "float32", (3,), optimizer="sgd", optimizer_params={"learning_rate": 1.0})
    grads = [np.array(g, np.float32) for g in ([1, 2, 3], [4, 5, 6], [7, 8, 10])]
    for r, g in enumerate(grads):
        store.steps.push([("w", g)], SyncSpec(0, r, 3, 3, hybrid=hybrid))
    mean = ((grads[0] + grads[1]) + grads[2]) * np.float32(1 / 3)
    np.testing.assert_array_equal(store.registry.variable("w").value, -mean)
