"""The transports (psserver/link/transport.py), one contract for every kind:
the same call gives the same reply and the same typed errors over the fake
(an in-process servicer: psserver logic, no network), gRPC, the Unix
socket and the data port (a real parameter server); plus what only real
sockets can show (a wrong token is refused before anything runs, a call
that times out drops its connection)."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from protos.pstrain.v1 import ps_pb2
from psserver.client import PSClient
from psserver.contract import TOKEN_ENV, call_metadata, routing, wire, wire_decode
from psserver.core.store import VariableStore
from psserver.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    NotSent,
    Unauthenticated,
    Unavailable,
)
from psserver.link import frames, methods
from psserver.link import tensor_proto as TP
from psserver.link.transport import FakeTransport, GrpcTransport, SocketTransport
from psserver.serve.servicer import ParameterServerServicer
from psserver.tls import make_channel
from tests.integration.test_data_port import data_port_of

pytestmark = pytest.mark.timeout(60)
TABLE = np.arange(12, dtype=np.float32).reshape(6, 2)
KINDS = ["fake", "grpc", "unix", "tcp"]


def in_process(store: VariableStore | None = None) -> FakeTransport:
    """A fake transport answering with a real servicer's handlers, in process
    (the methods' request/reply messages, or bytes framed by hand)."""
    servicer = ParameterServerServicer(store or VariableStore())
    services = {methods.PS: servicer, methods.BULK: servicer}

    def handle(method, request):
        handler = getattr(services[method.service], method.handler)
        if method.request is not None and isinstance(request, (bytes, bytearray)):
            request = method.request.FromString(request)
        reply = handler(request, None)
        if isinstance(reply, (bytes, bytearray, memoryview)) and method.reply is not None:
            return method.reply.FromString(bytes(reply))
        return bytes(reply) if isinstance(reply, memoryview) else reply
    return FakeTransport(handle)


@pytest.fixture(params=KINDS)
def transport(request, start_ps):
    """A transport of each kind to a server holding variable "t" (TABLE, SGD
    at learning rate 1)."""
    kw = dict(initial_value=TABLE, optimizer="sgd", optimizer_params={"learning_rate": 1.0})
    if request.param == "fake":
        store = VariableStore()
        store.create("t", "float32", TABLE.shape, initial_value=TABLE, optimizer="sgd",
                     optimizer_params={"learning_rate": 1.0})
        t = in_process(store)
        yield t
        return
    ps = start_ps()
    with PSClient(ps.address) as c:
        c.create_variable("t", **kw)
        info = c.server_info()
    identity = f"{info.protocol_version}:{info.server_id}"
    if request.param == "grpc":
        t = GrpcTransport(make_channel(ps.address, [], None), ps.address, call_metadata(None))
    elif request.param == "unix":
        t = SocketTransport(routing.UNIX, ps.address, None, name=info.host.ipc_socket,
                            identity=identity)
    else:
        t = SocketTransport(routing.TCP, ps.address, None, identity=identity,
                            tcp=(ps.address.rsplit(":", 1)[0], data_port_of(ps)))
    yield t
    t.close()


def _transports(ps, token=None) -> list:
    """gRPC, Unix socket and data port transports to one real server."""
    with PSClient(ps.address, token=token) as c:
        info = c.server_info()
    identity = f"{info.protocol_version}:{info.server_id}"
    host = ps.address.rsplit(":", 1)[0]
    return [GrpcTransport(make_channel(ps.address, [], None), ps.address, call_metadata(token)),
            SocketTransport(routing.UNIX, ps.address, token, name=info.host.ipc_socket,
                            identity=identity),
            SocketTransport(routing.TCP, ps.address, token, identity=identity,
                            tcp=(host, data_port_of(ps)))]


def _gather(ids, name="t") -> ps_pb2.GatherRequest:
    req = ps_pb2.GatherRequest(name=name)
    TP.fill(req.ids, np.asarray(ids, np.int64))
    return req


def test_the_same_replies_and_typed_errors_on_every_transport(transport):
    reply = transport.call(methods.GATHER, _gather([4, 1]), 10.0)
    np.testing.assert_array_equal(TP.decode(reply.rows), TABLE[[4, 1]])
    sent = transport.send(methods.GATHER, _gather([5]), 10.0)   # sent now, read on result()
    np.testing.assert_array_equal(TP.decode(sent.result().rows), TABLE[[5]])
    with pytest.raises(InvalidArgument, match="99"):
        transport.call(methods.GATHER, _gather([99]), 10.0)
    with pytest.raises(NotFound):
        transport.call(methods.GATHER, _gather([0], "nope"), 10.0)
    # bytes framed by hand go as they are (the bulk push), and post makes the value
    raw = wire.encode_push_request([("t", np.ones((6, 2), np.float32), 7)])
    assert transport.send(methods.BULK_PUSH, raw, 10.0,
                          post=lambda r: list(r.versions)).result() == [1]
    # recover answers an error instead of raising it
    got = transport.send(methods.GATHER, _gather([99]), 10.0,
                         recover=lambda exc: type(exc).__name__).result()
    assert got == "InvalidArgument"
    # a hand-framed reply is taken by a receiver, into the arrays offered
    into = np.zeros((6, 2), np.float32)
    values = transport.call(
        methods.BULK_READ, ps_pb2.ReadRequest(names=["t"]), 10.0,
        receiver=lambda recv_into, n: wire_decode.receive_read_reply(recv_into, n, [("t", into)]))
    assert values[0][1] == 1 and values[0][2] is into
    np.testing.assert_array_equal(into, TABLE - 1)


def test_a_socket_refuses_a_call_it_does_not_carry_before_sending(transport):
    if not isinstance(transport, SocketTransport):
        pytest.skip("socket transports only")
    with pytest.raises(ValueError, match="not a socket call"):
        transport.send(methods.META, ps_pb2.VariableRef(name="t"), 10.0)


def test_calls_after_close_fail_unavailable(start_ps):
    ps = start_ps()
    grpc_t = GrpcTransport(make_channel(ps.address, [], None), ps.address)
    grpc_t.call(methods.SERVER_INFO, ps_pb2.ServerInfoRequest(), 10.0)
    grpc_t.close()
    with pytest.raises(Unavailable, match="closed"):
        grpc_t.call(methods.SERVER_INFO, ps_pb2.ServerInfoRequest(), 10.0)
    fake = in_process()
    fake.close()
    with pytest.raises(NotSent):   # (an Unavailable: nothing ran)
        fake.send(methods.GATHER, _gather([0]), 1.0)


def test_a_wrong_token_is_refused_before_anything_runs(start_ps):
    ps = start_ps(env={TOKEN_ENV: "right"})
    host = ps.address.rsplit(":", 1)[0]
    grpc_t = GrpcTransport(make_channel(ps.address, [], None), ps.address,
                           call_metadata("wrong"))
    try:
        with pytest.raises(Unauthenticated):
            grpc_t.call(methods.META, ps_pb2.VariableRef(name="t"), 10.0)
    finally:
        grpc_t.close()
    sock = SocketTransport(routing.TCP, ps.address, "wrong", tcp=(host, data_port_of(ps)))
    with pytest.raises(Unauthenticated):   # raised by send: refused at its hello, nothing ran
        sock.send(methods.GATHER, ps_pb2.GatherRequest(name="t"), 10.0)
    sock.close()


class _HalfReplyServer:
    """Speaks the frame protocol's hello, then answers the first call with a
    reply header and half its body, and stalls: a server stuck mid-reply."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.closed_by_client = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        conn, _ = self.sock.accept()
        with conn:
            _, n, _ = frames.REQUEST.unpack(frames.recv_exact(conn, frames.REQUEST.size))
            frames.recv_exact(conn, n)
            conn.sendall(frames.REPLY.pack(0, 0))                       # hello: welcome
            _, n, _ = frames.REQUEST.unpack(frames.recv_exact(conn, frames.REQUEST.size))
            frames.recv_exact(conn, n)
            conn.sendall(frames.REPLY.pack(0, 100) + b"x" * 50)         # half a reply
            conn.settimeout(30)
            try:
                if conn.recv(1) == b"":   # the client closed the connection
                    self.closed_by_client.set()
            except OSError:
                self.closed_by_client.set()

    def close(self):
        self.sock.close()


def test_a_call_that_times_out_drops_its_connection():
    """A reply cut off by the call's deadline leaves half of it on the
    socket: the connection is closed, never used for the next call."""
    server = _HalfReplyServer()
    t = SocketTransport(routing.TCP, "stuck", None, tcp=("127.0.0.1", server.port))
    try:
        sent = t.send(methods.GATHER, _gather([0]), 0.3)
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            sent.result()
        assert time.monotonic() - start < 5
        assert server.closed_by_client.wait(10), "the half-read connection was kept"
        assert t._free == []   # nothing kept to be used again
    finally:
        t.close()
        server.close()


def test_result_timeout_is_honoured_and_the_call_stays_pending(start_ps):
    """result(timeout) raises DeadlineExceeded when the reply has not come,
    and a later result() still gets it (a sync read waiting for an earlier
    step: the server answers once that step completes)."""
    from psserver.contract import SyncSpec
    ps = start_ps()
    with PSClient(ps.address) as c, PSClient(ps.address) as other:
        c.create_variable("v", initial_value=np.zeros(4, np.float32))
        # step 0 needs two replicas; one pushed: a read for step 1 waits
        c.push_many([("v", np.ones(4, np.float32))], sync=SyncSpec(0, 0, 2, 2))
        waiting = c.read_many_async(["v"], sync_step=1)
        with pytest.raises(DeadlineExceeded):
            waiting.result(timeout=0.3)
        assert not waiting.done()
        other.push_many([("v", np.ones(4, np.float32))], sync=SyncSpec(0, 1, 2, 2))
        (snap,) = waiting.result(timeout=30)
        assert snap.version == 1
