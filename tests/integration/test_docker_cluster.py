"""coordinator.DockerCluster: every task in a container of its own, on a
private network; container-level failures (a server process killed inside its
container and restarted by Docker, a container cut off the network).

Needs a Docker engine, the ``docker`` package and the pstrain image
($PSTRAIN_IMAGE, default pstrain:0.1.0: deploy/build-image.sh builds it, and
.ci/run does). Skipped without them, failed instead with
PSTRAIN_REQUIRE_DOCKER=1 (CI).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    ParameterServerStrategy,
)
from tests.integration.test_multihost import counting_step

pytestmark = pytest.mark.timeout(300)
IMAGE = os.environ.get("PSTRAIN_IMAGE", "pstrain:0.1.0")
ROWS = 64


def _docker_or_skip():
    why = None
    try:
        import docker
        client = docker.from_env()
        client.ping()
        client.images.get(IMAGE)
    except ImportError:
        why = 'the docker package is not installed (pip install -e ".[docker]")'
    except Exception as exc:   # no engine, or no image
        why = f"no Docker engine or no image {IMAGE} (deploy/build-image.sh): {exc}"
    if why:
        if os.environ.get("PSTRAIN_REQUIRE_DOCKER") == "1":
            pytest.fail(f"PSTRAIN_REQUIRE_DOCKER=1 but {why}")
        pytest.skip(why)


@pytest.fixture
def docker_cluster():
    _docker_or_skip()
    from coordinator import DockerCluster
    with DockerCluster(2, 2, image=IMAGE) as cluster:
        yield cluster


def _table(strategy):
    return strategy.create_variable("w", initial_value=np.zeros((ROWS, 4), np.float32),
                                    optimizer="sgd", optimizer_params={"learning_rate": 1.0})


def test_a_parameter_server_killed_in_its_container_loses_nothing(docker_cluster):
    """Replication on: parameter server 1's process is SIGKILLed inside its
    container mid-training; Docker restarts the container on its address,
    the coordinator fails over and copies the shards back. Every step
    completes and the table holds exactly one update per step."""
    cluster = docker_cluster
    spec = cluster.spec
    assert len(spec.ps) == 2 and len(spec.worker) == 2
    assert all(not a.startswith("127.") for a in spec.ps + spec.worker)
    strategy = ParameterServerStrategy(spec, replication=True,
                                       variable_partitioner=FixedShardsPartitioner(2))
    w = _table(strategy)
    with ClusterCoordinator(strategy, ps_check_interval=0.5, ps_failover_after=3.0) as coord:
        step = counting_step(w, "HOSTNAME")
        results = coord.fetch([coord.schedule(step) for _ in range(20)])
        cluster.kill_ps(1)
        results += coord.fetch([coord.schedule(step) for _ in range(40)])
        assert coord.cluster.recovery.wait_for_recoveries(1, timeout=120)
        results += coord.fetch([coord.schedule(step) for _ in range(10)])
        coord.join()
        value = w.read()
    np.testing.assert_array_equal(value, np.full((ROWS, 4), len(results), np.float32))
    ps1 = cluster.container("ps", 1)
    ps1.reload()
    assert ps1.attrs["RestartCount"] >= 1 and ps1.status == "running"
    assert cluster.spec.ps == spec.ps   # restarted on its address


def test_a_worker_cut_off_the_network_has_its_closures_run_elsewhere_and_rejoins(docker_cluster):
    cluster = docker_cluster
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
    w = _table(strategy)
    names = [cluster.container("worker", i).attrs["Config"]["Hostname"] for i in (0, 1)]
    with ClusterCoordinator(strategy) as coord:
        step = counting_step(w, "HOSTNAME")
        coord.fetch([coord.schedule(step) for _ in range(10)])
        cluster.disconnect("worker", 0)
        during = coord.fetch([coord.schedule(step) for _ in range(30)])
        assert during.count(names[1]) >= 29, during   # one may have run on 0 before the cut
        cluster.reconnect("worker", 0)
        rejoined: set = set()
        # Until worker 0 takes closures again: its connection comes back when TCP
        # retransmits (backing off while cut) or gRPC reconnects; seconds, not rounds.
        deadline = time.monotonic() + 90
        while names[0] not in rejoined and time.monotonic() < deadline:
            rejoined |= set(coord.fetch([coord.schedule(step) for _ in range(6)]))
        assert names[0] in rejoined
        coord.join()
        value = w.read()
    assert (value >= 40 + 6).all()   # every step at least once


def test_stop_removes_every_container_and_the_network():
    _docker_or_skip()
    import docker

    from coordinator import DockerCluster
    client = docker.from_env()
    with DockerCluster(1, 1, image=IMAGE) as cluster:
        label = f"pstrain.cluster={cluster.id}"
        assert len(client.containers.list(filters={"label": label})) == 2
        net = cluster.network.name
    assert client.containers.list(all=True, filters={"label": label}) == []
    assert client.networks.list(names=[net]) == []


def test_a_killed_worker_restarts_on_its_address_and_a_bad_kill_is_an_error():
    """kill_worker drops the worker from the spec; restart_worker brings it
    back on the same address, where it runs steps again. Killing a process
    the container does not run raises, naming the container."""
    _docker_or_skip()
    from coordinator import DockerCluster
    with DockerCluster(1, 1, image=IMAGE) as cluster:
        address = cluster.spec.worker[0]
        cluster.kill_worker(0)
        assert list(cluster.spec.worker) == []
        cluster.restart_worker(0)
        assert list(cluster.spec.worker) == [address]
        strategy = ParameterServerStrategy(cluster.spec)
        w = _table(strategy)
        with ClusterCoordinator(strategy) as coord:
            coord.fetch([coord.schedule(counting_step(w, "HOSTNAME")) for _ in range(3)])
        np.testing.assert_array_equal(w.read(), np.full((ROWS, 4), 3, np.float32))
        with pytest.raises(RuntimeError, match="no such process runs there"):
            cluster._kill_inside("worker", 0, "no-such-module")
