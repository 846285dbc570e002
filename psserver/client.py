"""PSClient: the Python client of one parameter-server task.

Workers and the coordinator reach every parameter server through this class.
Every method raises a subclass of ``psserver.errors.PSError`` on failure
(``InvalidArgument``, ``NotFound``, ``AlreadyExists``, ``ResourceExhausted``,
``Unauthenticated``, ``Unavailable``, ``DeadlineExceeded``...), carrying the
server's message. Nothing waits forever: every call has a deadline
(``timeout``, default 60 s; streamed transfers get extra time per byte).

Delivery: reads, gathers and metadata calls are retried by gRPC on
UNAVAILABLE (they are idempotent). Pushes and assigns are sent at most once
by this client: an ``Unavailable`` error means the update may or may not have
been applied.

Non-blocking use: the ``*_async`` methods return a ``Handle`` at once; its
``result()`` blocks for the value (or raises), as ps-lite's ``Wait(ts)``.

Tensors larger than one message (``max_message_bytes``, 64 MiB by default)
travel in frames over a stream; callers never see the difference.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
from concurrent import futures
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import grpc
import numpy as np

from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
from psserver import replication as R
from psserver import tensor as T
from psserver import ipc, methods, routing, shm, wire
from psserver.tls import TLSConfig, make_channel
from psserver.contract import (DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES,
                               DEFAULT_STREAM_THRESHOLD_BYTES, MESSAGE_OVERHEAD, Code,
                               Initializer, InvalidArgument, PSError, SyncSpec, Unavailable,
                               VariableMeta, call_metadata)
from psserver.errors import from_rpc_error
from psserver.server import grpc_options

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0
#: The most variables one client maps for direct reads (each map holds a file
#: descriptor); further ones are read through their server.
MAX_MAPPED = 256
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


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A variable's value as read, with the version it belongs to."""
    name: str
    version: int
    value: np.ndarray


def _meta_from_proto(m: ps_pb2.VariableMeta) -> VariableMeta:
    backup = R.Peer(m.backup.address, m.backup.name) if m.HasField("backup") else None
    return VariableMeta(m.name, m.dtype, tuple(m.shape), m.version, m.optimizer.name,
                        dict(m.optimizer.params), m.nbytes, m.slot_nbytes, m.allow_nonfinite,
                        m.sync_steps, m.dropped_gradients, int(m.role), m.epoch, backup)


def _set_sync_read(req, sync_step: int | None) -> None:
    if sync_step is not None:
        req.sync.step = sync_step


def _set_sync(req, sync: SyncSpec | None) -> None:
    if sync is not None:
        req.sync.CopyFrom(ps_pb2.SyncInfo(**dataclasses.asdict(sync)))


#: Codes a server answers with once it is done with a call's segment (any
#: other error may have come while it was still using it).
_SERVER_DONE = frozenset({
    Code.INVALID_ARGUMENT, Code.NOT_FOUND,
    Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION,
    Code.RESOURCE_EXHAUSTED, Code.UNAUTHENTICATED,
    Code.UNIMPLEMENTED, Code.OUT_OF_RANGE,
    Code.PERMISSION_DENIED})


#: The route while it is being learnt, or could not be: gRPC, asked again later.
_UNPLANNED = routing.Plan(why="not learnt yet: gRPC meanwhile")


class _Later:
    """A future whose value is computed by the first result() call (a reply
    read from a socket the request was sent on earlier). Thread-safe: the
    reply is read once."""

    def __init__(self, fn: Callable[[], object], ready: Callable[[], bool] | None = None):
        self._fn, self._done, self._value, self._exc = fn, False, None, None
        self._ready = ready   # whether the reply is there to read
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


class Handle:
    """The pending result of a non-blocking call."""

    def __init__(self, fut, post: Callable = lambda r: r, target: str = "",
                 recover: Callable[[PSError], object] | None = None):
        self._fut, self._post, self._target = fut, post, target
        self._recover = recover   # may turn an error into a result, or re-raise

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None):
        """Block until the call finishes; return its value or raise its PSError."""
        try:
            try:
                return self._post(self._fut.result(timeout))
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, self._target) from exc
        except PSError as exc:
            if self._recover is None:
                raise
            return self._recover(exc)

    wait = result


class PSClient:
    """Client of the parameter server at ``address`` ("host:port").

    Args:
      token: the cluster's auth token, sent on every call (None: no token).
      tls: a TLSConfig to connect with TLS (its CA to trust the server; its
        certificate and key for mutual TLS). None: plaintext.
      timeout: deadline in seconds of each call (None: no deadline).
      max_message_bytes: must match the server's; no message is larger.
      chunk_bytes: frame size of streamed uploads.
      stream_threshold_bytes: tensors above this size travel over streams
        even when they would fit one message (streams are faster for them).
      bulk: read and push through ParameterServerBulk (hand-framed messages,
        one copy of the tensor data per side; psserver/wire.py), falling back
        to the generated path on a server without it.
      wait_for_ready: queue calls until the server is up instead of failing
        with UNAVAILABLE at once (useful while a cluster starts).
      shared_memory: use the server's same-host socket and shared memory
        (psserver/ipc.py, psserver/shm.py) where its route allows
        (psserver/routing.py: same host and network namespace; segments
        also need the same pid namespace and user). ``PSTRAIN_SHM=0`` turns
        it off: the client then plans as if on another host.
      data_port: otherwise make reads, pushes, lookups and sparse pushes
        over the server's data port (psserver/ipc.py over TCP, with this
        client's TLS and token); ``PSTRAIN_DATA=0`` turns it off. False:
        gRPC only.

    The route is planned once, from the server's GetServerInfo (no call is
    made to find it out), and again after a socket breaks; ``route`` tells
    what it is.
    """

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
        self._stub = ps_pb2_grpc.ParameterServerStub(self._channel)
        self.bulk = bulk
        self._bulk_read = self._channel.unary_unary(   # reply bytes kept as they came
            "/pstrain.v1.ParameterServerBulk/Read",
            request_serializer=ps_pb2.ReadRequest.SerializeToString)
        self._bulk_push = self._channel.unary_unary(   # request bytes framed by hand
            "/pstrain.v1.ParameterServerBulk/Push",
            response_deserializer=ps_pb2.UpdateReply.FromString)
        self._replicate_raw = self._channel.unary_unary(   # request bytes framed by hand
            "/pstrain.v1.ParameterServer/Replicate",
            response_deserializer=ps_pb2.ReplicateReply.FromString)
        self._shm_stub = ps_pb2_grpc.SharedMemoryStub(self._channel)
        self._idempotent = (self._shm_stub.Read, self._stub.Gather, self._bulk_read)
        self._arena: shm.Arena | None = None
        self._shm_lock = threading.Lock()   # makes the arena and the sockets once
        self._token = token
        self._tls = tls
        # The route to the server (psserver/routing.py), planned from its
        # ServerInfo on the first call that needs it, and its socket: the
        # same-host one (_ipc) or the data port (_data); None: gRPC.
        self._same_host_ok = shared_memory and shm.available() and ipc.available()
        self._data_ok = data_port and ipc.data_available()
        self._plan: routing.Plan | None = None
        self._planning = False
        self._ipc: ipc.IpcClient | None = None
        self._data: ipc.IpcClient | None = None
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

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
        for sock in (self._ipc, self._data):
            if sock is not None:
                sock.close()
        self._unmap(list(self._direct))
        self._channel.close()

    def __enter__(self) -> "PSClient":
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

    # -- plumbing ------------------------------------------------------------
    def _kw(self, timeout: float | None = None, extra_bytes: int = 0) -> dict:
        t = self.timeout if timeout is None else timeout
        if t is not None and extra_bytes:
            t += extra_bytes * _STREAM_SECONDS_PER_BYTE
        return {"timeout": t, "metadata": self._metadata, "wait_for_ready": self._wait_for_ready}

    def _call(self, method, request, **kw):
        try:
            return method(request, **self._kw(**kw))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from exc

    def _future(self, method, request, post, recover=None, **kw) -> Handle:
        return Handle(method.future(request, **self._kw(**kw)), post, self.address, recover)

    def _invoke(self, wait: bool, method, request, post=lambda r: r, recover=None,
                local: "methods.Method | None" = None):
        """A unary call: blocking (the value) or not (a Handle).

        The blocking form calls the stub directly: going through a future
        costs a thread start per call (measured: 1 KiB read p50 790 us via
        .future().result() against 520 us direct). ``local``: (ipc method,
        reply class) to make a blocking call over the same-host socket
        when there is one (psserver/ipc.py).
        """
        if not wait:
            if local is not None and self._socket(local) is not None:   # sent now, read
                receive = self._local_send(local, request, method)           # in result()
                return Handle(_Later(receive, getattr(receive, "ready", None)),
                              post, self.address, recover)
            return self._future(method, request, post, recover)
        try:
            if local is not None and self._socket(local) is not None:
                return post(self._local(local, request, method))
            return post(self._call(method, request))
        except PSError as exc:
            if recover is None:
                raise
            return recover(exc)

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

    def _fits(self, nbytes: int) -> bool:
        """Whether a tensor payload goes in one unary message (else a stream)."""
        return nbytes <= self.stream_threshold_bytes

    def _upload(self, kind: str, request, arrays: Sequence[np.ndarray],
                **kw) -> ps_pb2.UploadReply:
        """Send a request whose tensors are too big for one message, in frames."""
        total = sum(a.nbytes for a in arrays)

        def frames() -> Iterator[ps_pb2.UploadFrame]:
            yield ps_pb2.UploadFrame(**{kind: request})
            step = self.chunk_bytes
            for a in arrays:
                flat = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                for off in range(0, len(flat), step):
                    yield ps_pb2.UploadFrame(chunk=bytes(flat[off:off + step]))
        return self._call(self._stub.Upload, frames(), extra_bytes=total, **kw)

    # -- info ----------------------------------------------------------------
    def server_info(self) -> ps_pb2.ServerInfo:
        return self._call(self._stub.GetServerInfo, ps_pb2.ServerInfoRequest())

    def get_meta(self, name: str, timeout: float | None = None) -> VariableMeta:
        m = _meta_from_proto(self._call(self._stub.GetMeta, ps_pb2.VariableRef(name=name),
                                        timeout=timeout))
        self._remember(name, m.nbytes, m.shape)
        return m

    def list_variables(self) -> list[VariableMeta]:
        reply = self._call(self._stub.ListVariables, ps_pb2.ListRequest())
        return [_meta_from_proto(m) for m in reply.variables]

    # -- create / delete -----------------------------------------------------
    def create_variable(self, name: str, shape: Sequence[int] | None = None,
                        dtype: str | np.dtype | None = None, *,
                        initial_value: np.ndarray | None = None,
                        initializer: Initializer | str | None = None,
                        optimizer: str = "sgd",
                        optimizer_params: Mapping[str, float] | None = None,
                        allow_nonfinite: bool = False,
                        exist_ok: bool = False,
                        slots: Mapping[str, np.ndarray] | None = None,
                        version: int = 0,
                        overwrite: bool = False,
                        applied_ids=(),
                        sync_steps: int = 0,
                        role: int = 0,
                        epoch: int = 0,
                        backup: "R.Peer | None" = None,
                        timeout: float | None = None) -> VariableMeta:
        """Create a variable on this server and return its metadata.

        Give either ``initial_value`` (shape and dtype then default to its
        own; dtype otherwise defaults to float32) or an ``initializer`` (an Initializer, or a kind name such as
        "zeros"); with neither the variable starts at zeros.
        Restoring: ``slots`` (every optimizer slot, by name), ``version``, and
        ``overwrite`` to replace an existing variable's state at once.
        Replication (psserver.replication): ``backup`` (a Peer) makes a
        primary that copies its state there before answering; ``role``,
        ``epoch`` and ``sync_steps`` are set by a primary copying its state.
        Raises InvalidArgument, AlreadyExists, ResourceExhausted.
        """
        req = ps_pb2.CreateVariableRequest(
            name=name, allow_nonfinite=allow_nonfinite, exist_ok=exist_ok,
            version=version, overwrite=overwrite, sync_steps=sync_steps, role=role,
            epoch=epoch,
            applied_ids=[int(i) for i in np.asarray(applied_ids, np.uint64).ravel()],
            optimizer=ps_pb2.OptimizerSpec(name=optimizer, params=dict(optimizer_params or {})))
        arrays = []
        if initial_value is not None:
            if initializer is not None:
                raise InvalidArgument("give initial_value or initializer, not both")
            arr = np.asarray(initial_value)
            if dtype is None:
                dtype = arr.dtype if arr.dtype.kind == "f" else np.float32
            arr = arr.astype(np.dtype(dtype), copy=False)
            if shape is None:
                shape = arr.shape
            arrays = [arr]
        if shape is None:
            raise InvalidArgument(f"create_variable({name!r}) needs a shape or an initial_value")
        dtype = "float32" if dtype is None else dtype
        req.dtype = np.dtype(dtype).name
        req.shape[:] = [int(d) for d in shape]
        if initializer is not None:
            init = Initializer(initializer) if isinstance(initializer, str) else initializer
            req.initializer.CopyFrom(ps_pb2.Initializer(**dataclasses.asdict(init)))
        if backup is not None:
            req.backup.CopyFrom(ps_pb2.ReplicaPeer(address=backup.address, name=backup.name))
        slot_items = [(k, np.asarray(v)) for k, v in (slots or {}).items()]
        tensors = arrays + [v for _, v in slot_items]
        streamed = not self._fits(sum(a.nbytes for a in tensors))
        if arrays:
            T.fill(req.initial_value, arrays[0], with_data=not streamed)
        for k, v in slot_items:
            T.fill(req.slots.add(name=k).tensor, v, with_data=not streamed)
        kw = {} if timeout is None else {"timeout": timeout}
        if streamed:
            meta = self._upload("create", req, tensors, **kw).created
        else:
            meta = self._call(self._stub.CreateVariable, req, **kw)
        m = _meta_from_proto(meta)
        self._remember(name, m.nbytes, m.shape)
        return m

    def delete_variable(self, name: str) -> None:
        self._call(self._stub.DeleteVariable, ps_pb2.VariableRef(name=name))
        self._nbytes.pop(name, None)
        self._rows.pop(name, None)

    # -- reads ---------------------------------------------------------------
    def _read_stream(self, names: Sequence[str], sync_step: int | None = None) -> list[Snapshot]:
        total = sum(self._nbytes.get(n, 0) for n in names)
        req = ps_pb2.ReadRequest(names=names)
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
                    self._remember(name, buf.size, shape)
            return out
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from exc

    def _snapshots(self, values) -> list[Snapshot]:
        """Snapshots of (name, version, array), remembering each size."""
        out = []
        for name, version, arr in values:
            self._remember(name, arr.nbytes, arr.shape)
            out.append(Snapshot(name, version, arr))
        return out

    def _read_unary_post(self, reply: ps_pb2.ReadReply) -> list[Snapshot]:
        return self._snapshots((v.name, v.version, T.decode(v.value)) for v in reply.values)

    def _read_many(self, names: Sequence[str], wait: bool, sync_step: int | None = None,
                   out: Sequence[np.ndarray | None] | None = None):
        names = list(names)
        if sync_step is None and self._direct_ok():
            got = self._direct_read(names, out)
            if got is not None:
                return got if wait else Handle(_Later(lambda: got), target=self.address)
        known = [self._nbytes.get(n) for n in names]
        if None not in known and self._shm_for(sum(known)):
            return self._shm_read(names, known, wait, sync_step, out=out)
        if out is not None:   # the other paths fill it from what they return
            got = self._read_many(names, wait, sync_step)
            if wait:
                return _fill(got, out)
            return Handle(_Later(lambda: _fill(got.result(), out), got.done), target=self.address)
        if None not in known and not self._fits(sum(known)):
            return self._run(wait, self._read_stream, names, sync_step)

        bulk = self.bulk

        def recover(exc: PSError):   # larger than a unary read should carry: stream it
            if exc.code == Code.RESOURCE_EXHAUSTED:
                return self._read_stream(names, sync_step)
            if bulk and exc.code == Code.UNIMPLEMENTED:   # an older server
                self.bulk = False
                return self._read_many(names, True, sync_step)
            raise exc
        req = ps_pb2.ReadRequest(names=names, max_bytes=max(1, self.stream_threshold_bytes))
        _set_sync_read(req, sync_step)
        if bulk:
            return self._invoke(wait, self._bulk_read, req, self._read_bulk_post, recover,
                                local=methods.BULK_READ)
        return self._invoke(wait, self._stub.Read, req, self._read_unary_post, recover)

    # -- reads straight from the server's memory (same host, asynchronous) ---------------
    def _direct_read(self, names: list[str], out) -> list[Snapshot] | None:
        """Snapshots copied from the server's shared values (psserver.shm: a
        seqlock, no call), or None: read through the server instead (a name
        not shared, one dead or always being written, or the server gone)."""
        ipc_client = self._ipc
        if ipc_client is None or not ipc_client.alive():
            self._unmap(list(self._direct))   # its memory is a dead process's now
            return None
        missing = [n for n in names if n not in self._direct]
        if missing:
            self._map(missing)
        snaps = []
        for i, name in enumerate(names):
            mapped = self._direct.get(name)
            if mapped is None:
                return None
            try:
                dest = _dest(out, i, mapped.value)
                got = mapped.read_into(dest)
            except (TypeError, AttributeError, ValueError):   # closed by another thread
                return None
            if not got:   # deleted (re-created?), or never still: ask the server
                if got is False:
                    self._unmap([name])
                return None
            version, arr = got
            if dest is None:
                arr.flags.writeable = False
            snaps.append((name, version, arr))
        return self._snapshots(snaps)

    def _map(self, names: list[str]) -> None:
        reply = self._call(self._shm_stub.Share, ps_pb2.ShmShareRequest(names=names))
        for v in reply.variables:
            mapped = None
            if v.path and sum(m is not None for m in self._direct.values()) < MAX_MAPPED:
                try:
                    mapped = shm.MappedValue(v.path, v.dtype, list(v.shape), v.nbytes, v.tag)
                except OSError:   # not ours to open (another user, another pid namespace)
                    mapped = None
            with self._shm_lock:
                old = self._direct.get(v.name)
                self._direct[v.name] = mapped
            if old is not None:
                old.close()

    def _unmap(self, names: list[str]) -> None:
        with self._shm_lock:
            gone = [self._direct.pop(n, None) for n in names]
        for m in gone:
            if m is not None:
                m.close()

    # -- the route (psserver/routing.py) -------------------------------------------------
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
            if self._plan is not None or self._planning:
                return self._plan or _UNPLANNED
            self._planning = True
        try:
            return self._learn()
        finally:
            self._planning = False

    def _learn(self) -> routing.Plan:
        try:
            info = self._call(self._stub.GetServerInfo, ps_pb2.ServerInfoRequest())
        except PSError:   # asked again on a later call
            return _UNPLANNED
        offer = routing.offer_of(info.host)
        p = routing.plan(routing.this_host(), offer, same_host_ok=self._same_host_ok,
                         data_ok=self._data_ok)
        identity = f"{info.protocol_version}:{info.server_id}"
        sock = None
        if p.socket == routing.UNIX:
            sock = self._open(ipc.IpcClient(offer.ipc_socket, self._token, self.address,
                                            identity=identity))
            if sock is None:   # refused (another user's server?): the data port, if any
                p = routing.plan(routing.Host(), offer, data_ok=self._data_ok)
        if p.socket == routing.TCP:
            host = self.address.rsplit(":", 1)[0]
            try:
                ctx = self._tls.ssl_client_context() if self._tls is not None else None
                sock = self._open(ipc.IpcClient(
                    "", self._token, self.address, tcp=(host, offer.data_port),
                    ssl_context=ctx, identity=identity))
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

    def _open(self, client: ipc.IpcClient) -> ipc.IpcClient | None:
        """client, connected; None when it cannot be (a firewall, a
        NetworkPolicy, a port mapping to another task, a refused token)."""
        try:
            client.connect()
            return client
        except (OSError, PSError) as exc:
            log.warning("cannot use the %s of %s (%s); using gRPC",
                        "data port" if client.name == "" else "local socket", self.address, exc)
            client.close()
            return None

    def _direct_ok(self) -> bool:
        """Whether reads may copy straight from the server's memory (same host)."""
        return self._direct_on and self._ipc is not None and self._route().shm

    def _socket(self, method: methods.Method) -> ipc.IpcClient | None:
        """The socket that carries ``method`` now (None: gRPC)."""
        kind = routing.carries(self._route(), method.shm)
        return self._ipc if kind == routing.UNIX else self._data if kind == routing.TCP else None

    # -- shared memory (same host) ------------------------------------------------------
    def _shm_for(self, nbytes: int) -> bool:
        """Whether a read or push goes through shared memory (then the
        same-host socket carries it, whatever its size)."""
        return self._route().shm

    def _shm_take(self, nbytes: int) -> shm.Segment | None:
        """A segment of nbytes or more, or None: use gRPC (turned off for good when
        the server does not take segments after all)."""
        if self._arena is None:
            with self._shm_lock:
                if self._arena is None:
                    self._arena = shm.Arena(self._shm_attach, self._shm_detach)
        try:
            return self._arena.take(nbytes)
        except PSError as exc:
            if exc.code in (Code.FAILED_PRECONDITION, Code.UNIMPLEMENTED):
                log.warning("parameter server %s takes no shared memory from this process "
                            "(%s); sending tensor bytes over its socket", self.address, exc)
                self._no_shm()
                return None
            raise
        except OSError:   # no memory for a segment: this transfer goes over gRPC
            return None

    def _no_shm(self) -> None:
        with self._shm_lock:
            if self._plan is not None:
                self._plan = dataclasses.replace(self._plan, shm=False)

    def _shm_attach(self, seg: shm.Segment) -> int:
        return self._call(self._shm_stub.Attach, ps_pb2.ShmAttachRequest(
            name=seg.name, nbytes=seg.nbytes, pid=seg.pid, fd=seg.fd)).segment

    def _drop_socket(self, client: ipc.IpcClient) -> None:
        """A connection of ``client`` broke: stop using it (a restarted server
        has another socket and data port, learnt again)."""
        with self._shm_lock:
            if self._ipc is client:
                self._ipc, self._plan = None, None
            if self._data is client:
                self._data, self._plan = None, None
        client.close()

    def _local(self, local: methods.Method, request, via):
        """A blocking call over a socket: see _local_send."""
        return self._local_send(local, request, via)()

    def _local_send(self, local: methods.Method, request, via) -> Callable[[], object]:
        """Send a call over the same-host socket now; the function returned
        waits for its reply. ``via`` is the gRPC stub method of the same call:
        used when the socket is gone already. A lost connection drops the
        socket and the route (a restarted server has others, planned again
        on the next call); then an idempotent call (read, gather) is made
        again over gRPC, any other raises Unavailable, as it would over gRPC
        (applied or not: see update_id)."""
        client = self._socket(local)
        if client is None:   # dropped by another thread meanwhile
            return lambda: self._call(via, request)

        def lost(exc: Unavailable):
            self._drop_socket(client)
            if via not in self._idempotent:
                raise exc
            return self._call(via, request)
        payload = request if isinstance(request, (bytes, bytearray)) else \
            request.SerializeToString()
        try:
            receive = client.send(local.id, payload, self.timeout)
        except PSError as exc:
            if getattr(exc, "not_sent", False):   # never reached the server: gRPC is safe
                self._drop_socket(client)          # (and the socket is learnt again)
                return lambda: self._call(via, request)
            if not isinstance(exc, Unavailable):
                raise
            failed = exc
            return lambda: lost(failed)

        def finish():
            try:
                body = receive()
            except Unavailable as exc:
                return lost(exc)
            return body if local.reply is None else local.reply.FromString(body)
        finish.ready = receive.ready
        return finish

    def _shm_detach(self, seg_id: int) -> None:
        self._shm_stub.Detach(ps_pb2.ShmDetachRequest(segment=seg_id), timeout=2.0,
                              metadata=self._metadata)

    def _shm_invoke(self, wait: bool, method, req, seg: shm.Segment, finish, fallback,
                    local: methods.Method):
        """A SharedMemory call using ``seg``: finish(reply) turns the reply into the
        result before the segment goes back; fallback(exc) answers an error that
        says the server lost the segment (by redoing the call over gRPC)."""
        def on_error(exc: PSError):
            lost = exc.code == Code.FAILED_PRECONDITION and \
                shm.UNKNOWN_SEGMENT in str(exc)
            # After a timeout or a lost connection the server may still be
            # using the segment: it is never lent again (not detached either:
            # a late call still finds its data; the server closes it when idle).
            uncertain = exc.code not in _SERVER_DONE
            self._arena.give(seg, broken=lost or uncertain)
            if lost:
                self._arena.forget()   # the server restarted or expired them: attach anew
                return fallback(exc)
            if exc.code == Code.UNIMPLEMENTED:
                self._no_shm()
                return fallback(exc)
            if exc.code == Code.RESOURCE_EXHAUSTED and shm.TOO_SMALL in str(exc):
                return fallback(exc)
            raise exc

        def done(reply):
            try:
                return finish(reply)
            finally:
                self._arena.give(seg)
        if wait:
            try:
                if self._ipc is not None:
                    reply = self._local(local, req, method)
                else:
                    reply = self._call(method, req)
            except PSError as exc:
                return on_error(exc)
            return done(reply)
        if self._ipc is not None:   # sent now, its reply read in result()
            receive = self._local_send(local, req, method)
            return Handle(_Later(lambda: done(receive()), getattr(receive, "ready", None)),
                          target=self.address, recover=on_error)
        out: futures.Future = futures.Future()

        def complete(f):
            try:
                out.set_result(done(f.result()))
            except grpc.RpcError as exc:
                out.set_exception(from_rpc_error(exc, self.address))
            except BaseException as exc:
                out.set_exception(exc)
        method.future(req, **self._kw()).add_done_callback(complete)
        return Handle(out, target=self.address, recover=on_error)

    def _shm_read(self, names: list[str], known: list[int], wait: bool, sync_step: int | None,
                  gathers: Sequence[tuple[str, np.ndarray]] | None = None,
                  out: Sequence[np.ndarray | None] | None = None):
        """Read ``names`` (their sizes ``known``) through a segment: a list of
        Snapshot (values copied into ``out``'s arrays where given); with
        ``gathers`` ([(name, 1-D ids)], row sizes known too), (snapshots,
        [(rows, version)]) from the same call."""
        gathers = list(gathers or ())
        out_offset = sum(shm.align(ids.nbytes) for _, ids in gathers)
        need = out_offset + sum(shm.align(n) for n in known) + sum(
            shm.align(ids.size * self._row_bytes(name)) for name, ids in gathers)

        def fallback(exc: PSError | None = None):   # over gRPC, relearning the sizes
            self._forget_sizes(names)
            snaps = self._read_many(names, True, sync_step, out) if names else []
            if not gathers:
                return snaps
            return snaps, [self._gather(name, ids, True, sync_step, use_shm=False)
                           for name, ids in gathers]
        seg = self._shm_take(need)
        if seg is None:
            return self._run(wait, fallback)
        req = ps_pb2.ShmReadRequest(segment=seg.seg_id, names=names, out_offset=out_offset)
        _set_sync_read(req, sync_step)
        off = 0
        for name, ids in gathers:
            seg.array[off:off + ids.nbytes] = ids.view(np.uint8)
            req.gathers.add(name=name, ids=ps_pb2.ShmTensor(
                dtype=T.dtype_name(ids.dtype), shape=ids.shape, offset=off))
            off += shm.align(ids.nbytes)

        def copy_out(t: ps_pb2.ShmTensor, i: int | None = None) -> np.ndarray:
            """t's array copied out of the segment (into out[i] when it fits)."""
            dt, shape, n = T.spec(t, T.WIRE_DTYPES, f"value of {t.name!r}")
            src = np.frombuffer(seg.array, dtype=dt, count=n // dt.itemsize,
                                offset=t.offset).reshape(shape)
            dest = _dest(out, i, src) if i is not None else None
            if dest is not None:
                np.copyto(dest, src)
                return dest
            arr = src.copy()
            arr.flags.writeable = False
            return arr

        def finish(reply: ps_pb2.ShmReadReply):
            snaps = self._snapshots([
                (v.name, v.version, copy_out(v, i))
                for i, v in enumerate(reply.values)])
            if not gathers:
                return snaps
            return snaps, [(copy_out(g), g.version) for g in reply.gathered]
        return self._shm_invoke(wait, self._shm_stub.Read, req, seg, finish, fallback,
                                methods.SHM_READ)

    def _row_bytes(self, name: str) -> int:
        """Bytes of one row of ``name`` (asks the server the first time)."""
        if name not in self._nbytes or not self._rows.get(name):
            self._learn_size(name)
        rows = self._rows.get(name) or 1
        return self._nbytes[name] // rows

    def _learn_size(self, name: str) -> None:
        meta = self.get_meta(name)
        self._remember(name, meta.nbytes, meta.shape)

    def _forget_sizes(self, names: Sequence[str]) -> None:
        for n in names:
            self._nbytes.pop(n, None)

    def _shm_push(self, items, arrays, uids, wait: bool, sync: SyncSpec | None, fallback,
                  sparse: Sequence[tuple[str, np.ndarray, np.ndarray, int]] = ()):
        """Dense updates (and, async only, sparse ones) through a segment; None
        when there is no segment to be had (the caller uses gRPC)."""
        datas = [wire._contiguous_bytes(a) for a in arrays]
        sparse_datas = [(wire._contiguous_bytes(ids), wire._contiguous_bytes(rows))
                        for _, ids, rows, _ in sparse]
        sizes = [len(d) for d in datas] + [len(d) for pair in sparse_datas for d in pair]
        seg = self._shm_take(sum(shm.align(n) for n in sizes))
        if seg is None:
            return None
        req = ps_pb2.ShmPushRequest(segment=seg.seg_id)
        if sync is not None:
            _set_sync(req, sync)
        end = 0

        def put(d: memoryview, arr: np.ndarray, name: str = "") -> ps_pb2.ShmTensor:
            nonlocal end
            off = end
            seg.array[off:off + len(d)] = np.frombuffer(d, dtype=np.uint8)
            end = off + shm.align(len(d))
            return ps_pb2.ShmTensor(name=name, dtype=T.dtype_name(arr.dtype), shape=arr.shape,
                                    offset=off)
        for item, a, d, uid in zip(items, arrays, datas, uids):
            t = put(d, a, item[0])
            t.update_id = uid
            req.updates.append(t)
        for (name, ids, rows, uid), (di, dr) in zip(sparse, sparse_datas):
            req.sparse.add(name=name, ids=put(di, ids), rows=put(dr, rows), update_id=uid)
        return self._shm_invoke(wait, self._shm_stub.Push, req, seg,
                                lambda r: list(r.versions), fallback,
                                methods.SHM_PUSH)

    # -- a step's calls to one server, as one -----------------------------------------
    def read_and_gather(self, names: Sequence[str], gathers: Sequence[tuple[str, object]], *,
                        sync_step: int | None = None):
        """Read variables and look up rows of others in one call (same host;
        elsewhere, the separate calls): (snapshots, [(rows, version)]), rows
        shaped ids.shape + row shape, as gather. See read_many and gather."""
        return self._read_and_gather(names, gathers, True, sync_step)

    def read_and_gather_async(self, names: Sequence[str], gathers: Sequence[tuple[str, object]],
                              *, sync_step: int | None = None) -> Handle:
        return self._read_and_gather(names, gathers, False, sync_step)

    def _read_and_gather(self, names, gathers, wait: bool, sync_step: int | None):
        names = list(names)
        shaped = [(name, _as_ids(ids, "gather")) for name, ids in gathers]
        flat = [(name, ids.reshape(-1)) for name, ids in shaped]

        direct = None   # the dense values, read straight from the server's memory
        if names and sync_step is None and self._direct_ok():
            direct = self._direct_read(names, None)
            if direct is not None:
                names = []

        def reshape(result):
            snaps, rows = result
            return direct or snaps, [(r.reshape(ids.shape + r.shape[1:]), v)
                                     for (r, v), (_, ids) in zip(rows, shaped)]
        for n in names:   # the segment's size needs them
            if n not in self._nbytes:
                self._learn_size(n)
        known = [self._nbytes.get(n) for n in names]
        if self._shm_for(0) and None not in known:
            out = self._shm_read(names, known, wait, sync_step, flat)
            if wait:
                return reshape(out)
            return Handle(_Later(lambda: reshape(out.result()),
                                 getattr(out, "done", None)), target=self.address)

        def separate():
            snaps = direct or (self._read_many(names, True, sync_step) if names else [])
            return snaps, [self._gather(name, ids, True, sync_step, use_shm=False)
                           for name, ids in shaped]
        return self._run(wait, separate)

    def push_dense_and_sparse(self, dense, sparse: Sequence[tuple], *,
                              sync: SyncSpec | None = None) -> list[int]:
        """Dense updates ([(name, grad[, update_id])]) and row-wise ones
        ([(name, ids, rows, update_id)]) in one call (same host, async;
        otherwise the separate calls). Returns the versions after the dense
        updates, then after the sparse ones. Validated in full first when
        one call; see push_many and push_sparse."""
        return self._push_dense_and_sparse(dense, sparse, True, sync)

    def push_dense_and_sparse_async(self, dense, sparse: Sequence[tuple], *,
                                    sync: SyncSpec | None = None) -> Handle:
        return self._push_dense_and_sparse(dense, sparse, False, sync)

    def _push_dense_and_sparse(self, dense, sparse, wait: bool, sync: SyncSpec | None):
        items = list(dense.items()) if isinstance(dense, Mapping) else list(dense)
        sparse = [(name, _as_ids(ids, "sparse push").reshape(-1), np.asarray(rows), uid)
                  for name, ids, rows, uid in sparse]

        def separate(exc: PSError | None = None):
            versions = self._dense("push", items, True, sync, use_shm=False) if items else []
            return versions + [self._push_sparse(name, ids, rows, True, sync, uid)
                               for name, ids, rows, uid in sparse]
        if self._shm_for(0) and sync is None and (sparse or items):
            arrays = [np.asarray(item[1]) for item in items]
            uids = [item[2] if len(item) > 2 else 0 for item in items]
            out = self._shm_push(items, arrays, uids, wait, None, separate, sparse)
            if out is not None:
                return out
        return self._run(wait, separate)

    def _read_bulk_post(self, raw: bytes) -> list[Snapshot]:
        return self._snapshots(wire.decode_read_reply(raw))

    def read_many_async(self, names: Sequence[str], *, sync_step: int | None = None,
                        out: Sequence[np.ndarray | None] | None = None) -> Handle:
        """Read several variables in one call; ``result()`` is a list of Snapshot.

        Values are read-only arrays (``.copy()`` one to change it), or the
        arrays of ``out`` (one per name, None: a new one) when given with the
        value's shape and dtype: the value is copied into it (on this host,
        straight from shared memory: the only copy). With ``sync_step`` (sync
        mode), the read waits while an earlier step is still being gathered
        on a variable (see psserver.sync).
        """
        return self._read_many(names, False, sync_step, out)

    def read_many(self, names: Sequence[str], *, sync_step: int | None = None,
                  out: Sequence[np.ndarray | None] | None = None) -> list[Snapshot]:
        return self._read_many(names, True, sync_step, out)

    def read(self, name: str, *, with_version: bool = False):
        """The value of ``name`` (a read-only array), or (value, version)."""
        s = self.read_many([name])[0]
        return (s.value, s.version) if with_version else s.value

    def _gather_one(self, name: str, ids: np.ndarray, wait: bool = False, recover=None,
                    sync_step: int | None = None):
        req = ps_pb2.GatherRequest(name=name)
        T.fill(req.ids, ids)
        _set_sync_read(req, sync_step)
        return self._invoke(wait, self._stub.Gather, req,
                            lambda r: (T.decode(r.rows), r.version), recover,
                            methods.GATHER)

    def _gather_split(self, name: str, ids: np.ndarray,
                      sync_step: int | None = None) -> tuple[np.ndarray, int]:
        """A gather too big for one message, as several (each one consistent)."""
        meta = self.get_meta(name)
        row_bytes = max(1, meta.nbytes // meta.shape[0]) if meta.shape and meta.shape[0] else 1
        per_call = max(1, (self.max_message_bytes - MESSAGE_OVERHEAD) // row_bytes)
        flat = ids.reshape(-1)
        parts = [h.result() for h in [self._gather_one(name, flat[i:i + per_call],
                                                       sync_step=sync_step)
                                      for i in range(0, flat.size, per_call)]]
        rows = np.concatenate([p[0] for p in parts]) if parts else np.empty(
            (0,) + meta.shape[1:], meta.dtype)
        return rows.reshape(ids.shape + meta.shape[1:]), min((p[1] for p in parts), default=meta.version)

    def _gather(self, name: str, ids, wait: bool, sync_step: int | None = None,
                use_shm: bool = True):
        ids = _as_ids(ids, "gather")
        if use_shm and self._shm_for(0):   # the rows come back through shared memory
            got = self._read_and_gather([], [(name, ids)], wait, sync_step)
            if wait:
                return got[1][0]
            return Handle(_Later(lambda: got.result()[1][0], got.done), target=self.address)
        nbytes, rows = self._nbytes.get(name), self._rows.get(name)
        if nbytes is not None and rows and not self._fits_message(ids.size * (nbytes // rows)):
            return self._run(wait, self._gather_split, name, ids, sync_step)

        def recover(exc: PSError):   # too big for one message: split it
            if exc.code == Code.RESOURCE_EXHAUSTED:
                return self._gather_split(name, ids, sync_step)
            raise exc
        return self._gather_one(name, ids, wait, recover, sync_step)

    def gather_async(self, name: str, ids, *, sync_step: int | None = None) -> Handle:
        """Rows by id; ``result()`` is (rows, version).

        A gather whose rows exceed one message is split into several calls;
        each piece is a consistent snapshot and the version reported is the
        oldest piece's.
        """
        return self._gather(name, ids, False, sync_step)

    def gather(self, name: str, ids, *, with_version: bool = False,
               sync_step: int | None = None):
        """Rows ``value[ids]`` (shape ids.shape + row shape), or (rows, version)."""
        rows, version = self._gather(name, ids, True, sync_step)
        return (rows, version) if with_version else rows

    # -- updates ---------------------------------------------------------------
    def _dense(self, kind: str, updates: Mapping[str, np.ndarray] | Iterable, wait: bool,
               sync: SyncSpec | None = None, use_shm: bool = True):
        items = list(updates.items()) if isinstance(updates, Mapping) else list(updates)
        arrays = [np.asarray(item[1]) for item in items]
        uids = [item[2] if len(item) > 2 else 0 for item in items]
        msg_cls = ps_pb2.PushRequest if kind == "push" else ps_pb2.AssignRequest
        method = self._stub.Push if kind == "push" else self._stub.Assign
        streamed = not self._fits(sum(a.nbytes for a in arrays))

        def request(with_data: bool):
            req = msg_cls()
            if sync is not None:
                _set_sync(req, sync)
            for item, a, uid in zip(items, arrays, uids):
                T.fill(req.updates.add(name=item[0], update_id=uid).tensor, a, with_data)
            return req
        if kind == "push" and use_shm and self._shm_for(sum(a.nbytes for a in arrays)):
            def redo(exc: PSError):   # the server applied nothing: send it over gRPC
                return self._dense(kind, items, True, sync, use_shm=False)
            out = self._shm_push(items, arrays, uids, wait, sync, redo)
            if out is not None:
                return out
        if streamed:
            req = request(with_data=False)
            return self._run(wait, lambda: list(self._upload(kind, req, arrays).updated.versions))
        if kind == "push" and self.bulk:
            sync_raw = b""
            if sync is not None:
                sync_raw = ps_pb2.SyncInfo(**dataclasses.asdict(sync)).SerializeToString()
            raw = wire.encode_push_request(
                [(item[0], a, uid) for item, a, uid in zip(items, arrays, uids)], sync_raw)

            def recover(exc: PSError):
                if exc.code == Code.UNIMPLEMENTED:   # an older server
                    self.bulk = False
                    return self._invoke(True, method, request(True), lambda r: list(r.versions))
                raise exc
            return self._invoke(wait, self._bulk_push, raw, lambda r: list(r.versions), recover,
                                local=methods.BULK_PUSH)
        return self._invoke(wait, method, request(True), lambda r: list(r.versions))

    def push_many_async(self, grads, *, sync: SyncSpec | None = None) -> Handle:
        """Apply dense gradients ({name: grad}, [(name, grad)] or
        [(name, grad, update_id)]) in one call. A non-zero update_id makes the
        update idempotent: resending it after an error applies it at most once.

        ``result()`` is the list of versions after each update. The request is
        validated in full first: on an error nothing was applied. With
        ``sync`` (sync mode), the gradients join their step instead (see
        psserver.sync); a late one is dropped and counted on the server.
        """
        return self._dense("push", grads, False, sync)

    def push_many(self, grads, *, sync: SyncSpec | None = None) -> list[int]:
        return self._dense("push", grads, True, sync)

    def push(self, name: str, grad) -> int:
        """Apply one dense gradient; return the version after it."""
        return self.push_many([(name, grad)])[0]

    def assign_many_async(self, values) -> Handle:
        """Overwrite values ({name: value} or [(name, value)]) in one call."""
        return self._dense("assign", values, wait=False)

    def assign_many(self, values) -> list[int]:
        return self._dense("assign", values, wait=True)

    def assign(self, name: str, value) -> int:
        """Overwrite a variable's value (optimizer slots are kept)."""
        return self.assign_many([(name, value)])[0]

    def _push_sparse(self, name: str, ids, rows, wait: bool, sync: SyncSpec | None = None,
                     update_id: int = 0):
        ids = _as_ids(ids, "sparse push")
        rows = np.asarray(rows)
        local = wait and self._socket(methods.PUSH_SPARSE) is not None and \
            ids.nbytes + rows.nbytes <= ipc.MAX_FRAME_BYTES - MESSAGE_OVERHEAD
        streamed = not self._fits(ids.nbytes + rows.nbytes) and not local
        req = ps_pb2.PushSparseRequest(name=name, update_id=update_id)
        if sync is not None:
            _set_sync(req, sync)
        T.fill(req.ids, ids, with_data=not streamed)
        T.fill(req.values, rows, with_data=not streamed)
        if streamed:
            return self._run(wait, lambda: self._upload(
                "push_sparse", req, [ids, rows]).updated.versions[0])
        return self._invoke(wait, self._stub.PushSparse, req, lambda r: r.versions[0],
                            local=methods.PUSH_SPARSE)

    def push_sparse_async(self, name: str, ids, rows, *, sync: SyncSpec | None = None,
                          update_id: int = 0) -> Handle:
        return self._push_sparse(name, ids, rows, False, sync, update_id)

    def push_sparse(self, name: str, ids, rows, *, sync: SyncSpec | None = None,
                    update_id: int = 0) -> int:
        """Apply a row-wise gradient (duplicate ids summed); return the version.

        A non-zero update_id makes it idempotent, as in push_many_async."""
        return self._push_sparse(name, ids, rows, True, sync, update_id)

    def save(self, directory: str, names: Sequence[str] = ()) -> list[ps_pb2.SavedFile]:
        """Have the server write variables (all by default) to its directory."""
        return list(self._call(self._stub.Save, ps_pb2.SaveRequest(
            directory=directory, names=list(names)), timeout=max(self.timeout or 0, 600.0)).files)

    def abandon_step(self, step: int, replica: int) -> None:
        """Sync mode: replica will not push for step; stop waiting for it."""
        self._call(self._stub.AbandonStep, ps_pb2.AbandonRequest(step=step, replica=replica))

    # -- replication (psserver.replication) -------------------------------------------
    def replicate(self, records: Sequence["R.Record"],
                  timeout: float | None = None) -> list[tuple[str, int, int]]:
        """A primary's records to this server (its backup): (name, version,
        status) per variable, as VariableStore.replicate. Framed by hand
        (psserver/wire.py: tensor bytes copied once), over the data port (or
        same-host socket) when there is one; records above the stream
        threshold take Upload's frames."""
        if self._fits(sum(r.nbytes for r in records)):
            reply = self._invoke(True, self._replicate_raw, wire.encode_replicate_request(records),
                                 local=methods.REPLICATE)
        else:
            req = ps_pb2.ReplicateRequest()
            arrays = []
            for r in records:
                m = req.records.add(name=r.name, epoch=r.epoch, version=r.version,
                                    update_id=r.update_id, sync_steps=r.sync_steps, kind=r.kind)
                T.fill(m.tensor, r.tensor, with_data=False)
                arrays.append(r.tensor)
                if r.ids is not None:
                    T.fill(m.ids, r.ids, with_data=False)
                    arrays.append(r.ids)
            kw = {} if timeout is None else {"timeout": timeout}
            reply = self._upload("replicate", req, arrays, **kw).replicated
        return [(a.name, a.version, int(a.status)) for a in reply.acks]

    def reconfigure(self, changes: Sequence[tuple], timeout: float = 120.0) -> list[VariableMeta]:
        """The coordinator's role changes on this server: (name, action, epoch,
        backup Peer or None) each (see ReplicaChange in ps.proto); returns each
        copy's metadata after its change. A copy of state (PROMOTE with a
        backup, SET_BACKUP) or a hand-over (DEMOTE) may take up to ``timeout``."""
        req = ps_pb2.ReconfigureRequest(timeout=timeout)
        for name, action, epoch, peer in changes:
            c = req.changes.add(name=name, action=action, epoch=epoch)
            if peer is not None:
                c.backup.CopyFrom(ps_pb2.ReplicaPeer(address=peer.address, name=peer.name))
        reply = self._call(self._stub.Reconfigure, req, timeout=timeout + 10.0)
        return [_meta_from_proto(m) for m in reply.variables]


def _dest(out: Sequence[np.ndarray | None] | None, i: int, like) -> np.ndarray | None:
    """out[i] when the caller gave it with ``like``'s shape and dtype, else None
    (the value goes into a new array)."""
    dest = out[i] if out is not None and i < len(out) else None
    if dest is not None and dest.shape == like.shape and dest.dtype == like.dtype:
        return dest
    return None


def _fill(snaps: list[Snapshot], out: Sequence[np.ndarray | None]) -> list[Snapshot]:
    """Snapshots with their values copied into out's arrays (where given and fitting)."""
    filled = []
    for i, s in enumerate(snaps):
        dest = _dest(out, i, s.value)
        if dest is not None:
            np.copyto(dest, s.value)
            s = Snapshot(s.name, s.version, dest)
        filled.append(s)
    return filled


def _as_ids(ids, what: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} ids must be integers, got {ids.dtype.name}")
    if ids.dtype.kind == "u" or ids.dtype.itemsize not in (4, 8):
        ids = ids.astype(np.int64)
    return ids
