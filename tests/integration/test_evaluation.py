"""Evaluation beside training: fit's background validation (skipped when
due while one runs, abandoned when it hangs, never raised into training)
and the `coordinator evaluate` sidecar (killed and restarted mid-training:
training unchanged; its metrics in TensorBoard event files and Prometheus)."""
from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
from test_fit import read_events
from test_metrics import scrape

from coordinator import (
    Callback,
    CheckpointCallback,
    CheckpointManager,
    ClusterCoordinator,
    IndexedSlices,
    LocalCluster,
    ParameterServerStrategy,
    ShardedSource,
    TensorBoard,
    fit,
    push_gradients,
)
from coordinator import metrics as _metrics
from coordinator.checkpoint_files import read_manifest
from coordinator.evaluation import BackgroundValidation, Sidecar
from psserver.process import child_env

pytestmark = pytest.mark.timeout(180)

N, BATCH = 48, 8


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_ps=1, num_workers=2) as c:
        yield c


def counting(strategy, name):
    """A counter per example (SGD, lr 1), a sharded dataset's step that adds
    1 to each example of its batch, and the dataset's source."""
    w = strategy.create_variable(name, initial_value=np.zeros((N, 1), np.float32),
                                 optimizer="sgd", optimizer_params={"learning_rate": 1.0})

    def step(it):
        ids = next(it)
        push_gradients([(w, IndexedSlices(-np.ones((len(ids), 1), np.float32), ids))])
        return float(len(ids))
    return w, step, ShardedSource.from_arrays(np.arange(N), num_shards=3)


def evaluate_counter(ckpt):
    """The sidecar's evaluation (imported by `coordinator evaluate --fn`)."""
    return {"mean": float(ckpt.variables["ev_w"].mean()), "ckpt_step": ckpt.step}


def evaluate_step(ckpt):
    """A sidecar's evaluation that needs no particular variable."""
    return {"step": ckpt.step}


def _count(outcome: str) -> float:
    return _metrics.REGISTRY.get_sample_value(
        "pstrain_evaluations_total", {"source": "fit", "outcome": outcome}) or 0.0


def test_background_validation_due_while_one_runs_is_skipped_and_the_last_epoch_validated(
        cluster, tmp_path):
    strategy = ParameterServerStrategy(cluster.spec)
    w, step, source = counting(strategy, "bg_w")
    release = threading.Event()
    threads = []

    def validate(epoch):
        threads.append(threading.current_thread().name)
        if epoch == 0:
            assert release.wait(60)
        return {"seen": float(w.read().mean())}

    class Release(Callback):   # after epoch 1's validation was due: let epoch 0's end
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                release.set()
    skipped = _count("skipped")
    with ClusterCoordinator(strategy) as coord:
        ds = coord.create_sharded_dataset(source, BATCH)
        history = fit(coord, step, ds, epochs=3, validation_fn=validate,
                      background_validation=True, verbose=0,
                      callbacks=[Release(), TensorBoard(str(tmp_path / "tb"))])
    assert history.fit_state.validation.skipped == 1 and _count("skipped") == skipped + 1
    assert history.epochs_of["val_seen"] == [0, 2]
    assert history.history["val_seen"][1] == 3.0          # after the last epoch: all of it
    assert history.history["val_seen"][0] >= 1.0          # epoch 0's (it ran during epoch 1)
    assert history.epochs_of["loss"] == [0, 1, 2]
    assert all(t.startswith("validation-epoch-") for t in threads)
    valid = read_events(tmp_path / "tb" / "validation")
    assert [s for s, _ in valid["epoch_seen"]] == [0, 2]


def test_a_hung_validation_is_abandoned_and_a_failing_one_does_not_stop_training(
        cluster, caplog):
    strategy = ParameterServerStrategy(cluster.spec)
    w, step, source = counting(strategy, "hang_w")
    hang = threading.Event()

    def validate(epoch):
        if epoch == 0:
            hang.wait(120)                                  # hangs until the test ends
            return {"never": 1.0}
        raise ValueError("the evaluation data is missing")
    abandoned, failed = _count("abandoned"), _count("failed")
    try:
        with ClusterCoordinator(strategy) as coord, caplog.at_level(logging.WARNING):
            ds = coord.create_sharded_dataset(source, BATCH)
            history = fit(coord, step, ds, epochs=2, validation_fn=validate, verbose=0,
                          background_validation=True, validation_timeout=0.5)
            np.testing.assert_array_equal(w.read(), np.full((N, 1), 2.0))   # trained on
    finally:
        hang.set()
    v = history.fit_state.validation
    assert (v.abandoned, v.failed, v.skipped) == (1, 1, 0)
    assert (_count("abandoned"), _count("failed")) == (abandoned + 1, failed + 1)
    assert not any(k.startswith("val_") for k in history.history)
    assert "validation of epoch 1 abandoned: still running after 0.5s" in caplog.text
    assert "the evaluation data is missing" in caplog.text
    with pytest.raises(ValueError, match="validation_timeout"):
        BackgroundValidation(validate, 0)


def test_save_best_only_with_background_validation_keeps_each_improving_epochs_checkpoint(
        cluster, tmp_path):
    """Issue 33 item 11: with background validation a val_ monitor comes after
    the epoch; CheckpointCallback(save_best_only) used to warn and never save.
    Each epoch's end is saved as a candidate, kept if its validation improved
    val_loss (5 -> 7 -> 3: epochs 0 and 2), removed otherwise; the best
    survives max_to_keep=1 meanwhile, and holds the state its epoch ended at."""
    strategy = ParameterServerStrategy(cluster.spec)
    w, step, source = counting(strategy, "best_w")
    manager = CheckpointManager(strategy, str(tmp_path / "best"), max_to_keep=1)
    cb = CheckpointCallback(manager, save_best_only=True, monitor="val_loss")
    with ClusterCoordinator(strategy) as coord, warnings.catch_warnings():
        warnings.simplefilter("error")   # no "not in the epoch logs"
        ds = coord.create_sharded_dataset(source, BATCH)
        fit(coord, step, ds, epochs=3, verbose=0, background_validation=True,
            validation_fn=lambda epoch: {"loss": [5.0, 7.0, 3.0][epoch]}, callbacks=[cb])
    assert cb.best == 3.0 and len(cb.saved) == 2
    epochs = [read_manifest(p)["extra"]["epoch"] for p in manager.checkpoints()]
    assert epochs == [1, 3]   # epoch 1's (val_loss 7) was removed
    assert [read_manifest(p)["extra"]["epoch"] for p in cb.saved] == [1, 3]
    for path, value in zip(cb.saved, (1.0, 3.0)):
        manager.restore(path)
        np.testing.assert_array_equal(w.read(), np.full((N, 1), value))


def test_save_best_only_keeps_a_slow_validations_candidate_and_another_callbacks_saves(
        cluster, tmp_path):
    """A candidate whose validation outlasts the next epoch is not removed by
    max_to_keep meanwhile (epoch 0's, the best, validated during epoch 1,
    whose own validation is skipped); a plain CheckpointCallback on the same
    manager keeps every checkpoint it saved, though the save_best_only one
    rejects the same steps' candidates."""
    strategy = ParameterServerStrategy(cluster.spec)
    w, step, source = counting(strategy, "slow_w")
    release = threading.Event()

    def validate(epoch):
        if epoch == 0:
            assert release.wait(60)
        return {"loss": [3.0, 9.0, 5.0][epoch]}

    class Release(Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                release.set()
    manager = CheckpointManager(strategy, str(tmp_path / "m"), max_to_keep=1)
    best = CheckpointCallback(manager, save_best_only=True, monitor="val_loss")
    with ClusterCoordinator(strategy) as coord:
        ds = coord.create_sharded_dataset(source, BATCH)
        fit(coord, step, ds, epochs=3, verbose=0, background_validation=True,
            validation_fn=validate, callbacks=[best, Release()])
    assert best.best == 3.0 and [read_manifest(p)["extra"]["epoch"] for p in best.saved] == [1]
    assert os.path.isdir(best.saved[0])
    manager.restore(best.saved[0])
    np.testing.assert_array_equal(w.read(), np.full((N, 1), 1.0))

    shared = CheckpointManager(strategy, str(tmp_path / "shared"), max_to_keep=5)
    plain = CheckpointCallback(shared)
    best = CheckpointCallback(shared, save_best_only=True, monitor="val_loss")
    with ClusterCoordinator(strategy) as coord:
        ds = coord.create_sharded_dataset(source, BATCH)
        fit(coord, step, ds, epochs=3, verbose=0, background_validation=True,
            validation_fn=lambda epoch: {"loss": [5.0, 7.0, 3.0][epoch]},
            callbacks=[best, plain])
    assert len(plain.saved) == 3 and all(os.path.isdir(p) for p in plain.saved)
    assert len(best.saved) == 2


def test_early_stopping_watches_background_validations_as_they_come():
    import types

    from coordinator import EarlyStopping
    state = types.SimpleNamespace(background_validation=True, stop_training=False, step=0)
    es = EarlyStopping(monitor="val_loss", patience=1)
    es.set_fit_state(state)
    es.on_train_begin()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # no "not in the epoch logs"
        es.on_epoch_end(0, {"loss": 1.0})
        es.on_validation_end(0, {"val_loss": 1.0})
        es.on_epoch_end(1, {"loss": 1.0})
        assert not state.stop_training
        es.on_validation_end(1, {"val_loss": 2.0})
    assert state.stop_training and es.stopped_epoch == 1 and es.best_epoch == 0


class _Sidecar:
    """`coordinator evaluate` as a process of its own, its output lines read
    as they come."""

    def __init__(self, ckpt_dir, logdir, until_step):
        tests = os.path.dirname(os.path.abspath(__file__))
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "evaluate", str(ckpt_dir),
             "--fn", "test_evaluation:evaluate_counter", "--logdir", str(logdir),
             "--interval", "0.1", "--until-step", str(until_step), "--metrics-port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=child_env({"PYTHONPATH": os.pathsep.join(
                [tests, child_env()["PYTHONPATH"]])}))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = 60) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {text!r} from the sidecar:\n{''.join(self.output)}")
            if line is None:
                raise AssertionError(f"the sidecar ended before {text!r}:\n"
                                     f"{''.join(self.output)}")
            self.output.append(line)
            if text in line:
                return line

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def test_a_sidecar_killed_and_restarted_during_training_changes_nothing_there(cluster, tmp_path):
    """Training checkpoints each epoch (incremental); the sidecar follows the directory.
    After the first checkpoint's evaluation it is SIGKILLed and started
    again while training goes on. Training ends with the exact counts; the
    sidecars evaluated each checkpoint at most once (the second goes on
    after the first's last), up to the last, into TensorBoard events."""
    epochs = 3
    strategy = ParameterServerStrategy(cluster.spec)
    w, step, source = counting(strategy, "ev_w")
    ckpt_dir, logdir = tmp_path / "ckpt", tmp_path / "eval"
    manager = CheckpointManager(strategy, str(ckpt_dir), max_to_keep=10,
                                incremental=True)   # a base, then deltas: read as chains
    sidecars = []
    try:
        with ClusterCoordinator(strategy) as coord:
            ds = coord.create_sharded_dataset(source, BATCH)
            steps = ds.batches_per_epoch
            sidecars.append(_Sidecar(ckpt_dir, logdir, until_step=epochs * steps))
            metrics_at = sidecars[0].wait_for("metrics on").split()[-1]

            class Restart(Callback):   # after epoch 0's checkpoint: kill, start again
                def on_epoch_end(self, epoch, logs=None):
                    if epoch == 0:
                        sidecars[0].wait_for(f"(step {steps})")
                        got = scrape(metrics_at)
                        assert got.value("pstrain_evaluation_metric", source="sidecar",
                                         metric="mean") == 1.0
                        assert got.value("pstrain_evaluation_step", source="sidecar") == steps
                        sidecars[0].kill()
                        sidecars.append(_Sidecar(ckpt_dir, logdir, until_step=epochs * steps))
            history = fit(coord, step, ds, epochs=epochs, verbose=0,
                          callbacks=[CheckpointCallback(manager), Restart()])
            trained = w.read()
        assert sidecars[1].proc.wait(60) == 0, "".join(sidecars[1].output)
    finally:
        for s in sidecars:
            s.kill()
    np.testing.assert_array_equal(trained, np.full((N, 1), float(epochs)))  # as without it
    assert history.epoch == [0, 1, 2] and ds.epochs_completed == epochs
    assert ["chain" in read_manifest(p) for p in manager.checkpoints()] == [False, True, True]
    events = read_events(logdir / "evaluation")
    evaluated = sorted(s for s, _ in events["eval_mean"])   # (two processes' files)
    assert len(evaluated) == len(set(evaluated))            # each checkpoint at most once
    assert evaluated[0] == steps and evaluated[-1] == epochs * steps
    assert all(v == s / steps for s, v in events["eval_mean"])
    # In process: a hung evaluation is abandoned; older new checkpoints are skipped.
    hang = threading.Event()
    sidecar = Sidecar(str(ckpt_dir), lambda ckpt: hang.wait(60), str(tmp_path / "hung"),
                      timeout=0.3)
    try:
        assert sidecar.step_once() == epochs * steps and sidecar.step_once() is None
        assert (sidecar.abandoned, sidecar.skipped, sidecar.evaluated) == (1, epochs - 1, 0)
    finally:
        hang.set()
        sidecar.close()


def test_evaluate_command_says_what_is_wrong(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "coordinator", "evaluate", *args],
                              capture_output=True, text=True, timeout=60, env=child_env())
    r = run(str(tmp_path), "--fn", "no_such_module:f", "--logdir", str(tmp_path / "l"))
    assert r.returncode == 1 and "cannot load --fn no_such_module:f" in r.stderr
    r = run(str(tmp_path), "--fn", "json:dumps", "--logdir", str(tmp_path / "l"),
            "--timeout", "0")
    assert r.returncode == 2 and "must be > 0" in r.stderr
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "evaluator_state.json").write_text("{not json")
    r = run(str(tmp_path), "--fn", "json:dumps", "--logdir", str(tmp_path / "l"), "--once")
    assert r.returncode == 2 and "remove it" in r.stderr
    (tmp_path / "l" / "evaluator_state.json").unlink()
    r = run(str(tmp_path / "empty"), "--fn", "json:dumps", "--logdir", str(tmp_path / "l"),
            "--once")
    assert r.returncode == 0 and "following" in r.stdout


def test_evaluate_without_tensorboardx_exits_at_once_and_says_what_to_install(cluster,
                                                                               tmp_path):
    """Without tensorboardX (here: an import of it that fails, first on the
    path) `coordinator evaluate` used to evaluate the first checkpoint and
    then crash before writing its state, so a restarted sidecar looped. It
    exits 2 at start, naming the extra, having evaluated nothing."""
    strategy = ParameterServerStrategy(cluster.spec)
    strategy.create_variable("tbx_w", shape=(2,), optimizer="sgd")
    CheckpointManager(strategy, str(tmp_path / "ckpt")).save(1)
    hidden = tmp_path / "hidden" / "tensorboardX"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('tensorboardX hidden by the test')\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run(
        [sys.executable, "-m", "coordinator", "evaluate", str(tmp_path / "ckpt"),
         "--fn", "test_evaluation:evaluate_step", "--logdir", str(tmp_path / "eval"), "--once"],
        capture_output=True, text=True, timeout=60,
        env=child_env({"PYTHONPATH": os.pathsep.join(
            [str(tmp_path / "hidden"), tests, child_env()["PYTHONPATH"]])}))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'pstrain[viz]'" in r.stderr and "Traceback" not in r.stderr
    assert "step 1" not in r.stdout   # nothing evaluated
    assert not (tmp_path / "eval" / "evaluator_state.json").exists()


def test_a_damaged_checkpoint_does_not_stop_the_side_evaluator_for_good(cluster, tmp_path):
    """Issue 33 item 9: a ckpt-99999999 whose manifest is broken was recorded
    as evaluated, so every real checkpoint after it (of a lower step) was
    never evaluated. It is skipped now, recording nothing."""
    strategy = ParameterServerStrategy(cluster.spec)
    w = strategy.create_variable("ev_damaged", initial_value=np.ones((2, 1), np.float32))
    try:
        manager = CheckpointManager(strategy, str(tmp_path / "ckpt"))
        bad = tmp_path / "ckpt" / "ckpt-99999999"
        bad.mkdir(parents=True)
        (bad / "manifest.json").write_text("{not json")
        ev = Sidecar(str(tmp_path / "ckpt"), evaluate_step, str(tmp_path / "eval"))
        assert ev.step_once() == 99999999 and ev.last_step == -1 and ev.failed == 1
        manager.save(10)   # a real checkpoint after it
        assert ev.step_once() == 10 and ev.last_step == 10 and ev.evaluated == 1
        assert ev.step_once() is None   # both done: nothing pending
        # (issue 33 item 12(d)) a sidecar started again goes on after what the
        # state file recorded, evaluating nothing twice (the unreadable one is
        # tried again, once: what cannot be read is not recorded)
        again = Sidecar(str(tmp_path / "ckpt"), evaluate_step, str(tmp_path / "eval"))
        assert again.last_step == 10
        assert again.step_once() == 99999999 and again.evaluated == 0
        assert again.step_once() is None and again.last_step == 10
    finally:
        strategy.delete_variable(w)
