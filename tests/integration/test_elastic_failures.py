"""A server killed in the middle of a move (coordinator/elastic.py), on real
processes that really die (psserver.core.table_moves' fault switch: the
process exits at that point, once): the new server while it takes the
rows, or a source after it sent them and before it committed. The job
keeps one consistent layout (no key served by two shards or by none),
training goes on with no step failed, and the add can be made again."""
from __future__ import annotations

import time

import numpy as np
import pytest

from coordinator import CheckpointManager, ClusterCoordinator, LocalCluster, ps_pool
from coordinator.elastic import MoveUndetermined
from psserver.core.table_moves import FAULT_CRASH_IN_MOVE_ENV
from psserver.errors import PSError
from tests.integration.test_elastic import (
    EXAMPLES,
    KEYS,
    _each_example_once,
    _job,
    _rows,
    _schedule_epoch,
)

pytestmark = pytest.mark.timeout(240)


def _add_when_it_answers(coord, address: str, timeout: float = 60.0) -> list:
    """add_parameter_server once the (restarted) server answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return coord.add_parameter_server(address)
        except PSError:
            assert time.monotonic() < deadline, f"{address} did not come back"
            time.sleep(0.2)


def test_the_new_server_killed_while_it_takes_the_rows(tmp_path):
    flag = tmp_path / "crashed"
    with LocalCluster(num_ps=2, num_workers=2,
                      env={FAULT_CRASH_IN_MOVE_ENV: f"destination:{flag}"}) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        first = strategy.parameter_servers
        with ClusterCoordinator(strategy) as coord:
            ds, steps, done = _schedule_epoch(coord, counter, emb, w)
            done[steps // 4].fetch()
            added = cluster.add_ps()
            with pytest.raises(PSError):
                coord.add_parameter_server(added)
            assert flag.exists()   # (it died, in the move)
            # the job as it was: its servers, each table on them (numbered past the fence)
            assert strategy.parameter_servers == first
            for t in (counter, emb):
                assert t.addresses == first and t.num_shards == 2
            keys = np.arange(KEYS, dtype=np.int64)
            emb.lookup(keys, admit=False)   # (every key served: none refused)
            # it restarts (LocalCluster), and is added again while the steps go on
            moves = _add_when_it_answers(coord, added)
            assert [m.table for m in moves] == ["counter", "emb"] and emb.num_shards == 3
            _each_example_once(coord, ds, done, counter, w, steps)
            assert sum(_rows(counter.addresses, "counter")) == EXAMPLES


def test_the_new_server_killed_while_it_takes_the_rows_copied_ahead(tmp_path):
    """The rows copied ahead of the move (training going on) die with it: the
    moves send them whole to the server back at that address, or the add
    fails with nothing moved and is made again; no example counted twice."""
    flag = tmp_path / "crashed"
    with LocalCluster(num_ps=2, num_workers=2,
                      env={FAULT_CRASH_IN_MOVE_ENV: f"ahead:{flag}"}) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        first = strategy.parameter_servers
        with ClusterCoordinator(strategy) as coord:
            ds, steps, done = _schedule_epoch(coord, counter, emb, w)
            done[steps // 4].fetch()
            added = cluster.add_ps()
            try:
                moves = coord.add_parameter_server(added)
            except PSError:   # (back too late for the moves: the job as it was)
                assert strategy.parameter_servers == first
                assert counter.addresses == emb.addresses == first
                moves = _add_when_it_answers(coord, added)
            assert flag.exists()   # (it died, taking the copy ahead)
            assert [m.table for m in moves] == ["counter", "emb"] and emb.num_shards == 3
            _each_example_once(coord, ds, done, counter, w, steps)
            assert sum(_rows(counter.addresses, "counter")) == EXAMPLES


def test_a_source_killed_after_it_sent_the_rows_and_before_it_committed(tmp_path):
    flag = tmp_path / "crashed"
    with LocalCluster(num_ps=2, num_workers=2,
                      env={FAULT_CRASH_IN_MOVE_ENV: f"source:{flag}"}) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        first = strategy.parameter_servers
        ckpt = CheckpointManager(strategy, str(tmp_path / "ckpt"))
        with ClusterCoordinator(strategy, checkpoint_manager=ckpt) as coord:
            ds, steps, done = _schedule_epoch(coord, counter, emb, w)
            done[steps // 4].fetch()
            ckpt.save(step=1)
            done[steps // 3].fetch()
            added = cluster.add_ps()
            try:
                coord.add_parameter_server(added)
                raise AssertionError("the add went through")
            except MoveUndetermined as exc:   # (the restarted source can tell: not moved)
                raise AssertionError(f"the fence could not say: {exc}") from exc
            except PSError:
                pass
            assert flag.exists()
            assert strategy.parameter_servers == first
            assert counter.addresses == first and counter.num_shards == 2
            # the source comes back and is restored from the checkpoint; the steps
            # go on, none failed; no key is served by two shards (none refused), and
            # no update applied twice (a counter is 0 where the restore lost it, or 1)
            coord.join(timeout=180)
            assert coord.cluster.recovery.recoveries >= 1
            assert ds.wait_epoch(0, timeout=30)
            got = counter.lookup(np.arange(EXAMPLES), admit=False)[:, 0]
            assert set(np.unique(got)) <= {0.0, 1.0} and (got == 1).sum() > EXAMPLES // 2
            assert ps_pool.client_for(added).list_tables() == []   # (its shard went)
            # and the add, made again, goes through
            moves = _add_when_it_answers(coord, added)
            assert [m.table for m in moves] == ["counter", "emb"] and counter.num_shards == 3
            keys = np.arange(KEYS, dtype=np.int64)
            np.testing.assert_array_equal(counter.lookup(np.arange(EXAMPLES), admit=False)[:, 0],
                                          got)
            emb.lookup(keys, admit=False)


def test_a_source_killed_in_a_job_without_a_checkpoint_says_it_did_not_move(tmp_path):
    """No checkpoint: the restarted source's rows are gone and the job says
    so (its recovery); the add says at once that the move did not happen
    (the source is another process), not that it cannot tell (after the
    move's deadline), and the new server keeps no copy of the rows."""
    flag = tmp_path / "crashed"
    with LocalCluster(num_ps=2, num_workers=1,
                      env={FAULT_CRASH_IN_MOVE_ENV: f"source:{flag}"}) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            counter.lookup(np.arange(EXAMPLES))
            added = cluster.add_ps()
            with pytest.raises(PSError):   # (not MoveUndetermined)
                coord.add_parameter_server(added)
            assert flag.exists() and counter.num_shards == 2
            assert ps_pool.client_for(added).list_tables() == []


def test_a_source_that_restarts_between_two_steps_of_an_add_moves_nothing(tmp_path,
                                                                          monkeypatch):
    """The second source restarts (and its recovery makes its table again,
    empty) after the first source's step and before its own: its step is
    refused (the job knew another process there), so nothing is moved out
    of the empty shard; the recovery refills it from the checkpoint and no
    row is lost (the first source's part stays moved)."""
    from coordinator import ParameterServerStrategy, elastic
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        s = ParameterServerStrategy(cluster.spec)
        emb = s.create_embedding_table("emb", 2, initializer="zeros", optimizer="sgd",
                                       optimizer_params={"learning_rate": 1.0})
        keys = np.arange(6000, dtype=np.int64)
        emb.lookup(keys)
        emb.push_gradient(keys, np.ones((keys.size, 2), np.float32))
        ckpt = CheckpointManager(s, str(tmp_path))
        with ClusterCoordinator(s, checkpoint_manager=ckpt, ps_check_interval=0.1) as coord:
            ckpt.save(step=1)
            victim = emb.addresses[1]
            old = ps_pool.client_for(victim).server_info().server_id
            real, steps = elastic._progress, []

            def after_a_step(report, left, start):   # (the first: ps 0's)
                real(report, left, start)
                steps.append(left)
                if len(steps) == 1:
                    cluster.kill_ps(1)
                    deadline = time.monotonic() + 60
                    while True:   # until it restarted and its recovery made the table
                        assert time.monotonic() < deadline, "no restart"
                        try:
                            c = ps_pool.client_for(victim)
                            if c.server_info(timeout=2).server_id != old:
                                c.table_info("emb")
                                return
                        except PSError:
                            pass
                        time.sleep(0.05)
            monkeypatch.setattr(elastic, "_progress", after_a_step)
            added = cluster.add_ps()
            with pytest.raises(PSError, match="restarted since the move was planned"):
                coord.add_parameter_server(added)
            monkeypatch.undo()
            assert len(steps) == 1
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)   # (the watch)
            coord.join(timeout=60)
            # ps 0's part stands (moved before), ps 1's stayed and was refilled
            assert emb.num_shards == 3 and emb.addresses[2] == added
            np.testing.assert_array_equal(emb.lookup(keys, admit=False)[:, 0], -1.0)
            assert sum(_rows(emb.addresses, "emb")) == keys.size


def test_a_server_that_held_nothing_of_the_job_restarting_loses_nothing():
    """A server of the job that holds none of its shards (a failed add rolled
    back, a drained one, a variable-only job with more servers than shards)
    restarts: nothing to restore, training goes on (before, the recovery
    said it "restarted empty" and stopped the job; CI caught this as a race
    in test_the_new_server_killed_while_it_takes_the_rows)."""
    from coordinator import ParameterServerStrategy, push_gradients
    with LocalCluster(num_ps=2, num_workers=1) as cluster:   # (a killed server restarts)
        strategy = ParameterServerStrategy(cluster.spec)
        w = strategy.create_variable("w", shape=(2,), optimizer="sgd",
                                     optimizer_params={"learning_rate": 1.0},
                                     partitioner=None)
        x = strategy.create_variable("x", shape=(2,), partitioner=None)
        empty = x.shards[0].address
        assert empty != w.shards[0].address
        strategy.delete_variable(x)   # (its server stays one of the job's, holding nothing)
        with ClusterCoordinator(strategy, ps_check_interval=0.1) as coord:
            cluster.kill_ps(cluster.spec.cluster_spec().ps.index(empty))
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)
            coord.join(timeout=60)
            done = coord.schedule(push_gradients, args=([(w, np.ones(2, np.float32))],))
            done.fetch()
            np.testing.assert_array_equal(w.read(), [-1.0, -1.0])
