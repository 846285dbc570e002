"""The click-through-rate workload: the Criteo-shaped generator
(coordinator/ctr_data.py), the DLRM-style model (examples/dlrm.py) trained
in-process with plain SGD on dict-based tables, and examples/ctr.py training
it on real processes with a dynamic table."""
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
    assert not np.array_equal(D.batch(3, 8, 256).sparse, a.sparse)
    run = [D.batch(3, k, 256) for k in range(8)]           # batch 7 of a run of 0..7
    for x, y in zip(run[7], a):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError):
        next(D.shard(3, 3, 3, 256))


def test_raw_counts_and_other_vocabularies():
    b = D.batch(2, 0, 20_000)
    counts = D.raw_counts(b.dense)
    assert (counts >= 0).all() and (counts == np.floor(counts)).all()
    np.testing.assert_array_equal(np.log1p(counts).astype(np.float32), b.dense)
    assert np.median(counts) <= 3 and counts.max() > 500               # heavy tail
    small = tuple(min(v, 100) for v in D.VOCABS)
    s = D.batch(2, 0, 20_000, vocabs=small)
    np.testing.assert_array_equal(s.dense, b.dense)                     # only the ids change
    for f, v in enumerate(small):
        assert len(np.unique(s.sparse[:, f])) <= v
    # The same rank keeps its id: the small setting's values are among the
    # big one's most frequent.
    head = D.ids_of(np.repeat(np.arange(100)[:, None], 26, axis=1))   # ranks 0..99
    assert np.isin(s.sparse, head).all()
    assert np.isin(s.sparse[:, 0], head[:, 0]).all() and not np.isin(s.sparse[:, 0], head[:, 1]).any()
    with pytest.raises(ValueError):
        D.batch(0, 0, 10, vocabs=(10,) * 25)
    with pytest.raises(ValueError):
        D.batch(0, 0, 10, vocabs=(0,) + (10,) * 25)


def test_shapes_ids_and_click_rate_look_like_criteo():
    b = D.batch(0, 0, 50_000)
    assert b.dense.shape == (50_000, 13) and b.dense.dtype == np.float32
    assert b.sparse.shape == (50_000, 26) and b.sparse.dtype == np.int64
    assert b.labels.dtype == np.float32 and set(np.unique(b.labels)) == {0.0, 1.0}
    assert (b.dense >= 0).all() and b.dense.max() > 5          # log1p of heavy-tailed counts
    assert 0.15 < b.labels.mean() < 0.32
    ids = b.sparse
    assert (ids < 0).mean() > 0.4 and (np.abs(ids) > 2**40).mean() > 0.99   # hashes, not ranks
    # Feature 0 (a vocabulary of 50M) is Zipf: its 10 most frequent values
    # take > 15% of 50,000 draws (25.6% measured; uniform would give 0.0002%)
    # while > 10,000 distinct values appear (18,300 measured).
    f0 = ids[:, 0]
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


def _central(at) -> float:
    """The central difference of ``at(eps)`` at eps = 1e-6."""
    return (at(1e-6) - at(-1e-6)) / (2 * 1e-6)


def _check_param_grads(params, grads, names, rng, loss_of) -> None:
    """Each of ``names`` (repeats: more entries), at a random entry: its
    gradient equals the central difference of ``loss_of(params)``."""
    for name in names:
        idx = tuple(int(rng.integers(0, s)) for s in params[name].shape)

        def at(eps, name=name, idx=idx):
            p = {k: v.copy() for k, v in params.items()}
            p[name][idx] += eps
            return loss_of(p)
        assert _central(at) == pytest.approx(grads[name][idx], rel=1e-5, abs=1e-9), name


def test_dlrm_gradients_are_the_losss_derivatives():
    rng = np.random.default_rng(1)
    params = M.init_params(2, np.float64)
    n = 4
    dense = rng.normal(size=(n, 13))
    rows = rng.normal(size=(n, 26, M.DIM)) * 0.3
    labels = (rng.random(n) < 0.5).astype(np.float64)
    loss, grads, row_grads = M.loss_and_grads(params, dense, rows, labels)
    assert set(grads) == set(params) and row_grads.shape == rows.shape

    _check_param_grads(params, grads, [n for n in params for _ in range(3)], rng,
                       lambda p: M.loss_and_grads(p, dense, rows, labels)[0])
    for _ in range(5):
        idx = tuple(int(rng.integers(0, s)) for s in rows.shape)

        def at_row(eps, idx=idx):
            r = rows.copy()
            r[idx] += eps
            return M.loss_and_grads(params, dense, r, labels)[0]
        assert _central(at_row) == pytest.approx(row_grads[idx], rel=1e-5, abs=1e-9)
    # The same rows as a list of 26 blocks (n, DIM): gradients as a list too.
    loss_l, grads_l, rows_l = M.loss_and_grads(params, dense, list(rows.transpose(1, 0, 2)), labels)
    assert loss_l == loss and isinstance(rows_l, list) and len(rows_l) == 26
    np.testing.assert_array_equal(np.stack(rows_l, axis=1), row_grads)
    for name in params:
        np.testing.assert_array_equal(grads_l[name], grads[name])
    np.testing.assert_allclose(M.predict(params, dense, rows),
                               1 / (1 + np.exp(-M.forward(params, dense, rows)[0])))
    assert M.num_params() == 25_553
    with pytest.raises(ValueError):
        M.forward(params, dense, rows[:, :25])


def test_dlrm_rows_of_several_widths_are_projected_and_their_gradients_are_derivatives():
    """Mixed-dimension rows (examples/ctr.py's FEATURE_DIMS): each narrower
    feature's rows times its projection; the projections' and the rows'
    gradients are the loss's derivatives; the other weights are as without."""
    from examples import ctr
    rng = np.random.default_rng(3)
    dims = ctr.FEATURE_DIMS
    assert sorted(set(dims)) == [4, 8, M.DIM]
    params = M.init_params(2, np.float64, dims=dims)
    plain = M.init_params(2, np.float64)
    for name in plain:
        np.testing.assert_array_equal(params[name], plain[name])
    assert {k: v.shape for k, v in params.items() if k not in plain} == {
        "proj4/w": (dims.count(4), 4, M.DIM), "proj8/w": (dims.count(8), 8, M.DIM)}
    n = 4
    dense = rng.normal(size=(n, 13))
    blocks = [rng.normal(size=(n, d)) * 0.3 for d in dims]
    labels = (rng.random(n) < 0.5).astype(np.float64)
    loss, grads, row_grads = M.loss_and_grads(params, dense, blocks, labels)
    assert set(grads) == set(params) and [g.shape for g in row_grads] == [b.shape for b in blocks]
    # the same as full-width rows made by the projections
    nth = [dims[:f].count(d) for f, d in enumerate(dims)]   # its place among its width's
    wide = np.stack([b if d == M.DIM else b @ params[f"proj{d}/w"][j]
                     for b, d, j in zip(blocks, dims, nth)], axis=1)
    assert M.loss_and_grads(plain, dense, wide, labels)[0] == pytest.approx(loss, rel=1e-12)

    _check_param_grads(params, grads, [k for k in params if k.startswith("proj")] * 4, rng,
                       lambda p: M.loss_and_grads(p, dense, blocks, labels)[0])
    for f in (0, 4, 8, 20):   # widths 16, 8, 4, 16
        i, j = int(rng.integers(0, n)), int(rng.integers(0, dims[f]))

        def at_row(eps, f=f, i=i, j=j):
            b = [x.copy() for x in blocks]
            b[f][i, j] += eps
            return M.loss_and_grads(params, dense, b, labels)[0]
        assert _central(at_row) == pytest.approx(row_grads[f][i, j], rel=1e-5, abs=1e-9)
    assert M.num_params(dims) == M.num_params() + sum(d * M.DIM for d in dims if d < M.DIM)
    with pytest.raises(ValueError, match="proj4/w projects 7 features of width 4; 6 given"):
        M.forward(params, dense, blocks[:8] + [rng.normal(size=(n, M.DIM))] + blocks[9:])
    with pytest.raises(ValueError, match="feature 0: rows of shape .4, 5.; the model takes"):
        M.forward(params, dense, [rng.normal(size=(n, 5))] + blocks[1:])
    with pytest.raises(ValueError, match="list of 26"):
        M.forward(params, dense, wide)
    with pytest.raises(ValueError, match="widths"):
        M.init_params(0, dims=[32] * 26)


def test_sum_rows_gives_unique_ids_and_summed_gradients():
    rng = np.random.default_rng(3)
    ids = rng.integers(-5, 5, (6, 26)) * (2**60)                  # many duplicates
    grads = rng.normal(size=(6, 26, M.DIM)).astype(np.float32)
    keys, rows = M.sum_rows(ids, grads)
    assert keys.dtype == np.int64 and (np.diff(keys) > 0).all() and rows.shape == (keys.size, M.DIM)
    for k, r in zip(keys, rows):
        np.testing.assert_allclose(r, grads[ids == k].sum(axis=0), rtol=1e-5, atol=1e-6)
    assert set(keys.tolist()) == set(ids.ravel().tolist())
    keys_l, rows_l = M.sum_rows(ids, list(grads.transpose(1, 0, 2)))
    np.testing.assert_array_equal(keys_l, keys)
    np.testing.assert_array_equal(rows_l, rows)


class _DictTable:
    """An embedding table keyed by id in a dict (id -> slot of ``rows``);
    a new id gets a row from uniform(-0.05, 0.05), an unknown one reads zeros."""

    def __init__(self, capacity: int, seed: int):
        self.slot: dict[int, int] = {}
        self.rows = np.zeros((capacity + 1, M.DIM), np.float32)     # the last: zeros
        self.rng = np.random.default_rng(seed)

    def slots(self, keys: np.ndarray, admit: bool) -> np.ndarray:
        out = np.empty(len(keys), np.int64)
        for i, k in enumerate(keys.tolist()):
            s = self.slot.get(k)
            if s is None and admit:
                s = self.slot[k] = len(self.slot)
                self.rows[s] = self.rng.uniform(-0.05, 0.05, M.DIM)
            out[i] = -1 if s is None else s
        return out

    def lookup(self, ids: np.ndarray, admit: bool = True) -> np.ndarray:
        keys, inverse = np.unique(ids, return_inverse=True)
        return self.rows[self.slots(keys, admit)[inverse.reshape(ids.shape)]]

    def sgd(self, keys: np.ndarray, grads: np.ndarray, lr: float) -> None:
        self.rows[self.slots(keys, admit=False)] -= lr * grads


@pytest.mark.timeout(120)
def test_dlrm_learns_in_process_with_sgd_on_dict_tables():
    """300 steps of 256 on vocabularies cut to 1,000 (17,000 ids): plain SGD
    (dense 0.1, rows 5.0; row gradients are means over the batch). Held-out
    AUC goes from chance (~0.50) to ~0.76 (the planted model's: ~0.86)."""
    small = tuple(min(v, 1000) for v in D.VOCABS)
    params = M.init_params(0)
    table = _DictTable(sum(small), seed=7)
    held_out = D.batch(99, 0, 10_000, small)

    def held_out_auc() -> float:
        rows = table.lookup(held_out.sparse, admit=False)
        return D.auc(held_out.labels, M.predict(params, held_out.dense, rows))

    before = held_out_auc()
    stream = D.shard(1, 0, 1, 256, vocabs=small)
    losses = []
    for _ in range(300):
        b = next(stream)
        loss, grads, row_grads = M.loss_and_grads(params, b.dense, table.lookup(b.sparse),
                                                  b.labels)
        for name in params:
            params[name] -= 0.1 * grads[name]
        table.sgd(*M.sum_rows(b.sparse, row_grads), 5.0)
        losses.append(loss)
    after = held_out_auc()
    ceiling = D.auc(held_out.labels, D.planted_logits(held_out.dense, held_out.sparse))
    assert abs(before - 0.5) < 0.05
    print(f"held-out AUC {before:.3f} -> {after:.3f} (planted {ceiling:.3f}); "
          f"loss {np.mean(losses[:50]):.3f} -> {np.mean(losses[-50:]):.3f}")
    assert 0.65 < after < ceiling, (before, after, ceiling)
    assert np.mean(losses[-50:]) < np.mean(losses[:50]) - 0.02
    assert len(table.slot) > 5_000


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode, steps", [("async", 80), ("hybrid", 60)])
def test_the_ctr_example_learns_on_dynamic_tables(mode, steps):
    """examples/ctr.py on a LocalCluster (2 ps, 2 workers): AUC rises well
    above chance, below the planted model's, and the table admitted keys.
    (hybrid: a step is 2 replicas of a batch each.)"""
    from examples import ctr
    out = ctr.main(["--epochs", "2", "--steps-per-epoch", str(steps), "--batch-size", "256",
                    "--eval-batches", "10", "--verbose", "0", "--mode", mode])
    assert out["aucs"][-1] > out["aucs"][0] - 0.01
    assert 0.6 < out["auc"] < out["ceiling"]
    assert out["rows"] > 10_000 and out["samples_per_second"] > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tables", ["shared", "per-feature"])
def test_the_ctr_example_checkpoints_incrementally_and_its_serving_copy_scores_the_same(
        tmp_path, capsys, tables):
    """examples/ctr.py --incremental-checkpoints --export: a base and a delta
    checkpoint, a serving copy exported beside training; examples/serve_ctr.py
    scores the last export (from memory, no parameter server) with the
    training run's own final AUC."""
    import json
    import os

    from coordinator.checkpoint_files import chain_of
    from examples import ctr, serve_ctr
    ckpt, export = str(tmp_path / "ckpt"), str(tmp_path / "export")
    out = ctr.main(["--epochs", "2", "--steps-per-epoch", "30", "--batch-size", "256",
                    "--eval-batches", "5", "--verbose", "0", "--incremental-checkpoints", ckpt,
                    "--export", export, "--export-every", "0.5", "--tables", tables])
    said = capsys.readouterr().out   # where its checkpoints and exports went (issue 35 item 8)
    assert f"checkpoints: {ckpt} " in said and f"serving exports: {export} " in said, said
    latest = sorted(os.listdir(ckpt))[-1]
    assert [os.path.basename(p) for p, _ in chain_of(os.path.join(ckpt, latest))] == [
        "ckpt-00000030", "ckpt-00000060"]
    exports = sorted(os.listdir(export))
    assert any("chain" in json.load(open(os.path.join(export, e, "manifest.json")))
               for e in exports), exports
    served = serve_ctr.main(["--export", export, "--eval-batches", "5", "--batch-size", "256",
                             "--tables", tables])
    assert served["auc"] == out["auc"] and served["path"].endswith(exports[-1])
    # The side evaluator scores the last checkpoint (a delta on its base; an
    # Adagrad table read from the files) as training's own last validation.
    from coordinator import cli
    from coordinator.evaluation import read_checkpoint
    checkpoint = read_checkpoint(os.path.join(ckpt, latest))
    got = ctr.evaluate_checkpoint(checkpoint, batches=5, size=256, tables=tables)
    assert got["auc"] == out["auc"], (got, out["auc"])
    # a checkpoint directory reads as an export does
    from coordinator.serving import Snapshot
    ids = np.concatenate([D.batch(1, i, 256).sparse for i in range(3)])
    rows = ctr.reader_lookup(checkpoint, tables=tables)(ids)
    blocks = rows if tables == "per-feature" else list(rows.transpose(1, 0, 2))
    if tables == "per-feature":   # each feature's rows of its own width
        assert [b.shape for b in blocks] == [(len(ids), d) for d in ctr.FEATURE_DIMS]
    assert np.mean([(b != 0).any(axis=-1).mean() for b in blocks]) > 0.5
    again = ctr.reader_lookup(Snapshot(ckpt), tables=tables)(ids)
    for a, b in zip(again if tables == "per-feature" else list(again.transpose(1, 0, 2)),
                    blocks):
        np.testing.assert_array_equal(a, b)
    logs = tmp_path / "logs"
    fn = "evaluate_checkpoint" if tables == "shared" else "evaluate_per_feature_checkpoint"
    assert f"--fn examples.ctr:{fn} " in said
    assert cli.main(["evaluate", ckpt, "--fn", f"examples.ctr:{fn}", "--logdir",
                     str(logs), "--once"]) == 0
    assert json.loads((logs / "evaluator_state.json").read_text())["last_step"] == 60
    assert any(f.name.endswith(".step60." + str(os.getpid()))
               for f in (logs / "evaluation").iterdir())   # its metrics' event file


@pytest.mark.timeout(180)
@pytest.mark.parametrize("route", ["same host", "data port"])
@pytest.mark.parametrize("tables", ["shared", "per-feature"])
def test_a_ctr_step_is_one_round_trip_per_server_each_way(route, tables, monkeypatch):
    """examples/ctr.py's step (a dynamic table, or 26 per-feature tables of an
    EmbeddingCollection, looked up with the dense layers, its row gradients
    pushed with theirs): per step, one
    ParameterServerBulk.Read and one ParameterServerBulk.Push on each
    parameter server, and no other data call (no DynamicTables.Lookup or
    Update, no Gather, no SharedMemory call: the dense values come
    straight from the servers' memory on this host), counted by the
    servers themselves."""
    from coordinator import LocalCluster, ParameterServerStrategy, ps_pool
    from examples import ctr
    from psserver.contract import routing
    from tests.integration.test_metrics import metrics_address, scrape
    ps_pool.close_clients()   # clients read the switches when made
    if route == "data port":
        monkeypatch.setenv(routing.SHM_ENV, "0")
    try:
        with LocalCluster(num_ps=2, num_workers=0, tls=False,
                          ps_args=("--metrics-port", "0")) as cluster:
            strategy = ParameterServerStrategy(cluster.spec)
            variables, table = ctr.build(strategy, seed=0, lr=0.1, tables=tables)
            step = ctr.make_train_step(table, variables)
            batches = D.shard(0, 0, 1, 256)
            for _ in range(2):   # warm: routes planned, values mapped
                step(batches)

            def calls() -> dict:
                out = {}
                for ps in cluster.ps:
                    for (name, labels), v in scrape(metrics_address(ps)).items():
                        labels = dict(labels)
                        if name == "grpc_server_handled_total" and v:
                            key = (ps.address, labels["grpc_service"], labels["grpc_method"])
                            out[key] = out.get(key, 0) + v
                return out
            before = calls()
            losses = [step(batches) for _ in range(5)]
            after = calls()
        made = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        assert all(np.isfinite(losses))
        want = {(ps.address, "pstrain.v1.ParameterServerBulk", m): 5
                for ps in cluster.ps for m in ("Read", "Push")}
        assert made == want, made
    finally:
        ps_pool.close_clients()
