"""Elastic parameter servers across test hosts (bench/hosts.py): a server on
a host of its own added to a running job and drained again, the rows
moving server to server over the network with TLS and the token, while
workers on two other hosts train; every example counted exactly once. Then
the server holding a variable is drained: it moves whole, host to host."""
from __future__ import annotations

import host_gate
import numpy as np

from bench import hosts
from coordinator import (
    ClusterCoordinator,
    LocalCluster,
    ps_pool,
    push_gradients,
    read_variables,
)
from tests.integration.test_elastic import (
    EXAMPLES,
    _each_example_once,
    _job,
    _rows,
    _schedule_epoch,
)

pytestmark = host_gate.marks(240)


def _push_one(w):
    push_gradients([(w, np.ones(2, np.float32))])
    return read_variables([w])[0]


def test_a_server_on_another_host_is_added_and_drained_while_workers_train():
    with hosts.TestHosts(5) as h, \
            LocalCluster(2, 2, placement=h.placement(ps=[0, 1, 4], worker=[2, 3])) as cluster:
        strategy, counter, emb, w = _job(cluster.spec)
        assert strategy.tls is not None and all(
            a.startswith("198.18.") for a in strategy.parameter_servers)
        with ClusterCoordinator(strategy) as coord:
            ds, steps, done = _schedule_epoch(coord, counter, emb, w)
            done[steps // 4].fetch()
            added = cluster.add_ps()
            assert added.split(":")[0] == h.addresses[4]
            moves = coord.add_parameter_server(added)
            assert [m.table for m in moves] == ["counter", "emb"]
            assert all(m.rows > 0 and m.bytes > 0 for m in moves)
            assert counter.addresses[-1] == added and emb.num_shards == 3
            done[steps // 2].fetch()
            rows_there = _rows([added], "counter")[0]
            assert rows_there > 0
            drained = coord.remove_parameter_server(added)
            assert sum(m.rows for m in drained if m.table == "counter") >= rows_there
            _each_example_once(coord, ds, done, counter, w, steps)
            assert sum(_rows(counter.addresses, "counter")) == EXAMPLES
            for t in (counter, emb):
                assert t.num_shards == 2 and added not in t.addresses
                assert ps_pool.client_for(added).table_info(t.name).rows == 0
            # (each host has its own network: the moves went server to server
            # over it, and the coordinator's calls over the data ports)
            assert {ps_pool.client_for(a).route.socket for a in emb.addresses} == {"tcp"}
            # the server holding w (a variable) drained too: w moves whole, host to host
            first = w.shards[0].address
            want, counts = w.read(), counter.lookup(np.arange(EXAMPLES), admit=False)
            moved = [m for m in coord.remove_parameter_server(first) if hasattr(m, "shard")]
            assert [(m.shard, m.source) for m in moved] == [("w", first)]
            assert w.shards[0].address == moved[0].destination != first
            assert not ps_pool.client_for(first).list_variables()
            np.testing.assert_array_equal(w.read(), want)
            np.testing.assert_array_equal(counter.lookup(np.arange(EXAMPLES), admit=False),
                                          counts)
            done = coord.schedule(_push_one, args=(w,))   # (a worker, on its host)
            np.testing.assert_array_equal(done.fetch(), want - 1)
