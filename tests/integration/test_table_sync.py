"""Sync mode for dynamic embedding tables (psserver/core/table_store.py over
psserver/core/sync.py), on real parameter-server processes and clusters.

A shard gathers a step's updates, one per replica, and applies their mean
(or sum) once, as one table step; a look-up for step s waits while an
earlier step is being gathered; a late update is dropped whole and counted;
an abandoned replica does not hold the step up; the applied step replicates
as any update. Every new field is checked: bad values are refused with the
shard unchanged.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from reference_optimizers import ReferenceOptimizer

from coordinator import (
    ClusterCoordinator,
    Initializer,
    LocalCluster,
    ParameterServerStrategy,
)
from coordinator.replica import get_replica_context
from protos.pstrain.v1 import ps_pb2, tables_pb2
from psserver.client import PSClient, table_spec
from psserver.contract import SyncSpec
from psserver.contract.rows import sum_duplicates
from psserver.core import replication as R
from psserver.core.dynamic_table import DynamicTable
from psserver.errors import Code, DeadlineExceeded, InvalidArgument
from psserver.link import methods
from psserver.link import tensor_proto as TP
from psserver.serve.tables import spec_of

pytestmark = pytest.mark.timeout(180)

DIM = 4
ADAGRAD = {"learning_rate": 0.5}
SPEC = dict(initializer=Initializer(kind="random_uniform", minval=-1, maxval=1, seed=3),
            optimizer="adagrad", optimizer_params=ADAGRAD)


def reference_table() -> DynamicTable:
    """One in-process shard holding every key, as the servers' shards are made."""
    spec = spec_of(table_spec(DIM, **SPEC))
    return DynamicTable(spec.config(), spec.make_optimizer())


def apply_step(ref: DynamicTable, parts, mean: bool = True) -> None:
    """One sync step in process: the replicas' (keys, grads) summed per key,
    halved for the mean of two, applied once (psserver.core.dynamic_table)."""
    keys = np.concatenate([k for k, _ in parts])
    grads = np.concatenate([g for _, g in parts])
    uniq, summed = sum_duplicates(keys, grads)
    if mean and len(parts) > 1:
        summed *= summed.dtype.type(1.0 / len(parts))
    ref.apply_gradients(uniq, summed)


def _info(c: PSClient, name: str) -> dict:
    info = c.table_info(name)
    return {f.name: getattr(info, f.name) for f in tables_pb2.TableInfo.DESCRIPTOR.fields
            if f.name != "bytes"}


def test_a_step_of_two_replicas_is_applied_once_late_and_abandoned_ones_do_not_count(start_ps):
    ps = start_ps()
    keys = np.arange(1, 6, dtype=np.int64)
    ref = reference_table()
    with PSClient(ps.address) as c, PSClient(ps.address, timeout=0.5) as impatient:
        c.create_table("t", DIM, **SPEC)
        initial = c.lookup("t", keys, sync_step=0)   # nothing pending: answers at once
        np.testing.assert_array_equal(initial, ref.lookup(keys))
        rng = np.random.default_rng(0)
        g0 = rng.normal(size=(3, DIM)).astype(np.float32)   # keys 1, 2, 3
        g1 = rng.normal(size=(2, DIM)).astype(np.float32)   # keys 3, 4
        spec = [SyncSpec(0, r, 2, 2) for r in range(2)]
        assert c.update_table("t", keys[:3], g0, sync=spec[0]) == (0, 0)   # gathered
        # Step 0 is pending: a look-up for step 1 waits (here, past its deadline)...
        with pytest.raises(DeadlineExceeded):
            impatient.lookup("t", keys, sync_step=1)
        # ...and the rows are as before, step 0 not applied yet.
        np.testing.assert_array_equal(c.lookup("t", keys, admit=False), initial)
        assert c.update_table("t", keys[2:4], g1, sync=spec[1]) == (4, 0)   # completes it
        apply_step(ref, [(keys[:3], g0), (keys[2:4], g1)])
        after = c.lookup("t", keys, sync_step=1)
        np.testing.assert_array_equal(after, ref.lookup(keys, admit=False))
        # Key 3 took one Adagrad step of the replicas' mean, not one per replica.
        one = ReferenceOptimizer("adagrad", ADAGRAD, initial[2].copy())
        one.apply_dense((g0[2] + g1[0]) * np.float32(0.5))
        np.testing.assert_allclose(after[2], one.value, rtol=1e-6)
        info = _info(c, "t")
        assert (info["sync_steps"], info["step"], info["updated"], info["late"]) == (1, 1, 4, 0)

        # A replica's second update of an applied step: dropped whole, counted.
        c.update_table("t", keys[:3], g0, sync=spec[0])
        assert _info(c, "t")["late"] == 1
        np.testing.assert_array_equal(c.lookup("t", keys, admit=False), after)

        # Step 1: replica 1 is abandoned; the step completes with replica 0 alone.
        c.update_table("t", keys[:2], g0[:2], sync=SyncSpec(1, 0, 2, 2))
        c.abandon_step(1, 1)
        apply_step(ref, [(keys[:2], g0[:2])])
        np.testing.assert_array_equal(c.lookup("t", keys, sync_step=2),
                                      ref.lookup(keys, admit=False))
        c.update_table("t", keys[:2], g1, sync=SyncSpec(1, 1, 2, 2))   # it came after all
        info = _info(c, "t")
        assert (info["sync_steps"], info["step"], info["late"]) == (2, 2, 2)

        # Step 2 with a step_timeout: a look-up for step 3 completes it with what came.
        c.update_table("t", keys[3:], g1, sync=SyncSpec(2, 1, 2, 2, step_timeout=0.2))
        apply_step(ref, [(keys[3:], g1)])
        np.testing.assert_array_equal(c.lookup("t", keys, sync_step=3),
                                      ref.lookup(keys, admit=False))
        assert c.get_meta("~table~t").sync_steps == 3


def test_bad_sync_fields_are_refused_and_change_nothing(start_ps):
    ps = start_ps()
    keys = np.arange(1, 4, dtype=np.int64)
    grads = np.ones((3, DIM), np.float32)
    with PSClient(ps.address, shared_memory=False) as c:
        c.create_table("t", DIM, **SPEC)
        c.create_variable("v", initial_value=np.zeros((4, DIM), np.float32))
        c.lookup("t", keys)

        def state():
            return _info(c, "t"), c.lookup("t", keys, admit=False).tobytes(), \
                c.get_meta("~table~t"), c.get_meta("v")
        before = state()
        good = SyncSpec(0, 0, 2, 2)
        bad_specs = [dataclasses.replace(good, step=-1), dataclasses.replace(good, step=1 << 62),
                     dataclasses.replace(good, replica=2), dataclasses.replace(good, replica=-1),
                     dataclasses.replace(good, required=0), dataclasses.replace(good, required=3),
                     dataclasses.replace(good, num_replicas=0),
                     dataclasses.replace(good, step_timeout=-1.0),
                     dataclasses.replace(good, step_timeout=float("nan")),
                     dataclasses.replace(good, hybrid=True)]
        for spec in bad_specs:
            with pytest.raises(InvalidArgument) as e:
                c.update_table("t", keys, grads, sync=spec)
            assert e.value.code == Code.INVALID_ARGUMENT
            with pytest.raises(InvalidArgument):   # a fixed table's sync sparse push too
                c.push_sparse("v", keys, grads, sync=spec)
        for g, words in ((np.ones((2, DIM), np.float32), "shape"),
                         (np.full((3, DIM), np.nan, np.float32), "NaN"),
                         (np.ones((3, DIM), np.int32), "dtype")):
            with pytest.raises(InvalidArgument, match=words):
                c.update_table("t", keys, g, sync=good)
        for step, timeout in ((-1, 0.0), (1 << 62, 0.0), (0, -1.0), (0, float("nan"))):
            req = tables_pb2.LookupRequest(name="t", sync=ps_pb2.SyncRead(
                step=step, step_timeout=timeout))
            TP.fill(req.keys, keys)
            with pytest.raises(InvalidArgument, match="sync look-up"):
                c._call(methods.TABLE_LOOKUP, req)
        # Replication's new field: a record's and a state copy's sync_steps.
        rec = R.Record("~table~t", 0, 1, 0, -1, R.TABLE_UPDATE, grads[:1], keys[:1])
        with pytest.raises(InvalidArgument, match="sync_steps"):
            c.replicate([rec])
        rows = {"keys": np.zeros(0, np.int64), "values": np.zeros((0, DIM), np.float32),
                "age_steps": np.zeros(0, np.int64), "age_seconds": np.zeros(0),
                "freq": np.zeros(0, np.int64)}
        with pytest.raises(InvalidArgument, match="sync_steps"):
            c.import_table("_copy", rows, 0, replica=dict(
                spec=table_spec(DIM, **SPEC), epoch=0, version=1, applied_ids=[],
                sync_steps=-1))
        assert state() == before
        assert [t.name for t in c.list_tables()] == ["t"]
        # The refused updates joined no step: both replicas' good ones complete it.
        c.update_table("t", keys, grads, sync=good)
        c.update_table("t", keys, grads, sync=dataclasses.replace(good, replica=1))
        info = _info(c, "t")
        assert (info["sync_steps"], info["late"], info["updated"]) == (1, 0, 3)
        with pytest.raises(InvalidArgument, match="applied on arrival"):   # says what to do
            c.update_table("t", keys, grads, sync=dataclasses.replace(good, hybrid=True))


# -- on clusters -------------------------------------------------------------------------
STEPS, K = 6, 8


def step_keys(seed: int = 0) -> np.ndarray:
    """[step, replica, K] keys: replicas overlap on some keys each step."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 24, size=(STEPS, 2, K)).astype(np.int64) * 1_000_003


def row_grads(rows: np.ndarray, replica: int) -> np.ndarray:
    """A replica's gradient, a function of the rows it read (float32)."""
    return (rows * np.float32(0.5) - np.float32(replica + 1)).astype(np.float32)


def make_step(table, crash_step: int | None = None):
    def step(keys_global):
        ctx = get_replica_context()
        keys = np.unique(keys_global[ctx.replica_id_in_sync_group])
        rows = table.lookup(keys)
        if ctx.step == crash_step and ctx.replica_id_in_sync_group == 1:
            os.kill(os.getpid(), 9)   # looked up, never pushed (not re-run: abandoned)
        table.push_gradient(keys, row_grads(rows, ctx.replica_id_in_sync_group))
        return {"rows": rows, "step": ctx.step}
    return step


def reference_run(keys_global: np.ndarray, dead: tuple[int, int] | None = None):
    """The steps in one process: each step's look-ups, then one update of the
    replicas' mean (a dead replica looked up, and sent nothing)."""
    ref, seen = reference_table(), []
    for t in range(STEPS):
        parts, rows_t = [], []
        for r in range(2):
            keys = np.unique(keys_global[t, r])
            rows = ref.lookup(keys)
            rows_t.append(rows)
            if (t, r) != dead:
                parts.append((keys, row_grads(rows, r)))
        apply_step(ref, parts)
        seen.append(rows_t)
    return ref, seen


def _as_one_process(keys_global, got: np.ndarray, per_step: list) -> None:
    """The table (``got``: every key's row) ends as reference_run's, bit for
    bit, and every replica of step t looked up the rows after step t - 1."""
    ref, seen = reference_run(keys_global)
    np.testing.assert_array_equal(got, ref.lookup(np.unique(keys_global), admit=False))
    for t, replicas in enumerate(per_step):
        for r, out in enumerate(replicas):
            assert out["step"] == t
            np.testing.assert_array_equal(out["rows"], seen[t][r])


def _train(strategy, step_fn, keys_global):
    with ClusterCoordinator(strategy) as coord:
        results = [coord.schedule(step_fn, args=(keys_global[t],)) for t in range(STEPS)]
        coord.join()
        return [[r.fetch() for r in rv.replicas] for rv in results]


def test_sync_mode_trains_a_dynamic_table_as_one_process_would_and_replicates_it(tmp_path):
    from test_table_replication import _copies, _same
    keys_global = step_keys()
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="sync", replication=True)
        table = strategy.create_embedding_table("emb", DIM, **SPEC)
        per_step = _train(strategy, make_step(table), keys_global)
        all_keys = np.unique(keys_global)
        got = table.lookup(all_keys, admit=False)
        stats = table.stats()
        copies = _copies(cluster, table, tmp_path)
    _as_one_process(keys_global, got, per_step)
    assert stats.late == 0
    # Each shard applied one table step per sync step, and its backup holds the same.
    for p_version, b_version, p_rows, b_rows in copies:
        assert p_version == b_version and _same(p_rows, b_rows)


def test_a_dead_replica_is_abandoned_and_the_step_applies_without_it():
    keys_global = step_keys(1)
    crash = 3
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="sync", step_timeout=0)
        table = strategy.create_embedding_table("emb", DIM, **SPEC)
        per_step = _train(strategy, make_step(table, crash), keys_global)
        all_keys = np.unique(keys_global)
        got = table.lookup(all_keys, admit=False)
        infos = [PSClient(a, token=cluster.token, tls=cluster.tls).table_info("emb")
                 for a in table.addresses]
        assert sum(not w.alive() for w in cluster.workers) == 1
    from coordinator.coordinator import ABANDONED
    assert [(t, r) for t, reps in enumerate(per_step) for r, v in enumerate(reps)
            if v is ABANDONED] == [(crash, 1)]
    ref, _ = reference_run(keys_global, dead=(crash, 1))
    np.testing.assert_array_equal(got, ref.lookup(all_keys, admit=False))
    assert all(i.sync_steps == STEPS and i.step == STEPS for i in infos)



def test_a_sync_look_up_sent_to_a_backup_copy_is_refused_at_once():
    """A backup copy gathers a sync step's updates too (it finishes the step
    if promoted), so a sync look-up of a later step sent to it used to wait
    for that step until its deadline before answering NotPrimary. It is
    refused at once, without waiting (the look-up's deadline is far off)."""
    from psserver.errors import NotPrimary

    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="sync", replication=True)
        table = strategy.create_embedding_table("emb", DIM, **SPEC)
        keys = np.arange(4, dtype=np.int64)
        grads = np.ones((4, DIM), np.float32)
        backup = table.backups[0]
        with PSClient(table.shards[0].address, token=cluster.token, tls=cluster.tls) as p, \
                PSClient(backup.address, token=cluster.token, tls=cluster.tls,
                         timeout=20) as b:
            spec = SyncSpec(0, 0, 2, 2)   # one replica of two: step 0 stays pending
            p.update_table(table.shards[0].table, keys, grads, sync=spec)
            b.update_table(backup.table, keys, grads, sync=spec)
            with pytest.raises(NotPrimary):
                b.lookup(backup.table, keys, sync_step=1)
            with pytest.raises(NotPrimary):
                b.lookup(backup.table, keys)


def test_in_sync_mode_a_server_added_and_drained_mid_run_trains_as_one_process():
    """Adds and drains in sync mode (refused before): the pause comes between
    two whole steps, so every shard, the new one too, counts every replica of
    each step after it: the table ends as one process's, bit for bit, and
    each replica of step t read the rows after step t - 1. (That a started
    step's other replicas run first is made certain in hybrid mode,
    test_variable_moves, and on the queue, tests/coordinator/test_cluster.py:
    here both replicas of a step are usually taken together.)"""
    import time
    keys_global = step_keys()

    def slow_second(table):   # (replica 1 a straggler)
        step = make_step(table)

        def run(keys):
            if get_replica_context().replica_id_in_sync_group == 1:
                time.sleep(0.05)
            return step(keys)
        return run
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, mode="sync")
        table = strategy.create_embedding_table("emb", DIM, **SPEC)
        with ClusterCoordinator(strategy) as coord:
            results = [coord.schedule(slow_second(table), args=(keys_global[t],))
                       for t in range(STEPS)]
            results[1].fetch()
            added = coord.add_parameter_server(cluster.add_ps())
            results[3].fetch()
            drained = coord.remove_parameter_server(strategy.parameter_servers[0])
            coord.join()
            per_step = [[r.fetch() for r in rv.replicas] for rv in results]
        all_keys = np.unique(keys_global)
        got = table.lookup(all_keys, admit=False)
        assert table.num_shards == 2 and table.stats().late == 0
    assert [m.rows for m in added] and [m.rows for m in drained if hasattr(m, "table")]
    _as_one_process(keys_global, got, per_step)
