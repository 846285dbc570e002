"""Start a parameter-server task: ``create_server`` builds it, ``serve`` runs it.

The ``psserver`` command (and ``python -m psserver``)::

    psserver --port 0 --port-file /tmp/ps0.port      # prints "psserver listening on 127.0.0.1:PORT"
    psserver --port 0 --metrics-port 0   # also serves metrics: "psserver metrics on 127.0.0.1:PORT"
    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 1}}' psserver --host 0.0.0.0

Under TF_CONFIG (or TF_CONFIG_FILE) the server binds the port of its own
entry in the cluster unless ``--port`` says otherwise, as psworker does
(psserver/contract/tf_config.py); the address it binds stays ``--host``'s. A "task"
that is not a ps task, or not in the cluster, is an error (exit 2).

On SIGTERM or SIGINT the server reports NOT_SERVING on the health service,
stops taking new calls, lets the calls in flight finish (up to --grace
seconds) and exits 0.
"""
from __future__ import annotations

import argparse
import errno
import hmac
import logging
import os
import socket
import sys
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.pstrain.v1 import ps_pb2, tables_pb2
from psserver import tls as TLS
from psserver.contract import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_METADATA_KEY,
    PROTOCOL_VERSION,
    TOKEN_ENV,
    TOKEN_METADATA_KEY,
    routing,
    shm,
)
from psserver.contract.memory import bound_heap
from psserver.core.store import VariableStore
from psserver.link import buffers, methods
from psserver.link.grpc_common import grpc_options
from psserver.serve import ipc_server, rpc, task, task_metrics
from psserver.serve.servicer import ParameterServerServicer

log = logging.getLogger("psserver")

SERVICE_NAME = "pstrain.v1.ParameterServer"
# Calls that stay open without a token, so probes need no secret.
_PUBLIC_PREFIXES = ("/grpc.health.v1.Health/",)


def refusing_handler(handler, code: grpc.StatusCode, message: str):
    """A handler of the same shape (unary or streaming) as ``handler`` that
    aborts every call with code and message, so the servicer never runs."""
    if handler is None:
        return None

    def deny(request_or_iterator, context):
        context.abort(code, message)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(lambda it, ctx: iter([deny(it, ctx)]))
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(lambda r, ctx: iter([deny(r, ctx)]))
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuse (UNAUTHENTICATED) every call whose metadata lacks the token.

    A refused call never reaches the servicer, so it changes nothing.
    """

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_PUBLIC_PREFIXES):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return continuation(handler_call_details)
        return refusing_handler(
            continuation(handler_call_details), grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong auth token: pass the cluster's token "
            f"(PSClient(token=...) or ${TOKEN_ENV})")


class ProtocolVersionInterceptor(grpc.ServerInterceptor):
    """Refuse (FAILED_PRECONDITION) a caller that announces another protocol
    version in ``x-pstrain-protocol``, saying which side is older. Callers
    that announce none (grpcurl, probes) pass."""

    def intercept_service(self, continuation, handler_call_details):
        for key, value in handler_call_details.invocation_metadata or ():
            if key == PROTOCOL_METADATA_KEY:
                try:
                    theirs = int(value)
                except ValueError:
                    theirs = -1
                if theirs != PROTOCOL_VERSION:
                    older = "the client" if theirs < PROTOCOL_VERSION else "this server"
                    return refusing_handler(
                        continuation(handler_call_details), grpc.StatusCode.FAILED_PRECONDITION,
                        f"protocol version mismatch: the client speaks pstrain protocol {theirs}, "
                        f"this server speaks {PROTOCOL_VERSION}; {older} is older: install the "
                        "same pstrain version on every task and the coordinator")
        return continuation(handler_call_details)


class ServerHandle:
    """A running gRPC task: its server, port, main servicer and health service."""

    def __init__(self, server: grpc.Server, port: int, servicer,
                 health_servicer: health.HealthServicer, service_names: tuple[str, ...]):
        self.server, self.port, self.servicer = server, port, servicer
        self.health, self.service_names = health_servicer, service_names
        self.ipc = None    # an ipc_server.IpcServer beside gRPC (same host: a Unix socket)
        self.data = None   # an ipc_server.IpcServer on the data port (TCP), or None

    @property
    def store(self) -> VariableStore:
        return self.servicer.store

    def start(self) -> "ServerHandle":
        self.server.start()
        for side in (self.ipc, self.data):
            if side is not None:
                side.start()
        for name in ("",) + self.service_names:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float | None = 5.0) -> None:
        """Stop taking calls; let those in flight finish for up to ``grace`` s."""
        self.health.enter_graceful_shutdown()
        stopped = self.server.stop(grace)
        for side in (self.ipc, self.data):   # their calls get the same grace, at once
            if side is not None:
                side.stop(grace)
        stopped.wait()
        store = getattr(self.servicer, "store", None)   # (a psworker serves none)
        forwarding = store.replicator.forwarding if store is not None else None
        if forwarding is not None:   # replication senders (psserver/serve/forwarder.py)
            forwarding.stop()
        shared = getattr(self.servicer, "shared_memory", None)
        if shared is not None:
            shared.segments.close()


def make_server(address: str, servicer, add_to_server, service_name: str, *,
                token: str | None = None, tls: "TLS.TLSConfig | None" = None,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                max_workers: int = 16, thread_name_prefix: str = "rpc",
                rpc_metrics=None) -> ServerHandle:
    """Build (not start) a gRPC server for one servicer, with health and auth.

    ``"127.0.0.1:0"`` binds a free port; ``handle.port`` says which. With a
    token, every call but health checks must carry it; with ``tls``, the port
    serves TLS (mutual TLS when it has a CA). With ``rpc_metrics`` (a
    psserver.serve.task_metrics.RpcMetrics), every call is counted and timed, refused
    ones included.
    Raises OSError if the address cannot be bound.
    """
    interceptors = []
    if rpc_metrics is not None:   # first: it sees the calls the token check refuses
        interceptors.append(task_metrics.MetricsInterceptor(rpc_metrics))
    interceptors.append(ProtocolVersionInterceptor())
    if token:
        interceptors.append(TokenAuthInterceptor(token))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix=thread_name_prefix),
                         interceptors=interceptors,
                         options=grpc_options(max_message_bytes))
    add_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    _check_free(address)   # (before gRPC: its own error line would come first)
    try:
        port = TLS.add_port(server, address, tls)
    except RuntimeError as exc:
        raise OSError(f"could not bind {address}: {str(exc).rstrip('.')}") from None
    if port == 0:
        raise OSError(f"could not bind {address}")
    return ServerHandle(server, port, servicer, health_servicer, (service_name,))


class DataPortError(OSError):
    """The data port (``--data-port``) cannot be listened on: ``port``, why."""

    def __init__(self, host: str, port: int, why: OSError):
        super().__init__(getattr(why, "errno", None), why.strerror or str(why))
        self.host, self.port = host, port


def _check_free(address: str) -> None:
    """OSError (EADDRINUSE) when ``address``'s port, if not 0, is taken."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return   # (gRPC says why)
    family, kind, proto, _, where = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(where)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(errno.EADDRINUSE, f"port {port} is in use by another "
                                                "process") from None


def _add_parameter_server(servicer: ParameterServerServicer, server: grpc.Server) -> None:
    """The ParameterServer and SharedMemory services (requests parsed by
    their handlers: psserver/serve/rpc.py), and ParameterServerBulk with hand-framed
    messages (psserver/contract/wire.py): its Read returns bytes already serialized,
    its Push takes the request's bytes as they came."""
    services = ps_pb2.DESCRIPTOR.services_by_name
    rpc.add_service(server, services["ParameterServer"], servicer)
    rpc.add_service(server, services["SharedMemory"], servicer.shared_memory)

    rpc.add_service(server, tables_pb2.DESCRIPTOR.services_by_name["DynamicTables"],
                    servicer.tables)

    rpc.add_service(server, services["ParameterServerBulk"], None, {
        "Read": lambda raw, context: servicer.bulk_read(rpc.parse(ps_pb2.ReadRequest, raw),
                                                        context),
        "Push": servicer.bulk_push})


def create_server(address: str = "127.0.0.1:0", *, store: VariableStore | None = None,
                  token: str | None = None, tls: "TLS.TLSConfig | None" = None,
                  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  max_workers: int = 64, rpc_metrics=None,
                  data_port: int | None = None) -> ServerHandle:
    """Build (not start) a parameter server bound to ``address``.

    ``rpc_metrics``: a psserver.serve.task_metrics.RpcMetrics counting every call (see
    make_server); the store's own metrics come with ``VariableStore(observer=...)``.
    ``data_port``: also serve reads, pushes, lookups and sparse pushes framed
    by hand on this TCP port of the same host (0: a free one; None: none);
    TLS as the gRPC port, the same token.
    """
    from psserver.serve.forwarder import (
        Forwarder,  # it imports the client, which imports this
    )

    servicer = ParameterServerServicer(store if store is not None else VariableStore(),
                                       max_message_bytes=max_message_bytes,
                                       chunk_bytes=chunk_bytes)
    replicator = servicer.store.replicator
    if replicator.forwarding is None:   # replicated primaries reach their backups
        replicator.forwarding = Forwarder(token, tls)
    if isinstance(replicator.forwarding, Forwarder):   # and table shards' moves their destination
        servicer.tables.peer = replicator.forwarding.peer_client
        servicer.tables.server_id = servicer.server_id
    handle = make_server(address, servicer, _add_parameter_server, SERVICE_NAME, token=token,
                         tls=tls, max_message_bytes=max_message_bytes,
                         max_workers=max_workers, thread_name_prefix="psserver-rpc",
                         rpc_metrics=rpc_metrics)
    # Both sockets serve the calls of psserver/link/methods.py with the servicer's
    # own handlers; the shared-memory ones only where the segments can be: the
    # Unix socket. (Which client takes which socket: psserver/contract/routing.py.)
    services = {methods.PS: servicer, methods.BULK: servicer,
                methods.SHM: servicer.shared_memory, methods.TABLES: servicer.tables}
    identity = f"{PROTOCOL_VERSION}:{servicer.server_id}"
    if shm.available() and routing.same_host_available():
        shared = servicer.shared_memory
        handle.ipc = ipc_server.IpcServer(methods.socket_handlers(services, shm=True), token,
                                   rpc_metrics, identity=identity)
        shared.ipc_socket = handle.ipc.name
    if data_port is not None:
        host = address.rsplit(":", 1)[0]
        try:
            handle.data = ipc_server.IpcServer(
                methods.socket_handlers(services, shm=False), token, rpc_metrics,
                tcp=(host, data_port),
                ssl_context=tls.ssl_server_context() if tls is not None else None,
                identity=identity)
        except OSError as exc:
            if handle.ipc is not None:
                handle.ipc.stop(0)
            raise DataPortError(host, data_port, exc) from None
        servicer.data_port = handle.data.port
    return handle


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="psserver", description="Run one parameter-server task.",
                                epilog=task.task_epilog("psserver"),
                                formatter_class=task.help_formatter)
    task.add_task_arguments(p, grace="calls")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest message accepted; larger tensors move in frames (default 64 MiB)")
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                   help="frame size of streamed reads (default 1 MiB)")
    p.add_argument("--max-memory-bytes", type=int, default=None,
                   help="refuse what would take this server past this many bytes: "
                        "variables (values, slots), table rows, gathered sync steps")
    p.add_argument("--checkpoint-dir", action="append", default=[], metavar="DIR",
                   help="directory under which Save (checkpoints) may write shard files; "
                        "repeat for several. Without one this server writes no files")
    p.add_argument("--threads", type=int, default=64,
                   help="RPC handler threads (default 64; sync-mode reads wait in one each)")
    p.add_argument("--leave-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="on SIGTERM, while this server holds dynamic tables' rows, serve on "
                        "up to this long until the job drains it (a coordinator following "
                        "its servers does), then stop (default 0: stop at once). Give the "
                        "container a longer stop grace period (psserver/serve/leave.py)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for d in args.checkpoint_dir:   # (a save into a missing one would fail, or make it elsewhere)
        why = None if os.path.isdir(d) else "does not exist" if not os.path.exists(d) \
            else "is not a directory"
        if why is None and not os.access(d, os.W_OK | os.X_OK):
            why = "is not writable by this user"
        if why:
            print(f"psserver: --checkpoint-dir {d} {why}: create it (mkdir -p {d}) or give "
                  "a directory this server can write, on storage the coordinator sees at the "
                  "same path", file=sys.stderr)
            return 2
    if not args.leave_timeout >= 0:
        print(f"psserver: --leave-timeout must be >= 0, got {args.leave_timeout}",
              file=sys.stderr)
        return 2
    start = task.begin(args, "psserver", "ps")
    if start is None:
        return 2
    observer, rpc_metrics = None, None
    if start.served is not None:
        observer = task_metrics.StoreMetrics(start.served[0])
        rpc_metrics = task_metrics.RpcMetrics(start.served[0])
    store = VariableStore(args.max_memory_bytes, observer, checkpoint_dirs=args.checkpoint_dir)
    if args.max_memory_bytes is not None:   # freed buffers are resident memory too
        buffers.keep_at_most(args.max_memory_bytes // 8)
        bound_heap(args.max_memory_bytes)
    if observer is not None:
        observer.watch(store)
    try:
        handle = create_server(start.address, store=store, token=start.token, tls=start.tls,
                               max_message_bytes=args.max_message_bytes,
                               chunk_bytes=args.chunk_bytes, max_workers=args.threads,
                               rpc_metrics=rpc_metrics, data_port=task.data_port_of(args))
    except DataPortError as exc:
        print(f"psserver: cannot listen on data port {exc.host}:{exc.port}: {exc.strerror}. "
              "Pick another --data-port, or 0 for a free one", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"psserver: cannot listen on {start.address}: {exc.strerror or exc}. Pick "
              "another --port, or 0 for a free one", file=sys.stderr)
        return 2
    if start.served is not None:
        start.served[0].register(task_metrics.TablesCollector(handle.servicer.tables))
    handle.servicer.leave.timeout = args.leave_timeout
    task.serve(handle, grace=args.grace, port_file=args.port_file, host=args.host,
               leave=handle.servicer.leave.wait)
    return 0


if __name__ == "__main__":
    sys.exit(main())
