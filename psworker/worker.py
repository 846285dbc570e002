"""A worker task: runs the step closures a coordinator sends it.

The ``psworker`` command (and ``python -m psworker``)::

    psworker --port 0                      # prints "psworker listening on 127.0.0.1:PORT"
    psworker --port 0 --metrics-port 0     # first prints "psworker metrics on 127.0.0.1:PORT"
    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 1}}' psworker --host 0.0.0.0

Under TF_CONFIG (or TF_CONFIG_FILE) the worker binds the port of its own
entry in the cluster unless ``--port`` says otherwise; a "task" that is not
a worker, or not in the cluster, is an error (exit 2). The auth token comes
from ``$PSTRAIN_AUTH_TOKEN``; without one the worker refuses functions sent
by value (see coordinator.serialization). A step function runs in this
process: it reads and pushes variables through this process's connections to
the parameter servers, and its return value goes back to the coordinator.
"""
from __future__ import annotations

import argparse
import collections
import logging
import socket
import sys
import threading
import time
import traceback
import uuid

from coordinator import (
    collective_inbox,
    datasets,
    layouts,
    mirrored,
    placement,
    serialization,
    sources,
)
from coordinator.replica import CollectiveSpec, replica_scope
from protos.pstrain.v1 import ps_pb2, worker_pb2, worker_pb2_grpc
from psserver.contract import (
    PROTOCOL_VERSION,
    TOKEN_ENV,
    SyncSpec,
    join_host_port,
    routing,
)
from psserver.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
    WorkerRestarted,
)
from psserver.link import methods
from psserver.serve import ipc_server, rpc, task, task_metrics
from psserver.serve.server import make_server
from psserver.serve.task import INSECURE_FLAG

log = logging.getLogger("psworker")

SERVICE_NAME = "pstrain.v1.Worker"


#: Functions sent by value a worker keeps unpickled (the most recently used).
FUNCTIONS_KEPT = 32


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Runs closures. ``trusted``: calls passed a token check (or the task was
    started with --insecure-no-auth): only then does it run any function, by
    name or by value, or unpickle arguments beyond plain data. Running a
    closure is running code: a worker without a token runs none.
    ``metrics``: a psserver.serve.task_metrics.WorkerMetrics counting the closures run."""

    def __init__(self, trusted: bool, metrics: "task_metrics.WorkerMetrics | None" = None):
        self.trusted = trusted
        self.metrics = metrics
        self.worker_id = uuid.uuid4().hex
        self.ipc_socket = ""   # set by main when it serves its Unix socket (psserver/serve/ipc_server.py)
        self.data_port = 0     # likewise, its data port
        self.address = "(this one)"   # and where it listens, for error messages
        self._count = 0
        self._count_lock = threading.Lock()
        # Functions sent by value, unpickled once each, by their digest (the
        # coordinator sends a function's bytes once, then its digest alone).
        self._functions: collections.OrderedDict[bytes, object] = collections.OrderedDict()

    def _function(self, ref: worker_pb2.FunctionRef, context):
        if not self.trusted:   # by name is code too (os:system): nothing runs untrusted
            raise PermissionDenied(
                "this worker has no auth token configured, so it runs no function "
                f"(by name or by value) for anyone: set ${TOKEN_ENV} on every task "
                f"and the coordinator (or start it with {INSECURE_FLAG} on an "
                "isolated network)")
        kind = ref.WhichOneof("kind")
        if kind == "qualified_name":
            try:
                return serialization.import_function(ref.qualified_name, self.address)
            except serialization.FunctionImportError as exc:
                raise FailedPrecondition(str(exc)) from None
        if kind == "pickled" or ref.digest:
            with self._count_lock:   # (sent by value before: by its digest alone)
                fn = None if kind == "pickled" else self._functions.get(ref.digest)
                if fn is not None:
                    self._functions.move_to_end(ref.digest)
                    return fn
            if kind != "pickled":
                raise NotFound("this worker does not have the function sent by value with "
                               "that digest (it restarted, or let it go): send it by value")
            data = ref.pickled
            digest = serialization.function_digest(data)
            if ref.digest and ref.digest != digest:
                raise InvalidArgument("the function's digest does not match its bytes")
            with self._count_lock:
                fn = self._functions.get(digest)
                if fn is not None:
                    self._functions.move_to_end(digest)
                    return fn
            try:
                fn = serialization.load_function(data, self.address)
            except serialization.FunctionImportError as exc:
                raise FailedPrecondition(str(exc)) from None
            except Exception as exc:
                raise FailedPrecondition(
                    f"cannot unpickle the function on this worker: "
                    f"{type(exc).__name__}: {exc}. The worker needs the same "
                    "packages (and versions) as the coordinator") from None
            with self._count_lock:
                self._functions[digest] = fn
                while len(self._functions) > FUNCTIONS_KEPT:
                    self._functions.popitem(last=False)
            return fn
        raise InvalidArgument("no function in the request")

    def _check_fence(self, worker_id: str, context) -> None:
        if worker_id and worker_id != self.worker_id:
            raise WorkerRestarted(
                f"this worker restarted (it is {self.worker_id}, the caller expected "
                f"{worker_id}); reconnect and re-create its datasets")

    def GetWorkerInfo(self, request, context):
        return worker_pb2.WorkerInfo(
            protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id,
            datasets=datasets.dataset_ids(), closures_run=self._count,
            host=routing.announce(ps_pb2.HostInfo(), ipc_socket=self.ipc_socket,
                                  data_port=self.data_port))

    def CreateDataset(self, request, context):
        self._check_fence(request.worker_id, context)
        fn = self._function(request.fn, context)
        ctx = datasets.InputContext(max(1, request.num_workers), request.worker_index)
        try:
            ds = datasets.call_dataset_fn(fn, ctx)
        except Exception as exc:
            raise FailedPrecondition(
                f"dataset_fn raised on this worker: {type(exc).__name__}: {exc}\n"
                f"{traceback.format_exc()}") from None
        datasets.register_dataset(request.dataset_id, ds)
        if self.metrics is not None:
            self.metrics.dataset_created()
        return worker_pb2.CreateDatasetReply()

    def RunClosure(self, request, context):
        self._check_fence(request.worker_id, context)
        collective = None
        if request.HasField("collective"):
            try:
                collective = CollectiveSpec.of(request.collective)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            # First (the function and arguments are unpickled after): a
            # re-forming waits for the attempt to end here (mirrored.after_steps).
            mirrored.step_started(collective)
        completed = [False]   # (its function returned with its pushes through)
        try:
            return self._run_closure(request, context, collective, completed)
        finally:
            if collective is not None:
                mirrored.step_ended(collective, completed[0])

    def _run_closure(self, request, context, collective, completed: list):
        fn = self._function(request.fn, context)
        sources.check_assignments(request.batches)
        try:   # (the coordinator's whole table of moved variable shards; checked first)
            moved = placement.parse((m.made_at, m.name, m.address) for m in request.moved)
        except ValueError as exc:
            raise InvalidArgument(f"ClosureRequest.moved: {exc}") from None
        try:   # (before the arguments: their tables are brought to these as used)
            layouts.learn_known((t.name, t.table_id, t.layout) for t in request.layouts)
        except ValueError as exc:
            raise InvalidArgument(f"ClosureRequest.layouts: {exc}") from None
        placement.take(moved)
        try:
            args, kwargs = serialization.loads(request.args, trusted=self.trusted)
        except ModuleNotFoundError as exc:
            raise FailedPrecondition(str(serialization.not_importable(
                exc, self.address, "the closure's arguments"))) from None
        except Exception as exc:
            raise InvalidArgument(
                f"cannot unpickle the closure's arguments: {type(exc).__name__}: {exc}") from None
        sync = SyncSpec.of(request.sync) if request.HasField("sync") else None
        m, outcome, start = self.metrics, "error", time.perf_counter()
        if m is not None:
            m.running.inc()
        # An all-reduce step's pushes to parameter servers: keys of (job, step,
        # this worker), so its run here again is dropped where the first was
        # applied (by worker, not rank: ranks shift when a member is lost).
        replica_seed = None if collective is None else (
            f"allreduce/{collective.job}/{collective.step}/"
            f"{collective.members[collective.rank]}").encode()
        try:
            with replica_scope(sync, collective), \
                    sources.batch_scope(request.batches, replica_seed):
                result = fn(*args, **kwargs)
                completed[0] = collective is not None and mirrored.pushed_through(collective)
            reply = worker_pb2.ClosureReply(result=serialization.dumps(result))
            outcome = "ok"
        except Exception as exc:
            if collective is not None:   # the step's other workers are told at once
                with replica_scope(sync, collective):
                    mirrored.step_failed(collective, f"{type(exc).__name__}: {exc}")
            reply = worker_pb2.ClosureReply(error=worker_pb2.ErrorInfo(
                type=type(exc).__name__, message=str(exc), traceback=traceback.format_exc(),
                **_ps_failure(exc)))
        finally:
            if m is not None:
                m.running.dec()
                m.closure(outcome, time.perf_counter() - start)
        with self._count_lock:
            self._count += 1
        return reply

    def Collective(self, request, context):
        """A chunk of a collective operation (coordinator/collective.py),
        kept in this process's inbox until the member it is for takes it."""
        if not self.trusted:   # (it changes what a step here computes)
            raise PermissionDenied(
                "this worker has no auth token configured, so it takes no collective "
                f"chunks: set ${TOKEN_ENV} on every task (or start it with {INSECURE_FLAG} "
                "on an isolated network)")
        left = context.time_remaining()
        room = collective_inbox.ROOM_SECONDS
        member = collective_inbox.INBOX.deliver_bytes(request, room if left is None
                                                      else min(room, left))
        return worker_pb2.CollectiveReply(member=member)


def _add_worker(servicer: WorkerServicer, server) -> None:
    """The Worker service, its requests parsed by its handlers (psserver/serve/rpc.py)."""
    rpc.add_service(server, worker_pb2.DESCRIPTOR.services_by_name["Worker"], servicer,
                    {"Collective": servicer.Collective})   # (framed by hand: its bytes)


def _ps_failure(exc: BaseException) -> dict:
    """ErrorInfo fields naming the parameter server a step failed on, if any."""
    while exc is not None:
        if isinstance(exc, (Unavailable, DeadlineExceeded, NotFound)) and exc.address:
            return {"ps_address": exc.address, "ps_code": exc.code.name}
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="psworker", description="Run one worker task.",
                                epilog=task.task_epilog("psworker"),
                                formatter_class=task.help_formatter)
    task.add_task_arguments(p, grace="closures")
    p.add_argument("--threads", type=int, default=4,
                   help="closures that may run at once (default 4)")
    return p


def _named_host(host: str) -> str:
    """``host``, or this machine's name where it binds every interface
    (which says nothing to a person reading an error on the coordinator)."""
    return socket.gethostname() if host.strip("[]") in ("", "0.0.0.0", "::") else host


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = task.begin(args, "psworker", "worker")
    if start is None:
        return 2
    address, token, tls, served = start.address, start.token, start.tls, start.served
    worker_metrics = rpc_metrics = None
    if served is not None:
        worker_metrics = task_metrics.WorkerMetrics(served[0])
        rpc_metrics = task_metrics.RpcMetrics(served[0])
    try:
        handle = make_server(address, WorkerServicer(trusted=token is not None
                                                     or args.insecure_no_auth,
                                                     metrics=worker_metrics),
                             _add_worker, SERVICE_NAME,
                             token=token, tls=tls, max_workers=args.threads,
                             thread_name_prefix="psworker-rpc", rpc_metrics=rpc_metrics)
    except OSError as exc:
        print(f"psworker: cannot listen on {address}: {exc.strerror or exc}. Pick another "
              "--port, or 0 for a free one", file=sys.stderr)
        return 2
    handle.servicer.address = join_host_port(_named_host(args.host), handle.port)
    closures = methods.socket_handlers({methods.WORKER: handle.servicer}, shm=False)
    identity = f"{PROTOCOL_VERSION}:{handle.servicer.worker_id}"
    if routing.same_host_available():   # a coordinator on this host sends closures here
        handle.ipc = ipc_server.IpcServer(closures, token, rpc_metrics, identity=identity)
        handle.servicer.ipc_socket = handle.ipc.name
    data_port = task.data_port_of(args)
    if data_port is not None:   # and a coordinator on another host, here
        try:
            handle.data = ipc_server.IpcServer(
                closures, token, rpc_metrics, tcp=(args.host, data_port),
                ssl_context=tls.ssl_server_context() if tls is not None else None,
                identity=identity)
        except OSError as exc:
            print(f"psworker: cannot listen on data port {args.host}:{data_port}: "
                  f"{exc.strerror or exc}. Pick another --data-port, or 0 for a free one",
                  file=sys.stderr)
            return 2
        handle.servicer.data_port = handle.data.port
    task.serve(handle, grace=args.grace, port_file=args.port_file, host=args.host, role="psworker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
