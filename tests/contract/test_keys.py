"""How dynamic-table keys map to shards (psserver/contract/keys.py): a bucket
of the key's hash, each bucket a shard's by the table's BucketMap; and a
capacity cut by the shards' shares."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from psserver.contract.keys import (
    BUCKETS,
    BucketMap,
    bucket_of,
    fill_capacity,
    legacy_shard_of,
    mix64,
    split_capacity,
)
from psserver.errors import InvalidArgument

KEYS = np.random.default_rng(0).integers(-2**63, 2**63 - 1, 200_000, dtype=np.int64)


def test_a_key_has_one_bucket_whatever_the_table_and_small_keys_spread():
    b = bucket_of(KEYS)
    assert b.min() >= 0 and b.max() < BUCKETS
    assert (bucket_of(KEYS.copy()) == b).all()
    small = np.bincount(bucket_of(np.arange(BUCKETS * 64)), minlength=BUCKETS)
    assert small.min() > 20 and small.max() < 120   # 64 expected per bucket, by hash


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 100])
def test_even_maps_give_contiguous_runs_as_even_as_the_buckets_allow(n):
    m = BucketMap.even(n)
    runs = m.ranges()
    assert [r[2] for r in runs] == list(range(n))
    assert runs[0][0] == 0 and runs[-1][1] == BUCKETS
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    assert m.counts().max() - m.counts().min() <= 1
    rows = np.bincount(m.shard_of(KEYS), minlength=n)
    assert rows.sum() == KEYS.size and (np.abs(rows / KEYS.size - 1 / n) < 0.01).all()


def test_a_map_reads_back_from_its_runs_and_pickles_small():
    owner = np.arange(BUCKETS) % 3   # not contiguous: 4096 runs
    m = BucketMap(owner, 3)
    assert BucketMap.from_ranges(m.ranges(), 3) == m and m != BucketMap.even(3)
    for x in (m, BucketMap.even(5)):
        back = pickle.loads(pickle.dumps(x))
        assert back == x and hash(back) == hash(x)
        assert (back.shard_of(KEYS) == x.shard_of(KEYS)).all()
    assert len(pickle.dumps(BucketMap.even(5))) < 200   # a step closure carries it


@pytest.mark.parametrize("ranges", [
    [], [[0, 4096, 0]] * 2, [[0, 100, 0], [101, 4096, 1]], [[0, 100, 0], [90, 4096, 1]],
    [[0, 4096, 2]], [[0, 4097, 0]], [[0, 100, 0], [100, 4096, 0]],   # shard 1 has no bucket
    [[0, 4096, -1]], [[0.0, 4096, 0]], [[True, 4096, 0]], [[0, 4096]], "0-4096", None,
    [[0, 4096, 0, 1]], [[10, 4096, 0]],
])
def test_a_map_that_does_not_cover_every_bucket_once_is_refused(ranges):
    with pytest.raises(InvalidArgument, match="bucket map"):
        BucketMap.from_ranges(ranges, 2)


def test_maps_are_immutable_and_checked_when_made():
    m = BucketMap.even(4)
    with pytest.raises(ValueError):
        m.owner[0] = 3
    for bad, n in ((np.zeros(BUCKETS - 1, int), 1), (np.full(BUCKETS, 2), 2),
                   (np.zeros(BUCKETS, int), 2)):
        with pytest.raises(InvalidArgument):
            BucketMap(bad, n)
    for n in (0, BUCKETS + 1, 2.0):
        with pytest.raises(InvalidArgument):
            BucketMap.even(n)


def test_checkpoints_before_buckets_are_read_by_hash_mod_shards():
    golden = np.uint64(0x9E3779B97F4A7C15)
    expect = (mix64(KEYS.view(np.uint64) ^ golden) % np.uint64(3)).astype(np.int64)
    assert (legacy_shard_of(KEYS, 3) == expect).all()
    assert (legacy_shard_of(KEYS, 3) != BucketMap.even(3).shard_of(KEYS)).any()


@given(st.integers(0, 1 << 40), st.lists(st.integers(1, BUCKETS), min_size=1, max_size=64))
def test_a_capacity_is_cut_by_shares_into_parts_that_sum_to_it(capacity, weights):
    parts = split_capacity(capacity, weights)
    assert len(parts) == len(weights) and all(isinstance(p, int) for p in parts)
    if capacity == 0:
        assert parts == [0] * len(weights)
        return
    assert sum(parts) == capacity
    exact = capacity * np.asarray(weights) / sum(weights)
    assert (np.abs(np.asarray(parts) - exact) < 1 + 1e-9 * capacity).all()


def test_capacity_parts_of_an_even_map():
    assert split_capacity(30, BucketMap.even(3).counts()) == [10, 10, 10]
    assert split_capacity(3, BucketMap.even(2).counts()) == [2, 1]
    assert sum(split_capacity(10**9 + 7, BucketMap.even(7).counts())) == 10**9 + 7


@given(st.integers(0, 10_000), st.lists(st.tuples(st.integers(1, BUCKETS), st.integers(0, 5000)),
                                        min_size=1, max_size=12))
def test_a_restores_parts_keep_every_row_that_fits_and_sum_to_the_capacity(capacity, shards):
    shares, rows = [s for s, _ in shards], np.array([r for _, r in shards])
    parts = np.array(fill_capacity(capacity, shares, rows))
    if capacity == 0:
        assert not parts.any()
        return
    if capacity < len(shards):   # (a table is made with at least a row per server)
        return
    assert parts.sum() == capacity and parts.min() >= 1
    if rows.sum() <= capacity:
        assert (parts >= rows).all() or (rows.sum() == capacity and (parts == 1).any())
    else:   # as many restored rows kept as the capacity allows
        assert np.minimum(parts, rows).sum() >= capacity - (rows == 0).sum()


def test_restores_parts_by_example():
    assert fill_capacity(30, [1, 1], [18, 12]) == [18, 12]    # full: nothing evicted
    assert fill_capacity(30, [1, 1], [10, 6]) == [17, 13]     # room shared by buckets
    assert fill_capacity(30, [1, 1], [30, 10]) == [20, 10]    # too many: water-filled
    assert fill_capacity(30, [1, 1], [40, 0]) == [29, 1]      # never a part of 0 (no limit)
    assert fill_capacity(0, [1, 1], [5, 5]) == [0, 0]
