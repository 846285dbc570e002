"""An add's rows copied ahead while training goes on (coordinator/elastic.py
copy_ahead), on real processes: a checkpoint saved between the copy and
the move holds every row once and restores into any number of servers;
where the steps do not end in time for the move, the copies go (the new
server keeps no shard, the job is as it was) and the add can be made
again."""
from __future__ import annotations

import time

import numpy as np
import pytest

from coordinator import CheckpointManager, ClusterCoordinator, LocalCluster, elastic, ps_pool
from tests.integration.test_elastic import (
    EXAMPLES,
    _each_example_once,
    _job,
    _rows,
    _schedule_epoch,
)

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("resize", ["add", "drain"])
def test_a_checkpoint_saved_between_the_copy_ahead_and_the_move_has_every_row_once(
        monkeypatch, tmp_path, resize):
    with LocalCluster(num_ps=2 if resize == "add" else 3, num_workers=2) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        ckpt = CheckpointManager(strategy, str(tmp_path))
        saved = []
        real = elastic.copy_ahead

        def copy_then_save(*a, **kw):   # (a save in the window the copies are staged)
            out = real(*a, **kw)
            assert out and all(x.rows > 0 for x in out.values())
            saved.append(ckpt.save(1))
            return out
        monkeypatch.setattr(elastic, "copy_ahead", copy_then_save)
        with ClusterCoordinator(strategy) as coord:
            ds, steps, done = _schedule_epoch(coord, counter, emb, w)
            done[steps // 4].fetch()
            if resize == "add":
                coord.add_parameter_server(cluster.add_ps())
            else:   # (the copies are staged on servers of the job: saved by none)
                coord.remove_parameter_server(strategy.parameter_servers[-1])
            _each_example_once(coord, ds, done, counter, w, steps)
    counts, rows = {}, {}
    for servers in (2, 3):   # (the saved rows, each once, into either number of servers)
        with LocalCluster(num_ps=servers, num_workers=1) as cluster:
            strategy, counter, emb, w = _job(cluster.spec)
            with ClusterCoordinator(strategy):
                CheckpointManager(strategy, str(tmp_path)).restore(saved[0])
                counts[servers] = counter.lookup(np.arange(EXAMPLES), admit=False)[:, 0]
                rows[servers] = [sum(_rows(t.addresses, t.name)) for t in (counter, emb)]
    assert set(np.unique(counts[2])) == {0.0, 1.0}   # (some counted by then, each once)
    np.testing.assert_array_equal(counts[2], counts[3])
    assert rows[2] == rows[3] and rows[2][0] >= counts[2].sum()


def _slow_step(seconds: float) -> int:
    time.sleep(seconds)   # (the workload: a step that takes long)
    return 1


def test_steps_that_do_not_end_in_time_for_the_move_leave_no_copy_behind():
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        keys = np.arange(5000, dtype=np.int64)
        with ClusterCoordinator(strategy) as coord:
            emb.lookup(keys)
            emb.push_gradient(keys, np.ones((keys.size, 4), np.float32))
            want, rows = emb.lookup(keys, admit=False), _rows(emb.addresses, "emb")
            added = cluster.add_ps()
            slow = coord.schedule(_slow_step, args=(8.0,))
            deadline = time.monotonic() + 60
            while coord.pending()[1] == 0:   # (until the slow step is in flight)
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with pytest.raises(TimeoutError):
                coord.add_parameter_server(added, timeout=0.5)
            # the job as it was: its servers and rows; no shard left on the new server
            assert len(strategy.parameter_servers) == 2 and added not in strategy.parameter_servers
            assert emb.num_shards == 2 and _rows(emb.addresses, "emb") == rows
            assert [t.name for t in ps_pool.client_for(added).list_tables()] == []
            np.testing.assert_array_equal(emb.lookup(keys, admit=False), want)
            assert slow.fetch() == 1
            moves = coord.add_parameter_server(added)   # (made again: it goes through)
            assert [m.table for m in moves] == ["counter", "emb"] and emb.num_shards == 3
            assert sum(_rows(emb.addresses, "emb")) == keys.size
            np.testing.assert_array_equal(emb.lookup(keys, admit=False), want)


def test_an_add_that_cannot_say_whether_a_move_happened_cleans_nothing_up(monkeypatch):
    """Review 26: an add ending in MoveUndetermined (a source's move made, its
    answer lost, and the source not saying) promises that nothing is
    cleaned up; the copies' clean-up deleted the new server's shard, and the
    rows that had moved there were lost with it."""
    from psserver.client import admin
    from psserver.errors import DeadlineExceeded
    real, calls = admin.PSAdmin.move_table_buckets, []

    def move(self, *a, **kw):   # (the second source's move is made, its answer lost)
        if kw.get("layout_only") or kw.get("precopy") or kw.get("fence"):
            return real(self, *a, **kw)
        calls.append(self)
        out = real(self, *a, **kw)
        if len(calls) == 2:
            raise DeadlineExceeded("the answer was lost")
        return out
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        keys = np.arange(20000, dtype=np.int64)
        with ClusterCoordinator(strategy) as coord:
            counter.lookup(keys)
            added = cluster.add_ps()
            monkeypatch.setattr(admin.PSAdmin, "move_table_buckets", move)
            monkeypatch.setattr(elastic, "_fence", lambda *a, **kw: None)   # (cannot say)
            with pytest.raises(elastic.MoveUndetermined):
                coord.add_parameter_server(added)
            monkeypatch.undo()
            held = sum(_rows(list(strategy.parameter_servers[:2]) + [added], "counter"))
            assert held == keys.size   # (every row on some server: none dropped)
