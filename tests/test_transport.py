"""The transports (psserver/transport.py): one call, the same answer and the
same typed errors over gRPC, the Unix socket and the data port (a real
parameter server); and what a client does when a socket fails under a call
(psserver/channel.py ``_over``), against fake transports."""
from __future__ import annotations

import numpy as np
import pytest

from protos.pstrain.v1 import ps_pb2
from psserver import ipc, methods, routing, wire
from psserver import tensor as T
from psserver.channel import ServerChannel
from psserver.client import PSClient
from psserver.contract import (TOKEN_ENV, InvalidArgument, NotFound, Unauthenticated, Unavailable,
                               call_metadata)
from psserver.tls import make_channel
from psserver.transport import GrpcTransport, Pending, SocketTransport
from tests.test_data_port import data_port_of

pytestmark = pytest.mark.timeout(60)


def _transports(ps, token=None):
    """gRPC, Unix socket and data port transports to one server."""
    info = ps_pb2.ServerInfo()
    with PSClient(ps.address) as c:
        info.CopyFrom(c.server_info())
    identity = f"{info.protocol_version}:{info.server_id}"
    host = ps.address.rsplit(":", 1)[0]
    grpc_t = GrpcTransport(make_channel(ps.address, [], None), ps.address, call_metadata(token))
    unix = ipc.IpcClient(info.host.ipc_socket, token, ps.address, identity=identity)
    tcp = ipc.IpcClient("", token, ps.address, tcp=(host, data_port_of(ps)), identity=identity)
    return [grpc_t, SocketTransport(unix, routing.UNIX), SocketTransport(tcp, routing.TCP)]


def test_each_transport_gives_the_same_replies_and_the_same_typed_errors(start_ps):
    ps = start_ps()
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    with PSClient(ps.address) as c:
        c.create_variable("t", initial_value=table, optimizer="sgd",
                          optimizer_params={"learning_rate": 1.0})
    transports = _transports(ps)
    try:
        gather = ps_pb2.GatherRequest(name="t")
        T.fill(gather.ids, np.array([4, 1], np.int64))
        bad = ps_pb2.GatherRequest(name="t")
        T.fill(bad.ids, np.array([99], np.int64))
        unknown = ps_pb2.GatherRequest(name="nope")
        T.fill(unknown.ids, np.array([0], np.int64))
        for pushed, t in enumerate(transports):
            reply = t.call(methods.GATHER, gather, 10.0)
            np.testing.assert_array_equal(T.decode(reply.rows), table[[4, 1]] - pushed)
            pending = t.send(methods.GATHER, gather, 10.0)   # the async twin
            np.testing.assert_array_equal(T.decode(pending.result().rows),
                                          table[[4, 1]] - pushed)
            with pytest.raises(InvalidArgument, match="99"):
                t.call(methods.GATHER, bad, 10.0)
            with pytest.raises(NotFound):
                t.call(methods.GATHER, unknown, 10.0)
            # bytes framed by hand go as they are (the bulk push), on every transport
            raw = wire.encode_push_request([("t", np.ones((6, 2), np.float32), 0)])
            t.call(methods.BULK_PUSH, raw, 10.0)
        # three pushes of ones at learning rate 1, whichever way they went
        reply = transports[0].call(methods.GATHER, gather, 10.0)
        np.testing.assert_array_equal(T.decode(reply.rows), table[[4, 1]] - 3)
        # a gRPC-only call is refused by a socket before anything is sent
        with pytest.raises(ValueError, match="not a socket call"):
            transports[1].call(methods.META, ps_pb2.VariableRef(name="t"), 10.0)
        assert transports[0].call(methods.META, ps_pb2.VariableRef(name="t"), 10.0).version == 3
    finally:
        for t in transports:
            t.close()
    with pytest.raises(Unavailable, match="closed"):   # a call cut by close() is UNAVAILABLE
        transports[0].call(methods.META, ps_pb2.VariableRef(name="t"), 10.0)


def test_a_wrong_token_is_unauthenticated_on_every_transport(start_ps):
    ps = start_ps(env={TOKEN_ENV: "right"})
    host = ps.address.rsplit(":", 1)[0]
    grpc_t = GrpcTransport(make_channel(ps.address, [], None), ps.address,
                           call_metadata("wrong"))
    try:
        with pytest.raises(Unauthenticated):
            grpc_t.call(methods.META, ps_pb2.VariableRef(name="t"), 10.0)
        sock = SocketTransport(ipc.IpcClient("", "wrong", ps.address,
                                             tcp=(host, data_port_of(ps))), routing.TCP)
        with pytest.raises(Unauthenticated) as e:   # refused at its hello: nothing ran
            sock.send(methods.GATHER, ps_pb2.GatherRequest(name="t"), 10.0)
        assert e.value.not_sent
    finally:
        grpc_t.close()


# -- acting on a socket that fails under a call (fake transports) ------------------------
class FakeTransport:
    """Answers each call with the next outcome of ``script`` (an exception
    is raised, anything else returned), then "from grpc" or "from socket";
    ``on_send``: raised by send()."""

    def __init__(self, kind, *script, on_send=None):
        self.kind, self.script, self.on_send = kind, list(script), on_send
        self.sent, self.closed = [], False

    def send(self, method, request, timeout, receiver=None):
        self.sent.append(method)
        if self.on_send is not None:
            raise self.on_send
        outcome = self.script.pop(0) if self.script else \
            "from grpc" if self.kind == routing.GRPC else "from socket"

        def result():
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return Pending(result)

    def call(self, method, request, timeout):
        return self.send(method, request, timeout).result()

    def close(self):
        self.closed = True


def _channel_over(sock: FakeTransport) -> tuple[ServerChannel, FakeTransport]:
    ch = ServerChannel("127.0.0.1:9", shared_memory=False)   # no server is asked
    ch.grpc.close()
    ch.grpc = FakeTransport(routing.GRPC)
    ch._data = sock
    ch._plan = routing.Plan(socket=routing.TCP, why="test")
    return ch, ch.grpc


def test_calls_take_the_socket_the_route_names_and_grpc_only_calls_take_grpc():
    ch, grpc_t = _channel_over(FakeTransport(routing.TCP))
    assert ch._invoke(True, methods.GATHER, b"") == "from socket"
    assert ch._invoke(False, methods.PUSH_SPARSE, b"").result() == "from socket"
    assert ch._invoke(True, methods.META, b"") == "from grpc"
    assert grpc_t.sent == [methods.META]


def test_a_call_never_sent_goes_over_grpc_and_the_route_is_learnt_again():
    err = Unavailable("connection refused")
    err.not_sent = True
    sock = FakeTransport(routing.TCP, on_send=err)
    ch, grpc_t = _channel_over(sock)
    assert ch._invoke(True, methods.PUSH_SPARSE, b"") == "from grpc"   # safe: nothing ran
    assert sock.closed and ch._data is None and ch._plan is None
    assert grpc_t.sent == [methods.PUSH_SPARSE]


def test_a_read_lost_in_flight_is_read_again_over_grpc():
    sock = FakeTransport(routing.TCP, Unavailable("connection reset"))
    ch, grpc_t = _channel_over(sock)
    assert ch._invoke(True, methods.GATHER, b"") == "from grpc"
    assert sock.closed and ch._data is None and grpc_t.sent == [methods.GATHER]


def test_an_update_lost_in_flight_is_not_resent_and_fails_unavailable():
    sock = FakeTransport(routing.TCP, Unavailable("connection reset"))
    ch, grpc_t = _channel_over(sock)
    h = ch._invoke(False, methods.PUSH_SPARSE, b"")
    with pytest.raises(Unavailable):   # applied or not: the caller resends with its key
        h.result()
    assert sock.closed and ch._data is None and grpc_t.sent == []


def test_an_error_of_the_call_itself_keeps_the_socket():
    sock = FakeTransport(routing.TCP, InvalidArgument("bad ids"))
    ch, grpc_t = _channel_over(sock)
    with pytest.raises(InvalidArgument):
        ch._invoke(True, methods.GATHER, b"")
    assert ch._data is sock and not sock.closed
    assert ch._invoke(True, methods.GATHER, b"") == "from socket" and grpc_t.sent == []
