"""What the servicers' handlers share (psserver/serve/servicer.py, psserver/serve/tables.py):
a call's deadline, and the plain values of the message fields both services
read. The messages are read by attribute: this module imports neither grpc
nor protobuf.
"""
from __future__ import annotations

import time

from psserver.contract import SyncSpec


def deadline_of(context) -> float | None:
    """The call's deadline on time.monotonic()'s clock (None: no deadline, or
    no context: a call made in process). Every transport's context answers
    ``time_remaining()`` (gRPC's, psserver/serve/ipc_server.py's)."""
    remaining = context.time_remaining() if context is not None else None
    return None if remaining is None else time.monotonic() + remaining


def sync_spec_of(request) -> SyncSpec | None:
    """The SyncSpec a request's ``sync`` (a SyncInfo) carries, not validated;
    None when the field is unset (an asynchronous update)."""
    return SyncSpec.of(request.sync) if request.HasField("sync") else None


def save_fields(request) -> dict:
    """An incremental save's fields of a SaveRequest or SaveTableRequest, as
    psserver.core.saving.Saver.check_save takes them (it checks them)."""
    return dict(save_id=request.save_id, since=request.since, incarnation=request.incarnation,
                stream=request.stream, weights_only=request.weights_only)
