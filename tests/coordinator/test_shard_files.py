"""coordinator.shard_files: a checkpoint file is read only if its bytes have
the CRC-32 its manifest gives (issue 33 item 7), and a manifest's
checksums are checked as it is read; a manifest that predates checksums
reads as before. Pure: files on disk, no server (real clusters:
tests/integration/test_checksums.py)."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
from safetensors.numpy import save_file

from coordinator.checkpoint_files import read_manifest
from coordinator.shard_files import (
    CheckpointError,
    check_checksums,
    crc32_of_path,
    load_shard,
)


@pytest.fixture
def shard(tmp_path):
    """A shard file, its bytes and their CRC-32."""
    path = str(tmp_path / "w.safetensors")
    save_file({"value": np.arange(64, dtype=np.float32)}, path, metadata={"name": "w"})
    data = open(path, "rb").read()
    return path, data, zlib.crc32(data)


def test_a_file_of_its_checksum_loads_and_one_bit_flipped_is_refused(shard):
    path, data, crc = shard
    tensors, meta = load_shard(path, len(data), crc)
    np.testing.assert_array_equal(tensors["value"], np.arange(64, dtype=np.float32))
    for pos in (3, len(data) // 2, len(data) - 1):   # the header, the data, the last byte
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        open(path, "wb").write(damaged)
        with pytest.raises(CheckpointError, match="is damaged") as err:
            load_shard(path, len(data), crc)
        assert path in str(err.value) and "older checkpoint" in str(err.value)
    with pytest.raises(CheckpointError, match="not a CRC-32"):
        load_shard(path, len(data), "0x1234")


def test_without_a_checksum_a_file_is_read_unchecked_as_before(shard):
    """(A manifest that predates checksums.)"""
    path, data, crc = shard
    damaged = bytearray(data)
    damaged[-1] ^= 1
    open(path, "wb").write(damaged)
    tensors, _ = load_shard(path, len(data))
    assert tensors["value"][-1] != 63


def test_crc32_of_path_reads_a_regular_file_not_a_link(shard, tmp_path):
    path, data, crc = shard
    assert crc32_of_path(path) == crc
    os.symlink(path, tmp_path / "link")
    with pytest.raises(CheckpointError, match="symbolic link"):
        crc32_of_path(str(tmp_path / "link"))


def _manifest(**top):
    def entry(**e):
        return {"name": "w/part_0", "file": "ps-0/w", "offset": 0, "rows": 2, "version": 1,
                "bytes": 10, **e}
    return {"format_version": 2, "step": 1, **top,
            "variables": {"w": {"shape": [2], "dtype": "float32", "optimizer": "sgd",
                                "shards": [entry(crc32=5), entry(kind="unchanged")]}},
            "tables": {"t": {"dim": 2, "dtype": "float32",
                             "shards": [{"file": "ps-0/t", "rows": 0, "crc32": 0}]}}}


@pytest.mark.parametrize("damage,error", [
    (lambda m: None, None),
    (lambda m: m["tables"]["t"]["shards"][0].pop("crc32"), "not a CRC-32"),
    (lambda m: m["variables"]["w"]["shards"][0].update(crc32=1 << 32), "not a CRC-32"),
    (lambda m: m["variables"]["w"]["shards"][0].update(crc32=True), "not a CRC-32"),
    (lambda m: m["variables"]["w"]["shards"][0].update(crc32="5"), "not a CRC-32"),
    (lambda m: m.update(checksum="sha256"), "does not know"),
])
def test_a_checksummed_manifest_gives_every_file_a_crc32(tmp_path, damage, error):
    """An unchanged entry (no file) needs none; read_manifest checks it."""
    m = _manifest(checksum="crc32")
    damage(m)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    if error is None:
        check_checksums(str(tmp_path), m)
        assert read_manifest(str(tmp_path))["checksum"] == "crc32"
        return
    with pytest.raises(CheckpointError, match=error):
        check_checksums(str(tmp_path), m)
    with pytest.raises(CheckpointError, match=error):
        read_manifest(str(tmp_path))


def test_a_manifest_that_predates_checksums_may_lack_them():
    """No "checksum": entries without one are fine (read unchecked); one
    given is still checked to be a CRC-32 (it is verified on load)."""
    m = _manifest()
    for e in m["variables"]["w"]["shards"] + m["tables"]["t"]["shards"]:
        e.pop("crc32", None)
    check_checksums("old", m)
    m["tables"]["t"]["shards"][0]["crc32"] = -1
    with pytest.raises(CheckpointError, match="not a CRC-32"):
        check_checksums("old", m)


def test_the_coordinator_checksums_a_file_a_server_sent_none_for(shard):
    """A server of a pstrain that predates checksums sends no crc32 (proto3
    optional: unset); the manifest gets the file's, computed here."""
    from coordinator.checkpoint_io import _crc32
    from protos.pstrain.v1 import ps_pb2, tables_pb2

    path, data, crc = shard
    assert _crc32(ps_pb2.SavedFile(file="w.safetensors"), path) == crc
    assert _crc32(tables_pb2.SaveTableReply(file="w", crc32=0), path) == 0   # (0 is a CRC)
    assert _crc32(ps_pb2.SavedFile(file="w.safetensors", crc32=7), "/nonexistent") == 7


# -- manifests and state files: read_small, write_new ------------------------------------------
def test_a_small_file_is_read_only_if_regular_and_not_a_link(tmp_path):
    from coordinator.shard_files import read_small
    (tmp_path / "m.json").write_bytes(b'{"a": 1}')
    assert read_small(str(tmp_path / "m.json")) == b'{"a": 1}'
    (tmp_path / "secret").write_bytes(b"outside")
    os.symlink(tmp_path / "secret", tmp_path / "link.json")
    with pytest.raises(OSError):
        read_small(str(tmp_path / "link.json"))
    os.mkfifo(tmp_path / "fifo.json")   # would block a plain open() for good
    with pytest.raises(OSError, match="not a regular file"):
        read_small(str(tmp_path / "fifo.json"))
    with pytest.raises(OSError, match="more than the 4"):
        read_small(str(tmp_path / "m.json"), limit=4)


def test_a_new_file_is_never_written_through_a_planted_name(tmp_path):
    from coordinator.shard_files import write_new
    write_new(str(tmp_path / "new.json"), b"x" * 10)
    assert (tmp_path / "new.json").read_bytes() == b"x" * 10
    assert oct((tmp_path / "new.json").stat().st_mode & 0o777) == "0o644"
    (tmp_path / "target").write_bytes(b"keep")
    os.symlink(tmp_path / "target", tmp_path / "planted")
    with pytest.raises(OSError):
        write_new(str(tmp_path / "planted"), b"evil")
    with pytest.raises(FileExistsError):
        write_new(str(tmp_path / "new.json"), b"again")
    assert (tmp_path / "target").read_bytes() == b"keep"
    assert (tmp_path / "new.json").read_bytes() == b"x" * 10


def test_a_manifest_that_is_a_link_or_a_fifo_is_refused_not_followed(tmp_path):
    (tmp_path / "elsewhere.json").write_text(json.dumps({"step": 1, "variables": {}}))
    for kind in ("link", "fifo"):
        ckpt = tmp_path / f"ckpt-{kind}"
        ckpt.mkdir()
        if kind == "link":
            os.symlink(tmp_path / "elsewhere.json", ckpt / "manifest.json")
        else:
            os.mkfifo(ckpt / "manifest.json")
        with pytest.raises(CheckpointError, match="cannot read the manifest"):
            read_manifest(str(ckpt))
