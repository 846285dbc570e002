"""key_order's sorting shortcuts give exactly what numpy's general functions give."""
import numpy as np
import pytest

from coordinator.key_order import _unique, by_shard_of


@pytest.mark.parametrize("size,spread", [(0, 1), (1, 1), (7, 3), (13_312, 4_000),
                                         (5_000, 1 << 62)])
def test_unique_is_numpys(size, spread):
    keys = np.random.default_rng(size).integers(-spread, spread, size, dtype=np.int64)
    want = np.unique(keys, return_inverse=True, return_counts=True)
    got = _unique(keys)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)


@pytest.mark.parametrize("n", [1, 2, 5, 1 << 15, (1 << 15) + 3])
def test_by_shard_of_is_a_stable_sort_by_shard(n):
    which = np.random.default_rng(n).integers(0, n, 20_000).astype(np.int64)
    order, runs = by_shard_of(which, n)
    assert np.array_equal(order, np.argsort(which, kind="stable"))
    for shard, lo, hi in runs:
        assert (which[order[lo:hi]] == shard).all()
    assert sum(hi - lo for _, lo, hi in runs) == which.size
