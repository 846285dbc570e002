"""The socket frame protocol both ends of a task's sockets speak.

Beside gRPC, a task serves its hot calls on plain sockets: a same-host
abstract Unix socket, and a TCP data port for peers on other hosts.
gRPC Python's per-call machinery costs about 0.23 ms of client CPU and
0.33 ms of server CPU for an empty unary call on a 2-core machine, against
0.04 and 0.03 ms for a request/reply over a plain socket, and a 1.3 MB
tensor is copied several times on its way through it.

A connection first says hello (``methods.HELLO``, the cluster token), and a
client checks with ``methods.IDENTITY`` that the task answering is the one
whose id and protocol version its gRPC port told (a port mapping may lead
elsewhere). Then request/reply frames, one call at a time per connection:

* request ``<method u8><length u32><timeout f64>`` + the request's bytes
  (the protobuf message of the gRPC method, or bytes framed by hand:
  psserver/contract/wire.py);
* reply ``<status u8><length u32>`` + the reply's bytes, or the error's
  message (status: the gRPC status code number; 0 is OK).

This module holds the format, its limits, and the socket helpers both the
client (psserver/link/transport.py, ``SocketTransport``) and the server
(psserver/serve/ipc_server.py) use to move frames. The server side's limits
(``HELLO_SECONDS``, ``MAX_PENDING``...) are here beside the client's so
one place says what a connection may do.
"""
from __future__ import annotations

import _socket
import contextlib
import socket
import ssl
import struct

import numpy as np

from psserver.link import buffers

REQUEST = struct.Struct("<BId")
REPLY = struct.Struct("<BI")
PEERCRED = struct.Struct("3i")

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

#: Bodies above this are sent apart from their frame header (no joined copy).
JOIN_BYTES = 64 << 10
_IOV_MAX = 1024   # the most buffers one sendmsg takes (Linux's UIO_MAXIOV)
#: Frames up to this size are received into one buffer made at once.
EAGER_BYTES = 4 << 20
#: A plain TCP receive of this much or more waits in the kernel for all of it
#: (MSG_WAITALL): on a link slower than the reader, recv otherwise returns a
#: packet or two per call, and a 4 MB frame over a 1 Gbit/s link cost
#: thousands of trips through Python. The kernel takes the bytes off the
#: socket as they come (the window stays open), so nothing waits on the peer.
_WAITALL_BYTES = 256 << 10
_CHUNK = 1 << 20

#: A socket's address family as a plain int (``sock.family`` makes an enum each time).
_family = _socket.socket.family.__get__
_INET = (socket.AF_INET, socket.AF_INET6)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill all of ``view`` from sock (ConnectionError if it closes first)."""
    got, n = 0, len(view)
    if n >= _WAITALL_BYTES and _family(sock) in _INET and not isinstance(sock, ssl.SSLSocket):
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


def recv_exact(sock: socket.socket, n: int, hold=None) -> bytearray | memoryview:
    """n bytes, received in place into one buffer (no copy after the
    kernel's): up to JOIN_BYTES a bytearray, up to EAGER_BYTES a memoryview
    of an array made at once (not zeroed first, as a bytearray is: a
    worker's 1.4 MB read reply spent 0.2 ms in memset); a larger frame a
    memoryview of a buffer kept for such frames (psserver/link/buffers.py),
    taken against ``hold`` 1 MiB at a time as bytes arrive, so what a
    header only claims reserves nothing. ``hold(k)``: called before k more
    bytes are taken (it may refuse: raise)."""
    if n <= EAGER_BYTES:
        if hold is not None:
            hold(n)
        buf = bytearray(n) if n <= JOIN_BYTES else memoryview(np.empty(n, np.uint8))
        recv_into(sock, memoryview(buf))
        return buf
    view, got = memoryview(buffers.take(n)), 0
    while got < n:
        k = min(_CHUNK, n - got)
        if hold is not None:
            hold(k)
        recv_into(sock, view[got:got + k])
        got += k
    return view


def recv_rest(sock: socket.socket, head: bytes, start: int, n: int):
    """A frame's n-byte body whose first bytes are head[start:] (received
    with its header): the rest received after them, into one buffer as
    recv_exact makes it."""
    have = len(head) - start
    if have > n:
        raise ConnectionError("a reply longer than its header says: not a task of ours")
    buf = bytearray(n) if n <= JOIN_BYTES else (
        memoryview(np.empty(n, np.uint8)) if n <= EAGER_BYTES else memoryview(buffers.take(n)))
    view = memoryview(buf)
    view[:have] = memoryview(head)[start:]
    recv_into(sock, view[have:])
    return buf


def nbytes(body) -> int:
    """A frame body's size: a buffer, or a tuple of buffers (psserver/wire.Scattered)."""
    return sum(memoryview(p).nbytes for p in body) if isinstance(body, tuple) else len(body)


def send_parts(sock: socket.socket, parts) -> None:
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


def send_frame(sock: socket.socket, header: bytes, body) -> None:
    """A frame: header and body joined when small, sent apart (no copy) when
    large; a tuple of buffers (psserver/wire.Scattered) as they are."""
    if isinstance(body, tuple):
        send_parts(sock, (header, *body))
    elif len(body) <= JOIN_BYTES:
        sock.sendall(header + body)
    else:
        sock.sendall(header)
        sock.sendall(body)


def shut(sock: socket.socket) -> None:
    """Wake whatever waits on sock (its reads fail): a peer out of time."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def tune_tcp(sock: socket.socket) -> None:
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


def unix_address(name: str) -> str:
    """An abstract Unix socket's name as bind/connect take it."""
    return "\0" + name.lstrip("@")
