"""coordinator/elastic.py's plans, pure: which buckets move where when a
server is added or removed."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.elastic import plan_add, plan_remove
from psserver.contract.keys import BUCKETS, BucketMap


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_an_added_shard_takes_an_even_share_and_nothing_else_moves(n):
    old = BucketMap.even(n)
    new = plan_add(old)
    counts = new.counts()
    assert new.num_shards == n + 1 and counts[n] == BUCKETS // (n + 1)
    assert counts.max() - counts.min() <= 1
    stay = new.owner != n
    np.testing.assert_array_equal(new.owner[stay], old.owner[stay])   # (the rest stay put)


@pytest.mark.parametrize("n, j", [(2, 0), (2, 1), (3, 2), (4, 1), (7, 3)])
def test_a_removed_shards_buckets_spread_evenly_and_the_rest_stay(n, j):
    old = plan_add(BucketMap.even(n - 1)) if n > 1 else BucketMap.even(n)
    new = plan_remove(old, j)
    counts = new.counts()
    assert new.num_shards == n - 1 and counts.max() - counts.min() <= 1
    kept = old.owner != j
    renumbered = np.where(old.owner > j, old.owner - 1, old.owner)
    np.testing.assert_array_equal(new.owner[kept], renumbered[kept])
    assert len(new.ranges()) <= 3 * n   # (runs, not scattered buckets: a small map)


def test_an_add_and_a_remove_of_the_same_server_give_the_first_map_back_in_counts():
    first = BucketMap.even(2)
    again = plan_remove(plan_add(first), 2)
    np.testing.assert_array_equal(np.sort(again.counts()), np.sort(first.counts()))


def test_the_last_shard_cannot_be_removed():
    with pytest.raises(ValueError, match="last server"):
        plan_remove(BucketMap.even(1), 0)
