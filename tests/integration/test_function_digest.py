"""Functions sent by value cross the wire once per worker process: after
the first closure, the coordinator sends the function's digest alone
(FunctionRef.digest), and by value again where the worker let it go."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import (
    ClusterCoordinator,
    LocalCluster,
    ParameterServerStrategy,
    serialization,
)
from protos.pstrain.v1 import worker_pb2
from psserver.errors import Code, PSError
from psserver.link import methods
from psserver.link.channel import TaskChannel
from psworker.worker import FUNCTIONS_KEPT

pytestmark = pytest.mark.timeout(180)


def _make(i: int, payload: np.ndarray):
    def fn():
        return i + float(payload.sum())   # (a closure: not importable, so sent by value)
    return fn


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_ps=1, num_workers=1) as c:
        yield c


def test_a_large_closure_goes_once_and_comes_back_when_evicted(cluster):
    strategy = ParameterServerStrategy(cluster.spec)
    big = np.ones(1 << 20, np.float32)   # 4 MiB captured
    fns = [_make(i, big if i == 0 else np.zeros(1)) for i in range(FUNCTIONS_KEPT + 3)]
    with ClusterCoordinator(strategy) as coord:
        channel = coord.cluster.membership.workers[cluster.workers[0].address]._channel
        sent = []
        real_call = channel.call

        def spy(method, request, timeout):
            if method is methods.RUN_CLOSURE:
                sent.append(request.fn.WhichOneof("kind"))
            return real_call(method, request, timeout)
        channel.call = spy
        assert [coord.schedule(fns[0]).fetch() for _ in range(3)] == [float(1 << 20)] * 3
        assert sent == ["pickled", None, None]   # by digest alone after the first
        for f in fns[1:]:   # more functions than the worker keeps: fns[0] is let go
            coord.schedule(f).fetch()
        sent.clear()
        assert coord.schedule(fns[0]).fetch() == float(1 << 20)
        assert sent == [None, "pickled"]   # NOT_FOUND, then by value again


def test_a_digest_the_worker_lacks_or_that_lies_is_refused(cluster):
    w = cluster.workers[0]
    ref = serialization.encode_function(_make(7, np.zeros(1)))
    with TaskChannel(w.address, role="worker", token=cluster.token, tls=cluster.tls) as ch:
        with pytest.raises(PSError) as info:
            ch.call(methods.RUN_CLOSURE, worker_pb2.ClosureRequest(
                fn=worker_pb2.FunctionRef(digest=b"x" * 16),
                args=serialization.dumps(((), {}))), 30)
        assert info.value.code == Code.NOT_FOUND and "send it by value" in str(info.value)
        lying = worker_pb2.FunctionRef(pickled=ref.pickled, digest=b"y" * 16)
        with pytest.raises(PSError) as info:
            ch.call(methods.RUN_CLOSURE, worker_pb2.ClosureRequest(
                fn=lying, args=serialization.dumps(((), {}))), 30)
        assert info.value.code == Code.INVALID_ARGUMENT
        with pytest.raises(PSError) as info:   # (the lie was not kept under its digest)
            ch.call(methods.RUN_CLOSURE, worker_pb2.ClosureRequest(
                fn=worker_pb2.FunctionRef(digest=b"y" * 16),
                args=serialization.dumps(((), {}))), 30)
        assert info.value.code == Code.NOT_FOUND
        reply = ch.call(methods.RUN_CLOSURE, worker_pb2.ClosureRequest(
            fn=ref, args=serialization.dumps(((), {}))), 30)
        assert serialization.loads(reply.result, trusted=True) == 7.0
