"""The server side of a task's sockets: its hot calls beside gRPC.

``IpcServer`` serves the calls of psserver/link/methods.py on an abstract Unix
socket (same host) or a TCP data port, with the servicer's own handlers and
a stand-in context; every error becomes its status code here, once. The
frame format and the limits are psserver/link/frames.py; the client is
psserver/link/transport.py's SocketTransport.

* Same host: the server listens on an abstract Unix socket (Linux; no file
  to clean up, gone with the process) named ``@pstrain-ipc-<hex>`` and
  announces it in ServerInfo / WorkerInfo.host (psserver/contract/routing.py);
  tensor bytes go through shared memory (psserver/contract/shm.py). The name is no
  secret (any local user sees it in /proc/net/unix) and abstract sockets
  have no permissions, so a connection from another user is closed at once
  (SO_PEERCRED).
* Other hosts: the data port (``--data-port``, announced in HostInfo) with
  the task's TLS (a CA given: client certificates required) and the same
  keepalive as gRPC's.
* Either way a connection must finish its TLS handshake and say hello with
  the cluster token (any, when the task has none) within HELLO_SECONDS in
  all; at most MAX_PENDING connections may be waiting to, and
  MAX_CONNECTIONS be open. Request frames are at most MAX_FRAME_BYTES; one
  claiming more than EAGER_BYTES reserves nothing until its first MiB came.
* The handlers are the gRPC servicer's own, with a stand-in context: same
  validation, same errors, same metrics (``grpc_type`` "unix" or "tcp").
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from typing import Callable

from psserver import profiling
from psserver.contract.memory import give_back_memory
from psserver.errors import Code, Internal, InvalidArgument, Unimplemented, as_error
from psserver.link import buffers
from psserver.link.frames import (
    EAGER_BYTES,
    HELLO_SECONDS,
    MAX_ARRIVING_BYTES,
    MAX_CONNECTIONS,
    MAX_FRAME_BYTES,
    MAX_PENDING,
    MAX_PENDING_PER_PEER,
    PEERCRED,
    REPLY,
    REPLY_SECONDS,
    REQUEST,
    recv_exact,
    send_frame,
    shut,
    tune_tcp,
    unix_address,
)
from psserver.link.methods import BY_ID, HELLO, IDENTITY

log = logging.getLogger("psserver.ipc")


class _Context:
    """What the servicer's handlers use of a gRPC context: the deadline."""

    #: A reply may be as large as a frame (not gRPC's message limit), and is
    #: encoded into a buffer used again once it was sent (psserver/link/buffers.py).
    max_message_bytes = MAX_FRAME_BYTES
    reply_buffer = staticmethod(buffers.take)

    def __init__(self, timeout: float):
        self._deadline = time.monotonic() + timeout if timeout > 0 else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def invocation_metadata(self):
        return ()


# -- server ----------------------------------------------------------------------------
def follow_cpu(peer_pid: int) -> None:
    """Run this thread on its caller's CPU when the caller is bound to one
    (``psworker --cpus``): a caller waits for its reply anyway, so its call
    is handled on the core it left idle, with the gradients it just wrote
    still in that core's cache (about 3% more MLP steps/s on 2 cores).
    Within this process's own CPUs; otherwise nothing changes."""
    if peer_pid <= 0:
        return
    try:
        cpus = os.sched_getaffinity(peer_pid)
        if len(cpus) == 1 and cpus <= os.sched_getaffinity(0):
            os.sched_setaffinity(0, cpus)   # 0: the calling thread only
    except OSError:   # the caller is gone, or not ours to ask about
        pass


class IpcServer:
    """Serves a task's hot calls on an abstract Unix socket (same host), or
    on a TCP port (``tcp=(host, port)``: the data port, any host; TLS with
    ``ssl_context``)."""

    def __init__(self, handlers: dict[int, tuple[Callable | None, Callable]], token: str | None,
                 rpc_metrics=None, *, tcp: tuple[str, int] | None = None,
                 ssl_context: ssl.SSLContext | None = None, identity: str = ""):
        """handlers: method id -> (request parser, servicer method(request, context));
        a parser None hands the method the request's bytes as they came, and a
        method may return bytes (a reply serialized already). ``identity``: what
        IDENTITY answers (the task's id and protocol version: a client checks it
        reached the task it meant, not another behind a port mapping)."""
        self._handlers = handlers
        self._identity = identity.encode()
        self._token = (token or "").encode()
        self._metrics = rpc_metrics
        self._method_metrics: dict[int, object] = {}
        self._ssl = ssl_context
        if tcp is None:
            self.kind, self.port = "unix", 0
            self.name = "@pstrain-ipc-" + secrets.token_hex(16)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.bind(unix_address(self.name))
        else:
            host, port = tcp
            self.kind, self.name = "tcp", ""
            # The host as gRPC binds it: a name, an IPv4 or an IPv6 address.
            family, _, _, _, addr = socket.getaddrinfo(
                host.strip("[]"), port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0,
                socket.AI_PASSIVE)[0]
            self._sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._sock.bind(addr)
            except OSError:
                self._sock.close()
                raise
            self.port = self._sock.getsockname()[1]
        self._sock.listen(64)
        self._conns: set[socket.socket] = set()
        # Connections yet to say hello, oldest first: connection -> (peer
        # address, descriptor: a TLS socket made from it shares it).
        self._waiting: dict[socket.socket, str] = {}
        self._arriving = 0   # bytes of request frames being received, all connections
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)   # notified when no call runs
        self._running = 0
        self._stopped = False

    def start(self) -> "IpcServer":
        threading.Thread(target=self._accept, name="ipc-accept", daemon=True).start()
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop taking calls; let those running finish for up to ``grace``
        seconds (as gRPC's graceful stop), then close every connection."""
        with self._lock:
            self._stopped = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0, grace)
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return   # stopped
            peer = peer[0] if isinstance(peer, tuple) else "local"
            pid, uid = 0, os.geteuid()
            if self.kind == "unix":
                try:
                    pid, uid, _ = PEERCRED.unpack(conn.getsockopt(
                        socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
                except OSError:
                    pid, uid = 0, -1
            else:
                tune_tcp(conn)
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                if uid != os.geteuid() or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()   # another user's, or too many: nothing is read
                    continue
                mine = [c for c, (p, _) in self._waiting.items() if p == peer]
                if len(mine) >= MAX_PENDING_PER_PEER:
                    self._evict(mine[0])
                elif len(self._waiting) >= MAX_PENDING:
                    self._evict(next(iter(self._waiting)))
                self._conns.add(conn)
                self._waiting[conn] = (peer, conn.fileno())
            threading.Thread(target=self._serve, args=(conn, pid), name="ipc-conn",
                             daemon=True).start()

    def _evict(self, conn: socket.socket) -> None:
        """Cut off a connection still waiting to say hello (lock held): its
        thread's read fails and it goes. By its descriptor, which a TLS
        socket made from it shares (it is still open: the entry leaves
        _waiting before the connection is closed)."""
        entry = self._waiting.pop(conn, None)
        if entry is not None:
            fd = entry[1]
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=os.dup(fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)
                finally:
                    s.close()

    def _hello(self, conn: socket.socket) -> bool:
        method, n, _ = REQUEST.unpack(recv_exact(conn, REQUEST.size))
        token = bytes(recv_exact(conn, n)) if n <= 4096 else None
        # As the gRPC port: a server without a token takes any (or none).
        if method != HELLO or token is None or (
                self._token and not hmac.compare_digest(token, self._token)):
            msg = b"refused: wrong token"
            conn.sendall(REPLY.pack(Code.UNAUTHENTICATED, len(msg)) + msg)
            return False
        conn.sendall(REPLY.pack(0, 0))
        return True

    def _greet(self, raw: socket.socket) -> tuple[socket.socket, bool]:
        """The TLS handshake (with one) and the hello, within HELLO_SECONDS in
        all (a timer cuts off a peer that dribbles bytes): (the connection, as
        wrapped; whether to serve it)."""
        conn = raw
        current = [raw]   # what the timer cuts off: the wrapped socket once there is one
        timer = threading.Timer(HELLO_SECONDS, lambda: shut(current[0]))
        timer.daemon = True
        timer.start()
        try:
            raw.settimeout(HELLO_SECONDS)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(raw, server_side=True)   # takes raw's descriptor
                current[0] = conn
                with self._lock:
                    self._conns.discard(raw)
                    self._conns.add(conn)   # what stop() shuts down
                    if self._stopped:
                        return conn, False
            if not self._hello(conn):
                return conn, False
        except BaseException:
            if conn is not raw:
                conn.close()
            raise
        finally:
            timer.cancel()
            with self._lock:
                self._waiting.pop(raw, None)
        conn.settimeout(None)   # waits for the next call as long as it takes, but
        with contextlib.suppress(OSError):   # a reply not taken for REPLY_SECONDS fails it
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", int(REPLY_SECONDS), 0))
        return conn, True

    def _hold(self, held: list[int]) -> Callable[[int], None]:
        """A hold(k) for recv_exact that counts a connection's arriving bytes
        (in held[0]) against MAX_ARRIVING_BYTES; past it the connection goes."""
        def hold(k: int) -> None:
            with self._lock:
                if self._arriving + k > MAX_ARRIVING_BYTES:
                    raise ConnectionError("too many request bytes arriving at once")
                self._arriving += k
            held[0] += k
        return hold

    def _release(self, held: list[int]) -> None:
        with self._lock:
            self._arriving -= held[0]
        held[0] = 0

    def _serve(self, raw: socket.socket, peer_pid: int = 0) -> None:
        conn = raw
        held, largest = [0], 0
        try:
            conn, ok = self._greet(raw)
            if not ok:
                return
            follow_cpu(peer_pid)
            hold = self._hold(held)
            while True:
                method, n, timeout = REQUEST.unpack(recv_exact(conn, REQUEST.size))
                if n > MAX_FRAME_BYTES:
                    return   # not a client of ours: drop it
                largest = max(largest, n)
                try:
                    payload = recv_exact(conn, n, hold)
                finally:
                    self._release(held)
                with self._lock:
                    if self._stopped:   # stopping: take no new call
                        return
                    self._running += 1
                try:
                    if method == IDENTITY:
                        code, body = Code.OK, self._identity
                    else:
                        code, body = profiling.served(self._call, method, payload, timeout)
                    send_frame(conn, REPLY.pack(code, len(body)), body)
                finally:
                    with self._lock:
                        self._running -= 1
                        if self._stopped:   # only stop() waits for it
                            self._idle.notify_all()
        except (ConnectionError, OSError):   # ssl.SSLError included: a failed handshake
            pass
        finally:
            self._release(held)
            with self._lock:
                self._conns.discard(raw)
                self._conns.discard(conn)
                self._waiting.pop(raw, None)
            conn.close()
            raw.close()
            if largest > EAGER_BYTES:   # its pieces are free: give the pages back
                give_back_memory()

    def _call(self, method: int, payload: bytearray, timeout: float) -> tuple[Code, bytes]:
        """Run one call; the status and the reply's bytes (or the error's
        message). Every error becomes its code here, once."""
        start = time.perf_counter()
        mm = None
        try:
            entry = self._handlers.get(method)
            if entry is None:
                raise Unimplemented(f"no method {method} on this socket")
            parse, handler = entry
            try:
                request = payload if parse is None else parse(payload)   # (any buffer: not copied)
            except Exception as exc:   # not the message this method takes
                raise InvalidArgument(f"bad request: {exc}") from None
            mm = self._metrics_of(method)
            if mm is not None:   # counted as started before it runs, as the gRPC interceptor does
                mm.started.inc()
                mm.recv_msgs.inc()
                mm.recv_bytes.inc(len(payload))
            reply = handler(request, _Context(timeout))
            code, body = Code.OK, (
                reply if isinstance(reply, (bytes, bytearray, memoryview))
                else reply.SerializeToString())
        except Exception as exc:
            err = as_error(exc)
            if isinstance(err, Internal):   # a bug: report it, keep serving
                log.error("internal error in local call %d", method, exc_info=exc)
            code, body = err.code, str(err).encode()
        if mm is not None:
            if code == Code.OK:
                mm.sent_msgs.inc()
                mm.sent_bytes.inc(len(body))
            mm.finished(code.name, time.perf_counter() - start)
        return code, body

    def _metrics_of(self, method: int):
        """The method's metric children (grpc_type "unix" or "tcp"), or None without metrics."""
        if self._metrics is None or method not in BY_ID:
            return None
        mm = self._method_metrics.get(method)
        if mm is None:
            from psserver.serve.task_metrics import _MethodMetrics
            mm = self._method_metrics[method] = _MethodMetrics(
                self._metrics, (self.kind, BY_ID[method].service, BY_ID[method].name))
        return mm
