"""Issue 33 item 7: a shard file with one bit flipped, of the same size, was
loaded and served. Every file a manifest lists has its CRC-32 there now,
computed by the parameter server as it wrote it, and every reader checks
it first: a restore (from the program and from ``coordinator checkpoint
restore``), a Snapshot and the side evaluator refuse a damaged file,
naming it and saying it is damaged, with nothing changed. On real
clusters, of variables and dynamic tables, full checkpoints, incremental
deltas and serving exports."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest

from coordinator import (
    FixedShardsPartitioner,
    LocalCluster,
    ParameterServerStrategy,
    push_gradients,
)
from coordinator.checkpoint import CheckpointManager
from coordinator.checkpoint_files import CheckpointError
from coordinator.evaluation import read_checkpoint
from coordinator.serving import Exporter, Snapshot, SnapshotError
from coordinator.step_calls import IndexedSlices

pytestmark = pytest.mark.timeout(180)

KEYS = np.arange(0, 60, 3, dtype=np.int64)


def model(strategy):
    """A 2-shard Adam variable, a scalar-free bias and an Adam dynamic table."""
    w = strategy.create_variable("w", shape=(40, 4), initializer="random_normal", seed=1,
                                 optimizer="adam", optimizer_params={"learning_rate": 0.05})
    b = strategy.create_variable("b", shape=(4,), initializer="ones", optimizer="sgd")
    t = strategy.create_embedding_table("t", 4, initializer="random_normal", seed=2,
                                        optimizer="adam")
    return w, b, t


def train(w, b, t, seed: int, rows=(1, 30)):
    """Rows of both shards of ``w`` (a delta holds just those), ``b``, and
    some of the table's keys."""
    rng = np.random.default_rng(seed)
    ids = np.array(rows)
    push_gradients([(w, IndexedSlices(rng.normal(size=(ids.size, 4)).astype(np.float32), ids)),
                    (b, rng.normal(size=4).astype(np.float32))])
    keys = KEYS[seed % 3::2]
    t.lookup(keys)
    t.push_gradient(keys, rng.normal(size=(keys.size, 4)).astype(np.float32))


def state(w, b, t):
    return w.read(), w.versions(), b.read(), b.versions(), t.lookup(KEYS, admit=False)


def same(got, want):
    for g, x in zip(got, want):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(g, x)
        else:
            assert g == x


def entries(path: str):
    """(section, name, entry) of every file the manifest of ``path`` lists."""
    m = json.load(open(os.path.join(path, "manifest.json")))
    return [(section, name, e) for section in ("variables", "tables")
            for name, info in m.get(section, {}).items() for e in info["shards"]
            if e.get("kind", "full") != "unchanged"]


def shard_file(path: str, section: str, name: str, kind: str = "full") -> str:
    return next(os.path.join(path, e["file"]) for s, n, e in entries(path)
                if (s, n) == (section, name) and e.get("kind", "full") == kind)


def flip_bit(file: str, tensor: str) -> bytes:
    """Flip the lowest bit of an element in the middle of ``tensor``'s data
    (a float stays finite, a key keeps its order: only the checksum can tell);
    the file keeps its size. Returns its bytes before."""
    whole = open(file, "rb").read()
    n = int.from_bytes(whole[:8], "little")
    start, end = json.loads(whole[8:8 + n])[tensor]["data_offsets"]
    assert end > start
    pos = 8 + n + start + (end - start) // 2 // 8 * 8
    damaged = bytearray(whole)
    damaged[pos] ^= 1
    with open(file, "r+b") as f:
        f.write(damaged)
    assert os.path.getsize(file) == len(whole)
    return whole


def test_every_file_a_manifest_lists_has_its_crc32(tmp_path):
    """Full checkpoints, deltas and exports, variables and tables: each
    file's CRC-32 in its entry, the manifest marked as checksummed."""
    with LocalCluster(num_ps=2, num_workers=0, checkpoint_dirs=(str(tmp_path),)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w, b, t = model(strategy)
        train(w, b, t, 0)
        full = CheckpointManager(strategy, str(tmp_path / "full")).save(1)
        inc = CheckpointManager(strategy, str(tmp_path / "inc"), incremental=True)
        inc.save(1)
        train(w, b, t, 1)
        delta = inc.save(2)
        exporter = Exporter(strategy, str(tmp_path / "export"))
        exporter.export()
        train(w, b, t, 2)
        export_delta = exporter.export()
    kinds = set()
    for path in (full, delta, export_delta):
        assert json.load(open(os.path.join(path, "manifest.json")))["checksum"] == "crc32"
        for section, name, e in entries(path):
            kinds.add((section, e.get("kind", "full")))
            data = open(os.path.join(path, e["file"]), "rb").read()
            assert e["crc32"] == zlib.crc32(data), (path, name)
    assert kinds == {("variables", "full"), ("variables", "delta"), ("tables", "full"),
                     ("tables", "delta")}


def test_a_flipped_bit_in_a_full_checkpoint_is_refused_and_nothing_restored(
        tmp_path, monkeypatch, capsys):
    """One bit of a variable's and of a table's shard file: restore (the
    program's and the CLI's) refuses, naming the file and saying it is
    damaged, the variables and the table as they were; mended, it restores
    as before."""
    from coordinator import cli

    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w, b, t = model(strategy)
        train(w, b, t, 0)
        ckpt = CheckpointManager(strategy, str(tmp_path))
        path = ckpt.save(1)
        saved = state(w, b, t)
        train(w, b, t, 1)
        before = state(w, b, t)
        for k, val in cluster.tls.env().items():
            monkeypatch.setenv(k, val)
        monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", cluster.token)
        for section, name, tensor in (("variables", "w", "value"), ("tables", "t", "values"),
                                      ("variables", "w", "slot/m")):
            victim = shard_file(path, section, name)
            whole = flip_bit(victim, tensor)
            with pytest.raises(CheckpointError, match="damaged") as err:
                ckpt.restore(path)
            assert victim in str(err.value) and "older checkpoint" in str(err.value)
            capsys.readouterr()
            rc = cli.main(["checkpoint", "restore", str(tmp_path),
                           "--ps", ",".join(cluster.spec.ps)])
            assert rc != 0 and "damaged" in capsys.readouterr().err
            same(state(w, b, t), before)
            with open(victim, "wb") as f:
                f.write(whole)
        ckpt.restore(path)   # whole again: restored as before
        same(state(w, b, t), saved)


def test_a_flipped_bit_in_an_incremental_delta_or_its_base_is_refused(tmp_path):
    """A delta's variable rows, a table delta, and a file of the base the
    delta composes on: restoring the delta refuses each, nothing changed;
    mended, the chain restores."""
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w, b, t = model(strategy)
        train(w, b, t, 0)
        ckpt = CheckpointManager(strategy, str(tmp_path), incremental=True)
        base = ckpt.save(1)
        train(w, b, t, 1)
        delta = ckpt.save(2)
        saved = state(w, b, t)
        train(w, b, t, 2)
        before = state(w, b, t)
        for path, section, name, kind, tensor in (
                (delta, "variables", "w", "delta", "value"),
                (delta, "tables", "t", "delta", "values"),
                (base, "tables", "t", "full", "values")):
            victim = shard_file(path, section, name, kind)
            whole = flip_bit(victim, tensor)
            with pytest.raises(CheckpointError, match="damaged") as err:
                ckpt.restore(delta)
            assert victim in str(err.value)
            same(state(w, b, t), before)
            with open(victim, "wb") as f:
                f.write(whole)
        ckpt.restore(delta)
        same(state(w, b, t), saved)


def test_a_flipped_bit_in_a_serving_export_is_refused_and_the_old_state_served(tmp_path):
    """A Snapshot that starts on a damaged export refuses it; one following
    keeps serving what it had when a delta is damaged (a variable's, a
    table's), and the side evaluator's reader refuses it too; mended, both
    load it."""
    export_dir = str(tmp_path / "export")
    with LocalCluster(num_ps=2, num_workers=0, checkpoint_dirs=(str(tmp_path),)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w, b, t = model(strategy)
        train(w, b, t, 0)
        exporter = Exporter(strategy, export_dir)
        first = exporter.export()
        victim = shard_file(first, "variables", "w")
        whole = flip_bit(victim, "value")
        with pytest.raises(SnapshotError, match="damaged"):
            Snapshot(export_dir)
        with open(victim, "wb") as f:
            f.write(whole)
        snap = Snapshot(export_dir)
        served = snap.read("w"), snap.lookup("t", KEYS)
        train(w, b, t, 1)
        delta = exporter.export()
        want = w.read(), t.lookup(KEYS, admit=False)
    for section, name, tensor in (("variables", "w", "value"), ("tables", "t", "values")):
        victim = shard_file(delta, section, name, "delta")
        whole = flip_bit(victim, tensor)
        with pytest.raises(SnapshotError, match="damaged") as err:
            snap.refresh()
        assert victim in str(err.value)
        np.testing.assert_array_equal(snap.read("w"), served[0])
        np.testing.assert_array_equal(snap.lookup("t", KEYS), served[1])
        with pytest.raises(CheckpointError, match="damaged"):
            read_checkpoint(delta)
        with open(victim, "wb") as f:
            f.write(whole)
    assert snap.refresh() and snap.path == delta
    np.testing.assert_array_equal(snap.read("w"), want[0])
    np.testing.assert_array_equal(snap.lookup("t", KEYS), want[1])
    np.testing.assert_array_equal(read_checkpoint(delta).variables["w"], want[0])


def test_a_manifest_that_says_its_files_have_checksums_but_lacks_one_is_refused(tmp_path):
    """A checksum missing where the manifest says every file has one (the
    entry damaged) is refused; a manifest without the mark predates
    checksums (tests/data/ckpt-808e9e1/, test_old_checkpoints.py) and
    restores unchecked."""
    with LocalCluster(num_ps=1, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        w, b, t = model(strategy)
        train(w, b, t, 0)
        ckpt = CheckpointManager(strategy, str(tmp_path))
        path = ckpt.save(1)
        saved = state(w, b, t)
        train(w, b, t, 1)
        before = state(w, b, t)
        manifest_path = os.path.join(path, "manifest.json")
        manifest = json.load(open(manifest_path))
        del manifest["tables"]["t"]["shards"][0]["crc32"]
        json.dump(manifest, open(manifest_path, "w"))
        with pytest.raises(CheckpointError, match="not a CRC-32"):
            ckpt.restore(path)
        same(state(w, b, t), before)
        del manifest["checksum"]   # as written before checksums
        for info in (*manifest["variables"].values(), *manifest["tables"].values()):
            for e in info["shards"]:
                e.pop("crc32", None)
        json.dump(manifest, open(manifest_path, "w"))
        ckpt.restore(path)
        same(state(w, b, t), saved)
