"""The follower's rules (coordinator/ps_follow.py) as pure logic: what a
change of the cluster spec's parameter servers asks for, and what is done
about a spec that lists none, a removal that does not last, a server that
does not answer, restarted or is named another way, a refusal and a
failure. The integration test (tests/integration/test_elastic_follow.py)
runs it on real servers."""
from __future__ import annotations

import types

import numpy as np
import pytest

from coordinator import elastic, ps_follow
from psserver.contract.keys import BUCKETS, BucketMap
from psserver.errors import Unavailable


class _Job:
    """A strategy as the follower sees it: the spec it reads, the job's
    servers (their server_ids) and tables; add/remove as the coordinator's,
    recorded."""

    def __init__(self, ps):
        self.listed, self.parameter_servers, self.tables = list(ps), tuple(ps), []
        self.server_ids = {a: f"id-{a}" for a in ps}
        self.calls, self.fail = [], {}
        self.cluster_resolver = types.SimpleNamespace(
            cluster_spec=lambda: types.SimpleNamespace(ps=list(self.listed)))

    def add(self, address):
        self.calls.append(("add", address))
        if address in self.fail:
            raise self.fail[address]
        self.parameter_servers += (address,)
        self.server_ids[address] = f"id-{address}"
        return []

    def remove(self, address):
        self.calls.append(("remove", address))
        if address in self.fail:
            raise self.fail[address]
        self.parameter_servers = tuple(a for a in self.parameter_servers if a != address)
        return []


@pytest.fixture
def follow(monkeypatch):
    """make(ps) -> (job, follower, servers): ``servers`` maps an address to
    the server_id it answers with (absent: it does not answer); the
    follower's clock is ``follower.now[0]``, moved by hand."""
    servers: dict[str, str] = {}

    def client_for(address):
        def server_info(timeout=None, drains=False):
            if address not in servers:
                raise Unavailable(f"nothing answers at {address}")
            if isinstance(servers[address], Exception):
                raise servers[address]
            return types.SimpleNamespace(server_id=servers[address])
        return types.SimpleNamespace(server_info=server_info)
    monkeypatch.setattr(ps_follow.ps_pool, "client_for", client_for)

    def make(ps, busy=lambda a: False):
        job = _Job(ps)
        servers.update({a: f"id-{a}" for a in ps})
        now = [0.0]
        f = ps_follow.ServerFollower(job, job.add, job.remove, interval=1.0, busy=busy,
                                     clock=lambda: now[0])
        f.now = now
        return job, f, servers
    return make


def _later(f, seconds: float) -> None:
    f.now[0] += seconds
    f.look()


def test_only_changes_of_the_spec_are_acted_on_and_a_removal_after_its_grace(follow):
    job, f, servers = follow(["a:1", "b:1"])
    servers["c:1"] = "id-c:1"
    job.listed.append("c:1")   # listed when the coordinator starts, not in the job: added
    f.look()
    assert job.calls == [("add", "c:1")] and f.pending == {}
    job.remove("b:1")   # drained by the API: the spec still lists it, and is not undone
    job.calls.clear()
    f.look()
    assert job.calls == []
    job.listed.remove("c:1")   # the spec loses it: drained once missing for the grace
    _later(f, 1)
    _later(f, f.grace - 2)
    assert job.calls == [] and f.pending == {"c:1": "remove"}
    job.listed.append("c:1")   # back before the grace ran out: nothing happens
    _later(f, 5)
    assert job.calls == [] and f.pending == {}
    job.listed.remove("c:1")
    _later(f, 1)
    _later(f, f.grace)
    assert job.calls == [("remove", "c:1")] and job.parameter_servers == ("a:1",)


def test_a_spec_that_lists_no_server_changes_nothing(follow):
    job, f, _ = follow(["a:1", "b:1", "c:1"])
    f.look()
    job.listed[:] = []   # (a DNS name that did not resolve, a file half written)
    for _ in range(3):
        _later(f, f.grace)
    assert job.calls == [] and f.pending == {}
    job.listed[:] = ["a:1", "b:1", "c:1"]
    _later(f, f.grace)
    assert job.calls == []


def test_a_server_that_does_not_answer_or_is_recovered_waits_and_a_change_back_cancels(
        follow):
    recovering = set()
    job, f, servers = follow(["a:1", "b:1"], busy=lambda a: a in recovering)
    f.look()
    job.listed.append("c:1")   # listed before it serves
    f.look()
    f.look()
    assert job.calls == [] and f.pending == {"c:1": "add"}   # (no add tried: no pause)
    job.listed.remove("c:1")   # gone from the spec before it answered
    f.look()
    assert f.pending == {"c:1": "remove"} and job.calls == []
    _later(f, f.grace)
    assert f.pending == {} and job.calls == []   # (never in the job: nothing to drain)
    servers["c:1"] = "id-c:1"
    recovering.add("c:1")
    job.listed.append("c:1")
    f.look()
    assert job.calls == [] and f.pending == {"c:1": "add"}   # (its recovery first)
    recovering.clear()
    f.look()
    assert job.calls == [("add", "c:1")]


def test_a_server_that_left_the_spec_and_restarted_failed_and_is_not_drained(follow):
    job, f, servers = follow(["a:1", "b:1"])
    f.look()
    job.listed.remove("b:1")   # (its DNS name went with its process)
    del servers["b:1"]
    f.look()
    _later(f, f.grace)
    assert f.pending == {"b:1": "remove"} and job.calls == []
    servers["b:1"] = "id-b:1-restarted"   # back, recovered, a new process
    _later(f, 1)
    assert f.pending == {} and job.calls == []


def test_a_server_named_another_way_is_neither_added_nor_drained(follow):
    job, f, servers = follow(["a:1", "b:1"])
    f.look()
    servers["b.local:1"] = servers["b:1"]   # the same process
    job.listed[1] = "b.local:1"
    job.fail["b.local:1"] = ValueError("b.local:1 is the parameter server b:1 of this job")
    f.look()
    assert job.calls == [("add", "b.local:1")] and f.pending == {"b:1": "remove"}
    _later(f, f.grace)   # (the old name's removal: seen to be the same server)
    assert job.calls == [("add", "b.local:1")] and f.pending == {}
    assert job.parameter_servers == ("a:1", "b:1")


def test_a_refusal_is_dropped_and_a_failure_tried_again_later_and_later(follow):
    job, f, servers = follow(["a:1", "b:1", "c:1"])
    f.look()
    job.fail["a:1"] = ValueError("holds shards of variables")
    job.fail["b:1"] = Unavailable("lost during the move")
    job.fail["c:1"] = elastic.MoveUndetermined("cannot say whether it happened")
    servers["d:1"] = "id-d:1"
    job.listed[:] = ["d:1"]
    f.look()   # (d added now; the others' removals after the grace)
    _later(f, f.grace)
    assert f.pending == {"b:1": "remove"}   # a, c: not again; b: later
    tries = job.calls.count(("remove", "b:1"))
    for _ in range(7):
        _later(f, 1)   # seven looks, two tries (b waits 2 s, then 4 s...)
    assert job.calls.count(("remove", "b:1")) == tries + 2
    assert job.calls.count(("remove", "a:1")) == job.calls.count(("remove", "c:1")) == 1
    del job.fail["b:1"]
    _later(f, ps_follow.MAX_BACKOFF)
    assert f.pending == {} and job.parameter_servers == ("a:1", "c:1", "d:1")


def test_one_servers_unexpected_failure_holds_up_no_other(follow, caplog):
    job, f, servers = follow(["a:1", "b:1"])
    f.look()
    servers["c:1"], servers["d:1"] = RuntimeError("a bug, say"), "id-d:1"
    job.listed += ["c:1", "d:1"]
    f.look()
    f.look()
    assert job.calls == [("add", "d:1")] and f.pending == {"c:1": "add"}
    assert caplog.text.count("RuntimeError: a bug, say") == 1 and "Traceback" not in caplog.text


def test_wanted_reads_the_environment_only_when_not_given():
    assert ps_follow.wanted(None, {ps_follow.ELASTIC_ENV: "1"})
    assert not ps_follow.wanted(None, {})
    assert not ps_follow.wanted(False, {ps_follow.ELASTIC_ENV: "1"})
    assert ps_follow.wanted(True, {})


def test_an_add_that_failed_inside_a_table_is_tried_again_until_it_is_complete(follow):
    """The add stopped in the table's second move: the server is one of the
    job's and the table has a shard there, short of its share. The follower
    tries again (the coordinator completes it then), not "done"."""
    job, f, servers = follow(["a:1", "b:1"])
    f.look()
    owner = np.repeat([0, 1], BUCKETS // 2)
    owner[:100] = 2   # (BUCKETS // 3 is its share)
    table = types.SimpleNamespace(name="t", table_id="t0", layout_epoch=1,
                                  addresses=("a:1", "b:1", "c:1"),
                                  buckets=BucketMap(owner, 3))
    job.tables.append(table)
    f.look()   # (a table first seen now is on every server the spec lists)
    servers["c:1"] = "id-c:1"
    job.fail["c:1"] = Unavailable("a source did not answer")

    def add(address):   # the first try fails part way: the job has the server now
        job.calls.append(("add", address))
        job.parameter_servers += (address,)
        if job.fail.pop(address, None):
            raise Unavailable("a source did not answer")
        table.buckets = BucketMap(np.repeat([0, 1, 2], [1366, 1365, 1365]), 3)
        return []
    f._add = add
    job.listed.append("c:1")
    f.look()
    assert job.calls == [("add", "c:1")] and f.pending == {"c:1": "add"}
    _later(f, 60)
    assert job.calls == [("add", "c:1")] * 2 and f.pending == {}
    assert f.done == [("add", "c:1")]
