"""coordinator.checkpoint_io.table_capacities: each shard's part of a dynamic
table's capacity after a restore (pure logic; the restores themselves run
against real servers in tests/integration/test_table_capacity.py)."""
from __future__ import annotations

import types

import numpy as np
import pytest

from coordinator.checkpoint_io import table_capacities
from coordinator.embedding import DynamicEmbedding, TableShard
from psserver.errors import Unavailable

ADDRS = ("a:1", "b:1", "c:1")


def table(capacity: int, n: int = 3) -> DynamicEmbedding:
    return DynamicEmbedding("t", 4, "float32", ADDRS[:n], capacity=capacity)


def clients(caps: dict[str, int], down: tuple[str, ...] = ()):
    """client_for over servers whose shards of t have capacities ``caps``."""
    def client_for(address):
        def table_info(name):
            if address in down:
                raise Unavailable(f"{address} is down")
            return types.SimpleNamespace(spec=types.SimpleNamespace(capacity=caps[address]))
        return types.SimpleNamespace(table_info=table_info)
    return client_for


def test_a_whole_restore_makes_room_for_every_restored_row_and_sums_to_the_capacity():
    t = table(30, 2)
    copies = t.shards
    assert table_capacities(t, np.array([18, 12]), copies, clients({}), None) == [18, 12]
    assert table_capacities(t, np.array([10, 6]), copies, clients({}), None) == [17, 13]
    parts = table_capacities(t, np.array([25, 20]), copies, clients({}), None)
    assert parts == [15, 15]   # more rows than capacity: the shares, the policy evicts
    assert table_capacities(t, np.array([30, 10]), copies, clients({}), None) == [20, 10]


def test_a_table_without_capacity_keeps_its_shards_as_they_are():
    t = table(0)
    assert table_capacities(t, np.array([5, 5, 5]), t.shards, clients({}), None) == [None] * 3


def test_one_servers_refill_gets_what_the_other_shards_leave():
    t = table(30)
    caps = {"a:1": 12, "b:1": 9, "c:1": 10}
    assert table_capacities(t, np.array([3, 3, 3]), t.shards, clients(caps), "b:1") == \
        [None, 8, None]
    # a failover left two primaries on one server: they share what is left by buckets
    copies = [t.shards[0], TableShard("a:1", t.shards[1].name), t.shards[2]]
    got = table_capacities(t, np.array([3, 3, 3]), copies, clients(caps), "a:1")
    assert got[2] is None and got[0] + got[1] == 20
    # the others cannot say: unchanged
    assert table_capacities(t, np.array([3, 3, 3]), t.shards,
                            clients(caps, down=("c:1",)), "b:1") == [None] * 3
    # nothing left: one row each, never 0 (no limit)
    assert table_capacities(t, np.array([3, 3, 3]), t.shards,
                            clients({"a:1": 20, "b:1": 9, "c:1": 15}), "b:1") == [None, 1, None]


@pytest.mark.parametrize("rows", [[0, 0, 0], [28, 0, 0], [1, 2, 3]])
def test_parts_always_sum_to_the_capacity_when_the_rows_fit(rows):
    t = table(30)
    parts = table_capacities(t, np.array(rows), t.shards, clients({}), None)
    assert sum(parts) == 30 and all(p >= max(r, 1) for p, r in zip(parts, rows))


def test_a_part_is_never_0_which_would_mean_no_limit():
    """A full table restored into one of three servers: the others get a
    row each (0 would be no limit), the first evicts two."""
    t = table(30)
    assert table_capacities(t, np.array([30, 0, 0]), t.shards, clients({}), None) == [28, 1, 1]
