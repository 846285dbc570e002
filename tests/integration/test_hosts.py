"""Routes across test hosts (network namespaces, bench/hosts.py): a client
picks its transport from what the server announced, with no failed call."""

import host_gate
import numpy as np
import pytest
from test_metrics import metrics_address, scrape

from bench import hosts
from psserver.client import PSClient
from psserver.contract import TOKEN_ENV
from psserver.process import start_task

pytestmark = host_gate.marks(120)

TOKEN = "test-hosts-token"
PS, SHM = "pstrain.v1.ParameterServer", "pstrain.v1.SharedMemory"
BULK = "pstrain.v1.ParameterServerBulk"


@pytest.fixture
def two_hosts():
    with hosts.TestHosts(2, private=False) as h:
        yield h


def _ps_on(h: hosts.TestHosts, i: int):
    return start_task("psserver", ["--host", h.addresses[i], "--port", "0", "--metrics-port", "0",
                                   "--metrics-host", h.addresses[i]],
                      env={TOKEN_ENV: TOKEN}, prefix=h.run(i))


def _calls(samples, **labels) -> dict:
    """{(service, method, type, code): count} of the server's finished calls."""
    return {(dict(k)["grpc_service"], dict(k)["grpc_method"], dict(k)["grpc_type"],
             dict(k)["grpc_code"]): v
            for (name, k), v in samples.items()
            if name == "grpc_server_handled_total" and v}


def test_memory_shared_but_not_the_network_takes_the_data_port(two_hosts):
    """A client that shares /dev/shm and the pid namespace with its server
    but not the network (another namespace) reads and pushes over the data
    port: no shared-memory attach, no failed call of any kind."""
    ps = _ps_on(two_hosts, 0)
    try:
        with PSClient(ps.address, token=TOKEN) as c:
            c.create_variable("w", (1000, 343), initializer="ones",   # 1.37 MB
                              optimizer_params={"learning_rate": 0.5})
            for _ in range(3):
                c.read("w")
                c.push("w", np.ones((1000, 343), np.float32))
            c.gather("w", np.array([1, 5]))
            c.push_sparse("w", np.array([1]), np.ones((1, 343), np.float32))
            assert (c.route.socket, c.route.shm) == ("tcp", False), c.route
            assert "another network namespace" in c.route.why
            value = c.read("w")
            np.testing.assert_allclose(value[0], 1 - 0.5 * 3)          # three pushes
            np.testing.assert_allclose(value[1], 1 - 0.5 * 3 - 0.5)    # and a sparse one
        calls = _calls(scrape(metrics_address(ps)))
        failed = {k: v for k, v in calls.items() if k[3] != "OK"}
        assert not failed, calls
        assert not any(k[0] == SHM for k in calls), calls   # no Attach tried
        assert calls[(PS, "GetServerInfo", "unary", "OK")] == 1, calls
        assert calls[(BULK, "Read", "tcp", "OK")] == 5, calls   # (a gather is a read)
        assert calls[(BULK, "Push", "tcp", "OK")] == 3, calls
        assert calls[(PS, "PushSparse", "tcp", "OK")] == 1, calls
    finally:
        ps.kill()


def test_a_server_without_a_data_port_on_another_host_is_called_over_grpc(two_hosts):
    """Nothing to plan but gRPC: one GetServerInfo, then every call over
    gRPC, none failed."""
    h = two_hosts
    ps = start_task("psserver", ["--host", h.addresses[1], "--port", "0", "--data-port", "-1",
                                 "--metrics-port", "0", "--metrics-host", h.addresses[1]],
                    env={TOKEN_ENV: TOKEN}, prefix=h.run(1))
    try:
        with PSClient(ps.address, token=TOKEN) as c:
            c.create_variable("w", (4,), initializer="ones",
                              optimizer_params={"learning_rate": 0.5})
            c.push("w", np.ones(4, np.float32))
            np.testing.assert_allclose(c.read("w"), 0.5)
            assert c.route.socket == ""
        calls = _calls(scrape(metrics_address(ps)))
        assert all(k[3] == "OK" and k[2] == "unary" for k in calls), calls
        assert not any(k[0] == SHM for k in calls), calls
        assert calls[(PS, "GetServerInfo", "unary", "OK")] == 1, calls
    finally:
        ps.kill()
