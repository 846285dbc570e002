"""The data port (TCP, psserver/link/frames.py): the hot calls between hosts,
framed by hand beside gRPC. Real psserver/psworker processes on 127.0.0.1;
clients made to treat them as remote (shared_memory=False, or PSTRAIN_SHM=0)."""
from __future__ import annotations

import contextlib
import re
import socket
import ssl
import struct
import threading
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from proxy import CuttableProxy

from coordinator import (
    ClusterCoordinator,
    LocalCluster,
    ParameterServerStrategy,
    ps_pool,
    push_gradients,
)
from psserver.client import PSClient
from psserver.client import data as client_module
from psserver.contract import TOKEN_ENV, routing, shm, wire, wire_decode
from psserver.errors import Code, InvalidArgument, PSError, Unauthenticated, Unavailable
from psserver.link import frames, methods
from psserver.link.transport import SocketTransport
from psserver.process import start_task
from psserver.serve import ipc_server
from psserver.tls import TLSConfig, generate_self_signed

pytestmark = pytest.mark.timeout(120)
N = 1000


def remote(address: str, **kw) -> PSClient:
    """A client that uses the data port as one on another host would."""
    return PSClient(address, shared_memory=False, **kw)


def grpc_only(address: str, **kw) -> PSClient:
    return PSClient(address, shared_memory=False, data_port=False, **kw)


def data_port_of(task) -> int:
    for line in list(task.log_lines):
        m = re.match(rf"^{task.role} data port on \S+:(\d+)$", line.strip())
        if m:
            return int(m.group(1))
    raise AssertionError(f"{task.role} printed no data port:\n{task.output()}")


def _make(c: PSClient, name: str = "w") -> np.ndarray:
    init = np.linspace(-1, 1, N).astype(np.float32)
    c.create_variable(name, initial_value=init, optimizer="sgd",
                      optimizer_params={"learning_rate": 0.5}, exist_ok=True)
    return init


def test_data_port_gives_what_grpc_gives(start_ps):
    ps = start_ps("--metrics-port", "0")
    with remote(ps.address) as fast, grpc_only(ps.address) as slow:
        assert fast.server_info().host.data_port == data_port_of(ps) > 0
        init = _make(fast)
        table = np.arange(40, dtype=np.float64).reshape(10, 4)
        fast.create_variable("t", initial_value=table, optimizer="sgd",
                             optimizer_params={"learning_rate": 1.0})
        grads = np.random.default_rng(0).standard_normal((3, N)).astype(np.float32)
        for i, g in enumerate(grads):
            assert fast.push("w", g) == i + 1
            fast.push_sparse("t", [1, 1, 7], np.ones((3, 4)))
        np.testing.assert_array_equal(fast.read("w"), slow.read("w"))
        np.testing.assert_allclose(fast.read("w"), init - 0.5 * grads.sum(0), atol=1e-5)
        np.testing.assert_array_equal(fast.gather("t", [[1, 7], [0, 1]]),
                                      slow.gather("t", [[1, 7], [0, 1]]))
        np.testing.assert_array_equal(slow.read("t")[1], table[1] - 6)
        h = fast.push_many_async({"w": grads[0]})   # sent at once, collected later
        assert fast.channel.socket is not None and h.result() == [4]
        assert fast.channel.socket is not None and slow.channel.socket is None
    # Counted as the gRPC calls are, with grpc_type "tcp".
    with urllib.request.urlopen(f"http://{_metrics(ps)}/metrics", timeout=10) as r:
        text = r.read().decode()
    started = {tuple(sorted(s.labels.items())): s.value
               for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "grpc_server_started_total"}
    # (a gather is a read that looks rows up: ParameterServerBulk.Read)
    for service, method, n in (("pstrain.v1.ParameterServerBulk", "Push", 4),
                               ("pstrain.v1.ParameterServerBulk", "Read", 3),
                               ("pstrain.v1.ParameterServer", "PushSparse", 3)):
        key = tuple(sorted({"grpc_service": service, "grpc_method": method,
                            "grpc_type": "tcp"}.items()))
        assert started.get(key) == n, (method, started.get(key))


def _metrics(task) -> str:
    for line in list(task.log_lines):
        m = re.match(rf"^{task.role} metrics on (\S+)$", line.strip())
        if m:
            return m.group(1)
    raise AssertionError(task.output())


def test_data_port_checks_the_token_and_refuses_bad_calls_changing_nothing(start_ps):
    ps = start_ps(env={TOKEN_ENV: "right"})
    port = data_port_of(ps)
    for token in (None, "wrong", "righ"):
        with pytest.raises(Unauthenticated):
            SocketTransport(routing.TCP, ps.address, token, tcp=("127.0.0.1", port)).connect()
    for junk in (b"\x00" * 3,                                        # a short hello
                 struct.pack("<BId", 9, 0, 0.0),                      # not a hello
                 struct.pack("<BId", 0, 1 << 31, 0.0)):               # a huge hello
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            got = s.recv(1024)   # refused or closed, never served
            assert got == b"" or b"refused" in got, got
    with remote(ps.address, token="right") as c:
        init = _make(c)
        c.create_variable("b", (3,), "float32", initializer="zeros")
        raw = SocketTransport(routing.TCP, ps.address, "right", tcp=("127.0.0.1", port))
        bad = [b"\xff\xff\xff",                                           # not protobuf
               wire.encode_push_request([("w", np.ones(N + 1, np.float32), 0)], b""),
               wire.encode_push_request([("b", np.ones(3, np.float32), 0),     # one good,
                                         ("w", np.full(N, np.nan, np.float32), 0)], b""),
               wire.encode_push_request([("nope", np.ones(3, np.float32), 0)], b"")]
        for request in bad:
            with pytest.raises(PSError) as info:
                raw.call(methods.BULK_PUSH, request, 5)
            assert info.value.code in (Code.INVALID_ARGUMENT,
                                       Code.NOT_FOUND)
        with pytest.raises(PSError) as info:   # no such method on a parameter server
            raw.call(methods.RUN_CLOSURE, b"", 5)
        assert info.value.code == Code.UNIMPLEMENTED
        raw.close()
        # Nothing was applied, and the port still serves.
        value, version = c.read("w", with_version=True)
        np.testing.assert_array_equal(value, init)
        assert version == 0 and c.read("b", with_version=True)[1] == 0
        assert c.push("w", np.ones(N, np.float32)) == 1 and c.channel.socket is not None


def test_data_port_speaks_mutual_tls_only(start_ps, tmp_path):
    tls = generate_self_signed(str(tmp_path))
    ps = start_ps(env={**tls.env(), TOKEN_ENV: "t"})
    port = data_port_of(ps)
    with remote(ps.address, tls=tls, token="t") as c:   # certificate and key: served
        init = _make(c)
        assert c.push("w", np.ones(N, np.float32)) == 1 and c.channel.socket is not None
        np.testing.assert_allclose(c.read("w"), init - 0.5, rtol=1e-6)
    with pytest.raises(OSError):   # plaintext on a TLS port: no answer but the close
        SocketTransport(routing.TCP, ps.address, "t", tcp=("127.0.0.1", port)).connect()
    anonymous = TLSConfig(ca=tls.ca).ssl_client_context()   # trusts the server, no cert
    with pytest.raises((OSError, PSError)):
        SocketTransport(routing.TCP, ps.address, "t", tcp=("127.0.0.1", port),
                        ssl_context=anonymous).connect()
    stranger = generate_self_signed(str(tmp_path / "other"))   # another CA's certificate
    with pytest.raises(OSError):
        SocketTransport(routing.TCP, ps.address, "t", tcp=("127.0.0.1", port),
                        ssl_context=stranger.ssl_client_context()).connect()
    with remote(ps.address, tls=tls, token="t") as c:   # still serving
        assert c.push("w", np.ones(N, np.float32)) == 2
        # a push large enough to go from its array in parts (wire.Scattered), over TLS
        big = np.random.default_rng(1).standard_normal(1 << 19).astype(np.float32)   # 2 MiB
        c.create_variable("big", initial_value=np.zeros(big.size, np.float32),
                          optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        assert big.nbytes >= client_module.SCATTER_BYTES
        assert c.push("big", big) == 1 and c.channel.socket is not None
        np.testing.assert_array_equal(c.read("big"), -big)


def test_a_frame_in_parts_arrives_whole_however_the_kernel_splits_it():
    """frames.send_parts (wire.Scattered frames): buffers of any sizes and
    formats, through a send buffer far smaller than them (sendmsg sends
    part of a buffer, or of several), arrive byte for byte, in order."""
    import threading
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        rng = np.random.default_rng(2)
        floats = rng.standard_normal(300_001).astype(np.float32)
        parts = wire.Scattered([b"head", memoryview(floats), b"", bytes(range(256)) * 7,
                                memoryview(floats[::2].copy()).cast("B"), b"t"])
        want = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        assert parts.nbytes == len(want) and wire.joined(parts) == want
        got = bytearray()

        def read():
            while len(got) < len(want):
                got.extend(b.recv(1 << 16))
        t = threading.Thread(target=read)
        t.start()
        frames.send_parts(a, parts)
        t.join(timeout=20)
        assert bytes(got) == want
    finally:
        a.close()
        b.close()


def test_data_port_off_fixed_or_taken(start_ps):
    off = start_ps("--data-port", "-1")
    with remote(off.address) as c:
        assert c.server_info().host.data_port == 0
        _make(c)
        assert c.push("w", np.ones(N, np.float32)) == 1
        assert c.channel.socket is None and not c.channel.socket is not None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    fixed = start_ps("--data-port", str(free))
    assert data_port_of(fixed) == free
    with pytest.raises(RuntimeError, match="data port"):
        start_task("psserver", ["--port", "0", "--data-port", str(free)], timeout=20)


def test_client_follows_a_restarted_server_to_its_new_data_port(start_ps):
    ps = start_ps()
    with remote(ps.address, wait_for_ready=True) as c:
        _make(c)
        assert c.push("w", np.ones(N, np.float32)) == 1
        old = c.channel.socket
        assert old is not None
        port = ps.address.rsplit(":", 1)[1]
        ps.kill()
        ps2 = start_ps("--port", port)
        init = _make(c)            # over gRPC
        # A push first: its pooled connection is dead; nothing was sent on it, so
        # it goes over gRPC, then the client learns the new data port.
        assert c.push("w", np.ones(N, np.float32)) == 1
        np.testing.assert_allclose(c.read("w"), init - 0.5, rtol=1e-6)
        assert c.channel.socket is not None and c.channel.socket is not old
        assert c.channel.socket._tcp[1] == data_port_of(ps2)


def test_a_server_restarted_on_the_same_fixed_ports_is_found_again(start_ps):
    # As in deploy/: fixed ports. The new process answers on the old data port
    # with another identity: calls go over gRPC until the client has learnt it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        data = s.getsockname()[1]
    ps = start_ps("--data-port", str(data))
    with remote(ps.address, wait_for_ready=True) as c:
        _make(c)
        assert c.push("w", np.ones(N, np.float32)) == 1
        old = c.channel.socket
        port = ps.address.rsplit(":", 1)[1]
        ps.kill()
        start_ps("--port", port, "--data-port", str(data))
        init = _make(c)
        assert c.push("w", np.ones(N, np.float32)) == 1
        assert c.push("w", np.ones(N, np.float32)) == 2
        np.testing.assert_allclose(c.read("w"), init - 1.0, rtol=1e-6)
        assert c.channel.socket is not None and c.channel.socket is not old


def wait_stopped(pid: int, limit: float = 10.0) -> None:
    """Until every thread of pid is stopped (state T), at most limit seconds."""
    import os
    import time
    deadline = time.monotonic() + limit
    while True:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.add(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:   # a thread that just ended
                pass
        if states <= {"T", "t"}:
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: {states}"
        time.sleep(0.01)


def test_a_push_whose_connection_breaks_in_flight_fails_and_is_not_resent(start_ps):
    import os
    import signal
    ps = start_ps()
    with remote(ps.address) as c:
        _make(c)
        c.push("w", np.ones(N, np.float32))
        assert c.channel.socket is not None and c.channel.socket is not None
        os.kill(ps.pid, signal.SIGSTOP)
        wait_stopped(ps.pid)   # SIGSTOP takes effect a little later, thread by thread
        h = c.push_many_async({"w": np.ones(N, np.float32)})   # sent; the server sleeps
        ps.kill()
        with pytest.raises(Unavailable, match="data port"):   # applied or not: unknown,
            h.result()                                         # as over gRPC


def push_one(w):
    push_gradients([(w, np.ones(3, np.float32))])
    return 1


@pytest.mark.skipif(not shm.available(), reason="compares against the same-host path")
def test_coordinator_sends_closures_to_workers_over_their_data_port(monkeypatch):
    ps_pool.close_clients()
    monkeypatch.setenv(shm.ENV, "0")   # as if every task were on its own host
    try:
        with LocalCluster(num_ps=1, num_workers=2) as cluster:   # mutual TLS
            strategy = ParameterServerStrategy(cluster.spec)
            w = strategy.create_variable("w", initial_value=np.zeros(3, np.float32),
                                         optimizer="sgd",
                                         optimizer_params={"learning_rate": 1.0})
            with ClusterCoordinator(strategy) as coord:
                results = [coord.schedule(push_one, args=(w,)) for _ in range(6)]
                coord.join()
                assert [r.fetch() for r in results] == [1] * 6
                threads = list(coord.cluster.membership.workers.values())
                assert all(t._channel.socket is not None and t._channel.socket._tcp is not None
                           and isinstance(t._channel.socket._ssl, ssl.SSLContext)
                           for t in threads)
            np.testing.assert_array_equal(w.read(), -6 * np.ones(3))
    finally:
        ps_pool.close_clients()


def test_peers_that_never_say_hello_cannot_crowd_out_clients(start_ps):
    """70 silent connections from one address (more than MAX_PENDING, more
    than its per-peer share): a client that says hello is still served; the
    silent ones are cut off (pushed out by newer ones, or at HELLO_SECONDS)."""
    ps = start_ps(env={TOKEN_ENV: "t"})
    port = data_port_of(ps)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10)
              for _ in range(frames.MAX_PENDING + 6)]
    try:
        c = SocketTransport(routing.TCP, ps.address, "t", tcp=("127.0.0.1", port))
        try:
            c.connect()   # not crowded out
        finally:
            c.close()
        for s in silent:
            s.settimeout(frames.HELLO_SECONDS + 30)
            assert s.recv(1) == b""   # cut off
    finally:
        for s in silent:
            s.close()


def test_a_peer_dribbling_its_hello_is_cut_off_before_it_ends(start_ps):
    """A byte a second: the hello (14 bytes) never completes, the
    connection is cut (HELLO_SECONDS covers the whole hello, not each byte)."""
    import time
    ps = start_ps(env={TOKEN_ENV: "t"})
    dribbler = socket.create_connection(("127.0.0.1", data_port_of(ps)), timeout=10)
    hello = struct.pack("<BId", 0, 1, 0.0) + b"t"
    sent = 0
    try:
        for byte in hello:
            try:
                dribbler.sendall(bytes([byte]))
            except OSError:
                break
            sent += 1
            time.sleep(1.0)   # the dribble itself, not a wait for anything
        dribbler.settimeout(30)
        try:
            answer = dribbler.recv(64)
        except OSError:
            answer = b""
    finally:
        dribbler.close()
    assert sent < len(hello) or answer == b"", (sent, answer)


def test_a_data_port_that_answers_as_another_server_is_not_used(start_ps):
    # Server A is reached through a port mapping; the port number it announces
    # for its data port is, on the client's host, server B's.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        shared = s.getsockname()[1]
    b = start_ps("--data-port", str(shared))                        # 127.0.0.1:shared
    a = start_ps("--host", "127.0.0.2", "--data-port", str(shared))  # 127.0.0.2:shared
    fwd = CuttableProxy(a.address)   # listens on 127.0.0.1
    try:
        with remote(fwd.address) as c, remote(b.address) as cb:
            _make(c)
            _make(cb)
            assert c.push("w", np.ones(N, np.float32)) == 1
            assert c.push("w", np.ones(N, np.float32)) == 2
            assert c.channel.socket is None and c.route.socket == ""   # checked, refused: gRPC
            assert cb.read("w", with_version=True)[1] == 0   # B got nothing
            assert cb.channel.socket is not None
    finally:
        fwd.close()


@pytest.mark.skipif(not shm.available(), reason="compares against the same-host path")
def test_closures_reach_a_worker_restarted_on_the_same_fixed_ports(monkeypatch):
    ps_pool.close_clients()
    monkeypatch.setenv(shm.ENV, "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        data = s.getsockname()[1]
    try:
        with LocalCluster(num_ps=1, num_workers=1, tls=False,
                          worker_args=("--data-port", str(data))) as cluster:
            strategy = ParameterServerStrategy(cluster.spec)
            w = strategy.create_variable("w", initial_value=np.zeros(3, np.float32),
                                         optimizer="sgd",
                                         optimizer_params={"learning_rate": 1.0})
            with ClusterCoordinator(strategy) as coord:
                assert [r.fetch() for r in [coord.schedule(push_one, args=(w,))
                                            for _ in range(3)]] == [1] * 3
                (thread,) = coord.cluster.membership.workers.values()
                old = thread._channel.socket
                assert old is not None and old._tcp[1] == data
                cluster.restart_worker(0)   # same gRPC port, same data port, another id
                results = [coord.schedule(push_one, args=(w,)) for _ in range(5)]
                coord.join()
                assert [r.fetch() for r in results] == [1] * 5
                assert thread._channel.socket is not None and thread._channel.socket is not old
            np.testing.assert_array_equal(w.read(), -8 * np.ones(3))
    finally:
        ps_pool.close_clients()


def test_a_client_that_never_takes_its_reply_is_dropped(monkeypatch):
    # In-process server on a real socket: the reply's send times out (SO_SNDTIMEO),
    # the connection is closed and a graceful stop does not wait for it.
    import time
    monkeypatch.setattr(ipc_server, "REPLY_SECONDS", 1.0)
    big = b"x" * (64 << 20)   # far more than the socket buffers hold
    server = ipc_server.IpcServer({methods.GATHER.id: (None, lambda request, context: big)}, "t",
                           tcp=("127.0.0.1", 0)).start()
    try:
        client = SocketTransport(routing.TCP, "test", "t", tcp=("127.0.0.1", server.port), abortable=True)
        pending = client.send(methods.GATHER, b"", 30)   # sent; the reply is never read
        deadline = time.monotonic() + 10
        while not server._running and time.monotonic() < deadline:   # the call started
            time.sleep(0.01)
        assert server._running == 1
        deadline = time.monotonic() + 20
        while server._running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server._running, "the server still sends to a client that does not read"
        server.stop(grace=600)   # returns at once: nothing runs (else the test times out)
        client.abort()   # (the reply's connection: never collected)
        del pending
    finally:
        server.stop(grace=0)


@pytest.mark.timeout(60)
def test_abort_cuts_a_call_waiting_for_its_reply():
    """SocketTransport.abort (a coordinator shutting down a failed job): a call
    whose reply is awaited fails at once with Unavailable, not after its
    deadline (here an hour)."""
    import threading
    entered, release = threading.Event(), threading.Event()

    def stuck(request, context):
        entered.set()
        release.wait(60)
        return b""
    server = ipc_server.IpcServer({methods.GATHER.id: (None, stuck)}, "t",
                                  tcp=("127.0.0.1", 0)).start()
    try:
        client = SocketTransport(routing.TCP, "test", "t", tcp=("127.0.0.1", server.port), abortable=True)
        got = []
        caller = threading.Thread(target=lambda: got.append(_raised(
            lambda: client.call(methods.GATHER, b"", 3600))))
        caller.start()
        assert entered.wait(30)
        client.abort()
        caller.join(30)
        assert not caller.is_alive() and isinstance(got[0], PSError), got
        assert got[0].code == Code.UNAVAILABLE
    finally:
        release.set()
        server.stop(grace=0)


def _raised(fn):
    try:
        fn()
    except Exception as exc:   # what the call raised, to look at on this thread
        return exc
    return None



def test_tensors_above_the_stream_threshold_go_in_one_data_port_frame(start_ps):
    """A 12 MiB dense read and push over the data port: one frame each, as
    gRPC gives them, and no gRPC stream (ReadStream, Upload) is used."""
    ps = start_ps("--metrics-port", "0")
    n = 3 << 20   # 12 MiB of float32: three times the 4 MiB stream threshold
    with remote(ps.address) as fast, grpc_only(ps.address) as slow:
        init = np.ones(n, np.float32)   # made on the server: no upload
        fast.create_variable("big", (n,), initializer="ones", optimizer="sgd",
                             optimizer_params={"learning_rate": 1.0})
        np.testing.assert_array_equal(fast.read("big"), init)
        assert fast.push("big", np.ones(n, np.float32)) == 1
        assert fast.push_many_async({"big": np.ones(n, np.float32)}).result() == [2]
        np.testing.assert_array_equal(fast.read("big"), init - 2)
        np.testing.assert_array_equal(slow.read("big"), init - 2)   # gRPC: a stream
    with urllib.request.urlopen(f"http://{_metrics(ps)}/metrics", timeout=10) as r:
        text = r.read().decode()
    started = {(s.labels["grpc_service"], s.labels["grpc_method"], s.labels["grpc_type"]): s.value
               for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "grpc_server_started_total"}
    assert started.get(("pstrain.v1.ParameterServerBulk", "Read", "tcp")) == 2, started
    assert started.get(("pstrain.v1.ParameterServerBulk", "Push", "tcp")) == 2, started
    assert started.get(("pstrain.v1.ParameterServer", "Upload", "client_stream"), 0) == 0
    assert started.get(("pstrain.v1.ParameterServer", "ReadStream", "server_stream")) == 1


@pytest.mark.timeout(30)
def test_a_large_receive_waits_in_the_kernel_and_keeps_the_socket_timeout():
    """A plain TCP receive of 256 KiB or more is one MSG_WAITALL call: all the
    bytes, in order, whatever pieces they come in; under a socket timeout it
    still times out (and the socket keeps its timeout, SO_RCVTIMEO cleared);
    a peer that closes is a ConnectionError."""
    import socket
    import struct
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname())
    s, _ = srv.accept()
    try:
        data = np.random.default_rng(0).integers(0, 256, 3 << 20, np.uint8).tobytes()

        def send_in_pieces():
            for off in range(0, len(data), 100_000):
                c.sendall(data[off:off + 100_000])
        for timeout in (None, 10.0):
            s.settimeout(timeout)
            t = threading.Thread(target=send_in_pieces)
            t.start()
            got = bytearray(len(data))
            frames.recv_into(s, memoryview(got))
            t.join()
            assert got == data and s.gettimeout() == timeout
        s.settimeout(0.3)
        c.sendall(data[:1000])   # far less than asked: the timeout must fire
        with pytest.raises(socket.timeout):
            frames.recv_into(s, memoryview(bytearray(1 << 20)))
        assert s.gettimeout() == 0.3
        assert struct.unpack("ll", s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) == (0, 0)
        c.close()
        s.settimeout(5.0)
        with pytest.raises(ConnectionError):
            frames.recv_into(s, memoryview(bytearray(1 << 20)))
    finally:
        for x in (c, s, srv):
            x.close()


def test_a_steps_read_and_gather_and_its_pushes_are_sent_at_once_over_the_data_port(start_ps):
    """Over a socket, read_and_gather_async and push_dense_and_sparse_async are
    one call each (ReadRequest.gathers, PushRequest.sparse), sent at once (no
    thread), and give what the separate blocking calls give."""
    ps = start_ps()
    with remote(ps.address) as c, grpc_only(ps.address) as ref:
        init = _make(c)
        table = np.arange(40, dtype=np.float32).reshape(10, 4)
        c.create_variable("t", initial_value=table, optimizer="sgd",
                          optimizer_params={"learning_rate": 1.0})
        c.read("w")   # the route is planned
        assert c.channel.socket is not None
        before = {t.ident for t in threading.enumerate()}
        h = c.read_and_gather_async(["w"], [("t", [[1, 7], [1, 0]]), ("t", [9])])
        p = c.push_dense_and_sparse_async([("w", np.ones(N, np.float32), 5)],
                                          [("t", np.array([1, 1]), np.ones((2, 4), np.float32), 6)])
        assert {t.ident for t in threading.enumerate()} <= before   # no thread for them
        snaps, rows = h.result()
        # (the two calls are in flight together: the server may apply the push
        # before it reads; CI saw that once under load)
        assert snaps[0].version in (0, 1)
        np.testing.assert_array_equal(snaps[0].value, init - 0.5 * snaps[0].version)
        pushed = table.copy()
        pushed[1] -= 2
        assert any(np.array_equal(rows[0][0], t[[[1, 7], [1, 0]]]) for t in (table, pushed))
        np.testing.assert_array_equal(rows[1][0], table[[9]])
        assert p.result() == [1, 1]
        np.testing.assert_allclose(ref.read("w"), init - 0.5, atol=1e-6)
        np.testing.assert_array_equal(ref.read("t")[1], table[1] - 2)
        # One call, validated in full before anything is applied: an error in
        # its row-wise part leaves the dense part unapplied too.
        bad = c.push_dense_and_sparse_async([("w", np.ones(N, np.float32), 7)],
                                            [("nope", np.array([1]), np.ones((1, 4), np.float32), 8)])
        with pytest.raises(PSError) as e:
            bad.result()
        assert e.value.code == Code.NOT_FOUND
        assert ref.get_meta("w").version == 1
        snaps, rows = c.read_and_gather_async(["w"], [("t", [2])]).result()   # still usable
        np.testing.assert_array_equal(rows[0][0], table[[2]])


def test_a_read_over_the_data_port_lands_in_the_callers_arrays_with_no_copy(start_ps, monkeypatch):
    """read_many(out=...) over the data port receives each value's bytes
    straight into its out array (a slice of a larger array too): nothing is
    copied after the kernel (client_util's np.copyto never runs); a value
    whose array does not fit (dtype, shape) gets a new one, as before."""
    ps = start_ps()
    copies, into_full = [], []
    real, real_recv = np.copyto, frames.recv_into
    full = np.zeros((3001, 2), np.float32)
    from psserver.client import results as client_util
    monkeypatch.setattr(client_util.np, "copyto",
                        lambda *a, **k: (copies.append(1), real(*a, **k)))

    def spy(sock, view):   # what the socket's bytes are received into
        into_full.append(np.shares_memory(np.frombuffer(view, np.uint8), full))
        return real_recv(sock, view)
    monkeypatch.setattr(frames, "recv_into", spy)
    with remote(ps.address) as c:
        c.create_variable("a", initial_value=np.arange(6000, dtype=np.float32).reshape(3000, 2))
        c.create_variable("b", initial_value=np.full(5, 7, np.float32))
        assert c.route.socket == routing.TCP   # over the data port, not gRPC
        wrong = np.zeros(4, np.float32)   # b has 5 values: does not fit
        snaps = c.read_many(["a", "b"], out=[full[1:], wrong])
        assert snaps[0].value is not None and np.shares_memory(snaps[0].value, full)
        np.testing.assert_array_equal(full[1:], np.arange(6000, dtype=np.float32).reshape(3000, 2))
        assert not full[0].any()
        np.testing.assert_array_equal(snaps[1].value, np.full(5, 7, np.float32))
        assert not np.shares_memory(snaps[1].value, wrong) and not wrong.any()
        assert copies == [] and any(into_full)   # a's bytes went from the socket into full
        later = c.read_many_async(["a"], out=[np.empty((3000, 2), np.float32)]).result()
        np.testing.assert_array_equal(later[0].value, full[1:])
        assert copies == []


def test_a_reply_the_receiver_refuses_drops_its_connection_and_the_next_call_works():
    """A read reply refused part-way (malformed, or a value cut short) raises
    InvalidArgument and its connection is closed, not given back to the
    pool (where the next reply starts is unknown); the client's next call
    opens a new one and gets its answer."""
    good = wire.encode_read_reply([("a", 1, np.arange(3000, dtype=np.float32))])
    replies = [good[:-40] + wire._len_field(1, 5) + b"\x0a\x03ab", good]
    server = ipc_server.IpcServer({methods.BULK_READ.id: (None, lambda req, ctx: replies.pop(0))},
                                  "t", tcp=("127.0.0.1", 0)).start()
    try:
        client = SocketTransport(routing.TCP, "test", "t", tcp=("127.0.0.1", server.port), abortable=True)
        dest = np.zeros(3000, np.float32)

        def read():
            return client.send(methods.BULK_READ, b"", 30, receiver=lambda recv_into, n:
                               wire_decode.receive_read_reply(recv_into, n, [("a", dest)])).result()
        got = _raised(read)
        assert isinstance(got, InvalidArgument), got
        assert not client._free   # the connection was dropped
        values = read()
        assert values[0][2] is dest and values[0][:2] == ("a", 1)
        np.testing.assert_array_equal(dest, np.arange(3000, dtype=np.float32))
        client.close()
    finally:
        server.stop(grace=0)


def test_a_long_refusal_of_the_hello_is_a_clear_error():
    """A peer refusing the hello with a message over 64 KiB: the client
    raises that refusal (its first 4 KiB), not an AttributeError."""
    import socket as S
    lst = S.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]

    def refuse():
        conn, _ = lst.accept()
        with conn, contextlib.suppress(OSError):   # (the client hangs up part-way)
            _, n, _ = frames.REQUEST.unpack(conn.recv(frames.REQUEST.size, S.MSG_WAITALL))
            conn.recv(n, S.MSG_WAITALL)
            msg = b"bad token; " + b"x" * 100_000
            conn.sendall(frames.REPLY.pack(Code.UNAUTHENTICATED, len(msg)) + msg)
            conn.recv(1)
    t = threading.Thread(target=refuse, daemon=True)
    t.start()
    try:
        client = SocketTransport(routing.TCP, "test", "t", tcp=("127.0.0.1", port))
        got = _raised(lambda: client.send(methods.BULK_READ, b"", 10))
        assert isinstance(got, Unauthenticated) and "bad token" in str(got), got
        client.close()
    finally:
        lst.close()
        t.join(10)


def test_looked_up_rows_over_the_data_port_land_in_the_callers_arrays(start_ps, monkeypatch):
    """read_and_gather(rows_out=...) over the data port: each lookup's rows are
    received straight into the array offered for it (read_variables offers
    its slice of the distinct ids' rows); an array that does not fit gets
    new rows, as before."""
    ps = start_ps()
    real_recv = frames.recv_into
    dest = np.zeros((3000, 4), np.float32)
    landed = []

    def spy(sock, view):
        landed.append(np.shares_memory(np.frombuffer(view, np.uint8), dest))
        return real_recv(sock, view)
    monkeypatch.setattr(frames, "recv_into", spy)
    table = np.arange(40000, dtype=np.float32).reshape(10000, 4)
    with remote(ps.address) as c:
        c.create_variable("t", initial_value=table)
        c.create_variable("a", initial_value=np.ones(3, np.float32))
        ids = np.arange(0, 9000, 3)
        wrong = np.zeros((5, 4), np.float32)
        snaps, rows = c.read_and_gather(["a"], [("t", ids), ("t", [1, 2])],
                                        rows_out=[dest, wrong])
        assert np.shares_memory(rows[0][0], dest) and any(landed)
        np.testing.assert_array_equal(dest, table[ids])
        np.testing.assert_array_equal(rows[1][0], table[[1, 2]])
        assert not wrong.any() and not np.shares_memory(rows[1][0], wrong)
        np.testing.assert_array_equal(snaps[0].value, np.ones(3))
