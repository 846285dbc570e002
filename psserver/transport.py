"""One way to make a unary call to a task: ``Transport``.

A transport makes any call of psserver/methods.py it carries, blocking
(``call(method, request, timeout) -> reply``) or not (``send(...) ->
Pending``: sent now, its reply read by ``result()``), and raises the typed
errors of psserver.contract: each transport maps its errors once, here.

- ``GrpcTransport``: every Method, over a gRPC channel (TLS and token as the
  channel has them).
- ``SocketTransport``: the Methods with a socket id, over an IpcClient
  (psserver/ipc.py): the same-host Unix socket or the TCP data port (TLS and
  token). Shared memory is not a transport of its own: its calls
  (methods.SHM_READ, SHM_PUSH) carry segment ids over the Unix socket
  transport (psserver/client_shm.py).

Which transport carries a call is decided by psserver/routing.py
(``routing.carries``), acted on by psserver/channel.py (parameter servers)
and coordinator/worker_channel.py (workers).
"""
from __future__ import annotations

import threading
from typing import Callable

import grpc

from psserver import routing, wire
from psserver.errors import Internal, Unavailable, from_rpc_error
from psserver.ipc import IpcClient
from psserver.methods import Method


class Pending:
    """A call sent, its reply not read yet: ``result()`` reads it (once,
    thread-safe) and returns it or raises its error; ``done()`` says whether
    it is there to read."""

    def __init__(self, fn: Callable[[], object], ready: Callable[[], bool] | None = None):
        self._fn, self._done, self._value, self._exc = fn, False, None, None
        self._ready = ready
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._done or (self._ready is not None and self._ready())

    def result(self, timeout: float | None = None):
        with self._lock:
            if not self._done:
                try:
                    self._value = self._fn()
                except BaseException as exc:
                    self._exc = exc
                self._done, self._fn = True, None
        if self._exc is not None:
            raise self._exc
        return self._value


class Transport:
    """What every transport offers (see the module)."""

    kind = ""   # routing.GRPC, UNIX or TCP

    def send(self, method: Method, request, timeout: float | None) -> Pending:
        """(A socket's send also takes ``receiver``: SocketTransport.send.)"""
        raise NotImplementedError

    def call(self, method: Method, request, timeout: float | None):
        return self.send(method, request, timeout).result()

    def close(self) -> None:
        pass


class GrpcTransport(Transport):
    """Every Method over ``channel``; ``metadata`` (the token) and
    ``wait_for_ready`` go with each call. A request given as bytes (framed
    by hand, psserver/wire.py) is sent as it is; a Method whose reply class
    is None returns the reply's bytes."""

    kind = routing.GRPC

    def __init__(self, channel: grpc.Channel, target: str, metadata: tuple = (),
                 wait_for_ready: bool = False):
        self.channel, self.target = channel, target
        self.metadata, self.wait_for_ready = metadata, wait_for_ready
        self._callables: dict[tuple, grpc.UnaryUnaryMultiCallable] = {}
        self._closed = False

    def _callable(self, m: Method, request) -> tuple[grpc.UnaryUnaryMultiCallable, object]:
        """The multi-callable for m and the request as it takes it."""
        if isinstance(request, memoryview):   # framed into a socket's buffer (a resend)
            request = request.tobytes()
        elif isinstance(request, wire.Scattered):   # framed for a socket's sendmsg (a resend)
            request = wire.joined(request)
        raw = m.request is None or isinstance(request, (bytes, bytearray))   # framed by hand
        c = self._callables.get((m.path, raw))
        if c is None:
            c = self._callables[(m.path, raw)] = self.channel.unary_unary(
                m.path, request_serializer=None if raw else m.request.SerializeToString,
                response_deserializer=None if m.reply is None else m.reply.FromString)
        return c, request

    def call(self, method: Method, request, timeout: float | None):
        # Blocking calls go straight to the stub: through a future they would
        # cost a thread start each (1 KiB read p50 790 us against 520 us).
        try:
            c, request = self._callable(method, request)
            return c(request, timeout=timeout, metadata=self.metadata,
                     wait_for_ready=self.wait_for_ready)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.target) from exc
        except ValueError as exc:
            raise self._closed_error(exc) from None

    def send(self, method: Method, request, timeout: float | None) -> Pending:
        try:
            c, request = self._callable(method, request)
            fut = c.future(request, timeout=timeout, metadata=self.metadata,
                           wait_for_ready=self.wait_for_ready)
        except ValueError as exc:
            raise self._closed_error(exc) from None

        def result():
            try:
                return fut.result()
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, self.target) from exc
        return Pending(result, fut.done)

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
    """The Methods with a socket id over ``client`` (the task's Unix socket,
    kind UNIX, or its data port, TCP). ``send`` raises at once when the
    request could not be sent (a PSError with ``not_sent``: the server ran
    nothing; psserver/ipc.py), else the reply's error from ``result()``."""

    def __init__(self, client: IpcClient, kind: str):
        self.client, self.kind = client, kind

    def send(self, method: Method, request, timeout: float | None, receiver=None) -> Pending:
        """``receiver``: for a method framed by hand (reply None), takes the
        reply off the socket itself (IpcClient.send)."""
        if method.id is None:
            raise ValueError(f"{method.path} is not a socket call (psserver/methods.py)")
        payload = request if isinstance(request, (bytes, bytearray, memoryview, wire.Scattered)) \
            else request.SerializeToString()
        receive = self.client.send(method.id, payload, timeout,
                                   receiver if method.reply is None else None)
        if method.reply is None:
            return Pending(receive, receive.ready)
        parse = method.reply.FromString
        return Pending(lambda: parse(receive()), receive.ready)

    def alive(self) -> bool:
        return self.client.alive()

    def close(self) -> None:
        self.client.close()

    def abort(self) -> None:
        self.client.abort()
