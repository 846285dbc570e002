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


# -- checksums (issue 33 item 7) ----------------------------------------------------------------
@pytest.mark.parametrize("arrays", [
    {"value": np.arange(12, dtype=np.float32).reshape(4, 3),
     "slot/m": np.ones((4, 3), np.float32), "slot/iterations": np.asarray(np.int64(7)),
     "applied_ids": np.array([3, 1 << 63], np.uint64)},
    {"value": np.zeros((0, 3), np.float16), "rows": np.zeros(0, np.int64)},   # empty arrays
    {"keys": np.array([1, 5], ">i8"), "values": np.ones((2, 2), ">f8")},      # big-endian
    {"value": np.asfortranarray(np.arange(6.0).reshape(2, 3))},               # not C order
])
def test_a_written_files_checksum_is_the_crc32_of_its_bytes(tmp_path, arrays):
    """Computed from the header read back and the arrays in memory (not
    the file again): the CRC-32 of exactly the bytes on disk."""
    import zlib

    from safetensors.numpy import load_file

    store = VariableStore(checkpoint_dirs=[str(tmp_path)])
    with store.saver.save_directory(str(tmp_path)) as target:
        size, crc = write_tensors(target, "f.safetensors", arrays, {"name": "f"})
    data = (tmp_path / "f.safetensors").read_bytes()
    assert (size, crc) == (len(data), zlib.crc32(data))
    for k, a in load_file(str(tmp_path / "f.safetensors")).items():
        np.testing.assert_array_equal(a, arrays[k])


def test_a_file_laid_out_otherwise_is_checksummed_from_its_bytes(tmp_path):
    """Where the file's offsets are not the arrays one after another (a
    safetensors that pads, or other arrays), the file itself is read."""
    import zlib

    from psserver.core.save_files import _crc32_written

    data = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(40))
    path = tmp_path / "odd"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _crc32_written(fd, len(data), {"value": np.zeros(10, np.float32)}) == \
            zlib.crc32(data)
    finally:
        os.close(fd)


def test_the_checksum_helpers_agree_with_zlib(tmp_path):
    import zlib

    from psserver.contract import checkpoint_format as CF

    data = os.urandom(3 * 1000 + 17)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        os.lseek(fd, 100, os.SEEK_SET)   # (read from the start, whatever the offset)
        for chunk in (1000, 1 << 20):
            CF.CHECKSUM_CHUNK, old = chunk, CF.CHECKSUM_CHUNK
            try:
                assert CF.crc32_of_file(fd, len(data)) == zlib.crc32(data)
            finally:
                CF.CHECKSUM_CHUNK = old
        assert CF.crc32_of_file(fd, 0) == 0
        with pytest.raises(EOFError):
            CF.crc32_of_file(fd, len(data) + 1)
    finally:
        os.close(fd)
    a = np.arange(7, dtype=np.float64)
    assert CF.crc32_of_parts([b"ab", a, np.asarray(np.int32(5)), a[::2]]) == zlib.crc32(
        b"ab" + a.tobytes() + np.int32(5).tobytes() + a[::2].tobytes())
