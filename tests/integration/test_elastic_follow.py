"""Parameter servers that follow the cluster spec (coordinator/ps_follow.py),
on real processes and a real TF_CONFIG file, as a ConfigMap or
``coordinator run --ps-dns`` gives it: a server the file gains is added and
one it loses is drained while workers train, every example counted exactly
once; a server that does not answer pauses nothing and is added once it
answers; a drain that is refused changes nothing and is not tried again."""
from __future__ import annotations

import json
import logging
import socket
import time

import numpy as np
import pytest

from coordinator import (
    ClusterCoordinator,
    LocalCluster,
    cli,
    ps_pool,
)
from coordinator.cluster_spec import TFConfigClusterResolver
from psserver.contract import TOKEN_ENV
from tests.integration.test_elastic import (
    _each_example_once,
    _job,
    _rows,
    _schedule_epoch,
)

pytestmark = pytest.mark.timeout(240)


def _write(path, ps, worker) -> None:
    """The cluster file rewritten as a deployment does it (whole, then renamed)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"cluster": {"ps": list(ps), "worker": list(worker)}}))
    tmp.replace(path)


def _until(what, timeout: float = 60.0) -> None:
    """Wait for ``what()`` (the follower acts on its own thread), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "the follower did not act in time"
        time.sleep(0.05)


@pytest.fixture
def file_cluster(tmp_path, monkeypatch):
    """(LocalCluster of 2 ps and 2 workers, its spec's file, a resolver reading it)."""
    with LocalCluster(num_ps=2, num_workers=2, tls=False) as cluster:
        monkeypatch.setenv(TOKEN_ENV, cluster.token)
        spec = cluster.spec.cluster_spec()
        path = tmp_path / "tf_config.json"
        _write(path, spec.ps, spec.worker)
        yield cluster, path, TFConfigClusterResolver(str(path))


def test_a_server_the_file_gains_is_added_and_one_it_loses_drained_while_workers_train(
        file_cluster, monkeypatch, capsys):
    cluster, path, resolver = file_cluster
    ps, workers = list(resolver.cluster_spec().ps), list(resolver.cluster_spec().worker)
    strategy, counter, emb, w = _job(resolver)
    with ClusterCoordinator(strategy, elastic_servers=True, membership_interval=0.2) as coord:
        ds, steps, done = _schedule_epoch(coord, counter, emb, w)
        done[steps // 4].fetch()
        added = cluster.add_ps()
        _write(path, ps + [added], workers)   # (the ConfigMap lists the new pod)
        _until(lambda: ("add", added) in coord._follower.done)
        assert emb.num_shards == 3 and counter.num_shards == 3
        assert strategy.parameter_servers == (*ps, added)
        assert _rows([added], "counter")[0] > 0 and _rows([added], "emb")[0] > 0
        # coordinator ps list: each server's share of each table's buckets now
        monkeypatch.setenv("TF_CONFIG_FILE", str(path))
        capsys.readouterr()
        assert cli.main(["ps", "list", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)["servers"]
        for name in ("counter", "emb"):
            shards = [t for s in listed for t in s["tables"] if t["table"] == name]
            assert len(shards) == 3 and sum(t["buckets"] for t in shards) == 4096
            assert abs(shards[2]["buckets"] - 4096 // 3) <= 1
            assert {t["layout_epoch"] for t in shards} == {2}
        assert cli.main(["ps", "list"]) == 0
        assert f"{shards[2]['buckets']} (layout 2)" in capsys.readouterr().out
        done[steps // 2].fetch()
        queued, _ = coord.pending()
        _write(path, ps, workers)   # (and no longer lists it: drained)
        _until(lambda: ("remove", added) in coord._follower.done)
        _each_example_once(coord, ds, done, counter, w, steps)
        assert queued > 0   # (steps ran after the drain)
        for t in (counter, emb):
            assert t.num_shards == 2 and added not in t.addresses
            assert ps_pool.client_for(added).table_info(t.name).rows == 0
        assert coord._follower.pending == {}
        # ps list of the drained server: 0 buckets of each table, at the last layout
        assert cli.main(["ps", "list", "--json", "--ps", added]) == 0
        shards = json.loads(capsys.readouterr().out)["servers"][0]["tables"]
        assert [(t["buckets"], t["layout_epoch"]) for t in shards] == [(0, 4), (0, 4)]


def test_a_server_that_does_not_answer_pauses_nothing_and_a_refused_drain_is_not_retried(
        file_cluster, caplog):
    closed_port = socket.socket()
    closed_port.bind(("127.0.0.1", 0))
    cluster, path, resolver = file_cluster
    ps, workers = list(resolver.cluster_spec().ps), list(resolver.cluster_spec().worker)
    strategy, counter, emb, w = _job(resolver)
    caplog.set_level(logging.WARNING, logger="coordinator")
    with ClusterCoordinator(strategy, elastic_servers=True, membership_interval=0.1) as coord:
        follower = coord._follower
        # listed before its process serves (a pod's DNS name comes first): a port
        # bound here and not listening refuses every connection
        silent = f"127.0.0.1:{closed_port.getsockname()[1]}"
        _write(path, ps + [silent], workers)
        _until(lambda: follower.pending.get(silent) == "add" and "does not answer" in caplog.text)
        # steps go on meanwhile (no between-steps pause held for it)
        ds, steps, done = _schedule_epoch(coord, counter, emb, w)
        done[steps // 8].fetch()
        assert silent not in strategy.parameter_servers and emb.num_shards == 2
        assert caplog.text.count("does not answer") == 1   # (once per outage)
        # server 0 left the file: its variable w would move to server 1, which holds
        # another variable named w, so the drain is refused, once, nothing changed,
        # and not tried again while the file says the same
        assert w.shards[0].address == ps[0]
        ps_pool.client_for(ps[1]).create_variable("w", shape=(1,))
        _write(path, [ps[1], silent], workers)
        _until(lambda: "draining it was refused" in caplog.text and ps[0] not in follower.pending)
        assert strategy.parameter_servers == tuple(ps) and emb.num_shards == 2
        _each_example_once(coord, ds, done, counter, w, steps)
        looks = follower.looks
        _until(lambda: follower.looks >= looks + 5)   # none of them tries the drain again
        assert caplog.text.count("draining it was refused") == 1
        assert follower.pending == {silent: "add"}
    closed_port.close()


def test_a_server_the_file_names_another_way_is_neither_added_nor_drained(file_cluster,
                                                                          caplog):
    """The file switches a server's name (127.0.0.1:P to localhost:P, as a
    ConfigMap moved to other names): the same process, so it is not added
    under the new name (refused: it would move buckets to itself) nor
    drained under the old one; the table stays whole."""
    cluster, path, resolver = file_cluster
    ps, workers = list(resolver.cluster_spec().ps), list(resolver.cluster_spec().worker)
    strategy, counter, emb, w = _job(resolver)
    caplog.set_level(logging.WARNING, logger="coordinator")
    keys = np.arange(5000, dtype=np.int64)
    emb.lookup(keys)
    want = emb.lookup(keys, admit=False)
    with ClusterCoordinator(strategy, elastic_servers=True, membership_interval=0.1) as coord:
        renamed = "localhost:" + ps[1].rsplit(":", 1)[1]
        _until(lambda: coord._follower._seen is not None)   # (it saw the first names)
        _write(path, [ps[0], renamed], workers)
        _until(lambda: "names parameter server" in caplog.text and not coord._follower.pending)
        assert "(the same process, named another way)" in caplog.text
        assert strategy.parameter_servers == tuple(ps) and emb.addresses == tuple(ps)
        assert emb.layout_epoch == 0
        np.testing.assert_array_equal(emb.lookup(keys, admit=False), want)


def test_a_coordinator_made_again_after_the_spec_grew_adopts_the_table_as_made(tmp_path,
                                                                               monkeypatch):
    """The table was made over 2 servers; the file then lists a third (the
    ConfigMap's first step) and the coordinator is made again before any
    move: the table is adopted over the 2 that hold it (not an even map over
    3, which would look for half the keys where they never were), and the
    following coordinator adds the third as it would have."""
    with LocalCluster(num_ps=3, num_workers=1, tls=False) as cluster:
        monkeypatch.setenv(TOKEN_ENV, cluster.token)
        spec = cluster.spec.cluster_spec()
        path = tmp_path / "tf_config.json"
        _write(path, spec.ps[:2], spec.worker)
        args = dict(initializer="zeros", optimizer="sgd",
                    optimizer_params={"learning_rate": 1.0}, seed=5)
        first = TFConfigClusterResolver(str(path))
        from coordinator import ParameterServerStrategy
        emb = ParameterServerStrategy(first).create_embedding_table("emb", 2, **args)
        keys = np.arange(6000, dtype=np.int64)
        emb.lookup(keys)
        emb.push_gradient(keys, np.ones((keys.size, 2), np.float32))
        _write(path, spec.ps, spec.worker)   # (a third listed)
        again = ParameterServerStrategy(TFConfigClusterResolver(str(path)))
        emb2 = again.create_embedding_table("emb", 2, **args)
        assert emb2.addresses == tuple(spec.ps[:2]) and emb2.layout_epoch == 0
        np.testing.assert_array_equal(emb2.lookup(keys, admit=False)[:, 0], -1.0)
        assert ps_pool.client_for(spec.ps[2]).list_tables() == []
        with ClusterCoordinator(again, elastic_servers=True, membership_interval=0.1) as coord:
            _until(lambda: ("add", spec.ps[2]) in coord._follower.done)
            assert emb2.addresses == tuple(spec.ps)
            np.testing.assert_array_equal(emb2.lookup(keys, admit=False)[:, 0], -1.0)
