"""Replication of dynamic embedding tables (ParameterServerStrategy(
replication=True) with create_embedding_table) on real clusters.

Each table shard's primary hands what every call changed (rows evicted,
rows made, rows updated) to its backup on the next server
(psserver/core/table_store.py, psserver/core/replication.py): copies hold the same keys,
values and slots at every acknowledged version; a lost server's shards fail
over without losing an acknowledged update; restores rebuild the backups.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from safetensors.numpy import load_file

from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
from coordinator.checkpoint import CheckpointManager
from psserver.client import PSClient
from psserver.contract import DEMOTE, PROMOTE, ROLE_BACKUP, SET_BACKUP, Peer

pytestmark = pytest.mark.timeout(240)


def _client(cluster, address: str) -> PSClient:
    return PSClient(address, token=cluster.token, tls=cluster.tls)


def _copies(cluster, table, tmp_path) -> list[tuple[int, int, dict, dict]]:
    """(primary version, backup version, primary rows, backup rows) per
    shard, each copy written to a file by its own server."""
    out = []
    for i, (p, b) in enumerate(zip(table.primaries(), table.backups)):
        if p == b:   # (after a failback the created copy is primary again)
            p = table.shards[i]
        files, versions = [], []
        for copy, tag in ((p, "p"), (b, "b")):
            d = tmp_path / f"shard{i}{tag}"
            d.mkdir(parents=True, exist_ok=True)
            with _client(cluster, copy.address) as c:
                versions.append(c.get_meta(copy.name).version)
                saved = c.save_table(copy.table, str(d))
            files.append(load_file(str(d / saved.file)))
        out.append((*versions, *files))
    return out


def _same(a: dict, b: dict) -> bool:
    names = [n for n in a if n not in ("freq", "age_seconds")]   # each copy's own counts
    return a.keys() == b.keys() and all(a[n].tobytes() == b[n].tobytes() for n in names)


def train_table(t, seed: int):
    def step(i):
        rng = np.random.default_rng(seed + i)
        keys = (rng.zipf(1.3, 64) % 400).astype(np.int64)
        t.lookup(keys)
        t.push_gradient(keys, rng.normal(size=(keys.size, t.dim)).astype(np.float32))
        return i
    return step


def test_table_backups_hold_their_primarys_rows_and_a_restore_rebuilds_them(tmp_path):
    """Two workers train a table with admission and LRU eviction at once:
    each backup holds its primary's keys, values and Adagrad slots to the
    bit, at the same version. Saved and restored into a new replicated
    cluster of 3 servers, every new backup holds its primary's rows too."""
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        t = strategy.create_embedding_table(
            "emb", 8, initializer="random_normal", optimizer="adagrad",
            optimizer_params={"learning_rate": 0.1}, min_count=2, capacity=160)
        with ClusterCoordinator(strategy) as coord:
            coord.fetch([coord.schedule(train_table(t, 100), args=(i,)) for i in range(40)])
            coord.join()
        copies = _copies(cluster, t, tmp_path / "first")
        stats = t.stats()
        CheckpointManager(strategy, str(tmp_path / "ckpt")).save(step=40)
    assert stats.evicted_capacity > 0 and stats.not_admitted > 0   # the rules were at work
    for version_p, version_b, rows_p, rows_b in copies:
        assert version_p == version_b > 0
        assert rows_p["keys"].size > 0 and _same(rows_p, rows_b)

    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        t = strategy.create_embedding_table(
            "emb", 8, initializer="random_normal", optimizer="adagrad",
            optimizer_params={"learning_rate": 0.1}, min_count=2)   # (160 / 3 would evict)
        CheckpointManager(strategy, str(tmp_path / "ckpt")).restore()
        restored = _copies(cluster, t, tmp_path / "restored")
    assert sum(p["keys"].size for _, _, p, _ in restored) == \
        sum(p["keys"].size for _, _, p, _ in copies)
    for _, _, rows_p, rows_b in restored:
        assert _same(rows_p, rows_b)


def counting_step(t, keys):
    def step():
        t.lookup(keys)
        t.push_gradient(keys, -np.ones((keys.size, t.dim), np.float32))   # sgd lr 1: +1
    return step


def test_a_lost_server_fails_over_its_table_shards_and_loses_no_acknowledged_update():
    """A server killed mid-training and not restarted: the backups of its
    table shards are promoted, training completes, and every key counts
    every acknowledged update exactly once (update keys: a resend to the
    promoted copy is not applied twice)."""
    keys = np.arange(32, dtype=np.int64)
    with LocalCluster(num_ps=2, num_workers=2, restart=()) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        t = strategy.create_embedding_table("count", 2, optimizer="sgd",
                                            optimizer_params={"learning_rate": 1.0})
        with ClusterCoordinator(strategy, ps_check_interval=0.2, ps_failover_after=1.0,
                                ps_recovery_timeout=5.0) as coord:
            step = counting_step(t, keys)
            done = [coord.schedule(step) for _ in range(25)]
            cluster.kill_ps(1)
            done += [coord.schedule(step) for _ in range(25)]
            coord.fetch(done)   # would raise if recovery had timed out (5 s)
            coord.join()
            values = t.lookup(keys, admit=False)
            primaries = t.primaries()
            assert coord.cluster.recovery.lost == {cluster.spec.ps[1]}
    np.testing.assert_array_equal(values, np.full((32, 2), 50, np.float32))
    assert {p.address for p in primaries} == {cluster.spec.ps[0]}   # both shards there now


def test_table_replication_calls_validate_what_they_receive_and_change_nothing(start_ps):
    """Records and state copies of tables: bad input refused with the right
    code and nothing changed; a backup copy refuses clients' calls; a stale
    primary's state copy does not overwrite a newer copy."""
    from protos.pstrain.v1 import tables_pb2
    from psserver.client import table_spec
    from psserver.core import replication as R
    from psserver.errors import FailedPrecondition, InvalidArgument, NotPrimary
    from psserver.link import methods
    from psserver.link import tensor_proto as TP

    token = "table-replication-secret"
    env = {"PSTRAIN_AUTH_TOKEN": token}
    a, b = start_ps(env=env), start_ps(env=env)
    with PSClient(a.address, token=token) as ca, PSClient(b.address, token=token) as cb:
        ca.create_table("t", 4, min_count=1)
        ca.create_table("v_is_a_table_too", 4)
        ca.create_variable("w", (4, 2))
        ca.reconfigure([("~table~t", SET_BACKUP, 0, Peer(b.address, "~table~_t"))])
        ca.lookup("t", np.arange(6))
        ca.update_table("t", np.arange(3), np.ones((3, 4), np.float32), update_id=5)
        meta = cb.get_meta("~table~_t")
        assert (meta.role, meta.version, meta.shape) == (ROLE_BACKUP, 2, (6, 4))

        def state():
            return cb.get_meta("~table~_t"), cb.table_info("_t").rows, ca.get_meta("~table~t")
        before = state()

        def record(**kw):
            r = R.Record("~table~_t", 0, 3, 0, 0, R.TABLE_UPDATE,
                         np.ones((1, 4), np.float32), np.array([1], np.int64))
            return dataclasses.replace(r, **kw)
        for bad in (record(tensor=np.ones((2, 4), np.float32)),            # rows != keys
                    record(tensor=np.ones((1, 4), np.float64)),            # not the dtype
                    record(tensor=np.full((1, 4), np.nan, np.float32)),
                    record(ids=np.array([1], np.int32)),
                    record(kind=R.TABLE_ROWS, evicted=np.zeros((1, 1), np.int64)),
                    record(kind=R.DENSE),                                  # a variable's kind
                    record(version=0)):
            with pytest.raises(InvalidArgument):
                cb.replicate([bad])
        with pytest.raises(InvalidArgument, match="which is a dynamic table"):
            ca.replicate([dataclasses.replace(record(), name="~table~v_is_a_table_too",
                                              kind=R.SPARSE)])
        with pytest.raises(InvalidArgument, match="which is a variable"):
            ca.replicate([dataclasses.replace(record(), name="w")])
        # A record that does not fit the copy's rows asks for the whole state.
        assert cb.replicate([record(ids=np.array([77], np.int64))]) == \
            [("~table~_t", 2, R.NEEDS_STATE)]
        rows = {"keys": np.zeros(0, np.int64), "values": np.zeros((0, 4), np.float32),
                "age_steps": np.zeros(0, np.int64), "age_seconds": np.zeros(0),
                "freq": np.zeros(0, np.int64)}
        for call in (lambda: cb.lookup("_t", np.arange(2)),
                     lambda: cb.update_table("_t", np.arange(1), np.ones((1, 4), np.float32)),
                     lambda: cb.import_table("_t", rows, 0)):
            with pytest.raises(NotPrimary, match="backup copy"):
                call()
        copy = dict(spec=table_spec(4, min_count=1), epoch=0, version=9, applied_ids=[])
        with pytest.raises(InvalidArgument, match="started"):
            cb.import_table("_t", rows, 0, reset=False, replica=copy)
        with pytest.raises(InvalidArgument, match="epoch"):
            cb.import_table("_t", rows, 0, replica=dict(copy, epoch=-1))
        assert state() == before
        cb.reconfigure([("~table~_t", PROMOTE, 3, None)])
        with pytest.raises(NotPrimary, match="superseded"):
            cb.import_table("_t", rows, 0, replica=dict(copy, epoch=1))
        assert cb.table_info("_t").rows == before[1]
        # the promoted copy takes the resent update once (its key came with the records)
        assert cb.update_table("_t", np.arange(3), np.ones((3, 4), np.float32),
                               update_id=5) == (0, 0)
        assert cb.get_meta("~table~_t").version == 2

        # A state copy in pieces: the copy keeps its rows and version until the
        # last piece arrives, and a copy that never completed is never promoted.
        def piece(name, keys, epoch, complete):
            req = tables_pb2.ImportTableRequest(name=name, reset=True, step=0)
            req.replica.CopyFrom(tables_pb2.ReplicaCopy(spec=table_spec(4, min_count=1),
                                                        epoch=epoch, version=40,
                                                        complete=complete))
            part = dict(rows, keys=keys, values=np.zeros((keys.size, 4), np.float32),
                        age_steps=np.zeros(keys.size, np.int64),
                        age_seconds=np.zeros(keys.size), freq=np.ones(keys.size, np.int64))
            for field in ("keys", "values", "age_steps", "age_seconds", "freq"):
                TP.fill(getattr(req, field), part[field])
            return cb._call(methods.TABLE_IMPORT, req)
        cb.reconfigure([("~table~_t", DEMOTE, 4, None)])
        held = cb.table_info("_t").rows
        piece("_t", np.arange(100, 103), 4, complete=False)
        assert (cb.get_meta("~table~_t").version, cb.table_info("_t").rows) == (2, held)
        piece("_t", np.arange(100, 103), 4, complete=True)
        assert (cb.get_meta("~table~_t").version, cb.table_info("_t").rows) == (40, 3)
        piece("_u", np.arange(5), 4, complete=False)
        with pytest.raises(FailedPrecondition, match="incomplete"):
            cb.reconfigure([("~table~_u", PROMOTE, 5, None)])
        # reserved and mismatched names
        with pytest.raises(InvalidArgument, match="_backup/"):
            ca.create_table("_backup/mine", 4)
        with pytest.raises(InvalidArgument, match="both"):
            ca.reconfigure([("~table~t", SET_BACKUP, 1, Peer(b.address, "w"))])
        with pytest.raises(InvalidArgument, match="counts"):
            ca.lookup("t", np.arange(2), counts=np.array([1, 2**31 + 1]))


def test_a_restarted_server_gets_its_table_copies_back_and_its_primaries_handed_back(tmp_path):
    """A server killed and restarted empty: its table shards fail over, and
    when it answers again each gets a copy there again (the primary copies
    its whole state) and the shards created primary there are handed back.
    Every acknowledged update counted once; copies bit-identical after."""
    keys = np.arange(40, dtype=np.int64)
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        t = strategy.create_embedding_table("count", 3, optimizer="adagrad",
                                            optimizer_params={"learning_rate": 1.0})
        with ClusterCoordinator(strategy, ps_check_interval=0.2, ps_failover_after=1.0) as coord:
            step = counting_step(t, keys)
            done = [coord.schedule(step) for _ in range(20)]
            cluster.kill_ps(0)   # restarted, empty
            done += [coord.schedule(step) for _ in range(20)]
            coord.fetch(done)
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=120)
            coord.fetch([coord.schedule(step) for _ in range(10)])
            coord.join()
            values = t.lookup(keys, admit=False)
            primaries = t.primaries()
        copies = _copies(cluster, t, tmp_path)
    # adagrad, lr 1, accumulator 0.1 + n: the n-th update of -1 adds 1/sqrt(0.1 + n)
    expected = sum(1 / np.sqrt(0.1 + n) for n in range(1, 51))
    np.testing.assert_allclose(values, np.full((40, 3), expected), rtol=1e-5)
    assert primaries == list(t.shards)   # handed back: the layout as created
    for version_p, version_b, rows_p, rows_b in copies:
        assert version_p == version_b and _same(rows_p, rows_b) and rows_p["keys"].size > 0


def test_an_update_waiting_at_a_sync_barrier_has_sent_its_earlier_records_already():
    """One push: an asynchronous update of table x, then a sync update of
    table y for step 1 while step 0 is still gathered (it waits there). x's
    record reaches its backup while the push waits, not once the barrier
    passes (records are queued for the call's one wait: psserver/core/
    replication.py send_all). Then step 0 completes and the push goes on."""
    import time

    from psserver.client.results import TableGradient
    from psserver.contract import BACKUP_PREFIX, SyncSpec
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        kw = dict(initializer="zeros", optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        x = strategy.create_embedding_table("x", 2, **kw)
        y = strategy.create_embedding_table("y", 2, **kw)
        keys = np.arange(64, dtype=np.int64)
        kx, ky = keys[x.shard_of(keys) == 0][:5], keys[y.shard_of(keys) == 0][:5]
        primary, backup = x.shards[0].address, x.backups[0].address
        assert primary != backup and y.shards[0].address == primary
        one = np.ones((5, 2), np.float32)
        with _client(cluster, primary) as c, _client(cluster, backup) as b:
            c.lookup("x", kx)
            c.lookup("y", ky)
            c.update_table("y", ky, one, sync=SyncSpec(0, 0, 2, 2))   # step 0: 1 of 2
            before = b.table_info(BACKUP_PREFIX + "x").step
            waiting = c.push_all_async(tables=[TableGradient("x", kx, one, 7, None),
                                               TableGradient("y", ky, one, 0,
                                                             SyncSpec(1, 0, 2, 2))])
            deadline = time.monotonic() + 30
            while b.table_info(BACKUP_PREFIX + "x").step == before:
                assert time.monotonic() < deadline, "x's record waited for the barrier"
                time.sleep(0.02)
            assert not waiting.done()   # (still at the barrier)
            c.update_table("y", ky, one, sync=SyncSpec(0, 1, 2, 2))   # step 0 complete
            assert waiting.result(timeout=30)[1][0][:2] == (5, 0)
            np.testing.assert_array_equal(c.lookup("x", kx, admit=False), -one)
            # a read likewise: new rows of x made, then a sync look-up of y for step 2
            # waiting while step 1 is gathered (replica 0's part came in the push above)
            from psserver.client.results import TableLookup
            rows = b.table_info(BACKUP_PREFIX + "x").rows
            new = keys[(x.shard_of(keys) == 0) & ~np.isin(keys, kx)][:3]
            reading = c.read_all_async(tables=[TableLookup("x", new, None, True),
                                               TableLookup("y", ky, None, True, sync_step=2)])
            while b.table_info(BACKUP_PREFIX + "x").rows == rows:
                assert time.monotonic() < deadline, "x's new rows waited for the barrier"
                time.sleep(0.02)
            assert not reading.done()
            c.update_table("y", ky, one, sync=SyncSpec(1, 1, 2, 2))   # step 1 complete
            assert reading.result(timeout=30)[2][1].shape == (5, 2)
