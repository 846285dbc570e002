"""The replica context of a running step: which sync step and replica it is.

In sync and hybrid modes each scheduled step runs as
``num_replicas_in_sync`` closures, one per replica, each on its slice of
the global batch. Inside a step function, ``get_replica_context()`` says
which slice this is (as
``tf.distribute.get_replica_context().replica_id_in_sync_group`` does), and
the variable operations of ``coordinator.variables`` and
``coordinator.embedding`` use it to tag their reads and pushes: dense ones
with ``current_sync()``, the row-wise ones of embedding tables with
``rows_sync()`` (None in hybrid mode: applied on arrival). Outside these
modes it reports replica 0 of 1 and no step. In all-reduce mode
(coordinator/mirrored.py) each replica runs on a worker of the step's
group, and the context carries that group (``collective``).
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
    step: int | None = None            # the global step; None outside sync and hybrid modes
    sync: SyncSpec | None = None       # what the parameter servers need to know
    collective: "CollectiveSpec | None" = None   # all-reduce mode: the step's group


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
    """One replica of an all-reduce step (CollectiveInfo in worker.proto):
    the group its workers form, and how its gradients are combined."""
    group: str
    members: tuple[str, ...]
    rank: int
    step: int
    timeout: float
    sum: bool = False
    compression: str | None = None
    job: str = ""

    @classmethod
    def of(cls, info) -> "CollectiveSpec":
        """The spec a CollectiveInfo message carries, checked (ValueError)."""
        spec = cls(info.group, tuple(info.members), info.rank, info.step, info.timeout,
                   info.sum, info.compression or None, info.job)
        n = len(spec.members)
        if not spec.group or not spec.job or n < 1 or len(set(spec.members)) != n \
                or not 0 <= spec.rank < n or spec.step < 0 or not spec.timeout > 0 \
                or spec.compression not in (None, "fp16"):
            raise ValueError(f"a malformed all-reduce step: {spec}")
        return spec

    def message(self) -> dict:
        """CollectiveInfo's fields."""
        return dict(group=self.group, members=list(self.members), rank=self.rank,
                    step=self.step, timeout=self.timeout, sum=self.sum,
                    compression=self.compression or "", job=self.job)


_local = threading.local()


def get_replica_context() -> ReplicaContext:
    """The context of the step running on this thread."""
    return getattr(_local, "ctx", None) or ReplicaContext()


def current_sync() -> SyncSpec | None:
    """The running step's SyncSpec (sync and hybrid modes), else None."""
    ctx = getattr(_local, "ctx", None)
    return ctx.sync if ctx is not None else None


def rows_sync() -> SyncSpec | None:
    """The SyncSpec that embedding tables' row-wise gradients and dynamic
    tables' look-ups go with: the step's in sync mode; None in hybrid mode
    (applied on arrival, as in async mode) and outside sync steps."""
    sync = current_sync()
    return None if sync is None or sync.hybrid else sync


@contextlib.contextmanager
def replica_scope(sync: SyncSpec | None, collective: CollectiveSpec | None = None):
    """Run the body as the given replica of a sync step, or of an all-reduce
    step (None, None: neither)."""
    previous = getattr(_local, "ctx", None)
    if collective is not None:
        _local.ctx = ReplicaContext(collective.rank, len(collective.members), collective.step,
                                    None, collective)
    else:
        _local.ctx = None if sync is None else ReplicaContext(
            sync.replica, sync.num_replicas, sync.step, sync)
    try:
        yield
    finally:
        _local.ctx = previous
