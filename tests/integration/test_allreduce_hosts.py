"""All-reduce training mode across test hosts (bench/hosts.py): each worker
on a host of its own, the steps' chunks over the data ports with mutual TLS
and the token, a dynamic table on a parameter server of a host of its own;
a worker killed inside a step, and one that joins, as on one host
(tests/integration/test_allreduce.py, whose step functions the workers
import: this module makes test hosts at import)."""
from __future__ import annotations

import host_gate
import numpy as np
from test_allreduce import (
    IN,
    OUT,
    _equal_survivors,
    _model,
    _replicas_per_step,
    counting_dataset,
    counting_job,
    counting_step,
    crashing_step,
    make_step,
)

from bench import hosts
from coordinator import (
    ClusterCoordinator,
    LocalCluster,
    ParameterServerStrategy,
)

pytestmark = host_gate.marks(240)


def test_across_hosts_a_worker_killed_mid_step_and_one_that_joins():
    """3 workers on 3 hosts: replica 1's process dies in step 2 (the step
    runs again on the two left), then a worker joins (on the first host:
    LocalCluster's certificate names the hosts it started on) and gets the
    model: the model equals the large batch of the replicas each step had,
    bit-identical on a first worker and the joiner."""
    params = {"learning_rate": 0.05}
    with hosts.TestHosts(3) as h, \
            LocalCluster(0, 3, placement=h.placement(ps=[0], worker=[0, 1, 2])) as c:
        assert c.tls is not None and all(w.address.startswith("198.18.") for w in c.workers)
        strategy = ParameterServerStrategy(c.spec, mode="allreduce", step_timeout=5)
        w0 = np.random.default_rng(8).standard_normal((IN, OUT)).astype(np.float32)
        b0 = np.zeros(OUT, np.float32)
        w, b = _model(strategy, w0, b0, "sgd", params)
        with ClusterCoordinator(strategy) as coord:
            first = [coord.schedule(crashing_step(w, b, 2, 1)) for _ in range(4)]
            coord.join(timeout=120)
            c.add_worker()   # (worker 3: on the first host, round robin)
            later = [coord.schedule(make_step(w, b)) for _ in range(2)]
            coord.join(timeout=120)
            per_step = _replicas_per_step(first + later)
            assert per_step == [3, 3, 2, 2, 3, 3]
            got = [coord.replica_values(worker=i, with_versions=True) for i in (0, 3)]
    _equal_survivors(got, w0, b0, per_step, params)


def test_across_hosts_a_sharded_dataset_and_a_table_exactly_once_under_a_worker_loss():
    """The table on a parameter server of a host of its own; each example's
    row +1 exactly once although replica 1 dies inside step 1."""
    with hosts.TestHosts(4) as h, \
            LocalCluster(1, 3, placement=h.placement(ps=[3], worker=[0, 1, 2])) as c:
        strategy, w, table = counting_job(c.snapshot())
        with ClusterCoordinator(strategy) as coord:
            ds = counting_dataset(coord, 13)
            it = iter(ds)
            steps = [coord.schedule(counting_step(w, table, 1), args=(it,)) for _ in range(6)]
            coord.join(timeout=120)
            assert ds.wait_epoch(0, timeout=30)
            assert _replicas_per_step(steps) == [3, 2, 2, 2, 2, 2]
        rows = table.lookup(np.arange(52, dtype=np.int64), admit=False)
    np.testing.assert_array_equal(rows, np.ones((52, 1), np.float32))
