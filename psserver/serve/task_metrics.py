"""What a task (psserver, psworker) exports to Prometheus: gRPC calls, the
parameter server's state, closures. The registry, endpoint and options are
psserver/metrics.py's.

* ``RpcMetrics`` + ``MetricsInterceptor``: every call's count, latency,
  status code, and bytes in and out, per method (psserver and psworker). The
  names follow go-grpc-prometheus (``grpc_server_handled_total`` ...), so
  existing gRPC dashboards work.
* ``StoreMetrics``: a ``StoreObserver`` (gradients accepted, dropped, sync
  barrier waits, sync staleness) plus the variables and bytes held, read
  from the store at scrape time.
* ``WorkerMetrics``: closures run on a worker, by outcome, and their duration.
"""
from __future__ import annotations

import time
from typing import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from psserver.core.variable import StoreObserver
from psserver.metrics import CLOSURE_BUCKETS, LATENCY_BUCKETS, STALENESS_BUCKETS


# -- gRPC calls ------------------------------------------------------------------------
class RpcMetrics:
    """The server-side gRPC metrics of one task (psserver or psworker)."""

    def __init__(self, registry: CollectorRegistry):
        names = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter(
            "grpc_server_started_total", "RPCs started on the server.", names,
            registry=registry)
        self.handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by final status code.", names + ["grpc_code"],
            registry=registry)
        self.seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from the call reaching its handler to its last response (seconds), "
            "by final status code.", names + ["grpc_code"], buckets=LATENCY_BUCKETS,
            registry=registry)
        self.msg_received = Counter(
            "grpc_server_msg_received_total", "Messages received (stream frames count "
            "one each).", names, registry=registry)
        self.msg_sent = Counter(
            "grpc_server_msg_sent_total", "Messages sent (stream frames count one each).",
            names, registry=registry)
        self.bytes_received = Counter(
            "grpc_server_received_bytes_total",
            "Serialized request bytes received (protobuf payloads, before gRPC framing).",
            names, registry=registry)
        self.bytes_sent = Counter(
            "grpc_server_sent_bytes_total",
            "Serialized response bytes sent (protobuf payloads, before gRPC framing).",
            names, registry=registry)


def _rpc_type(handler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


def _split_method(full: str) -> tuple[str, str]:
    """'/pstrain.v1.ParameterServer/Push' -> ('pstrain.v1.ParameterServer', 'Push')."""
    _, _, rest = full.partition("/")
    service, _, method = rest.partition("/")
    return (service, method) if method else ("unknown", full)


def _code_name(code) -> str:
    if isinstance(code, grpc.StatusCode):
        return code.name
    return str(code).rsplit(".", 1)[-1].upper() if code is not None else "UNKNOWN"


class _MethodMetrics:
    """The label children of one method (labels() lookups cost more than the counting)."""

    def __init__(self, m: RpcMetrics, labels: tuple[str, str, str]):
        self._m, self.labels = m, labels
        self.started = m.started.labels(*labels)
        self.recv_msgs = m.msg_received.labels(*labels)
        self.recv_bytes = m.bytes_received.labels(*labels)
        self.sent_msgs = m.msg_sent.labels(*labels)
        self.sent_bytes = m.bytes_sent.labels(*labels)
        self._by_code: dict[str, tuple] = {}

    def finished(self, code: str, seconds: float) -> None:
        try:
            handled, histogram = self._by_code[code]
        except KeyError:
            handled = self._m.handled.labels(*self.labels, code)
            histogram = self._m.seconds.labels(*self.labels, code)
            self._by_code[code] = (handled, histogram)
        handled.inc()
        histogram.observe(seconds)


class MetricsInterceptor(grpc.ServerInterceptor):
    """Count and time every call, with its final status code and its bytes.

    Put it first among the interceptors, so calls other interceptors refuse
    (UNAUTHENTICATED) are counted too. The handler is wrapped, not replaced:
    the time runs from the handler's start to its return (unary responses)
    or its last frame (streamed responses); the code is what the handler
    set or aborted with (``context.abort`` raises: the exception is
    re-raised untouched), UNKNOWN for any other exception, CANCELLED when
    the client went away first. Bytes are the serialized messages as they
    pass through the request deserializer and response serializer, so
    counting costs no extra serialization. Calls to unknown methods
    (UNIMPLEMENTED, never reaching a handler) and non-blocking handlers
    (the health service's Watch) are not counted.
    """

    def __init__(self, metrics: RpcMetrics):
        self.m = metrics
        self._methods: dict[tuple[str, str], _MethodMetrics] = {}

    def _method(self, full_name: str, rpc_type: str) -> _MethodMetrics:
        try:
            return self._methods[(full_name, rpc_type)]
        except KeyError:
            mm = _MethodMetrics(self.m, (rpc_type, *_split_method(full_name)))
            self._methods[(full_name, rpc_type)] = mm
            return mm

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                    or handler.stream_stream)
        if getattr(behavior, "experimental_non_blocking", False):
            # Health/Watch: answers through a callback, off the handler thread;
            # wrapping it would make it hold a thread. Left as it is, uncounted.
            return handler
        mm = self._method(handler_call_details.method, _rpc_type(handler))
        mm.started.inc()
        done = [False]   # one record per call, whichever path ends it
        start = time.perf_counter()

        def finish(code_name: str) -> None:
            if not done[0]:
                done[0] = True
                mm.finished(code_name, time.perf_counter() - start)

        deserialize, serialize = handler.request_deserializer, handler.response_serializer

        def request_deserializer(data: bytes):
            mm.recv_msgs.inc()
            mm.recv_bytes.inc(len(data))
            if deserialize is None:
                return data
            try:
                return deserialize(data)
            except Exception:   # grpc answers INTERNAL; the handler never runs
                finish("INTERNAL")
                raise

        def response_serializer(message) -> bytes:
            data = serialize(message) if serialize is not None else message
            mm.sent_msgs.inc()
            mm.sent_bytes.inc(len(data))
            return data

        def outcome(context, failed: bool) -> str:
            code = context.code()
            if code is not None:
                return _code_name(code)
            if failed:
                return "UNKNOWN"
            if not context.is_active():   # the client cancelled or its deadline passed
                remaining = context.time_remaining()
                return ("DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0
                        else "CANCELLED")
            return "OK"

        def unary_response(behavior: Callable):
            def wrapped(request_or_iterator, context):
                try:
                    response = behavior(request_or_iterator, context)
                except BaseException:
                    finish(outcome(context, True))
                    raise
                finish(outcome(context, False))
                return response
            return wrapped

        def streamed_response(behavior: Callable):
            def wrapped(request_or_iterator, context):
                try:
                    yield from behavior(request_or_iterator, context)
                except GeneratorExit:   # grpc stopped iterating: the call ended early
                    finish(_code_name(context.code()) if context.code() is not None
                           else "CANCELLED")
                    raise
                except BaseException:
                    finish(outcome(context, True))
                    raise
                finish(outcome(context, False))
            return wrapped

        kw = {"request_deserializer": request_deserializer,
              "response_serializer": response_serializer}
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                streamed_response(handler.stream_stream), **kw)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                unary_response(handler.stream_unary), **kw)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                streamed_response(handler.unary_stream), **kw)
        return grpc.unary_unary_rpc_method_handler(unary_response(handler.unary_unary), **kw)


# -- the parameter server's state ---------------------------------------------------------
class _StoreCollector(Collector):
    """Variables and bytes held, read from the store at each scrape."""

    def __init__(self, store):
        self.store = store

    def collect(self):
        vs = self.store.variables_snapshot()
        held = GaugeMetricFamily("pstrain_ps_variables", "Variables (shards) held.")
        held.add_metric([], len(vs))
        yield held
        b = GaugeMetricFamily("pstrain_ps_bytes",
                              "Bytes held in variable values and optimizer slots.",
                              labels=["part"])
        b.add_metric(["values"], sum(v.value.nbytes for v in vs))
        b.add_metric(["slots"], sum(v.slot_nbytes for v in vs))
        yield b
        if self.store.max_bytes is not None:
            lim = GaugeMetricFamily("pstrain_ps_memory_limit_bytes",
                                    "--max-memory-bytes: the limit on values + slots.")
            lim.add_metric([], self.store.max_bytes)
            yield lim

    def describe(self):   # no describe-time scrape of the store
        return []


class TablesCollector(Collector):
    """The dynamic tables' counters (psserver/serve/tables.py), read at each scrape:
    rows and bytes held; look-ups, hits (hit rate: rate(hits) / rate(lookups)),
    admissions, look-ups answered with the default row, evictions by reason,
    rows updated, gradient rows dropped and late sync updates, by table."""

    _COUNTERS = (("lookups", "Keys looked up with admission."),
                 ("hits", "Keys looked up that had a row."),
                 ("admitted", "Rows created (keys admitted)."),
                 ("not_admitted", "Look-ups answered with the default row (key not admitted)."),
                 ("updated", "Rows a gradient changed."),
                 ("dropped", "Gradient rows dropped: their key had no row."),
                 ("late", "Sync-mode updates dropped whole: their step was applied, their "
                          "replica abandoned, or a replica's second."))

    def __init__(self, tables):
        self.tables = tables

    def collect(self):
        infos = self.tables.List(None, None).tables
        rows = GaugeMetricFamily("pstrain_ps_table_rows", "Rows held, by dynamic table.",
                                 labels=["table"])
        held = GaugeMetricFamily("pstrain_ps_table_bytes",
                                 "Bytes a dynamic table's shard holds (rows, slots, index, "
                                 "a sync step's gathered rows).",
                                 labels=["table"])
        counters = {k: CounterMetricFamily(f"pstrain_ps_table_{k}", text, labels=["table"])
                    for k, text in self._COUNTERS}
        evicted = CounterMetricFamily("pstrain_ps_table_evicted",
                                      "Rows evicted: reason capacity | age.",
                                      labels=["table", "reason"])
        for i in infos:
            rows.add_metric([i.name], i.rows)
            held.add_metric([i.name], i.bytes)
            for k, c in counters.items():
                c.add_metric([i.name], getattr(i, k))
            evicted.add_metric([i.name, "capacity"], i.evicted_capacity)
            evicted.add_metric([i.name, "age"], i.evicted_age)
        yield rows
        yield held
        yield from counters.values()
        yield evicted

    def describe(self):
        return []


class StoreMetrics(StoreObserver):
    """Counts what a VariableStore does (pass as ``VariableStore(observer=...)``),
    and reports what it holds."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._gradients = Counter(
            "pstrain_ps_gradients_total",
            "Gradients accepted, one per variable (shard) per push: kind dense|sparse; mode "
            "async (applied by the optimizer at once) | sync (added to its step, which "
            "applies the mean once).", ["kind", "mode"], registry=registry)
        # The label children, looked up once (labels() costs more than the counting).
        self._gradient_children = {(kind, mode): self._gradients.labels(kind, mode)
                                   for kind in ("dense", "sparse") for mode in ("async", "sync")}
        self._dropped = Counter(
            "pstrain_ps_dropped_gradients_total",
            "Sync gradients dropped: late (their step was applied already: a straggler "
            "beyond the backup workers), from an abandoned replica, or a replica's second.",
            ["kind"], registry=registry)
        for kind in ("dense", "sparse"):
            self._dropped.labels(kind)
        self._wait = Histogram(
            "pstrain_ps_sync_wait_seconds",
            "Seconds a sync call waited at the barrier for an earlier step of its variable "
            "(sync.wait_for_earlier_steps), one per variable per call: op read|gather|push.",
            ["op"], buckets=LATENCY_BUCKETS, registry=registry)
        self._staleness = Histogram(
            "pstrain_ps_sync_gradient_staleness_steps",
            "Sync gradients: steps the variable had already applied past the step the "
            "gradient was computed for, when it arrived (0: on time; more: late, dropped). "
            "Asynchronous pushes are not measured: the wire does not say which version they "
            "were computed on.", buckets=STALENESS_BUCKETS, registry=registry)
        self._store_collector = None

    def watch(self, store) -> "StoreMetrics":
        """Report ``store``'s variables and bytes held at each scrape."""
        self._store_collector = _StoreCollector(store)
        self.registry.register(self._store_collector)
        return self

    # -- StoreObserver ---------------------------------------------------------------
    def gradients(self, kind: str, mode: str, n: int = 1) -> None:
        self._gradient_children[kind, mode].inc(n)

    def dropped(self, kind: str) -> None:
        self._dropped.labels(kind).inc()

    def sync_wait(self, op: str, seconds: float) -> None:
        self._wait.labels(op).observe(seconds)

    def sync_staleness(self, steps: int) -> None:
        self._staleness.observe(steps)


# -- a worker's closures ---------------------------------------------------------------------
class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self._closures = Counter(
            "pstrain_worker_closures_total",
            "Step closures run on this worker, by outcome: ok (returned) | error (raised; "
            "the coordinator gets a StepFunctionError).", ["outcome"], registry=registry)
        self._seconds = Histogram(
            "pstrain_worker_closure_seconds",
            "Seconds a step function ran on this worker, by outcome.", ["outcome"],
            buckets=CLOSURE_BUCKETS, registry=registry)
        for outcome in ("ok", "error"):
            self._closures.labels(outcome)
            self._seconds.labels(outcome)
        self.running = Gauge("pstrain_worker_closures_running",
                             "Step closures running on this worker now.", registry=registry)
        self._datasets = Counter("pstrain_worker_datasets_created_total",
                                 "Per-worker datasets created on this worker.",
                                 registry=registry)

    def closure(self, outcome: str, seconds: float) -> None:
        self._closures.labels(outcome).inc()
        self._seconds.labels(outcome).observe(seconds)

    def dataset_created(self) -> None:
        self._datasets.inc()
