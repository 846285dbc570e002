"""Change tracking for incremental saves (psserver/core/tracking.py, saving.py),
in process: a parameter server's store writes its files to a directory and
the coordinator's reader (coordinator/checkpoint_files.py) composes them;
every composed state must be the store's state at that save, bit for bit,
whatever failed, crashed or was committed in between.
"""
from __future__ import annotations

import os
import types

import numpy as np
import pytest

from coordinator.checkpoint_files import advance_shard, advance_table_shard
from psserver.contract import ROLE_BACKUP
from psserver.core.saving import DELTA, FULL, UNCHANGED
from psserver.core.store import VariableStore
from psserver.core.tracking import MAX_POINTS, ChangeLog, Interval
from psserver.errors import FailedPrecondition, InvalidArgument


def _rows(n, *ids):
    a = np.zeros(n, bool)
    a[list(ids)] = True
    return Interval(touched=True, rows=a)


def _ids(interval):
    return None if interval is None else set(np.flatnonzero(interval.rows).tolist())


def test_a_change_log_answers_the_union_since_a_point_and_forgets_only_on_commit():
    log = ChangeLog()
    assert log.take(1, "a", 0, _rows(8, 0)) is None            # no base: whole
    assert _ids(log.take(2, "a", 1, _rows(8, 1))) == {1}
    assert _ids(log.take(3, "a", 1, _rows(8, 2))) == {1, 2}    # save 2 failed: taken again
    assert log.commit(3, "a")
    assert log.take(4, "a", 1, _rows(8, 3)) is None            # before the committed point
    assert _ids(log.take(5, "a", 3, _rows(8, 4))) == {3, 4}
    assert not log.commit(99, "a")                             # unknown: nothing changed
    assert [p[0] for p in log.points] == [3, 4, 5]


def test_two_streams_never_forget_each_others_changes():
    log = ChangeLog()
    log.take(1, "ckpt", 0, _rows(8))
    log.commit(1, "ckpt")
    log.take(2, "export", 0, _rows(8, 5))
    log.commit(2, "export")
    log.take(3, "export", 2, _rows(8, 6))
    log.commit(3, "export")
    assert _ids(log.take(4, "ckpt", 1, _rows(8, 7))) == {5, 6, 7}
    assert _ids(log.take(5, "export", 3, _rows(8))) == {7}


def test_too_many_uncommitted_points_merge_into_supersets_never_subsets():
    log = ChangeLog()
    log.take(1, "a", 0, _rows(64))
    log.commit(1, "a")
    for i in range(2, 2 * MAX_POINTS):
        log.take(i, "a", 1, _rows(64, i))
    assert len(log.points) <= MAX_POINTS and log.points[0][0] == 1
    assert _ids(log.take(100, "a", 1, _rows(64))) == set(range(2, 2 * MAX_POINTS))
    latest = log.points[-2][0]   # a point kept: since it, exactly what came after
    assert _ids(log.take(101, "a", latest, _rows(64, 63))) == {63}


def test_a_save_id_taken_again_counts_as_one_point():
    log = ChangeLog()
    log.take(1, "a", 0, _rows(4))
    log.commit(1, "a")
    log.take(2, "a", 1, _rows(4, 0))
    assert _ids(log.take(2, "a", 1, _rows(4, 1))) == {0, 1}
    assert [p[0] for p in log.points] == [1, 2]


# -- a store's saves composed by the coordinator's reader ---------------------------------
class _Saves:
    """Saves of one store into numbered directories, composed back."""

    def __init__(self, store, root, stream="s"):
        self.store, self.root, self.stream = store, root, stream
        self.n = 0
        self.committed = 0           # the base the next save asks about
        self.chain: list = []        # (dir, {name: SavedShard}) since the last base

    def save(self, *, fail: bool = False):
        self.n += 1
        d = os.path.join(self.root, f"s{self.n}")
        os.makedirs(d)
        saver = self.store.saver
        spec = saver.begin_save(self.n, self.committed, saver.incarnation, self.stream)
        saved = {s.name: s for s in self.store.saver.save(d, (), spec)}
        if not fail:
            self.store.saver.commit_save(self.n, self.stream, self.store.saver.incarnation)
            self.committed = self.n
            self.chain.append((d, saved))
        return spec, saved

    def compose(self, name):
        var = self.store.registry.variable(name)
        v = types.SimpleNamespace(name=name, dtype=var.value.dtype.name, shape=var.value.shape,
                                  optimizer=var.optimizer.name)
        full = max(i for i, (_, s) in enumerate(self.chain) if s[name].kind == FULL)
        tensors = meta = None
        for d, saved in self.chain[full:]:
            s = saved[name]
            entry = {"name": name, "file": s.file, "rows": var.value.shape[0] if
                     var.value.shape else 0, "version": s.version, "bytes": s.bytes,
                     "kind": {FULL: "full", DELTA: "delta", UNCHANGED: "unchanged"}[s.kind],
                     "delta_rows": s.rows}
            tensors, meta = advance_shard(tensors, meta, d, entry, v, False)
        return tensors


def _state(store, name):
    var = store.registry.variable(name)
    return {"value": var.value, **{f"slot/{k}": a for k, a in var.slots.items()},
            "applied_ids": np.fromiter(var.applied, np.uint64, len(var.applied))}


def _assert_same(got, want):
    assert set(got) == set(want)
    for k in want:
        assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "ftrl", "momentum"])
def test_random_updates_saves_and_failures_compose_to_the_state_bit_for_bit(tmp_path, optimizer):
    """Dense, sparse and assigned updates, saves that fail (never committed,
    as when the coordinator dies before the rename), each save composed from
    the last full file and the deltas after it equals the store's state."""
    store = VariableStore()
    rng = np.random.default_rng(7)
    store.create("emb", "float32", (50, 3), optimizer=optimizer)
    store.create("dense", "float32", (4,), optimizer=optimizer)
    store.create("scalar", "float32", (), optimizer=optimizer)
    saves = _Saves(store, str(tmp_path))
    kinds = set()
    uid = 0
    for step in range(40):
        uid += 1
        op = rng.integers(0, 10)
        if op < 6:
            ids = rng.choice(50, rng.integers(0, 4), replace=False)
            rows = rng.normal(size=(ids.size, 3)).astype(np.float32)
            store.push(sparse=[("emb", ids, rows, uid)])
        elif op < 8:
            store.push([("dense", rng.normal(size=4).astype(np.float32), uid)])
        else:
            store.assign([("scalar", np.float32(rng.normal()))])
        if step % 3 == 2:
            failed = rng.random() < 0.3
            _, saved = saves.save(fail=failed)
            kinds |= {s.kind for s in saved.values()}
            if not failed:
                for name in ("emb", "dense", "scalar"):
                    _assert_same(saves.compose(name), _state(store, name))
    assert kinds == {FULL, DELTA, UNCHANGED}
    delta_rows = [s.rows for _, saved in saves.chain for s in saved.values() if s.kind == DELTA]
    assert max(delta_rows) < 50   # deltas hold the rows changed, not the variable


def test_sync_steps_row_wise_and_dense_are_in_the_deltas(tmp_path):
    """Issue 33 item 12(a): a sync step's row-wise push that the tracker did
    not mark would be lost by every incremental checkpoint after it, and no
    test pushed in sync mode between saves. Two replicas a step, saved
    between steps: each delta composes to the state bit for bit, and a
    row-wise step's delta holds exactly its rows."""
    from psserver.contract import SyncSpec
    store = VariableStore()
    store.create("emb", "float32", (50, 3), optimizer="adagrad")
    store.create("dense", "float32", (4,), optimizer="adam")
    saves = _Saves(store, str(tmp_path))
    saves.save()
    rng = np.random.default_rng(3)
    for step in range(6):
        touched = set()
        for replica in range(2):
            spec = SyncSpec(step, replica, 2, 2)
            ids = rng.choice(50, 3, replace=False)
            touched |= set(ids.tolist())
            store.steps.push_rows("emb", ids, rng.normal(size=(3, 3)).astype(np.float32), spec)
            store.steps.push([("dense", rng.normal(size=4).astype(np.float32))], spec)
        _, saved = saves.save()
        assert saved["emb"].kind == DELTA and saved["emb"].rows == len(touched)
        for name in ("emb", "dense"):
            _assert_same(saves.compose(name), _state(store, name))


def test_a_base_this_incarnation_never_took_is_refused_and_another_incarnations_gets_full(
        tmp_path):
    store = VariableStore()
    store.create("w", "float32", (4, 2))
    store.saver.begin_save(1, 0, "", "s")
    store.saver.save(str(tmp_path))
    store.saver.commit_save(1, "s", store.saver.incarnation)
    with pytest.raises(FailedPrecondition, match="unknown"):
        store.saver.begin_save(2, 77, store.saver.incarnation, "s")
    assert 2 not in store.saver._saves   # refused: nothing noted
    spec = store.saver.begin_save(3, 1, "another-incarnation", "s")
    assert spec.since == 0          # a restarted server's base: written whole
    store.push(sparse=[("w", np.array([1]), np.ones((1, 2), np.float32), 0)])
    assert [s.kind for s in store.saver.save(str(tmp_path), (), spec)] == [FULL]
    for bad in (dict(save_id=0, since=1), dict(save_id=5, since=5),
                dict(save_id=-1), dict(save_id=1 << 64), dict(save_id=4, stream="x" * 200),
                dict(save_id=4, stream="tab\t"), dict(save_id=4, incarnation="i" * 65)):
        with pytest.raises(InvalidArgument):
            store.saver.begin_save(**bad)


def test_a_commit_of_an_unknown_save_or_incarnation_changes_nothing(tmp_path):
    store = VariableStore()
    store.create("w", "float32", (4, 2))
    store.saver.save(str(tmp_path), (), store.saver.begin_save(1, 0, "", "s"))
    points = [p[0] for p in store.registry.variable("w").tracker.log.points]
    here = store.saver.incarnation
    for save_id, stream, inc, err in ((2, "s", here, FailedPrecondition),
                                      (1, "s", "other", FailedPrecondition),
                                      (1, "other-stream", here, InvalidArgument),
                                      (0, "s", here, InvalidArgument)):
        with pytest.raises(err):
            store.saver.commit_save(save_id, stream, inc)
    assert [p[0] for p in store.registry.variable("w").tracker.log.points] == points
    assert store.registry.variable("w").tracker.log.anchors == {}
    assert store.saver.commit_save(1, "s", store.saver.incarnation) == (1, 0)


def test_a_restored_promoted_or_replaced_copy_is_saved_whole_next(tmp_path):
    store = VariableStore()
    store.create("w", "float32", (4, 2))
    saves = _Saves(store, str(tmp_path))
    saves.save()

    def next_kind():
        store.push(sparse=[("w", np.array([0]), np.ones((1, 2), np.float32), 0)])
        return saves.save()[1]["w"].kind
    assert next_kind() == DELTA
    store.create("w", "float32", (4, 2), initial_value=np.ones((4, 2), np.float32),
                 overwrite=True)                                # a restore
    assert next_kind() == FULL
    assert next_kind() == DELTA
    var = store.registry.variable("w")
    with var.lock:
        var.role = ROLE_BACKUP
    store.replicator.promote("w", epoch=1)                                 # a failover
    assert next_kind() == FULL


def _table_servicer(tmp_path, **spec):
    """(a TableServicer holding table "t" of dim 2 and ``spec``, lookup(keys),
    save(save_id, since) -> (reply, its directory): saved and committed on
    stream "s")."""
    from protos.pstrain.v1 import tables_pb2
    from psserver.core.table_store import TableStore
    from psserver.link.tensor_proto import fill
    from psserver.serve.tables import TableServicer

    store = VariableStore()
    tables = TableServicer(TableStore.beside(store), 1 << 26)
    tables.Create(tables_pb2.CreateTableRequest(name="t", spec=tables_pb2.TableSpec(
        dim=2, **spec)), None)

    def lookup(keys):
        req = tables_pb2.LookupRequest(name="t")
        fill(req.keys, keys)
        tables.Lookup(req, None)

    def save(n, since):
        d = tmp_path / f"s{n}"
        d.mkdir()
        reply = tables.Save(tables_pb2.SaveTableRequest(
            name="t", directory=str(d), save_id=n, since=since, stream="s",
            incarnation=store.saver.incarnation), None)
        store.saver.commit_save(n, "s", store.saver.incarnation)
        return reply, str(d)
    return tables, lookup, save


def _entry_of(reply) -> dict:
    """A table Save reply as a manifest entry (coordinator.checkpoint_files)."""
    return {"file": reply.file, "rows": reply.rows, "bytes": reply.bytes,
            "kind": "delta" if reply.kind == DELTA else "full"}


def test_table_shards_track_made_updated_looked_up_and_evicted_keys(tmp_path):
    """A dynamic table shard's deltas through the DynamicTables service (in
    process): made, updated, looked-up rows and evicted keys; composed with
    the reader's merge they equal a full export of the shard."""
    from protos.pstrain.v1 import ps_pb2, tables_pb2
    from psserver.link.tensor_proto import fill

    tables, lookup, save = _table_servicer(tmp_path, capacity=30,
                                           optimizer=ps_pb2.OptimizerSpec(name="adam"))
    t = types.SimpleNamespace(name="t", dim=2, dtype="float32", optimizer="adam")
    rng = np.random.default_rng(1)
    shard = None
    since = 0
    deltas = []
    for n in range(1, 9):
        keys = rng.integers(0, 60, 12)
        lookup(keys)
        upd = tables_pb2.TableUpdateRequest(name="t", update_id=n)
        fill(upd.keys, np.unique(keys)[:5])
        fill(upd.grads, np.ones((min(5, np.unique(keys).size), 2), np.float32))
        tables.Update(upd, None)
        reply, d = save(n, since)
        since = n
        shard = advance_table_shard(shard, d, _entry_of(reply), t, False)
        if reply.kind == DELTA:
            deltas.append((reply.rows, reply.evicted))
        entry_now = tables.store.registry.table("t")
        want = entry_now.table.export(now=shard[2])
        for k, a in want.items():
            if k == "age_seconds":
                np.testing.assert_allclose(shard[0][k], a, atol=1e-6)
            else:
                assert shard[0][k].tobytes() == a.tobytes(), (n, k)
    assert all(rows < 30 for rows, _ in deltas) and sum(e for _, e in deltas) > 0


def test_one_streams_many_saves_never_make_a_server_forget_anothers(tmp_path, monkeypatch):
    from psserver.core import saving
    monkeypatch.setattr(saving, "SAVES_KEPT", 4)
    store = VariableStore()
    store.create("w", "float32", (4, 2))
    store.saver.save(str(tmp_path), (), store.saver.begin_save(1, 0, "", "ckpt"))
    for i in range(2, 30):   # an export's many saves
        store.saver.begin_save(i, 0, "", "export")
    assert store.saver.begin_save(100, 1, store.saver.incarnation, "ckpt").since == 1
    for i in range(101, 106):   # the checkpoint stream's own: its oldest goes
        store.saver.begin_save(i, 0, "", "ckpt")
    with pytest.raises(FailedPrecondition, match="unknown"):
        store.saver.begin_save(200, 1, store.saver.incarnation, "ckpt")


def test_a_churning_table_keeps_a_bounded_count_of_evicted_keys_and_counts_them(tmp_path):
    """Tracking started (one save point) and then no save for a long time:
    a table shard that evicts 200,000 keys keeps at most a bounded number of
    them (past that its next save writes it whole), counts what it keeps in
    its bytes, and every save still composes to the shard's state."""
    from psserver.core.tracking import MIN_EVICTED_KEPT

    tables, lookup, save = _table_servicer(tmp_path, capacity=1000)
    table = tables.store.registry.table("t").table
    spec = types.SimpleNamespace(name="t", dim=2, dtype="float32", optimizer="sgd")

    def saved(n, since):
        reply, d = save(n, since)
        return reply, _entry_of(reply), d

    lookup(np.arange(1000))
    reply, entry, d = saved(1, 0)
    shard = advance_table_shard(None, d, entry, spec, False)
    untracked = table.nbytes - table.tracker.nbytes
    limit = max(table.value.shape[0], MIN_EVICTED_KEPT)
    most = 0
    for i in range(1, 201):   # 1,000 new keys a look-up: 200,000 evictions in all
        lookup(np.arange(1000 * i, 1000 * (i + 1)))
        kept = sum(a.size for a in table.tracker.evicted)
        most = max(most, kept)
        assert table.nbytes >= untracked + table.tracker.dirty.nbytes + 8 * kept
    assert table.stats.evicted_capacity == 200_000
    assert most <= 2 * limit and table.tracker.nbytes < 100 * limit
    reply, entry, d = saved(2, 1)
    assert reply.kind == FULL   # more evictions than it keeps: written whole
    shard = advance_table_shard(shard, d, entry, spec, False)
    lookup(np.arange(500_000, 500_010))
    reply, entry, d = saved(3, 2)
    assert reply.kind == DELTA and reply.rows == 10 and reply.evicted == 10
    shard = advance_table_shard(shard, d, entry, spec, False)
    want = table.export(now=shard[2])
    for k in ("keys", "values", "freq", "age_steps"):
        assert shard[0][k].tobytes() == want[k].tobytes(), k


def test_a_variables_tracking_is_bounded_per_row_and_counted_in_what_the_server_holds(tmp_path):
    store = VariableStore()
    store.create("w", "float32", (1000, 1))
    for n in range(1, 3 * MAX_POINTS):   # never committed: every point kept, up to the bound
        store.push(sparse=[("w", np.array([n]), np.ones((1, 1), np.float32), 0)])
        spec = store.saver.begin_save(n, n - 1, store.saver.incarnation, "s")
        store.saver.save(str(tmp_path), (), spec)
    tracker = store.registry.variable("w").tracker
    assert 1000 * MAX_POINTS <= tracker.nbytes <= 1000 * (1 + MAX_POINTS)
    var = store.registry.variable("w")   # (total_bytes: what the variables hold, tracking too)
    assert store.budget.held() == store.total_bytes() == \
        var.value.nbytes + var.slot_nbytes + tracker.nbytes


def _half_way(optimizer, method):
    """Make ``optimizer.method`` change its rows' values, then fail (a bug
    half-way through an apply)."""
    def broken(value, slots, *args):
        value[...] += 1
        raise RuntimeError("a bug half-way")
    setattr(optimizer, method, broken)


@pytest.mark.parametrize("sparse", [False, True])
def test_a_sync_step_that_fails_half_way_is_saved_whole_next(tmp_path, sparse):
    """A sync step's apply that fails after changing values: the changes
    it made are in no tracker, so the next incremental save must write the
    variable whole (as the asynchronous paths do), not a delta without them."""
    from psserver.contract import SyncSpec

    store = VariableStore()
    store.create("w", "float32", (4, 2))
    saves = _Saves(store, str(tmp_path))
    saves.save()
    var = store.registry.variable("w")
    _half_way(var.optimizer, "apply_sparse" if sparse else "apply_dense")
    with pytest.raises(RuntimeError, match="half-way"):
        if sparse:
            store.steps.push_rows("w", np.array([1]), np.ones((1, 2), np.float32),
                                   SyncSpec(0, 0, 1, 1))
        else:
            store.steps.push([("w", np.ones((4, 2), np.float32))], SyncSpec(0, 0, 1, 1))
    _, saved = saves.save()
    assert saved["w"].kind == FULL
    _assert_same(saves.compose("w"), _state(store, "w"))


def test_a_tables_sync_step_that_fails_half_way_is_saved_whole_next(tmp_path):
    from protos.pstrain.v1 import ps_pb2, tables_pb2
    from psserver.link.tensor_proto import fill

    tables, lookup, save = _table_servicer(tmp_path)
    lookup(np.arange(4))
    assert save(1, 0)[0].kind == FULL
    _half_way(tables.store.registry.table("t").table.optimizer, "apply_sparse")
    upd = tables_pb2.TableUpdateRequest(name="t", sync=ps_pb2.SyncInfo(
        step=0, replica=0, num_replicas=1, required=1))
    fill(upd.keys, np.array([1]))
    fill(upd.grads, np.ones((1, 2), np.float32))
    with pytest.raises(RuntimeError, match="half-way"):
        tables.Update(upd, None)
    assert save(2, 1)[0].kind == FULL
