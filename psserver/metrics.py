"""Prometheus metrics: the kit every role uses (tasks and the coordinator).

Each process keeps its metrics in a ``prometheus_client.CollectorRegistry``
of its own (never the library's global default), made by the command that
starts the task, so tasks and tests in one process never collide. Nothing
here runs unless metrics are switched on: ``psserver --metrics-port N`` /
``psworker --metrics-port N`` (or ``$PSTRAIN_METRICS_PORT``); 0 picks a free
port, and the task prints ``<role> metrics on HOST:PORT`` before its
``<role> listening on HOST:PORT`` line. The endpoint is plain HTTP
(``GET /metrics``), unauthenticated: it exposes counts and timings, never
variable values or names. What a task exports is psserver/serve/task_metrics.py;
the coordinator's, coordinator/metrics.py.
"""
from __future__ import annotations

import os
import sys
import threading

from prometheus_client import (
    CollectorRegistry,
    disable_created_metrics,
    start_http_server,
)

#: Default of ``--metrics-port`` (psserver, psworker) and of the coordinator's
#: metrics (coordinator.metrics): a port number, 0 for a free one. Unset: off.
PORT_ENV = "PSTRAIN_METRICS_PORT"
#: Default bind address of the metrics endpoint (tasks: their ``--host``
#: otherwise; the coordinator: 127.0.0.1 otherwise).
HOST_ENV = "PSTRAIN_METRICS_HOST"

#: Seconds: gRPC calls, sync barrier waits.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Seconds: a step closure on a worker.
CLOSURE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Steps a gradient is behind.
STALENESS_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50, 100)


def new_registry(process: bool = True) -> CollectorRegistry:
    """A registry of this task's own, with the process collectors
    (``process_*`` CPU, memory, open files; ``python_gc_*``; ``python_info``)."""
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
    registry = CollectorRegistry(auto_describe=True)
    if process:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


def env_port(environ=os.environ) -> int | None:
    """$PSTRAIN_METRICS_PORT as a port number, None if unset or empty.

    Raises ValueError if it is not a port number."""
    raw = (environ.get(PORT_ENV) or "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"${PORT_ENV} must be a port number (0: a free one), "
                         f"got {raw!r}") from None
    check_port(port, f"${PORT_ENV}")
    return port


def check_port(port: int, what: str = "--metrics-port") -> int:
    if not 0 <= port <= 65535:
        raise ValueError(f"{what} must be in 0..65535 (0: a free one), got {port}")
    return port


class MetricsServer:
    """A running metrics endpoint: ``host``, ``port`` (the bound one), ``address``."""

    def __init__(self, httpd, thread: threading.Thread, host: str):
        self._httpd, self._thread = httpd, thread
        self.host, self.port = host, httpd.server_port

    @property
    def address(self) -> str:
        host = self.host.strip("[]")
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at http://host:port/metrics from a daemon thread.

    Port 0 binds a free port (``.port`` says which). Raises OSError if the
    address cannot be bound.
    """
    check_port(port)
    httpd, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    return MetricsServer(httpd, thread, host)


# -- the --metrics-port / --metrics-host options of psserver and psworker ---------------------
def add_arguments(parser) -> None:
    g = parser.add_argument_group("metrics (Prometheus)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics; 0 picks a free "
                        f"port, printed as '<role> metrics on HOST:PORT' (default: ${PORT_ENV} "
                        "if set, else no metrics)")
    g.add_argument("--metrics-host", default=None,
                   help=f"address the metrics endpoint binds (default: ${HOST_ENV} if set, "
                        "else --host)")


def start_from_arguments(args, role: str, default_host: str) -> tuple[CollectorRegistry,
                                                                      MetricsServer] | None:
    """Start the metrics endpoint the options (or $PSTRAIN_METRICS_PORT) ask for.

    Returns (registry, server), or None when metrics are off. Prints
    ``<role> metrics on HOST:PORT``. Raises ValueError for a bad port, and
    OSError when ``--metrics-port`` cannot be bound. A port that comes from
    ``$PSTRAIN_METRICS_PORT`` and cannot be bound (tasks started by
    LocalCluster inherit the variable) only warns: the task runs without metrics.
    """
    explicit = args.metrics_port is not None
    port = check_port(args.metrics_port) if explicit else env_port()
    if port is None:
        return None
    host = args.metrics_host or os.environ.get(HOST_ENV) or default_host
    # A task process's own exposition: no "<counter>_created" series (they only
    # double the output; process_start_time_seconds says when counting began).
    disable_created_metrics()
    registry = new_registry()
    try:
        server = serve(registry, port, host)
    except OSError as exc:
        if explicit:
            raise
        print(f"{role}: no metrics: cannot listen on {host}:{port} (from ${PORT_ENV}): {exc}",
              file=sys.stderr, flush=True)
        return None
    print(f"{role} metrics on {server.address}", flush=True)
    return registry, server
