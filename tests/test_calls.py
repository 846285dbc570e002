"""How a step's calls are settled and resent (coordinator/calls.py), against a
fake transport: pure logic, no processes."""
import pytest

from coordinator import calls
from psserver.contract import InvalidArgument, NotFound, NotPrimary, Unavailable


class FakeServer:
    """Answers each call with the next of ``script`` (an exception is raised,
    anything else returned), recording every request it was sent; ``fail_on_send``
    raises while sending instead of from result()."""

    def __init__(self, *script, fail_on_send=False):
        self.script, self.requests, self.fail_on_send = list(script), [], fail_on_send
        self.collected = 0

    def start(self, request):
        def call(first: bool):
            self.requests.append(request)
            outcome = self.script.pop(0) if self.script else "ok"
            if self.fail_on_send and isinstance(outcome, Exception):
                raise outcome
            return _Reply(self, outcome)
        return call


class _Reply:
    def __init__(self, server, outcome):
        self.server, self.outcome = server, outcome

    def result(self):
        self.server.collected += 1
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(calls, "RETRY_SECONDS", 5.0)


def test_results_in_order_and_retryable_failures_resent_with_the_same_request():
    a = FakeServer(Unavailable("restarting"), NotFound("not restored yet"), "a-done")
    b = FakeServer("b-done")
    assert calls._settle([a.start(("w/part_0", 7)), b.start(("w/part_1", 8))]) == \
        ["a-done", "b-done"]
    assert a.requests == [("w/part_0", 7)] * 3   # the same request: the same update keys
    assert b.requests == [("w/part_1", 8)]


def test_a_failure_while_sending_is_resent_too():
    a = FakeServer(Unavailable("refused"), "ok", fail_on_send=True)
    assert calls._settle([a.start("r")]) == ["ok"] and len(a.requests) == 2


def test_a_bad_request_is_not_resent_and_the_other_replies_are_collected():
    a = FakeServer(InvalidArgument("wrong shape"))
    b, c = FakeServer("ok"), FakeServer("ok")
    with pytest.raises(InvalidArgument):
        calls._settle([a.start("r"), b.start("r"), c.start("r")])
    assert len(a.requests) == 1
    assert b.collected == c.collected == 1   # drained: no connection left holding a reply


def test_resending_stops_at_the_deadline(monkeypatch):
    monkeypatch.setattr(calls, "RETRY_SECONDS", 0.3)
    a = FakeServer(*[Unavailable("down")] * 1000)
    with pytest.raises(Unavailable):
        calls._settle([a.start("r")])
    assert 2 <= len(a.requests) < 1000


def test_not_primary_without_replicas_to_ask_about_goes_up_at_once():
    a = FakeServer(NotPrimary("a backup"))
    with pytest.raises(NotPrimary):
        calls._settle([a.start("r")])
    assert len(a.requests) == 1


def test_a_moved_primary_replans_the_whole_step(monkeypatch):
    """A call that reaches replicated shards asks where their primaries are
    (coordinator.routes.refresh); when one moved, _routed plans the step's
    calls again (the keys stay those of the first plan)."""
    moved = iter([True, False])
    monkeypatch.setattr(calls.routes, "refresh", lambda pairs: next(moved))
    plans = []

    def plan():
        server = FakeServer(NotPrimary("moved")) if not plans else FakeServer("done")
        plans.append(server)
        start = server.start(("w", 42))
        start.pairs = [("variable", 0)]
        return calls._settle([start])
    assert calls._routed(plan) == ["done"]
    assert len(plans) == 2 and plans[1].requests == [("w", 42)]
