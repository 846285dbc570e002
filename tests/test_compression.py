"""Gradient compression on the wire (coordinator.compression)."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import compression as C
from coordinator.compression import TopK
from psserver.errors import InvalidArgument


# -- the transforms (no servers) ---------------------------------------------------
def test_resolve_and_validation():
    assert C.resolve(None) is None
    assert C.resolve("fp16") == C.FP16() and C.resolve("BF16") == C.BF16()
    assert C.resolve(TopK(0.1)) == TopK(0.1)
    for bad in ("int8", 0.1, TopK):
        with pytest.raises(ValueError):
            C.resolve(bad)
    for ratio in (0, -0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError):
            TopK(ratio)
    assert TopK(0.01).k(64) == 1 and TopK(0.1).k(64) == 7 and TopK(1.0).k(5) == 5


def test_fp16_round_trip_with_clipping():
    g = np.array([1e-3, -2.5, 1e5, -7e4, 65504.0, 0.0], np.float32)
    h = C.to_fp16(g)
    assert h.dtype == np.float16 and np.all(np.isfinite(h))
    np.testing.assert_array_equal(h[2:5].astype(np.float32), [65504, -65504, 65504])
    np.testing.assert_allclose(h[[0, 1, 5]].astype(np.float32), g[[0, 1, 5]], rtol=1e-3)
    # Already non-finite stays non-finite (the server rejects it).
    bad = C.to_fp16(np.array([np.inf, -np.inf, np.nan, 1.0], np.float64))
    assert np.isposinf(bad[0]) and np.isneginf(bad[1]) and np.isnan(bad[2]) and bad[3] == 1


def test_bf16_rounds_to_nearest_even():
    g = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -9, -3.14159,
                  np.inf, np.nan], np.float32)
    b = C.to_bf16(g)
    assert b.dtype == np.float32
    assert np.all(b[:6].view(np.uint32) & 0xFFFF == 0)
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1); 1 + 3*2^-8 -> 1 + 2^-6.
    np.testing.assert_array_equal(b[:4], [1.0, 1.0, 1.0 + 2 ** -6, 1.0])
    assert abs(b[4] + 3.14159) < 3.14159 * 2 ** -8
    assert np.isposinf(b[5]) and np.isnan(b[6])


def test_topk_selects_largest_rows():
    g = np.zeros((10, 3))
    g[[2, 7, 4]] = [[5, 0, 0], [0, 9, 0], [1, 1, 1]]
    np.testing.assert_array_equal(C.top_rows(g, 2), [2, 7])
    np.testing.assert_array_equal(C.top_rows(g, 3), [2, 4, 7])
    np.testing.assert_array_equal(C.top_rows(g, 20), np.arange(10))


def test_topk_residual_accumulates_exactly_what_was_not_sent():
    rng = np.random.default_rng(0)
    res = C.Residuals()
    topk = TopK(0.25)
    ranges = [(0, 5), (5, 7)]               # two shards of a 12-row variable
    total_grad = np.zeros((12, 4))
    total_sent = np.zeros((12, 4))
    for _ in range(20):
        g = rng.integers(-50, 50, (12, 4)).astype(np.float64)   # exact sums
        total_grad += g
        acc, picks = res.compensate_and_select("w", g, ranges, topk)
        for (off, rows), ids in zip(ranges, picks):
            assert len(ids) == topk.k(rows) and np.all(ids < rows)
            total_sent[off + ids] += acc[off + ids]
    np.testing.assert_array_equal(total_sent + res.get("w"), total_grad)
    res.clear("w")
    assert res.get("w") is None


# -- the parameter server's dtype rule ------------------------------------------------
def test_store_accepts_float16_for_float32_and_float64(client):
    for dt in ("float32", "float64"):
        client.create_variable(f"v{dt}", (2, 3), dt, optimizer="sgd",
                               optimizer_params={"learning_rate": 1.0})
        client.push(f"v{dt}", np.full((2, 3), 0.5, np.float16))
        v = client.read(f"v{dt}")
        assert v.dtype == np.dtype(dt)
        np.testing.assert_array_equal(v, np.full((2, 3), -0.5))
        client.push_sparse(f"v{dt}", np.array([1]), np.full((1, 3), 0.25, np.float16))
        np.testing.assert_array_equal(client.read(f"v{dt}")[1], np.full(3, -0.75))


def test_store_still_rejects_other_dtype_mismatches(client):
    client.create_variable("w", (2, 3), "float32", optimizer="sgd")
    with pytest.raises(InvalidArgument, match="float64 but the variable is float32"):
        client.push("w", np.zeros((2, 3), np.float64))
    client.create_variable("h", (2, 3), "float16", optimizer="sgd")
    with pytest.raises(InvalidArgument, match="float32 but the variable is float16"):
        client.push("h", np.zeros((2, 3), np.float32))
    # float16 Inf (what an unclipped overflow would be) is rejected after the cast rule.
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        client.push("w", np.full((2, 3), np.inf, np.float16))
    np.testing.assert_array_equal(client.read("w"), np.zeros((2, 3), np.float32))


# -- strategy option and end to end ------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    from coordinator import LocalCluster
    with LocalCluster(num_ps=2, num_workers=2) as c:
        yield c


@pytest.mark.timeout(120)
def test_strategy_validates_eagerly(cluster):
    from coordinator import ParameterServerStrategy
    s = ParameterServerStrategy(cluster.spec)
    assert s.gradient_compression_spec is None
    assert ParameterServerStrategy(cluster.spec, gradient_compression="fp16") \
        .gradient_compression_spec == C.FP16()
    with pytest.raises(ValueError, match="gradient_compression"):
        ParameterServerStrategy(cluster.spec, gradient_compression="int8")
    with pytest.raises(ValueError, match="ratio"):
        ParameterServerStrategy(cluster.spec, gradient_compression=TopK(2.0))
    with pytest.raises(ValueError, match="sync"):
        ParameterServerStrategy(cluster.spec, mode="sync", gradient_compression="fp16")


@pytest.mark.timeout(120)
def test_push_gradients_topk_with_replication(cluster):
    """Coordinator-side pushes: top-k rows reach primary and backup, the rest waits."""
    from coordinator import ParameterServerStrategy, push_gradients
    s = ParameterServerStrategy(cluster.spec, replication=True,
                                gradient_compression=TopK(0.25))
    w = s.create_variable("ctk/w", (8, 2), optimizer="sgd",
                          optimizer_params={"learning_rate": 1.0})
    b = s.create_variable("ctk/b", (2,), optimizer="sgd",
                          optimizer_params={"learning_rate": 1.0})
    try:
        g = np.zeros((8, 2), np.float32)
        g[3] = 10
        g[:, 1] += 1
        push_gradients([(w, g), (b, np.ones(2, np.float32))],
                       compression=s.gradient_compression_spec)
        val = w.read()
        assert np.count_nonzero(val.any(axis=1)) == 2          # k = 2 rows sent
        np.testing.assert_array_equal(val[3], [-10, -11])
        np.testing.assert_array_equal(b.read(), [-1, -1])       # 1-D: dense
        backup = V_read_backup(w)
        np.testing.assert_array_equal(backup, val)
        resid = C.residuals.get("ctk/w")
        np.testing.assert_array_equal(-val + resid, g)
    finally:
        C.residuals.clear("ctk/w")
        for v in s.variables:
            s.delete_variable(v)


def V_read_backup(var):
    from coordinator.variables import client_for
    (bk,) = var.backups
    return client_for(bk.address).read(bk.name)


@pytest.mark.timeout(180)
def test_digits_fp16_end_to_end(cluster):
    from bench.bench_compression import train_digits
    r = train_digits(cluster.spec, "fp16", name="t_fp16", epochs=4, steps_per_epoch=50)
    assert r["test_accuracy"] >= 0.90, r["test_accuracy"]
    assert r["bytes_per_step"] == 2 * (64 * 64 + 64 + 64 * 10 + 10)   # half of float32


@pytest.mark.timeout(180)
def test_digits_topk_end_to_end(cluster):
    from bench.bench_compression import train_digits
    r = train_digits(cluster.spec, TopK(0.1), name="t_topk", epochs=4, steps_per_epoch=50)
    assert r["last_loss"] < 0.5 * r["first_loss"], (r["first_loss"], r["last_loss"])
    assert r["test_accuracy"] >= 0.80, r["test_accuracy"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["grpc", "data"])
def test_fp16_sends_half_the_bytes_on_the_wire(start_ps, monkeypatch, transport):
    """What the server received, counted by its metrics: an fp16 push carries
    about half the bytes of the same float32 push (the wire, not a formula)."""
    from coordinator import ClusterSpec, ParameterServerStrategy
    from coordinator import variables as V
    from test_metrics import metrics_address, scrape

    monkeypatch.setenv("PSTRAIN_SHM", "0")   # as between hosts: no shared memory
    monkeypatch.setenv("PSTRAIN_DATA", "1" if transport == "data" else "0")
    monkeypatch.delenv("PSTRAIN_AUTH_TOKEN", raising=False)
    V.configure(None, None)
    V.close_clients()
    ps = start_ps("--metrics-port", "0")
    m = metrics_address(ps)
    try:
        strategy = ParameterServerStrategy(ClusterSpec(ps=[ps.address]))
        w = strategy.create_variable("w", shape=(1000, 16), optimizer="sgd")
        g = np.full((1000, 16), 0.5, np.float32)

        def received() -> float:
            return scrape(m).total("grpc_server_received_bytes_total",
                                   grpc_service="pstrain.v1.ParameterServerBulk",
                                   grpc_method="Push")
        start = received()
        V.push_gradients([(w, g)])
        plain = received() - start
        V.push_gradients([(w, g)], compression="fp16")
        fp16 = received() - start - plain
    finally:
        V.close_clients()
    assert plain >= g.nbytes and 0.45 * plain < fp16 < 0.55 * plain, (plain, fp16)
    np.testing.assert_allclose(w.read(), np.full((1000, 16), -0.01, np.float32))   # both applied
