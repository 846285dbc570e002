"""End-to-end tests of the parameter-server process.

Every test talks real gRPC to real ``python -m psserver`` processes on
127.0.0.1 (fixtures in conftest.py, or ``start_task`` for the module-scoped
server of the bad-input table). Expected optimizer results come from the
plain numpy references in ``reference_optimizers.py``, not from psserver.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reference_optimizers import DEFAULTS, ReferenceOptimizer

from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
from psserver import errors
from psserver.client import PSClient
from psserver.contract import PROTOCOL_VERSION, Initializer
from psserver.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PSError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from psserver.link import tensor_proto as TP
from psserver.link.transport import from_rpc_error
from psserver.process import child_env, start_task

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

OPTIMIZERS = {   # non-default hyper-parameters, so each one is seen to travel
    "sgd": {"learning_rate": 0.1},
    "momentum": {"learning_rate": 0.05, "momentum": 0.8, "nesterov": 1.0},
    "adagrad": {"learning_rate": 0.1, "initial_accumulator_value": 0.2, "epsilon": 1e-6},
    "adam": {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6},
    "ftrl": {"learning_rate": 0.2, "learning_rate_power": -0.6, "initial_accumulator_value": 0.3,
             "l1_regularization_strength": 0.001, "l2_regularization_strength": 0.01,
             "l2_shrinkage_regularization_strength": 0.02, "beta": 0.1},
}
TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-12)}


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
@contextlib.contextmanager
def raw_stub(address: str, options=()):
    """The generated stub on its own channel (no PSClient checks in between)."""
    channel = grpc.insecure_channel(address, options=list(options))
    try:
        yield ps_pb2_grpc.ParameterServerStub(channel)
    finally:
        channel.close()


def raw(method, request, **kw):
    """Call a raw stub method; a failed call raises the typed PSError."""
    try:
        return method(request, timeout=10, **kw)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from exc


def state(c: PSClient) -> dict:
    """Every variable's (dtype, shape, version, value bytes), by name."""
    out = {}
    for m in c.list_variables():
        value, version = c.read(m.name, with_version=True)
        assert version == m.version
        out[m.name] = (m.dtype, m.shape, version, value.tobytes())
    return out


def run_threads(target, n: int, timeout: float = 60.0) -> list:
    """Run target(i) in n threads; return their results (exceptions re-raised)."""
    results: list = [None] * n
    errs: list = [None] * n

    def wrap(i):
        try:
            results[i] = target(i)
        except BaseException as exc:   # re-raised in the test's thread below
            errs[i] = exc
    threads = [threading.Thread(target=wrap, args=(i,), name=f"test-worker-{i}")
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "worker threads did not finish"
    for e in errs:
        if e is not None:
            raise e
    return results


# ---------------------------------------------------------------------------
# 1. Round trips against the numpy references
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_dense_round_trip_matches_reference(client, opt, dtype):
    rng = np.random.default_rng(1)
    init = rng.standard_normal((6, 4)).astype(dtype)
    meta = client.create_variable("v", initial_value=init, optimizer=opt,
                                  optimizer_params=OPTIMIZERS[opt])
    assert (meta.version, meta.dtype, meta.shape) == (0, np.dtype(dtype).name, (6, 4))
    assert meta.optimizer == opt
    assert dict(meta.optimizer_params) == {**DEFAULTS[opt], **OPTIMIZERS[opt]}
    value, version = client.read("v", with_version=True)
    assert version == 0 and value.dtype == dtype
    np.testing.assert_array_equal(value, init)

    ref = ReferenceOptimizer(opt, OPTIMIZERS[opt], init)
    for step in range(1, 6):
        g = rng.standard_normal((6, 4)).astype(dtype)
        assert client.push("v", g) == step
        ref.apply_dense(g)
        value, version = client.read("v", with_version=True)
        assert version == step
        np.testing.assert_allclose(value, ref.value, **TOL[dtype])
    assert client.get_meta("v").version == 5


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_sparse_round_trip_matches_reference(client, opt, dtype):
    """Lazy sparse updates: duplicates summed, untouched rows and slots unchanged."""
    rng = np.random.default_rng(2)
    init = rng.standard_normal((10, 3)).astype(dtype)
    client.create_variable("emb", initial_value=init, optimizer=opt,
                           optimizer_params=OPTIMIZERS[opt])
    ref = ReferenceOptimizer(opt, OPTIMIZERS[opt], init)
    steps = [
        np.array([1, 4, 4, 1, 6], np.int64),   # duplicates, summed before the update
        np.array([4, 4, 4], np.int32),         # int32 ids; a row touched again
        np.array([], np.int64),                # empty: still one update (version, Adam t)
        np.array([0, 6], np.int64),            # row 0 first touched at step 4: fresh slots
    ]
    for step, ids in enumerate(steps, start=1):
        rows = rng.standard_normal((ids.size, 3)).astype(dtype)
        assert client.push_sparse("emb", ids, rows) == step
        ref.apply_sparse(ids, rows)
        value, version = client.read("emb", with_version=True)
        assert version == step
        np.testing.assert_allclose(value, ref.value, **TOL[dtype])
    never = [2, 3, 5, 7, 8, 9]
    np.testing.assert_array_equal(value[never], init[never])   # bit for bit

    # Rows 2 and 3 were never pushed, so their slots must still be fresh: a
    # sparse then a dense update now give the reference's numbers only if so.
    ids = np.array([3, 2, 3], np.int64)
    rows = rng.standard_normal((3, 3)).astype(dtype)
    assert client.push_sparse("emb", ids, rows) == 5
    ref.apply_sparse(ids, rows)
    g = rng.standard_normal((10, 3)).astype(dtype)
    assert client.push("emb", g) == 6
    ref.apply_dense(g)
    value, version = client.read("emb", with_version=True)
    assert version == 6
    np.testing.assert_allclose(value, ref.value, **TOL[dtype])


def test_assign_keeps_slots_and_counts_as_a_version(client):
    rng = np.random.default_rng(3)
    init = rng.standard_normal((5, 2))
    params = OPTIMIZERS["adam"]
    client.create_variable("a", initial_value=init, optimizer="adam", optimizer_params=params)
    ref = ReferenceOptimizer("adam", params, init)
    g = rng.standard_normal((5, 2))
    client.push("a", g)
    ref.apply_dense(g)
    new = rng.standard_normal((5, 2))
    assert client.assign("a", new) == 2
    ref.assign(new)
    value, version = client.read("a", with_version=True)
    assert version == 2
    np.testing.assert_array_equal(value, new)
    g = rng.standard_normal((5, 2))
    assert client.push("a", g) == 3                # Adam's m, v and t survived the assign
    ref.apply_dense(g)
    np.testing.assert_allclose(client.read("a"), ref.value, rtol=1e-12, atol=1e-12)
    assert client.assign_many([("a", init)]) == [4]
    np.testing.assert_array_equal(client.read("a"), init)


def test_read_many_and_push_many_report_versions(client):
    client.create_variable("x", (3,), "float64", optimizer_params={"learning_rate": 1.0})
    client.create_variable("y", (2, 2), "float32", optimizer_params={"learning_rate": 1.0})
    assert client.push_many({"x": np.ones(3), "y": np.ones((2, 2), np.float32)}) == [1, 1]
    assert client.push_many([("x", np.ones(3))]) == [2]
    snaps = client.read_many(["y", "x"])
    assert [(s.name, s.version) for s in snaps] == [("y", 1), ("x", 2)]
    np.testing.assert_array_equal(snaps[1].value, np.full(3, -2.0))
    np.testing.assert_array_equal(snaps[0].value, np.full((2, 2), -1.0, np.float32))
    h = client.push_many_async({"y": np.ones((2, 2), np.float32)})
    assert h.result(timeout=30) == [2]
    assert client.read_many_async(["y"]).result(timeout=30)[0].version == 2


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_initializers(client, dtype):
    n = 20_000
    dt = np.dtype(dtype)

    def make(name, init, shape=(n,)):
        meta = client.create_variable(name, shape, dtype, initializer=init)
        assert (meta.shape, meta.dtype, meta.version) == (tuple(shape), dtype, 0)
        value = client.read(name)
        assert value.dtype == dt and value.shape == tuple(shape)
        return value

    np.testing.assert_array_equal(make("z", "zeros", (4, 5)), np.zeros((4, 5), dt))
    np.testing.assert_array_equal(make("default", None, (3,)), np.zeros(3, dt))
    np.testing.assert_array_equal(make("o", "ones", (4, 5)), np.ones((4, 5), dt))
    np.testing.assert_array_equal(make("c", Initializer("constant", value=2.5), (7,)),
                                  np.full(7, 2.5, dt))

    normal = Initializer("random_normal", mean=3.0, stddev=0.5, seed=11)
    a, b = make("n1", normal), make("n2", normal)
    np.testing.assert_array_equal(a, b)            # same seed, same values
    assert not np.array_equal(a, make("n3", Initializer("random_normal", mean=3.0,
                                                        stddev=0.5, seed=12)))
    assert abs(a.mean() - 3.0) < 0.05 and abs(a.std() - 0.5) < 0.05
    assert np.abs(a - 3.0).max() > 2 * 0.5        # not truncated

    trunc = make("t", Initializer("truncated_normal", mean=-1.0, stddev=2.0, seed=5))
    assert np.all(np.abs(trunc.astype(np.float64) + 1.0) <= 2 * 2.0 + 1e-6)
    assert trunc.std() > 1.0 and np.unique(trunc).size > n // 2
    np.testing.assert_array_equal(trunc, make("t2", Initializer("truncated_normal", mean=-1.0,
                                                                stddev=2.0, seed=5)))

    uni = make("u", Initializer("random_uniform", minval=-3.0, maxval=-1.0, seed=7))
    assert uni.min() >= -3.0 and uni.max() <= -1.0
    assert uni.min() < -2.9 and uni.max() > -1.1 and np.unique(uni).size > n // 2
    np.testing.assert_array_equal(uni, make("u2", Initializer("random_uniform", minval=-3.0,
                                                              maxval=-1.0, seed=7)))


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_gather_shapes_and_versions(client, id_dtype):
    value = np.arange(10 * 3 * 2, dtype=np.float32).reshape(10, 3, 2)
    client.create_variable("e", initial_value=value)
    for ids in ([7], [0, 9, 9, 3], [[1, 2, 3], [4, 5, 0]], 4, []):
        ids = np.array(ids, id_dtype)
        rows, version = client.gather("e", ids, with_version=True)
        assert version == 0
        assert rows.shape == ids.shape + (3, 2)
        np.testing.assert_array_equal(rows, value[ids])
    client.push("e", np.ones_like(value))
    rows, version = client.gather("e", np.array([1], id_dtype), with_version=True)
    assert version == 1
    np.testing.assert_allclose(rows, value[[1]] - 0.01, rtol=1e-6)
    one_d = client.create_variable("vec", initial_value=np.arange(5.0))
    assert one_d.shape == (5,)
    np.testing.assert_array_equal(client.gather("vec", np.array([4, 0], id_dtype)), [4.0, 0.0])


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_get_meta_list_and_delete(client, opt):
    meta = client.create_variable("layer/kernel:0", (8, 4), "float64", optimizer=opt,
                                  optimizer_params=OPTIMIZERS[opt], allow_nonfinite=True)
    assert meta == client.get_meta("layer/kernel:0")
    assert meta.name == "layer/kernel:0"
    assert (meta.shape, meta.dtype, meta.version, meta.nbytes) == ((8, 4), "float64", 0, 256)
    assert meta.allow_nonfinite is True
    slot_bytes = {"sgd": (0, 0), "momentum": (256, 256), "adagrad": (256, 256),
                  "adam": (512, 512 + 8),           # adam: m, v (+ an int64 step count)
                  "ftrl": (512, 512)}[opt]          # ftrl: accumulator, linear
    assert slot_bytes[0] <= meta.slot_nbytes <= slot_bytes[1]
    client.create_variable("b", (3,), "float32")
    client.push("b", np.ones(3, np.float32))
    listed = client.list_variables()
    assert [m.name for m in listed] == ["b", "layer/kernel:0"]
    assert listed[0].version == 1 and listed[0].nbytes == 12 and listed[0].slot_nbytes == 0
    info = client.server_info()
    assert info.num_variables == 2
    assert info.total_bytes == 256 + meta.slot_nbytes + 12

    client.delete_variable("layer/kernel:0")
    assert [m.name for m in client.list_variables()] == ["b"]
    for call in (lambda: client.get_meta("layer/kernel:0"), lambda: client.read("layer/kernel:0"),
                 lambda: client.delete_variable("layer/kernel:0"),
                 lambda: client.push("layer/kernel:0", np.ones((8, 4)))):
        with pytest.raises(NotFound, match="layer/kernel:0"):
            call()
    again = client.create_variable("layer/kernel:0", (2,), "float32", initializer="ones")
    assert again.version == 0 and again.shape == (2,)
    np.testing.assert_array_equal(client.read("layer/kernel:0"), [1.0, 1.0])


def test_exist_ok_returns_the_existing_variable(client):
    client.create_variable("w", initial_value=np.zeros(4), optimizer="momentum")
    client.push("w", np.ones(4))
    meta = client.create_variable("w", initial_value=np.full(4, 7.0), optimizer="momentum",
                                  exist_ok=True)
    assert meta.version == 1
    value, version = client.read("w", with_version=True)
    assert version == 1
    np.testing.assert_allclose(value, np.full(4, -0.01))   # not reset to 7 nor to 0


# ---------------------------------------------------------------------------
# 2. Concurrency
# ---------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_concurrent_clients_lose_no_update(ps):
    n_clients, n_pushes, size = 8, 100, 16
    with PSClient(ps.address) as c:
        c.create_variable("w", initial_value=np.zeros(size),
                          optimizer_params={"learning_rate": 1.0})
    start = threading.Barrier(n_clients, timeout=30)

    def grad(i, k):   # integer-valued float64: every sum is exact
        return (i + 1) * (1.0 + np.arange(size)) + k

    def worker(i):
        with PSClient(ps.address) as c:
            start.wait()
            return [c.push("w", grad(i, k)) for k in range(n_pushes)]

    versions = run_threads(worker, n_clients)
    everything = sorted(v for vs in versions for v in vs)
    assert everything == list(range(1, n_clients * n_pushes + 1))   # one version each
    for vs in versions:
        assert vs == sorted(vs)
    expected = -sum(grad(i, k) for i in range(n_clients) for k in range(n_pushes))
    with PSClient(ps.address) as c:
        value, version = c.read("w", with_version=True)
    assert version == n_clients * n_pushes
    np.testing.assert_array_equal(value, expected)


@pytest.mark.timeout(120)
def test_reads_are_consistent_snapshots_during_pushes(ps):
    """A read never sees half an update, and its version matches its value.

    The variable is large enough (2 MiB) that an update takes a while, so an
    unlocked read would be caught mid-update or with a stale version.
    """
    size, n_push, n_pushers = 1 << 18, 40, 3
    with PSClient(ps.address) as c:
        c.create_variable("w", initial_value=np.zeros(size),
                          optimizer_params={"learning_rate": 1.0})
    pushers_done = threading.Event()
    reader_out: dict = {}

    def pusher(i):
        with PSClient(ps.address) as c:
            for _ in range(n_push):
                c.push("w", np.ones(size))

    def reader():
        seen = []
        try:
            with PSClient(ps.address) as c:
                while not pushers_done.is_set():
                    value, version = c.read("w", with_version=True)
                    bad = np.count_nonzero(value != -float(version))
                    assert bad == 0, f"read of version {version}: {bad} elements disagree"
                    rows, gversion = c.gather("w", np.array([0, size - 1]), with_version=True)
                    assert np.all(rows == -float(gversion)), (gversion, rows)
                    seen.append(version)
        except BaseException as exc:    # re-raised in the test's thread
            reader_out["error"] = exc
        reader_out["seen"] = seen

    rt = threading.Thread(target=reader, name="test-reader")
    rt.start()
    try:
        run_threads(pusher, n_pushers)
    finally:
        pushers_done.set()
        rt.join(60)
    assert not rt.is_alive()
    if "error" in reader_out:
        raise reader_out["error"]
    assert len(reader_out["seen"]) > 1
    assert reader_out["seen"] == sorted(reader_out["seen"])
    with PSClient(ps.address) as c:
        assert c.read("w", with_version=True)[1] == n_push * n_pushers


# ---------------------------------------------------------------------------
# 3. Bad inputs: typed errors, and nothing changed
# ---------------------------------------------------------------------------
F32, F64 = np.float32, np.float64


def _t(dtype, shape, data):
    return ps_pb2.Tensor(dtype=dtype, shape=shape, data=data)


def _push_req(name, tensor):
    return ps_pb2.PushRequest(updates=[ps_pb2.DenseUpdate(name=name, tensor=tensor)])


def _frames(*frames):
    return iter(list(frames))


GOOD_W = np.ones((4, 3), F32)
BAD_CASES = [
    # (id, expected error, call(client, raw stub))
    ("push-wrong-shape", InvalidArgument, lambda c, s: c.push("w", np.ones((3, 4), F32))),
    ("push-wrong-rank", InvalidArgument, lambda c, s: c.push("w", np.ones(12, F32))),
    ("push-f64-into-f32", InvalidArgument, lambda c, s: c.push("w", np.ones((4, 3), F64))),
    ("push-f32-into-f64", InvalidArgument, lambda c, s: c.push("d64", np.ones(5, F32))),
    ("push-unknown", NotFound, lambda c, s: c.push("nope", GOOD_W)),
    ("push-nan", InvalidArgument,
     lambda c, s: c.push("w", np.where(np.eye(4, 3) > 0, np.nan, 1.0).astype(F32))),
    ("push-inf", InvalidArgument, lambda c, s: c.push("d64", np.array([1, 2, np.inf, 4, 5.0]))),
    ("push-neg-inf", InvalidArgument, lambda c, s: c.push("d64", np.full(5, -np.inf))),
    ("assign-wrong-shape", InvalidArgument, lambda c, s: c.assign("w", np.ones((4, 4), F32))),
    ("assign-wrong-dtype", InvalidArgument, lambda c, s: c.assign("w", np.ones((4, 3), F64))),
    ("assign-unknown", NotFound, lambda c, s: c.assign("nope", GOOD_W)),
    ("assign-nan", InvalidArgument, lambda c, s: c.assign("d64", np.full(5, np.nan))),
    ("read-unknown", NotFound, lambda c, s: c.read("nope")),
    ("read-many-one-unknown", NotFound, lambda c, s: c.read_many(["w", "nope"])),
    ("meta-unknown", NotFound, lambda c, s: c.get_meta("nope")),
    ("delete-unknown", NotFound, lambda c, s: c.delete_variable("nope")),
    ("gather-unknown", NotFound, lambda c, s: c.gather("nope", [0])),
    ("gather-out-of-range", InvalidArgument, lambda c, s: c.gather("emb", [0, 10])),
    ("gather-out-of-range-int32", InvalidArgument,
     lambda c, s: c.gather("emb", np.array([[1], [99]], np.int32))),
    ("gather-negative", InvalidArgument, lambda c, s: c.gather("emb", [-1])),
    ("gather-float-ids", InvalidArgument, lambda c, s: c.gather("emb", [0.0, 1.0])),
    ("gather-float-ids-raw", InvalidArgument, lambda c, s: raw(
        s.Gather, ps_pb2.GatherRequest(name="emb", ids=TP.encode(np.array([0.0, 1.0]))))),
    ("gather-scalar-variable", InvalidArgument, lambda c, s: c.gather("s", [0])),
    ("sparse-rows-count-mismatch", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [0, 1], np.ones((3, 3), F32))),
    ("sparse-row-width-mismatch", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [0, 1], np.ones((2, 4), F32))),
    ("sparse-rows-1d", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [0, 1, 2], np.ones(3, F32))),
    ("sparse-rows-wrong-dtype", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [0, 1], np.ones((2, 3), F64))),
    ("sparse-ids-2d", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [[0, 1]], np.ones((2, 3), F32))),
    ("sparse-ids-out-of-range", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [3, 10], np.ones((2, 3), F32))),
    ("sparse-ids-negative", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [3, -1], np.ones((2, 3), F32))),
    ("sparse-float-ids", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [3.0], np.ones((1, 3), F32))),
    ("sparse-float-ids-raw", InvalidArgument, lambda c, s: raw(s.PushSparse, ps_pb2.PushSparseRequest(
        name="emb", ids=TP.encode(np.array([3.0])), values=TP.encode(np.ones((1, 3), F32))))),
    ("sparse-unknown", NotFound, lambda c, s: c.push_sparse("nope", [0], np.ones((1, 3), F32))),
    ("sparse-scalar-variable", InvalidArgument,
     lambda c, s: c.push_sparse("s", [0], np.ones((1,), F32))),
    ("sparse-nan", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [1, 2], np.array([[0, 0, 0], [0, np.nan, 0]], F32))),
    ("sparse-inf", InvalidArgument,
     lambda c, s: c.push_sparse("emb", [1, 1], np.array([[0, 0, 0], [0, 0, -np.inf]], F32))),
    ("create-duplicate", AlreadyExists, lambda c, s: c.create_variable("w", (4, 3))),
    ("create-duplicate-value", AlreadyExists,
     lambda c, s: c.create_variable("w", initial_value=GOOD_W)),
    ("create-exist-ok-shape", AlreadyExists,
     lambda c, s: c.create_variable("w", (4, 4), exist_ok=True)),
    ("create-exist-ok-dtype", AlreadyExists,
     lambda c, s: c.create_variable("w", (4, 3), "float64", exist_ok=True)),
    ("create-exist-ok-optimizer", AlreadyExists,
     lambda c, s: c.create_variable("w", (4, 3), optimizer="adam", exist_ok=True)),
    ("create-exist-ok-params", AlreadyExists, lambda c, s: c.create_variable(
        "w", (4, 3), optimizer_params={"learning_rate": 0.5}, exist_ok=True)),
    ("create-bad-optimizer", InvalidArgument,
     lambda c, s: c.create_variable("new", (2,), optimizer="rmsprop")),
    *[(f"create-ftrl-{key}-{value}", InvalidArgument,
       lambda c, s, key=key, value=value: c.create_variable(
           "new", (2,), optimizer="ftrl", optimizer_params={key: value}))
      for key, value in (("learning_rate_power", 0.5), ("initial_accumulator_value", -0.1),
                         ("l1_regularization_strength", -1e-3),
                         ("l2_regularization_strength", -1e-3),
                         ("l2_shrinkage_regularization_strength", -1e-3), ("beta", -0.1),
                         ("learning_rate", 0.0), ("beta", float("inf")))],
    ("create-empty-optimizer-params-bad", InvalidArgument,
     lambda c, s: c.create_variable("new", (2,), optimizer="sgd",
                                    optimizer_params={"learning_rate": 0.0})),
    ("create-negative-lr", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), optimizer="adam", optimizer_params={"learning_rate": -1.0})),
    ("create-nan-lr", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), optimizer_params={"learning_rate": float("nan")})),
    ("create-momentum-1.5", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), optimizer="momentum", optimizer_params={"momentum": 1.5})),
    ("create-nesterov-0.5", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), optimizer="momentum", optimizer_params={"nesterov": 0.5})),
    ("create-adam-beta-1", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), optimizer="adam", optimizer_params={"beta_1": 1.0})),
    ("create-adam-epsilon-0", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), optimizer="adam", optimizer_params={"epsilon": 0.0})),
    ("create-adagrad-negative-accumulator", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), optimizer="adagrad", optimizer_params={"initial_accumulator_value": -0.1})),
    ("create-unknown-key", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), optimizer="sgd", optimizer_params={"momentum": 0.9})),
    ("create-unknown-key-adam", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), optimizer="adam", optimizer_params={"beta1": 0.9})),
    ("create-bad-initializer", InvalidArgument,
     lambda c, s: c.create_variable("new", (2,), initializer="glorot_uniform")),
    ("create-bad-stddev", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), initializer=Initializer("random_normal", stddev=-1.0))),
    ("create-bad-trunc-stddev", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), initializer=Initializer("truncated_normal", stddev=float("nan")))),
    ("create-bad-uniform-bounds", InvalidArgument, lambda c, s: c.create_variable(
        "new", (2,), initializer=Initializer("random_uniform", minval=1.0, maxval=0.0))),
    ("create-empty-name", InvalidArgument, lambda c, s: c.create_variable("", (2,))),
    ("create-name-space", InvalidArgument, lambda c, s: c.create_variable("a b", (2,))),
    ("create-name-newline", InvalidArgument, lambda c, s: c.create_variable("a\nb", (2,))),
    ("create-name-unicode", InvalidArgument, lambda c, s: c.create_variable("wéight", (2,))),
    ("create-name-too-long", InvalidArgument, lambda c, s: c.create_variable("x" * 257, (2,))),
    ("create-dtype-int32", InvalidArgument, lambda c, s: c.create_variable("new", (2,), "int32")),
    ("create-dtype-complex", InvalidArgument,
     lambda c, s: c.create_variable("new", (2,), "complex64")),
    ("create-dtype-unknown-raw", InvalidArgument, lambda c, s: raw(
        s.CreateVariable, ps_pb2.CreateVariableRequest(name="new", dtype="bfloat16", shape=[2]))),
    ("create-negative-dim", InvalidArgument, lambda c, s: c.create_variable("new", (-1, 3))),
    ("create-rank-9", InvalidArgument, lambda c, s: c.create_variable("new", (1,) * 9)),
    ("create-value-shape-mismatch", InvalidArgument,
     lambda c, s: c.create_variable("new", (2, 2), initial_value=np.ones(3))),
    ("create-nan-value", InvalidArgument,
     lambda c, s: c.create_variable("new", initial_value=np.array([1.0, np.nan]))),
    ("create-value-and-initializer", InvalidArgument,
     lambda c, s: c.create_variable("new", initial_value=np.ones(2), initializer="ones")),
    ("push-many-2nd-bad-shape", InvalidArgument,
     lambda c, s: c.push_many([("w", GOOD_W), ("emb", np.ones((10, 4), F32))])),
    ("push-many-2nd-unknown", NotFound,
     lambda c, s: c.push_many([("w", GOOD_W), ("nope", GOOD_W)])),
    ("push-many-2nd-nan", InvalidArgument,
     lambda c, s: c.push_many({"d64": np.ones(5), "w": np.full((4, 3), np.nan, F32)})),
    ("push-many-2nd-dtype", InvalidArgument,
     lambda c, s: c.push_many([("w", GOOD_W), ("d64", np.ones(5, F32))])),
    ("assign-many-2nd-bad", InvalidArgument,
     lambda c, s: c.assign_many([("d64", np.zeros(5)), ("w", np.ones((4, 3), F64))])),
    ("raw-push-short-data", InvalidArgument,
     lambda c, s: raw(s.Push, _push_req("w", _t("float32", [4, 3], b"\0" * 47)))),
    ("raw-push-long-data", InvalidArgument,
     lambda c, s: raw(s.Push, _push_req("w", _t("float32", [4, 3], b"\0" * 49)))),
    ("raw-push-2nd-malformed", InvalidArgument, lambda c, s: raw(s.Push, ps_pb2.PushRequest(updates=[
        ps_pb2.DenseUpdate(name="d64", tensor=TP.encode(np.ones(5))),
        ps_pb2.DenseUpdate(name="w", tensor=_t("float32", [4, 3], b"\0" * 8))]))),
    ("raw-push-int8", InvalidArgument,
     lambda c, s: raw(s.Push, _push_req("w", _t("int8", [4, 3], b"\0" * 12)))),
    ("raw-push-negative-shape", InvalidArgument,
     lambda c, s: raw(s.Push, _push_req("w", _t("float32", [-4, -3], b"\0" * 48)))),
    ("raw-assign-short-data", InvalidArgument, lambda c, s: raw(s.Assign, ps_pb2.AssignRequest(
        updates=[ps_pb2.DenseUpdate(name="d64", tensor=_t("float64", [5], b"\0" * 39))]))),
    ("raw-create-short-data", InvalidArgument, lambda c, s: raw(s.CreateVariable,
        ps_pb2.CreateVariableRequest(name="new", dtype="float32", shape=[2],
                                     initial_value=_t("float32", [2], b"\0" * 4)))),
    ("raw-sparse-short-values", InvalidArgument, lambda c, s: raw(s.PushSparse,
        ps_pb2.PushSparseRequest(name="emb", ids=TP.encode(np.array([1, 2])),
                                 values=_t("float32", [2, 3], b"\0" * 20)))),
    ("raw-sparse-short-ids", InvalidArgument, lambda c, s: raw(s.PushSparse,
        ps_pb2.PushSparseRequest(name="emb", ids=_t("int64", [2], b"\0" * 9),
                                 values=TP.encode(np.ones((2, 3), F32))))),
    ("raw-gather-short-ids", InvalidArgument, lambda c, s: raw(
        s.Gather, ps_pb2.GatherRequest(name="emb", ids=_t("int32", [3], b"\0" * 8)))),
    ("raw-upload-empty", InvalidArgument, lambda c, s: raw(s.Upload, _frames())),
    ("raw-upload-no-request", InvalidArgument,
     lambda c, s: raw(s.Upload, _frames(ps_pb2.UploadFrame(chunk=b"\0" * 48)))),
    ("raw-upload-too-few-bytes", InvalidArgument, lambda c, s: raw(s.Upload, _frames(
        ps_pb2.UploadFrame(push=_push_req("w", _t("float32", [4, 3], b""))),
        ps_pb2.UploadFrame(chunk=b"\0" * 40)))),
    ("raw-upload-too-many-bytes", InvalidArgument, lambda c, s: raw(s.Upload, _frames(
        ps_pb2.UploadFrame(push=_push_req("w", _t("float32", [4, 3], b""))),
        ps_pb2.UploadFrame(chunk=b"\0" * 40), ps_pb2.UploadFrame(chunk=b"\0" * 40)))),
    ("raw-upload-two-requests", InvalidArgument, lambda c, s: raw(s.Upload, _frames(
        ps_pb2.UploadFrame(push=_push_req("w", _t("float32", [4, 3], b""))),
        ps_pb2.UploadFrame(push=_push_req("w", _t("float32", [4, 3], b"\0" * 48)))))),
    ("raw-upload-bad-shape", InvalidArgument, lambda c, s: raw(s.Upload, _frames(
        ps_pb2.UploadFrame(push=_push_req("w", _t("float32", [3, 4], b""))),
        ps_pb2.UploadFrame(chunk=b"\0" * 48)))),
    ("raw-upload-create-nan", InvalidArgument, lambda c, s: raw(s.Upload, _frames(
        ps_pb2.UploadFrame(create=ps_pb2.CreateVariableRequest(
            name="new", dtype="float64", shape=[2], initial_value=_t("float64", [2], b""))),
        ps_pb2.UploadFrame(chunk=np.array([1.0, np.nan]).tobytes())))),
]


@pytest.fixture(scope="module")
def bad_input_server():
    """One server for the whole table: each case checks that nothing changed."""
    task = start_task("psserver", ["--port", "0"])
    try:
        with PSClient(task.address) as c:
            c.create_variable("w", initial_value=np.arange(12, dtype=F32).reshape(4, 3))
            c.create_variable("emb", initial_value=np.arange(30, dtype=F32).reshape(10, 3),
                              optimizer="adam", optimizer_params={"learning_rate": 0.1})
            c.create_variable("d64", initial_value=np.arange(5.0), optimizer="momentum")
            c.create_variable("s", (), "float32", initializer=Initializer("constant", value=3.0))
            c.push("w", GOOD_W)
            c.push_sparse("emb", [1, 1, 2], np.ones((3, 3), F32))
        yield task
    finally:
        task.kill()


@pytest.mark.parametrize("expected, call", [c[1:] for c in BAD_CASES],
                         ids=[c[0] for c in BAD_CASES])
def test_bad_input_is_refused_and_changes_nothing(bad_input_server, expected, call):
    with PSClient(bad_input_server.address) as c, raw_stub(bad_input_server.address) as stub:
        before = state(c)
        with pytest.raises(expected) as info:
            call(c, stub)
        assert type(info.value) is expected, f"{type(info.value).__name__}: {info.value}"
        assert str(info.value), "error without a message"
        assert state(c) == before, "a refused request changed the server's state"
    assert bad_input_server.alive()


def test_bad_input_server_still_serves(bad_input_server):
    """After every bad input above, the same server still works."""
    with PSClient(bad_input_server.address) as c:
        before = c.read("w", with_version=True)
        assert c.push("w", GOOD_W) == before[1] + 1
        np.testing.assert_allclose(c.read("w"), before[0] - 0.01, rtol=1e-6)
        assert [m.name for m in c.list_variables()] == ["d64", "emb", "s", "w"]
    assert bad_input_server.alive()


def test_nonfinite_accepted_with_allow_nonfinite(client):
    client.create_variable("f", initial_value=np.array([[1.0, np.inf], [0.0, 0.0]], F32),
                           optimizer_params={"learning_rate": 1.0}, allow_nonfinite=True)
    assert client.get_meta("f").allow_nonfinite
    assert client.push("f", np.array([[np.nan, 0], [0, 0]], F32)) == 1
    assert client.push_sparse("f", [1], np.array([[np.inf, -1]], F32)) == 2
    value = client.read("f")
    assert np.isnan(value[0, 0]) and value[0, 1] == np.inf
    assert value[1, 0] == -np.inf and value[1, 1] == 1.0
    assert client.assign("f", np.full((2, 2), np.nan, F32)) == 3
    assert np.isnan(client.read("f")).all()


def test_push_many_second_bad_applies_nothing_then_good_applies_all(client):
    client.create_variable("a", initial_value=np.zeros(3), optimizer_params={"learning_rate": 1.0})
    client.create_variable("b", initial_value=np.zeros(2), optimizer_params={"learning_rate": 1.0})
    with pytest.raises(InvalidArgument):
        client.push_many([("a", np.ones(3)), ("b", np.ones(3))])
    assert [s.version for s in client.read_many(["a", "b"])] == [0, 0]
    np.testing.assert_array_equal(client.read("a"), np.zeros(3))
    assert client.push_many([("a", np.ones(3)), ("b", np.ones(2))]) == [1, 1]
    np.testing.assert_array_equal(client.read("a"), -np.ones(3))


def test_oversized_unary_message_is_resource_exhausted(start_ps):
    ps = start_ps("--max-message-bytes", "65536", "--chunk-bytes", str(16 * KiB))
    with PSClient(ps.address, max_message_bytes=65536, chunk_bytes=16 * KiB) as c:
        c.create_variable("w", (100_000,), "float32")
        with raw_stub(ps.address) as stub:
            big = _push_req("w", TP.encode(np.ones(100_000, F32)))    # ~400 KB, one message
            assert big.ByteSize() > 2 * 65536
            with pytest.raises(ResourceExhausted):
                raw(stub.Push, big)
            with pytest.raises(ResourceExhausted):
                raw(stub.CreateVariable, ps_pb2.CreateVariableRequest(
                    name="x", dtype="float32", shape=[100_000],
                    initial_value=TP.encode(np.ones(100_000, F32))))
            reply = raw(stub.GetMeta, ps_pb2.VariableRef(name="w"))   # same channel still works
            assert reply.version == 0
        # the same data through PSClient is framed and goes through
        value, version = c.read("w", with_version=True)
        assert version == 0 and not value.any()
        assert [m.name for m in c.list_variables()] == ["w"]
        assert c.push("w", np.ones(100_000, F32)) == 1
        np.testing.assert_allclose(c.read("w"), np.full(100_000, -0.01, F32))
    assert ps.alive()


def test_max_memory_bytes_limits_creates(start_ps):
    ps = start_ps("--max-memory-bytes", str(1 * MiB))
    with PSClient(ps.address) as c:
        c.create_variable("a", (128 * KiB,), "float32")                 # 512 KiB
        with pytest.raises(ResourceExhausted, match="max-memory-bytes"):
            c.create_variable("b", (150 * KiB,), "float32")             # 600 KiB more
        with pytest.raises(ResourceExhausted):                          # 3 x 192 KiB with slots
            c.create_variable("c", (48 * KiB,), "float32", optimizer="adam")
        with pytest.raises(ResourceExhausted):
            c.create_variable("d", initial_value=np.ones(150 * KiB, F32))
        assert [m.name for m in c.list_variables()] == ["a"]
        assert c.server_info().total_bytes == 512 * KiB
        c.create_variable("c", (32 * KiB,), "float32", optimizer="adam")  # 3 x 128 KiB fits
        c.delete_variable("a")                                          # frees its bytes
        c.create_variable("b", (150 * KiB,), "float32")
        assert sorted(m.name for m in c.list_variables()) == ["b", "c"]
        assert c.push("b", np.ones(150 * KiB, F32)) == 1
    assert ps.alive()


def sync_pushes_until_refused(c: PSClient, what: str, rows: int, tries: int) -> int:
    """Replicas of a sync step that never completes (step 0, required 1000),
    each ``rows`` rows of 32 float32, pushed to table "t" (``what`` "table")
    or to variable "w" ("variable rows") until one is refused: raises that
    refusal, its ``accepted`` attribute the pushes taken before it."""
    from psserver.contract import SyncSpec
    grads, ids = np.ones((rows, 32), F32), np.arange(rows)
    accepted = 0
    try:
        for replica in range(tries):
            spec = SyncSpec(0, replica, 1000, 1000)
            if what == "table":
                c.update_table("t", ids, grads, sync=spec)
            else:
                c.push_sparse("w", ids, grads, sync=spec)
            accepted += 1
    except PSError as exc:
        exc.accepted = accepted
        raise
    return accepted


@pytest.mark.parametrize("what", ["table", "variable rows"])
def test_sync_steps_that_never_complete_count_against_max_memory_bytes(start_ps, what):
    """Issue 33 item 2: row-wise sync updates of a step that never completes
    (required 1000) grew a server far past --max-memory-bytes while it said
    it held almost nothing. What a step gathers now counts: past the limit
    a push is refused (ResourceExhausted, nothing gathered), and the server
    reports the bytes it holds for the step."""
    limit, rows = 16 * MiB, 16 * 1024           # 16k rows of 32 float32: 2 MiB a push
    ps = start_ps("--max-memory-bytes", str(limit))
    with PSClient(ps.address) as c:
        if what == "table":
            c.create_table("t", 32)
        else:
            c.create_variable("w", (rows, 32), "float32")
        held0 = c.server_info().total_bytes
        with pytest.raises(ResourceExhausted, match="sync step 0's gradient") as refused:
            sync_pushes_until_refused(c, what, rows, 20)   # 40 MiB unless stopped
        accepted = refused.value.accepted
        assert 3 <= accepted <= 8, accepted     # the limit, less what the server holds
        info = [t for t in c.list_tables()] if what == "table" else c.list_variables()
        assert info   # still serving
        if what == "variable rows":   # the step's bytes are the variable's, as the server says
            assert c.server_info().total_bytes >= held0 + accepted * 2 * MiB
    assert ps.alive()


# ---------------------------------------------------------------------------
# 4. Large tensors: framed transfers
# ---------------------------------------------------------------------------
SMALL_LIMIT = ("--max-message-bytes", str(MiB), "--chunk-bytes", str(256 * KiB))


def small_client(address: str, shared_memory: bool = False, **kw) -> PSClient:
    """A client with a 1 MiB message limit; gRPC only unless shared_memory."""
    return PSClient(address, max_message_bytes=MiB, chunk_bytes=256 * KiB,
                    shared_memory=shared_memory, **kw)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_large_tensors_are_streamed_exactly(start_ps, dtype, shared_memory):
    """Tensors over the message limit: in frames over gRPC, or through shared
    memory (psserver/contract/shm.py) when the client may use it."""
    ps = start_ps(*SMALL_LIMIT)
    rng = np.random.default_rng(4)
    rows, cols = 2048, 768                              # 6 MiB (f32) / 12 MiB (f64)
    init = rng.standard_normal((rows, cols)).astype(dtype)
    with small_client(ps.address, shared_memory) as c:
        meta = c.create_variable("big", initial_value=init,
                                 optimizer_params={"learning_rate": 0.5})
        assert meta.nbytes == init.nbytes > 4 * MiB
        # the limit is real: one unary Read of it is refused
        with raw_stub(ps.address) as stub, pytest.raises(ResourceExhausted):
            raw(stub.Read, ps_pb2.ReadRequest(names=["big"]))
        value, version = c.read("big", with_version=True)
        assert version == 0
        np.testing.assert_array_equal(value, init)

        ref = ReferenceOptimizer("sgd", {"learning_rate": 0.5}, init)
        g = rng.standard_normal((rows, cols)).astype(dtype)
        assert c.push("big", g) == 1
        ref.apply_dense(g)
        np.testing.assert_array_equal(c.read("big"), ref.value)

        ids = rng.integers(0, rows, 1000)               # ~3 MiB of rows, with duplicates
        ids[:10] = ids[10]
        sparse_rows = rng.standard_normal((ids.size, cols)).astype(dtype)
        assert c.push_sparse("big", ids, sparse_rows) == 2
        ref.apply_sparse(ids, sparse_rows)
        np.testing.assert_allclose(c.read("big"), ref.value, **TOL[dtype])

        gids = np.array([0, rows - 1, 17, 17, 1000])
        got, gversion = c.gather("big", gids, with_version=True)
        assert gversion == 2
        np.testing.assert_array_equal(got, c.read("big")[gids])

        new = rng.standard_normal((rows, cols)).astype(dtype)
        assert c.assign("big", new) == 3
        np.testing.assert_array_equal(c.read("big"), new)

        # several variables, each small, together over the limit
        parts = {f"p{i}": rng.standard_normal(100_000).astype(dtype) for i in range(3)}
        for name, v in parts.items():
            c.create_variable(name, initial_value=v, optimizer_params={"learning_rate": 1.0})
        snaps = c.read_many(["big", *parts])
        assert [s.name for s in snaps] == ["big", *parts]
        np.testing.assert_array_equal(snaps[0].value, new)
        for s in snaps[1:]:
            np.testing.assert_array_equal(s.value, parts[s.name])
        grads = {name: np.ones_like(v) for name, v in parts.items()}
        assert c.push_many(grads) == [1, 1, 1]
        for s in c.read_many(list(parts)):
            np.testing.assert_array_equal(s.value, parts[s.name] - 1)
            assert s.version == 1
        assert (c._segments._arena is not None) == shared_memory   # the path under test was taken

    # a fresh client does not know the sizes: it falls back to the stream
    with small_client(ps.address) as fresh:
        np.testing.assert_array_equal(fresh.read("big"), new)
        assert fresh.read("big", with_version=True)[1] == 3


@pytest.mark.timeout(60)
def test_gather_larger_than_one_message(start_ps):
    ps = start_ps(*SMALL_LIMIT)
    value = np.arange(4096 * 256, dtype=F32).reshape(4096, 256)    # 4 MiB
    with small_client(ps.address) as c:
        c.create_variable("big", initial_value=value)
        ids = np.arange(4096)[::-1].copy()                         # 4 MiB of rows
        np.testing.assert_array_equal(c.gather("big", ids), value[ids])


@pytest.mark.timeout(60)
def test_small_message_limit_with_default_chunk_bytes_server(start_ps):
    ps = start_ps("--max-message-bytes", str(MiB))
    value = np.arange(2 * MiB, dtype=F32)                          # 8 MiB
    with small_client(ps.address) as c:
        c.create_variable("big", initial_value=value)
        np.testing.assert_array_equal(c.read("big"), value)


@pytest.mark.timeout(60)
def test_small_message_limit_with_default_chunk_bytes_client(start_ps):
    ps = start_ps(*SMALL_LIMIT)
    value = np.arange(2 * MiB, dtype=F32)                          # 8 MiB
    with PSClient(ps.address, max_message_bytes=MiB, shared_memory=False, data_port=False) as c:
        c.create_variable("big", initial_value=value)
        np.testing.assert_array_equal(c.read("big"), value)


@pytest.mark.timeout(300)
def test_one_gib_variable(ps):
    with PSClient(ps.address, shared_memory=False, data_port=False) as client:   # gRPC frames
        _one_gib_variable(client)


def _one_gib_variable(client: PSClient) -> None:
    n = GiB // 4                                                    # float32 elements
    meta = client.create_variable("huge", (n,), "float32", initializer="zeros",
                                  optimizer_params={"learning_rate": 0.5})
    assert meta.nbytes == GiB
    value, version = client.read("huge", with_version=True)
    assert value.shape == (n,) and version == 0
    assert not value.any()
    del value
    grad = np.full(n, 2.0, F32)
    grad[[0, 12345, n - 1]] = [4.0, -2.0, 8.0]
    assert client.push("huge", grad) == 1
    del grad
    value = client.read("huge")
    assert value[0] == -2.0 and value[12345] == 1.0 and value[n - 1] == -4.0
    assert value[1] == -1.0 and value[n // 2] == -1.0
    assert np.count_nonzero(value == -1.0) == n - 3
    del value
    rows, version = client.gather("huge", [0, 12345, n - 1, n // 3], with_version=True)
    assert version == 1
    np.testing.assert_array_equal(rows, [-2.0, 1.0, -4.0, -1.0])
    assert client.server_info().total_bytes == GiB


# ---------------------------------------------------------------------------
# 5. SIGTERM mid-traffic
# ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_mid_traffic_exits_zero_and_clients_get_unavailable(start_ps, sig):
    ps = start_ps()
    with PSClient(ps.address) as c:
        c.create_variable("w", initial_value=np.zeros(10_000))
    n = 4
    pushing = [threading.Event() for _ in range(n)]

    def pusher(i):
        pushes = 0
        with PSClient(ps.address, timeout=10) as c:
            try:
                while True:
                    c.push("w", np.ones(10_000))
                    pushes += 1
                    pushing[i].set()
            except errors.PSError as exc:
                return pushes, exc
            finally:
                pushing[i].set()

    results: list = [None] * n
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, pusher(i)))
               for i in range(n)]
    for t in threads:
        t.start()
    try:
        for e in pushing:
            assert e.wait(30), "a pusher never got going"
        if sig == signal.SIGTERM:
            rc = ps.terminate(timeout=20)
        else:
            ps.proc.send_signal(sig)
            rc = ps.proc.wait(20)
    finally:
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a client hung after the server stopped"
    assert rc == 0, ps.output()
    for pushes, exc in results:
        assert pushes >= 1
        assert type(exc) is Unavailable, f"{type(exc).__name__}: {exc}"
    with PSClient(ps.address, timeout=5) as c, pytest.raises(Unavailable):
        c.push("w", np.ones(10_000))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", ["psserver", "psworker"])
def test_a_burst_of_signals_still_stops_the_task(module):
    """SIGTERMs 10 us apart (LocalCluster.stop sends two, a terminal's
    Ctrl-Cs or an orchestrator may send more): the task exits. Before, a
    second signal arriving inside the first one's handler (the stop
    event's set, holding its lock) deadlocked the main thread until
    SIGKILL, in about one task in four; eight tries each."""
    import os
    import time
    for _ in range(8):
        task = start_task(module, ["--port", "0"])
        try:
            for _ in range(1000):
                os.kill(task.proc.pid, signal.SIGTERM)
                until = time.perf_counter() + 1e-5
                while time.perf_counter() < until:
                    pass
            try:
                rc = task.proc.wait(20)   # (it stops at once: no call in flight)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{module} did not stop after a burst of SIGTERMs:\n"
                            + task.output())
            assert rc in (0, -signal.SIGTERM), task.output()   # (-15: one came after the stop)
        finally:
            task.kill()


# ---------------------------------------------------------------------------
# 6. Health
# ---------------------------------------------------------------------------
def test_health_reports_serving(ps):
    with grpc.insecure_channel(ps.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pstrain.v1.ParameterServer"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------------------
# 7. Token auth
# ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_token_auth(start_ps):
    ps = start_ps(*SMALL_LIMIT, env={"PSTRAIN_AUTH_TOKEN": "s3cret"})
    big = np.arange(512 * KiB, dtype=F32)                      # 2 MiB: framed calls too
    with small_client(ps.address, token="s3cret") as good:
        good.create_variable("w", initial_value=np.arange(4.0))
        good.create_variable("big", initial_value=big)
        before = state(good)
    for token in (None, "wrong", "s3cret "):
        with small_client(ps.address, token=token) as bad:
            calls = [
                lambda: bad.server_info(),
                lambda: bad.list_variables(),
                lambda: bad.get_meta("w"),
                lambda: bad.read("w"),
                lambda: bad.read("big"),
                lambda: bad.gather("w", [0]),
                lambda: bad.push("w", np.ones(4)),
                lambda: bad.push_sparse("w", [1], np.ones(1)),
                lambda: bad.assign("w", np.zeros(4)),
                lambda: bad.push("big", np.ones_like(big)),            # Upload stream
                lambda: bad.create_variable("x", (2,)),
                lambda: bad.create_variable("y", initial_value=big),  # Upload stream
                lambda: bad.delete_variable("w"),
            ]
            bad._sizes.remember("big", big.nbytes, big.shape)        # so read("big") takes ReadStream
            calls.append(lambda: bad.read("big"))
            for call in calls:
                with pytest.raises(Unauthenticated, match="token"):
                    call()
    with grpc.insecure_channel(ps.address) as channel:   # probes need no token
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pstrain.v1.ParameterServer"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with small_client(ps.address, token="s3cret") as good:
        assert state(good) == before                     # nothing refused was applied
        assert good.push("w", np.ones(4)) == 1
        np.testing.assert_allclose(good.read("w"), np.arange(4.0) - 0.01)
        np.testing.assert_array_equal(good.read("big"), big)


# ---------------------------------------------------------------------------
# 9. The psserver command
# ---------------------------------------------------------------------------
def _run_psserver(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "psserver", *args], env=child_env(),
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_cli_port_file(start_ps, tmp_path):
    port_file = tmp_path / "ps0.port"
    ps = start_ps("--port-file", str(port_file))
    port = int(ps.address.rsplit(":", 1)[1])
    with PSClient(f"127.0.0.1:{port}") as c:
        assert c.server_info().protocol_version == PROTOCOL_VERSION
    # The file is written while serving; once the server has exited on SIGTERM
    # it is certainly there (no polling needed).
    assert ps.terminate() == 0
    assert port_file.read_text() == f"{port}\n"
    assert not list(tmp_path.glob("*.tmp*")), "temporary port file left behind"


def test_cli_help():
    out = _run_psserver("--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: psserver")
    for flag in ("--port", "--port-file", "--host", "--grace", "--max-message-bytes",
                 "--chunk-bytes", "--max-memory-bytes", "--threads"):
        assert flag in out.stdout


def test_cli_bad_argument_exits_nonzero():
    out = _run_psserver("--port", "not-a-number")
    assert out.returncode == 2 and "--port" in out.stderr


def test_a_checkpoint_dir_that_cannot_be_written_is_refused_at_start(tmp_path):
    """Issue 35 item 3: a missing --checkpoint-dir was accepted without a word
    (the first save then failed, or the coordinator made it elsewhere)."""
    (tmp_path / "file").write_text("")
    for d, why in ((tmp_path / "missing", "does not exist"), (tmp_path / "file",
                                                               "is not a directory")):
        out = _run_psserver("--port", "0", "--checkpoint-dir", str(d))
        assert out.returncode == 2, out.stderr
        assert f"--checkpoint-dir {d} {why}: create it (mkdir -p {d})" in out.stderr
        assert not (tmp_path / "missing").exists()


def test_cli_port_in_use_exits_nonzero():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _run_psserver("--port", str(port))
    assert out.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "listening" not in out.stdout
    # issue 35 item 7: ours alone (no gRPC log line first), one period, the right flag
    assert "add_port.cc" not in out.stderr and ".." not in out.stderr
    assert "Pick another --port" in out.stderr and "--data-port" not in out.stderr


@pytest.mark.parametrize("role", ["psserver", "psworker"])
def test_a_taken_data_port_is_named_with_its_flag(role):
    import sys
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", role, "--port", "0", "--data-port",
                              str(port)], capture_output=True, text=True, timeout=60,
                             env=child_env())
    assert out.returncode == 2
    assert f"cannot listen on data port 127.0.0.1:{port}: " in out.stderr, out.stderr
    assert "Pick another --data-port" in out.stderr and "127.0.0.1:0" not in out.stderr


def test_cli_port_held_by_another_psserver_exits_nonzero(start_ps):
    first = start_ps()
    port = first.address.rsplit(":", 1)[1]
    with pytest.raises(RuntimeError, match="cannot listen"):
        start_ps("--port", port)
