"""How one client's calls reach one parameter server: ``ServerChannel``.

The transports (psserver/transport.py: gRPC, and the socket the route
picked, the same-host Unix socket or the data port), the route
(psserver/routing.py: planned once from the server's GetServerInfo, again
after a socket breaks), and the one way every unary call is made:
``_invoke(wait, method, request)`` on the transport that carries the
method (psserver/methods.py), blocking or not (a ``Handle``); a socket that
breaks is dropped and the call handled as ``_over`` says. Tensors too big
for one message travel over gRPC's streams (``_upload``, ``_read_stream``).
Errors arrive as the typed errors of psserver.contract, mapped once by each
transport. PSClient (psserver/client.py) is the parameter-server API on
top; psserver/client_shm.py adds shared memory.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent import futures
from typing import Iterator, Sequence

import grpc
import numpy as np

from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
from psserver import tensor as T
from psserver import ipc, methods, routing, shm, wire
from psserver.methods import Method
from psserver.transport import GrpcTransport, Pending, SocketTransport
from psserver.tls import TLSConfig, make_channel
from psserver.contract import (DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES,
                               DEFAULT_STREAM_THRESHOLD_BYTES, MESSAGE_OVERHEAD, PSError,
                               TOKEN_ENV, Unavailable, call_metadata)
from psserver.errors import from_rpc_error
from psserver.server import grpc_options

from psserver.client_util import Handle, Snapshot, _set_sync_read

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0
#: Extra deadline per byte of a streamed transfer: 20 MB/s is far below any
#: link this runs on, so only a stuck transfer reaches it.
_STREAM_SECONDS_PER_BYTE = 1 / 20e6

# gRPC retries idempotent calls on UNAVAILABLE (start-up races, restarts).
_IDEMPOTENT = ["GetServerInfo", "GetMeta", "ListVariables", "Read", "ReadStream", "Gather",
               "AbandonStep"]
_SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": "pstrain.v1.ParameterServer", "method": m} for m in _IDEMPOTENT]
    + [{"service": "pstrain.v1.SharedMemory", "method": "Read"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "2s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
}]})

#: How long a client waits for the server's ServerInfo to plan its route.
_ASK_SECONDS = 5.0
#: The route while it is being learnt, or could not be: gRPC, asked again later.
_UNPLANNED = routing.Plan(why="not learnt yet: gRPC meanwhile")


class ServerChannel:
    """The connection of one client to one parameter server (see the module);
    its arguments are PSClient's."""

    def __init__(self, address: str, *, token: str | None = None,
                 tls: TLSConfig | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 stream_threshold_bytes: int = DEFAULT_STREAM_THRESHOLD_BYTES,
                 wait_for_ready: bool = False, bulk: bool = True,
                 shared_memory: bool = True,
                 data_port: bool = True):
        self.address = address
        # As ParameterServerStrategy and the tasks: no token given is the cluster's.
        token = token or os.environ.get(TOKEN_ENV) or None
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        # A frame must fit in one message, whatever the two options say.
        self.chunk_bytes = max(1, min(chunk_bytes, max_message_bytes))
        self.stream_threshold_bytes = max(
            0, min(stream_threshold_bytes, max_message_bytes - MESSAGE_OVERHEAD))
        self._wait_for_ready = wait_for_ready
        self._metadata = call_metadata(token)
        options = grpc_options(max_message_bytes) + [
            ("grpc.service_config", _SERVICE_CONFIG), ("grpc.enable_retries", 1)]
        self._channel = make_channel(address, options, tls)
        self.grpc = GrpcTransport(self._channel, address, self._metadata, wait_for_ready)
        self._stub = ps_pb2_grpc.ParameterServerStub(self._channel)   # its streams
        self.bulk = bulk
        self._arena: shm.Arena | None = None
        self._shm_lock = threading.Lock()   # makes the arena and the sockets once
        self._token = token
        self._tls = tls
        # The route to the server (psserver/routing.py), planned from its
        # ServerInfo on the first call that needs it, and its socket: the
        # same-host one (_ipc) or the data port (_data), a SocketTransport;
        # None: gRPC.
        self._same_host_ok = shared_memory and shm.available() and ipc.available()
        self._data_ok = data_port and ipc.data_available()
        self._plan: routing.Plan | None = None
        self._planning = False
        self._ask_after = 0.0   # a failed GetServerInfo is asked again after this (monotonic)
        self._ipc: SocketTransport | None = None
        self._data: SocketTransport | None = None
        # Variables this client reads straight from the server's memory
        # (psserver.shm.MappedValue; None: the server does not share it).
        self._direct_on = shared_memory and shm.direct_reads_available()
        self._direct: dict[str, shm.MappedValue | None] = {}
        # Known sizes (bytes, rows) by name: they pick unary calls or streams.
        self._nbytes: dict[str, int] = {}
        self._rows: dict[str, int] = {}

    @property
    def local(self) -> bool:
        """Whether calls go over a socket of psserver/ipc.py (the same-host one or
        the data port): then the ``*_async`` methods send at once and cost no thread."""
        return self._ipc is not None or self._data is not None

    @property
    def route(self) -> routing.Plan:
        """How calls reach the server (psserver/routing.py): ``socket`` "unix",
        "tcp" or "" (gRPC only), ``shm``, and ``why``. Asks the server once."""
        return self._route()

    def close(self) -> None:
        if self._arena is not None:
            if self._ipc is not None and not self._ipc.alive():
                self._arena.forget()   # its server is gone: no Detach to wait 2 s for each
            self._arena.close()
        for sock in (self._ipc, self._data):
            if sock is not None:
                sock.close()
        self._unmap(list(self._direct))
        self.grpc.close()

    def __enter__(self) -> "ServerChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the server answers (raises DeadlineExceeded after timeout)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            from psserver.errors import DeadlineExceeded
            raise DeadlineExceeded(f"parameter server {self.address} not ready after {timeout}s; "
                                   "is it running and is the address right?") from None

    def _kw(self, timeout: float | None = None, extra_bytes: int = 0) -> dict:
        """A stream's call options (its deadline grows with its bytes)."""
        t = self.timeout if timeout is None else timeout
        if t is not None and extra_bytes:
            t += extra_bytes * _STREAM_SECONDS_PER_BYTE
        return {"timeout": t, "metadata": self._metadata, "wait_for_ready": self._wait_for_ready}

    def _call(self, method: Method, request, timeout: float | None = None):
        """A blocking call over gRPC (control calls)."""
        return self.grpc.call(method, request, self.timeout if timeout is None else timeout)

    def _invoke(self, wait: bool, method: Method, request, post=lambda r: r, recover=None,
                receiver=None):
        """A unary call on the transport that carries it now: blocking (the
        value) or not (a Handle, sent now). ``post`` turns the reply into the
        value; ``recover(error)`` may answer an error instead; ``receiver``:
        over a socket, what takes the reply off it (IpcClient.send)."""
        if not wait:
            return Handle(self._send(method, request, receiver), post, self.address, recover)
        try:
            return post(self._make(method, request, receiver))
        except PSError as exc:
            if recover is None:
                raise
            return recover(exc)

    def _make(self, method: Method, request, receiver=None):
        """A blocking call on the transport that carries it."""
        sock = self._socket(method)
        if sock is None:
            return self.grpc.call(method, request, self.timeout)
        return self._over(sock, method, request, receiver).result()

    def _send(self, method: Method, request, receiver=None) -> Pending:
        """A call sent now on the transport that carries it."""
        sock = self._socket(method)
        if sock is None:
            return self.grpc.send(method, request, self.timeout)
        return self._over(sock, method, request, receiver)

    def _run(self, wait: bool, fn, *args):
        """Run fn(*args) now (blocking) or on the client's threads (a Handle)."""
        return fn(*args) if wait else self._thread(fn, *args)

    def _thread(self, fn, *args) -> Handle:
        """Run a streamed transfer on its own daemon thread (its cost is
        nothing next to the megabytes it moves, and nothing lingers)."""
        fut: futures.Future = futures.Future()

        def run():
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)
        threading.Thread(target=run, name="psclient-transfer", daemon=True).start()
        return Handle(fut, target=self.address)

    def _remember(self, name: str, nbytes: int, shape: Sequence[int]) -> None:
        self._nbytes[name] = nbytes
        self._rows[name] = shape[0] if len(shape) else 0

    def _fits_message(self, nbytes: int) -> bool:
        return nbytes <= self.max_message_bytes - MESSAGE_OVERHEAD

    def _tensor_limit(self, method: Method) -> int:
        """The most tensor bytes one call of ``method`` carries: a frame's worth
        on a socket (psserver/ipc.py), the stream threshold over gRPC (past
        it: a stream)."""
        if self._socket(method) is not None:
            return ipc.MAX_FRAME_BYTES - MESSAGE_OVERHEAD
        return self.stream_threshold_bytes

    def _fits(self, nbytes: int) -> bool:
        """Whether a tensor payload goes in one unary message (else a stream)."""
        return nbytes <= self.stream_threshold_bytes

    def _upload(self, kind: str, request, arrays: Sequence[np.ndarray],
                timeout: float | None = None) -> ps_pb2.UploadReply:
        """Send a request whose tensors are too big for one message, in frames."""
        total = sum(a.nbytes for a in arrays)

        def frames() -> Iterator[ps_pb2.UploadFrame]:
            yield ps_pb2.UploadFrame(**{kind: request})
            step = self.chunk_bytes
            for a in arrays:
                flat = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                for off in range(0, len(flat), step):
                    yield ps_pb2.UploadFrame(chunk=bytes(flat[off:off + step]))
        try:
            return self._stub.Upload(frames(), **self._kw(timeout, extra_bytes=total))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from exc

    def _read_stream(self, names: Sequence[str], sync_step: int | None = None,
                     value_dtype: str = "") -> list[Snapshot]:
        total = sum(self._nbytes.get(n, 0) for n in names)
        req = ps_pb2.ReadRequest(names=names, value_dtype=value_dtype)
        _set_sync_read(req, sync_step)
        try:
            frames = self._stub.ReadStream(req, **self._kw(extra_bytes=total))
            out: list[Snapshot] = []
            buf = fill = cur = None
            for f in frames:
                if f.HasField("value"):
                    v = f.value
                    dt, shape, n = T.spec(v.value)
                    buf = np.empty(n, np.uint8)
                    fill = len(v.value.data)
                    buf[:fill] = np.frombuffer(v.value.data, np.uint8)
                    cur = (v.name, v.version, dt, shape)
                else:
                    k = len(f.chunk)
                    buf[fill:fill + k] = np.frombuffer(f.chunk, np.uint8)
                    fill += k
                if fill == buf.size:
                    name, version, dt, shape = cur
                    out.append(Snapshot(name, version, buf.view(dt).reshape(shape)))
                    if not value_dtype:   # float16 values are not the variable's size
                        self._remember(name, buf.size, shape)
            return out
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from exc

    def _route(self) -> routing.Plan:
        """The plan to reach the server: asked once (GetServerInfo), then kept
        until a socket breaks. While one thread asks, the others use gRPC."""
        p = self._plan
        if p is not None:
            return p
        if not (self._same_host_ok or self._data_ok):
            self._plan = routing.Plan(why="sockets switched off here: gRPC")
            return self._plan
        with self._shm_lock:
            if self._plan is not None or self._planning or time.monotonic() < self._ask_after:
                return self._plan or _UNPLANNED
            self._planning = True
        try:
            return self._learn()
        finally:
            self._planning = False

    def _learn(self) -> routing.Plan:
        try:   # briefly, without waiting for a server that is down: gRPC meanwhile
            info = self.grpc.call(methods.SERVER_INFO, ps_pb2.ServerInfoRequest(),
                                  min(self.timeout or _ASK_SECONDS, _ASK_SECONDS))
        except PSError:   # asked again on a call a second from now
            self._ask_after = time.monotonic() + 1.0
            return _UNPLANNED
        offer = routing.offer_of(info.host)
        p = routing.plan(routing.this_host(), offer, same_host_ok=self._same_host_ok,
                         data_ok=self._data_ok)
        identity = f"{info.protocol_version}:{info.server_id}"
        sock = None
        if p.socket == routing.UNIX:
            sock = self._open(ipc.IpcClient(offer.ipc_socket, self._token, self.address,
                                            identity=identity), routing.UNIX)
            if sock is None:   # refused (another user's server?): the data port, if any
                p = routing.plan(routing.Host(), offer, data_ok=self._data_ok)
        if p.socket == routing.TCP:
            host = self.address.rsplit(":", 1)[0]
            try:
                ctx = self._tls.ssl_client_context() if self._tls is not None else None
                sock = self._open(ipc.IpcClient(
                    "", self._token, self.address, tcp=(host, offer.data_port),
                    ssl_context=ctx, identity=identity), routing.TCP)
            except (OSError, ValueError) as exc:   # a bad certificate file
                log.warning("cannot use the data port of %s (%s); using gRPC", self.address, exc)
        if sock is None and p.socket != routing.GRPC:
            p = routing.Plan(why=f"{p.why}, which could not be reached: gRPC")
        with self._shm_lock:
            if p.socket == routing.UNIX:
                self._ipc = sock
            elif p.socket == routing.TCP:
                self._data = sock
            self._plan = p
        log.debug("route to %s: %s (%s)", self.address, p.socket or "grpc", p.why)
        return p

    def _open(self, client: ipc.IpcClient, kind: str) -> SocketTransport | None:
        """A transport on client, connected; None when it cannot be (a
        firewall, a NetworkPolicy, a port mapping to another task, a refused
        token)."""
        try:
            client.connect()
            return SocketTransport(client, kind)
        except (OSError, PSError) as exc:
            log.warning("cannot use the %s of %s (%s); using gRPC",
                        "data port" if client.name == "" else "local socket", self.address, exc)
            client.close()
            return None

    def _socket(self, method: Method) -> SocketTransport | None:
        """The socket that carries ``method`` now (None: gRPC)."""
        if method.id is None:
            return None
        kind = routing.carries(self._route(), method.shm)
        return self._ipc if kind == routing.UNIX else self._data if kind == routing.TCP else None

    def _drop_socket(self, sock: SocketTransport) -> None:
        """A connection of ``sock`` broke: stop using it (a restarted server
        has another socket and data port, learnt again)."""
        with self._shm_lock:
            if self._ipc is sock:
                self._ipc, self._plan = None, None
            if self._data is sock:
                self._data, self._plan = None, None
        sock.close()

    def _over(self, sock: SocketTransport, method: Method, request, receiver=None) -> Pending:
        """``method`` sent over ``sock`` now, acting on its failures: a
        request that never reached the server goes over gRPC instead (safe:
        nothing ran) and the route is learnt again on the next call; a
        connection lost under a sent call drops the socket and the route (a
        restarted server has others), then an idempotent call is made again
        over gRPC and any other raises Unavailable, as it would over gRPC
        (applied or not: see update_id)."""
        def lost(exc: Unavailable):
            self._drop_socket(sock)
            if method not in methods.IDEMPOTENT:
                raise exc
            return self.grpc.call(method, request, self.timeout)
        try:
            pending = sock.send(method, request, self.timeout, receiver)
        except PSError as exc:
            # joined now, while the caller's arrays are as they were (wire.Scattered)
            request = wire.joined(request)
            if getattr(exc, "not_sent", False):
                self._drop_socket(sock)
                return Pending(lambda: self.grpc.call(method, request, self.timeout))
            if not isinstance(exc, Unavailable):
                raise
            failed = exc
            return Pending(lambda: lost(failed))

        def finish():
            try:
                return pending.result()
            except Unavailable as exc:
                return lost(exc)
        return Pending(finish, pending.done)
