"""Synchronous (mirrored) training and bounded staleness, on real clusters."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from reference_optimizers import ReferenceOptimizer

from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
from coordinator.replica import get_replica_context
from coordinator.step_calls import push_gradients, read_variables
from psserver.contract import SyncSpec
from psserver.core.store import VariableStore
from psserver.errors import DeadlineExceeded

pytestmark = pytest.mark.timeout(180)

N_FEATURES, BATCH, STEPS = 5, 8, 20


def make_data(num_replicas: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(STEPS, num_replicas * BATCH, N_FEATURES)).astype(np.float32)
    w_true = rng.normal(size=(N_FEATURES, 1)).astype(np.float32)
    y = x @ w_true + 0.1 * rng.normal(size=(STEPS, num_replicas * BATCH, 1)).astype(np.float32)
    return x, y


def linear_grads(w, b, x, y):
    """Gradients of the mean squared error of x @ w + b (float32)."""
    err = x @ w + b - y
    return (2.0 / len(x)) * x.T @ err, (2.0 / len(x)) * err.sum(axis=0)


def make_step(w_var, b_var):
    def step(x_global, y_global):
        ctx = get_replica_context()
        lo = ctx.replica_id_in_sync_group * BATCH
        x, y = x_global[lo:lo + BATCH], y_global[lo:lo + BATCH]
        (w, b), versions = read_variables([w_var, b_var], with_versions=True)
        gw, gb = linear_grads(w, b, x, y)
        push_gradients([(w_var, gw.astype(np.float32)), (b_var, gb.astype(np.float32))])
        return {"step": ctx.step, "versions": versions, "pid": os.getpid()}
    return step


def reference_training(opt: str, params: dict, x, y):
    """One plain numpy process training on the global batches, mean loss."""
    w = ReferenceOptimizer(opt, params, np.zeros((N_FEATURES, 1), np.float32))
    b = ReferenceOptimizer(opt, params, np.zeros((1,), np.float32))
    for t in range(STEPS):
        gw, gb = linear_grads(w.value, b.value, x[t], y[t])
        w.apply_dense(gw.astype(np.float32))
        b.apply_dense(gb.astype(np.float32))
    return w.value, b.value


@pytest.mark.parametrize("opt, params", [("sgd", {"learning_rate": 0.05}),
                                         ("adam", {"learning_rate": 0.01})])
def test_sync_equals_one_process_on_the_global_batch(opt, params):
    num_replicas = 2
    x, y = make_data(num_replicas)
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="sync")
        assert strategy.num_replicas_in_sync == num_replicas
        w_var = strategy.create_variable("w", initial_value=np.zeros((N_FEATURES, 1), np.float32),
                                         optimizer=opt, optimizer_params=params)
        b_var = strategy.create_variable("b", initial_value=np.zeros((1,), np.float32),
                                         optimizer=opt, optimizer_params=params)
        with ClusterCoordinator(strategy) as coord:
            step = make_step(w_var, b_var)
            results = [coord.schedule(step, args=(x[t], y[t])) for t in range(STEPS)]
            coord.join()
            per_replica = [[r.fetch() for r in rv.replicas] for rv in results]
        w, b = read_variables([w_var, b_var])
        metas = w_var.meta() + b_var.meta()
    w_ref, b_ref = reference_training(opt, params, x, y)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b, b_ref, rtol=1e-5, atol=1e-7)
    # No step mixes versions: every replica of step t computed on version t.
    for t, replicas in enumerate(per_replica):
        assert len(replicas) == num_replicas
        for r in replicas:
            assert r["step"] == t and r["versions"] == [[t], [t]]
    assert all(m.version == STEPS and m.sync_steps == STEPS for m in metas)
    assert all(m.dropped_gradients == 0 for m in metas)


def make_crashing_step(w_var, b_var, crash_step: int, marker: str):
    inner = make_step(w_var, b_var)

    def step(x_global, y_global):
        ctx = get_replica_context()
        if ctx.step == crash_step and ctx.replica_id_in_sync_group == 1:
            try:   # only the first attempt at this replica crashes its worker
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())   # which worker crashes
                os.close(fd)
            except FileExistsError:
                return inner(x_global, y_global)
            (w, b) = read_variables([w_var, b_var])
            gw, gb = linear_grads(w, b, x_global[:BATCH], y_global[:BATCH])
            push_gradients([(w_var, gw.astype(np.float32))])   # half of its pushes...
            os.kill(os.getpid(), 9)                            # ...then SIGKILL mid-step
        return inner(x_global, y_global)
    return step


@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_sigkilled_replica_does_not_stop_the_job(tmp_path, mode):
    x, y = make_data(2)
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode=mode, step_timeout=0)
        w_var = strategy.create_variable("w", initial_value=np.zeros((N_FEATURES, 1), np.float32),
                                         optimizer="sgd", optimizer_params={"learning_rate": 0.05})
        b_var = strategy.create_variable("b", initial_value=np.zeros((1,), np.float32),
                                         optimizer="sgd", optimizer_params={"learning_rate": 0.05})
        with ClusterCoordinator(strategy) as coord:
            step = make_crashing_step(w_var, b_var, crash_step=5, marker=str(tmp_path / "crashed"))
            results = [coord.schedule(step, args=(x[t], y[t])) for t in range(STEPS)]
            coord.join()
            per_step = [[r.fetch() for r in rv.replicas] for rv in results]
        metas = w_var.meta() + b_var.meta()
        # The crashed worker's sockets close while it exits: wait for it.
        with open(tmp_path / "crashed") as f:
            crashed = int(f.read())
        (victim,) = [w for w in cluster.workers if w.pid == crashed]
        assert victim.proc.wait(timeout=30) == -9
        assert sum(not w.alive() for w in cluster.workers) == 1
    from coordinator.coordinator import ABANDONED
    abandoned = [(t, i) for t, reps in enumerate(per_step) for i, r in enumerate(reps)
                 if r is ABANDONED]
    assert abandoned == [(5, 1)]
    # The counter neither skipped nor repeated: each step's replicas read version t.
    for t, reps in enumerate(per_step):
        for r in reps:
            if r is not ABANDONED:
                assert r["step"] == t and r["versions"] == [[t], [t]]
    assert [m.version for m in metas] == [STEPS, STEPS]


def make_straggler_step(w_var, b_var, slow_replica: int):
    inner = make_step(w_var, b_var)

    def step(x_global, y_global, slow_fifo):
        ctx = get_replica_context()
        if ctx.replica_id_in_sync_group == slow_replica:
            with open(slow_fifo) as f:   # blocks until the test lets it go
                f.read()
        return inner(x_global, y_global)
    return step


def test_backup_workers_drop_the_straggler_and_count_it(tmp_path):
    x, y = make_data(3)
    fifo = str(tmp_path / "release")
    os.mkfifo(fifo)
    with LocalCluster(num_ps=1, num_workers=3) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="sync", num_replicas=3,
                                           backup_workers=1)
        w_var = strategy.create_variable("w", initial_value=np.zeros((N_FEATURES, 1), np.float32),
                                         optimizer="sgd", optimizer_params={"learning_rate": 0.05})
        b_var = strategy.create_variable("b", initial_value=np.zeros((1,), np.float32),
                                         optimizer="sgd", optimizer_params={"learning_rate": 0.05})
        with ClusterCoordinator(strategy) as coord:
            step = make_straggler_step(w_var, b_var, slow_replica=2)
            rv = coord.schedule(step, args=(x[0], y[0], fifo))
            fast = [r.fetch(timeout=60) for r in rv.replicas[:2]]   # step done without replica 2
            assert all(f["versions"] == [[0], [0]] for f in fast)
            assert [m.version for m in w_var.meta()] == [1]
            with open(fifo, "w") as f:   # now let the straggler push: too late
                f.write("go")
            coord.join()
        metas = w_var.meta() + b_var.meta()
    assert all(m.version == 1 for m in metas)
    assert all(m.dropped_gradients == 1 for m in metas)


def test_step_timeout_completes_a_step_whose_replica_hangs():
    store = VariableStore()
    store.create("v", "float32", (2,), optimizer="sgd", optimizer_params={"learning_rate": 1.0})
    spec0 = SyncSpec(step=0, replica=0, num_replicas=2, required=2, step_timeout=0.2)
    store.steps.push([("v", np.ones(2, np.float32))], spec0)
    # Replica 1 never pushes. A read for step 1 waits, then applies step 0 with replica 0 alone.
    version, value = store.snapshot("v", sync_step=1, deadline=time.monotonic() + 30)
    assert version == 1
    np.testing.assert_array_equal(value, [-1.0, -1.0])
    # Replica 1's gradient arriving now is late and dropped.
    assert store.steps.push([("v", np.ones(2, np.float32))],
                           SyncSpec(0, 1, 2, 2, step_timeout=0.2)) == [(1, True)]
    assert store.meta("v").dropped_gradients == 1


def test_sync_read_respects_the_call_deadline():
    store = VariableStore()
    store.create("v", "float32", (2,))
    store.steps.push([("v", np.ones(2, np.float32))], SyncSpec(0, 0, 2, 2))
    with pytest.raises(DeadlineExceeded, match="step 0"):
        store.read_bytes("v", sync_step=1, deadline=time.monotonic() + 0.1)
    assert store.meta("v").version == 0   # nothing applied by the failed wait


def test_sum_aggregation_and_linear_scaling():
    store = VariableStore()
    store.create("v", "float64", (1,), optimizer="sgd", optimizer_params={"learning_rate": 1.0})
    for r, g in enumerate((1.0, 3.0)):
        store.steps.push([("v", np.array([g]))], SyncSpec(0, r, 2, 2, sum=True))
    np.testing.assert_array_equal(store.snapshot("v")[1], [-4.0])
    with LocalCluster(num_ps=1, num_workers=0) as cluster:
        s = ParameterServerStrategy(cluster.spec, mode="sync", num_replicas=4)
        assert s.num_replicas_in_sync == 4 and s.scale_learning_rate(0.1) == pytest.approx(0.4)
        assert ParameterServerStrategy(cluster.spec).num_replicas_in_sync == 1
        with pytest.raises(ValueError, match="backup_workers"):
            ParameterServerStrategy(cluster.spec, mode="sync", num_replicas=2, backup_workers=2)
        with pytest.raises(ValueError, match="staleness"):
            ParameterServerStrategy(cluster.spec, mode="bounded")


# -- bounded staleness -----------------------------------------------------------------
def slow_on(pid_to_slow, seconds):
    if os.getpid() == pid_to_slow:
        time.sleep(seconds)   # the workload of a slow machine, not synchronisation
    return os.getpid()


def _run_bounded(staleness: int, steps: int = 60):
    with LocalCluster(num_ps=1, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="bounded", staleness=staleness)
        slow_pid = cluster.workers[0].pid
        with ClusterCoordinator(strategy) as coord:
            pids = coord.fetch([coord.schedule(slow_on, args=(slow_pid, 0.05))
                                for _ in range(steps)])
            stats = coord.staleness_stats()
    return stats, pids, slow_pid


@pytest.mark.parametrize("staleness", [0, 2])
def test_bounded_staleness_keeps_the_gap(staleness):
    stats, pids, slow_pid = _run_bounded(staleness)
    assert stats["max_gap"] <= staleness
    assert slow_pid in pids


def held_on(pid_to_hold, fifo):
    """The first closure the held worker runs blocks until the test writes to
    fifo (its later ones do not): a worker stuck as long as the test says.
    The other worker's closures wait until the held one has begun (they open
    the gate fifo for reading, which blocks until the held closure holds it
    open): otherwise the other worker could run every step before the held
    one took any."""
    if os.getpid() == pid_to_hold and not os.path.exists(fifo + ".released"):
        open(fifo + ".held", "w").close()
        gate = os.open(fifo + ".gate", os.O_RDWR)   # never blocks; lets the others through
        try:
            with open(fifo) as f:
                f.read()
        finally:
            os.close(gate)
    elif not os.path.exists(fifo + ".held"):
        os.close(os.open(fifo + ".gate", os.O_RDONLY))   # until the held closure began
    return os.getpid()


def test_large_staleness_behaves_as_async(tmp_path):
    """While one worker is stuck, the other runs every other step: with a
    bound far above the work, nothing waits for the slow one (as in async
    mode). Event-based: the stuck worker is released once the rest is done."""
    fifo = str(tmp_path / "release")
    os.mkfifo(fifo)
    os.mkfifo(fifo + ".gate")
    steps = 30
    with LocalCluster(num_ps=1, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="bounded", staleness=1000)
        held = cluster.workers[0].pid
        with ClusterCoordinator(strategy) as coord:
            rvs = [coord.schedule(held_on, args=(held, fifo)) for _ in range(steps)]
            assert coord.cluster.wait_for(   # checked as each step completes
                lambda: sum(r.done() for r in rvs) >= steps - 1, 120)
            open(fifo + ".released", "w").close()
            with open(fifo, "w") as f:
                f.write("go")
            pids = coord.fetch(rvs)
            stats = coord.staleness_stats()
    assert pids.count(held) == 1            # one step on the stuck worker...
    assert stats["max_gap"] >= steps - 2    # ...while the other ran all the rest ahead


# -- how a step combines its gradients (psserver/core/sync.py), each property where it is defined --
def _sgd(store, name="v", shape=(4, 2)):
    store.create(name, "float64", shape, optimizer="sgd", optimizer_params={"learning_rate": 1.0})


def test_sparse_gradients_of_several_replicas_are_averaged():
    """Rows from two replicas (one row twice): each row gets the mean of what
    the replicas sent for it, as a dense step would."""
    store = VariableStore()
    _sgd(store)
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    b = np.array([[5.0, 6.0], [7.0, 8.0]])
    store.steps.push_rows("v", np.array([0, 2]), a, SyncSpec(0, 0, 2, 2))
    store.steps.push_rows("v", np.array([2, 3]), b, SyncSpec(0, 1, 2, 2))
    want = np.zeros((4, 2))
    want[0] -= a[0] / 2
    want[2] -= (a[1] + b[0]) / 2
    want[3] -= b[1] / 2
    np.testing.assert_array_equal(store.snapshot("v")[1], want)


@pytest.mark.parametrize("sparse", [False, True])
def test_the_mean_is_over_the_replicas_that_pushed_not_the_configured_count(sparse):
    """Backup workers: 3 replicas, 2 required: the step's update is the mean
    of the 2 that came (not their sum over 3); an abandoned replica does not
    count either."""
    for abandon in (False, True):
        store = VariableStore()
        _sgd(store)
        ids, g = np.array([0, 1, 2, 3]), np.ones((4, 2))
        spec = [SyncSpec(0, r, 3, 3 if abandon else 2) for r in range(3)]
        if abandon:
            store.steps.abandon(0, 2)
        for r, scale in ((0, 1.0), (1, 3.0)):
            if sparse:
                store.steps.push_rows("v", ids, g * scale, spec[r])
            else:
                store.steps.push([("v", g * scale)], spec[r])
        version, value = store.snapshot("v")
        assert version == 1
        np.testing.assert_array_equal(value, -2.0 * np.ones((4, 2)))   # mean of 1 and 3


@pytest.mark.timeout(120)
def test_a_restarted_coordinator_numbers_its_steps_after_those_the_servers_applied():
    """Issue 33 item 11: a coordinator restarted in sync mode with
    reuse_existing numbered its steps from 0 again while the parameter
    servers had applied steps 0..2: every step it ran was late on every
    shard, its updates dropped. It now starts at the servers' step count,
    for variables and dynamic tables alike."""
    from coordinator import IndexedSlices, Lookup

    def job(cluster, steps, reuse):
        strategy = ParameterServerStrategy(cluster.spec, mode="sync", num_replicas=2,
                                           reuse_existing=reuse)
        w = strategy.create_variable("w", initial_value=np.zeros(3, np.float32),
                                     optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        t = strategy.create_embedding_table("t", 2, initializer="zeros", optimizer="sgd",
                                            optimizer_params={"learning_rate": 1.0})
        keys = np.array([7], np.int64)

        def step():
            rows, _ = read_variables([Lookup(t, keys), w])
            push_gradients([(w, np.ones(3, np.float32)),
                            (t, IndexedSlices(np.ones((1, 2), np.float32), keys))])
            return float(rows[0, 0])
        with ClusterCoordinator(strategy) as coord:
            coord.fetch([coord.schedule(step) for _ in range(steps)])
            coord.join()
        return w.read(), t.lookup(keys, admit=False)

    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        w, rows = job(cluster, 3, reuse=False)
        np.testing.assert_array_equal(w, np.full(3, -3.0, np.float32))
        np.testing.assert_array_equal(rows, np.full((1, 2), -3.0, np.float32))
        w, rows = job(cluster, 2, reuse=True)   # the restarted coordinator
        np.testing.assert_array_equal(w, np.full(3, -5.0, np.float32))
        np.testing.assert_array_equal(rows, np.full((1, 2), -5.0, np.float32))
