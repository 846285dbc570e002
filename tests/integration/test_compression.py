"""Gradient compression on the wire (coordinator.compression)."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import compression as C
from coordinator import ps_pool, step_calls
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
    from coordinator.ps_pool import client_for
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
    from test_metrics import metrics_address, scrape

    from coordinator import ClusterSpec, ParameterServerStrategy

    monkeypatch.setenv("PSTRAIN_SHM", "0")   # as between hosts: no shared memory
    monkeypatch.setenv("PSTRAIN_DATA", "1" if transport == "data" else "0")
    monkeypatch.delenv("PSTRAIN_AUTH_TOKEN", raising=False)
    ps_pool.configure(None, None)
    ps_pool.close_clients()
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
        step_calls.push_gradients([(w, g)])
        plain = received() - start
        step_calls.push_gradients([(w, g)], compression="fp16")
        fp16 = received() - start - plain
    finally:
        ps_pool.close_clients()
    assert plain >= g.nbytes and 0.45 * plain < fp16 < 0.55 * plain, (plain, fp16)
    np.testing.assert_allclose(w.read(), np.full((1000, 16), -0.01, np.float32))   # both applied


# -- reads as float16 (ReadRequest.value_dtype) ---------------------------------------
def _client_as(monkeypatch, address, path):
    """A PSClient that reads over ``path``: "same host" (shared memory), "data"
    (the data port, as between hosts) or "grpc"."""
    from psserver.client import PSClient
    monkeypatch.setenv("PSTRAIN_SHM", "1" if path == "same host" else "0")
    monkeypatch.setenv("PSTRAIN_DATA", "0" if path == "grpc" else "1")
    return PSClient(address)


@pytest.mark.timeout(60)
def test_float16_reads_give_the_same_numbers_on_every_path(start_ps, monkeypatch):
    """Values read with value_dtype="float16" are the variable rounded to
    float16 (clipped to +-65504), bit for bit the same whether the server sent
    float16 (gRPC, the data port, a stream) or this host rounded them (shared
    memory); the variable itself is untouched."""
    from psserver.client import PSClient
    from psserver.contract import tensor as T
    ps = start_ps()
    rng = np.random.default_rng(0)
    small = rng.standard_normal((300, 7)).astype(np.float32) * 3
    small[0, :3] = [1e6, -7e4, 1e-9]              # clipped, clipped, flushed to zero
    big = rng.standard_normal((1 << 20) + 3).astype(np.float32)   # over a gRPC message
    wide = rng.standard_normal(10) * 1e3                      # float64: a quarter of the bytes
    half = rng.standard_normal(10).astype(np.float16)         # already float16: as it is
    with PSClient(ps.address) as c:
        for name, v in (("small", small), ("big", big), ("wide", wide), ("half", half)):
            c.create_variable(name, initial_value=v)
    want = {"small": T.as_float16(small), "big": T.as_float16(big),
            "wide": T.as_float16(wide), "half": half}
    assert want["small"].dtype == np.float16 and want["small"][0, 0] == 65504
    assert want["small"][0, 1] == -65504 and want["small"][0, 2] == 0
    for path in ("same host", "data", "grpc"):
        with _client_as(monkeypatch, ps.address, path) as c:
            c.stream_threshold_bytes = 1 << 20   # "big" goes as a stream over gRPC
            for names in (["small", "wide", "half"], ["big"]):
                snaps = c.read_many(names, value_dtype="float16")
                for s in snaps:
                    np.testing.assert_array_equal(s.value, want[s.name], err_msg=path)
                    assert s.value.dtype == want[s.name].dtype, (path, s.name)
                out = [np.full(want[n].shape, np.nan, np.float64 if n == "wide" else
                               np.float16 if n == "half" else np.float32) for n in names]
                got = c.read_many_async(names, value_dtype="float16", out=out).result()
                for s, o in zip(got, out):
                    assert s.value is o, (path, s.name)   # into the caller's float32 array
                    np.testing.assert_array_equal(o, want[s.name].astype(o.dtype), err_msg=path)
            np.testing.assert_array_equal(c.read("small"), small)   # the variable as it was
            np.testing.assert_array_equal(c.read("big"), big)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["grpc", "data"])
def test_float16_reads_send_half_the_bytes(start_ps, monkeypatch, transport):
    """What the server sent, counted by its metrics: a float16 read of a float32
    variable carries about half the bytes of the plain read."""
    from test_metrics import metrics_address, scrape
    ps = start_ps("--metrics-port", "0")
    m = metrics_address(ps)
    value = np.random.default_rng(1).standard_normal((1000, 16)).astype(np.float32)
    with _client_as(monkeypatch, ps.address, transport) as c:
        c.create_variable("w", initial_value=value)

        def sent() -> float:
            return scrape(m).total("grpc_server_sent_bytes_total",
                                   grpc_service="pstrain.v1.ParameterServerBulk",
                                   grpc_method="Read")
        start = sent()
        c.read_many(["w"])
        plain = sent() - start
        c.read_many(["w"], value_dtype="float16")
        half = sent() - start - plain
    assert plain >= value.nbytes and 0.45 * plain < half < 0.55 * plain, (plain, half)


@pytest.mark.timeout(60)
def test_a_read_asking_for_another_dtype_is_refused_on_every_transport(start_ps):
    """value_dtype other than "" or "float16": INVALID_ARGUMENT naming the
    field, on every transport and on the stream, before anything is read."""
    import grpc

    from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
    from psserver.client import PSClient
    from psserver.link import methods
    from tests.integration.test_transport import _transports
    ps = start_ps()
    with PSClient(ps.address) as c:
        c.create_variable("w", initial_value=np.ones(4, np.float32))
    for bad in ("int8", "float32", "Float16", "\u00e9"):
        req = ps_pb2.ReadRequest(names=["w"], value_dtype=bad)
        transports = _transports(ps)
        try:
            for t in transports:
                for method in (methods.READ, methods.BULK_READ):
                    if method is methods.READ and t.__class__.__name__ != "GrpcTransport":
                        continue
                    with pytest.raises(InvalidArgument, match="value_dtype"):
                        t.call(method, req, 10.0)
        finally:
            for t in transports:
                t.close()
        with grpc.insecure_channel(ps.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(ps_pb2_grpc.ParameterServerStub(ch).ReadStream(req, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert "value_dtype" in e.value.details()
    with PSClient(ps.address) as c:
        np.testing.assert_array_equal(c.read("w"), np.ones(4, np.float32))
        with pytest.raises(InvalidArgument, match="value_dtype"):
            c.read_many(["w"], value_dtype="int8")


def test_read_compression_is_checked_where_it_is_given(cluster):
    from coordinator import ParameterServerStrategy, read_variables
    with pytest.raises(ValueError, match="fp16"):
        ParameterServerStrategy(cluster.spec, read_compression="int8")
    s = ParameterServerStrategy(cluster.spec, read_compression="fp16")
    assert s.read_compression_spec == "fp16"
    assert ParameterServerStrategy(cluster.spec).read_compression_spec is None
    t = s.create_variable("rc/t", (10, 4), optimizer="sgd")
    try:
        with pytest.raises(ValueError, match="lookups"):
            read_variables([t, t.lookup([1, 2])], compression="fp16")
        with pytest.raises(ValueError, match="fp16"):
            read_variables([t], compression=C.BF16())
    finally:
        s.delete_variable(t)


@pytest.mark.timeout(180)
def test_digits_fp16_reads_and_pushes_end_to_end(cluster):
    """Weights read as float16 and gradients pushed as float16 across the
    cluster's workers: digits still reaches 0.90."""
    from bench.bench_compression import train_digits
    r = train_digits(cluster.spec, "fp16", read_compression="fp16", name="t_fp16r",
                     epochs=4, steps_per_epoch=50)
    assert r["test_accuracy"] >= 0.90, r["test_accuracy"]


def test_float16_rounding_is_numpys_for_every_float16_bit_pattern_and_beyond():
    """psserver.contract.tensor.as_float16 (by hand below 2**-14, where numpy is slow)
    gives numpy's astype(float16) bits for every value a float16 can hold,
    the midpoints between them, random float32/float64 values of every
    magnitude, clips finite values beyond +-65504 and keeps NaN and Inf."""
    from psserver.contract import tensor as T
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    exact = h.astype(np.float32)
    ordered = np.sort(exact)
    mids = (ordered[:-1].astype(np.float64) + ordered[1:]) / 2   # ties: to even
    rng = np.random.default_rng(0)
    rand = rng.standard_normal(200_000) * 10.0 ** rng.uniform(-12, 5, 200_000)
    for values in (exact, mids, mids.astype(np.float32), rand, rand.astype(np.float32)):
        values = values[np.abs(values) <= 65504]
        got = T.as_float16(values)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got.view(np.uint16),
                                      values.astype(np.float16).view(np.uint16))
    big = np.array([7e4, -1e30, np.inf, 1e-30, -2e-8], np.float32)
    np.testing.assert_array_equal(T.as_float16(big).astype(np.float32),
                                  [65504, -65504, np.inf, 0, -0.0])
    assert np.signbit(T.as_float16(big)[4])
    for dt in (np.float32, np.float64):   # NaN beside a large value: that one clipped still
        odd = np.array([np.nan, 7e4, -np.inf, -7e4, 1.0], dt)
        got = T.as_float16(odd).astype(np.float32)
        assert np.isnan(got[0])
        np.testing.assert_array_equal(got[1:], [65504, -np.inf, -65504, 1.0])
    finite = np.array([7e4, -1e30, 65519, 65520, -2e-8, 3e-8, -0.0], np.float32)   # fast path
    got = T.as_float16(finite)
    np.testing.assert_array_equal(got.astype(np.float32),
                                  [65504, -65504, 65504, 65504, -0.0, 2.0 ** -24, -0.0])
    assert np.signbit(got[[4, 6]]).all() and got.dtype == np.float16
    np.testing.assert_array_equal(C.to_fp16(big)[:3].astype(np.float32), [65504, -65504, np.inf])


def test_float16_widening_is_exact_for_every_bit_pattern():
    from psserver.contract import tensor as T
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)
    for dt in (np.float32, np.float64):
        got = T.widen_float16(h, dt)
        assert got.dtype == dt and got.shape == h.shape
        np.testing.assert_array_equal(got, h.astype(dt))   # NaNs compare equal here
        out = np.empty((256, 256), dt)
        assert T.widen_float16(h, dt, out=out) is out
        np.testing.assert_array_equal(out, h.astype(dt))
