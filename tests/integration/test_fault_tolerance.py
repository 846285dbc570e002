"""Failures of every role on real clusters: the job goes on, nothing hangs."""
from __future__ import annotations

import logging
import os
import random
import signal
import threading

import numpy as np
import pytest
from proxy import CuttableProxy, spec_through

from coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    LocalCluster,
    ParameterServerLost,
    ParameterServerStrategy,
    batches,
    read_variables,
)
from coordinator import metrics as _metrics
from coordinator.checkpoint import CheckpointManager
from coordinator.step_calls import push_gradients

pytestmark = pytest.mark.timeout(180)


class _LogEvent(logging.Handler):
    """Set when a record of ``logger`` containing ``text`` is logged."""

    def __init__(self, logger: str, text: str):
        super().__init__()
        self._text, self._event, self.message = text, threading.Event(), ""
        self._logger = logging.getLogger(logger)
        self._logger.addHandler(self)

    def emit(self, record):
        msg = record.getMessage()
        if self._text in msg and not self._event.is_set():
            self.message = msg
            self._event.set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def close(self):
        self._logger.removeHandler(self)
        super().close()

ROWS = 8


def counting_step(w_var):
    """Each step adds 1 to every element (SGD, lr 1, gradient -1)."""
    def step():
        push_gradients([(w_var, -np.ones((ROWS, 4), np.float32))])
        return os.getpid()
    return step


def kill_once(marker: str, pid: int) -> bool:
    """SIGKILL pid the first time any closure gets here (a marker file decides)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    os.kill(pid, signal.SIGKILL)
    return True


def make_killing_step(w_var, marker, ps_pid):
    inner = counting_step(w_var)

    def step(kill):
        if kill:
            kill_once(marker, ps_pid)
        return inner()
    return step


def _sgd_table(strategy):
    return strategy.create_variable("w", initial_value=np.zeros((ROWS, 4), np.float32),
                                    optimizer="sgd", optimizer_params={"learning_rate": 1.0})


@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_killed_parameter_server_is_restored_and_training_goes_on(tmp_path, with_checkpoint):
    """From the latest checkpoint, or (asked for) re-created from its initializer."""
    with LocalCluster(num_ps=2, num_workers=2) as cluster:   # restarts a dead ps by default
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
        w = _sgd_table(strategy)
        ckpt = CheckpointManager(strategy, str(tmp_path / "ckpt")) if with_checkpoint else None
        with ClusterCoordinator(strategy, checkpoint_manager=ckpt,
                                recreate_lost_shards=not with_checkpoint) as coord:
            step = make_killing_step(w, str(tmp_path / "killed"), cluster.ps[1].pid)
            coord.fetch([coord.schedule(step, args=(False,)) for _ in range(10)])
            if ckpt:
                ckpt.save(step=10)
            coord.fetch([coord.schedule(step, args=(i == 5,)) for i in range(20)])
            coord.join()
            assert coord.cluster.recovery.recoveries == 1
            value = w.read()
        assert cluster.restarts == 1
    top, bottom = value[:ROWS // 2], value[ROWS // 2:]   # ps 0 holds the top rows
    assert (top >= 30).all() and (top <= 32).all()        # every step, a re-run at most twice
    floor = 10 if with_checkpoint else 0                  # the rest came back from the checkpoint
    assert (bottom >= floor + 14).all() and (bottom <= 30).all()
    assert len(np.unique(bottom)) == 1


@pytest.mark.timeout(60)   # leaving the coordinator does not wait out the workers' retries
def test_lost_parameter_server_stops_the_job_with_a_clear_error(tmp_path, caplog):
    """No replica, no checkpoint: a server that restarted empty fails the job
    (naming the lost shards and the ways to avoid it) instead of training on
    with half the model reset; and while it is away, the coordinator says so."""
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
        w = _sgd_table(strategy)
        with ClusterCoordinator(strategy) as coord:
            step = make_killing_step(w, str(tmp_path / "killed"), cluster.ps[1].pid)
            coord.fetch([coord.schedule(step, args=(False,)) for _ in range(5)])
            results = [coord.schedule(step, args=(i == 2,)) for i in range(10)]
            with pytest.raises(ParameterServerLost) as caught:
                coord.join()
    message = str(caught.value)
    assert cluster.ps[1].address in message and "w/part_1" in message
    assert "replication=True" in message and "CheckpointManager" in message
    assert "recreate_lost_shards=True" in message
    assert any(r.status.name in ("FAILED", "CANCELLED") for r in results)


def test_worker_cut_off_from_a_parameter_server_recovers_when_the_link_returns(tmp_path):
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        proxy = CuttableProxy(cluster.ps[0].address)
        try:
            spec = spec_through(cluster, proxy)
            strategy = ParameterServerStrategy(spec, variable_partitioner=FixedShardsPartitioner(2))
            w = _sgd_table(strategy)
            said = _LogEvent("coordinator", "is unreachable since")
            with ClusterCoordinator(strategy) as coord:
                step = counting_step(w)
                coord.fetch([coord.schedule(step) for _ in range(10)])
                proxy.cut()
                pending = [coord.schedule(step) for _ in range(10)]
                assert proxy.wait_refused(timeout=60), "nobody tried the cut link"
                # The coordinator says which server is away, since when, what it waits for.
                assert said.wait(timeout=30), "the coordinator never said the server is away"
                assert proxy.address in said.message and "paused" in said.message
                assert _metrics.REGISTRY.get_sample_value("pstrain_coordinator_ps_unreachable") == 1
                assert _metrics.REGISTRY.get_sample_value(
                    "pstrain_coordinator_ps_unreachable_seconds", {"address": proxy.address}) >= 0
                proxy.restore()
                coord.fetch(pending)
                coord.join()
                assert coord.cluster.recovery.recoveries == 0   # same server: nothing to restore
                assert _metrics.REGISTRY.get_sample_value("pstrain_coordinator_ps_unreachable") == 0
                value = w.read()
        finally:
            proxy.close()
            said.close()
    assert (value >= 20).all() and (value <= 24).all()   # every step at least once


# -- chaos -----------------------------------------------------------------------------------
def test_chaos_digits_survives_random_kills_of_every_role(tmp_path):
    from examples.digits import load_data
    from examples.nn import MLP, make_train_step

    x_tr, y_tr, x_te, y_te = load_data(seed=0)
    kills = {"ps": 0, "worker": 0}
    with LocalCluster(num_ps=2, num_workers=2, restart=("ps", "worker")) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
        model = MLP([64, 64, 10], loss="softmax_cross_entropy")
        model.create_variables(strategy, "mlp", optimizer="adam",
                               optimizer_params={"learning_rate": 3e-3}, seed=0)
        ckpt = CheckpointManager(strategy, str(tmp_path / "ckpt"), every_n_steps=50)
        stop = threading.Event()
        rng = random.Random(1234)

        def chaos():   # a kill every 0.3-0.8 s, alternating roles, until 6 of each
            for i in range(60):
                if min(kills.values()) >= 6 or stop.wait(rng.uniform(0.3, 0.8)):
                    return
                role = "worker" if i % 2 == 0 else "ps"
                tasks = cluster.workers if role == "worker" else cluster.ps
                victim = tasks[rng.randrange(len(tasks))]
                if victim is not None and victim.alive() and kills[role] < 6:
                    victim.kill()
                    kills[role] += 1

        def dataset_fn(ctx):
            x, y = ctx.shard(x_tr, y_tr)
            return batches(x, y, batch_size=32, seed=ctx.input_pipeline_id)

        with ClusterCoordinator(strategy, checkpoint_manager=ckpt) as coord:
            it = iter(coord.create_per_worker_dataset(dataset_fn))
            train_step = make_train_step(model)
            driver = threading.Thread(target=chaos, name="chaos")
            driver.start()
            step = 0
            try:
                while driver.is_alive() or step < 600:
                    coord.fetch([coord.schedule(train_step, args=(it,)) for _ in range(50)])
                    step += 50
                    ckpt.maybe_save(step)
                    if step >= 3000:
                        break
            finally:
                stop.set()
                driver.join()
            coord.fetch([coord.schedule(train_step, args=(it,)) for _ in range(100)])
            coord.join()
            params = read_variables(model.variables)
        accuracy = float((model.predict(params, x_te).argmax(axis=1) == y_te).mean())
    assert kills["ps"] >= 5 and kills["worker"] >= 5, kills
    assert accuracy >= 0.90, accuracy


# -- coordinator restart ------------------------------------------------------------------------
COORDINATOR_SCRIPT = '''
import os, sys
import numpy as np
from coordinator import ClusterCoordinator, ParameterServerStrategy, TFConfigClusterResolver
from coordinator.checkpoint import CheckpointManager
from coordinator.step_calls import push_gradients

strategy = ParameterServerStrategy(TFConfigClusterResolver(), reuse_existing=True)
w = strategy.create_variable("w", initial_value=np.zeros(4, np.float32), optimizer="sgd",
                             optimizer_params={"learning_rate": 1.0})
ckpt = CheckpointManager(strategy, sys.argv[1])
state = ckpt.restore_or_initialize()
start = state["step"] if state else 0
print("resumed from", start, flush=True)

def step():
    push_gradients([(w, -np.ones(4, np.float32))])

with ClusterCoordinator(strategy) as coord:
    for s in range(start, 100, 10):
        coord.fetch([coord.schedule(step) for _ in range(10)])
        ckpt.save(step=s + 10)
        if s + 10 == 50 and sys.argv[2] == "crash":
            coord.fetch([coord.schedule(step) for _ in range(5)])   # progress after the checkpoint
            os._exit(1)                                             # the coordinator dies
print("final", float(w.read()[0]), flush=True)
'''


def test_restarted_coordinator_resumes_from_the_latest_checkpoint(tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(COORDINATOR_SCRIPT)
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        config = tmp_path / "tf_config.json"
        config.write_text(json.dumps({"cluster": cluster.snapshot().as_dict()}))
        env = {**os.environ, **cluster._env, "TF_CONFIG_FILE": str(config)}
        run = [sys.executable, str(script), str(tmp_path / "ckpt")]
        first = subprocess.run(run + ["crash"], env=env, capture_output=True, text=True, timeout=120)
        assert first.returncode == 1, first.stderr
        assert "resumed from 0" in first.stdout
        second = subprocess.run(run + ["finish"], env=env, capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 0, second.stderr
    assert "resumed from 50" in second.stdout
    assert "final 100.0" in second.stdout   # the 5 steps after checkpoint 50 were rolled back


def test_replication_loses_no_acknowledged_update_when_servers_die():
    """Every acknowledged push is applied exactly once, across 5 server kills."""
    with LocalCluster(num_ps=2, num_workers=2) as cluster:   # dead servers come back empty
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2),
                                           replication=True)
        w = _sgd_table(strategy)
        assert len(w.backups) == 2 and {b.address for b in w.backups} == set(cluster.spec.ps)
        rng = random.Random(7)
        with ClusterCoordinator(strategy, ps_check_interval=0.2) as coord:
            step = counting_step(w)
            scheduled = []
            for kill in range(5):
                scheduled += [coord.schedule(step) for _ in range(20)]
                cluster.kill_ps(rng.randrange(2))          # mid-traffic
                scheduled += [coord.schedule(step) for _ in range(20)]
                # One server at a time: the next kill waits for this one's refill.
                assert coord.cluster.recovery.wait_for_recoveries(kill + 1, timeout=60)
            coord.fetch(scheduled)
            coord.join()
            value = w.read()
            metas = w.meta()
        assert cluster.restarts == 5
    acknowledged = len(scheduled)              # each step pushed once and was acknowledged
    np.testing.assert_array_equal(value, np.full((ROWS, 4), acknowledged, np.float32))
    assert [m.version for m in metas] == [acknowledged, acknowledged]   # applied exactly once
