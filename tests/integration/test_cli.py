"""The operator CLI (coordinator ps ... / coordinator checkpoint ...) against a live cluster.

One LocalCluster (real processes, auth token and mutual TLS) serves the
module; the CLI runs in-process through ``coordinator.cli.main(argv)`` with
the cluster's token and TLS in the environment, and once as a subprocess
(``python -m coordinator``). Tests that change variables put them back.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from coordinator import (
    FixedShardsPartitioner,
    LocalCluster,
    ParameterServerStrategy,
    cli,
    ps_pool,
)
from coordinator.checkpoint import CheckpointManager
from coordinator.checkpoint_files import CheckpointError
from coordinator.checkpoint_layout import (
    LayoutMismatch,
    layout_from_listing,
    restore_plan,
    split_shard_name,
)
from coordinator.step_calls import push_gradients, read_variables
from psserver.client import PSClient
from psserver.contract import PROTOCOL_VERSION
from psserver.process import child_env, start_task
from psserver.serve.server import build_parser as psserver_parser
from psworker.worker import build_parser as psworker_parser

pytestmark = pytest.mark.timeout(120)

PUSHES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live():
    """A 2-ps, 1-worker cluster with three variables, trained a little:
    dense/w (10, 3) in 2 shards (adam), emb (7, 4) in 3 shards (adagrad),
    bias (3,) whole (sgd); every shard at version PUSHES."""
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        rng = np.random.default_rng(0)
        w = strategy.create_variable("dense/w",
                                     initial_value=rng.normal(size=(10, 3)).astype("float32"),
                                     optimizer="adam", optimizer_params={"learning_rate": 0.05})
        emb = strategy.create_variable("emb", shape=(7, 4), initializer="ones", optimizer="adagrad",
                                       partitioner=FixedShardsPartitioner(3))
        bias = strategy.create_variable("bias", shape=(3,), initializer="zeros", partitioner=None)
        ns = SimpleNamespace(cluster=cluster, strategy=strategy, w=w, emb=emb, bias=bias,
                             variables=[w, emb, bias])
        train(ns, PUSHES, seed=1)
        yield ns


def train(ns, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        push_gradients([(v, rng.normal(size=v.shape).astype("float32")) for v in ns.variables])


@pytest.fixture
def env(live, monkeypatch):
    """The cluster in TF_CONFIG, its token and TLS in the environment (as an operator has)."""
    spec = live.cluster.snapshot()
    monkeypatch.delenv("TF_CONFIG_FILE", raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec.as_dict()}))
    monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", live.cluster.token)
    for k, v in live.cluster.tls.env().items():
        monkeypatch.setenv(k, v)
    return spec


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def squeeze(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines()]


# -- ps list -------------------------------------------------------------------------------
def test_ps_list_shows_each_shard_with_its_variable_shape_and_version(live, env, capsys):
    code, out, err = run(capsys, "ps", "list")
    assert code == 0, err
    lines = squeeze(out)
    assert lines[0] == f"ps 0 at {env.ps[0]}" and f"ps 1 at {env.ps[1]}" in lines
    # NAME VARIABLE SHARD ROWS DTYPE SHAPE VERSION OPTIMIZER BYTES
    expected = [
        rf"dense/w/part_0 dense/w 0 of 2 0:5 float32 \[5, 3\] {PUSHES} adam \d+ B",
        rf"dense/w/part_1 dense/w 1 of 2 5:10 float32 \[5, 3\] {PUSHES} adam \d+ B",
        rf"emb/part_0 emb 0 of 3 0:3 float32 \[3, 4\] {PUSHES} adagrad \d+ B",
        rf"emb/part_1 emb 1 of 3 3:5 float32 \[2, 4\] {PUSHES} adagrad \d+ B",
        rf"emb/part_2 emb 2 of 3 5:7 float32 \[2, 4\] {PUSHES} adagrad \d+ B",
        rf"bias bias - 0:3 float32 \[3\] {PUSHES} sgd 12 B",
    ]
    for pattern in expected:
        assert any(re.fullmatch(pattern, line) for line in lines), (pattern, out)
    assert sum(line.startswith("total: ") for line in lines) == 2      # one per server
    assert lines[-1].startswith("all: 6 variable(s) and 0 table shard(s) (0 rows) on 2 of 2 "
                                "parameter server(s)")


def test_ps_list_json_matches_the_variables(live, env, capsys):
    code, out, _ = run(capsys, "ps", "list", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["source"] == "TF_CONFIG"
    assert [s["address"] for s in doc["servers"]] == list(env.ps)
    entries = {e["name"]: {**e, "address": s["address"]}
               for s in doc["servers"] for e in s["variables"]}
    for v in live.variables:
        for i, (shard, meta) in enumerate(zip(v.shards, v.meta())):
            e = entries[shard.name]
            assert e["address"] == shard.address
            assert e["variable"] == v.name
            assert (e["shard"], e["num_shards"]) == ((i, v.num_shards) if v.num_shards > 1
                                                     else (None, 1))
            assert (e["offset"], e["rows"]) == (shard.offset, shard.rows)
            assert e["shape"] == [shard.rows, *v.shape[1:]] and e["dtype"] == "float32"
            assert e["version"] == meta.version == PUSHES
            assert e["optimizer"] == v.optimizer
            assert e["bytes"] == e["value_bytes"] + e["slot_bytes"]
            assert e["value_bytes"] == shard.rows * int(np.prod(v.shape[1:])) * 4
    assert entries["dense/w/part_0"]["slot_bytes"] > 0            # adam's m and v
    for s in doc["servers"]:
        assert s["total"]["variables"] == len(s["variables"])
        assert s["total"]["bytes"] == sum(e["bytes"] for e in s["variables"])
    assert doc["total"]["bytes"] == sum(s["total"]["bytes"] for s in doc["servers"])


@pytest.mark.timeout(60)
def test_the_cli_as_a_subprocess(live, env, tmp_path):
    """python -m coordinator, the cluster in a TF_CONFIG_FILE; a checkpoint round trip."""
    cfg = tmp_path / "tf_config.json"
    cfg.write_text(json.dumps({"cluster": env.as_dict()}))
    penv = child_env({"TF_CONFIG_FILE": str(cfg), "PSTRAIN_AUTH_TOKEN": live.cluster.token,
                      **live.cluster.tls.env()})
    penv.pop("TF_CONFIG", None)

    def coordinator(*argv):
        return subprocess.run([sys.executable, "-m", "coordinator", *argv], env=penv,
                              capture_output=True, text=True, timeout=50, check=False)
    r = coordinator("ps", "list", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["source"] == f"TF_CONFIG_FILE={cfg}"
    assert sum(s["total"]["variables"] for s in doc["servers"]) == 6
    r = coordinator("ps", "health")
    assert r.returncode == 0 and "3 of 3 task(s) healthy" in r.stdout, r.stdout + r.stderr
    r = coordinator("checkpoint", "save", str(tmp_path / "ckpts"))
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip()
    assert os.path.isfile(os.path.join(path, "manifest.json")) and "saved 3 variable(s)" in r.stderr
    r = coordinator("checkpoint", "restore", str(tmp_path / "ckpts"))
    assert r.returncode == 0 and r.stdout.startswith(f"restored {path}"), r.stdout + r.stderr
    r = coordinator("ps", "list", "--ps", f"127.0.0.1:{free_port()}")
    assert r.returncode == 1 and "nothing answers at 127.0.0.1:" in r.stderr


# -- ps health -----------------------------------------------------------------------------
def test_ps_health_lists_every_task_as_serving(live, env, capsys):
    code, out, err = run(capsys, "ps", "health")
    assert code == 0, err
    lines = squeeze(out)
    assert lines[0].split() == ["ROLE", "TASK", "ADDRESS", "HEALTH", "PROTOCOL", "SERVER", "ID",
                                "VARIABLES", "TABLE", "SHARDS", "TABLE", "ROWS", "BYTES"]
    for role, addrs in (("ps", env.ps), ("worker", env.worker)):
        for i, addr in enumerate(addrs):
            assert any(line.startswith(f"{role} {i} {addr} SERVING") for line in lines), out
    assert lines[-1] == "3 of 3 task(s) healthy"

    code, out, _ = run(capsys, "ps", "health", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True
    tasks = {(t["role"], t["index"]): t for t in doc["tasks"]}
    assert set(tasks) == {("ps", 0), ("ps", 1), ("worker", 0)}
    assert all(t["status"] == "SERVING" and t["serving"] and t["error"] is None
               for t in tasks.values())
    listing = json.loads(run(capsys, "ps", "list", "--json")[1])
    for s in listing["servers"]:
        info = tasks[("ps", s["index"])]["server_info"]
        assert info["protocol_version"] == PROTOCOL_VERSION and len(info["server_id"]) >= 8
        assert info["num_variables"] == s["total"]["variables"]
        assert info["total_bytes"] == s["total"]["bytes"]
    assert tasks[("worker", 0)]["server_info"] is None


# -- checkpoint save / restore ---------------------------------------------------------------
def test_checkpoint_save_writes_what_checkpoint_manager_writes_and_restores(live, env, capsys,
                                                                          tmp_path):
    code, out, err = run(capsys, "checkpoint", "save", str(tmp_path / "cli"), "--extra",
                         '{"epoch": 7}')
    assert code == 0, err
    path = out.strip()
    assert path == str(tmp_path / "cli" / f"ckpt-{PUSHES:08d}")   # default step: the versions
    assert os.listdir(tmp_path / "cli") == [os.path.basename(path)]   # no tmp dir left
    saved = read_variables(live.variables)
    # The manifest is the one CheckpointManager writes for the same variables.
    ours = json.loads((tmp_path / "cli" / os.path.basename(path) / "manifest.json").read_text())
    manager = CheckpointManager(live.strategy, str(tmp_path / "manager"))
    with open(os.path.join(manager.save(step=PUSHES), "manifest.json")) as f:
        theirs = json.load(f)
    assert set(ours) == set(theirs)

    # (Two saves of one state may differ in their files' checksums: safetensors
    # writes a file's metadata in any order.)
    def unsummed(m):
        return {n: {**v, "shards": [{k: x for k, x in e.items() if k != "crc32"}
                                    for e in v["shards"]]} for n, v in m["variables"].items()}
    assert unsummed(ours) == unsummed(theirs)
    assert (ours["format_version"], ours["step"], ours["extra"]) == (1, PUSHES, {"epoch": 7})
    # ... and CheckpointManager restores it.
    train(live, 2, seed=5)
    assert not np.array_equal(read_variables([live.w])[0], saved[0])
    state = CheckpointManager(live.strategy, str(tmp_path / "cli")).restore()
    assert state == {"step": PUSHES, "extra": {"epoch": 7}, "path": path}
    for e, g in zip(saved, read_variables(live.variables)):
        np.testing.assert_array_equal(g, e)
    # A second save without --step never replaces the first: it is the next one.
    code, out, _ = run(capsys, "checkpoint", "save", str(tmp_path / "cli"), "--json")
    assert code == 0 and json.loads(out)["path"].endswith(f"ckpt-{PUSHES + 1:08d}")
    code, _, err = run(capsys, "checkpoint", "save", str(tmp_path / "cli"), "--step", str(PUSHES))
    assert code == 1 and "exists already" in err
    code, out, _ = run(capsys, "checkpoint", "list", str(tmp_path / "cli"), "--json")
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [PUSHES, PUSHES + 1]


def test_checkpoint_restore_brings_the_values_back(live, env, capsys, tmp_path):
    code, out, _ = run(capsys, "checkpoint", "save", str(tmp_path), "--step", "10")
    assert code == 0
    first = out.strip()
    saved = read_variables(live.variables)
    versions = [m.version for v in live.variables for m in v.meta()]
    train(live, 2, seed=11)
    code, out, _ = run(capsys, "checkpoint", "save", str(tmp_path), "--step", "20")
    later = read_variables(live.variables)
    train(live, 1, seed=12)
    for e, g in zip(saved, read_variables(live.variables)):
        assert not np.array_equal(e, g)

    code, out, err = run(capsys, "checkpoint", "restore", str(tmp_path), "--path",
                         "ckpt-00000010")
    assert code == 0, err
    assert out.strip() == (f"restored {first} (step 10): 3 variable(s), 6 shard(s) and 0 "
                           "dynamic table(s) (0 rows) on 2 parameter server(s)")
    for e, g in zip(saved, read_variables(live.variables)):
        np.testing.assert_array_equal(g, e)
    assert [m.version for v in live.variables for m in v.meta()] == versions
    # Slots came back too: the same pushes from here give the same values as from the save.
    train(live, 2, seed=11)
    for e, g in zip(later, read_variables(live.variables)):
        np.testing.assert_array_equal(g, e)
    code, out, _ = run(capsys, "checkpoint", "restore", str(tmp_path), "--path", first, "--json")
    assert code == 0 and json.loads(out)["step"] == 10          # an absolute --path
    code, out, _ = run(capsys, "checkpoint", "restore", str(tmp_path))   # the latest: step 20
    assert code == 0 and "(step 20)" in out
    for e, g in zip(later, read_variables(live.variables)):
        np.testing.assert_array_equal(g, e)
    run(capsys, "checkpoint", "restore", str(tmp_path), "--path", first)   # leave it as found


def test_restore_refuses_another_layout_and_points_to_checkpoint_manager(live, env, capsys,
                                                                        tmp_path):
    code, out, _ = run(capsys, "checkpoint", "save", str(tmp_path / "a"))
    assert code == 0
    path = out.strip()
    other = tmp_path / "b" / "ckpt-00000001"
    shutil.copytree(path, other)
    manifest = json.loads((other / "manifest.json").read_text())
    w = manifest["variables"]["dense/w"]   # as if saved from one parameter server, unsharded
    w["shards"] = [{**w["shards"][0], "name": "dense/w", "rows": 10}]
    manifest["variables"]["new"] = {**manifest["variables"].pop("bias")}
    (other / "manifest.json").write_text(json.dumps(manifest))
    before = read_variables(live.variables)
    train(live, 1, seed=3)
    changed = read_variables(live.variables)
    code, out, err = run(capsys, "checkpoint", "restore", str(tmp_path / "b"))
    assert code == 1 and out == ""
    assert "does not have the layout of the variables on the parameter servers" in err
    assert "'dense/w' is cut into 2 shard(s) on the servers (rows 0:5, 5:10) but 1 in the " \
           "checkpoint (rows 0:10)" in err
    assert "'new' is in the checkpoint but on no parameter server" in err
    assert "'bias' is on the parameter servers but not in the checkpoint" in err
    assert "Nothing was restored" in err and "CheckpointManager(strategy" in err
    for e, g in zip(changed, read_variables(live.variables)):   # untouched
        np.testing.assert_array_equal(g, e)
    assert run(capsys, "checkpoint", "restore", str(tmp_path / "a"))[0] == 0
    for e, g in zip(before, read_variables(live.variables)):
        np.testing.assert_array_equal(g, e)


def test_no_checkpoint_found(live, env, capsys, tmp_path):
    code, _, err = run(capsys, "checkpoint", "restore", str(tmp_path))
    assert code == 1 and f"no checkpoint found in {tmp_path}" in err
    (tmp_path / "ckpt-00000005.tmp-abc").mkdir()     # an unfinished save does not count
    assert run(capsys, "checkpoint", "restore", str(tmp_path))[0] == 1
    code, _, err = run(capsys, "checkpoint", "restore", str(tmp_path / "missing"))
    assert code == 1 and "does not exist" in err
    code, _, err = run(capsys, "checkpoint", "restore", str(tmp_path), "--path", "ckpt-00000009")
    assert code == 1 and "no checkpoint at" in err and "checkpoint list" in err
    code, out, err = run(capsys, "checkpoint", "list", str(tmp_path))
    assert code == 0 and out == "" and "no checkpoint in" in err   # (an empty list)
    for missing in ("--json", None):   # a path that is not there is a mistake, not a list
        code, out, err = run(capsys, *filter(None, ("checkpoint", "list",
                                                    str(tmp_path / "missing"), missing)))
        assert code == 1 and out == "" and "does not exist" in err


@pytest.mark.timeout(60)
def test_a_server_that_dies_during_the_save_leaves_no_checkpoint(capsys, monkeypatch, tmp_path):
    with LocalCluster(num_ps=1, num_workers=0, tls=False, restart=(),
                      env={"PSTRAIN_FAULT_CRASH_IN_SAVE": "1"}) as cluster:
        # (A PSClient of its own: a strategy would reconfigure this process's shared
        # connections, which the module's cluster uses.)
        with PSClient(cluster.ps[0].address, token=cluster.token) as c:
            c.create_variable("v", (4,))
        for k in ("TF_CONFIG", "TF_CONFIG_FILE", "PSTRAIN_TLS_CERT", "PSTRAIN_TLS_KEY",
                  "PSTRAIN_TLS_CA"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", cluster.token)
        code, out, err = run(capsys, "checkpoint", "save", str(tmp_path),
                             "--ps", cluster.ps[0].address)
    assert code == 1 and out == ""
    assert f"ps 0 at {cluster.ps[0].address} stopped answering" in err
    assert "No checkpoint written" in err
    assert os.listdir(tmp_path) == []


# -- errors a person can act on -------------------------------------------------------------
def test_a_wrong_address_says_which_and_to_check_tf_config(live, env, capsys, monkeypatch,
                                                          tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": [env.ps[0], dead],
                                                            "worker": list(env.worker)}}))
    code, out, err = run(capsys, "ps", "list")
    assert code == 1
    assert f"nothing answers at {dead} (ps 1, from TF_CONFIG)" in err
    assert "that the host and port in TF_CONFIG are right" in err
    assert f"ps 0 at {env.ps[0]}" in out          # the reachable one is still listed
    code, out, err = run(capsys, "ps", "health")
    assert code == 1 and "2 of 3 task(s) healthy" in out
    assert re.search(rf"ps\s+1\s+{re.escape(dead)}\s+UNAVAILABLE", out)
    assert f"nothing answers at {dead}" in err
    code, _, err = run(capsys, "checkpoint", "save", str(tmp_path / "ckpts"))
    assert code == 1 and f"nothing answers at {dead}" in err
    assert os.listdir(tmp_path) == []
    code, _, err = run(capsys, "ps", "list", "--ps", "no-such-host.invalid:2222")
    assert code == 1 and "cannot resolve 'no-such-host.invalid'" in err and "--ps" in err


def test_a_wrong_or_missing_token_says_to_set_pstrain_auth_token(live, env, capsys, monkeypatch):
    monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", "not-the-token")
    code, out, err = run(capsys, "ps", "list")
    assert code == 1 and out == ""
    assert f"ps 0 at {env.ps[0]} refused the auth token (UNAUTHENTICATED)" in err
    assert "$PSTRAIN_AUTH_TOKEN" in err
    code, _, err = run(capsys, "ps", "list", "--token", live.cluster.token)   # --token wins
    assert code == 0, err
    monkeypatch.delenv("PSTRAIN_AUTH_TOKEN")
    code, out, err = run(capsys, "ps", "health")   # health is public; server_info is not
    assert code == 1 and "demands the cluster's auth token and none was given: set " \
                         "$PSTRAIN_AUTH_TOKEN" in err
    assert out.count("UNAUTHENTICATED: no token") == 3 and "SERVING" not in out
    assert "0 of 3 task(s) healthy" in out


@pytest.mark.timeout(60)
def test_ps_health_with_a_wrong_token_shows_why_and_counts_nobody_healthy(start_ps, capsys,
                                                                         monkeypatch):
    """Health checks answer SERVING without a token; the calls behind them do not."""
    token = {"PSTRAIN_AUTH_TOKEN": "the-right-token"}
    ps = start_ps(env=token)
    worker = start_task("psworker", ["--port", "0"], env=token)
    try:
        for k in ("TF_CONFIG", "TF_CONFIG_FILE", "PSTRAIN_TLS_CERT", "PSTRAIN_TLS_KEY",
                  "PSTRAIN_TLS_CA"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", "a-wrong-token")
        code, out, err = run(capsys, "ps", "health", "--ps", ps.address, "--worker",
                             worker.address)
        assert code == 1
        rows = squeeze(out)
        assert f"ps 0 {ps.address} UNAUTHENTICATED: wrong token" in rows, out
        assert f"worker 0 {worker.address} UNAUTHENTICATED: wrong token" in rows, out
        assert "SERVING" not in out and rows[-1] == "0 of 2 task(s) healthy"
        for what, addr in (("ps 0", ps.address), ("worker 0", worker.address)):
            assert f"{what} at {addr} refused the auth token (UNAUTHENTICATED)" in err
        doc = json.loads(run(capsys, "ps", "health", "--ps", ps.address, "--worker",
                             worker.address, "--json")[1])
        assert doc["ok"] is False
        assert [t["status"] for t in doc["tasks"]] == ["UNAUTHENTICATED: wrong token"] * 2
        monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", token["PSTRAIN_AUTH_TOKEN"])   # the right one
        code, out, _ = run(capsys, "ps", "health", "--ps", ps.address, "--worker",
                           worker.address)
        assert code == 0 and squeeze(out)[-1] == "2 of 2 task(s) healthy", out
    finally:
        worker.kill()


def test_run_checks_the_token_before_the_program_and_a_refusal_ends_in_one_line(
        live, env, capsys, monkeypatch, tmp_path):
    """Issue 35 item 1: `coordinator run` with a wrong or missing token said
    every task was serving (health is public), then the program died with
    an 80-line traceback. It asks a call of each task first, as ps health
    does; a program stopped by a refusal anyway ends in one line."""
    script = tmp_path / "train.py"
    script.write_text("import os\n"
                      "from psserver.client import PSClient\n"
                      "from psserver.tls import TLSConfig\n"
                      "with PSClient(os.environ['PS0'], tls=TLSConfig.from_env()) as c:\n"
                      "    c.server_info()\n"
                      "open(os.environ['MARK'], 'w').close()\n")
    monkeypatch.setenv("PS0", env.ps[0])
    monkeypatch.setenv("MARK", str(tmp_path / "ran"))
    for token in ("wrong", None):
        if token is None:
            monkeypatch.delenv("PSTRAIN_AUTH_TOKEN")
        else:
            monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", token)
        code, out, err = run(capsys, "run", "--wait-ready", "30", str(script))
        assert code == 2 and "PSTRAIN_AUTH_TOKEN" in err and "--token" not in err, err
        assert ("UNAUTHENTICATED" if token else "none was given") in err, err
        assert "worker 0" in err and "Traceback" not in err
        assert not (tmp_path / "ran").exists()
    monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", "wrong")   # no check: the program is refused
    code, out, err = run(capsys, "run", "--wait-ready", "0", str(script))
    assert code == 1 and len(err.strip().splitlines()) == 1 and "train.py stopped" in err, err
    monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", live.cluster.token)
    code, out, err = run(capsys, "run", "--wait-ready", "30", str(script))
    assert code == 0 and (tmp_path / "ran").exists(), err


def test_a_tls_mismatch_is_named(live, env, capsys, monkeypatch):
    for k in live.cluster.tls.env():
        monkeypatch.delenv(k)
    code, _, err = run(capsys, "ps", "list")
    assert code == 1
    assert "accepts connections but the gRPC handshake fails" in err
    assert "TLS mismatch" in err and "plaintext" in err and "$PSTRAIN_TLS_CA" in err
    monkeypatch.setenv("PSTRAIN_TLS_CERT", "/nonexistent/tls.crt")
    code, _, err = run(capsys, "ps", "list")
    assert code == 2 and "bad TLS settings" in err


def test_usage_and_configuration_errors_exit_2(capsys, monkeypatch, tmp_path):
    for k in ("TF_CONFIG", "TF_CONFIG_FILE"):
        monkeypatch.delenv(k, raising=False)
    code, _, err = run(capsys, "ps", "list")
    assert code == 2 and "no cluster description" in err and "--ps" in err
    monkeypatch.setenv("TF_CONFIG", "{oops")
    assert run(capsys, "ps", "health")[0] == 2
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["w:1"]}}')
    code, _, err = run(capsys, "checkpoint", "save", str(tmp_path))
    assert code == 2 and "no parameter servers" in err
    code, _, err = run(capsys, "ps", "list", "--ps", "justahost")
    assert code == 2 and "host:port" in err
    code, _, err = run(capsys, "checkpoint", "save", str(tmp_path), "--ps", "h:1", "--extra", "[1]")
    assert code == 2 and "--extra" in err
    for argv in (["ps"], ["checkpoint", "save"], ["ps", "list", "--bogus"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
    assert os.listdir(tmp_path) == []
    # a typo is said in its command's usage, not the top level's (issue 35 item 12)
    capsys.readouterr()
    for argv, prog, typo in ((["run", "--wait-redy", "10", "x.py"], "coordinator run",
                              "--wait-redy"),
                             (["ps", "list", "--jsn"], "coordinator ps list", "--jsn")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        err = capsys.readouterr().err
        assert f"usage: {prog} " in err and \
            f"{prog}: error: unrecognized arguments: {typo}" in err, err


# -- plans from a listing (no cluster) ----------------------------------------------------------
def meta(name, shape, dtype="float32", optimizer="sgd", version=0):
    return SimpleNamespace(name=name, shape=tuple(shape), dtype=dtype, optimizer=optimizer,
                           version=version)


def test_split_shard_name():
    assert split_shard_name("x/part_3") == ("x", 3)
    assert split_shard_name("a/b/part_0") == ("a/b", 0)
    for name in ("x", "x/part_", "x/part_03", "x/partial_1", "part_1"):
        assert split_shard_name(name) == (name, None)


def test_layout_from_listing_groups_parts_in_order_with_cumulative_offsets():
    layout = layout_from_listing({
        "a:1": [meta("emb/part_1", (2, 4), optimizer="adam"), meta("s", ())],
        "b:1": [meta("emb/part_0", (3, 4), optimizer="adam"),
                meta("emb/part_2", (2, 4), optimizer="adam")],
    })
    emb, s = layout
    assert (emb.name, emb.shape, emb.optimizer) == ("emb", (7, 4), "adam")
    assert [(x.address, x.name, x.offset, x.rows) for x in emb.shards] == [
        ("b:1", "emb/part_0", 0, 3), ("a:1", "emb/part_1", 3, 2), ("b:1", "emb/part_2", 5, 2)]
    assert (s.name, s.shape, [(x.offset, x.rows) for x in s.shards]) == ("s", (), [(0, 0)])


@pytest.mark.parametrize("listing,match", [
    ({"a:1": [meta("x/part_0", (2,)), meta("x/part_2", (2,))]}, "part_1 missing"),
    ({"a:1": [meta("x", (2,))], "b:1": [meta("x", (2,))]}, "on both a:1 and b:1"),
    ({"a:1": [meta("x", (2,)), meta("x/part_0", (2,))]}, "both a whole variable and sharded"),
    ({"a:1": [meta("x/part_0", (2, 3)), meta("x/part_1", (2, 4))]}, "differ"),
    ({"a:1": [meta("x/part_0", (2,)), meta("x/part_1", (2,), "float64")]}, "differ"),
])
def test_layout_from_listing_refuses_an_inconsistent_listing(listing, match):
    with pytest.raises(CheckpointError, match=match):
        layout_from_listing(listing)


def test_restore_plan_pairs_shards_or_lists_every_difference():
    layout = layout_from_listing({"a:1": [meta("x/part_0", (2, 3)), meta("y", (4,))],
                                  "b:1": [meta("x/part_1", (1, 3))]})
    manifest = {"variables": {
        "x": {"shape": [3, 3], "dtype": "float32", "optimizer": "sgd", "shards": [
            {"name": "x/part_0", "offset": 0, "rows": 2, "file": "ps-0/f0", "version": 1},
            {"name": "x/part_1", "offset": 2, "rows": 1, "file": "ps-1/f1", "version": 1}]},
        "y": {"shape": [4], "dtype": "float32", "optimizer": "sgd", "shards": [
            {"name": "y", "offset": 0, "rows": 4, "file": "ps-0/y", "version": 2}]}}}
    plan = restore_plan(layout, manifest)
    assert [(s.address, s.name, e["file"]) for _, s, e in plan] == [
        ("a:1", "x/part_0", "ps-0/f0"), ("b:1", "x/part_1", "ps-1/f1"), ("a:1", "y", "ps-0/y")]
    manifest["variables"]["y"]["optimizer"] = "adam"
    with pytest.raises(LayoutMismatch) as exc:
        restore_plan(layout, manifest, "ckpt-1")
    assert exc.value.differences == [
        "'y' is float32 [4] sgd on the servers but float32 [4] adam in the checkpoint"]


def test_checkpoint_restore_keeps_the_idempotency_keys(live, env, capsys, tmp_path):
    """A push applied before the save and resent after `coordinator checkpoint
    restore` (a retry that crossed the restore) is acknowledged, not applied
    twice: the CLI restores through CheckpointManager's code, keys included."""
    shard = live.bias.shards[0]
    c = ps_pool.client_for(shard.address)
    key = 0x5EED_0001
    c.push_many([(shard.name, np.ones(3, np.float32), key)])
    assert run(capsys, "checkpoint", "save", str(tmp_path), "--step", "5")[0] == 0
    saved = c.read(shard.name)
    train(live, 1, seed=21)
    assert run(capsys, "checkpoint", "restore", str(tmp_path))[0] == 0
    np.testing.assert_array_equal(c.read(shard.name), saved)
    c.push_many([(shard.name, np.ones(3, np.float32), key)])   # the retry
    np.testing.assert_array_equal(c.read(shard.name), saved)
    c.push_many([(shard.name, np.ones(3, np.float32), key + 1)])   # a new push applies
    assert not np.array_equal(c.read(shard.name), saved)


# -- --help texts ------------------------------------------------------------------------------
def _commands(parser, name):
    """(name, parser) of a command and of each of its subcommands."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _commands(subparser, f"{name} {sub}")


def _parser(prog):
    return {"psserver": psserver_parser, "psworker": psworker_parser,
            "coordinator": cli.build_parser}[prog]()


@pytest.mark.parametrize("prog", ["psserver", "psworker", "coordinator"])
def test_every_option_has_help_in_plain_text(prog):
    for name, parser in _commands(_parser(prog), prog):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            what = f"{name}: {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help.strip(), f"{what} has no help text"
            for choice in getattr(action, "_choices_actions", ()):
                assert choice.help, f"{name} {choice.dest} has no help text"
        text = parser.format_help()
        assert "``" not in text and not re.search(r":\w+:`", text), f"reST in {name} --help"


@pytest.mark.parametrize("prog", ["psserver", "psworker"])
def test_task_help_says_what_the_auth_token_is(prog):
    text = " ".join(_parser(prog).format_help().split())
    assert "PSTRAIN_AUTH_TOKEN the cluster's auth token: a shared secret" in text
    assert "TF_CONFIG" in text


def test_only_ps_health_offers_worker(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["ps", "health", "--worker", "h:1"]).worker == "h:1"
    for argv in (["ps", "list"], ["checkpoint", "save", "d"], ["checkpoint", "restore", "d"]):
        with pytest.raises(SystemExit):   # it would do nothing there
            parser.parse_args([*argv, "--worker", "h:1"])
        assert "unrecognized arguments: --worker" in capsys.readouterr().err


def test_checkpoint_save_and_restore_carry_dynamic_tables(live, env, capsys, tmp_path):
    """`coordinator checkpoint save` finds the tables on the servers and
    saves them with the variables; `restore` puts their rows back (what a
    CheckpointManager of the training program reads as well)."""
    strategy = ParameterServerStrategy(live.cluster.spec)
    table = strategy.create_embedding_table("cli_emb", 3, initializer="random_normal",
                                            optimizer="adagrad")
    keys = np.arange(50, dtype=np.int64) * 7919
    try:
        table.lookup(keys)
        table.push_gradient(keys[:20], np.ones((20, 3), np.float32))
        saved = table.lookup(keys, admit=False)
        code, out, err = run(capsys, "checkpoint", "save", str(tmp_path), "--step", "5")
        assert code == 0 and "1 dynamic table(s)" in err, err
        manifest = json.loads((tmp_path / "ckpt-00000005" / "manifest.json").read_text())
        assert sum(s["rows"] for s in manifest["tables"]["cli_emb"]["shards"]) == 50
        # the operator commands show the table (issue 32): list, health, checkpoint list
        code, out, err = run(capsys, "ps", "list")
        shards = [line.split() for line in squeeze(out) if line.startswith("cli_emb ")]
        assert code == 0 and len(shards) == 2 and sum(int(r[3]) for r in shards) == 50, out
        assert all(r[1:3] == ["cli_emb", "primary"] and r[4:6] == ["3", "float32"]
                   and r[7] == "adagrad" for r in shards), out
        assert squeeze(out)[-1].startswith("all: 6 variable(s) and 2 table shard(s) (50 rows)")
        doc = json.loads(run(capsys, "ps", "list", "--json")[1])
        assert doc["total"]["tables"] == 2 and doc["total"]["table_rows"] == 50
        assert sorted(t["rows"] for s in doc["servers"] for t in s["tables"]) == \
            sorted(int(r[3]) for r in shards)
        doc = json.loads(run(capsys, "ps", "health", "--json")[1])
        assert sum(t["server_info"]["table_rows"] for t in doc["tasks"] if t["role"] == "ps") \
            == 50
        code, out, err = run(capsys, "checkpoint", "list", str(tmp_path))
        row = [line.split() for line in squeeze(out) if line.endswith("ckpt-00000005")][0]
        assert row[0] == "5" and row[4:8] == ["3", "6", "1", "50"], out   # (SAVED: 2 words)
        doc = json.loads(run(capsys, "checkpoint", "list", str(tmp_path), "--json")[1])
        assert (doc["checkpoints"][0]["tables"], doc["checkpoints"][0]["table_shards"],
                doc["checkpoints"][0]["table_rows"]) == (1, 2, 50)
        table.push_gradient(keys, np.ones((50, 3), np.float32))
        table.lookup(np.arange(1000, 1010))
        code, out, err = run(capsys, "checkpoint", "restore", str(tmp_path))
        assert code == 0, err
        assert "and 1 dynamic table(s) (50 rows) on 2 parameter server(s)" in out, out
        np.testing.assert_array_equal(table.lookup(keys, admit=False), saved)
        assert table.stats().rows == 50
        later = ParameterServerStrategy(live.cluster.spec)   # the program's way reads it too
        t2 = later.create_embedding_table("cli_emb", 3, initializer="random_normal",
                                          optimizer="adagrad")
        CheckpointManager(later, str(tmp_path)).restore()
        np.testing.assert_array_equal(t2.lookup(keys, admit=False), saved)
    finally:
        for address in live.cluster.spec.ps:
            ps_pool.client_for(address).delete_table("cli_emb")
