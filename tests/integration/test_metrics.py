"""Prometheus metrics: real psserver / psworker processes and a real coordinator,
their endpoints scraped over HTTP, the values checked against what was done."""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator import (
    ClosureCancelled,
    ClusterCoordinator,
    LocalCluster,
    ParameterServerStrategy,
    StepFunctionError,
    push_gradients,
)
from coordinator import metrics as coordinator_metrics
from coordinator.checkpoint import CheckpointManager
from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
from psserver.client import PSClient
from psserver.contract import TOKEN_ENV, TOKEN_METADATA_KEY, SyncSpec, shm
from psserver.errors import InvalidArgument, Unauthenticated
from psserver.metrics import PORT_ENV
from psserver.process import start_task

pytestmark = pytest.mark.timeout(120)

PS = "pstrain.v1.ParameterServer"
BULK = "pstrain.v1.ParameterServerBulk"   # PSClient's reads and pushes (psserver/contract/wire.py)
SHM = "pstrain.v1.SharedMemory"            # ... on the same host (psserver/contract/shm.py, ipc_server.py)
WORKER = "pstrain.v1.Worker"


# -- helpers ---------------------------------------------------------------------------------
def metrics_address(task) -> str:
    """The "<role> metrics on HOST:PORT" line a task prints (before it says it listens)."""
    for line in list(task.log_lines):
        m = re.match(rf"^{task.role} metrics on (\S+)$", line.strip())
        if m:
            return m.group(1)
    raise AssertionError(f"{task.role} printed no metrics address:\n{task.output()}")


class Samples(dict):
    """{(sample name, frozenset(labels)): value} of one scrape."""

    def value(self, name: str, **labels) -> float:
        """The sample with exactly these labels (0 when absent)."""
        return self.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str, **labels) -> float:
        """Sum over the samples whose labels include these."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.items() if n == name and want <= ls)


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = Samples()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def rpc(service, method, code=None, kind="unary") -> dict:
    labels = {"grpc_service": service, "grpc_method": method, "grpc_type": kind}
    if code is not None:
        labels["grpc_code"] = code
    return labels


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- psserver --------------------------------------------------------------------------------
def test_psserver_counts_calls_codes_bytes_and_pushes(start_ps):
    token = "metrics-test-token"
    ps = start_ps("--metrics-port", "0", env={TOKEN_ENV: token})
    lines = [ln.strip() for ln in ps.log_lines]
    assert lines.index(f"psserver metrics on {metrics_address(ps)}") < \
        lines.index(f"psserver listening on {ps.address}")
    m = metrics_address(ps)
    grad = np.ones(4, np.float32)
    # Tensors over 1 MiB travel over the streams (whatever the default threshold).
    with PSClient(ps.address, token=token, stream_threshold_bytes=1 << 20,
                  shared_memory=False, data_port=False) as c:
        c.create_variable("w", (4,), initializer="zeros")
        for _ in range(7):
            c.push("w", grad)
        with pytest.raises(InvalidArgument):
            c.push("w", np.ones(5, np.float32))
        s = scrape(m)
        assert s.value("pstrain_ps_gradients_total", kind="dense", mode="async") == 7
        assert s.value("pstrain_ps_gradients_total", kind="sparse", mode="async") == 0
        assert s.value("grpc_server_handled_total", **rpc(BULK, "Push", "OK")) == 7
        assert s.value("grpc_server_handled_total", **rpc(BULK, "Push", "INVALID_ARGUMENT")) == 1
        assert s.value("grpc_server_handling_seconds_count", **rpc(BULK, "Push", "OK")) == 7
        assert s.value("grpc_server_started_total", **rpc(BULK, "Push")) == 8
        assert s.value("grpc_server_msg_received_total", **rpc(BULK, "Push")) == 8
        # No reply to the bad push.
        assert s.value("grpc_server_msg_sent_total", **rpc(BULK, "Push")) == 7
        # Each push carries its 16 tensor bytes plus the name, dtype and shape.
        pushed = s.value("grpc_server_received_bytes_total", **rpc(BULK, "Push"))
        assert 7 * 16 + 20 < pushed < 8 * 100
        assert s.value("grpc_server_sent_bytes_total", **rpc(BULK, "Push")) > 0
        assert s.value("grpc_server_handled_total", **rpc(PS, "CreateVariable", "OK")) == 1
        assert s.value("pstrain_ps_variables") == 1
        assert s.value("pstrain_ps_bytes", part="values") == 16
        assert s.value("pstrain_ps_bytes", part="slots") == 0
        assert s.value("process_resident_memory_bytes") > 0

        # Streams: a 2.4 MB push goes over Upload, its read over ReadStream (in frames).
        c.create_variable("big", (600, 1000), initializer="zeros", optimizer="adagrad")
        c.push("big", np.ones((600, 1000), np.float32))
        assert c.read("big").shape == (600, 1000)
        # A streaming call that aborts: NOT_FOUND, raised before its first frame.
        with grpc.insecure_channel(ps.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(ps_pb2_grpc.ParameterServerStub(ch).ReadStream(
                    ps_pb2.ReadRequest(names=["nope"]),
                    metadata=((TOKEN_METADATA_KEY, f"Bearer {token}"),), timeout=10))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with PSClient(ps.address) as anonymous:   # no token: refused by the auth interceptor
        with pytest.raises(Unauthenticated):
            anonymous.get_meta("w")

    s = scrape(m)
    assert s.value("pstrain_ps_gradients_total", kind="dense", mode="async") == 8
    assert s.value("grpc_server_handled_total", **rpc(BULK, "Push", "OK")) == 7
    upload = rpc(PS, "Upload", kind="client_stream")
    assert s.value("grpc_server_handled_total", **upload, grpc_code="OK") == 1
    assert s.value("grpc_server_received_bytes_total", **upload) >= 2_400_000
    assert s.value("grpc_server_msg_received_total", **upload) >= 2   # request + frames
    stream = rpc(PS, "ReadStream", kind="server_stream")
    assert s.value("grpc_server_handled_total", **stream, grpc_code="OK") == 1
    assert s.value("grpc_server_handled_total", **stream, grpc_code="NOT_FOUND") == 1
    assert s.value("grpc_server_sent_bytes_total", **stream) >= 2_400_000
    assert s.value("grpc_server_msg_sent_total", **stream) >= 3       # 1 MiB frames
    assert s.value("grpc_server_handled_total", **rpc(PS, "GetMeta", "UNAUTHENTICATED")) == 1
    assert s.value("pstrain_ps_variables") == 2
    assert s.value("pstrain_ps_bytes", part="values") == 16 + 2_400_000
    assert s.value("pstrain_ps_bytes", part="slots") == 2_400_000          # adagrad's accumulator


def test_psserver_sync_barrier_waits_staleness_and_dropped_gradients(start_ps):
    ps = start_ps("--metrics-port", "0")
    m = metrics_address(ps)

    def spec(step, replica):
        return SyncSpec(step, replica, num_replicas=2, required=2)

    g = np.ones(3, np.float32)
    with PSClient(ps.address) as c:
        c.create_variable("v", (3,), initializer="zeros")
        c.push_many([("v", g)], sync=spec(0, 0))          # step 0: 1 of 2 replicas
        read = {}
        reader = threading.Thread(target=lambda: read.update(
            snap=c.read_many(["v"], sync_step=1)))          # waits for step 0 to complete
        reader.start()
        deadline = time.monotonic() + 30
        while scrape(m).total("grpc_server_started_total", grpc_method="Read") < 1:
            assert time.monotonic() < deadline, "the sync read never reached the server"
            time.sleep(0.05)
        assert reader.is_alive()                            # it waits at the barrier
        c.push_many([("v", g)], sync=spec(0, 1))          # completes step 0
        reader.join(10)
        assert not reader.is_alive() and read
        c.push_many([("v", g)], sync=spec(0, 0))          # step 0 again: late, dropped
        assert c.get_meta("v").dropped_gradients == 1
    s = scrape(m)
    assert s.value("pstrain_ps_gradients_total", kind="dense", mode="sync") == 2
    assert s.value("pstrain_ps_gradients_total", kind="dense", mode="async") == 0
    assert s.value("pstrain_ps_dropped_gradients_total", kind="dense") == 1
    # Staleness: on time (0) twice, then one step behind.
    assert s.value("pstrain_ps_sync_gradient_staleness_steps_count") == 3
    assert s.value("pstrain_ps_sync_gradient_staleness_steps_bucket", le="0.0") == 2
    assert s.value("pstrain_ps_sync_gradient_staleness_steps_sum") == 1
    # Barrier: three pushes that did not wait, one read that waited for a
    # push after it (so longer than all three pushes' waits together).
    assert s.value("pstrain_ps_sync_wait_seconds_count", op="push") == 3
    assert s.value("pstrain_ps_sync_wait_seconds_count", op="read") == 1
    assert s.value("pstrain_ps_sync_wait_seconds_sum", op="push") < \
        s.value("pstrain_ps_sync_wait_seconds_sum", op="read")


# -- the port options --------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_metrics_port_from_the_environment_and_bind_errors(start_ps):
    # $PSTRAIN_METRICS_PORT is the default of --metrics-port.
    ps = start_ps(env={PORT_ENV: "0"})
    assert scrape(metrics_address(ps)).value("pstrain_ps_variables") == 0
    taken = metrics_address(ps).rsplit(":", 1)[1]
    # From the environment, a port in use only warns (LocalCluster's tasks inherit it) ...
    quiet = start_ps(env={PORT_ENV: taken})
    assert "no metrics: cannot listen" in quiet.output()
    with PSClient(quiet.address) as c:
        assert c.server_info().num_variables == 0
    # ... while --metrics-port must be honoured: exit 2, saying why.
    with pytest.raises(RuntimeError, match="cannot serve metrics"):
        start_task("psserver", ["--port", "0", "--metrics-port", taken], timeout=20)
    with pytest.raises(RuntimeError, match="PSTRAIN_METRICS_PORT must be a port number"):
        start_task("psworker", ["--port", "0"], env={PORT_ENV: "ninety"}, timeout=20)
    # An explicit port and host.
    port = free_port()
    w = start_task("psworker", ["--port", "0", "--metrics-port", str(port),
                                "--metrics-host", "127.0.0.1"], timeout=20)
    try:
        assert metrics_address(w) == f"127.0.0.1:{port}"
        assert scrape(metrics_address(w)).value("pstrain_worker_closures_total", outcome="ok") == 0
    finally:
        w.kill()


# -- workers and the coordinator -----------------------------------------------------------------
def push_step(w):
    push_gradients([(w, np.ones(3, np.float32))])
    return 1


def slow_failure():
    time.sleep(0.5)
    raise ValueError("this step fails on purpose")


def test_worker_coordinator_and_checkpoint_metrics(tmp_path):
    host, port = coordinator_metrics.serve(0)
    coord_m = f"{host}:{port}"
    assert coordinator_metrics.address() == coord_m
    before = scrape(coord_m)

    def delta(s, name, **labels):
        return s.value(name, **labels) - before.value(name, **labels)

    with LocalCluster(num_ps=1, num_workers=1, ps_args=("--metrics-port", "0"),
                      worker_args=("--metrics-port", "0")) as cluster:
        ps_m, worker_m = metrics_address(cluster.ps[0]), metrics_address(cluster.workers[0])
        strategy = ParameterServerStrategy(cluster.spec)
        w = strategy.create_variable("w", shape=(3,), initializer="zeros")
        with ClusterCoordinator(strategy) as coord:
            oks = [coord.schedule(push_step, args=(w,)) for _ in range(5)]
            coord.join()
            assert coord.fetch(oks) == [1] * 5
            during = scrape(coord_m)
            assert during.value("pstrain_coordinator_workers_alive") >= 1
            assert during.value("pstrain_coordinator_workers") >= 1
            assert during.value("pstrain_coordinators") >= 1

            # One worker: the failing closure runs while three more wait in the
            # queue; its failure cancels them.
            bad = coord.schedule(slow_failure)
            rest = [coord.schedule(push_step, args=(w,)) for _ in range(3)]
            with pytest.raises(StepFunctionError, match="fails on purpose"):
                coord.join()
            with pytest.raises(StepFunctionError):
                bad.fetch()
            for rv in rest:
                with pytest.raises(ClosureCancelled):
                    rv.fetch()

        ckpt = CheckpointManager(strategy, str(tmp_path / "ckpt"))
        path = ckpt.save(step=5)
        ckpt.restore()
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
        saved = sum(s["bytes"] for v in manifest["variables"].values() for s in v["shards"])

        after = scrape(coord_m)
        assert delta(after, "pstrain_coordinator_closures_scheduled_total") == 9
        assert delta(after, "pstrain_coordinator_closures_succeeded_total") == 5
        assert delta(after, "pstrain_coordinator_closures_failed_total",
                     error="StepFunctionError") == 1
        assert delta(after, "pstrain_coordinator_closures_cancelled_total") == 3
        assert delta(after, "pstrain_coordinator_closures_retried_total") == 0
        assert delta(after, "pstrain_checkpoint_seconds_count", op="save") == 1
        assert delta(after, "pstrain_checkpoint_seconds_count", op="restore") == 1
        assert delta(after, "pstrain_checkpoint_failures_total", op="save") == 0
        assert saved > 0
        assert delta(after, "pstrain_checkpoint_bytes_total", op="save") == saved
        assert delta(after, "pstrain_checkpoint_bytes_total", op="restore") == saved

        ws = scrape(worker_m)
        assert ws.value("pstrain_worker_closures_total", outcome="ok") == 5
        assert ws.value("pstrain_worker_closures_total", outcome="error") == 1
        assert ws.value("pstrain_worker_closure_seconds_count", outcome="error") == 1
        assert ws.value("pstrain_worker_closure_seconds_sum", outcome="error") >= 0.5
        assert ws.value("pstrain_worker_closures_running") == 0
        # A step's error travels in the reply: the call itself is OK.
        # The coordinator shares the host: closures went over the local socket.
        kind = "unix" if shm.available() else "unary"
        assert ws.value("grpc_server_handled_total",
                        **rpc(WORKER, "RunClosure", "OK", kind=kind)) == 6
        assert ws.total("grpc_server_received_bytes_total", grpc_method="RunClosure") > 0

        pss = scrape(ps_m)
        assert pss.value("pstrain_ps_gradients_total", kind="dense", mode="async") == 5
        # the worker shares the host: its pushes went over the local socket (psserver/serve/ipc_server.py)
        pushes = rpc(SHM, "Push", "OK", kind="unix") if shm.available() else rpc(BULK, "Push", "OK")
        assert pss.value("grpc_server_handled_total", **pushes) == 5
        assert pss.value("grpc_server_received_bytes_total", **{
            k: v for k, v in pushes.items() if k != "grpc_code"}) > 0
        assert pss.value("grpc_server_handled_total", **rpc(PS, "Save", "OK")) == 1
        assert pss.value("pstrain_ps_variables") == 1


# -- deployment: every role exposes its metrics port ---------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METRICS_PORT = 9100


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_manifests_and_compose_expose_the_metrics_port():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    docs = []
    for name in ("ps.yaml", "worker.yaml", "coordinator-job.yaml", "networkpolicy.yaml"):
        with open(os.path.join(ROOT, "deploy", name)) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("StatefulSet", "Job")}
    assert set(workloads) == {"ps", "worker", "pstrain-coordinator"}
    for name, d in workloads.items():
        template = d["spec"]["template"]
        notes = template["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true", name
        assert notes["prometheus.io/port"] == str(METRICS_PORT), name
        assert notes["prometheus.io/path"] == "/metrics", name
        (c,) = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == METRICS_PORT, name
        env = {e["name"]: e.get("value") for e in c["env"]}
        if name == "pstrain-coordinator":   # served by the script's ClusterCoordinator
            assert env[PORT_ENV] == str(METRICS_PORT) and env["PSTRAIN_METRICS_HOST"] == "0.0.0.0"
        else:   # `coordinator task` passes these to the task, which binds --host 0.0.0.0
            assert _flag(c["command"], "--metrics-port") == str(METRICS_PORT), name
    for d in docs:
        if d["kind"] == "Service":
            assert {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics",
                    "protocol": "TCP"} in d["spec"]["ports"]
        if d["kind"] == "NetworkPolicy":
            (rule,) = d["spec"]["ingress"]
            assert METRICS_PORT in [p["port"] for p in rule["ports"]]

    with open(os.path.join(ROOT, "docker-compose.yml")) as f:
        services = yaml.safe_load(f)["services"]
    for name, s in services.items():
        assert "ports" not in s, f"compose service {name} publishes a port"
        if s["command"][0] in ("psserver", "psworker"):
            assert _flag(s["command"], "--metrics-port") == str(METRICS_PORT), name
    env = services["coordinator"]["environment"]
    assert env[PORT_ENV] == str(METRICS_PORT) and env["PSTRAIN_METRICS_HOST"] == "0.0.0.0"
