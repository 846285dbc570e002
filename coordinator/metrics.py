"""Prometheus metrics of the coordinator process: closures, workers, recoveries, checkpoints.

    from coordinator import metrics
    host, port = metrics.serve(0)          # http://127.0.0.1:PORT/metrics, a free port

Or set ``PSTRAIN_METRICS_PORT`` (and ``PSTRAIN_METRICS_HOST``, default
127.0.0.1) in the coordinator's environment: the first ``ClusterCoordinator``
made in the process starts the endpoint by itself (how the deployed
coordinator, ``coordinator run SCRIPT``, serves them with no change to the
script). The endpoint is plain HTTP and unauthenticated.

The metrics live in ``REGISTRY``, a registry of this process (not
prometheus_client's global default). Counters count over the life of the
process, across every ClusterCoordinator and CheckpointManager in it; the
gauges (queued, running, live workers) sum over the coordinators not shut down.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from psserver import metrics as _pm

log = logging.getLogger("coordinator.metrics")

PORT_ENV, HOST_ENV = _pm.PORT_ENV, _pm.HOST_ENV

#: This process's coordinator metrics.
REGISTRY = _pm.new_registry()

CLOSURES_SCHEDULED = Counter(
    "pstrain_coordinator_closures_scheduled_total",
    "Closures queued by schedule() (a sync step queues one per replica).", registry=REGISTRY)
CLOSURES_SUCCEEDED = Counter(
    "pstrain_coordinator_closures_succeeded_total",
    "Closures whose result came back.", registry=REGISTRY)
CLOSURES_FAILED = Counter(
    "pstrain_coordinator_closures_failed_total",
    "Closures that failed, by error: StepFunctionError (the step raised on a worker), "
    "WorkerCallError (a worker refused it, or a parameter server could not be recovered).",
    ["error"], registry=REGISTRY)
for _e in ("StepFunctionError", "WorkerCallError"):
    CLOSURES_FAILED.labels(_e)
CLOSURES_CANCELLED = Counter(
    "pstrain_coordinator_closures_cancelled_total",
    "Closures cancelled, never run, because an earlier closure failed.", registry=REGISTRY)
CLOSURES_RETRIED = Counter(
    "pstrain_coordinator_closures_retried_total",
    "Closures put back in the queue to run again: their worker failed or restarted, or "
    "their parameter server was unreachable or restarted.", registry=REGISTRY)
CLOSURES_ABANDONED = Counter(
    "pstrain_coordinator_closures_abandoned_total",
    "Sync replicas abandoned because their worker failed (the step went on without them).",
    registry=REGISTRY)
PS_RECOVERIES = Counter(
    "pstrain_coordinator_ps_recoveries_total",
    "Parameter-server checks after a step could not reach a server, by outcome: "
    "unchanged (it answered as the same process: a network problem), restored (it "
    "restarted: shards restored from the latest checkpoint), recreated (it restarted, no "
    "checkpoint, recreate_lost_shards=True: shards created again), failed (it did not come "
    "back in time, or restarted empty with nothing to refill it from), failover "
    "(replication: its shards' other copies took over), replicated (replication: it "
    "answered again and got its copies back).",
    ["outcome"], registry=REGISTRY)
for _o in ("unchanged", "restored", "recreated", "failed", "failover", "replicated"):
    PS_RECOVERIES.labels(_o)
TABLE_MOVES = Counter(
    "pstrain_coordinator_table_moves_total",
    "Dynamic tables' moves of buckets between parameter servers (ClusterCoordinator."
    "add_parameter_server, remove_parameter_server), by outcome: done|failed.",
    ["outcome"], registry=REGISTRY)
TABLE_ROWS_MOVED = Counter(
    "pstrain_coordinator_table_rows_moved_total",
    "Rows of dynamic tables moved between parameter servers (adds and drains).",
    registry=REGISTRY)
TABLE_ROWS_AHEAD = Counter(
    "pstrain_coordinator_table_rows_copied_ahead_total",
    "Rows of dynamic tables copied to their destination ahead of a move, while "
    "training went on (the move then sends only those changed since).",
    registry=REGISTRY)
TABLE_BYTES_MOVED = Counter(
    "pstrain_coordinator_table_moved_bytes_total",
    "Bytes (values and per-row slots) of dynamic tables moved between servers.",
    registry=REGISTRY)
TABLE_MOVE_SECONDS = Histogram(
    "pstrain_coordinator_table_move_seconds",
    "Seconds each table's move took (its shards' moves in turn).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0), registry=REGISTRY)
for _o in ("done", "failed"):
    TABLE_MOVES.labels(_o)
VARIABLE_MOVES = Counter(
    "pstrain_coordinator_variable_moves_total",
    "Variable shards moved whole between parameter servers (an add's even share, a "
    "drain's shards), by outcome: done|failed.",
    ["outcome"], registry=REGISTRY)
VARIABLE_BYTES_MOVED = Counter(
    "pstrain_coordinator_variable_moved_bytes_total",
    "Bytes (values and optimizer slots) of variable shards moved between servers.",
    registry=REGISTRY)
for _o in ("done", "failed"):
    VARIABLE_MOVES.labels(_o)
TABLE_MOVE_LEFT = Gauge(
    "pstrain_coordinator_table_move_buckets_left",
    "Buckets a table's move under way has still to move (0: none under way); each "
    "source shard's buckets go in one call, so it falls a source at a time.",
    ["table"], registry=REGISTRY)
CHECKPOINT_SECONDS = Histogram(
    "pstrain_checkpoint_seconds",
    "Seconds a checkpoint save or restore took (successful ones), by op save|restore.",
    ["op"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0, 300.0, 600.0), registry=REGISTRY)
CHECKPOINT_BYTES = Counter(
    "pstrain_checkpoint_bytes_total",
    "Bytes of shard files written by saves / read by restores (successful ones).",
    ["op"], registry=REGISTRY)
CHECKPOINT_FAILURES = Counter(
    "pstrain_checkpoint_failures_total", "Checkpoint saves or restores that raised, by op.",
    ["op"], registry=REGISTRY)
for _op in ("save", "restore"):
    CHECKPOINT_SECONDS.labels(_op)
    CHECKPOINT_BYTES.labels(_op)
    CHECKPOINT_FAILURES.labels(_op)
DATA_BATCHES = Counter(
    "pstrain_coordinator_data_batches_total",
    "Batches of sharded datasets, by outcome: dispatched (bound to a closure when a worker "
    "took it), acknowledged (its closure's result came back), rerun (handed out again: its "
    "closure did not come back).", ["outcome"], registry=REGISTRY)
for _o in ("dispatched", "acknowledged", "rerun"):
    DATA_BATCHES.labels(_o)
#: Evaluations beside training: source "fit" (fit's background validation)
#: or "sidecar" (`coordinator evaluate`, coordinator/evaluation.py).
EVALUATIONS = Counter(
    "pstrain_evaluations_total",
    "Evaluations, by source (fit: fit's background validation; sidecar: coordinator "
    "evaluate) and outcome: ok, failed (raised), skipped (due while the previous one still "
    "ran; sidecar: checkpoints passed over for a newer one), abandoned (ran past its "
    "timeout).", ["source", "outcome"], registry=REGISTRY)
EVALUATION_SECONDS = Histogram(
    "pstrain_evaluation_seconds", "Seconds an evaluation took (those that ended ok).",
    ["source"], buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0),
    registry=REGISTRY)
EVALUATION_METRIC = Gauge(
    "pstrain_evaluation_metric", "The latest value of each metric an evaluation returned.",
    ["source", "metric"], registry=REGISTRY)
EVALUATION_STEP = Gauge(
    "pstrain_evaluation_step",
    "What the latest evaluation evaluated: the epoch (fit) or the checkpoint's step (sidecar).",
    ["source"], registry=REGISTRY)


class _CoordinatorCollector(Collector):
    """Gauges read at scrape time from the live coordinators (their Clusters,
    coordinator/cluster.py)."""

    def __init__(self):
        self.clusters: "weakref.WeakSet" = weakref.WeakSet()

    def collect(self):
        coords = [c for c in list(self.clusters) if not c.closed]
        queued = running = alive = known = 0
        max_gap = 0
        away: dict[str, float] = {}
        for c in coords:
            for addr, since in c.recovery.unreachable().items():
                away[addr] = min(since, away.get(addr, since))
            q, r = c.queue.counts()
            queued, running = queued + q, running + r
            alive += c.workers_alive()
            known += c.num_workers
            max_gap = max(max_gap, c.staleness_stats()["max_gap"])
        for name, doc, value in (
                ("pstrain_coordinator_closures_queued", "Closures waiting in the queue.", queued),
                ("pstrain_coordinator_closures_running", "Closures in flight on workers.",
                 running),
                ("pstrain_coordinator_workers_alive",
                 "Workers that answered their last call.", alive),
                ("pstrain_coordinator_workers", "Workers in the cluster spec.", known),
                ("pstrain_coordinator_max_clock_gap",
                 "Bounded mode: the largest lead (steps) a worker had over the slowest live "
                 "worker when it started a step.", max_gap),
                ("pstrain_coordinators", "ClusterCoordinators running in this process.",
                 len(coords)),
                ("pstrain_coordinator_ps_unreachable",
                 "Parameter servers that do not answer now (see "
                 "pstrain_coordinator_ps_unreachable_seconds for which, and since when).",
                 len(away))):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        g = GaugeMetricFamily("pstrain_coordinator_ps_unreachable_seconds",
                              "Seconds each parameter server that does not answer now has "
                              "been away.", labels=["address"])
        now = time.time()
        for addr, since in sorted(away.items()):
            g.add_metric([addr], now - since)
        yield g

    def describe(self):
        return []


_collector = _CoordinatorCollector()
REGISTRY.register(_collector)

_serve_lock = threading.Lock()
_server: "_pm.MetricsServer | None" = None


def serve(port: int = 0, host: str | None = None) -> tuple[str, int]:
    """Serve this process's coordinator metrics at http://host:port/metrics.

    One endpoint per process: a second call returns the running one's
    (host, port). Port 0 picks a free port. ``host`` defaults to
    $PSTRAIN_METRICS_HOST, else 127.0.0.1 (0.0.0.0 for a Prometheus on
    another machine). Raises OSError if the address cannot be bound.
    """
    global _server
    with _serve_lock:
        if _server is None:
            host = host or os.environ.get(HOST_ENV) or "127.0.0.1"
            _server = _pm.serve(REGISTRY, port, host)
            log.info("coordinator metrics on %s", _server.address)
        return _server.host, _server.port


def address() -> str | None:
    """"HOST:PORT" of this process's endpoint, None when not serving."""
    return _server.address if _server is not None else None


def track(cluster) -> None:
    """Count a ClusterCoordinator's ``cluster`` in the gauges; start the
    endpoint if $PSTRAIN_METRICS_PORT asks.

    A port from the environment that cannot be bound only warns.
    """
    _collector.clusters.add(cluster)
    if _server is not None:
        return
    try:
        port = _pm.env_port()
    except ValueError as exc:
        log.warning("no coordinator metrics: %s", exc)
        return
    if port is None:
        return
    try:
        serve(port)
    except OSError as exc:
        log.warning("no coordinator metrics: cannot listen on port %d (from $%s): %s",
                    port, PORT_ENV, exc)


# -- hooks (called by coordinator.closures and coordinator.checkpoint) -----------------------
def closure_result(abandoned: bool) -> None:
    (CLOSURES_ABANDONED if abandoned else CLOSURES_SUCCEEDED).inc()


def closure_error(error: BaseException, cancelled: bool) -> None:
    if cancelled:
        CLOSURES_CANCELLED.inc()
    else:
        CLOSURES_FAILED.labels(type(error).__name__).inc()


def timed_checkpoint(op: str):
    """Decorator: time a checkpoint save/restore (successful ones), count failures."""
    def wrap(fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                CHECKPOINT_FAILURES.labels(op).inc()
                raise
            CHECKPOINT_SECONDS.labels(op).observe(time.perf_counter() - start)
            return out
        return timed
    return wrap


def checkpoint_bytes(op: str, n: int) -> None:
    CHECKPOINT_BYTES.labels(op).inc(n)


def data_batches(outcome: str) -> None:
    DATA_BATCHES.labels(outcome).inc()


def evaluation(source: str, outcome: str, seconds: float | None = None, step: int | None = None,
               values: dict | None = None) -> None:
    """Count an evaluation; an ok one also sets its step and metrics."""
    EVALUATIONS.labels(source, outcome).inc()
    if outcome != "ok":
        return
    if seconds is not None:
        EVALUATION_SECONDS.labels(source).observe(seconds)
    if step is not None:
        EVALUATION_STEP.labels(source).set(step)
    for name, v in (values or {}).items():
        EVALUATION_METRIC.labels(source, name).set(v)
