"""fit, its callbacks, progress output and plots; fit runs on real LocalCluster processes."""
from __future__ import annotations

import io
import itertools
import json
import os
import re
import struct
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:          # examples.* importable here and on the workers
    sys.path.insert(0, ROOT)

from coordinator import (  # noqa: E402
    ClusterCoordinator,
    LocalCluster,
    ParameterServerStrategy,
    StepFunctionError,
    batches,
    push_gradients,
    read_variables,
)
from coordinator.callbacks import (  # noqa: E402
    Callback,
    CheckpointCallback,
    EarlyStopping,
    History,
    LambdaCallback,
    PlotHistory,
    TensorBoard,
    TerminateOnNaN,
)
from coordinator.checkpoint import CheckpointManager  # noqa: E402
from coordinator.fit import fit  # noqa: E402
from coordinator.plots import plot_history, try_plot_history  # noqa: E402
from coordinator.progress import Progress, format_seconds  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TRUE_W = np.array([[1.0], [-2.0], [0.5], [3.0], [-1.0]])


# -- progress: no cluster ------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_writes_lines_every_n_steps_when_not_a_terminal():
    out, clock = io.StringIO(), FakeClock()        # StringIO.isatty() is False
    p = Progress(total=100, file=out, log_every_seconds=None, log_every_steps=25,
                 workers=lambda: (2, 3), desc="epoch 1/4", clock=clock)
    p.scheduled(40)
    for i in range(100):
        clock.now += 0.2                            # 5 steps/s
        p.update(1, loss=1.0 / (i + 1))
    p.close()
    p.close()                                       # idempotent
    lines = out.getvalue().splitlines()
    assert p.interactive is False and "\r" not in out.getvalue()
    assert len(lines) == 5, lines
    assert lines[0] == ("progress: epoch 1/4  step 25/100  scheduled 40  5.0 steps/s  "
                        "loss 0.0400  workers 2/3  elapsed 5s  eta 15s")
    assert [ln.split("  ")[1] for ln in lines[:4]] == [f"step {n}/100" for n in (25, 50, 75, 100)]
    assert "scheduled 100" in lines[3] and lines[3].endswith("elapsed 20s  eta 0s")
    assert lines[4] == "progress: done  100 steps in 20s  5.0 steps/s  loss 0.0100"


def test_progress_says_stopped_when_it_ends_short_of_its_total():
    """Issue 35 item 12: "progress: done 394 steps" after an interrupt."""
    out, clock = io.StringIO(), FakeClock()
    p = Progress(total=100, file=out, log_every_seconds=None, log_every_steps=1000, clock=clock)
    for _ in range(40):
        clock.now += 0.5
        p.update(1)
    p.close()
    assert out.getvalue().splitlines()[-1].startswith("progress: stopped after 40 steps in ")


def test_progress_lines_by_time_also_while_no_step_finishes():
    out, clock = io.StringIO(), FakeClock()
    alive = [2]
    p = Progress(total=None, file=out, interactive=False, log_every_seconds=10,
                 workers=lambda: (alive[0], 2), clock=clock)
    p.update(3)
    clock.now += 9
    p.tick()
    assert out.getvalue() == ""                     # not due yet
    alive[0] = 0
    clock.now += 1
    p.tick()                                        # due: a stalled run still reports
    clock.now += 5
    p.tick()
    assert out.getvalue().splitlines() == [
        "progress: step 3/?  scheduled 3  0.3 steps/s  workers 0/2  elapsed 10s"]


def test_progress_draws_a_tqdm_bar_when_interactive(capsys):
    bar_out = io.StringIO()
    p = Progress(total=10, file=bar_out, interactive=True, workers=lambda: (2, 2),
                 desc="epoch 1/1")
    p.scheduled(10)
    for _ in range(10):
        p.update(1, loss=0.5)
    p.write("epoch 1/1  steps 10/10  loss 0.5000")
    p.close()
    text = bar_out.getvalue()
    assert "\r" in text and "10/10" in text and "step/s" in text
    assert "loss=0.5000" in text and "workers=2/2" in text and "scheduled=10" in text
    assert "progress:" not in text
    assert capsys.readouterr().out == "epoch 1/1  steps 10/10  loss 0.5000\n"


def test_format_seconds():
    assert [format_seconds(s) for s in (0, 6.4, 125, 3720, float("inf"))] == \
        ["0s", "6s", "2m05s", "1h02m", "?"]


# -- plots: no cluster ------------------------------------------------------------------------
def assert_png(path, min_bytes=10_000):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_SIGNATURE, data[:16]
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 400 and height >= 300, (width, height)
    assert len(data) >= min_bytes, len(data)
    return width, height


def synthetic_history(epochs=5, steps=20) -> History:
    h = History()
    h.set_params({"epochs": epochs, "steps": steps})
    rng = np.random.default_rng(0)
    for e in range(epochs):
        losses = np.exp(-(e * steps + np.arange(steps)) / 40) + 0.05 * rng.random(steps)
        for i, v in enumerate(losses):
            h.steps.append(e * steps + i + 1)
            h.step_history.setdefault("loss", []).append(float(v))
        h.on_epoch_end(e, {"loss": float(losses.mean()), "val_loss": float(losses.mean()) + .1,
                           "val_accuracy": 0.5 + 0.1 * e})
    return h


def test_plot_history_writes_a_png(tmp_path):
    h = synthetic_history()
    path = plot_history(h, str(tmp_path / "sub" / "curve.png"), title="synthetic")
    assert path == str(tmp_path / "sub" / "curve.png")
    _, height_two_panels = assert_png(path)
    # A plain dict works too; one panel (loss only) is shorter.
    path2 = plot_history({"loss": [3.0, 2.0, 1.5]}, str(tmp_path / "dict.png"), per_step=False)
    _, height_one_panel = assert_png(path2, min_bytes=5_000)
    assert height_one_panel < height_two_panels
    assert os.listdir(tmp_path / "sub") == ["curve.png"]       # no temporary file left


def test_missing_matplotlib_is_one_line_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails
    path, message = try_plot_history(synthetic_history(), str(tmp_path / "x.png"))
    assert path is None and not (tmp_path / "x.png").exists()
    assert message == "plot: matplotlib is not installed (pip install 'pstrain[viz]'); no plot written"
    monkeypatch.undo()
    path, message = try_plot_history({}, str(tmp_path / "y.png"))
    assert (path, message) == (None, "plot: the history is empty: nothing to plot; no plot written")
    (tmp_path / "file").write_text("")
    path, message = try_plot_history({"loss": [1.0]}, str(tmp_path / "file" / "z.png"))
    assert path is None and message.startswith("plot: cannot write ") and "\n" not in message


# -- fit on a real cluster ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_ps=1, num_workers=2) as c:
        yield c


_names = itertools.count()


@pytest.fixture
def strategy(cluster):
    s = ParameterServerStrategy(cluster.spec)
    yield s
    for v in s.variables:
        s.delete_variable(v)


@pytest.fixture
def coord(strategy):
    with ClusterCoordinator(strategy) as c:
        yield c


def make_problem(strategy, lr=0.05, optimizer="sgd"):
    """Noise-free linear regression: (w, train_step, dataset_fn, validation_fn)."""
    w = strategy.create_variable(f"fit{next(_names)}/w", shape=(5, 1), initializer="zeros",
                                 optimizer=optimizer, optimizer_params={"learning_rate": lr})
    x_val = np.random.default_rng(99).normal(size=(200, 5))
    y_val = x_val @ TRUE_W

    def dataset_fn(ctx):
        x = np.random.default_rng(ctx.input_pipeline_id).normal(size=(512, 5))
        return batches(x, x @ TRUE_W, batch_size=16, seed=ctx.input_pipeline_id)

    def train_step(it):
        x, y = next(it)
        (wv,) = read_variables([w])
        err = x @ wv - y
        push_gradients([(w, 2 * x.T @ err / len(x))])
        return {"loss": float((err ** 2).mean()), "mae": float(np.abs(err).mean())}

    def validation_fn(epoch):
        (wv,) = read_variables([w])
        return {"loss": float(((x_val @ wv - y_val) ** 2).mean())}

    return w, train_step, dataset_fn, validation_fn


@pytest.mark.timeout(60)
def test_fit_returns_a_history_whose_losses_decrease(coord, strategy, capsys):
    _, step, dataset_fn, val = make_problem(strategy)
    history = fit(coord, step, dataset_fn, epochs=4, steps_per_epoch=10, validation_fn=val)
    h = history.history
    assert history.epoch == [0, 1, 2, 3]
    assert sorted(h) == ["loss", "mae", "val_loss"]
    assert all(len(v) == 4 for v in h.values())
    assert all(b < a for a, b in zip(h["loss"], h["loss"][1:])), h["loss"]
    assert all(b < a for a, b in zip(h["val_loss"], h["val_loss"][1:])), h["val_loss"]
    assert h["loss"][-1] < h["loss"][0] / 5
    # Per step: every step's values, in order, and their means are the epoch's.
    assert history.steps == list(range(1, 41))
    assert len(history.step_history["loss"]) == 40
    assert np.mean(history.step_history["mae"][:10]) == pytest.approx(h["mae"][0])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 4 and lines[3].startswith("epoch 4/4  steps 40/40  loss ")
    assert " val_loss " in lines[3] and lines[3].endswith("workers 2")
    # Not a terminal (captured): progress lines on stderr, no bar.
    assert "\r" not in err and err.splitlines()[-1].startswith("progress: done  40 steps in ")


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, logs=None):
        self.events.append(("train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(("epoch_begin", epoch))

    def on_batch_begin(self, batch, logs=None):     # via Keras' on_train_batch_begin
        self.events.append(("batch_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("batch_end", batch, sorted(logs), self.fit_state.step))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch_end", epoch, sorted(logs)))

    def on_train_end(self, logs=None):
        self.events.append(("train_end", sorted(logs)))


@pytest.mark.timeout(60)
def test_callbacks_are_called_in_order(coord, strategy, capsys):
    _, step, dataset_fn, val = make_problem(strategy)
    rec = Recorder()
    lam = []
    history = fit(coord, step, dataset_fn, epochs=2, steps_per_epoch=6, validation_fn=val,
                  callbacks=[rec, LambdaCallback(on_epoch_end=lambda e, logs: lam.append(e))],
                  verbose=0, max_pending_steps=3)
    assert capsys.readouterr() == ("", "")           # verbose=0: silent
    ev = rec.events
    assert ev[0] == ("train_begin",) and ev[-1] == ("train_end", ["loss", "mae", "val_loss"])
    assert [e for e in ev if e[0].startswith("epoch")] == [
        ("epoch_begin", 0), ("epoch_end", 0, ["loss", "mae", "val_loss"]),
        ("epoch_begin", 1), ("epoch_end", 1, ["loss", "mae", "val_loss"])]
    for epoch in range(2):
        start = ev.index(("epoch_begin", epoch))
        end = ev.index(("epoch_end", epoch, ["loss", "mae", "val_loss"]))
        inner = ev[start + 1:end]
        assert [e[1] for e in inner if e[0] == "batch_begin"] == list(range(6))
        assert [e[1] for e in inner if e[0] == "batch_end"] == list(range(6))
        assert all(e[2] == ["loss", "mae"] for e in inner if e[0] == "batch_end")
        assert [e[3] for e in inner if e[0] == "batch_end"] == [epoch * 6 + i for i in range(1, 7)]
        pending = 0
        for e in inner:                              # never more than 3 scheduled ahead
            pending += 1 if e[0] == "batch_begin" else -1
            assert 0 <= pending <= 3
        # Every step is scheduled before it ends.
        for i in range(6):
            assert inner.index(("batch_begin", i)) < [j for j, e in enumerate(inner)
                                                      if e[:2] == ("batch_end", i)][0]
    assert lam == [0, 1]
    assert rec.model is rec.fit_state and rec.params["steps"] == 6
    assert history.history["loss"] and rec.fit_state.history is history


@pytest.mark.timeout(60)
def test_fit_in_sync_mode_counts_global_steps(cluster):
    strategy = ParameterServerStrategy(cluster.spec, mode="sync")
    try:
        _, step, dataset_fn, val = make_problem(strategy, lr=0.1)
        with ClusterCoordinator(strategy) as coord:
            history = fit(coord, step, dataset_fn, epochs=3, steps_per_epoch=8,
                          validation_fn=val, verbose=0)
        assert history.steps == list(range(1, 25))       # one per global step, not replica
        losses = history.history["val_loss"]
        assert all(b < a for a, b in zip(losses, losses[1:])), losses
    finally:
        for v in strategy.variables:
            strategy.delete_variable(v)


@pytest.mark.timeout(60)
def test_lambda_callback_hooks_get_logs_as_in_keras(coord, strategy):
    _, step, dataset_fn, _ = make_problem(strategy)
    calls = []
    fit(coord, step, dataset_fn, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[
        LambdaCallback(on_train_begin=lambda logs: calls.append(("tb", logs)),
                       on_epoch_begin=lambda e, logs: calls.append(("eb", e, logs)),
                       on_train_batch_begin=lambda b, logs: calls.append(("bb", b, logs)),
                       on_train_batch_end=lambda b, logs: calls.append(("be", b, sorted(logs))),
                       on_epoch_end=lambda e, logs: calls.append(("ee", e, sorted(logs))),
                       on_train_end=lambda logs: calls.append(("te", sorted(logs))))])
    assert calls == [("tb", {}), ("eb", 0, {}), ("bb", 0, {}), ("bb", 1, {}),
                     ("be", 0, ["loss", "mae"]), ("be", 1, ["loss", "mae"]),
                     ("ee", 0, ["loss", "mae"]), ("te", ["loss", "mae"])]
    with pytest.raises(TypeError, match="unknown hooks"):
        LambdaCallback(on_step_end=print)


@pytest.mark.timeout(60)
def test_early_stopping_stops_when_the_monitor_stalls(coord, strategy):
    _, step, dataset_fn, _ = make_problem(strategy)
    stopper = EarlyStopping(monitor="val_loss", patience=2)
    history = fit(coord, step, dataset_fn, epochs=20, steps_per_epoch=3, verbose=0,
                  validation_fn=lambda: {"loss": 1.0}, callbacks=[stopper])
    # Epoch 0 sets the best; epochs 1 and 2 do not improve on it: stop after epoch 2.
    assert history.epoch == [0, 1, 2] and stopper.stopped_epoch == 2
    assert stopper.best == 1.0 and stopper.best_epoch == 0 and len(history.steps) == 9


@pytest.mark.timeout(60)
def test_early_stopping_restores_the_best_epoch(coord, strategy, tmp_path):
    w, step, dataset_fn, _ = make_problem(strategy)
    fake_val = iter([3.0, 1.0, 2.0, 4.0, 5.0])      # best at epoch 1
    seen = {}
    remember = LambdaCallback(on_epoch_end=lambda e, logs: seen.__setitem__(
        e, read_variables([w])[0]))
    stopper = EarlyStopping(monitor="val_loss", patience=2,
                            restore_best=CheckpointManager(strategy, str(tmp_path / "best")))
    history = fit(coord, step, dataset_fn, epochs=10, steps_per_epoch=4, verbose=0,
                  validation_fn=lambda e: {"loss": next(fake_val)}, callbacks=[remember, stopper])
    assert history.history["val_loss"] == [3.0, 1.0, 2.0, 4.0]
    assert stopper.stopped_epoch == 3 and stopper.best_epoch == 1
    assert stopper.restored and stopper.restored.endswith("ckpt-00000008")
    np.testing.assert_array_equal(read_variables([w])[0], seen[1])
    assert not np.array_equal(seen[1], seen[3])


@pytest.mark.timeout(60)
def test_a_callback_can_stop_mid_epoch(coord, strategy):
    _, step, dataset_fn, val = make_problem(strategy)

    def stop_after_third(batch, logs):
        if batch == 2:
            stopper.model.stop_training = True       # Keras spelling

    stopper = LambdaCallback(on_train_batch_end=stop_after_third)
    history = fit(coord, step, dataset_fn, epochs=5, steps_per_epoch=50, verbose=0,
                  validation_fn=val, callbacks=[stopper], max_pending_steps=1)
    # Steps in flight finish; the epoch still ends (validation, on_epoch_end).
    assert history.epoch == [0] and len(history.steps) == 3
    assert sorted(history.history) == ["loss", "mae", "val_loss"]


@pytest.mark.timeout(60)
def test_terminate_on_nan(coord, strategy):
    w = strategy.create_variable(f"fit{next(_names)}/nan", shape=(1,), initializer="zeros")
    history = fit(coord, nan_after_two, lambda: itertools.count(), epochs=3,
                  steps_per_epoch=20, verbose=0, callbacks=[TerminateOnNaN()],
                  max_pending_steps=1)
    # Each worker counts its own batches: the first NaN comes within 5 steps, and
    # training stops right there (one step in flight at a time).
    losses = history.step_history["loss"]
    assert history.epoch == [0] and 3 <= len(losses) <= 5
    assert np.isnan(losses[-1]) and not np.isnan(losses[:-1]).any()
    assert np.isnan(history.history["loss"][0])
    del w


def nan_after_two(it):
    return float("nan") if next(it) >= 2 else 1.0


@pytest.mark.timeout(60)
def test_checkpoint_callback_writes_checkpoints_and_fit_resumes(coord, strategy, tmp_path,
                                                                capsys):
    w, step, dataset_fn, val = make_problem(strategy)
    manager = CheckpointManager(strategy, str(tmp_path / "ckpt"), max_to_keep=10)
    saver = CheckpointCallback(manager, every_epochs=2)
    fit(coord, step, dataset_fn, epochs=4, steps_per_epoch=5, validation_fn=val,
        callbacks=[saver], verbose=2)
    names = [os.path.basename(p) for p in manager.checkpoints()]
    assert names == ["ckpt-00000010", "ckpt-00000020"] and saver.saved == manager.checkpoints()
    with open(os.path.join(manager.latest(), "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["step"] == 20 and manifest["extra"]["epoch"] == 4
    assert sorted(manifest["extra"]["logs"]) == ["loss", "mae", "val_loss"]
    assert list(manifest["variables"]) == [w.name]
    # Resume: restore, and go on from the stored epoch.
    state = manager.restore()
    history = fit(coord, step, dataset_fn, epochs=5, steps_per_epoch=5,
                  initial_epoch=state["extra"]["epoch"], verbose=2)
    assert history.epoch == [4] and history.steps == [21, 22, 23, 24, 25]
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("epoch 5/5  steps 25/25  loss ")
    assert "progress:" not in err                    # verbose=2: epoch lines only


def read_events(directory):
    """Scalars {tag: [(step, value)]} from the TFRecord event files in ``directory``."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    scalars = {}
    files = sorted(f for f in os.listdir(directory) if "tfevents" in f)
    assert files, os.listdir(directory)
    for name in files:
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
            body = data[pos + 12:pos + 12 + length]
            assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == \
                masked_crc32c(body)
            pos += 16 + length
            event = Event.FromString(body)
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars


@pytest.mark.timeout(60)
def test_tensorboard_event_files_read_back(coord, strategy, tmp_path):
    _, step, dataset_fn, val = make_problem(strategy)
    tb = TensorBoard(str(tmp_path / "tb"))
    history = fit(coord, step, dataset_fn, epochs=3, steps_per_epoch=5, validation_fn=val,
                  callbacks=[tb], verbose=0)
    train = read_events(tmp_path / "tb" / "train")
    valid = read_events(tmp_path / "tb" / "validation")
    assert sorted(train) == ["batch_loss", "batch_mae", "epoch_loss", "epoch_mae"]
    assert [s for s, _ in train["epoch_loss"]] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in train["epoch_loss"]], history.history["loss"],
                               rtol=1e-6)
    assert [s for s, _ in train["batch_loss"]] == list(range(1, 16))
    np.testing.assert_allclose([v for _, v in train["batch_loss"]],
                               history.step_history["loss"], rtol=1e-6)
    assert sorted(valid) == ["epoch_loss"]
    np.testing.assert_allclose([v for _, v in valid["epoch_loss"]], history.history["val_loss"],
                               rtol=1e-6)


@pytest.mark.timeout(60)
def test_plot_callback_writes_the_png_at_the_end(coord, strategy, tmp_path, capsys):
    _, step, dataset_fn, val = make_problem(strategy)
    plot = PlotHistory(str(tmp_path / "curves" / "loss.png"))
    fit(coord, step, dataset_fn, epochs=3, steps_per_epoch=8, validation_fn=val,
        callbacks=[plot], verbose=0)
    assert plot.path_written == str(tmp_path / "curves" / "loss.png")
    assert_png(plot.path_written)
    assert capsys.readouterr().out == f"loss curve: {plot.path_written}\n"


def fail_on_fourth(it):
    if next(it) == 3:
        raise ValueError("bad batch")
    return 0.5


@pytest.mark.timeout(60)
def test_a_step_error_ends_fit_and_the_coordinator_goes_on(coord, capsys):
    closed = []
    tracker = LambdaCallback(on_train_end=lambda logs: closed.append("end"))
    tracker.close = lambda: closed.append("close")
    with pytest.raises(StepFunctionError, match="bad batch"):
        fit(coord, fail_on_fourth, lambda: itertools.count(), epochs=2, steps_per_epoch=10,
            callbacks=[tracker], max_pending_steps=1)
    assert closed == ["close"]                       # closed, but no on_train_end
    assert coord.schedule(nan_after_two, args=(iter([0]),)).fetch() == 1.0
    assert "Traceback" not in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_bad_arguments(coord):
    with pytest.raises(ValueError, match="steps_per_epoch"):
        fit(coord, fail_on_fourth, lambda: [], steps_per_epoch=0)
    with pytest.raises(ValueError, match="verbose"):
        fit(coord, fail_on_fourth, lambda: [], steps_per_epoch=1, verbose=3)


# -- the main job ---------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_digits_writes_its_loss_curve_png(tmp_path, monkeypatch, capsys):
    from examples import digits
    monkeypatch.chdir(tmp_path)                      # the default path is relative: runs/digits/
    out = digits.main(["--epochs", "2", "--steps-per-epoch", "30", "--num-ps", "1",
                       "--num-workers", "1"])
    runs = tmp_path / "runs" / "digits"
    (run,) = os.listdir(runs)                        # a directory of this run's own
    assert re.fullmatch(rf"\d{{8}}-\d{{6}}-{os.getpid()}", run), run
    expected = str(runs / run / "loss.png")
    assert out["plot"] == expected
    assert_png(expected)
    text = capsys.readouterr().out.splitlines()
    assert f"loss curve: {expected}" in text and text[-1].startswith("test accuracy: ")
    assert sorted(out["history"]) == ["loss", "val_accuracy", "val_loss"]
    assert out["steps"] == len(out["losses"]) == 60
    # --no-plot writes nothing, and makes no run directory.
    out = digits.main(["--epochs", "1", "--steps-per-epoch", "5", "--num-ps", "1",
                       "--num-workers", "1", "--no-plot", "--verbose", "0"])
    assert out["plot"] is None and os.listdir(runs) == [run]
    assert capsys.readouterr().out.splitlines()[-1].startswith("test accuracy: ")
    # --plot PATH wins over the run directory.
    chosen = str(tmp_path / "mine.png")
    out = digits.main(["--epochs", "1", "--steps-per-epoch", "5", "--num-ps", "1",
                       "--num-workers", "1", "--plot", chosen, "--verbose", "0"])
    assert out["plot"] == chosen and os.listdir(runs) == [run]
    assert f"loss curve: {chosen}" in capsys.readouterr().out


def test_each_run_of_digits_gets_its_own_plot_path(tmp_path, monkeypatch):
    """Two runs at once (or one after another within a second) never share
    runs/digits/.../loss.png."""
    from examples import digits
    monkeypatch.chdir(tmp_path)
    first, second = digits.default_plot_path(), digits.default_plot_path()
    assert first != second and os.path.dirname(first) != os.path.dirname(second)
    for path in (first, second):
        assert os.path.isdir(os.path.dirname(path)) and not os.path.exists(path)
        assert os.path.dirname(os.path.dirname(path)) == os.path.join("runs", "digits")
        assert os.path.basename(path) == "loss.png"
    assert f"-{os.getpid()}" in first
