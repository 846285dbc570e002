"""The examples: numpy gradients checked, then each example trained end to end.

The end-to-end tests start real clusters (parameter servers and workers as
processes on 127.0.0.1) through each example's ``main()``.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:          # `pytest` (not `python -m pytest`) from anywhere
    sys.path.insert(0, ROOT)

from examples import embedding_bag, nn  # noqa: E402
from psserver.process import child_env  # noqa: E402


def numeric_grad(f, arrays, eps=1e-6):
    """Central finite differences of the scalar f() w.r.t. each array (changed in place)."""
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            old = a[i]
            a[i] = old + eps
            up = f()
            a[i] = old - eps
            down = f()
            a[i] = old
            g[i] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("loss", ["softmax_cross_entropy", "mse", "sigmoid_cross_entropy"])
def test_mlp_gradients_match_finite_differences(loss):
    rng = np.random.default_rng(0)
    out = 4 if loss == "softmax_cross_entropy" else 2
    model = nn.MLP([3, 5, 6, out], loss=loss)
    params = model.init_params(seed=1)
    params[1] += 0.1 * rng.standard_normal(params[1].shape)   # nonzero biases too
    x = rng.standard_normal((7, 3))
    y = {"softmax_cross_entropy": rng.integers(0, out, 7),
         "mse": rng.standard_normal((7, out)),
         "sigmoid_cross_entropy": rng.integers(0, 2, (7, out)).astype(float)}[loss]
    value, grads = model.loss_and_grads(params, x, y)
    assert value == pytest.approx(model.loss_and_grads(params, x, y)[0])
    expected = numeric_grad(lambda: model.loss_and_grads(params, x, y)[0], params)
    for g, e in zip(grads, expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-8)


def test_softmax_cross_entropy_is_stable():
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]])
    loss, grad = nn.softmax_cross_entropy(logits, np.array([0, 2]))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert loss == pytest.approx(np.log(3) / 2)
    loss, grad = nn.sigmoid_cross_entropy(np.array([[800.0], [-800.0]]), np.array([[1.0], [0.0]]))
    assert loss == pytest.approx(0.0) and np.all(np.isfinite(grad))


def test_embedding_bag_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((5, 4, 3))
    w, b = rng.standard_normal((3, 1)), rng.standard_normal(1)
    labels = rng.integers(0, 2, 5).astype(float)
    _, drows, dw, db = embedding_bag.loss_and_grads(rows, w, b, labels)
    expected = numeric_grad(lambda: embedding_bag.loss_and_grads(rows, w, b, labels)[0],
                            [rows, w, b])
    for g, e in zip([drows, dw, db], expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-8)


def test_embedding_bag_data_is_deterministic_and_balanced_enough():
    ids, labels, sign = embedding_bag.make_data(500, vocab=1000, seed=3)
    ids2, labels2, _ = embedding_bag.make_data(500, vocab=1000, seed=3)
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(labels, labels2)
    assert ids.shape == (500, 20) and ids.min() >= 0 and ids.max() < 1000
    np.testing.assert_array_equal(labels, sign[ids].sum(axis=1) > 0)
    assert 0.3 < labels.mean() < 0.7
    held_out, _, _ = embedding_bag.make_data(500, vocab=1000, seed=3, split=1)
    assert not np.array_equal(ids, held_out)


# -- end to end: real processes ----------------------------------------------------------
@pytest.mark.timeout(60)
def test_regression_learns(capsys):
    from examples import regression
    out = regression.main(["--steps", "300"])
    assert out["steps"] == len(out["losses"]) == 300
    assert all(np.isfinite(out["losses"]))
    assert out["final_loss"] < out["initial_loss"] / 5, out
    assert "final loss" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_digits_reaches_90_percent(capsys):
    from examples import digits
    out = digits.main(["--epochs", "8", "--steps-per-epoch", "50"])
    assert out["steps"] == 400
    assert out["test_accuracy"] >= 0.90, out["test_accuracy"]
    text = capsys.readouterr().out
    assert "epoch 8/8  steps 400/400" in text and "workers 2" in text
    assert f"test accuracy: {out['test_accuracy']:.4f}" in text


@pytest.mark.timeout(90)
def test_digits_checkpoints_every_epoch_and_a_second_run_resumes(tmp_path, monkeypatch, capsys):
    """`--checkpoint-dir`: a checkpoint after each epoch; run again with more
    epochs, it restores the latest and trains only the epochs left."""
    from examples import digits
    monkeypatch.chdir(tmp_path)   # a local cluster's servers may write under the current dir
    args = ["--steps-per-epoch", "50", "--checkpoint-dir", "ck", "--no-plot", "--verbose", "2"]
    first = digits.main(["--epochs", "2", *args])
    assert first["steps"] == 100
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-00000050", "ckpt-00000100"]
    capsys.readouterr()
    second = digits.main(["--epochs", "3", *args])
    text = capsys.readouterr().out
    assert second["steps"] == 50, text          # epoch 3 alone
    assert "resumed from" in text and "ckpt-00000100 (epoch 2 of 3 done)" in text
    assert "epoch 3/3  steps 150/150" in text
    assert second["test_accuracy"] >= first["test_accuracy"] - 0.05
    assert "ckpt-00000150" in os.listdir(tmp_path / "ck")


@pytest.mark.timeout(60)
def test_embedding_bag_learns_with_a_sharded_table(capsys):
    out = embedding_bag.main([])
    assert out["num_shards"] == 2
    (addr0, off0, rows0), (addr1, off1, rows1) = out["shards"]
    assert addr0 != addr1 and (off0, rows0, off1, rows1) == (0, 10_000, 10_000, 10_000)
    assert out["test_accuracy"] >= 0.80, out["test_accuracy"]
    assert "in 2 shards" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_digits_runs_as_a_script_from_another_directory(tmp_path):
    """`python examples/digits.py`: the example makes itself and examples.nn importable."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "digits.py"), "--epochs", "2",
         "--steps-per-epoch", "50", "--num-workers", "1", "--num-ps", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "epoch 2/2  steps 100/100" in proc.stdout
    acc = float(proc.stdout.strip().splitlines()[-1].split(":")[1])
    assert acc >= 0.85, proc.stdout


# -- installing the torch example -------------------------------------------------------------
def test_torch_example_and_readme_name_the_same_extras_and_the_cpu_build():
    """docs/checkpoints.md, examples/torch_digits.py and the torch examples'
    message without torch say the same `pip install -e ".[...]"`
    for the torch example, every extra in it exists, and both install
    PyTorch's CPU build first (PyPI's default Linux torch is GBs of CUDA)."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    with open(os.path.join(ROOT, "examples", "torch_digits.py")) as f:
        example = f.read()
    with open(os.path.join(ROOT, "docs", "checkpoints.md")) as f:   # its PyTorch item
        readme = f.read()
    install = re.compile(r"""pip install -e ["']\.\[([\w,]+)\]["']""")
    in_example = set(install.findall(example))
    in_readme = {m for m in install.findall(readme) if "torch" in m.split(",")}
    assert in_example and in_example == in_readme, (in_example, in_readme)
    for named in in_example:
        assert set(named.split(",")) <= set(extras), (named, sorted(extras))
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in example and cpu in readme
    from coordinator.local import TORCH_INSTALL
    assert set(install.findall(TORCH_INSTALL)) == in_example and cpu in TORCH_INSTALL


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:   # gone
        return ""


@pytest.mark.timeout(90)
def test_ctrl_c_stops_the_main_job_quietly_with_its_tasks(tmp_path):
    """Ctrl-C at a terminal: SIGINT to the job's whole process group. The job
    says so in one line, stops its LocalCluster and exits 130, without a
    traceback or closures re-queued on workers that were told to stop."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "examples", "digits.py"), "--epochs", "1000",
         "--no-plot"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)   # a process group of its own, as a shell's job
    lines: "queue.Queue[str | None]" = queue.Queue()
    out: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:   # until it trains: its first epoch line
            line = lines.get(timeout=60)
            assert line is not None, "".join(out)
            out.append(line)
            if line.startswith("epoch 1/"):
                break
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            tasks = [int(pid) for pid in f.read().split()]
        roles = sorted(_cmdline(pid).split(" -m ")[1].split()[0] for pid in tasks)
        assert roles == ["psserver", "psserver", "psworker", "psworker"], roles
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        while (line := lines.get(timeout=10)) is not None:
            out.append(line)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(out)
    assert "interrupted; stopping the cluster\n" in text, text
    assert "Traceback" not in text and "re-queue" not in text, text
    assert [pid for pid in tasks if _cmdline(pid)] == [], "tasks left running"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("program", ["evaluate", "serve_ctr"])
def test_ctrl_c_in_the_evaluator_and_the_serving_copy_ends_in_one_line_and_130(tmp_path,
                                                                               program):
    """Issue 35 item 6: Ctrl-C in `coordinator evaluate` and in
    `serve_ctr.py --follow` printed a raw KeyboardInterrupt traceback."""
    from coordinator import LocalCluster, ParameterServerStrategy
    from coordinator.serving import Exporter
    export = tmp_path / "export"
    with LocalCluster(num_ps=1, num_workers=0, checkpoint_dirs=(str(tmp_path),)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        from examples import ctr
        ctr.build(strategy, 0, 0.1)   # the model serve_ctr.py scores, as created
        Exporter(strategy, str(export)).export()
    cmd = ([sys.executable, "-m", "coordinator", "evaluate", str(export), "--fn", "json:dumps",
            "--logdir", str(tmp_path / "logs"), "--interval", "60"] if program == "evaluate"
           else [sys.executable, os.path.join(ROOT, "examples", "serve_ctr.py"), "--export",
                 str(export), "--follow", "600", "--eval-batches", "1", "--batch-size", "8"])
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=child_env())
    try:
        first = proc.stdout.readline()   # it runs: "following ..." / "serving ..."
        assert ("following" if program == "evaluate" else "serving") in first, first
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        text = first + proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


@pytest.mark.parametrize("example", ["ctr", "serve_ctr", "digits", "regression",
                                     "embedding_bag"])
def test_an_examples_help_says_its_first_sentence_whole(example):
    """Issue 35 item 8: descriptions stopped mid-sentence (the docstring's first line)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", f"{example}.py"),
                        "--help"], capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stdout.split("\n\n")[1].split())   # (after the usage lines)
    assert said.endswith("."), said
    import importlib
    doc = importlib.import_module(f"examples.{example}").__doc__
    assert said == " ".join(doc.strip().split("\n\n")[0].split())
