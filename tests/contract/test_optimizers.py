"""psserver.contract.optimizers against an independent plain-numpy reference (Keras 3 formulas)."""
from __future__ import annotations

import numpy as np
import pytest
from reference_optimizers import DEFAULTS as KERAS_DEFAULTS
from reference_optimizers import STEPS as REF_STEPS
from reference_optimizers import ReferenceOptimizer, initial_slots

from psserver.contract.optimizers import OPTIMIZERS, make_optimizer
from psserver.contract.rows import sum_duplicates

STEPS = 5
TOL = {np.float32: dict(rtol=1e-5, atol=0.0), np.float64: dict(rtol=1e-12, atol=0.0)}

# (optimizer name, params): defaults and a few non-default settings.
CASES = [
    ("sgd", {}),
    ("sgd", {"learning_rate": 0.3}),
    ("momentum", {}),
    ("momentum", {"learning_rate": 0.05, "momentum": 0.5, "nesterov": 1.0}),
    ("adagrad", {}),
    ("adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.0, "epsilon": 1e-3}),
    ("adam", {}),
    ("adam", {"learning_rate": 0.01, "beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-3}),
    ("ftrl", {}),
    ("ftrl", {"learning_rate": 0.1, "learning_rate_power": -0.7,
              "initial_accumulator_value": 0.3, "l1_regularization_strength": 0.01,
              "l2_regularization_strength": 0.02, "l2_shrinkage_regularization_strength": 0.05,
              "beta": 0.4}),
    ("ftrl", {"learning_rate": 0.05, "learning_rate_power": 0.0, "l1_regularization_strength": 0.5}),
]
CASE_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items()) or 'defaults'}" for n, p in CASES]


# The reference: one step of each optimizer, written out plainly in the array's
# dtype (tests/reference_optimizers.py: Keras 3's formulas, no psserver import).
def ref_init(name, p, var):
    return initial_slots(name, {**KERAS_DEFAULTS[name], **p}, var)


def ref_step(name, p, var, state, g, step):
    """New var; ``state`` updated. ``step`` is the 1-based Adam step."""
    return REF_STEPS[name](var, g, state, {**KERAS_DEFAULTS[name], **p}, step)


def _close(actual, expected, dtype):
    np.testing.assert_allclose(actual, expected, **TOL[dtype])


# --------------------------------------------------------------------------
# Dense
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(13,), (6, 5), ()], ids=["1d", "2d", "scalar"])
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_dense_matches_reference(name, params, shape, dtype):
    rng = np.random.default_rng(1234)
    opt = make_optimizer(name, params)
    var = rng.standard_normal(shape).astype(dtype)
    slots = opt.create_slots(var)
    ref_var, ref_state = var.copy(), ref_init(name, params, var)
    for step in range(1, STEPS + 1):
        g = rng.standard_normal(shape).astype(dtype)
        g_before = g.copy()
        opt.apply_dense(var, slots, g)
        ref_var = ref_step(name, params, ref_var, ref_state, g_before, step)
        np.testing.assert_array_equal(g, g_before)  # gradient untouched
        assert var.dtype == dtype and var.shape == shape
        _close(var, ref_var, dtype)
        for k, a in ref_state.items():
            assert slots[k].dtype == dtype and slots[k].shape == shape
            _close(slots[k], a, dtype)
        if name == "adam":
            assert slots["iterations"].dtype == np.int64 and slots["iterations"].shape == ()
            assert int(slots["iterations"]) == step


def test_dense_is_in_place():
    opt = make_optimizer("adam")
    var = np.ones((4, 3), np.float32)
    slots = opt.create_slots(var)
    ptrs = {k: a.__array_interface__["data"][0] for k, a in slots.items()}
    vptr = var.__array_interface__["data"][0]
    opt.apply_dense(var, slots, np.full((4, 3), 0.5, np.float32))
    assert var.__array_interface__["data"][0] == vptr
    assert {k: a.__array_interface__["data"][0] for k, a in slots.items()} == ptrs
    assert not np.array_equal(var, np.ones((4, 3), np.float32))
    assert not np.array_equal(slots["m"], np.zeros((4, 3), np.float32))


# --------------------------------------------------------------------------
# Sparse (lazy)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("row_shape", [(), (4,), (2, 3)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_sparse_matches_reference(name, params, row_shape, dtype):
    rng = np.random.default_rng(99)
    n_rows = 20
    opt = make_optimizer(name, params)
    var = rng.standard_normal((n_rows,) + row_shape).astype(dtype)
    slots = opt.create_slots(var)
    ref_var, ref_state = var.copy(), ref_init(name, params, var)
    for step in range(1, STEPS + 1):
        ids = rng.choice(n_rows, size=7, replace=False).astype(np.int64)  # unsorted, unique
        rows = rng.standard_normal((len(ids),) + row_shape).astype(dtype)
        var_before = var.copy()
        slots_before = {k: a.copy() for k, a in slots.items()}

        opt.apply_sparse(var, slots, ids, rows)

        # Reference: the same step applied to the selected rows only.
        sub_state = {k: a[ids] for k, a in ref_state.items()}
        ref_var[ids] = ref_step(name, params, ref_var[ids], sub_state, rows, step)
        for k, a in sub_state.items():
            ref_state[k][ids] = a

        untouched = np.setdiff1d(np.arange(n_rows), ids)
        # Rows not in ids: bit-for-bit unchanged, variable and slots.
        assert var[untouched].tobytes() == var_before[untouched].tobytes()
        for k in ref_state:
            assert slots[k][untouched].tobytes() == slots_before[k][untouched].tobytes()
        # Rows in ids: as the reference.
        _close(var[ids], ref_var[ids], dtype)
        for k, a in ref_state.items():
            _close(slots[k][ids], a[ids], dtype)
        # Overall (untouched rows of the reference are untouched too).
        _close(var, ref_var, dtype)
        if name == "adam":
            assert int(slots["iterations"]) == step


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_sparse_with_duplicate_ids_matches_reference_optimizer(name, params, dtype):
    """Duplicate ids as a push brings them: summed by sum_duplicates (as the
    store does), then one lazy update, against reference_optimizers (its own
    summing loop), dense and sparse steps mixed."""
    rng = np.random.default_rng(31)
    opt = make_optimizer(name, params)
    var = rng.standard_normal((12, 3)).astype(dtype)
    slots = opt.create_slots(var)
    ref = ReferenceOptimizer(name, params, var)
    for step in range(STEPS):
        ids = rng.integers(0, 12, 9)   # duplicates, unsorted
        rows = rng.standard_normal((9, 3)).astype(dtype)
        opt.apply_sparse(var, slots, *sum_duplicates(ids, rows))
        ref.apply_sparse(ids, rows)
        if step % 2:
            g = rng.standard_normal((12, 3)).astype(dtype)
            opt.apply_dense(var, slots, g)
            ref.apply_dense(g)
        _close(var, ref.value, dtype)
        for k, a in ref.slots.items():
            _close(slots[k], a, dtype)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sparse_empty_ids_changes_no_rows(name):
    opt = make_optimizer(name)
    var = np.arange(12, dtype=np.float32).reshape(4, 3)
    slots = opt.create_slots(var)
    before = var.copy()
    opt.apply_sparse(var, slots, np.zeros(0, np.int64), np.zeros((0, 3), np.float32))
    np.testing.assert_array_equal(var, before)


def test_adam_iterations_count_dense_and_sparse_together():
    opt = make_optimizer("adam")
    var = np.zeros((5, 2), np.float64)
    slots = opt.create_slots(var)
    opt.apply_dense(var, slots, np.ones((5, 2)))
    opt.apply_sparse(var, slots, np.array([3], np.int64), np.ones((1, 2)))
    opt.apply_dense(var, slots, np.ones((5, 2)))
    assert int(slots["iterations"]) == 3


# --------------------------------------------------------------------------
# float16: supported, dtype kept, close to a float64 reference
# --------------------------------------------------------------------------
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_float16_close_to_float64(name, params):
    rng = np.random.default_rng(5)
    opt = make_optimizer(name, params)
    var64 = rng.standard_normal((8, 3))
    var16 = var64.astype(np.float16)
    var64 = var16.astype(np.float64)
    s16, s64 = opt.create_slots(var16), opt.create_slots(var64)
    for _ in range(STEPS):
        g16 = rng.standard_normal((8, 3)).astype(np.float16)
        opt.apply_dense(var16, s16, g16)
        opt.apply_dense(var64, s64, g16.astype(np.float64))
    assert var16.dtype == np.float16
    assert all(a.dtype == np.float16 for k, a in s16.items() if k != "iterations")
    np.testing.assert_allclose(var16, var64, rtol=1e-2, atol=1e-2)


def test_apply_does_not_raise_under_seterr_raise():
    # Overflow (g*g in float16) must not interrupt an update half-way.
    opt = make_optimizer("adagrad")
    var = np.ones(4, np.float16)
    slots = opt.create_slots(var)
    with np.errstate(all="raise"):
        opt.apply_dense(var, slots, np.full(4, 1000.0, np.float16))
        opt.apply_sparse(var, slots, np.array([1], np.int64), np.full(1, 1000.0, np.float16))
    assert np.isinf(slots["accumulator"]).all()


# --------------------------------------------------------------------------
# Slots
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_create_slots(name, dtype):
    opt = make_optimizer(name)
    value = np.ones((3, 2), dtype)
    slots = opt.create_slots(value)
    assert tuple(slots) == opt.slot_names
    for k, a in slots.items():
        assert not np.shares_memory(a, value)
        if k == "iterations":
            assert a.shape == () and a.dtype == np.int64 and int(a) == 0
        else:
            assert a.shape == value.shape and a.dtype == dtype
    if name == "adagrad":
        np.testing.assert_array_equal(slots["accumulator"], np.full((3, 2), 0.1, dtype))
    if name == "ftrl":
        np.testing.assert_array_equal(slots["accumulator"], np.full((3, 2), 0.1, dtype))
        np.testing.assert_array_equal(slots["linear"], np.zeros((3, 2), dtype))
    expected = {"sgd": (), "momentum": ("momentum",), "adagrad": ("accumulator",),
                "adam": ("m", "v", "iterations"), "ftrl": ("accumulator", "linear")}[name]
    assert opt.slot_names == expected


# --------------------------------------------------------------------------
# sum_duplicates
# --------------------------------------------------------------------------
def naive_sum_duplicates(ids, rows):
    acc = {}
    for i, r in zip(ids.tolist(), rows):
        acc[i] = acc[i] + r if i in acc else r.copy()
    keys = sorted(acc)
    out = np.stack([acc[k] for k in keys]) if keys else rows[:0]
    return np.array(keys, np.int64), out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n,vocab,row_shape", [
    (0, 10, (3,)), (1, 10, (3,)), (50, 5, (3,)), (50, 1000, (3,)), (200, 150, ()),
    (300, 40, (2, 2)), (64, 10**12, (4,)),
], ids=lambda v: str(v))
def test_sum_duplicates_matches_naive(n, vocab, row_shape, dtype):
    rng = np.random.default_rng(n + vocab)
    ids = rng.integers(0, vocab, n).astype(np.int64)
    rows = rng.standard_normal((n,) + row_shape).astype(dtype)
    uid, summed = sum_duplicates(ids, rows)
    nid, nsum = naive_sum_duplicates(ids, rows)
    assert uid.dtype == np.int64 and summed.dtype == dtype
    assert summed.shape == (len(nid),) + row_shape
    np.testing.assert_array_equal(uid, nid)
    # numpy's reductions may sum in another order (and float16 via float32).
    tol = {np.float16: 1e-2, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(summed, nsum, rtol=tol, atol=tol)
    # Deterministic: the same input gives bit-identical output.
    again = sum_duplicates(ids, rows)
    assert again[1].tobytes() == summed.tobytes()
    # An id seen up to 8 times: its rows added one after another, in order
    # (the naive loop's bits); more often: numpy's reduceat (within tolerance).
    uniq, counts = np.unique(ids, return_counts=True)
    few = np.isin(nid, uniq[counts <= 8])
    assert summed[few].tobytes() == nsum[few].tobytes()


def test_sum_duplicates_takes_sorted_distinct_ids_as_they_are():
    """What a client that summed its duplicates sends (coordinator.variables):
    nothing to sort or copy; anything else still is (summed into new arrays)."""
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    ids = np.array([1, 5, 6, 9])
    uid, summed = sum_duplicates(ids, rows)
    assert summed is rows and np.array_equal(uid, ids)
    for ids in ([1, 6, 5, 9], [1, 5, 5, 9]):   # out of order; a duplicate
        uid, summed = sum_duplicates(np.array(ids), rows)
        assert not np.shares_memory(summed, rows)


def test_sum_duplicates_all_same_id():
    ids = np.full(10, 7, np.int64)
    rows = np.ones((10, 2), np.float32)
    uid, summed = sum_duplicates(ids, rows)
    np.testing.assert_array_equal(uid, [7])
    np.testing.assert_array_equal(summed, [[10.0, 10.0]])


# --------------------------------------------------------------------------
# Hyper-parameters
# --------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(KERAS_DEFAULTS))
def test_config_returns_keras_defaults(name):
    assert make_optimizer(name).config() == KERAS_DEFAULTS[name]
    assert make_optimizer(name, None).config() == KERAS_DEFAULTS[name]
    assert OPTIMIZERS[name]().config() == KERAS_DEFAULTS[name]


def test_config_includes_overrides_and_is_a_copy():
    opt = make_optimizer("adam", {"beta_1": 0.8})
    cfg = opt.config()
    assert cfg == {**KERAS_DEFAULTS["adam"], "beta_1": 0.8}
    cfg["beta_1"] = 0.1
    assert opt.config()["beta_1"] == 0.8


def test_registry_and_names():
    assert set(OPTIMIZERS) == {"sgd", "momentum", "adagrad", "adam", "ftrl"}
    for name, cls in OPTIMIZERS.items():
        assert cls.name == name
        assert make_optimizer(name).name == name


BAD_PARAMS = [
    ("sgd", {"learning_rate": 0.0}),
    ("sgd", {"learning_rate": -0.1}),
    ("sgd", {"learning_rate": float("nan")}),
    ("sgd", {"learning_rate": float("inf")}),
    ("sgd", {"learning_rate": "fast"}),
    ("momentum", {"learning_rate": 0.0}),
    ("momentum", {"momentum": 1.0}),
    ("momentum", {"momentum": -0.1}),
    ("momentum", {"momentum": float("nan")}),
    ("momentum", {"nesterov": 0.5}),
    ("momentum", {"nesterov": 2.0}),
    ("adagrad", {"learning_rate": -1.0}),
    ("adagrad", {"initial_accumulator_value": -0.1}),
    ("adagrad", {"epsilon": -1e-7}),
    ("adagrad", {"initial_accumulator_value": 0.0, "epsilon": 0.0}),
    ("adam", {"learning_rate": 0.0}),
    ("adam", {"beta_1": 1.0}),
    ("adam", {"beta_1": -0.1}),
    ("adam", {"beta_2": 1.0}),
    ("adam", {"beta_2": 1.5}),
    ("adam", {"epsilon": -1e-7}),
    ("adam", {"epsilon": 0.0}),
    ("ftrl", {"learning_rate": 0.0}),
    ("ftrl", {"learning_rate": -0.1}),
    ("ftrl", {"learning_rate_power": 0.5}),
    ("ftrl", {"initial_accumulator_value": -0.1}),
    ("ftrl", {"l1_regularization_strength": -1e-3}),
    ("ftrl", {"l2_regularization_strength": -1e-3}),
    ("ftrl", {"l2_shrinkage_regularization_strength": -1e-3}),
    ("ftrl", {"beta": -0.1}),
    ("ftrl", {"learning_rate_power": float("nan")}),
    ("ftrl", {"l1_regularization_strength": float("inf")}),
    ("ftrl", {"beta": float("-inf")}),
]


@pytest.mark.parametrize("name,params", BAD_PARAMS,
                         ids=[f"{n}-{p}" for n, p in BAD_PARAMS])
def test_bad_hyper_parameter_raises(name, params):
    with pytest.raises(ValueError) as exc:
        make_optimizer(name, params)
    msg = str(exc.value)
    assert name in msg and any(k in msg for k in params), msg
    with pytest.raises(ValueError):
        OPTIMIZERS[name](**params)


@pytest.mark.parametrize("name,params", [
    ("momentum", {"momentum": 0.0, "nesterov": True}),
    ("adagrad", {"initial_accumulator_value": 0.0}),
    ("adagrad", {"epsilon": 0.0}),
    ("adam", {"beta_1": 0.0, "beta_2": 0.0}),
    ("sgd", {"learning_rate": 1}),
    ("ftrl", {"learning_rate_power": 0.0, "initial_accumulator_value": 0.0,
              "l1_regularization_strength": 0.0, "l2_regularization_strength": 0.0,
              "l2_shrinkage_regularization_strength": 0.0, "beta": 0.0}),
])
def test_edge_hyper_parameters_accepted(name, params):
    cfg = make_optimizer(name, params).config()
    assert all(isinstance(v, float) for v in cfg.values())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unknown_hyper_parameter_names_valid_keys(name):
    with pytest.raises(ValueError) as exc:
        make_optimizer(name, {"learning_rate": 0.1, "lr": 0.1})
    msg = str(exc.value)
    assert "'lr'" in msg
    for key in KERAS_DEFAULTS[name]:
        assert key in msg


@pytest.mark.parametrize("name", ["rmsprop", "", "sgdd"])
def test_unknown_optimizer_raises_listing_known(name):
    with pytest.raises(ValueError) as exc:
        make_optimizer(name)
    for known in OPTIMIZERS:
        assert known in str(exc.value)


def test_optimizer_name_is_case_insensitive():
    assert make_optimizer("Adam").name == "adam"


# --------------------------------------------------------------------------
# Blocked dense apply: same bits whatever the block size, small scratch only
# --------------------------------------------------------------------------
import tracemalloc  # noqa: E402

import psserver.contract.optimizers as optimizers_module  # noqa: E402


def _run_steps(name, params, var, grads, sparse=None):
    opt = make_optimizer(name, params)
    var = var.copy()
    slots = opt.create_slots(var)
    for i, g in enumerate(grads):
        opt.apply_dense(var, slots, g)
        if sparse is not None:
            ids, rows = sparse[i]
            opt.apply_sparse(var, slots, ids, rows)
    return var, slots


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_block_size_does_not_change_bits(name, params, dtype, monkeypatch):
    rng = np.random.default_rng(7)
    shape = (37, 29)  # 1073 elements: many blocks, a ragged last one
    var = rng.standard_normal(shape).astype(dtype)
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(STEPS)]
    sparse = []
    for _ in range(STEPS):
        ids = rng.choice(shape[0], size=11, replace=False).astype(np.int64)
        sparse.append((ids, rng.standard_normal((11, shape[1])).astype(dtype)))
    monkeypatch.setattr(optimizers_module, "BLOCK_BYTES", 1 << 30)  # one block
    whole_var, whole_slots = _run_steps(name, params, var, grads, sparse)
    for block_bytes in (1, 40, 1000):  # 1 element per block, and odd sizes
        monkeypatch.setattr(optimizers_module, "BLOCK_BYTES", block_bytes)
        v, s = _run_steps(name, params, var, grads, sparse)
        assert v.tobytes() == whole_var.tobytes()
        for k in whole_slots:
            assert s[k].tobytes() == whole_slots[k].tobytes()


@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_dense_grad_layouts_give_same_bits(name, params, monkeypatch):
    # Read-only (wire) views, Fortran order, strided, another dtype: all read
    # block by block, never written, same result as a plain C-ordered grad.
    monkeypatch.setattr(optimizers_module, "BLOCK_BYTES", 256)
    rng = np.random.default_rng(11)
    shape = (23, 17)
    var = rng.standard_normal(shape).astype(np.float32)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]
    want_var, want_slots = _run_steps(name, params, var, grads)
    layouts = [
        lambda g: np.frombuffer(g.tobytes(), np.float32).reshape(shape),
        np.asfortranarray,
        lambda g: np.repeat(g, 2, axis=1)[:, ::2],
        lambda g: g.astype(np.float64),
    ]
    for make in layouts:
        gs = [make(g) for g in grads]
        before = [g.copy() for g in gs]
        v, s = _run_steps(name, params, var, gs)
        for g, b in zip(gs, before):
            np.testing.assert_array_equal(g, b)
        assert v.tobytes() == want_var.tobytes()
        for k in want_slots:
            assert s[k].tobytes() == want_slots[k].tobytes()


def _peak_bytes(fn):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_dense_apply_allocates_one_block_not_the_variable(name):
    n = 1 << 20  # 4 MiB of float32
    opt = make_optimizer(name)
    var = np.ones(n, np.float32)
    slots = opt.create_slots(var)
    g = np.frombuffer(np.full(n, 0.5, np.float32).tobytes(), np.float32)
    opt.apply_dense(var, slots, g)
    block = optimizers_module.BLOCK_BYTES * opt._scratch_blocks   # FTRL: 3 blocks
    assert block <= 1 << 20
    assert _peak_bytes(lambda: opt.apply_dense(var, slots, g)) < block + 64 * 1024
    # A grad of another dtype/layout is cast through a block-sized buffer.
    g64 = np.full((n // 2, 2), 0.5)[:, ::-1].reshape(n // 2, 2)
    var2, slots2 = var.reshape(n // 2, 2), {k: (a.reshape(n // 2, 2) if a.ndim else a)
                                           for k, a in slots.items()}
    assert _peak_bytes(lambda: opt.apply_dense(var2, slots2, g64)) < 2 * block + 64 * 1024


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sparse_apply_temporaries_scale_with_rows_not_variable(name):
    opt = make_optimizer(name)
    var = np.ones((1 << 16, 16), np.float32)  # 4 MiB
    slots = opt.create_slots(var)
    ids = np.arange(0, 1 << 16, 64, dtype=np.int64)  # 1024 rows = 64 KiB
    rows = np.full((ids.size, 16), 0.5, np.float32)
    opt.apply_sparse(var, slots, ids, rows)
    n_copies = 1 + sum(1 for k in opt.slot_names if k != "iterations")  # gathered
    # + the scratch blocks, each <= rows
    limit = (n_copies + opt._scratch_blocks) * rows.nbytes + 64 * 1024
    assert _peak_bytes(lambda: opt.apply_sparse(var, slots, ids, rows)) < limit


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_dense_rejects_non_contiguous_value_before_writing(name):
    opt = make_optimizer(name)
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    var = base[:, ::2]
    slots = opt.create_slots(np.ascontiguousarray(var))
    before = base.copy(), {k: a.copy() for k, a in slots.items()}
    with pytest.raises(ValueError, match="C-contiguous"):
        opt.apply_dense(var, slots, np.ones(var.shape))
    np.testing.assert_array_equal(base, before[0])
    for k, a in slots.items():
        np.testing.assert_array_equal(a, before[1][k])


def test_dense_rejects_wrong_grad_shape_before_writing():
    opt = make_optimizer("adam")
    var = np.ones((3, 4), np.float32)
    slots = opt.create_slots(var)
    with pytest.raises(ValueError, match="shape"):
        opt.apply_dense(var, slots, np.ones((4,), np.float32))  # would broadcast
    np.testing.assert_array_equal(var, np.ones((3, 4), np.float32))
    assert int(slots["iterations"]) == 0 and not slots["m"].any()


def test_blocked_apply_does_not_raise_under_seterr_raise(monkeypatch):
    monkeypatch.setattr(optimizers_module, "BLOCK_BYTES", 4)
    opt = make_optimizer("adam", {"learning_rate": 1e6})  # alpha overflows float16
    var = np.ones(9, np.float16)
    slots = opt.create_slots(var)
    with np.errstate(all="raise"):
        opt.apply_dense(var, slots, np.full(9, 1000.0, np.float16))
        opt.apply_dense(var, slots, np.full(9, 1000.0))  # float64 grad, cast per block
    assert int(slots["iterations"]) == 2


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_all_finite_finds_every_nan_and_inf_and_only_them(dtype):
    from psserver.contract.tensor import all_finite
    a = np.ones((50, 20), dtype)
    assert all_finite(a) and all_finite(a[:, ::3]) and all_finite(a[:0])
    huge = np.full(1000, np.finfo(dtype).max / 2, dtype)   # finite, but its squares overflow
    assert all_finite(huge)
    for bad in (np.nan, np.inf, -np.inf):
        for where in ((0, 0), (49, 19), (25, 7)):
            b = a.copy()
            b[where] = bad
            assert not all_finite(b) and not all_finite(b[:, ::1]) and not all_finite(b.T)


def _tensorflow():
    """TensorFlow, or a skip (a failure with PSTRAIN_REQUIRE_TF=1)."""
    import os
    try:
        import tensorflow as tf
    except ImportError:
        if os.environ.get("PSTRAIN_REQUIRE_TF") == "1":
            pytest.fail("PSTRAIN_REQUIRE_TF=1 but tensorflow is not installed")
        pytest.skip("tensorflow is not installed (pip install tensorflow-cpu to compare)")
    return tf


FTRL_TF = {"learning_rate": 0.1, "learning_rate_power": -0.6, "initial_accumulator_value": 0.2,
           "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.03,
           "l2_shrinkage_regularization_strength": 0.02, "beta": 0.5}


def _float32_close(ours, theirs):
    """Equal within float32 rounding: rtol 1e-6 (8 ulps of float32, whose eps is
    1.2e-7) plus an absolute 4 ulps of the array's largest magnitude.

    TensorFlow's pow (Eigen) and numpy's may round the same float32 inputs an
    ulp apart, and the difference is carried through six steps; and
    var = (clip(linear, l1) - linear) / quadratic cancels where |linear| is
    just above l1, so an ulp of ``linear`` becomes a large *relative* error of
    a small value: hence the absolute term at the array's scale (measured over
    40 seeds: at most 2.5 ulps of the largest value, and 8.3e-7 relative for
    values above a tenth of it). A wrong formula misses by far more."""
    theirs = np.asarray(theirs)
    atol = 4 * np.finfo(np.float32).eps * float(np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=atol)


def _keras_slots(keras_opt, shape):
    """Keras 3 Ftrl's slots of its one variable, by name ("accumulator", "linear")."""
    return {v.path.rsplit("_", 1)[-1]: v.numpy() for v in keras_opt.variables
            if tuple(v.shape) == shape}


@pytest.mark.timeout(120)
def test_ftrl_dense_equals_keras():
    """tf.keras.optimizers.Ftrl (Keras 3) on a tf.Variable, six dense steps,
    every hyper-parameter off its default: value and both slots."""
    tf = _tensorflow()
    rng = np.random.default_rng(7)
    value = rng.standard_normal((6, 5)).astype(np.float32)
    ours = make_optimizer("ftrl", FTRL_TF)
    var, slots = value.copy(), ours.create_slots(value)
    tf_var = tf.Variable(value)
    keras_opt = tf.keras.optimizers.Ftrl(**FTRL_TF)
    for _ in range(6):
        g = rng.standard_normal((6, 5)).astype(np.float32)
        ours.apply_dense(var, slots, g)
        keras_opt.apply_gradients([(tf.constant(g), tf_var)])
    _float32_close(var, tf_var.numpy())
    keras_slots = _keras_slots(keras_opt, value.shape)
    assert set(keras_slots) == set(slots)
    for k in slots:
        _float32_close(slots[k], keras_slots[k])


@pytest.mark.timeout(120)
def test_ftrl_sparse_equals_keras_and_tensorflows_lazy_kernel():
    """Sparse steps with duplicate ids, summed first (sum_duplicates, as the
    store does), six steps, within float32 rounding (``_float32_close``).

    Keras 3 Ftrl given tf.IndexedSlices densifies them (every row steps; see
    the module docstring of psserver.contract.optimizers): it equals the lazy update
    on a zero-initialised variable without l2 shrinkage, which is checked
    here, the duplicates summed before the IndexedSlices are made (Keras 3
    would square each row first). The general case (a random initial value,
    shrinkage) against TensorFlow's own lazy kernel,
    raw_ops.ResourceSparseApplyFtrlV2, given l2 + beta / (2 lr) as Keras
    passes it."""
    tf = _tensorflow()
    rng = np.random.default_rng(8)
    shape = (8, 5)

    cfg = {**FTRL_TF, "l2_shrinkage_regularization_strength": 0.0}
    ours = make_optimizer("ftrl", cfg)
    zeros = np.zeros(shape, np.float32)
    var, slots = zeros.copy(), ours.create_slots(zeros)
    tf_var = tf.Variable(zeros)
    keras_opt = tf.keras.optimizers.Ftrl(**cfg)
    for _ in range(6):
        ids = rng.integers(0, shape[0], 5)
        uniq, summed = sum_duplicates(ids, rng.standard_normal((5, 5)).astype(np.float32))
        ours.apply_sparse(var, slots, uniq, summed)
        keras_opt.apply_gradients([(tf.IndexedSlices(
            tf.constant(summed), tf.constant(uniq), tf.constant(shape, tf.int64)), tf_var)])
    _float32_close(var, tf_var.numpy())
    keras_slots = _keras_slots(keras_opt, shape)
    for k in slots:
        _float32_close(slots[k], keras_slots[k])

    cfg = FTRL_TF
    ours = make_optimizer("ftrl", cfg)
    value = rng.standard_normal(shape).astype(np.float32)
    var, slots = value.copy(), ours.create_slots(value)
    tf_var = tf.Variable(value)
    accum = tf.Variable(np.full_like(value, cfg["initial_accumulator_value"]))
    linear = tf.Variable(np.zeros_like(value))
    l2 = cfg["l2_regularization_strength"] + cfg["beta"] / (2.0 * cfg["learning_rate"])
    for _ in range(6):
        ids = rng.integers(0, shape[0], 5)
        uniq, summed = sum_duplicates(ids, rng.standard_normal((5, 5)).astype(np.float32))
        ours.apply_sparse(var, slots, uniq, summed)
        tf.raw_ops.ResourceSparseApplyFtrlV2(
            var=tf_var.handle, accum=accum.handle, linear=linear.handle,
            grad=tf.constant(summed), indices=tf.constant(uniq),
            lr=np.float32(cfg["learning_rate"]), l1=np.float32(cfg["l1_regularization_strength"]),
            l2=np.float32(l2), l2_shrinkage=np.float32(cfg["l2_shrinkage_regularization_strength"]),
            lr_power=np.float32(cfg["learning_rate_power"]))
    _float32_close(var, tf_var.numpy())
    _float32_close(slots["accumulator"], accum.numpy())
    _float32_close(slots["linear"], linear.numpy())


# -- take_rows / put_rows: whole-row copies, as fancy indexing gives ------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st

from psserver.contract.rows import put_rows, take_rows  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(), (0,), (1,), (3,), (2, 5), (64,)]),
       st.sampled_from([np.float32, np.float64, np.float16, np.int64, np.int8]),
       st.data())
def test_take_rows_and_put_rows_are_fancy_indexing(n, row_shape, dtype, data):
    rng = np.random.default_rng(n)
    a = (rng.standard_normal((n,) + row_shape) * 10).astype(dtype)
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=12, unique=True)),
                   np.int64)
    shaped = ids.reshape(data.draw(st.sampled_from([(-1,), (1, -1)])))
    np.testing.assert_array_equal(take_rows(a, shaped), a[shaped])
    assert take_rows(a, shaped).shape == shaped.shape + row_shape
    rows = (rng.standard_normal((ids.size,) + row_shape) * 10).astype(dtype)
    kind = data.draw(st.sampled_from(["same", "strided", "other dtype"]))
    if kind == "strided":   # not contiguous: the element-wise path
        rows = np.stack([rows, rows], axis=-1)[..., 0]
    elif kind == "other dtype":
        rows = rows.astype(np.float32 if dtype != np.float32 else np.float64)
    want = a.copy()
    want[ids] = rows
    put_rows(a, ids, rows)
    np.testing.assert_array_equal(a, want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=60))
def test_sum_duplicates_with_the_callers_sort_order_is_the_same(ids):
    ids = np.array(ids, np.int64)
    rows = np.random.default_rng(len(ids)).standard_normal((ids.size, 3)).astype(np.float32)
    a = sum_duplicates(ids, rows)
    b = sum_duplicates(ids, rows, np.argsort(ids, kind="stable"))
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
