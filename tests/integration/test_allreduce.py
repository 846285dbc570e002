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

from coordinator import (
    ClusterCoordinator,
    LocalCluster,
    ParameterServerStrategy,
    ShardedSource,
)
from coordinator.closures import ABANDONED
from coordinator.errors import StepFunctionError, WorkerCallError
from coordinator.fit import fit
from coordinator.step_calls import push_gradients, read_variables
from psserver.contract.optimizers import make_optimizer
from psserver.errors import Unavailable

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


def _model(strategy, w0, b0, optimizer: str = "sgd", params: dict | None = None):
    """The model's variables w and b on ``strategy``, from w0 and b0."""
    return tuple(strategy.create_variable(n, initial_value=v, optimizer=optimizer,
                                          optimizer_params=params or {"learning_rate": 0.01})
                 for n, v in (("w", w0), ("b", b0)))


# -- the reference: one process, the large batch ------------------------------------------
def large_batch(w0, b0, replicas, steps: int, optimizer: str, params: dict):
    """``replicas``: per step (a list) or for every step (an int)."""
    opt_w, opt_b = make_optimizer(optimizer, params), make_optimizer(optimizer, params)
    w, b = w0.copy(), b0.copy()
    sw, sb = opt_w.create_slots(w), opt_b.create_slots(b)
    for s in range(steps):
        n = replicas[s] if isinstance(replicas, list) else replicas
        gs = [grads(w, b, *batch(s, r))[:2] for r in range(n)]
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
    w, b = _model(strategy, w0, b0, optimizer, params)
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
    w, b = _model(strategy, np.zeros((IN, OUT), np.float32), np.zeros(OUT, np.float32))
    with ClusterCoordinator(strategy) as coord:
        coord.schedule(make_step(w, b))
        coord.join()
        got = [coord.replica_values(worker=i) for i in range(3)]
    gs = [grads(np.zeros((IN, OUT), np.float32), np.zeros(OUT, np.float32), *batch(0, r))[:2]
          for r in range(3)]
    want = -0.01 * np.sum([g[0] for g in gs], axis=0)
    np.testing.assert_allclose(got[0]["w"], want, rtol=2e-3, atol=1e-4)   # (float16 hops)
    assert got[1]["w"].tobytes() == got[0]["w"].tobytes() == got[2]["w"].tobytes()


def test_a_restarted_worker_gets_the_model_and_its_initial_values_are_never_averaged(cluster):
    """A worker that restarts has its replicas afresh (version 0): its
    replicas are read by no tool, the next step's all-reduce finds them out
    of step (nothing applied anywhere), and the coordinator re-forms the
    ring, copies the model to it (values, slots, counts) and runs the step
    again: every replica then holds the update of step 1 and step 2, never
    one averaged with the initial values."""
    params = {"learning_rate": 0.05}
    w0 = np.random.default_rng(7).standard_normal((IN, OUT)).astype(np.float32)
    b0 = np.zeros(OUT, np.float32)
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce", step_timeout=20)
    w, b = _model(strategy, w0, b0, "sgd", params)
    with ClusterCoordinator(strategy) as coord:
        coord.schedule(make_step(w, b))
        coord.join()
        assert coord.replica_values(worker=0, with_versions=True)[1] == {"w": 1, "b": 1}
    cluster.restart_worker(2)
    with ClusterCoordinator(strategy) as coord:
        with pytest.raises(StepFunctionError, match="no replica"):   # never the initial value
            coord.replica_values(worker=2, timeout=60)
        coord.join(timeout=60)   # (a tool's failure is its caller's alone: the queue goes on)
    with ClusterCoordinator(strategy) as coord:
        step = coord.schedule(make_step(w, b))
        coord.join(timeout=120)
        assert np.isfinite(step.fetch()) and len(step.replicas) == 3
        got = [coord.replica_values(worker=i, with_versions=True) for i in range(3)]
    # (the steps are numbered by the strategy: its second step is step 1)
    assert all(v == {"w": 2, "b": 2} for _, v in got), got
    assert got[0][0]["w"].tobytes() == got[1][0]["w"].tobytes() == got[2][0]["w"].tobytes()
    want_w, _ = large_batch(w0, b0, 3, 2, "sgd", params)
    np.testing.assert_allclose(got[2][0]["w"], want_w, rtol=2e-5, atol=2e-6)

    # sync_replicas still copies one worker's replicas to the others by hand.
    with ClusterCoordinator(strategy) as coord:
        assert coord.sync_replicas(source=cluster.workers[1].address) == \
            cluster.workers[1].address
        coord.schedule(make_step(w, b))
        coord.join(timeout=60)
        synced = [coord.replica_values(worker=i, with_versions=True) for i in range(3)]
    assert all(v == {"w": 3, "b": 3} for _, v in synced), synced
    assert synced[0][0]["w"].tobytes() == synced[1][0]["w"].tobytes() == \
        synced[2][0]["w"].tobytes()


def other_variables_step(w, b):
    """make_step's, but replica 1 pushes w alone (a program that pushes
    other variables on one worker)."""
    def step():
        from coordinator import get_replica_context
        ctx = get_replica_context()
        x, y = batch(ctx.step, ctx.replica_id_in_sync_group)
        wv, bv = read_variables([w, b])
        gw, gb, loss = grads(wv, bv, x, y)
        push_gradients([(w, gw)] if ctx.replica_id_in_sync_group == 1 else [(w, gw), (b, gb)])
        return loss
    return step


def test_workers_that_push_other_variables_fail_the_job_after_the_attempts(cluster):
    """A disagreement that re-forming cannot mend (the workers push other
    variables) fails the job with it after MAX_ATTEMPTS re-runs; nothing
    was applied anywhere."""
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce", step_timeout=20)
    w, b = _model(strategy, np.ones((IN, OUT), np.float32), np.zeros(OUT, np.float32))
    with ClusterCoordinator(strategy) as coord:
        step = coord.schedule(other_variables_step(w, b))
        with pytest.raises((StepFunctionError, WorkerCallError), match="disagree"):
            coord.join(timeout=120)
        assert coord.cluster.gangs.wait(60)
    with ClusterCoordinator(strategy) as coord:
        got = [coord.replica_values(worker=i, with_versions=True) for i in range(3)]
    assert all(v == {"w": 0, "b": 0} for _, v in got), got
    assert step.status.name == "FAILED"


def touched(flag_path: str) -> None:
    """A closure body whose running leaves a trace (it must not run)."""
    open(flag_path, "w").close()


BAD_INFOS = {
    "rank past the members": dict(rank=3),
    "negative rank": dict(rank=-1),
    "no members": dict(members=[]),
    "a member twice": dict(members=["a:1", "a:1"], rank=0),
    "no group": dict(group=""),
    "no job": dict(job=""),
    "negative step": dict(step=-5),
    "zero timeout": dict(timeout=0.0),
    "nan timeout": dict(timeout=float("nan")),
    "unknown compression": dict(compression="bf16"),
}


@pytest.mark.parametrize("what", sorted(BAD_INFOS))
def test_a_malformed_step_is_refused_before_anything_runs(cluster, tmp_path, what):
    """A RunClosure whose CollectiveInfo is malformed: INVALID_ARGUMENT, the
    function not run, the worker serving on."""
    from coordinator import serialization
    from protos.pstrain.v1 import worker_pb2
    from psserver.errors import Code, PSError
    from psserver.link import methods
    from psserver.link.channel import TaskChannel
    members = [w.address for w in cluster.workers]
    info = dict(group="g", members=members, rank=0, step=0, timeout=10.0, job="j")
    info.update(BAD_INFOS[what])
    flag = tmp_path / "ran"
    w = cluster.workers[0]
    with TaskChannel(w.address, role="worker", token=cluster.token, tls=cluster.tls) as ch:
        with pytest.raises(PSError) as raised:
            ch.call(methods.RUN_CLOSURE, worker_pb2.ClosureRequest(
                fn=serialization.encode_function(touched),
                args=serialization.dumps(((str(flag),), {})),
                collective=worker_pb2.CollectiveInfo(**info)), 30)
        assert raised.value.code == Code.INVALID_ARGUMENT, raised.value
        assert "malformed" in str(raised.value)
        assert not flag.exists()
        ok = ch.call(methods.RUN_CLOSURE, worker_pb2.ClosureRequest(   # still serving
            fn=serialization.encode_function(touched),
            args=serialization.dumps(((str(flag),), {}))), 30)
        assert not ok.HasField("error") and flag.exists()


def test_arguments_that_do_not_apply_are_refused(cluster):
    for kwargs, words in [(dict(num_replicas=2), "num_replicas"),
                          (dict(backup_workers=1), "num_replicas and backup_workers"),
                          (dict(gradient_compression="bf16"), "fp16"),
                          (dict(staleness=1), "bounded"),
                          (dict(step_timeout=float("inf")), "step_timeout")]:
        with pytest.raises(ValueError, match=words):
            ParameterServerStrategy(cluster.spec, mode="allreduce", **kwargs)
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce")
    with pytest.raises(ValueError, match="shape or an initial_value"):
        strategy.create_variable("v")
    with pytest.raises(ValueError, match="NaN or Inf"):
        strategy.create_variable("v", initial_value=np.array([np.nan], np.float32))
    with pytest.raises(ValueError, match="unknown"):
        strategy.create_variable("v", shape=(2,), optimizer="adam",
                                 optimizer_params={"lr": 1.0})
    v = strategy.create_variable("v", shape=(4, 2), initializer="glorot_uniform", seed=5)
    assert v.shape == (4, 2) and np.abs(v.initial_value).max() > 0
    with pytest.raises(ValueError, match="already created"):
        strategy.create_variable("v", shape=(2,))
    with ClusterCoordinator(strategy) as coord:
        with pytest.raises(TypeError, match="mirrored"):
            coord.replica_values([object()])
        with pytest.raises(ValueError, match="not a worker"):
            coord.replica_values(worker="10.9.9.9:1")


def test_a_push_outside_an_allreduce_step_says_where_it_belongs(cluster):
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce")
    v = strategy.create_variable("v", shape=(2,))
    with pytest.raises(RuntimeError, match="all-reduce mode"):
        push_gradients([(v, np.ones(2, np.float32))])


def bad_gradient_step(w, b, rank_with_bad_shape: int):
    def step():
        from coordinator import get_replica_context
        ctx = get_replica_context()
        wv, bv = read_variables([w, b])
        gw = np.ones(wv.shape, np.float32)
        if ctx.replica_id_in_sync_group == rank_with_bad_shape:
            gw = gw[:-1]
        push_gradients([(w, gw), (b, np.ones(bv.shape, np.float32))])
    return step


def test_one_replica_with_a_bad_gradient_fails_the_step_at_once_everywhere(cluster):
    """One worker's gradient has the wrong shape: it refuses it and tells
    the others, whose all-reduce fails at once (not after step_timeout);
    nothing is applied anywhere."""
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce", step_timeout=300)
    w = strategy.create_variable("w", shape=(IN, OUT))
    b = strategy.create_variable("b", shape=(OUT,))
    with ClusterCoordinator(strategy) as coord:
        step = coord.schedule(bad_gradient_step(w, b, 1))
        with pytest.raises(StepFunctionError):
            step.fetch(timeout=60)   # (well within the 300 s an all-reduce may take)
        assert all(r._done.wait(60) for r in step.replicas)
        errors = [str(r._error) for r in step.replicas]
        assert "has shape" in errors[1], errors
    with ClusterCoordinator(strategy) as coord:
        versions = [coord.replica_values(worker=i, with_versions=True)[1] for i in range(3)]
    assert all(v == {"w": 0, "b": 0} for v in versions), versions


def hybrid_step(w, table):
    def step():
        from coordinator import get_replica_context
        from coordinator.step_calls import IndexedSlices, Lookup
        r = get_replica_context().replica_id_in_sync_group
        keys = np.arange(4, dtype=np.int64) + 100 * r
        wv, rows = read_variables([w, Lookup(table, keys)])
        push_gradients([(w, np.full(wv.shape, r + 1.0, np.float32)),
                        (table, IndexedSlices(np.ones_like(rows), keys))])
    return step


def test_tables_stay_on_the_servers_beside_mirrored_variables():
    """Dense variables by all-reduce, a dynamic table on a parameter server
    (row-wise gradients applied on arrival, as in hybrid mode), in one step."""
    with LocalCluster(num_ps=1, num_workers=2) as c:
        strategy = ParameterServerStrategy(c.spec, mode="allreduce")
        w = strategy.create_variable("w", shape=(3,), optimizer="sgd",
                                     optimizer_params={"learning_rate": 0.5})
        table = strategy.create_embedding_table("t", 2, optimizer="sgd",
                                                optimizer_params={"learning_rate": 0.25})
        steps = 4
        with ClusterCoordinator(strategy) as coord:
            for _ in range(steps):
                coord.schedule(hybrid_step(w, table))
            coord.join()
            got = [coord.replica_values(worker=i) for i in range(2)]
        rows = table.lookup(np.array([0, 3, 100, 103], np.int64), admit=False)
    np.testing.assert_array_equal(got[0]["w"], np.full(3, -0.5 * 1.5 * steps, np.float32))
    assert got[1]["w"].tobytes() == got[0]["w"].tobytes()
    np.testing.assert_allclose(rows, np.full((4, 2), -0.25 * steps, np.float32))


def test_a_step_run_again_after_its_ring_failed_applies_its_table_rows_once():
    """A worker restarts between steps: its next step's all-reduce finds the
    replicas out of step and the step runs again after the re-forming. Its
    rows (random update keys: no exactly-once batch) were not sent by the
    failed attempt, so each member's rows get one update a step."""
    with LocalCluster(num_ps=1, num_workers=2) as c:
        strategy = ParameterServerStrategy(c.spec, mode="allreduce", step_timeout=20)
        w = strategy.create_variable("w", shape=(3,), optimizer="sgd",
                                     optimizer_params={"learning_rate": 0.5})
        table = strategy.create_embedding_table("t", 2, optimizer="sgd",
                                                optimizer_params={"learning_rate": 0.25})
        with ClusterCoordinator(strategy) as coord:
            coord.schedule(hybrid_step(w, table))
            coord.join(timeout=60)
        c.restart_worker(1)
        with ClusterCoordinator(strategy) as coord:
            coord.schedule(hybrid_step(w, table))
            coord.join(timeout=120)
            got = [coord.replica_values(worker=i, with_versions=True) for i in range(2)]
        rows = table.lookup(np.array([0, 3, 100, 103], np.int64), admit=False)
    np.testing.assert_allclose(rows, np.full((4, 2), -0.25 * 2, np.float32))
    assert got[0][1] == got[1][1] == {"w": 2}
    np.testing.assert_array_equal(got[1][0]["w"], np.full(3, -0.5 * 1.5 * 2, np.float32))


def test_a_table_without_parameter_servers_says_what_to_add(cluster):
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce")
    with pytest.raises(ValueError, match="add \"ps\" tasks"):
        strategy.create_embedding_table("t", 4)


def _elastic_job(c, seed: int, params: dict):
    """An all-reduce strategy on a fixed spec of ``c`` (as TF_CONFIG's: a
    dead worker stays in it), step_timeout 5 s, and its w, b (SGD) with
    their initial values: (strategy, w, b, w0, b0)."""
    strategy = ParameterServerStrategy(c.snapshot(), mode="allreduce", step_timeout=5)
    w0 = np.random.default_rng(seed).standard_normal((IN, OUT)).astype(np.float32)
    b0 = np.zeros(OUT, np.float32)
    return (strategy, *_model(strategy, w0, b0, "sgd", params), w0, b0)


def test_a_worker_lost_between_steps_and_training_goes_on_without_it():
    """Elastic: a worker of a fixed spec dies; the step it was in is issued
    again to the two that answer (after the others' all-reduce fails within
    step_timeout), the replicas are made one, and the steps after it run on
    two workers: the model equals the large batch of 3 replicas for the
    first steps and of 2 after, on both survivors bit for bit."""
    params = {"learning_rate": 0.05}
    with LocalCluster(num_ps=0, num_workers=3) as c:
        strategy, w, b, w0, b0 = _elastic_job(c, 3, params)
        with ClusterCoordinator(strategy) as coord:
            for _ in range(3):
                coord.schedule(make_step(w, b))
            coord.join(timeout=60)
            c.kill_worker(2)
            steps = [coord.schedule(make_step(w, b)) for _ in range(4)]
            coord.join(timeout=120)
            assert [len([v for v in s.replicas if v.fetch() is not ABANDONED]) for s in steps] \
                == [2, 2, 2, 2]
            # later steps go to the two (the dead worker stays in the fixed spec)
            assert len(coord.schedule(make_step(w, b)).replicas) == 2
            coord.join(timeout=60)
            got = [coord.replica_values(worker=i, with_versions=True) for i in (0, 1)]
    _equal_survivors(got, w0, b0, [3, 3, 3, 2, 2, 2, 2, 2], params)


def test_a_worker_leaving_the_spec_before_the_first_step():
    """The members are the spec's workers when the first step is scheduled."""
    with LocalCluster(num_ps=0, num_workers=2) as c:
        strategy = ParameterServerStrategy(c.spec, mode="allreduce")
        w = strategy.create_variable("w", shape=(IN, OUT))
        b = strategy.create_variable("b", shape=(OUT,))
        c.kill_worker(1)
        with ClusterCoordinator(strategy) as coord:
            step = coord.schedule(make_step(w, b))
            step.fetch(timeout=60)
            assert len(step.replicas) == 1


def step_number():
    from coordinator import get_replica_context
    return get_replica_context().step


def test_steps_are_numbered_across_coordinators_and_reads_belong_to_steps(cluster):
    """A second coordinator on the strategy goes on numbering (batches chosen
    by step do not repeat); closure_timeout is refused (a step cut off would
    still apply on its workers); a read on the coordinator says where the
    values are."""
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce")
    w = strategy.create_variable("w", shape=(2,))
    with pytest.raises(ValueError, match="closure_timeout"):
        ClusterCoordinator(strategy, closure_timeout=5)
    with pytest.raises(RuntimeError, match="replica_values"):
        read_variables([w])
    numbers = []
    for _ in range(2):
        with ClusterCoordinator(strategy) as coord:
            numbers += [coord.schedule(step_number).fetch() for _ in range(2)]
    assert numbers == [0, 1, 2, 3]


def raising_step(w, rank_that_raises: int):
    def step():
        from coordinator import get_replica_context
        (wv,) = read_variables([w])
        if get_replica_context().replica_id_in_sync_group == rank_that_raises:
            raise ArithmeticError("this replica's step went wrong before its push")
        push_gradients([(w, np.ones(wv.shape, np.float32))])
    return step


def test_a_replica_raising_before_its_push_fails_the_others_at_once(cluster):
    strategy = ParameterServerStrategy(cluster.spec, mode="allreduce", step_timeout=300)
    w = strategy.create_variable("w", shape=(5,))
    with ClusterCoordinator(strategy) as coord:
        step = coord.schedule(raising_step(w, 2))
        assert all(r._done.wait(60) for r in step.replicas)   # not the 300 s of step_timeout
        errors = [str(r._error) for r in step.replicas]
        assert "ArithmeticError" in errors[2], errors
        assert all(e != "None" for e in errors), errors
        # Nothing applied anywhere. (A rank whose closure the failing job took
        # off the queue before its worker took it never ran: no replica.)
        for i in (0, 1):
            try:
                assert coord.replica_values(worker=i, with_versions=True)[1] == {"w": 0}
            except StepFunctionError as exc:
                assert "no replica" in str(exc), exc


def test_checkpoints_go_from_allreduce_to_ps_mode_and_back(tmp_path):
    """A checkpoint of all-reduce mode holds one worker's replicas (values,
    Adam's slots, update counts), restores into every worker of a new
    all-reduce job, and into parameter-server mode; one written in
    parameter-server mode restores into all-reduce mode."""
    from coordinator import CheckpointManager
    params = {"learning_rate": 0.01}
    with LocalCluster(num_ps=1, num_workers=2) as c:
        def job(mode):
            s = ParameterServerStrategy(c.spec, mode=mode)
            return s, s.create_variable("w", initial_value=np.ones((IN, OUT), np.float32),
                                        optimizer="adam", optimizer_params=params), \
                s.create_variable("b", initial_value=np.zeros(OUT, np.float32),
                                  optimizer="adam", optimizer_params=params)
        strategy, w, b = job("allreduce")
        with ClusterCoordinator(strategy) as coord:
            for _ in range(3):
                coord.schedule(make_step(w, b))
            coord.join()
            saved = coord.replica_states()
            path = CheckpointManager(strategy, str(tmp_path / "ar")).save(step=3)
        assert saved["w"][2] == 3 and saved["w"][1]["iterations"] == 3

        strategy2, w2, b2 = job("allreduce")   # a new job: its own replicas
        with ClusterCoordinator(strategy2) as coord:
            assert CheckpointManager(strategy2, str(tmp_path / "ar")).restore()["step"] == 3
            for i in range(2):
                got = coord.replica_states(source=i)
                for name in ("w", "b"):
                    assert got[name][0].tobytes() == saved[name][0].tobytes()
                    assert got[name][2] == 3
                    assert all(got[name][1][k].tobytes() == a.tobytes()
                               for k, a in saved[name][1].items())
            coord.schedule(make_step(w2, b2))   # trains on: the replicas agree
            coord.join()
            # its steps are numbered on from the checkpoint's (batches chosen by step
            # are not those of steps 0-3 again)
            assert coord.schedule(step_number).fetch() == 4

        ps, wp, bp = job("async")   # into parameter-server mode
        CheckpointManager(ps, str(tmp_path / "ar")).restore(path)
        values, versions = read_variables([wp, bp], with_versions=True)
        assert values[0].tobytes() == saved["w"][0].tobytes() and versions[0] == [3]
        with ClusterCoordinator(ps) as coord:   # and a step there takes Adam's slots on
            gw = np.ones((IN, OUT), np.float32)
            coord.schedule(push_one, args=(wp, gw)).fetch()
        strategy3, w3, b3 = job("allreduce")
        with ClusterCoordinator(strategy3) as coord:
            want = large_adam_step(saved["w"], gw, params)
            CheckpointManager(ps, str(tmp_path / "ps")).save(step=4)
            CheckpointManager(strategy3, str(tmp_path / "ps")).restore()
            got = coord.replica_states(source=1)
        np.testing.assert_array_equal(got["w"][0], want)
        assert got["w"][2] == 4 and got["w"][1]["iterations"] == 4


def push_one(v, g):
    push_gradients([(v, g)])


def large_adam_step(state, g, params):
    value, slots, _ = state
    value, slots = value.copy(), {k: a.copy() for k, a in slots.items()}
    make_optimizer("adam", params).apply_dense(value, slots, g)
    return value


def test_incremental_checkpoints_keep_the_tables_as_deltas(tmp_path):
    """With mirrored variables beside a table, an incremental save after the
    first is still a delta (the replicas whole in it), and restores."""
    from coordinator import CheckpointManager
    from coordinator.checkpoint_files import read_manifest
    with LocalCluster(num_ps=1, num_workers=2) as c:
        strategy = ParameterServerStrategy(c.spec, mode="allreduce")
        w = strategy.create_variable("w", shape=(3,), optimizer="sgd",
                                     optimizer_params={"learning_rate": 0.5})
        table = strategy.create_embedding_table("t", 2, optimizer="sgd",
                                                optimizer_params={"learning_rate": 0.25})
        manager = CheckpointManager(strategy, str(tmp_path / "inc"), incremental=True)
        with ClusterCoordinator(strategy) as coord:
            coord.schedule(hybrid_step(w, table))
            coord.join()
            manager.save(step=1)
            coord.schedule(hybrid_step(w, table))
            coord.join()
            second = manager.save(step=2)
            want = coord.replica_values()["w"]
            manifest = read_manifest(second)
            assert "chain" in manifest, manifest.keys()
            assert manifest["variables"]["w"]["shards"][0]["kind"] == "full"
            coord.schedule(hybrid_step(w, table))   # moves on; the restore takes it back
            coord.join()
            manager.restore(second)
            assert coord.replica_values()["w"].tobytes() == want.tobytes()


def test_a_scalar_and_a_changed_set_of_variables_checkpoint_right(tmp_path):
    """A 0-d mirrored variable stays 0-d through a checkpoint into PS mode;
    a variable added between two incremental saves makes the second a
    base (every variable in it), which restores."""
    from coordinator import CheckpointManager
    from coordinator.checkpoint_files import read_manifest
    with LocalCluster(num_ps=1, num_workers=2) as c:
        strategy = ParameterServerStrategy(c.spec, mode="allreduce")
        s = strategy.create_variable("s", initial_value=np.float32(1.5))
        table = strategy.create_embedding_table("t", 2)
        manager = CheckpointManager(strategy, str(tmp_path / "inc"), incremental=True)
        with ClusterCoordinator(strategy) as coord:
            coord.schedule(hybrid_step(s, table)).fetch()   # (pushes a 0-d gradient)
            manager.save(step=1)
            late = strategy.create_variable("late", shape=(2,))
            with pytest.raises(Unavailable, match="first step that reads"):
                manager.save(step=2)   # (no replica of it anywhere yet)
            coord.schedule(read_all, args=([s, late],)).fetch()
            second = manager.save(step=2)
            assert "chain" not in read_manifest(second)
            manager.restore(second)
        ps = ParameterServerStrategy(c.spec)
        v = ps.create_variable("s", initial_value=np.float32(0))
        ps.create_variable("late", shape=(2,))
        CheckpointManager(ps, str(tmp_path / "inc")).restore(second)
        (got,) = read_variables([v])
        assert got.shape == () and got == np.float32(1.5 - 0.01 * 1.5)


def read_all(variables):
    read_variables(variables)


def test_a_dead_worker_neither_blocks_nor_fails_a_save(tmp_path):
    """With a worker of a fixed spec dead, a save takes a live worker's
    replicas, the tools answer Unavailable at once for the dead one (never
    a closure left queued for it), and join() returns."""
    from coordinator import CheckpointManager
    with LocalCluster(num_ps=0, num_workers=2) as c:
        strategy = ParameterServerStrategy(c.snapshot(), mode="allreduce")
        w = strategy.create_variable("w", shape=(IN, OUT))
        b = strategy.create_variable("b", shape=(OUT,))
        manager = CheckpointManager(strategy, str(tmp_path / "dead"), every_n_steps=1)
        with ClusterCoordinator(strategy) as coord:
            coord.schedule(make_step(w, b)).fetch()
            c.kill_worker(1)
            assert manager.maybe_save(1) is not None   # from worker 0
            with pytest.raises(Unavailable):
                coord.replica_values(worker=1, timeout=60)
            with pytest.raises(Unavailable, match="not answering"):   # (at once now)
                coord.replica_values(worker=1, timeout=60)
            with pytest.raises(Unavailable, match="but not on"):
                manager.restore()
            coord.join(timeout=30)
            assert coord.pending() == (0, 0)


def crashing_step(w, b, at_step: int, rank: int):
    """make_step's, but replica ``rank``'s process dies at step ``at_step``
    between its read and its push (a worker lost mid-step)."""
    inner = make_step(w, b)

    def step():
        import os

        from coordinator import get_replica_context
        ctx = get_replica_context()
        if ctx.step == at_step and ctx.replica_id_in_sync_group == rank \
                and ctx.num_replicas_in_sync == 3:
            read_variables([w, b])
            os._exit(3)
        return inner()
    return step


def test_a_worker_killed_mid_step_and_the_step_is_run_again_without_it():
    params = {"learning_rate": 0.05}
    with LocalCluster(num_ps=0, num_workers=3) as c:
        strategy, w, b, w0, b0 = _elastic_job(c, 4, params)
        step = crashing_step(w, b, 2, 1)
        with ClusterCoordinator(strategy) as coord:
            losses = [coord.schedule(step) for _ in range(5)]
            coord.join(timeout=120)
            assert all(np.isfinite(x.fetch()) for x in losses)
            got = [coord.replica_values(worker=i, with_versions=True) for i in (0, 2)]
    _equal_survivors(got, w0, b0, [3, 3, 2, 2, 2], params)


def test_steps_scheduled_while_the_ring_is_re_formed():
    """schedule() during a recovery waits for it (it took the order lock
    before: a deadlock) and its steps run on the new members."""
    params = {"learning_rate": 0.05}
    with LocalCluster(num_ps=0, num_workers=3) as c:
        strategy, w, b, w0, b0 = _elastic_job(c, 5, params)
        step = crashing_step(w, b, 1, 2)
        with ClusterCoordinator(strategy) as coord:
            first = [coord.schedule(step) for _ in range(2)]
            gangs = coord.cluster.gangs
            with gangs._lock:   # (the recovery under way: the members wait out step_timeout)
                assert gangs._lock.wait_for(lambda: gangs._recovering, 60)
            later = [coord.schedule(step) for _ in range(2)]
            coord.join(timeout=120)
            assert [len(s.replicas) for s in later] == [2, 2]
            assert all(np.isfinite(x.fetch()) for x in first + later)
            got = [coord.replica_values(worker=i, with_versions=True) for i in (0, 1)]
    _equal_survivors(got, w0, b0, [3, 2, 2, 2], params)


def slow_step(w, b):
    """make_step's, taking 0.2 s more."""
    inner = make_step(w, b)

    def step():
        import time
        time.sleep(0.2)
        return inner()
    return step


def _replicas_per_step(steps) -> list[int]:
    """How many replicas each step's update averaged (its RemoteValues not ABANDONED)."""
    return [len([v for v in s.replicas if v.fetch() is not ABANDONED]) for s in steps]


@pytest.mark.parametrize("between_steps", [True, False], ids=["idle", "steps-queued"])
def test_a_worker_that_joins_enters_at_a_step_boundary_with_the_current_model(between_steps):
    """The spec grows (LocalCluster.add_worker) while the job runs: the next
    schedule() gives the joiner the current model at a step boundary and
    every step from then on has it as a member (steps queued but not started
    too). The model equals the large batch of the replicas each step had,
    bit-identical on an old worker and the joiner."""
    params = {"learning_rate": 0.05}
    with LocalCluster(num_ps=0, num_workers=2) as c:
        strategy = ParameterServerStrategy(c.spec, mode="allreduce", step_timeout=10)
        w0 = np.random.default_rng(6).standard_normal((IN, OUT)).astype(np.float32)
        b0 = np.zeros(OUT, np.float32)
        w, b = _model(strategy, w0, b0, "sgd", params)
        with ClusterCoordinator(strategy) as coord:
            # (slow steps: some are still queued when the joiner is noticed)
            first = [coord.schedule(make_step(w, b) if between_steps else slow_step(w, b))
                     for _ in range(3 if between_steps else 10)]
            if between_steps:
                coord.join(timeout=60)
            c.add_worker()
            later = [coord.schedule(make_step(w, b)) for _ in range(3)]
            coord.join(timeout=120)
            per_step = _replicas_per_step(first + later)
            assert _replicas_per_step(later) == [3, 3, 3]
            if between_steps:
                assert _replicas_per_step(first) == [2, 2, 2]
            assert all(np.isfinite(x.fetch()) for x in first + later)
            got = [coord.replica_values(worker=i, with_versions=True) for i in (0, 2)]
    _equal_survivors(got, w0, b0, per_step, params)


def counting_step(w, table, die_at_step: int | None):
    """A step on a sharded dataset of example ids: each example's row of
    ``table`` (SGD, learning rate 1) gets +1, and w the mean of its
    replicas' batch sizes (SGD, learning rate 1: -4 a step). With
    ``die_at_step``, replica 1's process dies in that step, after its
    read, while the step has 3 replicas."""
    def step(it):
        import os

        from coordinator import get_replica_context
        from coordinator.step_calls import IndexedSlices, Lookup
        ctx = get_replica_context()
        ids = np.asarray(next(it), np.int64)   # (a source of one array: batches of it)
        wv, rows = read_variables([w, Lookup(table, ids)])
        if ctx.step == die_at_step and ctx.replica_id_in_sync_group == 1 \
                and ctx.num_replicas_in_sync == 3:
            os._exit(3)
        push_gradients([(table, IndexedSlices(-np.ones_like(rows), ids)),
                        (w, np.full(wv.shape, float(ids.size), np.float32))])
        return ids.tolist()
    return step


SGD1 = {"learning_rate": 1.0}


def counting_job(spec):
    """counting_step's strategy (all-reduce, step_timeout 5 s), its w and its
    table (SGD 1, rows from zeros): (strategy, w, table)."""
    strategy = ParameterServerStrategy(spec, mode="allreduce", step_timeout=5)
    w = strategy.create_variable("w", shape=(2,), optimizer="sgd", optimizer_params=SGD1)
    table = strategy.create_embedding_table("t", 1, initializer="zeros", optimizer="sgd",
                                            optimizer_params=SGD1)
    return strategy, w, table


def counting_dataset(coord, batches: int):
    """Example ids 0 .. 4 x batches - 1 in batches of 4, over 2 shards (24
    ids, the rest)."""
    return coord.create_sharded_dataset(ShardedSource.from_arrays(
        np.arange(4 * batches), shard_sizes=[24, 4 * batches - 24]), batch_size=4)


@pytest.mark.parametrize("killed", [False, True], ids=["all-workers", "worker-killed-mid-step"])
def test_a_sharded_dataset_is_trained_exactly_once_with_or_without_a_worker_lost(killed):
    """Sharded datasets in all-reduce mode: each closure of a step takes a
    batch; an epoch's every example is trained exactly once (its table row
    +1), also when a worker dies inside a step: the step's batches go back
    and the step runs again on the two left (the table pushes of the first
    attempt, keyed by batch, are not applied twice)."""
    batches = 13 if killed else 12   # 3 + 2 x 5 steps, or 3 x 4
    with LocalCluster(num_ps=1, num_workers=3) as c:
        strategy, w, table = counting_job(c.snapshot())
        with ClusterCoordinator(strategy) as coord:
            ds = counting_dataset(coord, batches)
            it = iter(ds)
            step = counting_step(w, table, 1 if killed else None)
            steps = [coord.schedule(step, args=(it,)) for _ in range(6 if killed else 4)]
            coord.join(timeout=120)
            assert ds.wait_epoch(0, timeout=30) and ds.epochs_completed == 1
            assert _replicas_per_step(steps) == ([3, 2, 2, 2, 2, 2] if killed else [3] * 4)
            trained = sorted(i for s in steps for v in s.replicas if v.fetch() is not ABANDONED
                             for i in v.fetch())
            assert trained == list(range(4 * batches))
            got = [coord.replica_values(worker=i, with_versions=True) for i in (0, 2)]
        rows = table.lookup(np.arange(4 * batches, dtype=np.int64), admit=False)
    np.testing.assert_array_equal(rows, np.ones((4 * batches, 1), np.float32))
    assert got[0][1] == got[1][1] == {"w": len(steps)}
    np.testing.assert_array_equal(got[0][0]["w"], got[1][0]["w"])
    np.testing.assert_array_equal(got[0][0]["w"], np.full(2, -4.0 * len(steps), np.float32))


def loss_of(step):
    """``step``, returning a float (fit logs it) in place of its value."""
    def with_loss(it):
        return float(len(step(it)))
    return with_loss


def test_fit_on_a_sharded_dataset_makes_an_epoch_of_the_data():
    """fit's default steps per epoch in all-reduce mode: the batches over the
    workers (a step takes one on each), so 2 epochs of fit train every
    example twice: each table row +2, 2 epochs acknowledged."""
    with LocalCluster(num_ps=1, num_workers=2) as c:
        strategy, w, table = counting_job(c.spec)
        with ClusterCoordinator(strategy) as coord:
            ds = counting_dataset(coord, 12)
            history = fit(coord, loss_of(counting_step(w, table, None)), ds, epochs=2,
                          verbose=0)
            assert ds.wait_epoch(1, timeout=30) and ds.epochs_completed == 2
            assert len(history.steps) == 2 * 6
            got = coord.replica_values(worker=1, with_versions=True)
        rows = table.lookup(np.arange(48, dtype=np.int64), admit=False)
    np.testing.assert_array_equal(rows, np.full((48, 1), 2.0, np.float32))
    assert got[1] == {"w": 12}


def test_fit_follows_the_members_when_a_worker_is_lost_mid_epoch():
    """3 workers, a worker killed inside fit's second step: the rest of the
    epoch runs on 2, so fit's first guess (12 batches over 3: 4 steps)
    leaves batches; fit runs steps until its data epoch is trained, in both
    epochs. Every example trained twice, but for the first batches of a
    third data epoch that a last step of 2 members takes (at most one a
    step's worth: 4 ids, trained three times). Before, fit stopped after
    4 steps an epoch and 2 epochs of fit trained 17 of the 24 batches."""
    with LocalCluster(num_ps=1, num_workers=3) as c:
        strategy, w, table = counting_job(c.snapshot())
        with ClusterCoordinator(strategy) as coord:
            ds = counting_dataset(coord, 12)
            history = fit(coord, loss_of(counting_step(w, table, 1)), ds, epochs=2,
                          verbose=0)
            assert ds.epochs_completed >= 2
            assert coord.replicas_in_sync() == 2
            got = [coord.replica_values(worker=i, with_versions=True) for i in (0, 2)]
        rows = table.lookup(np.arange(48, dtype=np.int64), admit=False)[:, 0]
    assert (rows >= 2).all() and (rows <= 3).all() and rows.sum() - 2 * 48 <= 4, rows
    assert got[0][1] == got[1][1] == {"w": len(history.steps)}


def test_fit_follows_a_worker_that_joins_between_epochs():
    """2 workers, a third added at the end of fit's first epoch: the next
    epoch's steps are counted with the joiner (12 batches over 3: 4 steps),
    so each of the 3 epochs of fit trains one data epoch (before, epoch 1
    counted 6 steps of 2 and they took 3 each: 18 batches, and epoch 2 the
    6 left)."""
    from coordinator.callbacks import Callback

    class Join(Callback):
        def __init__(self):
            self.acknowledged = []

        def on_epoch_end(self, epoch, logs=None):
            self.acknowledged.append(ds.stats().acknowledged)
            if epoch == 0:
                c.add_worker()
    with LocalCluster(num_ps=1, num_workers=2) as c:
        strategy, w, table = counting_job(c.spec)
        with ClusterCoordinator(strategy) as coord:
            ds = counting_dataset(coord, 12)
            join = Join()
            fit(coord, loss_of(counting_step(w, table, None)), ds, epochs=3, verbose=0,
                callbacks=[join])
            assert coord.replicas_in_sync() == 3
        rows = table.lookup(np.arange(48, dtype=np.int64), admit=False)
    assert join.acknowledged == [12, 24, 36]
    np.testing.assert_array_equal(rows, np.full((48, 1), 3.0, np.float32))


def _equal_survivors(got: list, w0, b0, replicas: list, params: dict) -> None:
    """Two survivors' (values, versions): one update per step, bit-identical,
    equal to the large batch of ``replicas`` per step."""
    assert got[0][1] == got[1][1] == {"w": len(replicas), "b": len(replicas)}
    assert got[0][0]["w"].tobytes() == got[1][0]["w"].tobytes()
    want_w, _ = large_batch(w0, b0, replicas, len(replicas), "sgd", params)
    np.testing.assert_allclose(got[0][0]["w"], want_w, rtol=2e-5, atol=2e-6)
