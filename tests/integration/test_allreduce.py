"""All-reduce mode (coordinator/mirrored.py) on real psworker processes:
mirrored variables trained by steps scheduled on every worker at once, the
gradients averaged by the ring among them, the optimizer on every worker.

What must hold: the training equals one process running the large batch
(the mean of the replicas' gradients, the same optimizer arithmetic), the
replicas are bit-identical on every worker after every step, and a replica
that differs from the others (a worker restarted) makes the step fail on
every worker with nothing applied."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
from coordinator.errors import StepFunctionError, WorkerCallError
from coordinator.step_calls import push_gradients, read_variables
from psserver.contract.optimizers import make_optimizer

pytestmark = pytest.mark.timeout(180)

IN, OUT, BATCH = 12, 3, 16


# -- run on the workers (imported there by name) -----------------------------------------
def batch(step: int, replica: int):
    """Replica ``replica``'s batch of ``step`` (the same on every process)."""
    rng = np.random.default_rng(1000 * step + replica)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = (x @ np.arange(IN * OUT, dtype=np.float32).reshape(IN, OUT) / 50).astype(np.float32)
    return x, y


def grads(w, b, x, y):
    """Gradients of the mean squared error of x @ w + b (and the loss)."""
    err = x @ w + b - y
    return (2 * x.T @ err / err.size).astype(np.float32), \
        (2 * err.sum(axis=0) / err.size).astype(np.float32), float((err ** 2).mean())


def make_step(w, b):
    def step():
        from coordinator import get_replica_context
        ctx = get_replica_context()
        x, y = batch(ctx.step, ctx.replica_id_in_sync_group)
        wv, bv = read_variables([w, b])
        gw, gb, loss = grads(wv, bv, x, y)
        push_gradients([(w, gw), (b, gb)])
        return loss
    return step


# -- the reference: one process, the large batch ------------------------------------------
def large_batch(w0, b0, replicas: int, steps: int, optimizer: str, params: dict):
    opt_w, opt_b = make_optimizer(optimizer, params), make_optimizer(optimizer, params)
    w, b = w0.copy(), b0.copy()
    sw, sb = opt_w.create_slots(w), opt_b.create_slots(b)
    for s in range(steps):
        gs = [grads(w, b, *batch(s, r))[:2] for r in range(replicas)]
        opt_w.apply_dense(w, sw, np.mean([g[0] for g in gs], axis=0, dtype=np.float32))
        opt_b.apply_dense(b, sb, np.mean([g[1] for g in gs], axis=0, dtype=np.float32))
    return w, b


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_ps=0, num_workers=3) as c:
        yield c


@pytest.mark.parametrize("optimizer,params", [("sgd", {"learning_rate": 0.05}),
                                              ("adam", {"learning_rate": 0.01})])
def test_training_equals_the_large_batch_and_replicas_are_identical(cluster, optimizer, params):
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce")
    assert strategy.num_replicas_in_sync == 3
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((IN, OUT)).astype(np.float32)
    b0 = np.zeros(OUT, np.float32)
    w = strategy.create_variable("w", initial_value=w0, optimizer=optimizer,
                                 optimizer_params=params)
    b = strategy.create_variable("b", initial_value=b0, optimizer=optimizer,
                                 optimizer_params=params)
    steps = 12
    with ClusterCoordinator(strategy) as coord:
        losses = [coord.schedule(make_step(w, b)) for _ in range(steps)]
        coord.join()
        first, last = losses[0].fetch(), losses[-1].fetch()
        per_worker = [coord.replica_values(worker=i, with_versions=True) for i in range(3)]
    want_w, want_b = large_batch(w0, b0, 3, steps, optimizer, params)
    values, versions = per_worker[0]
    assert versions == {"w": steps, "b": steps}
    np.testing.assert_allclose(values["w"], want_w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(values["b"], want_b, rtol=2e-5, atol=2e-6)
    assert not np.array_equal(values["w"], w0)
    for other, other_versions in per_worker[1:]:   # bit-identical replicas
        assert other_versions == versions
        for name in ("w", "b"):
            assert other[name].tobytes() == values[name].tobytes()
    assert last < first


def test_fp16_and_sum(cluster):
    """gradient_compression="fp16": the ring's chunks in float16, the
    replicas still identical; aggregation="sum": the sum, not the mean."""
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce", aggregation="sum",
                                       gradient_compression="fp16")
    w = strategy.create_variable("w", initial_value=np.zeros((IN, OUT), np.float32),
                                 optimizer="sgd", optimizer_params={"learning_rate": 0.01})
    b = strategy.create_variable("b", initial_value=np.zeros(OUT, np.float32),
                                 optimizer="sgd", optimizer_params={"learning_rate": 0.01})
    with ClusterCoordinator(strategy) as coord:
        coord.schedule(make_step(w, b))
        coord.join()
        got = [coord.replica_values(worker=i) for i in range(3)]
    gs = [grads(np.zeros((IN, OUT), np.float32), np.zeros(OUT, np.float32), *batch(0, r))[:2]
          for r in range(3)]
    want = -0.01 * np.sum([g[0] for g in gs], axis=0)
    np.testing.assert_allclose(got[0]["w"], want, rtol=2e-3, atol=1e-4)   # (float16 hops)
    assert got[1]["w"].tobytes() == got[0]["w"].tobytes() == got[2]["w"].tobytes()


def test_a_restarted_worker_is_refused_not_averaged(cluster):
    """A worker that restarts has its replicas afresh (version 0): the next
    step fails on every worker and nothing is applied anywhere."""
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce", step_timeout=20)
    w = strategy.create_variable("w", initial_value=np.ones((IN, OUT), np.float32),
                                 optimizer="sgd", optimizer_params={"learning_rate": 0.01})
    b = strategy.create_variable("b", initial_value=np.zeros(OUT, np.float32),
                                 optimizer="sgd", optimizer_params={"learning_rate": 0.01})
    with ClusterCoordinator(strategy) as coord:
        coord.schedule(make_step(w, b))
        coord.join()
        before = coord.replica_values(worker=0, with_versions=True)
        assert before[1] == {"w": 1, "b": 1}
    cluster.restart_worker(2)
    with ClusterCoordinator(strategy) as coord:
        step = coord.schedule(make_step(w, b))
        with pytest.raises((StepFunctionError, WorkerCallError)):
            coord.join()
        errors = [r._error for r in step.replicas]
        assert any(isinstance(e, StepFunctionError) and "disagree" in str(e) for e in errors), \
            errors
    with ClusterCoordinator(strategy) as coord:
        after = [coord.replica_values(worker=i, with_versions=True) for i in range(3)]
    assert after[0][1] == after[1][1] == {"w": 1, "b": 1}
    assert after[0][0]["w"].tobytes() == before[0]["w"].tobytes()
    assert after[2][1] == {"w": 0, "b": 0}   # the restarted one: its initial value, untouched
