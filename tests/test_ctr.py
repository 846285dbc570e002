"""The click-through-rate workload: the Criteo-shaped generator
(coordinator/ctr_data.py), the DLRM-style model (examples/dlrm.py), and
examples/ctr.py training it on real processes with a dynamic table."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import ctr_data as D
from examples import dlrm as M


def test_batches_are_deterministic_and_random_access():
    a = D.batch(3, 7, 256)
    again = D.batch(3, 7, 256)
    for x, y in zip(a, again):
        np.testing.assert_array_equal(x, y)
    stream = D.shard(3, 1, 3, 256)            # worker 1 of 3: batches 1, 4, 7
    for _ in range(2):
        next(stream)
    for x, y in zip(next(stream), a):
        np.testing.assert_array_equal(x, y)
    other = D.batch(4, 7, 256)
    assert not np.array_equal(other.sparse, a.sparse)


def test_shapes_ids_and_click_rate_look_like_criteo():
    b = D.batch(0, 0, 50_000)
    assert b.dense.shape == (50_000, 13) and b.dense.dtype == np.float32
    assert b.sparse.shape == (50_000, 26) and b.sparse.dtype == np.int64
    assert b.labels.dtype == np.float32 and set(np.unique(b.labels)) == {0.0, 1.0}
    assert (b.dense >= 0).all() and b.dense.max() > 5          # log1p of heavy-tailed counts
    assert 0.15 < b.labels.mean() < 0.32
    ids = b.sparse
    assert (ids < 0).mean() > 0.4 and (np.abs(ids) > 2**40).mean() > 0.99   # hashes, not ranks
    f0 = ids[:, 0]                                             # vocabulary of 50M: Zipf
    values, counts = np.unique(f0, return_counts=True)
    top = np.sort(counts)[::-1]
    assert values.size > 10_000 and top[:10].sum() > 0.15 * f0.size
    small = np.unique(ids[:, 8])                               # a 3-value feature
    assert small.size == 3
    assert len(np.intersect1d(ids[:, 0], ids[:, 2])) == 0      # features never share an id


def test_auc_is_sklearns_ties_included():
    from sklearn.metrics import roc_auc_score
    rng = np.random.default_rng(0)
    labels = (rng.random(5000) < 0.3).astype(np.float32)
    for scores in (rng.random(5000), np.round(rng.random(5000), 1), labels + rng.random(5000)):
        assert D.auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    with pytest.raises(ValueError):
        D.auc(np.zeros(5), np.arange(5))


def test_the_planted_model_is_learnable_but_not_trivial():
    ceiling = D.bayes_auc(1, 50_000)
    assert 0.8 < ceiling < 0.95
    b = D.batch(1, 0, 50_000)
    assert 0.55 < D.auc(b.labels, b.dense @ D.DENSE_WEIGHTS) < ceiling - 0.1   # dense alone


def test_dlrm_gradients_are_the_losss_derivatives():
    rng = np.random.default_rng(1)
    params = M.init_params(2, np.float64)
    n = 4
    dense = rng.normal(size=(n, 13))
    rows = rng.normal(size=(n, 26, M.DIM)) * 0.3
    labels = (rng.random(n) < 0.5).astype(np.float64)
    loss, grads, row_grads = M.loss_and_grads(params, dense, rows, labels)
    assert set(grads) == set(params) and row_grads.shape == rows.shape

    def numeric(change):
        eps = 1e-6
        plus = change(eps)
        minus = change(-eps)
        return (plus - minus) / (2 * eps)
    for name in params:
        for _ in range(3):
            idx = tuple(int(rng.integers(0, s)) for s in params[name].shape)

            def at(eps, name=name, idx=idx):
                p = {k: v.copy() for k, v in params.items()}
                p[name][idx] += eps
                return M.loss_and_grads(p, dense, rows, labels)[0]
            assert numeric(at) == pytest.approx(grads[name][idx], rel=1e-5, abs=1e-9), name
    for _ in range(5):
        idx = tuple(int(rng.integers(0, s)) for s in rows.shape)

        def at_row(eps, idx=idx):
            r = rows.copy()
            r[idx] += eps
            return M.loss_and_grads(params, dense, r, labels)[0]
        assert numeric(at_row) == pytest.approx(row_grads[idx], rel=1e-5, abs=1e-9)


@pytest.mark.timeout(240)
def test_the_ctr_example_learns_on_dynamic_tables():
    """examples/ctr.py on a LocalCluster (2 ps, 2 workers): AUC rises well
    above chance, below the planted model's, and the table admitted keys."""
    from examples import ctr
    out = ctr.main(["--epochs", "2", "--steps-per-epoch", "80", "--batch-size", "256",
                    "--eval-batches", "10", "--verbose", "0"])
    assert out["aucs"][-1] > out["aucs"][0] - 0.01
    assert 0.6 < out["auc"] < out["ceiling"]
    assert out["rows"] > 10_000 and out["samples_per_second"] > 0
