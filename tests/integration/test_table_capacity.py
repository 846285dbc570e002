"""A dynamic table's capacity is the whole table's (issue 32 item 5): each
server holds its share of the key buckets and that share of the capacity,
the shares summing to it exactly; a restore into another number of servers
keeps every row that fits and the table never holds more than its capacity.
Checkpoints record each table's bucket map (format 3)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from coordinator import CheckpointManager, LocalCluster, ParameterServerStrategy
from coordinator.serving import Snapshot, SnapshotError
from psserver.contract.keys import BucketMap
from psserver.errors import AlreadyExists

pytestmark = pytest.mark.timeout(120)


def keys_split(want: dict[tuple[int, int], int]) -> np.ndarray:
    """Keys, want[(i, j)] of them on shard i of 3 servers and shard j of 2."""
    k = np.arange(1, 100_000, dtype=np.int64)
    on3, on2 = BucketMap.even(3).shard_of(k), BucketMap.even(2).shard_of(k)
    return np.concatenate([k[(on3 == i) & (on2 == j)][:n] for (i, j), n in want.items()])


def table(strategy, capacity: int):
    return strategy.create_embedding_table("emb", 4, capacity=capacity, optimizer="adagrad",
                                           initializer="random_normal", seed=1)


def test_a_full_table_restored_into_fewer_servers_keeps_every_row_and_its_capacity(tmp_path):
    """30 rows, capacity 30, 3 servers (10 each) restored into 2 whose hash
    gives 18 and 12 of them: all 30 come back with their values (before: each
    server held ceil(30 / 2) = 15 and 3 rows were evicted silently), new keys
    evict so that the table stays at 30, and a coordinator that comes back
    adopts the table with the capacity it has and refuses another."""
    keys = keys_split({(0, 0): 10, (1, 0): 8, (1, 1): 2, (2, 1): 10})
    with LocalCluster(num_ps=3, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        t = table(strategy, 30)
        t.lookup(keys)
        t.push_gradient(keys, np.ones((keys.size, 4), np.float32))
        assert len(t) == 30
        want = t.lookup(keys, admit=False)
        saved = CheckpointManager(strategy, str(tmp_path / "ckpt")).save(1)
    manifest = json.load(open(os.path.join(saved, "manifest.json")))
    assert manifest["format_version"] == 3
    assert manifest["tables"]["emb"]["buckets"] == BucketMap.even(3).ranges()
    np.testing.assert_array_equal(Snapshot(str(tmp_path / "ckpt")).lookup("emb", keys), want)

    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        t = table(strategy, 30)
        CheckpointManager(strategy, str(tmp_path / "ckpt")).restore(saved)
        assert len(t) == 30
        np.testing.assert_array_equal(t.lookup(keys, admit=False), want)
        t.lookup(np.arange(10**6, 10**6 + 50, dtype=np.int64))   # new keys: evictions
        assert len(t) == 30
        again = ParameterServerStrategy(cluster.spec)   # a coordinator that comes back
        assert len(table(again, 30)) == 30
        with pytest.raises(AlreadyExists, match="capacity 30 over its servers, not 40"):
            table(ParameterServerStrategy(cluster.spec), 40)


@pytest.mark.parametrize("num_ps,capacity", [(2, 3), (3, 7)])
def test_the_whole_table_never_holds_more_than_its_capacity(num_ps, capacity):
    """Before, each server held ceil(capacity / servers): 4 rows for 3 on 2
    servers, 9 for 7 on 3."""
    with LocalCluster(num_ps=num_ps, num_workers=0) as cluster:
        t = table(ParameterServerStrategy(cluster.spec), capacity)
        for lo in range(0, 200, 20):
            t.lookup(np.arange(lo, lo + 20, dtype=np.int64))
            assert len(t) <= capacity
        assert len(t) == capacity
        with pytest.raises(ValueError, match=f"at least {num_ps}"):   # a part of 0: no limit
            table(ParameterServerStrategy(cluster.spec), num_ps - 1)


def test_a_checkpoints_bucket_map_is_checked_by_its_readers(tmp_path):
    """A manifest whose map does not fit its shards is named as damaged, not
    read with keys sent to the wrong shard."""
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        table(strategy, 0).lookup(np.arange(100, dtype=np.int64))
        saved = CheckpointManager(strategy, str(tmp_path / "ckpt")).save(1)
    path = os.path.join(saved, "manifest.json")
    manifest = json.load(open(path))
    manifest["tables"]["emb"]["buckets"] = [[0, 4096, 0]]   # 2 shards, one given no bucket
    os.chmod(path, 0o644)
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(SnapshotError, match="bucket map"):
        Snapshot(str(tmp_path / "ckpt"))
