"""The pure parts of moving variable shards: where a drain and an add send
them (coordinator/variable_moves.py) and the table of moved shards every
process keeps (coordinator/placement.py)."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import placement
from coordinator.variable_moves import plan_drain, plan_spread, shard_bytes
from coordinator.variables import Shard, ShardedVariable


@pytest.fixture(autouse=True)
def _fresh_table():
    placement.forget()
    yield
    placement.forget()


def _var(name: str, rows_at: list[tuple[str, int]]) -> ShardedVariable:
    shards, offset = [], 0
    for i, (addr, rows) in enumerate(rows_at):
        shards.append(Shard(addr, f"{name}/part_{i}" if len(rows_at) > 1 else name, offset, rows))
        offset += rows
    return ShardedVariable(name, (offset, 2), "float32", tuple(shards))


def _loads(variables, servers, moves=()) -> dict[str, int]:
    moved = {(s.made_at, s.name): dest for _, s, dest in moves}
    load = dict.fromkeys(servers, 0)
    for v in variables:
        for s in v.shards:
            load[moved.get((s.made_at, s.name), s.address)] += shard_bytes(v, s)
    return load


def test_a_drain_sends_each_shard_to_the_least_loaded_other_server():
    vs = [_var("a", [("A", 100)]), _var("b", [("B", 100)]), _var("c", [("A", 50)]),
          _var("d", [("C", 10)]), _var("e", [("A", 10), ("B", 10), ("C", 10)])]
    plan = plan_drain(vs, ("A", "B", "C"), "A")
    assert sorted(s.name for _, s, _ in plan) == ["a", "c", "e/part_0"]
    assert all(dest in ("B", "C") for *_, dest in plan)
    # (loads in rows: B 110, C 20; largest first, each to the least loaded then)
    assert [(s.name, dest) for _, s, dest in plan] == [("a", "C"), ("c", "B"), ("e/part_0", "C")]
    assert plan_drain(vs, ("A",), "A") == []   # (no other server: nothing to plan)


def test_an_add_takes_about_an_even_share_and_never_more_at_random():
    rng = np.random.default_rng(7)
    for trial in range(300):
        servers = [f"s{i}" for i in range(int(rng.integers(1, 6)))]
        vs = [_var(f"v{j}", [(str(rng.choice(servers)), int(rng.integers(1, 200)))
                             for _ in range(int(rng.integers(1, 4)))])
              for j in range(int(rng.integers(0, 25)))]
        new = "new"
        everyone = tuple(servers) + (new,)
        plan = plan_spread(vs, everyone, new)
        before, after = _loads(vs, everyone), _loads(vs, everyone, plan)
        share = sum(before.values()) / len(everyone)
        assert after[new] <= share + 1e-9, trial
        assert max(after.values()) - min(after.values()) <= \
            max(before.values()) - min(before.values()), trial
        assert len({(s.made_at, s.name) for _, s, _ in plan}) == len(plan)   # (each once)
        assert all(s.address != new for _, s, _ in plan)


def test_an_add_moves_nothing_where_no_shard_fits():
    vs = [_var("big", [("A", 1000)]), _var("other", [("B", 1000)])]
    assert plan_spread(vs, ("A", "B", "C"), "C") == []   # (a shard is never split)
    assert plan_spread(vs, ("A", "B"), "C") == []        # (not one of the servers)


def test_the_table_of_moved_shards_is_followed_taken_whole_and_checked():
    s = Shard("a:1", "v/part_0", 0, 4)
    assert s.address == "a:1"
    placement.record("a:1", "v/part_0", "b:2")
    assert s.address == "b:2" and s.made_at == "a:1"
    assert placement.known() == [("a:1", "v/part_0", "b:2")]
    placement.take(placement.parse([("a:1", "w", "c:3")]))   # (a closure's: replaces)
    assert s.address == "a:1" and Shard("a:1", "w", 0, 1).address == "c:3"
    placement.settled("a:1", "w")   # (made again there: no longer moved)
    assert placement.known() == [] and Shard("a:1", "w", 0, 1).address == "a:1"
    for bad in [("a:1", "v"), ("", "v", "b:2"), ("a:1", "v", ""), ("a:1", "v\n", "b:2"),
                ("a:1", "v", "x" * 1025), ("a:1", 7, "b:2"), ("a", "b", "c", "d")]:
        with pytest.raises(ValueError, match="made on, name, address now"):
            placement.parse([bad])


def test_with_replication_no_copy_goes_where_its_other_copy_is():
    rng = np.random.default_rng(3)
    for trial in range(200):
        servers = [f"s{i}" for i in range(int(rng.integers(3, 6)))]
        vs = []
        for j in range(int(rng.integers(1, 12))):
            p, b = rng.choice(len(servers), 2, replace=False)
            rows = int(rng.integers(1, 100))
            vs.append(ShardedVariable(f"v{j}", (rows, 2), "float32",
                                      (Shard(servers[p], f"v{j}", 0, rows),), "sgd",
                                      (Shard(servers[b], f"_backup/v{j}", 0, rows),)))
        leaving = servers[int(rng.integers(len(servers)))]
        plan = plan_drain(vs, servers, leaving)
        on = {(v.name, s.name) for v in vs for s in v.shards + v.backups if s.address == leaving}
        assert {(v.name, s.name) for v, s, _ in plan} == on, trial
        for v, s, dest in plan:
            other = v.backups[0] if s == v.shards[0] else v.shards[0]
            assert dest not in (leaving, other.address), trial
    two = [ShardedVariable("v", (4, 2), "float32", (Shard("a", "v", 0, 4),), "sgd",
                           (Shard("b", "_backup/v", 0, 4),))]
    with pytest.raises(ValueError, match="no server is left"):
        plan_drain(two, ("a", "b"), "a")
    three = [ShardedVariable(f"v{i}", (4, 2), "float32", (Shard("a", f"v{i}", 0, 4),), "sgd",
                             (Shard("b", f"_backup/v{i}", 0, 4),)) for i in range(3)]
    movable = {v.backups[0] for v in three}   # (an add: backup copies move, primaries stay)
    plan = plan_spread(three, ("a", "b", "c"), "c", movable)
    assert [(s.name, d) for _, s, d in plan] == [("_backup/v2", "c")]
