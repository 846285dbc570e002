"""Checkpoints and serving exports written by the code of 808e9e1 (before the
one-call-path redesign, protocol 2) still restore and serve: the files in
tests/data/ckpt-808e9e1/ were written by that commit's code with
tests/data/ckpt-808e9e1/make.py, beside the values they held (expected.npz)."""
from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

from coordinator import (
    CheckpointManager,
    FixedShardsPartitioner,
    Initializer,
    LocalCluster,
    ParameterServerStrategy,
    push_gradients,
)
from coordinator.serving import Snapshot

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "ckpt-808e9e1"


def model(strategy):
    """The variables and table make.py made (the same names, shapes, optimizers)."""
    w = strategy.create_variable("w", initial_value=np.zeros((6, 3), np.float32),
                                 optimizer="adam", optimizer_params={"learning_rate": 0.1})
    b = strategy.create_variable("b", initial_value=np.zeros(3, np.float32), optimizer="sgd",
                                 optimizer_params={"learning_rate": 0.5})
    t = strategy.create_embedding_table("emb", 4, optimizer="adagrad",
                                        optimizer_params={"learning_rate": 0.1},
                                        initializer=Initializer(kind="random_uniform",
                                                                minval=-0.1, maxval=0.1, seed=3))
    return w, b, t


def step(w, b, t, keys, k):
    """make.py's step k (a look-up, a dense push of both variables, a table push)."""
    g = np.random.default_rng(k).standard_normal((6, 3)).astype(np.float32)
    t.lookup(keys[: 3 + k % 3])
    push_gradients([(w, g), (b, np.full(3, k + 1.0, np.float32))])
    t.push_gradient(keys[: 3 + k % 3], np.full((3 + k % 3, 4), 0.1 * (k + 1), np.float32))


@pytest.fixture
def data(tmp_path):
    """A copy of the files (restoring reads them where every server may)."""
    shutil.copytree(DATA, tmp_path / "data")
    return tmp_path / "data", dict(np.load(tmp_path / "data" / "expected.npz"))


def same(w, b, t, keys, expected, tag):
    np.testing.assert_array_equal(w.read(), expected[f"{tag}/w"])
    np.testing.assert_array_equal(b.read(), expected[f"{tag}/b"])
    np.testing.assert_array_equal(t.lookup(keys, admit=False), expected[f"{tag}/emb"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_ps", [2, 3])
def test_checkpoints_written_by_808e9e1_restore_whole_and_train_on(data, num_ps):
    """A full checkpoint and every link of an incremental chain restore the
    values they held, into as many servers as then or more; after the last,
    the next step gives what 808e9e1 computed (the Adam and Adagrad slots,
    versions and update keys came back too)."""
    root, expected = data
    keys = expected["keys"]
    with LocalCluster(num_ps=num_ps, num_workers=0, checkpoint_dirs=[str(root)]) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w, b, t = model(strategy)
        full = CheckpointManager(strategy, str(root / "full"))
        full.restore(full.checkpoints()[0])
        same(w, b, t, keys, expected, "1")
        inc = CheckpointManager(strategy, str(root / "incremental"))
        paths = inc.checkpoints()
        assert len(paths) == 3
        for tag, path in zip(("1", "2", "3"), paths):
            inc.restore(path)
            same(w, b, t, keys, expected, tag)
        step(w, b, t, keys, 3)
        same(w, b, t, keys, expected, "4")


@pytest.mark.timeout(60)
def test_an_export_written_by_808e9e1_serves(data):
    """The serving copy (a base and a delta) loads and answers as the servers did."""
    root, expected = data
    snap = Snapshot(str(root / "export"))
    np.testing.assert_array_equal(snap.read("w"), expected["3/w"])
    np.testing.assert_array_equal(snap.read("b"), expected["3/b"])
    np.testing.assert_array_equal(snap.lookup("emb", expected["keys"]), expected["3/emb"])
