"""Incremental checkpoints on real clusters: chains restored bit for bit and
resharded, crashes and failed saves losing nothing, retention that keeps
chains whole, the operator CLI; unknown save ids refused over the wire."""
from __future__ import annotations

import json
import os
import shutil
import time
import zlib

import numpy as np
import pytest

from coordinator import (
    FixedShardsPartitioner,
    LocalCluster,
    ParameterServerStrategy,
    ps_pool,
    push_gradients,
    read_variables,
)
from coordinator.checkpoint import CheckpointManager
from coordinator.checkpoint_files import (
    CheckpointError,
    chain_of,
    load_table,
    load_variable,
)
from coordinator.step_calls import IndexedSlices
from psserver.errors import FailedPrecondition, PSError

pytestmark = pytest.mark.timeout(240)

KEYS = np.arange(0, 400, 3, dtype=np.int64)   # 134 keys for a table of capacity 60


def make_model(strategy, capacity: int = 60):
    emb = strategy.create_variable("emb", shape=(200, 8), initializer="random_normal", seed=1,
                                   optimizer="adam", optimizer_params={"learning_rate": 0.05})
    dense = strategy.create_variable("dense", shape=(8, 4), initializer="random_normal",
                                     seed=2, optimizer="momentum")
    bias = strategy.create_variable("bias", shape=(4,), optimizer="sgd")
    table = strategy.create_embedding_table("tab", 4, initializer="random_normal", seed=3,
                                            optimizer="adam", capacity=capacity)
    return emb, dense, bias, table


def train(model, rng, steps: int = 1):
    """Row-wise pushes to a few rows, a dense push now and then, look-ups and
    row gradients of a dynamic table (over its capacity: it evicts)."""
    emb, dense, bias, table = model
    for _ in range(steps):
        ids = rng.choice(200, 3, replace=False)
        pairs = [(emb, IndexedSlices(rng.normal(size=(3, 8)).astype(np.float32), ids))]
        if rng.random() < 0.4:
            pairs.append((dense, rng.normal(size=(8, 4)).astype(np.float32)))
        push_gradients(pairs)
        keys = np.unique(rng.choice(KEYS, 12))
        table.lookup(keys)
        table.push_gradient(keys, rng.normal(size=(keys.size, 4)).astype(np.float32))


def composed(path, model):
    chain = chain_of(path)
    return ([load_variable(v, chain) for v in model[:3]], load_table(model[3], chain)[0])


def assert_same_state(got, want, age_gap: float = 0.0):
    """Two composed checkpoints: variables (values, slots, versions, update
    keys, scalar slots per shard) and the table's arrays bit for bit; ages
    in seconds up to ``age_gap`` (the time between the two saves)."""
    (gv, gt), (wv, wt) = got, want
    for a, b in zip(gv, wv):
        assert a["value"].tobytes() == b["value"].tobytes()
        assert set(a["slots"]) == set(b["slots"])
        for k in b["slots"]:
            assert a["slots"][k].tobytes() == b["slots"][k].tobytes(), k
        assert a["version"] == b["version"]
        assert a["same_cut"].keys() == b["same_cut"].keys()
        for cut, (version, applied, scalars) in b["same_cut"].items():
            g = a["same_cut"][cut]
            assert g[0] == version and np.array_equal(g[1], applied), cut
            assert {k: v.tobytes() for k, v in g[2].items()} == \
                {k: v.tobytes() for k, v in scalars.items()}
    assert set(gt) == set(wt)
    for k in wt:
        if k == "age_seconds":
            np.testing.assert_allclose(gt[k], wt[k], atol=age_gap + 1e-6)
        else:
            assert gt[k].tobytes() == wt[k].tobytes(), k


def test_base_and_ten_deltas_restore_to_a_full_save_bit_for_bit_and_reshard(tmp_path):
    """A base and 10 deltas (sparse Adam rows, momentum's dense updates,
    an Adam table that evicts), taken while nothing runs, compose to what a
    full save right after holds, bit for bit; restored into the servers
    after they wandered off, a full save gives it again; and the chain
    restores resharded into 3 servers (evicted keys stay gone)."""
    rng = np.random.default_rng(0)
    inc_dir, full_dir, again_dir = (str(tmp_path / d) for d in ("inc", "full", "again"))
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        model = make_model(strategy)
        inc = CheckpointManager(strategy, inc_dir, incremental=True, full_every=20,
                                max_to_keep=20)
        train(model, rng, 3)
        inc.save(0)
        for step in range(1, 11):
            train(model, rng)
            started = time.monotonic()
            last = inc.save(step)
        full = CheckpointManager(strategy, full_dir).save(10)
        gap = time.monotonic() - started   # ages in seconds differ by at most this
        chain = chain_of(last)
        assert [os.path.basename(p) for p, _ in chain] == [f"ckpt-{i:08d}" for i in range(11)]
        kinds = {e["kind"] for _, m in chain[1:] for info in m["variables"].values()
                 for e in info["shards"]}
        assert kinds == {"delta", "full", "unchanged"}   # dense: full or unchanged
        assert_same_state(composed(last, model), composed(full, model), gap)
        values = read_variables(list(model[:3]))
        saved_keys = composed(full, model)[1]["keys"]
        stats = model[3].stats()
        assert stats.evicted_capacity > 0 and saved_keys.size == stats.rows < stats.admitted
        rows = model[3].lookup(KEYS, admit=False)

        train(model, rng, 4)                                # wander off...
        inc.restore(last)                                   # ...and come back
        again = CheckpointManager(strategy, again_dir).save(10)
        assert_same_state(composed(again, model), composed(full, model), 60.0)
        assert inc.save(11) and "chain" not in json.load(     # restored: a new base
            open(os.path.join(inc.latest(), "manifest.json")))
    with LocalCluster(num_ps=3, num_workers=0) as three:
        strategy = ParameterServerStrategy(three.spec,
                                           variable_partitioner=FixedShardsPartitioner(3))
        model3 = make_model(strategy, capacity=1000)   # (60 in 3 shards would evict)
        CheckpointManager(strategy, inc_dir).restore(last)
        for got, want in zip(read_variables(list(model3[:3])), values):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(model3[3].lookup(KEYS, admit=False), rows)
        assert model3[3].stats().rows == saved_keys.size
        held = composed(CheckpointManager(strategy, str(tmp_path / "three")).save(1), model3)
        np.testing.assert_array_equal(held[1]["keys"], saved_keys)   # evicted: absent


def test_a_crash_while_writing_a_delta_keeps_the_previous_chain_restorable(tmp_path):
    """The servers die in the middle of writing a delta (fault switch): the
    save fails, nothing partial is listed, and the previous delta restores
    (with its chain) into a fresh cluster as it was saved. (The first
    failure ends the save and cancels the calls not yet sent: a server may
    never get its delta, and live on.)"""
    rng = np.random.default_rng(1)
    with LocalCluster(num_ps=2, num_workers=0, restart=(),
                      env={"PSTRAIN_FAULT_CRASH_IN_SAVE": "delta"}) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        model = make_model(strategy)
        from coordinator.ps_pool import (
            client_for,  # (calls to a dead server fail at once)
        )
        inc = CheckpointManager(strategy, str(tmp_path), incremental=True,
                                client_for=client_for)
        train(model, rng, 2)
        base = inc.save(1)                  # a base: written whole, no crash
        with pytest.raises(PSError):
            train(model, rng)
            inc.save(2)                     # a delta: the servers die writing it
        deadline = time.monotonic() + 30    # (their sockets close while they exit)
        while all(p.alive() for p in cluster.ps):
            assert time.monotonic() < deadline, "no server crashed writing its delta"
            time.sleep(0.05)
        assert inc.checkpoints() == [base] and os.listdir(tmp_path) == ["ckpt-00000001"]
    with LocalCluster(num_ps=2, num_workers=0) as fresh:
        strategy = ParameterServerStrategy(fresh.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        model2 = make_model(strategy)
        CheckpointManager(strategy, str(tmp_path)).restore()
        assert_same_state(composed(CheckpointManager(strategy, str(tmp_path / "x")).save(1),
                                   model2), composed(base, model), 120.0)


def test_a_failed_save_and_an_uncommitted_one_lose_nothing(tmp_path, monkeypatch):
    """A save that fails after the servers wrote (the manifest write fails,
    as when the coordinator dies before the rename) leaves its changes to
    the next delta; a save whose commit never reached the servers (a
    coordinator that died right after the rename) is followed by a delta of
    it, also by a new CheckpointManager (a restarted coordinator)."""
    from coordinator import checkpoint_io as ckpt_module
    rng = np.random.default_rng(2)
    with LocalCluster(num_ps=2, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        model = make_model(strategy)
        inc = CheckpointManager(strategy, str(tmp_path / "inc"), incremental=True)
        train(model, rng, 2)
        inc.save(1)
        train(model, rng, 2)
        real_write = ckpt_module._write_json

        def fails(*a, **k):
            raise OSError("disk full")
        monkeypatch.setattr(ckpt_module, "_write_json", fails)
        with pytest.raises(OSError):
            inc.save(2)
        train(model, rng)
        with pytest.raises(OSError):   # twice: the next delta takes both again
            inc.save(2)
        monkeypatch.setattr(ckpt_module, "_write_json", real_write)
        train(model, rng)
        monkeypatch.setattr(ckpt_module, "_commit", lambda *a: None)   # never committed
        third = inc.save(3)
        monkeypatch.undo()
        train(model, rng)
        restarted = CheckpointManager(strategy, str(tmp_path / "inc"), incremental=True)
        started = time.monotonic()
        fourth = restarted.save(4)
        full = CheckpointManager(strategy, str(tmp_path / "full")).save(4)
        gap = time.monotonic() - started
        assert [os.path.basename(p) for p, _ in chain_of(fourth)] == \
            ["ckpt-00000001", "ckpt-00000003", "ckpt-00000004"]
        assert json.load(open(os.path.join(third, "manifest.json")))["chain"]["parent"] == \
            "ckpt-00000001"
        assert_same_state(composed(fourth, model), composed(full, model), gap)


def test_retention_keeps_chains_whole_and_the_cli_lists_restores_and_exports(
        tmp_path, monkeypatch, capsys):
    """max_to_keep=2 with a base every 3 saves keeps the chains the newest
    two need; saving a step again removes the deltas that needed it; the
    CLI lists kinds and parents, restores a delta with its chain, and
    writes serving exports."""
    from coordinator import cli
    ckpt_dir = str(tmp_path / "ckpt")
    with LocalCluster(num_ps=1, num_workers=0, checkpoint_dirs=(str(tmp_path),)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        w = strategy.create_variable("w", shape=(10, 2), optimizer="adagrad")
        table = strategy.create_embedding_table("t", 2)
        inc = CheckpointManager(strategy, ckpt_dir, incremental=True, full_every=3,
                                max_to_keep=2)
        values = {}
        for step in range(1, 8):
            w.push_sparse(np.array([step]), np.ones((1, 2), np.float32))
            table.lookup([step])
            inc.save(step)
            values[step] = w.read()
        names = [os.path.basename(p) for p in inc.checkpoints()]
        assert names == ["ckpt-00000004", "ckpt-00000005", "ckpt-00000006", "ckpt-00000007"]
        for step in (4, 5, 6, 7):
            inc.restore(os.path.join(ckpt_dir, f"ckpt-{step:08d}"))
            np.testing.assert_array_equal(w.read(), values[step])

        for k, v in cluster.tls.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", cluster.token)
        capsys.readouterr()
        assert cli.main(["checkpoint", "list", ckpt_dir, "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)["checkpoints"]
        assert [(c["kind"], c["parent"], c["base"]) for c in listed] == [
            ("full", None, None), ("delta", "ckpt-00000004", "ckpt-00000004"),
            ("delta", "ckpt-00000005", "ckpt-00000004"), ("full", None, None)]
        w.push_sparse(np.array([0]), np.ones((1, 2), np.float32))
        ps = ["--ps", ",".join(cluster.spec.ps)]
        assert cli.main(["checkpoint", "restore", ckpt_dir, "--path", "ckpt-00000006",
                         "--json", *ps]) == 0
        assert json.loads(capsys.readouterr().out)["chain"] == [
            "ckpt-00000004", "ckpt-00000005", "ckpt-00000006"]
        np.testing.assert_array_equal(w.read(), values[6])

        inc.save(5)   # step 5 again: a base; 6, a delta of the old 5, goes
        assert [os.path.basename(p) for p in inc.checkpoints()] == \
            ["ckpt-00000005", "ckpt-00000007"]

        refused = []

        class Forgetful:   # a server that no longer knows the parent's save
            def __init__(self, address):
                self.client = ps_pool.client_for(address)

            def __getattr__(self, name):
                return getattr(self.client, name)

            def save_incremental(self, *a, since=0, **k):
                if since and not refused:
                    refused.append(since)
                    raise FailedPrecondition("save id unknown")
                return self.client.save_incremental(*a, since=since, **k)
        forgetful = CheckpointManager(strategy, ckpt_dir, incremental=True, client_for=Forgetful)
        w.push_sparse(np.array([9]), np.ones((1, 2), np.float32))
        path = forgetful.save(8)   # written whole instead, and a delta follows it
        assert refused and "chain" not in json.load(open(os.path.join(path, "manifest.json")))
        w.push_sparse(np.array([9]), np.ones((1, 2), np.float32))
        values[9] = w.read()
        assert "chain" in json.load(open(os.path.join(forgetful.save(9), "manifest.json")))
        inc.restore()
        np.testing.assert_array_equal(w.read(), values[9])

        export_dir = str(tmp_path / "export")
        assert cli.main(["export", export_dir, "--every", "0.05", "--count", "2", "--json",
                         *ps]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [x["kind"] for x in lines] == ["base", "delta"]
        assert cli.main(["checkpoint", "restore", export_dir, *ps]) == 1
        assert "serving export" in capsys.readouterr().err
        assert cli.main(["export", export_dir, "--every", "0", *ps]) == 2


def test_a_checkpoint_is_removed_only_once_no_chain_needs_it_and_pins_survive_retention(
        tmp_path):
    """CheckpointManager.remove (CheckpointCallback's candidates): a base a
    delta needs stays until the delta goes; a pinned checkpoint survives
    max_to_keep, and the next delta does not follow a removed one."""
    with LocalCluster(num_ps=1, num_workers=0, checkpoint_dirs=(str(tmp_path),)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        w = strategy.create_variable("w", shape=(4, 2), optimizer="sgd")
        inc = CheckpointManager(strategy, str(tmp_path / "c"), incremental=True,
                                max_to_keep=1)
        base = inc.save(1, candidate=True)
        inc.pinned = {base}
        w.push_sparse(np.array([1]), np.ones((1, 2), np.float32))
        delta = inc.save(2, candidate=True)
        assert inc.checkpoints() == [base, delta]   # pinned, and the delta's base anyway
        assert not inc.remove(base) and inc.checkpoints() == [base, delta]
        assert inc.remove(delta) and inc.remove(base) and inc.checkpoints() == []
        w.push_sparse(np.array([2]), np.ones((1, 2), np.float32))
        third = inc.save(3)   # a base: what it would have followed is gone
        assert [p for p, _ in chain_of(third)] == [third]
        inc.restore(third)
        assert not inc.remove(third)   # not a candidate: only retention removes it
        fourth = inc.save(4, candidate=True)
        assert inc.save(4) == fourth   # saved again, not as a candidate: someone wants it
        assert not inc.remove(fourth) and fourth in inc.checkpoints()


def test_unknown_save_ids_are_refused_over_the_wire_with_nothing_written(start_ps, tmp_path):
    from psserver.client import PSClient

    server = start_ps("--checkpoint-dir", str(tmp_path))
    with PSClient(server.address) as c:
        c.create_variable("w", initial_value=np.arange(4, dtype=np.float32))
        first = c.save_incremental(str(tmp_path), save_id=1, stream="s")
        assert [f.kind for f in first.files] == [0] and first.incarnation
        (tmp_path / "next").mkdir()
        with pytest.raises(FailedPrecondition, match="unknown"):
            c.save_incremental(str(tmp_path / "next"), save_id=2, since=99, stream="s",
                               incarnation=first.incarnation)
        assert os.listdir(tmp_path / "next") == []
        for save_id, stream, incarnation in ((99, "s", first.incarnation),
                                             (1, "s", "someone-else")):
            with pytest.raises(FailedPrecondition):
                c.commit_save(save_id, stream, incarnation)
        c.push_sparse("w", np.array([2]), np.ones((1,), np.float32))
        reply = c.save_incremental(str(tmp_path / "next"), save_id=3, since=1, stream="s",
                                   incarnation=first.incarnation)
        assert [(f.kind, f.rows) for f in reply.files] == [(1, 1)]   # a delta of row 2
        assert c.commit_save(3, "s", first.incarnation).variables == 1
    shutil.rmtree(tmp_path / "next")


def test_a_refused_save_notes_no_save_id_and_pushes_no_stream_out(start_ps, tmp_path):
    """A Save refused for its directory or names (variables and tables)
    leaves the server as it was: its save id is not one the server took,
    and more refused saves on new streams than it keeps streams push no
    real stream out."""
    from psserver.client import PSClient
    from psserver.core.saving import STREAMS_KEPT
    from psserver.errors import InvalidArgument, NotFound, PermissionDenied

    server = start_ps("--checkpoint-dir", str(tmp_path))
    with PSClient(server.address) as c:
        c.create_variable("w", initial_value=np.arange(4, dtype=np.float32))
        c.create_table("t", 2)
        inc = c.save_incremental(str(tmp_path), save_id=1, stream="s").incarnation
        refused = []
        for i in range(STREAMS_KEPT + 6):
            with pytest.raises(PermissionDenied):
                c.save_incremental("/etc", save_id=100 + i, stream=f"x{i}")
            refused.append((100 + i, f"x{i}"))
        for save_id, stream, call, err in (
                (200, "y", lambda **f: c.save_incremental(str(tmp_path / "missing"), **f),
                 InvalidArgument),
                (201, "z", lambda **f: c.save_incremental(str(tmp_path), ["nope"], **f),
                 NotFound),
                (202, "u", lambda **f: c.save_table("t", "/etc", **f), PermissionDenied)):
            with pytest.raises(err):
                call(save_id=save_id, stream=stream)
            refused.append((save_id, stream))
        (tmp_path / "next").mkdir()
        for save_id, stream in refused:
            with pytest.raises(FailedPrecondition, match="unknown"):
                c.save_incremental(str(tmp_path / "next"), save_id=300, since=save_id,
                                   stream=stream, incarnation=inc)
        assert os.listdir(tmp_path / "next") == []
        c.push_sparse("w", np.array([2]), np.ones((1,), np.float32))
        reply = c.save_incremental(str(tmp_path / "next"), save_id=3, since=1, stream="s",
                                   incarnation=inc)
        assert [(f.kind, f.rows) for f in reply.files] == [(1, 1)]   # still a delta since 1
    shutil.rmtree(tmp_path / "next")


def test_a_serving_export_is_not_restored_as_a_checkpoint(tmp_path):
    with LocalCluster(num_ps=1, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        strategy.create_variable("w", shape=(3,), optimizer="adam")
        path = CheckpointManager(strategy, str(tmp_path), incremental=True,
                                 weights_only=True).save(1)
        with pytest.raises(CheckpointError, match="serving export"):
            CheckpointManager(strategy, str(tmp_path)).restore(path)


def _replicated_step(w, table, seed: int):
    """A worker's step: rows of w and of the table (looked up, updated)."""
    from coordinator import push_gradients as push
    rng = np.random.default_rng(seed)
    ids = rng.choice(40, 4, replace=False)
    push([(w, IndexedSlices(np.ones((4, 2), np.float32), ids))])
    keys = np.unique(rng.integers(0, 100, 8))
    table.lookup(keys)
    table.push_gradient(keys, np.ones((keys.size, 2), np.float32))


def test_a_failed_over_shard_is_saved_whole_and_the_chain_stays_exact(tmp_path):
    """Replication: a server dies and its shards' backups are promoted. The
    next incremental save writes the promoted copies whole (their changes
    since the base are not known there) and the others as deltas; the
    chain composes to what the servers hold."""
    from coordinator import ClusterCoordinator
    with LocalCluster(num_ps=2, num_workers=1, restart=()) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = strategy.create_variable("w", shape=(40, 2), optimizer="adam")
        table = strategy.create_embedding_table("t", 2, initializer="random_normal",
                                                optimizer="adagrad")
        inc = CheckpointManager(strategy, str(tmp_path), incremental=True)
        with ClusterCoordinator(strategy, ps_check_interval=0.2, ps_failover_after=1.0,
                                ps_recovery_timeout=10.0) as coord:
            def run(first, n):
                coord.fetch([coord.schedule(_replicated_step, args=(w, table, s))
                             for s in range(first, first + n)])
            run(0, 10)
            inc.save(1)
            run(10, 5)
            second = inc.save(2)
            cluster.kill_ps(1)
            run(15, 10)   # fails over, and goes on
            dead = cluster.spec.ps[1]
            deadline = time.monotonic() + 60   # the recovery's own routes moved off it
            while any(c.address == dead for c in ps_pool.servers().routes.primaries(w)
                      + table.primaries()):
                assert time.monotonic() < deadline, "the failover did not complete"
                time.sleep(0.05)
            assert coord.cluster.recovery.lost == {dead}
            third = inc.save(3)
            keys = np.arange(100, dtype=np.int64)
            want_w, want_rows = w.read(), table.lookup(keys, admit=False)

    def kinds(path):
        m = json.load(open(os.path.join(path, "manifest.json")))
        return ([e["kind"] for e in m["variables"]["w"]["shards"]],
                [e["kind"] for e in m["tables"]["t"]["shards"]])
    assert kinds(second) == (["delta", "delta"], ["delta", "delta"])
    assert kinds(third) == (["delta", "full"], ["delta", "full"])   # shard 1: promoted
    chain = chain_of(third)
    assert len(chain) == 3
    np.testing.assert_array_equal(load_variable(w, chain)["value"], want_w)
    state, _ = load_table(table, chain)
    held = np.isin(keys, state["keys"])
    np.testing.assert_array_equal(state["values"], want_rows[held])
    assert not want_rows[~held].any()   # keys it does not hold: no row there either


def test_a_manifest_cannot_point_the_reader_outside_its_checkpoint(tmp_path):
    """Chains name parents by directory name beside them and files inside
    the checkpoint: a manifest naming anything else is refused, unread."""
    from coordinator.checkpoint_files import load_checked_shard
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"x")
    ckpt = tmp_path / "d" / "ckpt-00000002"
    ckpt.mkdir(parents=True)
    for parent in ("../secret", "ckpt-1/../../x", 7):
        (ckpt / "manifest.json").write_text(json.dumps(
            {"step": 2, "variables": {}, "chain": {"parent": parent, "parent_id": 1}}))
        with pytest.raises(CheckpointError, match="no valid parent"):
            chain_of(str(ckpt))
    for name in ("../../secret.safetensors", str(secret)):
        with pytest.raises(CheckpointError, match="outside the checkpoint"):
            load_checked_shard(str(ckpt), {"file": name, "rows": 1, "version": 0},
                               "float32", (1,), "sgd")


def test_a_checkpoint_the_servers_would_refuse_is_refused_before_any_is_written(tmp_path):
    """Every variable and table of a checkpoint is read and checked before any
    server is written: table files whose per-row arrays have another shape or
    dtype, or rows a server refuses (negative ages, NaN in
    a slot, ages past the step), and malformed manifests (a format version
    that is not a number, shard entries that are not objects, unchanged
    entries without a valid version) are refused with CheckpointError, the
    variables and the table on the server as they were."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with LocalCluster(num_ps=1, num_workers=0) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        w = strategy.create_variable("w", shape=(4, 2), initializer="ones", optimizer="adam")
        table = strategy.create_embedding_table("t", 2, initializer="random_normal",
                                                optimizer="adam")
        keys = np.arange(10, dtype=np.int64)
        table.lookup(keys)
        table.push_gradient(keys, np.ones((10, 2), np.float32))
        ckpt = CheckpointManager(strategy, str(tmp_path), incremental=True)
        base = ckpt.save(1)
        table.push_gradient(keys[:3], np.ones((3, 2), np.float32))
        delta = ckpt.save(2)   # w unchanged, the table a delta
        saved = (w.read(), table.lookup(keys, admit=False))
        w.push_gradient(np.ones((4, 2), np.float32))
        table.push_gradient(keys, np.ones((10, 2), np.float32))
        before = (w.read(), w.versions(), table.lookup(keys, admit=False))

        manifest_path = os.path.join(base, "manifest.json")
        manifest = json.load(open(manifest_path))
        entry = manifest["tables"]["t"]["shards"][0]
        shard = os.path.join(base, entry["file"])
        with safe_open(shard, framework="np") as f:
            meta = f.metadata()
            good = {k: f.get_tensor(k) for k in f.keys()}
        step = int(meta["step"])

        def changed(name, fn):
            def damage(t):
                t[name] = fn(t[name].copy())
            return damage

        def negative(a):   # (the last key: the delta has rows of the first three)
            a[-1] = -100
            return a

        def nan(a):
            a[-1, 0] = np.nan
            return a
        damages = {
            "age_steps longer": changed("age_steps", lambda a: np.r_[a, 0]),
            "age_steps shorter": changed("age_steps", lambda a: a[:-1]),
            "age_steps int32": changed("age_steps", lambda a: a.astype(np.int32)),
            "age_seconds 2-D": changed("age_seconds", lambda a: a.reshape(-1, 1)),
            "freq float": changed("freq", lambda a: a.astype(np.float64)),
            "a slot's rows": changed("slot/m", lambda a: a[:-1]),
            "a slot's dtype": changed("slot/v", lambda a: a.astype(np.float64)),
            "a scalar slot's shape": changed("slot/iterations", lambda a: a.reshape(1)),
            "a negative age": changed("age_steps", negative),
            "NaN in a slot": changed("slot/v", nan),
            "an age past the step": changed("age_steps", lambda a: a + step + 1),
        }
        for what, damage in damages.items():
            tensors = {k: a.copy() for k, a in good.items()}
            damage(tensors)
            save_file(tensors, shard, metadata=meta)
            entry["bytes"] = os.path.getsize(shard)
            entry["crc32"] = zlib.crc32(open(shard, "rb").read())   # (past the checksum)
            json.dump(manifest, open(manifest_path, "w"))
            with pytest.raises(CheckpointError):
                ckpt.restore(delta)
                pytest.fail(f"restored with {what}")
        save_file(good, shard, metadata=meta)
        entry["bytes"] = os.path.getsize(shard)
        entry["crc32"] = zlib.crc32(open(shard, "rb").read())
        json.dump(manifest, open(manifest_path, "w"))

        delta_path = os.path.join(delta, "manifest.json")
        good_delta = open(delta_path).read()

        def edit(fn):
            m = json.loads(good_delta)
            fn(m)
            return m
        unchanged = lambda m: m["variables"]["w"]["shards"][0]   # noqa: E731
        malformed = {
            "format_version a string": edit(lambda m: m.update(format_version="9")),
            "a shard entry a string": edit(
                lambda m: m["variables"]["w"].update(shards=["ps-0/w.safetensors"])),
            "table shards an object": edit(lambda m: m["tables"]["t"].update(shards={})),
            "a variable an array": edit(lambda m: m["variables"].update(w=[1])),
            "an unchanged entry's version a string": edit(
                lambda m: unchanged(m).update(version="x")),
            "an unchanged entry without a version": edit(lambda m: unchanged(m).pop("version")),
            "an unchanged entry without rows": edit(lambda m: unchanged(m).pop("rows")),
            "a negative version": edit(lambda m: unchanged(m).update(version=-1)),
            "an unknown kind": edit(lambda m: unchanged(m).update(kind="partial")),
        }
        assert unchanged(json.loads(good_delta))["kind"] == "unchanged"
        for what, m in malformed.items():
            json.dump(m, open(delta_path, "w"))
            with pytest.raises(CheckpointError):
                ckpt.restore(delta)
                pytest.fail(f"restored with {what}")
        after = (w.read(), w.versions(), table.lookup(keys, admit=False))
        open(delta_path, "w").write(good_delta)
        ckpt.restore(delta)   # whole again: restored
        restored = (w.read(), table.lookup(keys, admit=False))
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1] == before[1]
    np.testing.assert_array_equal(after[2], before[2])
    np.testing.assert_array_equal(restored[0], saved[0])
    np.testing.assert_array_equal(restored[1], saved[1])
