"""coordinator/checkpoint_io.py: how a checkpoint's save calls are run and
watched (pure logic, fake servers: the real ones are in
tests/integration/test_checkpoint.py)."""
from __future__ import annotations

import threading

import pytest

from coordinator import checkpoint_io as C
from psserver.errors import DeadlineExceeded, PermissionDenied, Unavailable


def test_each_servers_save_calls_run_one_at_a_time_and_servers_at_once():
    """Many calls at once on one server would each copy a shard under its
    lock and fill its request threads (a review found 26 at once); the
    servers still save side by side. close() cancels the calls not started."""
    lock, active, most = threading.Lock(), {}, {}
    both = threading.Barrier(2, timeout=10)   # both servers' first calls meet: side by side
    started: dict[str, int] = {}

    def call(addr):
        with lock:
            active[addr] = active.get(addr, 0) + 1
            most[addr] = max(most.get(addr, 0), active[addr])
            first = started[addr] = started.get(addr, 0) + 1
        if first == 1:
            both.wait()
        with lock:
            active[addr] -= 1
        return addr
    saves = C._Saves()
    jobs = [saves.submit(a, call, a) for _ in range(8) for a in ("x:1", "y:2")]
    assert [j.result(timeout=10) for j in jobs] == ["x:1", "y:2"] * 8
    saves.close()
    assert most == {"x:1": 1, "y:2": 1}

    gate, begun = threading.Event(), threading.Event()

    def first():
        begun.set()
        return gate.wait(10)
    saves = C._Saves()
    running = saves.submit("z:3", first)
    queued = saves.submit("z:3", call, "z:3")
    assert begun.wait(10)
    saves.close()
    gate.set()
    assert running.result(timeout=10) is True and queued.cancelled()


class _Server:
    def __init__(self, reply):
        self.reply, self.asked = reply, 0

    def server_info(self, timeout=None):
        self.asked += 1
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(C, "PROBE_EVERY", 0.01)
    monkeypatch.setattr(C, "PROBE_MISSES", 3)


def test_a_server_that_answers_nothing_fails_the_wait_naming_it(quick):
    never = C._Saves()
    gate = threading.Event()
    job = never.submit("h:1", gate.wait, 10)
    servers = {"h:1": _Server(DeadlineExceeded("no reply"))}
    with pytest.raises(Unavailable, match="h:1 answered nothing .* DeadlineExceeded"):
        C._await_saves({"h:1": [job]}, servers.__getitem__)
    assert servers["h:1"].asked == 3
    gate.set()
    never.close()


def test_a_server_that_answers_with_an_error_is_alive_and_its_save_is_waited_for(quick):
    """An error reply (PermissionDenied, say) is an answer: the server is
    alive, and the wait goes on until its save ends."""
    saves = C._Saves()
    gate = threading.Event()
    job = saves.submit("a:1", gate.wait, 10)
    server = _Server(PermissionDenied("wrong token"))

    def client_for(addr):
        if server.asked >= 5:   # answered 5 times: now let the save end
            gate.set()
        return server
    C._await_saves({"a:1": [job]}, client_for)
    assert job.result() is True and server.asked >= 5
    saves.close()


def test_the_first_failed_call_ends_the_wait_with_its_error(quick):
    saves = C._Saves()
    gate = threading.Event()

    def fail():
        raise PermissionDenied("not under --checkpoint-dir")
    slow = saves.submit("a:1", gate.wait, 10)
    failed = saves.submit("b:2", fail)
    with pytest.raises(PermissionDenied, match="checkpoint-dir"):
        C._await_saves({"a:1": [slow], "b:2": [failed]}, lambda addr: _Server("ok"))
    gate.set()
    saves.close()
