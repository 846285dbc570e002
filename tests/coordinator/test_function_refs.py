"""How a closure's function goes to a worker process (worker_channel's
_run_closure): by value the first time, by its digest alone after, by value
again where the process let it go (NOT_FOUND) or predates digests
(INVALID_ARGUMENT: then by value from there on). A stub channel stands in
for the worker; tests/integration/test_function_digest.py runs the real one."""
from __future__ import annotations

import types

import numpy as np

from coordinator import serialization
from coordinator.closures import Closure
from coordinator.worker_channel import _SharedWorker, _WorkerThread
from psserver.errors import InvalidArgument, NotFound


class _Channel:
    def __init__(self, refuse_digests: type | None):
        self.refuse, self.sent = refuse_digests, []

    def call(self, method, request, timeout):
        kind = request.fn.WhichOneof("kind")
        self.sent.append(kind)
        if kind is None and self.refuse is not None:
            raise self.refuse("no function in the request")
        return "reply"


def _thread(refuse_digests=None):
    t = _WorkerThread.__new__(_WorkerThread)
    t._shared, t.worker_id = _SharedWorker(), "w1"
    t._channel = _Channel(refuse_digests)
    t.cluster = types.SimpleNamespace(closure_timeout=None)
    return t


def _closure():
    payload = np.arange(4)
    ref = serialization.encode_function(lambda: payload.sum())
    return Closure(ref, serialization.dumps(((), {})), "f")


def test_by_value_once_then_by_digest():
    t, c = _thread(), _closure()
    for _ in range(3):
        assert t._run_closure(c) == "reply"
    assert t._channel.sent == ["pickled", None, None]


def test_a_worker_that_let_it_go_gets_it_again():
    t, c = _thread(NotFound), _closure()
    t._run_closure(c)
    t._run_closure(c)
    assert t._channel.sent == ["pickled", None, "pickled"]


def test_a_worker_from_before_digests_gets_values_from_then_on():
    t, c = _thread(InvalidArgument), _closure()
    for _ in range(3):
        t._run_closure(c)
    assert t._channel.sent == ["pickled", None, "pickled", "pickled"]


def test_a_restarted_process_starts_afresh():
    t, c = _thread(), _closure()
    t._run_closure(c)
    t.worker_id = "w2"
    t._run_closure(c)
    assert t._channel.sent == ["pickled", "pickled"] and set(t._shared.functions) == {"w2"}
