"""One way to make a unary call to a task: ``Transport.send``.

A transport makes any call of psserver/link/methods.py it carries and returns a
``Pending`` (psserver/link/pending.py) at once: the request has gone (or is
going, on a kept thread); ``result()`` is the reply, made into the caller's
value by ``post`` where given, or the call's typed error (psserver.errors),
mapped once, here, answered by ``recover`` where given. ``call`` is
``send(...).result()`` (over gRPC made straight on the calling thread).

- ``GrpcTransport``: every Method, over a gRPC channel (its TLS, the token);
  also the streams (``upload``, ``read_stream``) for tensors too large for
  one message.
- ``SocketTransport``: the Methods with a socket id, over the task's
  same-host Unix socket (kind UNIX) or its data port (TCP), in the frames of
  psserver/link/frames.py, with the task's TLS and token. ``send`` raises
  only for a request that never reached the task (nothing ran there):
  ``NotSent`` for a refused or lost connection, or the task's refusal
  (``Unauthenticated``, another task answering); a connection lost after
  the request went fails ``result()`` with ``Unavailable``, as over gRPC.
- ``FakeTransport``: answers from a function (tests, and users' tests), the
  way httpx's MockTransport does.

``receiver(recv_into, n)``, for a method whose reply is framed by hand
(``Method.reply`` None), takes a reply of n bytes itself: over a socket
straight off it (``recv_into(view)`` fills a view), elsewhere out of the
reply's bytes; what it returns is the reply.
"""
from __future__ import annotations

import functools
import queue
import select
import socket
import ssl
import threading
import weakref
from concurrent import futures
from typing import Callable, Iterable, Iterator, Sequence

import grpc
import numpy as np

from psserver.contract import wire
from psserver.errors import (
    Code,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotSent,
    PSError,
    Unavailable,
    error_for,
)
from psserver.link import frames, methods
from psserver.link.methods import Method
from psserver.link.pending import Pending

_RDHUP = getattr(select, "POLLRDHUP", 0)
#: The first read of a reply takes up to this much: a small reply (most
#: are) comes whole with its header, in one system call.
_FIRST_BYTES = 64 << 10


class Transport:
    """What every transport offers (see the module)."""

    kind = ""   # routing.GRPC, UNIX or TCP

    def send(self, method: Method, request, timeout: float | None, *, post=None, recover=None,
             receiver=None) -> Pending:
        raise NotImplementedError

    def call(self, method: Method, request, timeout: float | None, *, receiver=None):
        return self.send(method, request, timeout, receiver=receiver).result()

    def close(self) -> None:
        pass


def _reader(raw) -> Callable[[memoryview], None]:
    """A recv_into over a reply already in memory (the bytes of a reply a
    receiver takes, when it did not come over a socket)."""
    pos = 0

    def recv_into(view: memoryview) -> None:
        nonlocal pos
        n = len(view)
        if pos + n > len(raw):
            raise InvalidArgument("the reply ends before its fields do")
        view[:] = memoryview(raw)[pos:pos + n]
        pos += n
    return recv_into


def _raw(request):
    """A request framed by hand for a socket (a view, scattered parts), as bytes."""
    if isinstance(request, memoryview):
        return request.tobytes()
    if isinstance(request, wire.Scattered):
        return wire.joined(request)
    return request


def from_rpc_error(exc: grpc.RpcError, target: str = "", service: str = "") -> PSError:
    """The typed error for a failed gRPC call (psserver.errors.error_for)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    number = code.value[0] if isinstance(code, grpc.StatusCode) else Code.UNKNOWN
    return error_for(number, details or "", target, service)


class _Threads:
    """The kept threads gRPC sends run on.

    Threads are started once and kept (daemons, blocked on a queue when
    idle): a gRPC future costs a thread start on every call (the channel's
    polling thread, when it goes from no call to one in flight), measured at
    about a fifth of a worker's CPU per small call; a blocking call on a
    kept thread costs a queue hand-off (a 1 KiB read, p50: 790 us through a
    future, 520 us blocking).
    """

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, fn: Callable, *args) -> futures.Future:
        fut: futures.Future = futures.Future()
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._queue.put((fut, fn, args))
        if start:
            threading.Thread(target=self._work, name="ps-fanout", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)
            del fut, fn, args
            with self._lock:
                self._idle += 1


_threads = _Threads()


def _future_done(fut: futures.Future, seconds: float) -> bool:
    return fut.done() or bool(futures.wait((fut,), seconds).done)


def background(fn: Callable, *args) -> Pending:
    """``fn(*args)`` run on a kept thread (a streamed transfer, several calls
    made one after another): its Pending."""
    fut = _threads.submit(fn, *args)
    return Pending(fut.result, functools.partial(_future_done, fut))


class GrpcTransport(Transport):
    """Every Method over ``channel``; ``metadata`` (the token) and
    ``wait_for_ready`` go with each call. A request given as bytes (framed
    by hand, psserver/contract/wire.py) is sent as it is; a Method whose reply class
    is None returns the reply's bytes (or a receiver's value)."""

    kind = ""

    def __init__(self, channel: grpc.Channel, target: str, metadata: tuple = (),
                 wait_for_ready: bool = False, *, chunk_bytes: int = 1 << 20,
                 diagnose: Callable[[PSError], PSError] | None = None):
        self.channel, self.target = channel, target
        self.metadata, self.wait_for_ready = metadata, wait_for_ready
        self.chunk_bytes = chunk_bytes
        # Until the task answers a call (``answered``), a call that does not
        # reach it fails with the error ``diagnose`` makes of it: why, and
        # what to check (psserver/link/diagnose.py), not gRPC's bare words.
        self.diagnose = diagnose
        self.answered = False
        self._callables: dict[tuple, grpc.UnaryUnaryMultiCallable] = {}
        self._closed = False

    def _callable(self, m: Method, raw: bool) -> grpc.UnaryUnaryMultiCallable:
        c = self._callables.get((m.path, raw))
        if c is None:
            c = self._callables[(m.path, raw)] = self.channel.unary_unary(
                m.path, request_serializer=None if raw else m.request.SerializeToString,
                response_deserializer=None if m.reply is None else m.reply.FromString)
        return c

    def call(self, method: Method, request, timeout: float | None, receiver=None):
        request = _raw(request)
        raw = method.request is None or isinstance(request, (bytes, bytearray))
        try:
            reply = self._callable(method, raw)(request, timeout=timeout, metadata=self.metadata,
                                                wait_for_ready=self.wait_for_ready)
        except grpc.RpcError as exc:
            raise self._error(exc, method.service) from exc
        except ValueError as exc:
            raise self._closed_error(exc) from None
        self.answered = True
        if receiver is not None and method.reply is None:
            return receiver(_reader(reply), len(reply))
        return reply

    def send(self, method: Method, request, timeout: float | None, *, post=None, recover=None,
             receiver=None) -> Pending:
        request = _raw(request)   # now: the caller's arrays may change once this returns
        fut = _threads.submit(self.call, method, request, timeout, receiver)
        return Pending(fut.result, functools.partial(_future_done, fut), post, recover)

    def upload(self, kind: str, request, arrays: Sequence[np.ndarray], timeout: float | None):
        """A request whose tensors are too big for one message (an UploadFrame
        ``kind``: "push", "create"...), their bytes in frames of chunk_bytes."""
        from protos.pstrain.v1 import ps_pb2

        def frames_of() -> Iterator[ps_pb2.UploadFrame]:
            yield ps_pb2.UploadFrame(**{kind: request})
            step = self.chunk_bytes
            for a in arrays:
                flat = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                for off in range(0, len(flat), step):
                    yield ps_pb2.UploadFrame(chunk=bytes(flat[off:off + step]))
        stream = self.channel.stream_unary("/pstrain.v1.ParameterServer/Upload",
                                           request_serializer=ps_pb2.UploadFrame.SerializeToString,
                                           response_deserializer=ps_pb2.UploadReply.FromString)
        return self._stream_call(lambda: stream(frames_of(), **self._kw(timeout)))

    def read_stream(self, request, timeout: float | None) -> Iterable:
        """ReadStream's frames (a generator; errors mapped as they come)."""
        from protos.pstrain.v1 import ps_pb2
        stream = self.channel.unary_stream("/pstrain.v1.ParameterServer/ReadStream",
                                           request_serializer=ps_pb2.ReadRequest.SerializeToString,
                                           response_deserializer=ps_pb2.ReadFrame.FromString)
        try:
            yield from stream(request, **self._kw(timeout))
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        except ValueError as exc:
            raise self._closed_error(exc) from None

    def _kw(self, timeout: float | None) -> dict:
        return {"timeout": timeout, "metadata": self.metadata,
                "wait_for_ready": self.wait_for_ready}

    def _stream_call(self, fn):
        try:
            return fn()
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        except ValueError as exc:
            raise self._closed_error(exc) from None

    def _error(self, exc: grpc.RpcError, service: str = "") -> PSError:
        """The typed error of a failed call; one that did not reach a task
        that never answered says why (``diagnose``)."""
        err = from_rpc_error(exc, self.target, service)
        if err.code not in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED):
            self.answered = True   # it answered, with an error
        elif err.code != Code.CANCELLED and not self.answered and self.diagnose is not None \
                and not self._closed:
            err = self.diagnose(err)
        return err

    def _closed_error(self, exc: ValueError) -> Exception:
        """What a call grpc refuses with ValueError (a closed channel) is:
        UNAVAILABLE once this transport was closed (calls cut by a
        shutdown), else a bug here."""
        if not self._closed:
            return Internal(f"a call to {self.target} could not be made: {exc}")
        return Unavailable(f"the channel to {self.target} was closed ({exc})")

    def close(self) -> None:
        self._closed = True
        self.channel.close()


class SocketTransport(Transport):
    """A client's connections to one task's socket, each used by one call at
    a time: its Unix socket ``name`` (kind UNIX), or ``tcp=(host, port)``,
    its data port (kind TCP; TLS with ``ssl_context``, ``server_hostname``
    the name its certificate must carry, default host). ``identity``: what
    the task must answer to IDENTITY (its id and protocol version, as its
    gRPC port told), checked on every connection.

    A client keeps up to ``max_free`` idle connections and opens another
    when all are busy; a kept one that its task closed is dropped before
    use. Calls to several tasks overlap on one thread: send to each, then
    collect each reply. Until collected, a call holds its connection (a
    reply never collected costs that connection: it closes when the
    Pending is collected as garbage). ``abortable``: ``abort()`` may cut
    calls waiting for their replies (a worker's closures).
    """

    def __init__(self, kind: str, target: str, token: str | None, *, name: str = "",
                 tcp: tuple[str, int] | None = None, ssl_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, identity: str | None = None,
                 max_free: int = 8, abortable: bool = False):
        self.kind, self.target, self.name = kind, target, name
        self._identity = None if identity is None else identity.encode()
        self._tcp = tcp
        self._ssl = ssl_context
        self._server_hostname = server_hostname or (tcp[0].strip("[]") if tcp else None)
        self._token = (token or "").encode()
        self._free: list[socket.socket] = []
        self._lock = threading.Lock()
        self._max_free = max_free
        self._closed = False
        self._watch: socket.socket | None = None   # see alive()
        self._watch_poll = None
        # With ``abortable``: connections whose reply is awaited, for abort()
        # (weakly: a reply never collected must not keep its connection open).
        self._busy: weakref.WeakSet | None = weakref.WeakSet() if abortable else None

    @property
    def where(self) -> str:
        return "data port" if self._tcp else "local socket"

    # -- connections ---------------------------------------------------------------
    def _connect(self) -> socket.socket:
        if self._tcp is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            s = socket.create_connection((self._tcp[0].strip("[]"), self._tcp[1]),
                                         timeout=frames.CONNECT_SECONDS)
            frames.tune_tcp(s)
        try:
            s.settimeout(frames.CONNECT_SECONDS)
            if self._tcp is None:
                s.connect(frames.unix_address(self.name))
            elif self._ssl is not None:
                s = self._ssl.wrap_socket(s, server_hostname=self._server_hostname)
            s.sendall(frames.REQUEST.pack(methods.HELLO, len(self._token), 0.0) + self._token)
            code, n = frames.REPLY.unpack(frames.recv_exact(s, frames.REPLY.size))
            if code:
                raise error_for(code, bytes(frames.recv_exact(s, min(n, 4096))).decode(
                    errors="replace"), self.target)
            if self._identity is not None:
                s.sendall(frames.REQUEST.pack(methods.IDENTITY, 0, 0.0))
                code, n = frames.REPLY.unpack(frames.recv_exact(s, frames.REPLY.size))
                got = bytes(frames.recv_exact(s, min(n, 4096)))
                if code or got != self._identity:
                    raise error_for(Code.FAILED_PRECONDITION,
                                    f"{self.name or self._tcp} answers as another task "
                                    f"({got[:80]!r}, not {self._identity!r}): a port mapping "
                                    "that reaches another task, or the task restarted",
                                    self.target)
            return s
        except BaseException:
            s.close()
            raise

    def connect(self) -> None:
        """Open one connection now (raises OSError or a PSError if it cannot)."""
        self._give(self._connect())

    def alive(self) -> bool:
        """Whether the task's process is still there: a connection kept for
        this and never used for calls reports its end when the task dies."""
        with self._lock:
            if self._watch is None:
                try:
                    self._watch = self._connect()
                except (OSError, PSError):
                    return False
                self._watch_poll = select.poll()
                self._watch_poll.register(self._watch, select.POLLIN | select.POLLHUP | _RDHUP)
            return not self._watch_poll.poll(0)

    def _give(self, s: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._free) < self._max_free:
                self._free.append(s)
                return
        s.close()

    def _take(self) -> socket.socket | None:
        """A free connection that is still open (one whose task went away
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

    # -- calls -------------------------------------------------------------------------
    def send(self, method: Method, request, timeout: float | None, *, post=None, recover=None,
             receiver=None) -> Pending:
        mid = method.id
        if mid is None:
            raise ValueError(f"{method.path} is not a socket call (psserver/link/methods.py)")
        payload = request if isinstance(request, (bytes, bytearray, memoryview, tuple)) \
            else request.SerializeToString()
        s = self._take()
        try:
            if s is None:
                if self._closed:
                    raise ConnectionError("the client was closed")
                s = self._connect()
            s.settimeout(timeout)
            if self._busy is not None:
                with self._lock:
                    self._busy.add(s)
            kind = type(payload)
            if kind is bytes and len(payload) <= frames.JOIN_BYTES:
                s.sendall(frames.REQUEST.pack(mid, len(payload), timeout or 0.0) + payload)
            elif kind is memoryview and payload.nbytes <= frames.JOIN_BYTES:
                s.sendall(frames.REQUEST.pack(mid, payload.nbytes, timeout or 0.0) + payload)
            else:
                frames.send_frame(s, frames.REQUEST.pack(mid, frames.nbytes(payload),
                                                         timeout or 0.0), payload)
        except BaseException as exc:
            # Not sent in full: a task runs a call only once all of it came.
            # (A new connection refused, or answered by another task (one
            # restarted behind the same port), is not sent either.)
            raise self._not_sent(s, exc) from None
        parse = None if method.reply is None else method.reply.FromString
        return Pending(functools.partial(self._receive, s, timeout, receiver, parse,
                                         method.service),
                       functools.partial(self._ready, s), post, recover)

    def _receive(self, s: socket.socket, timeout: float | None, receiver, parse, service: str):
        try:
            if receiver is None:   # a small reply comes whole with one recv (nothing
                head = s.recv(_FIRST_BYTES)   # else arrives on a connection before it)
                if len(head) < frames.REPLY.size:
                    if not head:
                        raise ConnectionError("connection closed")
                    head += bytes(frames.recv_exact(s, frames.REPLY.size - len(head)))
                code, n = frames.REPLY.unpack_from(head)
                body = head[frames.REPLY.size:] if len(head) == frames.REPLY.size + n \
                    else frames.recv_rest(s, head, frames.REPLY.size, n)
            else:
                code, n = frames.REPLY.unpack(frames.recv_exact(s, frames.REPLY.size))
                if code == 0:
                    # the reply taken off the socket by its own receiver (wire.receive_read_reply)
                    if n > frames.MAX_FRAME_BYTES:
                        raise InvalidArgument(f"a reply of {n} bytes, over the "
                                              f"{frames.MAX_FRAME_BYTES}-byte frame limit: not "
                                              "a task of ours")
                    got = receiver(functools.partial(frames.recv_into, s), n)
                else:
                    body = frames.recv_exact(s, n)
        except BaseException as exc:
            raise self._broken(s, exc, timeout) from None
        if self._busy is not None:
            with self._lock:
                self._busy.discard(s)
        self._give(s)
        if code:
            raise error_for(code, bytes(body).decode(errors="replace"), self.target, service)
        if receiver is not None:
            return got
        if parse is not None:
            return parse(body)
        return body if len(body) > frames.JOIN_BYTES else bytes(body)   # large: not copied again

    @staticmethod
    def _ready(s: socket.socket, seconds: float) -> bool:
        """Whether s's reply (or its end) has arrived, waiting up to seconds."""
        if isinstance(s, ssl.SSLSocket) and s.pending():
            return True   # decrypted already: poll cannot see it
        try:
            p = select.poll()
            p.register(s, select.POLLIN | select.POLLHUP)
            return bool(p.poll(int(seconds * 1000)))
        except (OSError, ValueError):   # closed: asking for the result reports the error
            return True

    def _not_sent(self, s: socket.socket | None, exc: BaseException) -> BaseException:
        """The error ``send`` raises (nothing ran on the task): a lost or
        refused connection as NotSent, a refusal (token, identity) as itself."""
        err = self._broken(s, exc)
        if type(err) is Unavailable:
            sent = NotSent(str(err))
            sent.address = self.target
            return sent
        return err

    def _broken(self, s: socket.socket | None, exc: BaseException,
                timeout: float | None = None) -> BaseException:
        """The error for a call whose connection failed (the connection is
        dropped: where a half-read reply ends is unknown)."""
        if s is not None:
            if self._busy is not None:
                with self._lock:
                    self._busy.discard(s)
            s.close()
        if isinstance(exc, socket.timeout):
            err = DeadlineExceeded(f"call did not finish within {timeout}s [{self.target}]")
            err.address = self.target
            return err
        if isinstance(exc, (ConnectionError, OSError)):
            err = Unavailable(f"lost the connection to the {self.where} of {self.target}: "
                              f"{exc} [{self.target}]")
            err.address = self.target
            return err
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
            busy = list(self._busy or ())
        for s in busy:
            frames.shut(s)


class FakeTransport(Transport):
    """Answers calls from ``handler(method, request) -> reply`` (raise a
    PSError to fail one), as httpx's MockTransport. A reply framed by hand
    (bytes) goes through the caller's receiver as a socket's would.
    ``requests`` lists every (method, request) sent."""

    def __init__(self, handler: Callable[[Method, object], object], kind: str = ""):
        self.handler, self.kind = handler, kind
        self.requests: list[tuple[Method, object]] = []
        self.closed = False

    def send(self, method: Method, request, timeout: float | None, *, post=None, recover=None,
             receiver=None) -> Pending:
        if self.closed:
            raise NotSent(f"fake transport {self.kind or 'grpc'} closed")
        request = _raw(request)
        self.requests.append((method, request))

        def fetch():
            reply = self.handler(method, request)
            if receiver is not None and isinstance(reply, (bytes, bytearray)):
                return receiver(_reader(reply), len(reply))
            return reply
        return Pending(fetch, lambda seconds: True, post, recover)

    def close(self) -> None:
        self.closed = True
