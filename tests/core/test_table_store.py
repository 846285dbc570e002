"""psserver.core.table_store: the dynamic tables' logic, in process (no processes,
no grpc): create, look up, update, sync steps, saves, imports, replication
of a shard to another store, and that a refused call changes nothing."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from psserver.contract import ROLE_BACKUP, Initializer, Peer, SyncSpec
from psserver.core import replication as R
from psserver.core.store import VariableStore
from psserver.core.table_config import TableConfig
from psserver.core.table_store import StateCopy, TableSpec, TableStore
from psserver.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    NotPrimary,
    PermissionDenied,
    ResourceExhausted,
)

SGD1 = dict(optimizer="sgd", optimizer_params={"learning_rate": 1.0})


def _stores(**kw) -> tuple[VariableStore, TableStore]:
    store = VariableStore(**kw)
    return store, TableStore.beside(store, describe_spec=lambda s: json.dumps(s.given.dim))


def _rows_of(tables: TableStore, name: str, keys) -> np.ndarray:
    return tables.lookup(name, np.asarray(keys), admit=False)


def _exported(tables: TableStore, name: str) -> dict:
    """A shard's rows, slots and counts (not its ages: clocks differ)."""
    state = tables.registry.table(name).table.export()
    return {k: v for k, v in state.items() if k != "age_seconds"}


def test_create_info_list_delete():
    store, tables = _stores()
    spec = TableSpec(TableConfig(dim=3), **SGD1)
    made = tables.create("t", spec)
    assert (made.name, made.rows, made.step, made.spec) == ("t", 0, 0, spec)
    assert tables.create("t", spec, exist_ok=True).spec == spec   # adopted
    with pytest.raises(AlreadyExists, match="another spec"):
        tables.create("t", TableSpec(TableConfig(dim=4)), exist_ok=True)
    with pytest.raises(AlreadyExists, match="exists"):
        tables.create("t", spec)
    tables.create("a", TableSpec(TableConfig(dim=1)))
    assert [s.name for s in tables.list()] == ["a", "t"]
    assert store.meta("~table~t").shape == (0, 3)   # replication's name reaches it
    assert tables.delete("t") and not tables.delete("t")
    with pytest.raises(NotFound, match="no dynamic table"):
        tables.info("t")


@pytest.mark.parametrize("name, spec, words", [
    ("_backup/t", TableSpec(TableConfig(dim=2)), "backup copies"),
    ("bad name", TableSpec(TableConfig(dim=2)), "invalid"),
    ("t", TableSpec(TableConfig(dim=0)), "dim"),
    ("t", TableSpec(TableConfig(dim=2), optimizer="nope"), "optimizer"),
    ("t", TableSpec(TableConfig(dim=2, policy="fifo")), "policy"),
    ("t", TableSpec(TableConfig(2, initializer=Initializer("constant", value=1e39))), "range"),
])
def test_bad_creates_are_refused_and_make_nothing(name, spec, words):
    store, tables = _stores()
    with pytest.raises(InvalidArgument, match=words):
        tables.create(name, spec)
    assert tables.list() == [] and store.registry.copies() == []


def test_look_up_and_update_and_resend():
    _, tables = _stores()
    tables.create("t", TableSpec(TableConfig(dim=2), **SGD1))
    np.testing.assert_array_equal(tables.lookup("t", np.array([[1, 2], [2, 3]])),
                                  np.zeros((2, 2, 2)))
    done = tables.update("t", np.array([1, 2, 9]), np.ones((3, 2), np.float32), update_id=5)
    assert (done.updated, done.dropped, done.step, done.late) == (2, 1, 1, False)
    again = tables.update("t", np.array([1, 2, 9]), np.ones((3, 2), np.float32), update_id=5)
    assert (again.updated, again.dropped, again.step) == (0, 0, 1)   # applied once
    np.testing.assert_array_equal(_rows_of(tables, "t", [1, 2, 3]), [[-1, -1], [-1, -1], [0, 0]])


def test_refused_calls_change_nothing():
    _, tables = _stores()
    tables.create("t", TableSpec(TableConfig(dim=2), **SGD1))
    tables.lookup("t", np.array([1]))
    before = tables.info("t")
    for call, err in [
        (lambda: tables.lookup("t", np.arange(100), max_reply_bytes=799), ResourceExhausted),
        (lambda: tables.lookup("t", np.array([1.5])), InvalidArgument),
        (lambda: tables.lookup("t", np.array([4]), counts=np.array([0])), InvalidArgument),
        (lambda: tables.lookup("t", np.array([4]), sync_step=-1), InvalidArgument),
        (lambda: tables.update("t", np.array([[1]]), np.ones((1, 2))), InvalidArgument),
        (lambda: tables.update("t", np.array([1]), np.full((1, 2), np.nan)), InvalidArgument),
        (lambda: tables.update("t", np.array([1]), np.ones((1, 3))), InvalidArgument),
        (lambda: tables.update("t", np.array([1]), np.ones((1, 2)),
                               sync=SyncSpec(0, 0, 1, 1, hybrid=True)), InvalidArgument),
        (lambda: tables.import_rows("t", {"keys": np.array([1])}, 0, False), InvalidArgument),
        (lambda: tables.lookup("u", np.array([1])), NotFound),
    ]:
        with pytest.raises(err):
            call()
    after = tables.info("t")
    assert (after.rows, after.step, after.stats) == (before.rows, before.step, before.stats)
    np.testing.assert_array_equal(_rows_of(tables, "t", [1]), [[0, 0]])


def test_an_admitting_look_up_builds_no_optimizer_slots(monkeypatch):
    """A row's bytes (the memory check of every admitting look-up) are the
    table's, computed once when it is made: a look-up makes no slots."""
    _, tables = _stores(max_bytes=1 << 30)
    tables.create("t", TableSpec(TableConfig(dim=4), optimizer="adam"))
    made = []
    optimizer = tables.registry.table("t").table.optimizer
    real = optimizer.create_slots
    monkeypatch.setattr(optimizer, "create_slots", lambda v: (made.append(v.shape), real(v))[1])
    for k in range(5):
        tables.lookup("t", np.arange(k * 10, k * 10 + 10))
    assert made == [] and tables.info("t").rows == 50


def test_a_sync_step_applies_once_when_every_replica_pushed():
    _, tables = _stores()
    tables.create("t", TableSpec(TableConfig(dim=1), **SGD1))
    tables.lookup("t", np.array([1, 2]))
    first = tables.update("t", np.array([1]), np.array([[2.0]]), sync=SyncSpec(0, 0, 2, 2))
    assert (first.updated, first.late, tables.info("t").sync_steps) == (0, False, 0)
    second = tables.update("t", np.array([1, 2]), np.array([[4.0], [2.0]]),
                           sync=SyncSpec(0, 1, 2, 2))
    assert (second.updated, second.late, tables.info("t").sync_steps) == (2, False, 1)
    np.testing.assert_array_equal(_rows_of(tables, "t", [1, 2]), [[-3.0], [-1.0]])   # means
    late = tables.update("t", np.array([1]), np.array([[1.0]]), sync=SyncSpec(0, 0, 2, 2))
    assert late.late and tables.info("t").late == 1
    tables.update("t", np.array([1]), np.array([[1.0]]), sync=SyncSpec(1, 0, 2, 2))
    with pytest.raises(DeadlineExceeded):   # step 1 has replica 0 only: step 2 waits
        tables.lookup("t", np.array([1]), sync_step=2, deadline=0.0)


def test_save_and_import_a_shard(tmp_path):
    store, tables = _stores(checkpoint_dirs=[str(tmp_path)])
    tables.create("t", TableSpec(TableConfig(dim=2), **SGD1))
    tables.lookup("t", np.array([1, 2, 3]))
    tables.update("t", np.array([2]), np.ones((1, 2), np.float32))
    saved = tables.save("t", str(tmp_path))
    assert (saved.file, saved.rows, saved.step, saved.incarnation) == \
        ("~table~t.safetensors", 3, 1, store.saver.incarnation)
    from safetensors import safe_open
    with safe_open(str(tmp_path / saved.file), "np") as f:
        meta, state = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert (meta["kind"], meta["save"], meta["spec"]) == ("dynamic_table", "full", "2")
    with pytest.raises(PermissionDenied):   # outside the checkpoint directories
        tables.save("t", str(tmp_path.parent))
    _, other = _stores()
    other.create("t", TableSpec(TableConfig(dim=2), **SGD1))
    assert other.import_rows("t", state, int(meta["step"]), reset=True) == 3
    np.testing.assert_array_equal(_rows_of(other, "t", [1, 2, 3]),
                                  _rows_of(tables, "t", [1, 2, 3]))


class Loopback(R.Forwarding):
    """Hands a shard's records and state copies to another in-process table
    store at once, as psserver.serve.forwarder would over the network."""

    def __init__(self, stores: dict):
        self.stores = stores

    def waker(self, replicator, var, peer):
        return lambda: self.flush(replicator, var)

    def flush(self, replicator, var):
        link = var.link
        if link is None:
            return
        store, tables = self.stores[link.peer.address]
        if link.needs_state:
            state = var.take_state(link)
            tables.import_copy(link.peer.name[len("~table~"):], state["rows"], state["step"],
                               True, StateCopy(state["spec"], state["epoch"], state["version"],
                                               True, state["applied_ids"], state["sync_steps"]))
            replicator.acknowledged(var, link, link.generation, state["version"], R.OK)
            return
        for _, version, status in store.replicator.replicate(link.records()):
            replicator.acknowledged(var, link, link.generation, version, status)


def _replicating() -> tuple[tuple, tuple]:
    """Two stores, "a" and "b", that hand each other records and state
    copies in process (Loopback): ((store a, its tables), (store b, ...))."""
    stores = {"a": _stores(), "b": _stores()}
    fwd = Loopback(stores)
    for store, _ in stores.values():
        store.replicator.forwarding = fwd
    return stores["a"], stores["b"]


def test_a_replicated_shard_and_its_backup_hold_the_same_rows():
    """The variables' Replicator runs a table shard's replication too: its
    state copy, then one record per call that changed rows (look-ups that
    made rows, updates), applied on the backup as the primary did."""
    (a, ta), (b, tb) = _replicating()
    spec = TableSpec(TableConfig(dim=2, capacity=4), **SGD1)
    ta.create("t", spec)
    ta.lookup("t", np.array([1, 2]))
    a.replicator.set_backup("~table~t", Peer("b", "~table~_t"), epoch=0)
    assert tb.info("_t").spec == spec and b.meta("~table~_t").role == ROLE_BACKUP
    ta.lookup("t", np.array([3, 4, 5]))   # made rows, evicted one
    ta.update("t", np.array([1, 5]), np.ones((2, 2), np.float32), update_id=9)
    mine, copy = _exported(ta, "t"), _exported(tb, "_t")
    assert set(mine) == set(copy) and mine["keys"].size == 4   # at capacity
    for k in mine:
        np.testing.assert_array_equal(copy[k], mine[k], err_msg=k)
    assert b.meta("~table~_t").version == a.meta("~table~t").version
    with pytest.raises(NotPrimary):   # a backup takes no client calls
        tb.update("_t", np.array([1]), np.ones((1, 2), np.float32))
    b.replicator.promote("~table~_t", epoch=1)   # a failover: the backup takes over
    with pytest.raises(NotPrimary, match="superseded"):   # the old primary's state: refused
        tb.import_copy("_t", {"keys": np.zeros(0, np.int64)}, 0, True,
                       StateCopy(spec, epoch=0, version=0, complete=True))
    tb.update("_t", np.array([1]), np.ones((1, 2), np.float32), update_id=9)   # a resend
    np.testing.assert_array_equal(_rows_of(tb, "_t", [1]), _rows_of(ta, "t", [1]))


def test_an_import_can_give_the_shard_its_part_of_the_tables_capacity():
    """A restore into another layout gives each shard room for the rows it
    restores (its part of the whole table's capacity): set before the rows
    go in (none evicted), reported, copied to the backup, kept by an
    exist_ok create; a refused import leaves the capacity as it was."""
    (a, ta), (_, tb) = _replicating()
    spec = TableSpec(TableConfig(dim=2, capacity=4), **SGD1)
    ta.create("t", spec)
    a.replicator.set_backup("~table~t", Peer("b", "~table~_t"), epoch=0)
    ta.lookup("t", np.arange(4))
    state = ta.registry.table("t").table.export()
    state = {k: (v if np.ndim(v) == 0 else np.concatenate([v, v])) for k, v in state.items()}
    state["keys"] = np.arange(8)
    assert ta.import_rows("t", state, 0, True, capacity=8) == 8   # none evicted
    assert ta.info("t").spec.given.capacity == 8 == tb.info("_t").spec.given.capacity
    assert ta.registry.table("t").table.pending.limit == 32   # admission's default: 4x
    assert ta.create("t", spec, exist_ok=True).spec.given.capacity == 8
    bad = dict(state, values=np.full((8, 2), np.nan, np.float32))
    for call, error in ((lambda: ta.import_rows("t", bad, 0, True, capacity=3), InvalidArgument),
                        (lambda: ta.import_rows("t", state, 0, False, capacity=3),
                         InvalidArgument),   # only with reset
                        (lambda: ta.import_rows("t", state, 0, True, capacity=-1),
                         InvalidArgument)):
        with pytest.raises(error):
            call()
        assert ta.info("t").spec.given.capacity == 8 and len(ta.registry.table("t").table) == 8
        assert ta.registry.table("t").table.config.capacity == 8
    assert ta.import_rows("t", state, 0, True, capacity=5) == 5   # fewer: the policy evicts


def test_a_state_copy_arrives_in_pieces_and_an_incomplete_one_cannot_be_promoted():
    store, tables = _stores()
    spec = TableSpec(TableConfig(dim=1), **SGD1)
    rows = {"keys": np.array([1, 2]), "values": np.ones((2, 1), np.float32),
            "age_steps": np.zeros(2, np.int64), "age_seconds": np.zeros(2),
            "freq": np.ones(2, np.int64)}
    half = {k: v[:1] for k, v in rows.items()}
    rest = {k: v[1:] for k, v in rows.items()}
    with pytest.raises(InvalidArgument, match="reset"):   # a later piece first
        tables.import_copy("c", rest, 0, False, StateCopy(spec, 2, 7, True))
    assert tables.import_copy("c", half, 0, True, StateCopy(spec, 2, 7, False)) == 1
    with pytest.raises(FailedPrecondition, match="incomplete"):
        store.replicator.promote("~table~c", epoch=3)
    assert tables.import_copy("c", rest, 0, False, StateCopy(spec, 2, 7, True, [4])) == 2
    meta = store.meta("~table~c")
    assert (meta.role, meta.epoch, meta.version) == (ROLE_BACKUP, 2, 7)
    assert store.registry.table("c").applied == collections.OrderedDict({4: 0})
    store.replicator.promote("~table~c", epoch=3)
    np.testing.assert_array_equal(_rows_of(tables, "c", [1, 2]), [[1.0], [1.0]])


@pytest.mark.parametrize("kind", ["table", "variable"])
def test_a_sync_step_counts_the_whole_buffers_its_gathered_rows_keep(kind):
    """Issue 33 item 3: a sync update's rows as received are views of their
    request's buffer, which can be larger than they are (a large frame's
    buffer is rounded up to its size class: psserver/link/buffers.py). Rows
    that fill nearly all of their buffer (sync.KEEP_SHARE) are kept as they
    are and the whole buffer counts, against --max-memory-bytes and in the
    bytes reported, each buffer once (keys and rows of one request share
    theirs); any others are copied out and count as themselves."""
    from psserver.contract import SyncSpec
    store, tables = _stores(max_bytes=8 << 20)
    if kind == "table":
        tables.create("t", TableSpec(TableConfig(dim=4), **SGD1))
    else:
        store.create("w", "float32", (100, 4))

    def request(n: int, room: int) -> tuple[np.ndarray, np.ndarray]:
        """n keys and their rows, views of one buffer with ``room`` bytes more."""
        buf = np.zeros(n * 8 + n * 16 + room, np.uint8)
        keys = buf[:n * 8].view(np.int64)
        keys[:] = np.arange(n) % 100
        return keys, buf[n * 8:n * 24].view(np.float32).reshape(n, 4)

    def push(replica: int, keys, rows) -> None:
        spec = SyncSpec(0, replica, 100, 100)
        if kind == "table":
            tables.update("t", keys, rows, sync=spec)
        else:
            store.steps.push_rows("w", keys, rows, spec)

    def held() -> int:
        return tables.info("t").bytes if kind == "table" else store.total_bytes()

    def parts() -> list:
        copy = tables.registry.table("t") if kind == "table" else store.registry.variable("w")
        return copy.acc.parts
    before = held()
    whole = 2_640_000 + (256 << 10)                 # 2.64 MB of keys and rows, 256 KiB more
    first = request(110_000, 256 << 10)
    push(0, *first)
    assert held() - before == whole                 # kept as it came: the buffer, once
    assert all(np.shares_memory(a, b) for a, b in zip(parts()[-1], first))
    push(1, *request(110_000, 256 << 10))
    assert held() - before == 2 * whole
    with pytest.raises(ResourceExhausted, match="sync step 0"):   # 3 buffers > 8 MiB
        push(2, *request(110_000, 256 << 10))
    assert len(parts()) == 2 and held() - before == 2 * whole     # nothing changed
    was = held()
    small = request(50, 6 << 20)                    # 1,200 bytes in a 6 MiB request: copied
    push(3, *small)
    assert held() - was == 1200
    assert not any(np.shares_memory(a, b) for a in parts()[-1] for b in small)
    loose = request(50_000, 600_000)                # 1.2 MB in 1.8 MB: copied too
    push(4, *loose)
    assert held() - was == 1200 + 1_200_000
    from psserver.core.sync import buffer_bytes
    assert buffer_bytes(first) == whole
    assert buffer_bytes(list(request(50, 0))) == 1200


def test_two_tables_updated_by_one_request_count_its_buffer_once():
    """Sync updates of two tables in one request's buffer (the data port's
    frames carry a whole push): each table's rows are copied out, so the
    server counts what it keeps, not the buffer once per table (a review
    found 2x: the second table refused at half the limit)."""
    from psserver.contract import SyncSpec, TableWrite
    store, tables = _stores(max_bytes=8 << 20)
    for name in ("a", "b"):
        tables.create(name, TableSpec(TableConfig(dim=4), **SGD1))
    n = 100_000
    buf = np.zeros(2 * n * 24, np.uint8)            # 4.8 MB: both tables' keys and rows
    writes = []
    for i, name in enumerate(("a", "b")):
        at = i * n * 24
        keys = buf[at:at + n * 8].view(np.int64)
        keys[:] = np.arange(n)
        rows = buf[at + n * 8:at + n * 24].view(np.float32).reshape(n, 4)
        writes.append(TableWrite(name, keys, rows, sync=SyncSpec(0, 0, 2, 2)))
    before = sum(tables.info(t).bytes for t in ("a", "b"))
    tables.update_all(writes)                       # 4.8 MB gathered, under the 8 MiB limit
    assert sum(tables.info(t).bytes for t in ("a", "b")) - before == 2 * n * 24
