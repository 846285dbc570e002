"""How a step's calls are settled and resent (coordinator/ps_pool.py's
ParameterServers.settle), against fake clients: pure logic, no processes."""
import threading

import pytest

from coordinator import ps_pool
from coordinator.ps_pool import Op, ParameterServers
from coordinator.routes import Route
from coordinator.variables import Shard, ShardedVariable
from psserver.errors import InvalidArgument, NotFound, NotPrimary, Unavailable
from psserver.link.pending import Pending


class FakeServer:
    """Answers each call with the next of ``script`` (an exception is raised,
    anything else returned), recording every request it was sent;
    ``fail_on_send`` raises while sending instead of from result()."""

    def __init__(self, *script, fail_on_send=False):
        self.script, self.requests, self.fail_on_send = list(script), [], fail_on_send
        self.collected = 0

    def op(self, request, routes=(), pairs=()) -> Op:
        def send(client):
            self.requests.append(request)
            outcome = self.script.pop(0) if self.script else "ok"
            if self.fail_on_send and isinstance(outcome, Exception):
                raise outcome
            return Pending(lambda: self._collect(outcome))
        return Op("fake:1", send, routes, pairs)

    def _collect(self, outcome):
        self.collected += 1
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(ps_pool, "RETRY_SECONDS", 5.0)
    p = ParameterServers()
    p._clients["fake:1"] = object()   # the fake ops need no client
    return p


def test_results_in_order_and_retryable_failures_resent_with_the_same_request(pool):
    a = FakeServer(Unavailable("restarting"), NotFound("not restored yet"), "a-done")
    b = FakeServer("b-done")
    assert pool.settle(lambda: [a.op(("w/part_0", 7)), b.op(("w/part_1", 8))]) == \
        ["a-done", "b-done"]
    assert a.requests == [("w/part_0", 7)] * 3   # the same request: the same update keys
    assert b.requests == [("w/part_1", 8)]


def test_a_failure_while_sending_is_resent_too(pool):
    a = FakeServer(Unavailable("refused"), "ok", fail_on_send=True)
    assert pool.settle(lambda: [a.op("r")]) == ["ok"] and len(a.requests) == 2


def test_a_bad_request_is_not_resent_and_the_other_replies_are_collected(pool):
    a = FakeServer(InvalidArgument("wrong shape"))
    b, c = FakeServer("ok"), FakeServer("ok")
    with pytest.raises(InvalidArgument):
        pool.settle(lambda: [a.op("r"), b.op("r"), c.op("r")])
    assert len(a.requests) == 1
    assert b.collected == c.collected == 1   # drained: no connection left holding a reply


def test_resending_stops_at_the_deadline(pool, monkeypatch):
    monkeypatch.setattr(ps_pool, "RETRY_SECONDS", 0.3)
    a = FakeServer(*[Unavailable("down")] * 1000)
    with pytest.raises(Unavailable):
        pool.settle(lambda: [a.op("r")])
    assert 2 <= len(a.requests) < 1000


def test_not_primary_without_replicas_to_ask_about_goes_up_when_no_move_explains_it(
        pool, monkeypatch):
    """Resent for MOVE_WAIT_SECONDS (a variable shard's move refuses calls
    for a moment), then it goes up (a table's refusal goes up at once:
    tests/integration/test_elastic.py)."""
    monkeypatch.setattr(ps_pool, "MOVE_WAIT_SECONDS", 0.2)
    a = FakeServer(*[NotPrimary("a backup")] * 1000)
    with pytest.raises(NotPrimary):
        pool.settle(lambda: [a.op("r")])
    assert 2 <= len(a.requests) < 1000


def test_a_call_refused_during_a_variable_shards_move_is_planned_again_once_recorded(pool):
    """Review 23: the coordinator process's own call meets the shard's copy
    handed over (NotPrimary) or deleted (NotFound) while the move runs; once
    the move is recorded (placement), the call is planned again on the new
    server, with the same request."""
    from coordinator import placement
    placement.forget()
    shard = Shard("fake:1", "w", 0, 4)
    moved = FakeServer("at-the-new-server")
    pool._clients["new:1"] = object()
    old = FakeServer(NotPrimary("a backup copy"), *[NotFound("deleted")] * 1000)

    def plan():
        server = old if shard.address == "fake:1" else moved
        op = server.op(("w", 7))
        return [Op(shard.address, op.send)]

    def record_after_two():
        for _ in range(500):   # (at most 5 s)
            if len(old.requests) >= 2:
                break
            threading.Event().wait(0.01)
        placement.record("fake:1", "w", "new:1")
    mover = threading.Thread(target=record_after_two)
    mover.start()
    try:
        assert pool.settle(plan) == ["at-the-new-server"]
    finally:
        mover.join()
        placement.forget()
    assert moved.requests == [("w", 7)] and old.requests[:2] == [("w", 7)] * 2


def _replicated() -> ShardedVariable:
    return ShardedVariable("w", (4,), "float32", (Shard("ps0:1", "w", 0, 4),),
                           backups=(Shard("ps1:1", "w", 0, 4),))


def test_a_moved_primary_replans_the_whole_step(pool, monkeypatch):
    """A call that reaches replicated shards and fails asks who leads; when
    a route it was planned on changed, the step's calls are planned again
    (the keys stay those of the first plan)."""
    v = _replicated()
    flipped = Route(flipped=True)
    monkeypatch.setattr(pool, "refresh", lambda pairs: pool.routes.set(v.shards[0], flipped))
    plans = []

    def plan():
        r = pool.routes.route(v, 0)
        server = FakeServer(NotPrimary("moved")) if not plans else FakeServer("done")
        plans.append((server, r))
        return [server.op(("w", 42), (((v.shards[0].address, "w"), r),), ((v, 0),))]
    assert pool.settle(plan) == ["done"]
    assert len(plans) == 2 and plans[1][0].requests == [("w", 42)]
    assert plans[1][1] == flipped   # planned again on the new route


def test_a_route_another_thread_found_moved_replans_too(pool, monkeypatch):
    """The route changed before this call asked (another thread refreshed
    first): this call's refresh changes nothing, yet it is planned again,
    not resent to the old copy until the deadline."""
    v = _replicated()
    moved_by_other = threading.Event()

    def refresh(pairs):   # another thread found out first: nothing changes here
        return False
    monkeypatch.setattr(pool, "refresh", refresh)
    plans = []

    def plan():
        r = pool.routes.route(v, 0)
        if not plans:
            server = FakeServer(NotPrimary("moved"))
            pool.routes.set(v.shards[0], Route(flipped=True))   # meanwhile, elsewhere
            moved_by_other.set()
        else:
            server = FakeServer("done")
        plans.append(server)
        return [server.op("r", (((v.shards[0].address, "w"), r),), ((v, 0),))]
    assert pool.settle(plan) == ["done"] and len(plans) == 2
    assert moved_by_other.is_set()


def test_start_sends_now_and_settles_in_result(pool):
    a = FakeServer(Unavailable("restarting"), "done")
    sent = pool.start(lambda: [a.op("r")])
    assert a.requests == ["r"]   # sent before result() is asked
    assert sent.result() == ["done"] and a.requests == ["r", "r"]
