"""Adding a parameter server to a running job (coordinator/elastic.py), on
real processes: each dynamic table moves about a third of its rows to the
third server while workers train; no step fails, no update is lost or
applied twice (an exactly-once counter per example), a description of the
table made before the move learns the new layout from the first refusal,
and checkpoints written after it restore into the old number of servers.
What is not supported yet is refused with nothing changed."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from coordinator import (
    CheckpointManager,
    ClusterCoordinator,
    IndexedSlices,
    LocalCluster,
    Lookup,
    ParameterServerStrategy,
    ShardedSource,
    ps_pool,
    push_gradients,
    read_variables,
)
from psserver.errors import NotPrimary, PSError

pytestmark = pytest.mark.timeout(240)

SGD1 = {"learning_rate": 1.0}
EXAMPLES, BATCH = 9600, 16
KEYS = 30_000


def counting_step(counter, emb, w, it):
    """Each example id's counter row +1 (exactly once, the batch's update
    key), and 64 rows of a bigger table per example -1, w -1: a CTR-like
    step of a look-up and a push of two tables and a variable."""
    ids = np.asarray(next(it), np.int64)
    keys = (ids[:, None] * 64 + np.arange(64)).reshape(-1) % KEYS
    got, rows, _ = read_variables([Lookup(counter, ids), Lookup(emb, keys), w])
    push_gradients([(counter, IndexedSlices(-np.ones_like(got), ids)),
                    (emb, IndexedSlices(np.ones_like(rows), keys)),
                    (w, np.ones(2, np.float32))])
    return ids.tolist()


def _job(spec, **kw):
    strategy = ParameterServerStrategy(spec, **kw)
    counter = strategy.create_embedding_table("counter", 1, initializer="zeros",
                                              optimizer="sgd", optimizer_params=SGD1)
    emb = strategy.create_embedding_table("emb", 4, initializer="zeros", optimizer="adam",
                                          optimizer_params={"learning_rate": 0.01})
    w = strategy.create_variable("w", shape=(2,), optimizer="sgd", optimizer_params=SGD1)
    return strategy, counter, emb, w


def _schedule_epoch(coord, counter, emb, w):
    """counting_step over an exactly-once sharded dataset of EXAMPLES ids,
    every step of its epoch scheduled: (dataset, steps, their RemoteValues)."""
    ds = coord.create_sharded_dataset(ShardedSource.from_arrays(
        np.arange(EXAMPLES), shard_sizes=[EXAMPLES // 2] * 2), batch_size=BATCH)
    it = iter(ds)
    steps = EXAMPLES // BATCH
    return ds, steps, [coord.schedule(counting_step, args=(counter, emb, w, it))
                       for _ in range(steps)]


def _each_example_once(coord, ds, done, counter, w, steps: int) -> None:
    """After the epoch: no step failed, each batch trained once, every
    example's counter exactly 1, and w one update a step."""
    coord.join(timeout=180)
    assert ds.wait_epoch(0, timeout=30) and ds.epochs_completed == 1
    assert sorted(i for d in done for i in d.fetch()) == list(range(EXAMPLES))
    np.testing.assert_array_equal(counter.lookup(np.arange(EXAMPLES), admit=False),
                                  np.ones((EXAMPLES, 1), np.float32))
    np.testing.assert_array_equal(read_variables([w])[0], [-steps, -steps])


def _rows(addresses, name):
    return [ps_pool.client_for(a).table_info(name).rows for a in addresses]


def test_a_server_added_while_workers_train_takes_a_third_and_nothing_is_lost(tmp_path,
                                                                              caplog):
    import logging
    import re
    caplog.set_level(logging.INFO, logger="coordinator")
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            ds, steps, done = _schedule_epoch(coord, counter, emb, w)
            done[steps // 5].fetch()   # training: some steps done, the rest queued
            stale = pickle.dumps(emb)   # a description from before the move
            rows_before = {t.name: sum(_rows(t.addresses, t.name)) for t in (counter, emb)}
            added = cluster.add_ps()
            queued, in_flight = coord.pending()
            moves = coord.add_parameter_server(added)
            _each_example_once(coord, ds, done, counter, w, steps)
            assert queued > 0   # (steps sent with the old layout ran after the move)
            # each table: about a third of its buckets and rows went to the new server
            assert [m.table for m in moves] == ["counter", "emb"]
            for m, t in zip(moves, (counter, emb)):
                assert t.addresses[-1] == added and t.num_shards == 3 and t.layout_epoch == 2
                assert abs(m.buckets - 4096 // 3) <= 1
                assert abs(m.rows / (m.rows + m.kept) - 1 / 3) < 0.1 / 3, m
                assert m.rows + m.kept >= rows_before[t.name]
                # copied ahead while the steps ran; between two steps, what changed since
                assert m.ahead.rows > 0 and m.sent <= m.rows, m
                assert f"table '{m.table}': {m.ahead.rows} rows" in caplog.text
            assert strategy.parameter_servers[-1] == added
            from prometheus_client import generate_latest

            from coordinator import metrics
            text = generate_latest(metrics.REGISTRY).decode()   # (what /metrics serves)
            assert 'pstrain_coordinator_table_moves_total{outcome="done"}' in text
            assert metrics.REGISTRY.get_sample_value(
                "pstrain_coordinator_table_rows_moved_total") >= sum(m.rows for m in moves) > 0
            assert metrics.REGISTRY.get_sample_value(
                "pstrain_coordinator_table_rows_copied_ahead_total") >= \
                sum(m.ahead.rows for m in moves)
            assert metrics.REGISTRY.get_sample_value(   # (none under way now)
                "pstrain_coordinator_table_move_buckets_left", {"table": "emb"}) == 0
            # progress in the log, a source at a time: part of the buckets, then all
            for m in moves:
                done = [int(d) for d, total in re.findall(
                    rf"table '{m.table}': (\d+) of (\d+) buckets moved", caplog.text)
                    if int(total) == m.buckets]
                assert len(done) == 2 and 0 < done[0] < done[1] == m.buckets, caplog.text
            assert sum(_rows(counter.addresses, "counter")) == EXAMPLES
            assert _rows(emb.addresses, "emb")[2] > 0
            # a description from before the move: refused at first, it learns the
            # layout there and reads every row where it is now
            old = pickle.loads(stale)
            assert old.layout_epoch == 0 and old.num_shards == 2
            keys = np.arange(KEYS, dtype=np.int64)
            np.testing.assert_array_equal(old.lookup(keys, admit=False),
                                          emb.lookup(keys, admit=False))
            assert old.layout_epoch == 2 and old.addresses == emb.addresses
            # a checkpoint written now restores into this job (its shards are told
            # the layout again: the restore emptied them) and into two servers
            saved = CheckpointManager(strategy, str(tmp_path)).save(steps)
            want = emb.lookup(keys, admit=False)
            CheckpointManager(strategy, str(tmp_path)).restore(saved)
            np.testing.assert_array_equal(emb.lookup(keys, admit=False), want)
            gone = keys[(emb.shard_of(keys) == 2) & (pickle.loads(stale).shard_of(keys) == 0)]
            with pytest.raises(NotPrimary, match="another server"):
                ps_pool.client_for(emb.addresses[0]).lookup("emb", gone[:3], admit=False)
            np.testing.assert_array_equal(pickle.loads(stale).lookup(keys, admit=False), want)
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy):
            CheckpointManager(strategy, str(tmp_path)).restore(saved)
            np.testing.assert_array_equal(emb.lookup(keys, admit=False), want)
            np.testing.assert_array_equal(counter.lookup(np.arange(EXAMPLES), admit=False),
                                          np.ones((EXAMPLES, 1), np.float32))


def test_a_source_refuses_moved_keys_to_a_caller_that_cannot_learn_the_layout():
    """The server side of the rule, without the coordinator's help: a plain
    client asking the old shard for a moved key gets NotPrimary, not a row."""
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            keys = np.arange(3000, dtype=np.int64)
            emb.lookup(keys)
            old_map = emb.buckets
            coord.add_parameter_server(cluster.add_ps())
            moved = keys[(emb.shard_of(keys) == 2) & (old_map.shard_of(keys) == 0)]
            assert moved.size
            with pytest.raises(NotPrimary, match="handed to another server"):
                ps_pool.client_for(emb.addresses[0]).lookup("emb", moved[:5], admit=False)


def slow_step(emb):
    """A step still running when the add is asked for: its end (wall clock)."""
    import time
    emb.lookup(np.arange(100, dtype=np.int64))
    time.sleep(1.5)   # (the work of a long step)
    emb.push_gradient(np.arange(100, dtype=np.int64), np.ones((100, 4), np.float32))
    return time.time()


def test_the_move_waits_for_the_steps_in_flight():
    """Between two steps: a step running when the add is asked for ends
    before any row moves (its push would otherwise meet a layout other than
    its look-up's)."""
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            running = coord.schedule(slow_step, args=(emb,))
            while coord.pending() != (0, 1):   # (taken by the worker)
                pass
            moves = coord.add_parameter_server(cluster.add_ps())
            assert moves[1].started >= running.fetch()


@pytest.mark.parametrize("kw, match", [
    (dict(replication=True), "replication"),
])
def test_what_is_not_supported_yet_is_refused_with_nothing_changed(kw, match):
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy, counter, emb, w = _job(cluster.spec, **kw)
        with ClusterCoordinator(strategy) as coord:
            added = cluster.add_ps()
            with pytest.raises(ValueError, match=match):
                coord.add_parameter_server(added)
            with pytest.raises(ValueError, match="already"):
                coord.add_parameter_server(strategy.parameter_servers[0])
            assert strategy.parameter_servers == tuple(cluster.spec.cluster_spec().ps[:2])
            assert emb.num_shards == 2 and emb.layout_epoch == 0
            assert ps_pool.client_for(added).list_tables() == []


def test_adding_an_address_that_is_not_a_parameter_server_says_so_and_changes_nothing():
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            worker = cluster.spec.cluster_spec().worker[0]
            with pytest.raises(ValueError, match="is not a parameter server"):
                coord.add_parameter_server(worker)
            assert strategy.parameter_servers == tuple(cluster.spec.cluster_spec().ps)
            assert emb.num_shards == 2 and emb.layout_epoch == 0


def test_a_step_half_applied_before_the_add_and_run_again_after_it_applies_once():
    """An exactly-once step whose worker died after one server applied its
    part runs again after the add, with the same update keys: the part
    applied before is left out where its rows are now (the source, and the
    new server for the buckets it moved), the rest is applied, once. The
    update keys follow the shard a key was created on, not where it is now."""
    from coordinator.calls import update_key_scope
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        table = strategy.create_embedding_table("sgd", 2, initializer="zeros",
                                                optimizer="sgd", optimizer_params=SGD1)
        with ClusterCoordinator(strategy) as coord:
            keys = np.arange(4000, dtype=np.int64)
            table.lookup(keys)
            first = keys[table.shard_of(keys) == 0]   # what server 0 applied before the death
            ones = np.ones((keys.size, 2), np.float32)
            with update_key_scope(b"batch-7"):
                push_gradients([(table, IndexedSlices(ones[:first.size], first))])
            coord.add_parameter_server(cluster.add_ps())
            for _ in range(2):   # the step run again, whole; then a resend of it
                with update_key_scope(b"batch-7"):
                    push_gradients([(table, IndexedSlices(ones, keys))])
            got = table.lookup(keys, admit=False)
            np.testing.assert_array_equal(got, -ones)   # every key: once
            on_new = table.shard_of(keys) == 2
            assert (on_new & np.isin(keys, first)).any() and (on_new & ~np.isin(keys, first)).any()


def test_two_adds_and_a_description_from_between_them_update_every_key_once():
    """A description made after the first add and used after the second:
    its pieces for the second new server come from two of its shards with one
    update key each; merged, every key is updated once (none taken for a
    resend of the other)."""
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        table = strategy.create_embedding_table("sgd", 1, initializer="zeros",
                                                optimizer="sgd", optimizer_params=SGD1)
        with ClusterCoordinator(strategy) as coord:
            keys = np.arange(20000, dtype=np.int64)
            table.lookup(keys)
            coord.add_parameter_server(cluster.add_ps())
            between = pickle.dumps(table)
            coord.add_parameter_server(cluster.add_ps())
            assert table.num_shards == 4 and table.layout_epoch == 5   # (a move per source)
            from coordinator import layouts
            layouts._latest.clear()   # (as a process that met only the first add)
            stale = pickle.loads(between)
            stale.push_gradient(keys, np.ones((keys.size, 1), np.float32))
            assert stale.layout_epoch == 5
            np.testing.assert_array_equal(table.lookup(keys, admit=False)[:, 0], -1.0)
            # two calls in flight on one stale description: both planned again
            layouts._latest.clear()
            stale = pickle.loads(between)
            calls = [stale.lookup_async(keys, admit=False) for _ in range(2)]
            for c in calls:
                np.testing.assert_array_equal(c.result()[:, 0], -1.0)


def _failing_second_move(monkeypatch, lost_reply: bool):
    """The second source's MoveBuckets fails: before it is sent, or (with
    ``lost_reply``) after the source made it (its answer lost)."""
    from psserver.client import admin
    from psserver.errors import DeadlineExceeded, Unavailable
    real, calls = admin.PSAdmin.move_table_buckets, []

    def move(self, *a, **kw):
        if kw.get("layout_only") or kw.get("precopy"):   # (the moves' own calls only)
            return real(self, *a, **kw)
        calls.append(self)
        if len(calls) == 2:
            if lost_reply:
                real(self, *a, **kw)
                raise DeadlineExceeded("the answer was lost")
            raise Unavailable("the source did not answer")
        return real(self, *a, **kw)
    monkeypatch.setattr(admin.PSAdmin, "move_table_buckets", move)


@pytest.mark.parametrize("lost_reply", [False, True], ids=["not-sent", "answer-lost"])
def test_a_move_that_fails_part_way_leaves_a_consistent_layout_and_can_be_resumed(
        monkeypatch, tmp_path, lost_reply):
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            keys = np.arange(30000, dtype=np.int64)
            counter.lookup(keys)
            emb.lookup(keys)
            emb.push_gradient(keys, np.ones((keys.size, 4), np.float32))
            want = emb.lookup(keys, admit=False), counter.lookup(keys, admit=False)
            added = cluster.add_ps()
            _failing_second_move(monkeypatch, lost_reply)
            with pytest.raises(PSError):
                coord.add_parameter_server(added)
            monkeypatch.undo()
            # counter: source 0 moved (and source 1 too, its answer lost); emb: not started
            assert counter.num_shards == 3 and emb.num_shards == 2
            assert counter.layout_epoch == 2   # (past the fence on source 1, moved or not)
            on_new = int((counter.buckets.owner == 2).sum())
            assert on_new == 4096 // 3 if lost_reply else 0 < on_new < 4096 // 3
            rows = _rows(counter.addresses, "counter")
            assert sum(rows) == keys.size   # no row twice, none lost
            np.testing.assert_array_equal(counter.lookup(keys, admit=False), want[1])
            np.testing.assert_array_equal(emb.lookup(keys, admit=False), want[0])
            saved = CheckpointManager(strategy, str(tmp_path)).save(1)
            CheckpointManager(strategy, str(tmp_path)).restore(saved)
            # resumed: the part of counter's add that failed, and the table it did not reach
            moves = coord.add_parameter_server(added)
            assert [m.table for m in moves] == (["emb"] if lost_reply else ["counter", "emb"])
            assert emb.num_shards == counter.num_shards == 3
            for table in (counter, emb):   # each its share on the added server, as one add
                assert int((table.buckets.owner == 2).sum()) == 4096 // 3
            assert sum(_rows(counter.addresses, "counter")) == keys.size
            assert 0 < _rows(counter.addresses, "counter")[2] < keys.size
            np.testing.assert_array_equal(emb.lookup(keys, admit=False), want[0])
            np.testing.assert_array_equal(counter.lookup(keys, admit=False), want[1])
            with pytest.raises(ValueError, match="already"):
                coord.add_parameter_server(added)


def test_a_coordinator_made_again_and_the_cli_keep_the_layout_the_servers_serve(tmp_path):
    """After an add, a coordinator made again (the same create call) takes
    the table as the moves left it, not an even split of its servers, so
    its checkpoints name the map the shard files follow; and the CLI's
    restore (token on the command line) tells every shard the layout again."""
    import os
    import subprocess
    import sys

    from coordinator.serving import Snapshot
    args = dict(initializer="zeros", optimizer="sgd", optimizer_params=SGD1)
    with LocalCluster(num_ps=2, num_workers=1, checkpoint_dirs=[str(tmp_path)],
                      tls=False) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        emb = strategy.create_embedding_table("emb", 4, **args)
        keys = np.arange(20000, dtype=np.int64)
        with ClusterCoordinator(strategy) as coord:
            emb.lookup(keys)
            coord.add_parameter_server(cluster.add_ps())
            emb.push_gradient(keys, np.ones((keys.size, 4), np.float32))
        again = ParameterServerStrategy(cluster.spec)   # (its spec has the third server)
        emb2 = again.create_embedding_table("emb", 4, **args)
        assert (emb2.layout_epoch, emb2.buckets, emb2.addresses) == \
            (emb.layout_epoch, emb.buckets, emb.addresses)
        with ClusterCoordinator(again):
            path = CheckpointManager(again, str(tmp_path)).save(1)
        np.testing.assert_array_equal(Snapshot(str(tmp_path)).lookup("emb", keys)[:, 0], -1.0)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PSTRAIN_")}
        done = subprocess.run([sys.executable, "-m", "coordinator", "checkpoint", "restore",
                               os.path.dirname(path),
                               "--ps", ",".join(again.parameter_servers), "--token",
                               cluster.token], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert all(ps_pool.client_for(a).table_info("emb").layout for a in emb.addresses)
        np.testing.assert_array_equal(emb.lookup(keys, admit=False)[:, 0], -1.0)


def test_a_server_added_and_removed_again_while_workers_train_loses_nothing():
    """Issue 34's test: a CTR-like job on 2 servers, a third added at a
    quarter of the steps and drained again at half, workers training
    throughout: no step fails, every example counted exactly once, the
    drained server ends holding no row, and a description made between
    the two learns the layout from the drained server."""
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            ds, steps, done = _schedule_epoch(coord, counter, emb, w)
            done[steps // 4].fetch()
            added = cluster.add_ps()
            coord.add_parameter_server(added)
            between = pickle.dumps(emb)
            done[steps // 2].fetch()
            queued, _ = coord.pending()
            moves = coord.remove_parameter_server(added)
            _each_example_once(coord, ds, done, counter, w, steps)
            assert queued > 0   # (steps ran after the drain)
            assert added not in strategy.parameter_servers
            assert len(strategy.parameter_servers) == 2
            for m, t in zip(moves, (counter, emb)):
                assert t.num_shards == 2 and added not in t.addresses and m.kept == 0
                assert ps_pool.client_for(added).table_info(t.name).rows == 0
                assert t.layout_epoch == 4   # (two moves in, two out)
            old = pickle.loads(between)   # (3 shards, the drained server among them)
            keys = np.arange(KEYS, dtype=np.int64)
            np.testing.assert_array_equal(old.lookup(keys, admit=False),
                                          emb.lookup(keys, admit=False))
            assert old.addresses == emb.addresses
            with pytest.raises(ValueError, match="not a parameter server of this job"):
                coord.remove_parameter_server(added)
            # the drained server added again (its empty shards taken back)
            want = emb.lookup(keys, admit=False)
            coord.add_parameter_server(added)
            assert emb.num_shards == 3 and emb.addresses[-1] == added
            np.testing.assert_array_equal(emb.lookup(keys, admit=False), want)
            assert ps_pool.client_for(added).table_info("emb").rows > 0


def test_a_server_recreated_after_an_add_gets_its_capacity_part_as_the_buckets_are_now():
    """Recovery recreates a lost shard with the capacity part it holds after
    the add (the parts follow the buckets), not the one it was made with."""
    with LocalCluster(num_ps=2, num_workers=1) as cluster:   # (a killed server restarts)
        strategy = ParameterServerStrategy(cluster.spec)
        t = strategy.create_embedding_table("cap", 2, capacity=3000, initializer="zeros")
        with ClusterCoordinator(strategy, recreate_lost_shards=True,
                                ps_check_interval=0.1) as coord:
            t.lookup(np.arange(2000, dtype=np.int64))
            coord.add_parameter_server(cluster.add_ps())
            parts = [ps_pool.client_for(a).table_info("cap").spec.capacity for a in t.addresses]
            assert sum(parts) == 3000 and parts[0] < 1500
            cluster.kill_ps(0)
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)   # (the watch)
            coord.join(timeout=60)
            assert ps_pool.client_for(t.addresses[0]).table_info("cap").spec.capacity == parts[0]
            assert t.lookup(np.arange(2000, dtype=np.int64), admit=False).shape == (2000, 2)


@pytest.mark.parametrize("spec_lists", ["the-original-two", "a-drained-one-too"])
def test_a_coordinator_made_again_adopts_a_table_with_a_capacity_whatever_its_spec_lists(
        spec_lists):
    """A coordinator made again after an add and a drain made by the API (its
    cluster spec not changed): the table with a capacity is adopted as the
    moves left it (its capacity summed over the servers its layout names),
    and a server only the layout names is watched and recreated as the others."""
    from coordinator.cluster_spec import ClusterSpec
    args = dict(initializer="zeros", optimizer="sgd", optimizer_params=SGD1, capacity=9000,
                seed=7)   # (each shard's admission seed: seed * servers + i when made)
    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        full = cluster.spec.cluster_spec()
        first = ClusterSpec(ps=full.ps[:2], worker=full.worker, token=full.token, tls=full.tls)
        strategy = ParameterServerStrategy(first)
        emb = strategy.create_embedding_table("emb", 2, **args)
        keys = np.arange(6000, dtype=np.int64)
        with ClusterCoordinator(strategy) as coord:
            emb.lookup(keys)
            coord.add_parameter_server(full.ps[2])
            if spec_lists == "a-drained-one-too":
                coord.remove_parameter_server(full.ps[1])
            emb.push_gradient(keys, np.ones((keys.size, 2), np.float32))
        spec = full if spec_lists == "a-drained-one-too" else first
        again = ParameterServerStrategy(spec)
        emb2 = again.create_embedding_table("emb", 2, **args)
        assert (emb2.layout_epoch, emb2.buckets, emb2.addresses) == \
            (emb.layout_epoch, emb.buckets, emb.addresses)
        np.testing.assert_array_equal(emb2.lookup(keys, admit=False)[:, 0], -1.0)
        assert "emb" in again.tables_on(full.ps[2]) and full.ps[2] in again.server_ids
        assert full.ps[2] in again.parameter_servers   # (a member: it can be drained)
        with ClusterCoordinator(again) as coord:
            coord.remove_parameter_server(full.ps[2])
            assert emb2.addresses == tuple(a for a in emb.addresses if a != full.ps[2])
            np.testing.assert_array_equal(emb2.lookup(keys, admit=False)[:, 0], -1.0)


def test_a_server_added_is_reached_with_its_jobs_token_and_tls_whatever_else_runs_here():
    """Another cluster in the process (its strategy made later sets the
    process's default credentials): the server added to the first job is
    reached with the first job's token and TLS, as its other servers are."""
    from coordinator.cluster_spec import ClusterSpec
    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        full = cluster.spec.cluster_spec()
        first = ClusterSpec(ps=full.ps[:2], worker=full.worker, token=full.token, tls=full.tls)
        strategy = ParameterServerStrategy(first)
        emb = strategy.create_embedding_table("emb", 2, initializer="zeros")
        keys = np.arange(3000, dtype=np.int64)
        emb.lookup(keys)
        with LocalCluster(num_ps=1, num_workers=0) as other:
            ParameterServerStrategy(other.spec).create_variable("x", shape=(2,))
            with ClusterCoordinator(strategy) as coord:
                coord.add_parameter_server(full.ps[2])
            assert emb.num_shards == 3 and _rows([full.ps[2]], "emb")[0] > 0


@pytest.mark.parametrize("seed, capacity", [(0, 0), (5, 0), (5, 9000)])
def test_a_coordinator_made_again_after_a_shard_was_lost_keeps_the_others_where_they_are(
        seed, capacity):
    """The spec unchanged, one server's shard gone (it restarted empty while
    no coordinator ran): the table made again is taken over every server as
    it was made (that shard made again, empty, for a restore to refill), not
    spread over the others, which would look for their rows elsewhere."""
    args = dict(initializer="zeros", optimizer="sgd", optimizer_params=SGD1, seed=seed,
                capacity=capacity)
    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        emb = ParameterServerStrategy(cluster.spec).create_embedding_table("emb", 2, **args)
        keys = np.arange(6000, dtype=np.int64)
        emb.lookup(keys)
        emb.push_gradient(keys, np.ones((keys.size, 2), np.float32))
        ps_pool.client_for(emb.addresses[2]).delete_table("emb")   # (lost)
        again = ParameterServerStrategy(cluster.spec)
        emb2 = again.create_embedding_table("emb", 2, **args)
        assert emb2.addresses == emb.addresses
        got = emb2.lookup(keys, admit=False)[:, 0]
        on_lost = emb.shard_of(keys) == 2
        np.testing.assert_array_equal(got[~on_lost], -1.0)   # (where they were)
        np.testing.assert_array_equal(got[on_lost], 0.0)     # (gone with the shard)
