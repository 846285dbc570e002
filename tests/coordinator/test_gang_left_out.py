"""Which workers a re-forming left out come back into an all-reduce ring,
and when (coordinator/gang.py ``_note_left_out``, ``_back``, ``joining``):
pure logic, with a stand-in for the cluster's worker threads (their
connections made) and for the clock."""
from __future__ import annotations

import types

from coordinator import gang


class _Worker:
    def __init__(self):
        self.connects_made = 0


def _gangs(addresses):
    workers = {a: _Worker() for a in addresses}
    cluster = types.SimpleNamespace(membership=types.SimpleNamespace(workers=workers))
    return gang.Gangs(cluster), workers


def test_a_worker_left_out_comes_back_once_it_connects_again_no_sooner_than_its_backoff(
        monkeypatch):
    now = [100.0]
    monkeypatch.setattr(gang.time, "monotonic", lambda: now[0])
    g, workers = _gangs(["a", "b", "c"])
    g.known = {"a", "b", "c"}
    spec = ["a", "b", "c"]
    # c reconnected during the re-forming: counted from before it asked
    workers["c"].connects_made = 1
    with g._lock:
        g._note_left_out(spec, ("a", "b"), {"a": 1, "b": 1, "c": 0})
        assert not g._back("a") and not g._back("c")   # (its backoff: 1 s)
    assert g.joining(spec) == 0
    now[0] += 1.0
    assert g.joining(spec) == 1   # c is back: the next step admits it
    with g._lock:
        assert g._back("c") and not g._back("b")
    # left out again (it flaps): 2 s, then 4 s; one that connects no more stays out
    for wait in (2.0, 4.0):
        with g._lock:
            g._note_left_out(spec, ("a", "b"), {"c": workers["c"].connects_made})
        workers["c"].connects_made += 1
        now[0] += wait - 0.5
        assert g.joining(spec) == 0
        now[0] += 0.5
        assert g.joining(spec) == 1
    with g._lock:   # a member again: its backoff starts over
        g._note_left_out(spec, ("a", "b", "c"), {})
        assert g.left_out == {} and "c" not in g._back_after


def test_a_worker_that_leaves_the_spec_is_forgotten_and_comes_back_as_a_joiner():
    g, workers = _gangs(["a", "b", "c"])
    g.known = {"a", "b", "c"}
    with g._lock:
        g._note_left_out(["a", "b"], ("a", "b"), {})   # c left the spec
        assert g.known == {"a", "b"} and g.left_out == {}
    assert g.joining(["a", "b", "c"]) == 1   # listed again: a joiner
