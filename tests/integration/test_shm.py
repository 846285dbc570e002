"""Same-host transfers through shared memory (psserver/contract/shm.py), against real
psserver processes.

What is checked: values and versions equal the gRPC path's; the server
really holds the client's segment (its /proc fd table), a sealed memfd that
cannot shrink under it, and nothing is left behind, also after a client is
SIGKILLed; a server elsewhere (here:
shared memory switched off) or one that lost the segment (restarted) is
answered by gRPC transparently; every malformed SharedMemory call is refused
with the right code and changes nothing.
"""
from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest
from test_data_port import wait_stopped

from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
from psserver.client import PSClient
from psserver.contract import shm
from psserver.errors import Code, FailedPrecondition, PSError
from psserver.link import methods

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not shm.available(), reason="no sealed memfds on this system")]

N = 1 << 18   # 1 MiB of float32


def _server_segments(pid: int) -> list[str]:
    """The pstrain segments a process holds open (by its fd table)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if re.fullmatch(rf"/memfd:{shm.NAME_PREFIX}[0-9a-f]{{32}} \(deleted\)", target):
            out.append(target)
    return out


def _make(c: PSClient, name: str = "w", n: int = N) -> np.ndarray:
    init = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    c.create_variable(name, initial_value=init, optimizer="sgd",
                      optimizer_params={"learning_rate": 0.5})
    return init


def test_shared_memory_matches_grpc_and_leaves_nothing(ps):
    with PSClient(ps.address) as fast, PSClient(ps.address, shared_memory=False, data_port=False) as slow:
        init = _make(fast)
        fast.read("w")   # learns the size; the next read goes through shared memory
        grads = np.random.default_rng(1).standard_normal((5, N)).astype(np.float32)
        for i, g in enumerate(grads):
            assert fast.push("w", g) == i + 1
            v_fast, ver_fast = fast.read("w", with_version=True)
            v_slow, ver_slow = slow.read("w", with_version=True)
            assert ver_fast == ver_slow == i + 1
            np.testing.assert_array_equal(v_fast, v_slow)
        np.testing.assert_allclose(v_fast, init - 0.5 * grads.sum(0), rtol=1e-5, atol=1e-5)
        assert not v_fast.flags.writeable   # as the gRPC path's snapshots
        assert fast.route.shm and fast._segments._arena is not None
        held = _server_segments(ps.pid)
        assert held and all(t.endswith("(deleted)") for t in held), held
    # close() detaches: the server lets go of the memory
    with PSClient(ps.address) as c:
        c.read("w")
        assert not _server_segments(ps.pid)


def test_concurrent_async_calls_each_get_their_own_segment(ps):
    with PSClient(ps.address) as c:
        init = _make(c)
        c.read("w")
        pushes = [c.push_many_async({"w": np.ones(N, np.float32)}) for _ in range(6)]
        reads = [c.read_many_async(["w"]) for _ in range(6)]
        assert sorted(h.result()[0] for h in pushes) == [1, 2, 3, 4, 5, 6]
        for h in reads:
            s = h.result()[0]
            # a consistent snapshot: value matches its version exactly
            np.testing.assert_allclose(s.value, init - 0.5 * s.version, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(c.read("w"), init - 3.0, rtol=1e-6, atol=1e-6)


def test_multi_variable_read_and_push(ps):
    with PSClient(ps.address) as c:
        a, b = _make(c, "a"), _make(c, "b", N // 2 + 3)   # odd size: offsets are aligned
        c.read_many(["a", "b"])
        c.push_many({"a": np.ones(N, np.float32), "b": np.full(N // 2 + 3, 2, np.float32)})
        ra, rb = c.read_many(["a", "b"])
        np.testing.assert_allclose(ra.value, a - 0.5, rtol=1e-6)
        np.testing.assert_allclose(rb.value, b - 1.0, rtol=1e-6)
        assert (ra.version, rb.version) == (1, 1)


def test_server_without_shared_memory_is_answered_over_grpc(start_ps):
    ps = start_ps(env={shm.ENV: "0"})
    with PSClient(ps.address) as c:
        init = _make(c)
        c.read("w")
        c.push("w", np.ones(N, np.float32))
        np.testing.assert_allclose(c.read("w"), init - 0.5, rtol=1e-6)
        assert not c.route.shm   # planned from ServerInfo: no segment offered
        assert not _server_segments(ps.pid)


def test_restarted_server_lost_the_segment_client_recovers(start_ps):
    ps = start_ps()
    with PSClient(ps.address, wait_for_ready=True) as c:
        _make(c)
        c.read("w")
        c.push("w", np.ones(N, np.float32))   # a segment is attached now
        port = ps.address.rsplit(":", 1)[1]
        ps.kill()
        ps2 = start_ps("--port", port)
        init = _make(c)
        c.read("w")   # the old segment id is unknown to the new server: gRPC, then re-attach
        assert c.push("w", np.ones(N, np.float32)) == 1
        np.testing.assert_allclose(c.read("w"), init - 0.5, rtol=1e-6)
        assert c.route.shm and _server_segments(ps2.pid)


def test_a_client_of_a_server_that_is_gone_closes_at_once(start_ps, monkeypatch):
    """Its segments are dropped without a Detach call each (one would wait for
    the dead server until its deadline); a live server's are detached."""
    detached = []
    from psserver.client.segments import SegmentPath
    real = SegmentPath._detach
    monkeypatch.setattr(SegmentPath, "_detach",
                        lambda self, seg_id: detached.append(seg_id) or real(self, seg_id))
    for kill in (False, True):
        ps = start_ps()
        c = PSClient(ps.address, wait_for_ready=True)
        _make(c)
        c.push("w", np.ones(N, np.float32))   # a segment is attached (and free again)
        assert c.route.shm and _server_segments(ps.pid)
        if kill:
            ps.kill()
        detached.clear()
        c.close()
        assert bool(detached) is not kill
        if not kill:
            assert not _server_segments(ps.pid)


def test_sigkilled_client_leaves_nothing_behind(ps):
    """Its segments go with it (memfds: no name anywhere); the server closes
    its own descriptors of them once idle (see test_segments_expire_when_idle)."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    code = textwrap.dedent(f"""
        import os, signal, numpy as np
        from psserver.client import PSClient
        c = PSClient({ps.address!r})
        c.create_variable("k", initial_value=np.zeros({N}, np.float32))
        c.read("k"); c.read("k"); c.push("k", np.ones({N}, np.float32))
        assert c._segments._arena is not None
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert r.returncode == -9
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) == before


# -- bad input: every malformed call refused, nothing changed ------------------------
@pytest.fixture
def raw(ps):
    """(generated SharedMemory stub, PSClient) on one server, with a 1 MiB variable."""
    with PSClient(ps.address) as c, grpc.insecure_channel(ps.address) as ch:
        _make(c)
        yield ps_pb2_grpc.SharedMemoryStub(ch), c


def _code(fn, *args) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, timeout=10)
    return info.value.code()


@pytest.mark.parametrize("name, code", [
    ("../../etc/passwd", grpc.StatusCode.INVALID_ARGUMENT),
    ("pstrain-xyz", grpc.StatusCode.INVALID_ARGUMENT),
    ("", grpc.StatusCode.INVALID_ARGUMENT),
    ("pstrain-" + "0" * 32, grpc.StatusCode.FAILED_PRECONDITION),   # not on this host
])
def test_attach_refuses_bad_names(raw, name, code):
    stub, _ = raw
    # (a process that is not on this host: no such /proc/PID)
    assert _code(stub.Attach, ps_pb2.ShmAttachRequest(name=name, nbytes=4096, pid=2**30,
                                                      fd=3)) == code


def test_attach_refuses_wrong_size_and_symlinks(raw, tmp_path):
    stub, _ = raw
    seg = shm.Segment(1 << 20)
    try:
        for n in (0, -1, 4096):
            assert _code(stub.Attach, _attach_request(seg, nbytes=n)) == \
                grpc.StatusCode.INVALID_ARGUMENT
    finally:
        seg.close()
    # Any other file of this user's: a descriptor of a regular file, named as
    # a segment would be, is refused (not a memfd of that name).
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 4096)
    fd = os.open(target, os.O_RDWR)
    try:
        assert _code(stub.Attach, ps_pb2.ShmAttachRequest(
            name=shm.NAME_PREFIX + secrets.token_hex(16), nbytes=4096, pid=os.getpid(),
            fd=fd)) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        os.close(fd)
    assert target.read_bytes() == b"x" * 4096


def _attach_request(seg, **kw):
    return ps_pb2.ShmAttachRequest(**{**dict(name=seg.name, nbytes=seg.nbytes, pid=seg.pid,
                                             fd=seg.fd), **kw})


def test_a_segment_that_could_shrink_is_refused_and_an_attached_one_cannot(raw):
    """A token holder that truncated its own segment killed the server with
    SIGBUS. Segments are sealed memfds: an unsealed one is refused at attach,
    and an attached one cannot be truncated; the server serves on."""
    import fcntl

    stub, c = raw
    name = shm.NAME_PREFIX + secrets.token_hex(16)
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 1 << 20)
        assert _code(stub.Attach, ps_pb2.ShmAttachRequest(
            name=name, nbytes=1 << 20, pid=os.getpid(), fd=fd)) == \
            grpc.StatusCode.FAILED_PRECONDITION
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)   # half sealed: still refused
        assert _code(stub.Attach, ps_pb2.ShmAttachRequest(
            name=name, nbytes=1 << 20, pid=os.getpid(), fd=fd)) == \
            grpc.StatusCode.FAILED_PRECONDITION
    finally:
        os.close(fd)
    seg = shm.Segment(1 << 20)
    try:
        seg_id = stub.Attach(_attach_request(seg)).segment
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 0)
        with pytest.raises(PermissionError):   # through the server's own path to it too
            os.truncate(f"/proc/{seg.pid}/fd/{seg.fd}", 0)
        r = stub.Read(ps_pb2.ShmReadRequest(segment=seg_id, names=["w"]))
        assert r.values[0].name == "w"
    finally:
        seg.close()
    assert c.read("w") is not None   # still serving


def test_malformed_push_and_read_change_nothing(raw):
    stub, c = raw
    value0, version0 = c.read("w", with_version=True)
    seg = shm.Segment(1 << 22)
    try:
        seg_id = stub.Attach(_attach_request(seg)).segment
        seg.unlink()
        grad = np.ones(N, np.float32)
        seg.array[:grad.nbytes] = grad.view(np.uint8)

        def push(**kw):
            u = dict(name="w", dtype="float32", shape=[N], offset=0)
            u.update(kw)
            return ps_pb2.ShmPushRequest(segment=kw.pop("segment", seg_id),
                                         updates=[ps_pb2.ShmTensor(**u)])
        bad = {
            "past the end": push(offset=seg.nbytes - 8),
            "negative offset": push(offset=-4),
            "misaligned": push(offset=2),
            "wrong shape": push(shape=[N + 1]),
            "wrong dtype": push(dtype="float64"),
            "unknown dtype": push(dtype="complex64"),
            "negative dim": push(shape=[-N]),
            "no such variable": push(name="nope"),
        }
        codes = {k: _code(stub.Push, req) for k, req in bad.items()}
        assert set(codes.values()) <= {grpc.StatusCode.INVALID_ARGUMENT,
                                        grpc.StatusCode.NOT_FOUND}, codes
        assert codes["no such variable"] == grpc.StatusCode.NOT_FOUND
        unknown = ps_pb2.ShmPushRequest(segment=seg_id + 1, updates=[
            ps_pb2.ShmTensor(name="w", dtype="float32", shape=[N])])
        assert _code(stub.Push, unknown) == grpc.StatusCode.FAILED_PRECONDITION
        seg.array[:4] = np.array([np.nan], np.float32).view(np.uint8)
        assert _code(stub.Push, push()) == grpc.StatusCode.INVALID_ARGUMENT   # NaN
        value, version = c.read("w", with_version=True)
        assert version == version0
        np.testing.assert_array_equal(value, value0)

        small = shm.Segment(1 << 20)   # 1 MiB: the variable plus alignment does not fit...
        try:
            sid = stub.Attach(_attach_request(small)).segment
            assert _code(stub.Read, ps_pb2.ShmReadRequest(segment=sid, names=["w", "w"])) == \
                grpc.StatusCode.OUT_OF_RANGE   # too small: the client reads again without it
            # ...but one copy does, at offset 0
            r = stub.Read(ps_pb2.ShmReadRequest(segment=sid, names=["w"]))
            assert (r.values[0].offset, r.values[0].version) == (0, version0)
            np.testing.assert_array_equal(small.array[:N * 4].view(np.float32), value0)
        finally:
            small.close()
        assert _code(stub.Read, ps_pb2.ShmReadRequest(segment=seg_id, names=["nope"])) == \
            grpc.StatusCode.NOT_FOUND
        stub.Detach(ps_pb2.ShmDetachRequest(segment=seg_id))
        assert _code(stub.Read, ps_pb2.ShmReadRequest(segment=seg_id, names=["w"])) == \
            grpc.StatusCode.FAILED_PRECONDITION
    finally:
        seg.close()


def test_segments_expire_when_idle():
    """A client that died never detaches: its segments close after idle_seconds."""
    segs = shm.Segments(idle_seconds=0.0)
    a = shm.Segment(1 << 20)
    try:
        seg_id = segs.attach(a.name, a.nbytes, a.pid, a.fd)
        a.unlink()
        with segs.mapped(seg_id) as buf:
            assert len(buf) == a.nbytes
        b = shm.Segment(1 << 20)
        try:
            segs.attach(b.name, b.nbytes, b.pid, b.fd)   # sweeps the idle one
            with pytest.raises(FailedPrecondition, match=shm.UNKNOWN_SEGMENT):
                with segs.mapped(seg_id):
                    pass
        finally:
            b.close()
    finally:
        a.close()
        segs.close()
    assert len(segs) == 0


def test_arena_reuses_and_bounds_segments():
    attached, detached = [], []
    arena = shm.Arena(lambda seg: attached.append(seg.nbytes) or len(attached),
                      lambda seg_id: detached.append(seg_id), max_free=2)
    s1 = arena.take(100)
    assert s1.nbytes == 1 << 20 and s1.fd == -1   # its descriptor closed once attached
    arena.give(s1)
    assert arena.take(5000) is s1   # reused
    s2, s3 = arena.take(3 << 20), arena.take(10)
    assert s2.nbytes == 4 << 20
    for s in (s1, s2, s3):
        arena.give(s)
    assert len(detached) == 1   # only the largest max_free kept
    arena.close()
    assert len(detached) == 3


@pytest.mark.parametrize("mode", ["shm", "data", "grpc"])
def test_read_into_given_arrays(ps, mode):
    with PSClient(ps.address, shared_memory=mode == "shm", data_port=mode != "grpc") as c:
        init = _make(c)
        c.read("w")
        c.push("w", np.ones(N, np.float32))
        dest, wrong = np.empty(N, np.float32), np.empty(N + 1, np.float32)
        for _ in range(2):   # (the first read of a client may take another path)
            s1, s2, s3 = c.read_many(["w", "w", "w"], out=[dest, wrong, None])
        assert s1.value is dest and s1.version == 1
        np.testing.assert_allclose(dest, init - 0.5, rtol=1e-6)
        assert s2.value is not wrong   # a shape that does not fit: a new array
        np.testing.assert_array_equal(s2.value, dest)
        np.testing.assert_array_equal(s3.value, dest)
        h = c.read_many_async(["w"], out=[dest])
        assert h.result()[0].value is dest
        sock = c.channel.socket
        assert (sock.kind if sock is not None else "grpc") == \
            {"shm": "unix" if shm.available() else "tcp", "data": "tcp", "grpc": "grpc"}[mode]


# -- the local call socket (psserver/serve/ipc_server.py) --------------------------------------------
def _ipc_name(address: str, token: str | None = None) -> str:
    """The server's Unix socket, as it announces it (ServerInfo.host)."""
    with PSClient(address, token=token) as c:
        name = c.server_info().host.ipc_socket
    assert name.startswith("@pstrain-ipc-")
    return name


def test_local_socket_checks_the_token_and_survives_garbage(start_ps):
    from psserver.contract import TOKEN_ENV, routing
    from psserver.errors import Unauthenticated
    from psserver.link.transport import SocketTransport
    ps = start_ps(env={TOKEN_ENV: "right"})
    name = _ipc_name(ps.address, "right")
    for token in (None, "wrong", "righ"):
        with pytest.raises(Unauthenticated):
            SocketTransport(routing.UNIX, ps.address, token, name=name).connect()
    import socket
    import struct
    for junk in (b"\x00" * 3,                                        # a short hello
                 struct.pack("<BId", 9, 0, 0.0),                      # not a hello
                 struct.pack("<BId", 0, 1 << 31, 0.0)):               # a huge hello
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect("\0" + name.lstrip("@"))
        s.sendall(junk)
        s.shutdown(socket.SHUT_WR)
        s.recv(1024)   # refused or closed, never served
        s.close()
    client = SocketTransport(routing.UNIX, ps.address, "right", name=name)
    gather = ps_pb2.GatherRequest(name="nope", ids=ps_pb2.Tensor(
        dtype="int64", shape=[1], data=np.zeros(1, np.int64).tobytes()))
    with pytest.raises(PSError) as info:   # a well-formed call: the servicer's answer
        client.call(methods.GATHER, gather.SerializeToString(), 5)
    assert info.value.code == Code.NOT_FOUND
    with pytest.raises(PSError) as info:   # an unparsable request
        client.call(methods.PUSH_SPARSE, b"\xff\xff\xff", 5)
    assert info.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(PSError) as info:   # no such method
        client.call(methods.Method(77, methods.PS, "Nothing", None, None, "nothing"), b"", 5)
    assert info.value.code == Code.UNIMPLEMENTED
    client.close()
    with PSClient(ps.address, token="right") as c:   # and it still serves
        _make(c)
        c.read("w")
        c.push("w", np.ones(N, np.float32))
        assert c.channel.socket is not None and c.read("w", with_version=True)[1] == 1


# -- reads straight from the server's memory (psserver.contract.shm.SharedValue) -------------------
direct = pytest.mark.skipif(not shm.direct_reads_available(),
                            reason="direct reads need Linux on x86-64")


@direct
def test_direct_reads_are_consistent_under_concurrent_pushes(ps):
    """A writer process pushes ones (lr 1) as fast as it can; every read must be
    exactly init - version in every element: no torn value, no wrong version."""
    n = 1 << 20   # 4 MiB: reads and writes overlap often
    with PSClient(ps.address) as c:
        c.create_variable("w", initial_value=np.zeros(n, np.float32),
                          optimizer_params={"learning_rate": 1.0})
        c.read("w")
        c.read("w")
        assert isinstance(c._segments._mapped.get("w"), shm.MappedValue)   # the path under test
        code = textwrap.dedent(f"""
            import numpy as np
            from psserver.client import PSClient
            with PSClient({ps.address!r}) as c:
                g = np.ones({n}, np.float32)
                for _ in range(150):
                    c.push("w", g)
        """)
        writer = subprocess.Popen([sys.executable, "-c", code])
        try:
            seen = set()
            while writer.poll() is None:
                value, version = c.read("w", with_version=True)
                assert value[0] == -version and (value == -version).all(), version
                seen.add(version)
            assert writer.wait(60) == 0
        finally:
            writer.kill()
        value, version = c.read("w", with_version=True)
        assert version == 150 and (value == -150).all()
        assert len(seen) > 5   # reads really ran between the writes


@direct
def test_direct_reads_follow_delete_recreate_and_restart(start_ps):
    ps = start_ps()
    with PSClient(ps.address, wait_for_ready=True) as c:
        c.create_variable("w", initial_value=np.full(1000, 1.0, np.float32))
        c.read("w")
        np.testing.assert_array_equal(c.read("w"), 1.0)
        mapped = c._segments._mapped["w"]
        c.delete_variable("w")
        c.create_variable("w", initial_value=np.full(1000, 2.0, np.float32))
        np.testing.assert_array_equal(c.read("w"), 2.0)   # not the dead one
        assert c._segments._mapped.get("w") is not mapped
        np.testing.assert_array_equal(c.read("w"), 2.0)
        port = ps.address.rsplit(":", 1)[1]
        ps.kill()
        with pytest.raises(PSError):   # the dead server's memory is not read
            _read_fast(c)
        start_ps("--port", port)
        c.create_variable("w", initial_value=np.full(1000, 3.0, np.float32))
        np.testing.assert_array_equal(c.read("w"), 3.0)
        np.testing.assert_array_equal(c.read("w"), 3.0)


@direct
def test_no_value_of_a_dead_server_is_read_after_it_restarts_and_a_push_goes_first(start_ps):
    """A client that read a variable straight from its server's memory, whose
    server was killed and restarted on the same port, and whose first call
    after that is a push: its next read is the new process's value, not the
    dead process's memory (issue 33 item 1: what it knew of the server is
    kept per incarnation, TaskChannel.incarnation)."""
    ps = start_ps()
    port = ps.address.rsplit(":", 1)[1]
    with PSClient(ps.address, wait_for_ready=True) as c:
        c.create_variable("w", initial_value=np.zeros(1000, np.float32),
                          optimizer_params={"learning_rate": 1.0})
        c.read("w")
        assert c.read("w", with_version=True)[1] == 0
        assert isinstance(c._segments._mapped.get("w"), shm.MappedValue)   # mapped
        ps.kill()
        ps = start_ps("--port", port)
        with PSClient(ps.address) as other:
            other.create_variable("w", initial_value=np.full(1000, 9.0, np.float32),
                                  optimizer_params={"learning_rate": 1.0})
            assert other.push("w", np.ones(1000, np.float32)) == 1   # 8.0 at version 1
            assert c.push("w", np.ones(1000, np.float32)) == 2       # 7.0 at version 2
            value, version = c.read("w", with_version=True)
            assert version == 2 and (value == 7.0).all(), (version, value[:3])
            np.testing.assert_array_equal(other.read("w"), value)


def _read_fast(c: PSClient):
    """A read with a short deadline (the server is down)."""
    ch = c.channel
    old, ch.timeout = ch.timeout, 2.0
    old_wait, ch.grpc.wait_for_ready = ch.grpc.wait_for_ready, False
    try:
        return c.read_many(["w"])
    finally:
        ch.timeout, ch.grpc.wait_for_ready = old, old_wait


@direct
def test_mapped_value_checks_its_tag_and_the_seqlock():
    """Unit test of the reader side against a SharedValue made here."""
    class Var:
        version = 0
    value = np.arange(10, dtype=np.float64)
    shared = shm.SharedValue(value, 7)
    try:
        with pytest.raises(OSError, match="not the variable"):
            shm.MappedValue(shared.path, "float64", [10], shared.nbytes, shared.tag + 1)
        m = shm.MappedValue(shared.path, "float64", [10], shared.nbytes, shared.tag)
        version, got = m.read_into(None)
        assert version == 7
        np.testing.assert_array_equal(got, value)
        var = Var()
        with shared.writing(var):   # a writer mid-change: readers never take it
            shared.value[:] = -1
            assert m.read_into(None, tries=3) is None
            var.version = 8
        dest = np.empty(10)
        assert m.read_into(dest)[0] == 8 and (dest == -1).all()
        shared.retire()
        shared = None
        assert m.read_into(None) is False   # deleted: map again
        m.close()
    finally:
        if shared is not None:
            shared.retire()


def test_segment_of_a_timed_out_push_is_never_lent_again(start_ps):
    """A push that times out on the client may still be read by the server
    later: its segment must not carry the next call's data (the server would
    apply those bytes as the first push's gradients)."""
    import signal
    ps = start_ps()
    n = 65536
    with PSClient(ps.address, shared_memory=False) as setup, \
            PSClient(ps.address, timeout=1.0) as c:
        for name, size in (("a", n), ("b", n), ("c", 2 * n)):
            setup.create_variable(name, (size,), optimizer_params={"learning_rate": 1.0})
        c.read("a")
        c.read("a")   # attached: a free segment, a local connection
        assert c.channel.socket is not None
        c.channel.socket.connect()   # a second one, so the next call needs no server to connect
        # Two free segments: 1 MiB, which the first push takes, and 4 MiB, which
        # the second takes only if the first one is (rightly) not lent again.
        for seg in [c._segments._take(1 << 20), c._segments._take(3 << 20)]:
            c._segments._arena.give(seg)
        os.kill(ps.pid, signal.SIGSTOP)   # a server too slow for the deadline
        wait_stopped(ps.pid)   # every thread of it (SIGSTOP lands thread by thread)
        try:
            with pytest.raises(PSError):
                c.push_many([("a", np.ones(n, np.float32)), ("b", np.ones(n, np.float32))])
            c.timeout = 30
            # Written into a segment now, while the server has not read the first push.
            h = c.push_many_async([("c", np.full(2 * n, 1000.0, np.float32))])
        finally:
            os.kill(ps.pid, signal.SIGCONT)
        h.result()
        # The late push still lands, with its own data (ones), not c's.
        deadline = time.monotonic() + 30
        while setup.get_meta("b").version < 1:
            assert time.monotonic() < deadline, "the late push never landed"
            time.sleep(0.05)
        for name in ("a", "b"):
            np.testing.assert_array_equal(setup.read(name), -1.0)
        np.testing.assert_array_equal(setup.read("c"), -1000.0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_local_socket_closes_other_users_at_once(ps):
    address = "\0" + _ipc_name(ps.address).lstrip("@")
    code = textwrap.dedent(f"""
        import os, socket, struct
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect({address!r})
        try:
            s.sendall(struct.pack("<BId", 0, 0, 0.0))   # a hello without token
            print(repr(s.recv(100)))
        except OSError as e:
            print("closed", type(e).__name__)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("b''", "closed ConnectionResetError", "closed BrokenPipeError"), \
        r.stdout   # no reply: nothing read from another user


def test_a_read_whose_segment_is_too_small_is_made_again_without_it(ps):
    """A variable re-created larger behind a client's back: the client's
    read, sized from what it knew, does not fit its segment; the server says
    so (RESOURCE_EXHAUSTED, nothing done) and the read is made again without
    the segment, returning the new value. (Sync reads: asynchronous ones copy
    straight from the server's memory, without a segment.)"""
    with PSClient(ps.address) as c, PSClient(ps.address) as other:
        _make(c)
        c.read_many(["w"], sync_step=0)   # remembers N floats
        assert c.route.shm
        other.delete_variable("w")
        bigger = _make(other, n=4 * N)
        for _ in range(2):   # made again without the segment; then sized anew
            np.testing.assert_array_equal(c.read_many(["w"], sync_step=0)[0].value, bigger)
