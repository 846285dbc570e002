"""psserver.core.shards: the registry of every shard copy on a server, the rules
both kinds of copy share (CopyState), and the one memory budget the
variable store and the table store both check (in process: no processes,
no grpc)."""
from __future__ import annotations

import numpy as np
import pytest

from psserver.contract import BACKUP_PREFIX, ROLE_BACKUP, ROLE_PRIMARY, Peer, SyncSpec
from psserver.core.replication import Link
from psserver.core.shards import CopyState, MemoryBudget, ShardRegistry, check_name
from psserver.core.store import VariableStore
from psserver.core.table_config import TableConfig
from psserver.core.table_store import TableSpec, TableStore
from psserver.errors import InvalidArgument, NotFound, NotPrimary, ResourceExhausted


class Copy(CopyState):
    """A bare copy: the shared rules only."""

    def __init__(self, name: str, nbytes: int = 0, is_table: bool = False):
        self.name, self.nbytes, self.is_table = name, nbytes, is_table
        self.role, self.epoch, self.link, self.draining = ROLE_PRIMARY, 0, None, False
        self.version, self.applied = 0, {}

    @property
    def held_bytes(self) -> int:
        return self.nbytes


def test_variables_and_table_shards_are_apart_by_replication_name():
    reg = ShardRegistry()
    w, t = Copy("w"), Copy("~table~w", is_table=True)
    assert reg.add(w) is w and reg.add(t) is t
    assert reg.variable("w") is w and reg.table("w") is t
    assert reg.find("w") is w and reg.find("~table~w") is t
    assert reg.copy("~table~w") is t and reg.copy("w") is w
    with pytest.raises(NotFound, match="no variable"):
        reg.variable("~table~w")   # a table shard's name is no variable's
    with pytest.raises(NotFound, match="no dynamic table"):
        reg.copy("~table~x")
    assert reg.find("x") is None and reg.find("~table~x") is None
    assert reg.copies() == [w, t] and reg.variables() == [w] and reg.tables() == [t]
    assert reg.variable_count() == 1


def test_add_never_replaces_and_remove_takes_only_the_registered_copy():
    reg = ShardRegistry()
    first, second = Copy("w"), Copy("w")
    assert reg.add(first) is first
    assert reg.add(second) is first          # lost the race: the first stays
    assert not reg.remove(second)            # not the registered one: nothing removed
    assert reg.variable("w") is first
    assert reg.remove(first) and reg.find("w") is None
    assert not reg.remove(first)             # a second remove: nothing


def test_check_name():
    assert check_name("dense/kernel/part_0") == "dense/kernel/part_0"
    for bad in ("", "a b", "~table~t", "x" * 257, 7, None):
        with pytest.raises(InvalidArgument, match="invalid variable name"):
            check_name(bad)


@pytest.mark.parametrize("kind", ["variable", "table"])
def test_a_name_no_save_could_write_is_refused_at_create(kind, tmp_path):
    """Issue 33 item 8: a name whose checkpoint file (its backup's, its table
    shard's) would pass 255 bytes was accepted, and every save then failed.
    The longest accepted name saves, as a variable and as a table, and as
    the backup copy's name."""
    from psserver.core.store import VariableStore
    from psserver.core.table_config import TableConfig
    from psserver.core.table_store import TableSpec, TableStore
    longest = "x/" * 56 + "xy"       # 114 characters, quoted 226 bytes: 255 with prefixes
    assert check_name(longest) == longest
    for bad in ("a" * 227, "/" * 76, longest + "c"):
        with pytest.raises(InvalidArgument, match="over the 255 a filesystem takes"):
            check_name(bad)
    store = VariableStore(checkpoint_dirs=[str(tmp_path)])
    tables = TableStore.beside(store)
    assert check_name(BACKUP_PREFIX + longest)   # its backup copy's name
    for name in (longest, BACKUP_PREFIX + longest)[:2 if kind == "variable" else 1]:
        if kind == "variable":
            store.create(name, "float32", [2])
            (saved,) = store.saver.save(str(tmp_path), [name])
        else:
            tables.create(name, TableSpec(TableConfig(dim=2)))
            saved = tables.save(name, str(tmp_path))
        assert (tmp_path / saved.file).is_file() and len(saved.file) <= 255
    with pytest.raises(InvalidArgument, match="255"):
        store.create(longest + "c", "float32", [2]) if kind == "variable" else \
            tables.create(longest + "c", TableSpec(TableConfig(dim=2)))


@pytest.mark.parametrize("role, epoch, fenced, offered, accepted", [
    (ROLE_BACKUP, 3, False, 3, True),      # a backup takes its primary's state again
    (ROLE_BACKUP, 3, False, 4, True),      # ... or a newer primary's
    (ROLE_BACKUP, 3, False, 2, False),     # never an older epoch's
    (ROLE_PRIMARY, 3, False, 3, False),    # a primary of the same epoch is not replaced
    (ROLE_PRIMARY, 3, True, 3, True),      # ... unless it was superseded (fenced)
    (ROLE_PRIMARY, 3, False, 4, True),     # a newer epoch replaces a primary
])
def test_a_state_copy_is_accepted_by_one_rule_for_both_kinds(role, epoch, fenced, offered,
                                                             accepted):
    for copy in (Copy("w"), Copy("~table~t", is_table=True)):
        copy.role, copy.epoch = role, epoch
        if fenced:
            copy.link = Link(Peer("b:1", "_w"), lambda: None)
            copy.link.fenced = True
        if accepted:
            copy.accept_state_copy(offered)
        else:
            with pytest.raises(NotPrimary, match="superseded primary"):
                copy.accept_state_copy(offered)


def test_a_backup_or_draining_copy_takes_no_client_updates():
    copy = Copy("w")
    copy.check_primary()
    copy.draining = True
    with pytest.raises(NotPrimary, match="handing over"):
        copy.check_primary()
    copy.draining, copy.role = False, ROLE_BACKUP
    with pytest.raises(NotPrimary, match="backup copy"):
        copy.check_primary()


def test_update_keys_are_remembered_oldest_forgotten_first(monkeypatch):
    import collections
    copy = Copy("w")
    copy.applied = collections.OrderedDict()
    monkeypatch.setattr(Copy, "APPLIED_IDS_KEPT", 2)
    for uid in (7, 8, 9):
        copy.version += 1
        copy.remember(uid)
    copy.remember(0)   # no key: nothing remembered
    assert copy.applied_at(7) is None and copy.applied_at(8) == 2 and copy.applied_at(9) == 3
    assert copy.applied_at(0) is None and list(copy.applied) == [8, 9]


def test_the_budget_counts_every_copy_and_refuses_past_its_limit():
    reg = ShardRegistry()
    budget = MemoryBudget(100, reg)
    reg.add(Copy("w", 30))
    reg.add(Copy("~table~t", 50, is_table=True))
    assert budget.held() == 80
    budget.check(20, "x", "advice")   # exactly at the limit: allowed
    with pytest.raises(ResourceExhausted, match=r"'x' needs 21 bytes.*80 of its 100-byte"
                                                r".*--max-memory-bytes.*; do less"):
        budget.check(21, "'x'", "do less")
    MemoryBudget(None, reg).check(1 << 60, "x", "")   # no limit


def test_variables_and_tables_share_one_budget():
    """A table's rows count against a variable's create, and a variable's
    bytes against a table's admissions: one budget, both stores."""
    store = VariableStore(max_bytes=2 << 20)
    tables = TableStore.beside(store)
    assert tables.budget is store.budget and tables.registry is store.registry
    tables.create("t", TableSpec(TableConfig(dim=64)))
    held = store.budget.held()
    assert held > 0   # the table's first rows
    tables.lookup("t", np.arange(2000))   # past the first rows: the shard grows
    assert store.budget.held() > held
    room = store.budget.limit - store.budget.held()   # in float32 elements: room // 4
    with pytest.raises(ResourceExhausted, match="max-memory-bytes"):
        store.create("w", "float32", (room // 4 + 1,))   # the tables' rows leave no room
    assert len(store) == 0
    store.create("w", "float32", (room // 4 - 100,))    # what fits
    before = tables.info("t").rows
    with pytest.raises(ResourceExhausted, match="max-memory-bytes"):
        tables.lookup("t", np.arange(2000, 2002))   # the variable leaves no room for rows
    assert tables.info("t").rows == before   # refused: nothing admitted


def test_a_variables_and_a_tables_bytes_are_what_they_hold():
    store = VariableStore()
    tables = TableStore.beside(store)
    store.create("w", "float32", (4, 2), optimizer="adam")
    tables.create("t", TableSpec(TableConfig(dim=2)))
    var, shard = store.registry.variable("w"), store.registry.table("t")
    assert var.held_bytes == var.value.nbytes + var.slot_nbytes
    assert shard.held_bytes == shard.table.nbytes
    assert store.budget.held() == var.held_bytes + shard.held_bytes


def test_an_abandoned_replica_completes_the_steps_of_variables_and_table_shards():
    """AbandonStep reaches every copy of the registry: a variable's step and
    a table shard's step waiting for the abandoned replica both apply."""
    store = VariableStore()
    tables = TableStore.beside(store)
    store.create("w", "float32", (2,), optimizer_params={"learning_rate": 1.0})
    tables.create("t", TableSpec(TableConfig(dim=2), "sgd", {"learning_rate": 1.0}))
    tables.lookup("t", np.array([5]))
    spec = SyncSpec(step=0, replica=0, num_replicas=2, required=2)
    assert store.steps.push([("w", np.ones(2, np.float32))], spec) == [(0, False)]
    tables.update("t", np.array([5]), np.ones((1, 2), np.float32), sync=spec)
    assert tables.info("t").sync_steps == 0   # waiting for replica 1
    store.steps.abandon(0, 1)
    assert store.meta("w").version == 1 and store.meta("w").sync_steps == 1
    assert tables.info("t").sync_steps == 1
    np.testing.assert_array_equal(tables.lookup("t", np.array([5]), admit=False), [[-1, -1]])
