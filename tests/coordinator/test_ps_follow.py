"""The follower's rules (coordinator/ps_follow.py) as pure logic: what a
change of the cluster spec's parameter servers asks for, and what is done
about a server that does not answer, a refusal and a failure. The
integration test (tests/integration/test_elastic_follow.py) runs it on real
servers."""
from __future__ import annotations

import types

import pytest

from coordinator import ps_follow
from psserver.errors import Unavailable


class _Job:
    """A strategy as the follower sees it: the spec it reads, the job's
    servers and tables; add/remove as the coordinator's, recorded."""

    def __init__(self, ps):
        self.listed, self.parameter_servers, self.tables = list(ps), tuple(ps), []
        self.calls, self.fail = [], {}
        self.cluster_resolver = types.SimpleNamespace(
            cluster_spec=lambda: types.SimpleNamespace(ps=list(self.listed)))

    def add(self, address):
        self.calls.append(("add", address))
        if address in self.fail:
            raise self.fail[address]
        self.parameter_servers += (address,)
        return []

    def remove(self, address):
        self.calls.append(("remove", address))
        if address in self.fail:
            raise self.fail[address]
        self.parameter_servers = tuple(a for a in self.parameter_servers if a != address)
        return []


@pytest.fixture
def follow(monkeypatch):
    down = set()

    def client_for(address):
        def server_info(timeout=None):
            if address in down:
                raise Unavailable(f"nothing answers at {address}")
        return types.SimpleNamespace(server_info=server_info)
    monkeypatch.setattr(ps_follow.ps_pool, "client_for", client_for)

    def make(ps):
        job = _Job(ps)
        return job, ps_follow.ServerFollower(job, job.add, job.remove), down
    return make


def test_only_changes_of_the_spec_are_acted_on(follow):
    job, f, _ = follow(["a:1", "b:1"])
    job.listed.append("c:1")   # listed when the coordinator starts, not in the job: added
    f.look()
    assert job.calls == [("add", "c:1")] and f.pending == {}
    job.remove("b:1")   # drained by the API: the spec still lists it, and is not undone
    job.calls.clear()
    f.look()
    assert job.calls == []
    job.listed.remove("c:1")   # the spec loses it: drained
    f.look()
    assert job.calls == [("remove", "c:1")] and job.parameter_servers == ("a:1",)


def test_a_server_that_does_not_answer_waits_and_a_change_back_cancels(follow):
    job, f, down = follow(["a:1", "b:1"])
    f.look()
    down.add("c:1")
    job.listed.append("c:1")
    f.look()
    f.look()
    assert job.calls == [] and f.pending == {"c:1": "add"}   # (no add tried: no pause)
    job.listed.remove("c:1")   # gone from the spec before it answered
    f.look()
    assert f.pending == {} and job.calls == []
    down.clear()
    job.listed.append("c:1")
    f.look()
    assert job.calls == [("add", "c:1")]


def test_a_refusal_is_dropped_and_a_failure_tried_again(follow):
    job, f, _ = follow(["a:1", "b:1"])
    f.look()
    job.fail["a:1"] = ValueError("holds shards of variables")
    job.fail["b:1"] = Unavailable("lost during the move")
    job.listed[:] = []
    f.look()
    assert f.pending == {"b:1": "remove"}   # a: refused, dropped; b: kept
    f.look()
    assert job.calls.count(("remove", "a:1")) == 1 and job.calls.count(("remove", "b:1")) == 2
    del job.fail["b:1"]
    f.look()
    assert f.pending == {} and job.parameter_servers == ("a:1",)


def test_wanted_reads_the_environment_only_when_not_given():
    assert ps_follow.wanted(None, {ps_follow.ELASTIC_ENV: "1"})
    assert not ps_follow.wanted(None, {})
    assert not ps_follow.wanted(False, {ps_follow.ELASTIC_ENV: "1"})
    assert ps_follow.wanted(True, {})
