"""psserver.core.save_files: a save writes only into the directory it
checked, whatever happens to its path meanwhile (issue 33 item 4); in
process, the swap made at the worst moment. (A real server with a swapper
thread: tests/integration/test_security.py.)"""
from __future__ import annotations

import os

import numpy as np
import pytest

from psserver.core.save_files import write_tensors
from psserver.core.store import VariableStore
from psserver.core.table_config import TableConfig
from psserver.core.table_store import TableSpec, TableStore
from psserver.errors import InvalidArgument, PermissionDenied


@pytest.fixture
def dirs(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    (root / "run").mkdir(parents=True)
    outside.mkdir()
    return root, outside


def _swap(root, outside):
    """ckpt/run moved aside, a link to outside/ put in its place."""
    os.rename(root / "run", root / "run-moved")
    os.symlink(outside, root / "run")


def test_a_part_swapped_for_a_link_after_the_check_writes_nothing_outside(dirs):
    root, outside = dirs
    store = VariableStore(checkpoint_dirs=[str(root)])
    with store.saver.save_directory(str(root / "run")) as target:
        _swap(root, outside)   # after the check, before the write
        write_tensors(target, "w.safetensors", {"value": np.ones(3, np.float32)}, {})
    assert os.listdir(outside) == []
    assert os.listdir(root / "run-moved") == ["w.safetensors"]   # where it was checked


@pytest.mark.parametrize("what", ["variable", "table"])
def test_a_save_into_a_linked_part_is_refused_or_lands_inside(dirs, what):
    """A link already there when the save starts: resolved into the
    checkpoint dir it is followed (as before), out of it refused."""
    root, outside = dirs
    store = VariableStore(checkpoint_dirs=[str(root)])
    store.create("w", "float32", [3])
    tables = TableStore.beside(store)
    tables.create("t", TableSpec(TableConfig(dim=2)))

    def save(path):
        return store.saver.save(path) if what == "variable" else tables.save("t", path)
    os.symlink(root / "run", root / "inside")
    os.symlink(outside, root / "out")
    save(str(root / "inside"))
    assert os.listdir(root / "run") and not os.listdir(outside)
    with pytest.raises(PermissionDenied, match="outside this parameter server's checkpoint"):
        save(str(root / "out"))
    with pytest.raises(InvalidArgument, match="does not exist"):
        save(str(root / "nonesuch"))
    assert os.listdir(outside) == []
