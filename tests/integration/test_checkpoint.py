"""Checkpoints on real clusters: round trip, resharding, crash mid-save, retention."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from coordinator import (
    FixedShardsPartitioner,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    ps_pool,
)
from coordinator.checkpoint import CheckpointManager
from coordinator.checkpoint_files import CheckpointError
from coordinator.step_calls import push_gradients, read_variables
from psserver.errors import PSError

pytestmark = pytest.mark.timeout(120)

ROWS, COLS = 10, 3


def make_variables(strategy):
    rng = np.random.default_rng(0)
    w = strategy.create_variable("dense/w", initial_value=rng.normal(size=(ROWS, COLS)).astype(np.float32),
                                 optimizer="adam", optimizer_params={"learning_rate": 0.05})
    b = strategy.create_variable("dense/b", initial_value=np.zeros(COLS, np.float32),
                                 optimizer="momentum", optimizer_params={"learning_rate": 0.1})
    return w, b


def train(w, b, steps: int, seed: int):
    """Deterministic pushes from the coordinator: the same seed, the same updates."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        push_gradients([(w, rng.normal(size=(ROWS, COLS)).astype(np.float32)),
                        (b, rng.normal(size=COLS).astype(np.float32))])


def test_restore_continues_training_exactly(tmp_path):
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
        w, b = make_variables(strategy)
        train(w, b, 5, seed=1)
        ckpt = CheckpointManager(strategy, str(tmp_path))
        path = ckpt.save(step=5, extra={"epoch": 2})
        train(w, b, 5, seed=2)                      # uninterrupted: 5 more steps
        expected = read_variables([w, b])
        versions = [m.version for m in w.meta()]
        train(w, b, 3, seed=99)                     # wander off...
        state = ckpt.restore()                      # ...and come back
        assert state == {"step": 5, "extra": {"epoch": 2}, "path": path}
        train(w, b, 5, seed=2)                      # the same 5 steps again
        got = read_variables([w, b])
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(g, e)     # slots restored too, or Adam would differ
        assert [m.version for m in w.meta()] == versions


def test_checkpoint_files_are_plain_safetensors(tmp_path):
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
        w, b = make_variables(strategy)
        train(w, b, 2, seed=1)
        path = CheckpointManager(strategy, str(tmp_path)).save(step=2)
        value = w.read()
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    shards = manifest["variables"]["dense/w"]["shards"]
    assert [s["rows"] for s in shards] == [5, 5]
    parts = [load_file(os.path.join(path, s["file"])) for s in shards]
    np.testing.assert_array_equal(np.concatenate([p["value"] for p in parts]), value)
    assert {"value", "slot/m", "slot/v", "slot/iterations"} <= set(parts[0])


@pytest.mark.parametrize("num_ps", [1, 3])
def test_two_shard_checkpoint_restores_into_other_cluster_sizes(tmp_path, num_ps):
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
        w, b = make_variables(strategy)
        train(w, b, 4, seed=1)
        CheckpointManager(strategy, str(tmp_path)).save(step=4)
        saved = read_variables([w, b])
        assert w.num_shards == 2
    with LocalCluster(num_ps=num_ps, num_workers=0) as other:
        strategy = ParameterServerStrategy(other.spec, variable_partitioner=FixedShardsPartitioner(num_ps))
        w2, b2 = make_variables(strategy)
        assert w2.num_shards == num_ps
        CheckpointManager(strategy, str(tmp_path)).restore()
        for e, g in zip(saved, read_variables([w2, b2])):
            np.testing.assert_array_equal(g, e)


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    # Parameter server 1 dies while writing its shard files (fault-injection switch).
    with LocalCluster(num_ps=2, num_workers=0, restart=()) as cluster:   # we restart it by hand
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
        w, b = make_variables(strategy)
        train(w, b, 2, seed=1)
        ckpt = CheckpointManager(strategy, str(tmp_path))
        good = ckpt.save(step=2)
        saved = read_variables([w, b])
        # Restart ps 1 with the fault switch on, with its shards restored.
        from psserver.process import start_task
        victim = cluster.ps[1]
        victim.kill()
        port = victim.address.rsplit(":", 1)[1]
        cluster.ps[1] = start_task("psserver", ["--port", port, "--checkpoint-dir", str(tmp_path)],
                                   env={**cluster._env, "PSTRAIN_FAULT_CRASH_IN_SAVE": "1"})
        for v in (w, b):
            for s in v.shards:
                if s.address == victim.address:
                    ps_pool.client_for(s.address).create_variable(
                        s.name, None, v.dtype, initial_value=np.zeros((s.rows,) + v.shape[1:], v.dtype),
                        optimizer=v.optimizer)
        ckpt.restore(good)
        train(w, b, 2, seed=3)
        with pytest.raises(PSError):
            ckpt.save(step=4)
        cluster.ps[1].proc.wait(timeout=30)   # its socket closes while it exits
        assert not cluster.ps[1].alive()
        assert ckpt.checkpoints() == [good] and ckpt.latest() == good
        assert not [n for n in os.listdir(tmp_path) if n != os.path.basename(good)]
    # The previous checkpoint is whole: it restores on a fresh cluster.
    with LocalCluster(num_ps=1, num_workers=0) as fresh:
        strategy = ParameterServerStrategy(fresh.spec)
        w2, b2 = make_variables(strategy)
        assert CheckpointManager(strategy, str(tmp_path)).restore()["step"] == 2
        for e, g in zip(saved, read_variables([w2, b2])):
            np.testing.assert_array_equal(g, e)


def test_keeps_the_last_k_and_saves_on_schedule(tmp_path):
    with LocalCluster(num_ps=1, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        w, b = make_variables(strategy)
        ckpt = CheckpointManager(strategy, str(tmp_path), max_to_keep=2, every_n_steps=10)
        saved_at = [step for step in range(0, 50, 5) if ckpt.maybe_save(step)]
        assert saved_at == [0, 10, 20, 30, 40]
        assert [os.path.basename(p) for p in ckpt.checkpoints()] == ["ckpt-00000030",
                                                                       "ckpt-00000040"]


def test_restore_refuses_a_mismatched_variable(tmp_path):
    with LocalCluster(num_ps=1, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        make_variables(strategy)
        ckpt = CheckpointManager(strategy, str(tmp_path))
        ckpt.save(step=1)
        strategy.create_variable("extra", shape=(2,))
        with pytest.raises(CheckpointError, match="'extra' is not in checkpoint"):
            ckpt.restore()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        with LocalCluster(num_ps=1, num_workers=0) as c2:
            CheckpointManager(ParameterServerStrategy(c2.spec), str(tmp_path / "empty")).restore()


def test_min_size_sharded_table_round_trip(tmp_path):
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(
            cluster.spec, variable_partitioner=MinSizePartitioner(min_shard_bytes=1 << 10, max_shards=2))
        table = strategy.create_variable("emb", shape=(1000, 8), initializer="random_normal", seed=1,
                                         optimizer="adagrad")
        table.push_sparse([1, 999, 1], np.ones((3, 8), np.float32))
        ckpt = CheckpointManager(strategy, str(tmp_path))
        ckpt.save(step=1)
        before = table.read()
        table.push_sparse([5], np.ones((1, 8), np.float32))
        ckpt.restore()
        np.testing.assert_array_equal(table.read(), before)


DELETE_CRASH_SCRIPT = '''
import os, shutil, sys
import numpy as np
from coordinator import LocalCluster, ParameterServerStrategy, FixedShardsPartitioner
from coordinator.checkpoint import CheckpointManager

with LocalCluster(num_ps=2, num_workers=0) as cluster:
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
    w = strategy.create_variable("w", initial_value=np.arange(8, dtype=np.float32))
    ckpt = CheckpointManager(strategy, sys.argv[1], max_to_keep=1)
    ckpt.save(step=1)

    def dies_half_way(path, *a, **k):   # the coordinator killed while deleting
        for root, _, files in os.walk(path):
            for f in files:
                if f.endswith(".safetensors"):
                    os.remove(os.path.join(root, f))
                    os._exit(9)
    shutil.rmtree = dies_half_way
    w.assign(np.ones(8, np.float32))
    ckpt.save(step=2)   # removes ckpt 1 (max_to_keep=1): dies in the middle
'''


def test_a_coordinator_killed_while_removing_old_checkpoints_lists_only_whole_ones(tmp_path):
    """max_to_keep removal interrupted: the half-deleted checkpoint is never
    listed (it left the listed names first), the new one restores, and the
    next save clears what was left."""
    import subprocess
    import sys

    from coordinator.checkpoint_files import find_checkpoints
    from psserver.process import child_env

    script, ckpts = tmp_path / "train.py", tmp_path / "ckpts"
    script.write_text(DELETE_CRASH_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(ckpts)], env=child_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stdout + r.stderr
    listed = find_checkpoints(str(ckpts))
    assert [os.path.basename(p) for p in listed] == ["ckpt-00000002"]
    with LocalCluster(num_ps=1, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        w = strategy.create_variable("w", shape=(8,))
        ckpt = CheckpointManager(strategy, str(ckpts), max_to_keep=1)
        assert ckpt.restore()["step"] == 2
        np.testing.assert_array_equal(w.read(), np.ones(8, np.float32))
        ckpt.save(step=3)
    assert sorted(os.listdir(ckpts)) == ["ckpt-00000003"]   # leftovers cleared


def test_a_checkpoint_set_aside_for_a_resave_that_never_landed_is_put_back(tmp_path):
    """Saving step N again sets the old ckpt-N aside first; a coordinator that
    died before the new one landed loses neither: the next save puts it back."""
    from coordinator.checkpoint_files import find_checkpoints
    from coordinator.checkpoint_io import clear_leftovers

    old = tmp_path / ".replaced-ckpt-00000005-0123abcd"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    (tmp_path / ".deleting-ckpt-00000001-89abcdef").mkdir()
    (tmp_path / "ckpt-00000006.tmp-deadbeef").mkdir()
    clear_leftovers(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000005"]
    assert [os.path.basename(p) for p in find_checkpoints(str(tmp_path))] == ["ckpt-00000005"]


@pytest.mark.parametrize("damage", ["slot", "value", "file", "shape"])
def test_a_checkpoint_lacking_what_its_manifest_promises_is_refused(tmp_path, damage,
                                                                     monkeypatch):
    """A shard saved without an optimizer slot restored with fresh slots,
    silently. Now any missing or wrong part is refused, naming the file,
    before any server is written (through the program and the CLI)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from coordinator import cli
    from coordinator.checkpoint_files import CheckpointError

    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = strategy.create_variable("w", shape=(4, 2), initializer="ones", optimizer="adam")
        w.push_gradient(np.ones((4, 2), np.float32))
        ckpt = CheckpointManager(strategy, str(tmp_path))
        path = ckpt.save(step=1)
        shard = os.path.join(path, json.load(open(os.path.join(path, "manifest.json")))
                             ["variables"]["w"]["shards"][1]["file"])
        with safe_open(shard, framework="np") as f:
            meta = f.metadata()
        tensors = load_file(shard)
        if damage == "file":
            os.remove(shard)
        else:
            if damage == "slot":
                del tensors["slot/m"]
            elif damage == "value":
                del tensors["value"]
            else:
                tensors["slot/v"] = tensors["slot/v"][:1]
            save_file(tensors, shard, metadata=meta)
        w.push_gradient(np.ones((4, 2), np.float32))
        before = (w.read(), w.versions())
        with pytest.raises(CheckpointError, match=os.path.basename(shard) if damage != "file"
                           else "cannot read"):
            ckpt.restore(path)
        for k, val in cluster.tls.env().items():
            monkeypatch.setenv(k, val)
        monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", cluster.token)
        rc = cli.main(["checkpoint", "restore", str(tmp_path), "--ps", ",".join(cluster.spec.ps)])
        after = (w.read(), w.versions())
    assert rc != 0
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1] == before[1] == [2, 2]



@pytest.mark.parametrize("optimizer,params", [
    ("sgd", {}), ("momentum", {"momentum": 0.9}), ("momentum", {"nesterov": 1.0}),
    ("adagrad", {}), ("adam", {}), ("adam", {"beta_1": 0.5}),
    ("ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01,
              "l2_shrinkage_regularization_strength": 0.02, "beta": 0.3})])
def test_every_optimizer_slot_survives_save_and_restore(tmp_path, optimizer, params):
    """The store writes every slot of every optimizer (store.save) and the
    checkpoint restores every one (load_checked_shard + create(slots=...)):
    the restored copy then trains to the same bits as the original."""
    from coordinator.checkpoint_files import load_checked_shard
    from psserver.contract import Initializer
    from psserver.core.store import VariableStore

    a, b = VariableStore(), VariableStore()
    a.create("w", "float32", (5, 3), optimizer=optimizer, optimizer_params=params,
             initializer=Initializer("random_normal", seed=3))
    rng = np.random.default_rng(0)
    for i in range(3):
        a.push([("w", rng.normal(size=(5, 3)).astype(np.float32), i + 1)])
        a.push(sparse=[("w", np.array([1, 4]), rng.normal(size=(2, 3)).astype(np.float32), 0)])
    (saved,) = a.saver.save(str(tmp_path))
    name, file, version = saved.name, saved.file, saved.version
    entry = {"name": name, "file": file, "offset": 0, "rows": 5, "version": version}
    tensors, meta = load_checked_shard(str(tmp_path), entry, "float32", (5, 3), optimizer)
    slots = {k[5:]: v for k, v in tensors.items() if k.startswith("slot/")}
    assert set(slots) == set(a.registry.variable("w").slots)
    b.create("w", "float32", (5, 3), initial_value=tensors["value"], optimizer=optimizer,
             optimizer_params=json.loads(meta["optimizer_params"]), slots=slots,
             version=version)
    for k, v in a.registry.variable("w").slots.items():
        restored = b.registry.variable("w").slots[k]
        assert np.asarray(v).tobytes() == np.asarray(restored).tobytes(), k
    g = rng.normal(size=(5, 3)).astype(np.float32)
    for s in (a, b):
        s.push([("w", g, 99)])
    assert a.snapshot("w")[1].tobytes() == b.snapshot("w")[1].tobytes()


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "ftrl"])
def test_a_dynamic_tables_optimizer_slots_survive_save_and_restore(tmp_path, optimizer):
    """Issue 33 item 12(e): a restore that dropped a table's per-row slots
    was caught only by the incremental round trip. A table trained, saved,
    trained on, restored: a second save holds every array of the first,
    slots included, bit for bit."""
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        t = strategy.create_embedding_table("t", 3, optimizer=optimizer,
                                            initializer="random_normal", seed=2)
        keys = np.arange(40, dtype=np.int64) * 7919
        rng = np.random.default_rng(1)
        t.lookup(keys)
        for _ in range(3):
            t.push_gradient(keys[:25], rng.normal(size=(25, 3)).astype(np.float32))
        manager = CheckpointManager(strategy, str(tmp_path / "a"))
        first = manager.save(1)
        t.push_gradient(keys, np.ones((40, 3), np.float32))   # moves values and slots
        manager.restore(first)
        second = CheckpointManager(strategy, str(tmp_path / "b")).save(1)
    def arrays(path):
        manifest = json.load(open(os.path.join(path, "manifest.json")))
        out = {}
        for shard in manifest["tables"]["t"]["shards"]:
            tensors = load_file(os.path.join(path, shard["file"]))
            for k, a in tensors.items():
                if k not in ("age_seconds",):   # (clock readings: ages differ by the wait)
                    out.setdefault(k, []).append(a)
        return {k: np.concatenate([np.atleast_1d(a) for a in v]) for k, v in out.items()}
    want, got = arrays(first), arrays(second)
    assert any(k.startswith("slot/") for k in want) and set(got) == set(want)
    for k in want:
        assert want[k].tobytes() == got[k].tobytes(), k


def test_each_shard_restored_into_its_own_cut_keeps_its_own_step_count(tmp_path):
    """Lazy (sparse) Adam counts steps per shard: pushes that reached one
    shard only leave the shards at different counts. Restored into the same
    layout, each shard gets its own count back (not the largest), so the
    same pushes after the restore give the same bits as after the save."""
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = strategy.create_variable("emb", shape=(4, 3), initializer="ones", optimizer="adam",
                                     optimizer_params={"learning_rate": 0.1})
        rows = np.ones((1, 3), np.float32)
        for _ in range(3):
            w.push_sparse(np.array([0]), rows)          # shard 0 only: its count 3, shard 1's 0
        ckpt = CheckpointManager(strategy, str(tmp_path))
        ckpt.save(step=1)

        def after():
            w.push_sparse(np.array([0, 3]), np.ones((2, 3), np.float32))   # both shards
            return w.read()
        expected = after()
        ckpt.restore()
        np.testing.assert_array_equal(after(), expected)


class _DiskOps:
    """Records this process's fsyncs (by path) and renames, in order."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        fsync, replace = os.fsync, os.replace

        def spy_fsync(fd):
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return fsync(fd)

        def spy_replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            def full(p, fd):   # (names relative to an open directory: its path)
                return os.fspath(p) if fd is None else \
                    os.path.join(os.readlink(f"/proc/self/fd/{fd}"), os.fspath(p))
            self.events.append(("replace", full(src, src_dir_fd), full(dst, dst_dir_fd)))
            return replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        monkeypatch.setattr(os, "fsync", spy_fsync)
        monkeypatch.setattr(os, "replace", spy_replace)

    def renamed(self, dst: str) -> tuple[int, str]:
        """(index, source) of the rename into ``dst``."""
        return next((i, e[1]) for i, e in enumerate(self.events)
                    if e[0] == "replace" and e[2] == dst)


def test_a_shard_files_name_is_on_disk_before_the_save_returns(tmp_path, monkeypatch):
    """The server's side (the store, in process): the file is fsynced before
    its rename, and its directory (a checkpoint's ps-N/) after it."""
    from psserver.core.store import VariableStore

    store = VariableStore()
    store.create("w", "float32", (4, 2))
    disk = _DiskOps(monkeypatch)
    (saved,) = store.saver.save(str(tmp_path))
    final = str(tmp_path / saved.file)
    at, tmp = disk.renamed(final)
    assert ("fsync", tmp) in disk.events[:at]
    assert ("fsync", str(tmp_path)) in disk.events[at:]


def test_a_checkpoint_directory_is_on_disk_before_it_is_renamed_into_place(tmp_path,
                                                                          monkeypatch):
    """The coordinator's side: the temporary checkpoint directory (manifest,
    ps-N/ entries) is fsynced before it is renamed to ckpt-N, and the
    checkpoints' directory after."""
    with LocalCluster(num_ps=1, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        strategy.create_variable("w", shape=(4,), initializer="ones")
        manager = CheckpointManager(strategy, str(tmp_path))
        disk = _DiskOps(monkeypatch)
        path = manager.save(1)
        monkeypatch.undo()
    at, tmp = disk.renamed(path)
    assert ("fsync", tmp) in disk.events[:at]
    assert ("fsync", str(tmp_path)) in disk.events[at:]


def test_a_hung_server_fails_a_save_in_seconds_and_nothing_is_listed(tmp_path, monkeypatch):
    """Issue 33 item 11: a server that is alive but answers nothing (stopped
    here with SIGSTOP; a host that drops packets looks the same) kept a save
    waiting until gRPC's keepalive gave up on the stream (61 s here, "Stream
    removed (ping timeout)"), or the call's deadline. While servers
    save, each one still saving is probed (ServerInfo); one that answers no
    probe PROBE_MISSES times in a row fails the save with Unavailable naming
    it, nothing listed; the other servers' saves are unaffected, and the
    next save, once it answers again, succeeds."""
    import signal
    import time

    from coordinator import checkpoint_io
    from psserver.errors import Unavailable
    monkeypatch.setattr(checkpoint_io, "PROBE_EVERY", 0.2)
    monkeypatch.setattr(checkpoint_io, "PROBE_SECONDS", 0.5)
    monkeypatch.setattr(checkpoint_io, "PROBE_MISSES", 2)
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = strategy.create_variable("w", shape=(8, 2), initializer="ones")
        strategy.create_embedding_table("t", 2, initializer="ones")
        manager = CheckpointManager(strategy, str(tmp_path))
        manager.save(1)
        hung = cluster.ps[1]
        os.kill(hung.task_pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(Unavailable, match=f"{hung.address} answered nothing .* hangs"):
                manager.save(2)
            assert time.monotonic() - start < 30
            assert [os.path.basename(p) for p in manager.checkpoints()] == ["ckpt-00000001"]
            assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001"]
        finally:
            os.kill(hung.task_pid, signal.SIGCONT)
        assert os.path.basename(manager.save(3)) == "ckpt-00000003"
        np.testing.assert_array_equal(w.read(), np.ones((8, 2), np.float32))


def test_a_save_that_fails_on_one_server_fails_at_once_while_another_hangs(tmp_path,
                                                                           monkeypatch):
    """The first save call to fail ends the save with its error, whichever
    server's reply would have been read first (here the hung one's: waiting
    on it would have taken until gRPC gave up)."""
    import signal
    import time

    from coordinator import checkpoint_io
    from psserver.client.admin import PSAdmin
    from psserver.errors import ResourceExhausted
    monkeypatch.setattr(checkpoint_io, "PROBE_MISSES", 1000)   # no probe ends it
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        strategy.create_variable("w", shape=(8, 2), initializer="ones")
        manager = CheckpointManager(strategy, str(tmp_path))
        hung, failing = cluster.ps[0], cluster.ps[1]
        real = PSAdmin.save_incremental

        def save_incremental(self, *args, **kwargs):
            if self.address == failing.address:
                raise ResourceExhausted("no room left on the device (a test)")
            return real(self, *args, **kwargs)
        monkeypatch.setattr(PSAdmin, "save_incremental", save_incremental)
        os.kill(hung.task_pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(ResourceExhausted, match="no room left"):
                manager.save(1)
            assert time.monotonic() - start < 20
            assert manager.checkpoints() == []
        finally:
            os.kill(hung.task_pid, signal.SIGCONT)
