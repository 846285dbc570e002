"""psserver.core.store.VariableStore in process (no processes, no grpc): its one
asynchronous push, the variables' namespace beside the table shards', and
its parts (registry, budget, steps, replicator, saver) made once and shared."""
from __future__ import annotations

import numpy as np
import pytest

from psserver.contract import ROLE_BACKUP, Peer, SyncSpec
from psserver.core.store import VariableStore
from psserver.core.table_config import TableConfig
from psserver.core.table_store import TableSpec, TableStore
from psserver.errors import InvalidArgument, NotFound, NotPrimary

SGD1 = dict(optimizer_params={"learning_rate": 1.0})


@pytest.fixture
def store():
    s = VariableStore()
    s.create("d", "float32", (2,), **SGD1)
    s.create("e", "float32", (4, 2), **SGD1)
    return s


def test_one_push_applies_dense_and_row_wise_gradients(store):
    versions = store.push([("d", np.ones(2, np.float32), 11)],
                          [("e", np.array([3, 0, 3]), np.ones((3, 2), np.float32), 12)])
    assert versions == [1, 1]
    np.testing.assert_array_equal(store.snapshot("d")[1], [-1, -1])
    np.testing.assert_array_equal(store.snapshot("e")[1], [[-1, -1], [0, 0], [0, 0], [-2, -2]])
    assert store.push(sparse=[("e", np.array([0]), np.ones((1, 2), np.float32), 12)]) == [1]
    assert store.push([("d", np.ones(2, np.float16), 13)]) == [2]   # widened, applied once


@pytest.mark.parametrize("sparse", [
    [("e", np.array([4]), np.ones((1, 2), np.float32), 0)],        # out of range
    [("e", np.array([[0]]), np.ones((1, 2), np.float32), 0)],      # not 1-D
    [("e", np.array([0]), np.ones((1, 3), np.float32), 0)],        # rows of another shape
    [("e", np.array([0.5]), np.ones((1, 2), np.float32), 0)],      # not integer ids
    [("e", np.array([0]), np.full((1, 2), np.inf, np.float32), 0)],
    [("missing", np.array([0]), np.ones((1, 2), np.float32), 0)],
])
def test_a_push_is_checked_whole_before_anything_applies(store, sparse):
    with pytest.raises((InvalidArgument, NotFound)):
        store.push([("d", np.ones(2, np.float32), 1)], sparse)
    assert store.meta("d").version == 0 and store.meta("e").version == 0
    np.testing.assert_array_equal(store.snapshot("d")[1], [0, 0])


def test_a_table_shards_name_is_no_variables(store):
    tables = TableStore.beside(store)
    tables.create("t", TableSpec(TableConfig(dim=2)))
    assert store.meta("~table~t").name == "~table~t"   # GetMeta reaches it
    for call in (lambda: store.snapshot("~table~t"), lambda: store.delete("~table~t"),
                 lambda: store.push([("~table~t", np.ones(2, np.float32))])):
        with pytest.raises(NotFound, match="no variable"):
            call()
    with pytest.raises(InvalidArgument):
        store.create("~table~t", "float32", (2,))
    with pytest.raises(InvalidArgument, match="must be a variable"):
        store.create("w", "float32", (2,), backup=Peer("b:1", "~table~t"))
    assert [m.name for m in store.list()] == ["d", "e"] and len(store) == 2
    assert tables.info("t").rows == 0   # untouched


def test_a_deleted_variable_is_gone_once(store):
    store.delete("d")
    with pytest.raises(NotFound):
        store.delete("d")
    assert store.registry.find("d") is None and len(store) == 1


def test_its_parts_see_the_same_variables(store, tmp_path):
    assert sorted(s.name for s in store.saver.save(str(tmp_path))) == ["d", "e"]
    assert store.budget.held() == store.total_bytes() and store.max_bytes is None
    store.registry.variable("d").role = ROLE_BACKUP
    with pytest.raises(NotPrimary):
        store.push([("d", np.ones(2, np.float32))])
    # a backup gathers a sync step but leaves applying it to its primary...
    assert store.steps.push([("d", np.ones(2, np.float32))], SyncSpec(0, 0, 1, 1)) == \
        [(0, False)]
    store.replicator.promote("d", epoch=1)   # ... until it is promoted: applied then
    assert (store.meta("d").version, store.meta("d").sync_steps) == (1, 1)
    assert store.push([("d", np.ones(2, np.float32))]) == [2]
