"""What both ends of a gRPC connection agree on: channel and server options,
the client's retry policy, and the status code of a typed error.

``grpc_options`` is the one set of options a task's server and every
client channel use (message limits, keepalive, reconnect backoff).
``service_config`` declares retries in the channel, as the gRPC retry
example does (STYLE #12): every call of ``methods.IDEMPOTENT`` (and the
ReadStream stream) is retried by gRPC on UNAVAILABLE, with backoff, so a
server's restart under an idempotent call costs a short wait, not an error.
It is built from that set, so it cannot drift from what the socket path
re-makes after a broken connection (psserver/link/channel.py).
"""
from __future__ import annotations

import json

import grpc

from psserver.contract import MESSAGE_OVERHEAD
from psserver.errors import Code
from psserver.link import methods

#: gRPC's own retries of idempotent calls (attempts include the first).
RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "2s",
                "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options shared by both sides of the wire."""
    limit = max_message_bytes + MESSAGE_OVERHEAD
    return [("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            # Detect a dead or cut-off peer within KEEPALIVE (10 s) + 5 s even
            # when no call is in flight, and keep idle connections through NATs.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Servers accept those pings (the default minimum is 5 minutes).
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            # A second server on a port in use must fail, not share the port.
            ("grpc.so_reuseport", 0),
            # Reconnect to a restarted peer within 0.1 s, not gRPC's default 1 s
            # (measured: recovery of a killed parameter server 1.0 s -> 0.35 s).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2_000)]


def service_config() -> str:
    """The channel's service config: gRPC retries every idempotent call."""
    names = sorted({(m.service, m.name) for m in methods.IDEMPOTENT}
                   | {(methods.PS, "ReadStream")})
    return json.dumps({"methodConfig": [{
        "name": [{"service": s, "method": n} for s, n in names],
        "retryPolicy": RETRY_POLICY}]})


def client_options(max_message_bytes: int) -> list[tuple]:
    """A client channel's options: the shared ones and the retry policy."""
    return grpc_options(max_message_bytes) + [("grpc.service_config", service_config()),
                                              ("grpc.enable_retries", 1)]


_GRPC = {c.value[0]: c for c in grpc.StatusCode}


def grpc_code(code: Code) -> grpc.StatusCode:
    """The gRPC status code of ``code`` (same number): what a servicer aborts a
    call with for a typed error (psserver.errors)."""
    return _GRPC[int(code)]
