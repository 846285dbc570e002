"""TF_CONFIG parsing (pure logic), and tasks that take their port from TF_CONFIG."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from coordinator.cluster_spec import (
    ClusterConfigError,
    ClusterSpec,
    TaskId,
    TFConfigClusterResolver,
    parse_tf_config,
)
from coordinator.strategy import ParameterServerStrategy
from psserver.contract import tf_config
from psserver.process import child_env, start_task

CFG = {"cluster": {"chief": ["c:1"], "ps": ["p0:2", "p1:2"], "worker": ["w0:3", "w1:3", "w2:3"]},
       "task": {"type": "worker", "index": 2}}


def test_parse_tf_config():
    spec, task = parse_tf_config(json.dumps(CFG))
    assert spec.ps == ("p0:2", "p1:2") and spec.worker == ("w0:3", "w1:3", "w2:3")
    assert spec.chief == ("c:1",)
    assert task == TaskId("worker", 2)
    assert json.loads(spec.tf_config("ps", 1)) == {"cluster": CFG["cluster"],
                                                   "task": {"type": "ps", "index": 1}}


@pytest.mark.parametrize("text, match", [
    ("not json", "not valid JSON"),
    ("[]", '"cluster" object'),
    ('{"cluster": {"ps": "p0:1"}}', "must be a list"),
    ('{"cluster": {"ps": ["nohostport"]}}', "host:port"),
    ('{"cluster": {"ps": ["a:1"], "gpu": ["b:1"]}}', "unknown roles"),
    ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 3}}', "not in the cluster"),
    ('{"cluster": {"ps": ["a:1"]}, "task": {"index": 0}}', "bad TF_CONFIG"),
])
def test_bad_tf_config_is_explained(text, match):
    with pytest.raises(ClusterConfigError, match=match):
        parse_tf_config(text)


def test_cluster_spec_takes_tensorflows_dict_of_jobs():
    want = ClusterSpec(ps=["p0:2", "p1:2"], worker=["w0:3"], chief=["c:1"])
    assert ClusterSpec({"ps": ["p0:2", "p1:2"], "worker": ["w0:3"], "chief": ["c:1"]}) == want
    assert ClusterSpec({"ps": {1: "p1:2", 0: "p0:2"}, "worker": {"0": "w0:3"},
                        "chief": ["c:1"]}) == want
    assert ClusterSpec(ps={0: "p0:2", 1: "p1:2"}, worker=["w0:3"], chief=["c:1"]) == want
    assert ClusterSpec(want.as_dict()) == want
    copy = ClusterSpec(ClusterSpec({"ps": ["p0:2"]}, token="t"))
    assert copy.ps == ("p0:2",) and copy.token == "t"
    assert ClusterSpec({"ps": ["p0:2"], "evaluator": ["e:4"]}).as_dict() == {"ps": ["p0:2"]}
    spec, _ = parse_tf_config(json.dumps({"cluster": {"ps": {"0": "p0:2", "1": "p1:2"}}}))
    assert spec.ps == ("p0:2", "p1:2")


@pytest.mark.parametrize("args, kwargs, match", [
    (({"ps": ["a:1"], "gpu": ["b:1"]},), {}, "unknown roles"),
    (({"ps": ["a:1"]},), {"worker": ["w:1"]}, "either as one dict"),
    (({"ps": {0: "a:1", 2: "b:1"}},), {}, "no task 1"),
    (({"ps": {"first": "a:1"}, "worker": []},), {}, "task index 'first' is not a number"),
    (({"ps": "a:1"},), {}, "must be a list"),
    (({"ps": ["nohostport"]},), {}, "host:port"),
])
def test_cluster_spec_dict_errors_say_what_to_write(args, kwargs, match):
    with pytest.raises(ClusterConfigError, match=match):
        ClusterSpec(*args, **kwargs)


def test_resolver_rereads_a_file(tmp_path):
    path = tmp_path / "tf_config.json"
    path.write_text(json.dumps(CFG))
    r = TFConfigClusterResolver(environ={"TF_CONFIG_FILE": str(path)})
    assert r.cluster_spec().num_workers == 3
    cfg = json.loads(json.dumps(CFG))
    cfg["cluster"]["worker"].append("w3:3")
    path.write_text(json.dumps(cfg))
    assert r.cluster_spec().num_workers == 4


def test_resolver_without_config_says_what_to_set():
    with pytest.raises(ClusterConfigError, match="TF_CONFIG"):
        TFConfigClusterResolver(environ={})


def test_strategy_needs_parameter_servers():
    with pytest.raises(ClusterConfigError, match="no parameter servers"):
        ParameterServerStrategy(ClusterSpec(worker=["w:1"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_worker_binds_the_port_of_its_tf_config_entry():
    port = _free_port()
    cfg = {"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:1", f"127.0.0.1:{port}"]},
           "task": {"type": "worker", "index": 1}}
    w = start_task("psworker", [], env={"TF_CONFIG": json.dumps(cfg)})
    try:
        assert w.address == f"127.0.0.1:{port}"
    finally:
        w.kill()


@pytest.mark.timeout(60)
def test_ps_binds_the_port_of_its_tf_config_entry():
    port = _free_port()
    cfg = {"cluster": {"ps": ["127.0.0.1:1", f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]},
           "task": {"type": "ps", "index": 1}}
    ps = start_task("psserver", [], env={"TF_CONFIG": json.dumps(cfg)})
    try:
        assert ps.address == f"127.0.0.1:{port}"
    finally:
        ps.kill()


@pytest.mark.timeout(60)
def test_an_explicit_port_wins_over_tf_config():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))   # the TF_CONFIG entry's port cannot be bound
    try:
        cfg = {"cluster": {"ps": [f"127.0.0.1:{taken.getsockname()[1]}"]},
               "task": {"type": "ps", "index": 0}}
        ps = start_task("psserver", ["--port", "0"], env={"TF_CONFIG": json.dumps(cfg)})
        try:
            assert ps.address != f"127.0.0.1:{taken.getsockname()[1]}"
        finally:
            ps.kill()
    finally:
        taken.close()


@pytest.mark.parametrize("task, match", [
    ({"type": "worker", "index": 0},
     r'the task in TF_CONFIG is worker:0, but psserver runs a "ps" task: make it '
     r'\{"type": "ps", "index": N\}'),
    ({"type": "ps", "index": 2}, "TF_CONFIG task ps:2 is not in the cluster's 2 ps addresses"),
])
def test_task_port_explains_a_tf_config_for_another_task(task, match):
    cfg = {"cluster": {"ps": ["a:1", "b:2"], "worker": ["c:3"]}, "task": task}
    with pytest.raises(ClusterConfigError, match=match):
        tf_config.task_port("ps", "psserver", {"TF_CONFIG": json.dumps(cfg)})


def test_task_port_without_a_task_is_a_free_port():
    assert tf_config.task_port("ps", "psserver", {}) == 0
    assert tf_config.task_port("ps", "psserver",
                               {"TF_CONFIG": json.dumps({"cluster": CFG["cluster"]})}) == 0
    assert tf_config.task_port("ps", "psserver",
                               {"TF_CONFIG": json.dumps({**CFG, "task": {"type": "ps",
                                                                         "index": 1}})}) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module, task, match", [
    ("psserver", {"type": "worker", "index": 0}, 'psserver runs a "ps" task'),
    ("psserver", {"type": "ps", "index": 5}, "ps:5 is not in the cluster's 1 ps addresses"),
    ("psworker", {"type": "ps", "index": 0}, 'psworker runs a "worker" task'),
])
def test_a_task_given_another_tasks_tf_config_exits_2(module, task, match):
    cfg = {"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "task": task}
    env = child_env({"TF_CONFIG": json.dumps(cfg)})
    env.pop("TF_CONFIG_FILE", None)
    out = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True,
                         text=True, timeout=50, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr
    assert match in out.stderr and f"{module}: " in out.stderr
    assert "Traceback" not in out.stderr
