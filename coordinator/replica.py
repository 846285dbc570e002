"""The replica context of a running step: which sync step and replica it is.

In sync mode each scheduled step runs as ``num_replicas_in_sync`` closures,
one per replica, each on its slice of the global batch. Inside a step
function, ``get_replica_context()`` says which slice this is (as
``tf.distribute.get_replica_context().replica_id_in_sync_group`` does), and
the variable operations of ``coordinator.variables`` use it to tag their
reads and pushes. Outside sync mode it reports replica 0 of 1 and no step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

from psserver.contract import SyncSpec


@dataclasses.dataclass(frozen=True)
class ReplicaContext:
    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1
    step: int | None = None            # the global sync step; None outside sync mode
    sync: SyncSpec | None = None       # what the parameter servers need to know


_local = threading.local()


def get_replica_context() -> ReplicaContext:
    """The context of the step running on this thread."""
    return getattr(_local, "ctx", None) or ReplicaContext()


def current_sync() -> SyncSpec | None:
    ctx = getattr(_local, "ctx", None)
    return ctx.sync if ctx is not None else None


@contextlib.contextmanager
def replica_scope(sync: SyncSpec | None):
    """Run the body as the given replica of a sync step (None: not sync)."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = None if sync is None else ReplicaContext(
        sync.replica, sync.num_replicas, sync.step, sync)
    try:
        yield
    finally:
        _local.ctx = previous
