"""Hot calls over plain sockets, beside gRPC: a same-host Unix socket, and
the data port (TCP) for peers on other hosts.

gRPC Python's per-call machinery costs about 0.23 ms of client CPU and
0.33 ms of server CPU for an empty unary call on a 2-core machine, against
0.04 and 0.03 ms for a request/reply over a plain socket, and a 1.3 MB
tensor is copied several times on its way through it. A training step makes
one to four calls per parameter server, so the hot ones (reads, pushes,
lookups, sparse pushes, closures) go over sockets with the frame format
below; everything else stays on gRPC, which every deployment can rely on.

* Same host: the server listens on an abstract Unix socket (Linux; no file
  to clean up, gone with the process) named ``@pstrain-ipc-<hex>`` and
  announces it in its reply to ``SharedMemory.Attach``; tensor bytes go
  through shared memory (psserver/shm.py). The name is no secret (any local
  user sees it in /proc/net/unix) and abstract sockets have no permissions,
  so a connection from another user is closed at once (SO_PEERCRED).
* Other hosts: the data port (``psserver --data-port``, ``psworker
  --data-port``; announced in ServerInfo / WorkerInfo.data_port) carries
  the ParameterServerBulk read and push (tensor bytes framed by hand,
  psserver/wire.py), gathers, sparse pushes and closures. A task with TLS
  speaks TLS there too, with the same certificate and the same rule (a CA
  given: client certificates required); keepalive as gRPC's. A client that
  cannot reach it (a firewall, a port-forward of the gRPC port only) keeps
  to gRPC.
* Either way a connection must finish its TLS handshake (data port with
  TLS) and say hello with the cluster token (any, when the task has none) within
  HELLO_SECONDS in all; at most MAX_PENDING connections may be waiting to,
  and MAX_CONNECTIONS be open. Request frames are at most MAX_FRAME_BYTES;
  one claiming more than _EAGER_BYTES reserves nothing until its first MiB
  came. A client checks, with IDENTITY, that the task answering is the one
  whose id and protocol version its gRPC port told (a port mapping may lead
  elsewhere).
* Then request/reply frames, one call at a time per connection:
  request ``<method u8><length u32><timeout f64>`` + the serialized request
  (the same protobuf messages as the gRPC methods); reply
  ``<status u8><length u32>`` + the serialized reply, or the error message
  (status: the gRPC status code number; 0 is OK).
* The handlers are the gRPC servicer's own, with a stand-in context: same
  validation, same errors, same metrics (``grpc_type`` "unix" or "tcp").
* A client keeps a few connections (one per concurrent call) and opens
  another when all are busy; a kept one that its server closed is dropped
  before use. A connection broken after its request went fails the call
  with UNAVAILABLE, as a lost gRPC connection does; a request that never
  went (a refused connection, another task answering) is marked not_sent,
  and the caller makes it over gRPC.
"""
from __future__ import annotations

import contextlib
import logging
import os
import _socket
import select
import socket
import ssl
import struct
import sys
import threading
import weakref

from typing import Callable

import numpy as np

from psserver import buffers
from psserver.contract import (Code, DeadlineExceeded, InvalidArgument, PSError, Unauthenticated,
                               Unavailable, error_for)

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("<BId")
_REPLY = struct.Struct("<BI")
_PEERCRED = struct.Struct("3i")
#: Largest request a server takes, and the most tensor bytes one socket call
#: carries (dense reads and pushes of any size up to it go over the data port
#: in one frame, received straight into the buffer the arrays are views of;
#: larger ones take gRPC's streams).
MAX_FRAME_BYTES = 256 << 20
#: Seconds a new connection has to say hello, and the most connections a
#: server keeps.
HELLO_SECONDS = 5.0
MAX_CONNECTIONS = 1024
#: Connections that have not said hello yet a server keeps, in all and per
#: peer address. A new one past either bound pushes out the oldest waiting one
#: (of that peer, or of any): silent connections cannot lock out a client,
#: which says hello at once.
MAX_PENDING = 64
MAX_PENDING_PER_PEER = 8
#: Bytes of request frames still arriving that a server holds, over all its
#: connections (one frame per connection, each at most MAX_FRAME_BYTES). A
#: connection whose frame would go past it is dropped: its memory is taken as
#: bytes arrive, never reserved for what a header only announces.
MAX_ARRIVING_BYTES = 1 << 30
#: Seconds a client waits to connect to a data port and be greeted
#: (unreachable: it keeps to gRPC).
CONNECT_SECONDS = 5.0
#: Seconds a server waits for a client to take a reply before dropping it.
REPLY_SECONDS = 60.0

#: The frame protocol's own calls; the others are psserver/methods.py's ids.
HELLO, IDENTITY = 0, 8
#: Bodies above this are sent apart from their frame header (no joined copy).
_JOIN_BYTES = 64 << 10
_IOV_MAX = 1024   # the most buffers one sendmsg takes (Linux's UIO_MAXIOV)
#: Frames up to this size are received into one buffer made at once.
_EAGER_BYTES = 4 << 20
_RDHUP = getattr(select, "POLLRDHUP", 0)


def available() -> bool:
    """Whether this process may serve and use local sockets (Linux; not turned
    off with PSTRAIN_SHM=0, the switch of the whole same-host path)."""
    return (os.environ.get("PSTRAIN_SHM", "1") != "0" and hasattr(socket, "AF_UNIX")
            and hasattr(socket, "SO_PEERCRED") and sys.platform.startswith("linux"))


DATA_ENV = "PSTRAIN_DATA"


def data_available() -> bool:
    """Whether this process uses data ports (the frames below over TCP, to
    servers on other hosts); PSTRAIN_DATA=0 keeps those calls on gRPC."""
    return os.environ.get(DATA_ENV, "1") != "0"


#: A plain TCP receive of this much or more waits in the kernel for all of it
#: (MSG_WAITALL): on a link slower than the reader, recv otherwise returns a
#: packet or two per call, and a 4 MB frame over a 1 Gbit/s link cost
#: thousands of trips through Python. The kernel takes the bytes off the
#: socket as they come (the window stays open), so nothing waits on the peer.
_WAITALL_BYTES = 256 << 10


#: A socket's address family as a plain int (``sock.family`` makes an enum each time).
_family = _socket.socket.family.__get__


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    if n >= _WAITALL_BYTES and _family(sock) in (socket.AF_INET, socket.AF_INET6) \
            and not isinstance(sock, ssl.SSLSocket):
        got = _recv_waitall(sock, view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("connection closed")
        got += k


def _recv_waitall(sock: socket.socket, view: memoryview) -> int:
    """Receive into all of ``view`` in one blocking call (MSG_WAITALL), under
    the socket's timeout (SO_RCVTIMEO while it blocks); the bytes it got (all,
    or fewer after a signal or the timeout: the caller receives the rest)."""
    timeout = sock.gettimeout()
    if timeout is not None:   # Python's timeouts make the socket non-blocking
        sec = int(timeout)
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", sec, int((timeout - sec) * 1e6) or (not sec)))
    try:
        k = sock.recv_into(view, len(view), socket.MSG_WAITALL)
    except BlockingIOError:   # SO_RCVTIMEO passed with nothing received
        raise socket.timeout("timed out") from None
    finally:
        if timeout is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
            sock.settimeout(timeout)
    if not k:
        raise ConnectionError("connection closed")
    return k   # fewer than asked: a signal, or the timeout part-way (the loop finds out)


def _recv_exact(sock: socket.socket, n: int, hold=None) -> bytearray | memoryview:
    """n bytes, received in place into one buffer (no copy after the
    kernel's): up to _JOIN_BYTES a bytearray, up to _EAGER_BYTES a
    memoryview of an array made at once (not zeroed first, as a bytearray
    is: a worker's 1.4 MB read reply spent 0.2 ms in memset); a larger frame a memoryview
    of a buffer kept for such frames (psserver/buffers.py), taken against
    ``hold`` 1 MiB at a time as bytes arrive, so what a header only claims
    reserves nothing. ``hold(k)``: called before k more bytes are taken
    (it may refuse: raise)."""
    if n <= _EAGER_BYTES:
        if hold is not None:
            hold(n)
        buf = bytearray(n) if n <= _JOIN_BYTES else memoryview(np.empty(n, np.uint8))
        _recv_into(sock, memoryview(buf))
        return buf
    view, got = memoryview(buffers.take(n)), 0
    while got < n:
        k = min(_CHUNK, n - got)
        if hold is not None:
            hold(k)
        _recv_into(sock, view[got:got + k])
        got += k
    return view


_CHUNK = 1 << 20


def _give_back_memory() -> None:
    """Return freed heap memory to the system (glibc; tasks run with a high
    trim threshold, MALLOC_ENV, so a large frame's pages would stay)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _shut(sock: socket.socket) -> None:
    """Wake whatever waits on sock (its reads fail): a peer out of time."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _tune_tcp(sock: socket.socket) -> None:
    """No Nagle delay; keepalive as gRPC's (a probe after 10 s idle, unanswered
    for 5 s: gone), and data sent but not acknowledged for 15 s: gone, so a
    peer whose host vanished or whose link was cut is found out in ~15 s,
    waiting for a reply or in the middle of sending."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 15_000)


def _nbytes(body) -> int:
    """A frame body's size: a buffer, or a tuple of buffers (psserver/wire.Scattered)."""
    return sum(memoryview(p).nbytes for p in body) if isinstance(body, tuple) else len(body)


def _send_parts(sock: socket.socket, parts) -> None:
    """The buffers ``parts`` sent in order, with sendmsg (one system call
    for all of them, however the kernel splits it); one by one over TLS."""
    views = [v.cast("B") for v in map(memoryview, parts) if v.nbytes]
    if isinstance(sock, ssl.SSLSocket):   # no sendmsg there
        for v in views:
            sock.sendall(v)
        return
    while views:
        n = sock.sendmsg(views[:_IOV_MAX])
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0], n = views[0][n:], 0


def _send(sock: socket.socket, header: bytes, body) -> None:
    """A frame: header and body joined when small, sent apart (no copy) when
    large; a tuple of buffers (psserver/wire.Scattered) as they are."""
    if isinstance(body, tuple):
        _send_parts(sock, (header, *body))
    elif len(body) <= _JOIN_BYTES:
        sock.sendall(header + body)
    else:
        sock.sendall(header)
        sock.sendall(body)


def _address(name: str) -> str:
    """The abstract socket name as bind/connect take it."""
    return "\0" + name.lstrip("@")


# -- client ----------------------------------------------------------------------------
class _Pending:
    """A sent call: calling it waits for the reply; ready() says whether it came."""

    def __init__(self, client: "IpcClient", sock: socket.socket, timeout: float | None,
                 receiver=None):
        self._client, self._sock, self._timeout = client, sock, timeout
        self._receiver = receiver

    def ready(self) -> bool:
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return True   # decrypted already: poll cannot see it
        try:
            p = select.poll()
            p.register(self._sock, select.POLLIN | select.POLLHUP)
            return bool(p.poll(0))
        except (OSError, ValueError):   # closed: calling it reports the error
            return True

    def __call__(self) -> bytes:
        return self._client._receive(self._sock, self._timeout, self._receiver)


class IpcClient:
    """A client's connections to one server's socket, each used by one call at a time.

    ``name``: the server's abstract Unix socket; or ``tcp=(host, port)``: its
    data port, with TLS when ``ssl_context`` is given (``server_hostname``:
    the name its certificate must carry, default host).
    """

    def __init__(self, name: str, token: str | None, target: str, max_free: int = 8, *,
                 tcp: tuple[str, int] | None = None, ssl_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, identity: str | None = None):
        """``identity``: what the server must answer to IDENTITY (its id and
        protocol version, as its gRPC port told), checked on every connection."""
        self.name, self.target = name, target
        self._identity = None if identity is None else identity.encode()
        self._closed = False
        self._tcp = tcp
        self._ssl = ssl_context
        self._server_hostname = server_hostname or (tcp[0].strip("[]") if tcp else None)
        self._token = (token or "").encode()
        self._free: list[socket.socket] = []
        self._lock = threading.Lock()
        self._max_free = max_free
        self._watch: socket.socket | None = None   # see alive()
        # Connections whose reply is awaited (weakly: a reply never collected
        # must not keep its connection open; it closes when collected as garbage).
        self._busy: weakref.WeakSet = weakref.WeakSet()
        self._poll = None

    def _connect(self) -> socket.socket:
        if self._tcp is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            s = socket.create_connection((self._tcp[0].strip("[]"), self._tcp[1]),
                                         timeout=CONNECT_SECONDS)
            _tune_tcp(s)
        try:
            s.settimeout(CONNECT_SECONDS)
            if self._tcp is None:
                s.connect(_address(self.name))
            elif self._ssl is not None:
                s = self._ssl.wrap_socket(s, server_hostname=self._server_hostname)
            s.sendall(_REQUEST.pack(HELLO, len(self._token), 0.0) + self._token)
            code, n = _REPLY.unpack(_recv_exact(s, _REPLY.size))
            if code:
                raise error_for(code, bytes(_recv_exact(s, min(n, 4096))).decode(errors="replace"),
                                self.target)
            if self._identity is not None:
                s.sendall(_REQUEST.pack(IDENTITY, 0, 0.0))
                code, n = _REPLY.unpack(_recv_exact(s, _REPLY.size))
                got = bytes(_recv_exact(s, min(n, 4096)))
                if code or got != self._identity:
                    raise error_for(Code.FAILED_PRECONDITION,
                                 f"{self.name or self._tcp} answers as another task "
                                 f"({got[:80]!r}, not {self._identity!r}): a port mapping "
                                 "that reaches another server", self.target)
            return s
        except BaseException:
            s.close()
            raise

    def connect(self) -> None:
        """Open one connection now (raises OSError or PSError if it cannot)."""
        self._give(self._connect())

    def alive(self) -> bool:
        """Whether the server process is still there: a connection kept for
        this and never used for calls reports its end when the server dies."""
        with self._lock:
            if self._watch is None:
                try:
                    self._watch = self._connect()
                except (OSError, PSError):
                    return False
                self._poll = select.poll()
                self._poll.register(self._watch, select.POLLIN | select.POLLHUP | _RDHUP)
            return not self._poll.poll(0)

    def _give(self, s: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._free) < self._max_free:
                self._free.append(s)
                return
        s.close()

    def _take(self) -> socket.socket | None:
        """A free connection that is still open (one whose server went away
        reads as readable or hung up: nothing else arrives unasked), or None."""
        while True:
            with self._lock:
                s = self._free.pop() if self._free else None
            if s is None:
                return None
            if isinstance(s, ssl.SSLSocket) and s.pending():
                s.close()
                continue
            try:
                p = select.poll()
                p.register(s, select.POLLIN | select.POLLHUP | select.POLLERR | _RDHUP)
                if not p.poll(0):
                    return s
            except (OSError, ValueError):
                pass
            s.close()

    def call(self, method: int, request: bytes, timeout: float | None) -> bytes:
        """Send a request and wait for its reply (raises the call's PSError)."""
        return self.send(method, request, timeout)()

    def send(self, method: int, request: bytes, timeout: float | None,
             receiver=None) -> Callable[[], bytes]:
        """Send a request now; the returned function waits for the reply.
        ``receiver(recv_into, n)``: takes a successful reply's n bytes off
        the socket itself and returns what the call returns (an error's
        message is received as ever).

        Calls to several servers overlap this way on one thread: send to
        each, then collect each reply. Until collected, the call holds its
        connection (a reply never collected costs that connection).
        """
        s = self._take()
        try:
            if s is None:
                if self._closed:
                    raise ConnectionError("the client was closed")
                s = self._connect()
            s.settimeout(timeout)
            with self._lock:
                self._busy.add(s)
            _send(s, _REQUEST.pack(method, _nbytes(request), timeout or 0.0), request)
        except BaseException as exc:
            # Not sent in full: a server runs a call only once all of it came.
            # (A new connection refused, or answered by another task (a server
            # restarted behind the same port), is not sent either.)
            err = self._broken(s, exc)
            if isinstance(err, PSError):
                err.not_sent = True
            raise err from None
        return _Pending(self, s, timeout, receiver)

    def _receive(self, s: socket.socket, timeout: float | None, receiver=None) -> bytes:
        try:
            code, n = _REPLY.unpack(_recv_exact(s, _REPLY.size))
            if receiver is not None and code == 0:
                # the reply taken off the socket by its own receiver (wire.receive_read_reply)
                if n > MAX_FRAME_BYTES:
                    raise InvalidArgument(f"a reply of {n} bytes, over the {MAX_FRAME_BYTES}-byte "
                                          "frame limit: not a server of ours")
                got = receiver(lambda view: _recv_into(s, view), n)
            else:
                body = _recv_exact(s, n)
        except BaseException as exc:
            raise self._broken(s, exc, timeout) from None
        with self._lock:
            self._busy.discard(s)
        self._give(s)
        if receiver is not None and code == 0:
            return got
        if code:
            raise error_for(code, bytes(body).decode(errors="replace"), self.target)
        return body if len(body) > _JOIN_BYTES else bytes(body)   # large: not copied again

    def _broken(self, s: socket.socket | None, exc: BaseException,
                timeout: float | None = None) -> BaseException:
        """The error for a call whose connection failed (the connection is dropped)."""
        if s is not None:
            with self._lock:
                self._busy.discard(s)
            s.close()
        if isinstance(exc, socket.timeout):
            return DeadlineExceeded(f"call did not finish within {timeout}s [{self.target}]")
        if isinstance(exc, (ConnectionError, OSError)):
            where = "data port" if self._tcp else "local socket"
            return Unavailable(f"lost the connection to the {where} of {self.target}: {exc} "
                               f"[{self.target}]")
        return exc

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
            if self._watch is not None:
                free.append(self._watch)
                self._watch = None
        for s in free:
            s.close()

    def abort(self) -> None:
        """close(), and cut the calls waiting for their replies: each fails at
        once with Unavailable (the caller gave up on them)."""
        self.close()
        with self._lock:
            busy = list(self._busy)
        for s in busy:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


__all__ = ["IpcClient", "available", "Unauthenticated"]
