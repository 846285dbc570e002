"""A step's update keys: ``new_update_id`` / ``update_key_scope``.

A push's idempotency key is random, or inside a step of an exactly-once
sharded dataset derived from its batch (coordinator/sharded.py), so a
re-run of the batch sends the same keys; outside one, an all-reduce step's
are derived from its job, step and worker (psworker/worker.py, through
sources.batch_scope's fallback), so its run again on that worker does. (How a step's calls are sent,
settled and resent with them: coordinator/ps_pool.py.)
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading

# -- update keys -----------------------------------------------------------------
_keys = threading.local()


class _DerivedKeys:
    """Update keys of one step, derived from ``seed`` (what the step is: an
    exactly-once batch, coordinator/sharded.py, or an all-reduce step on a
    worker; ``from_batch`` says which): the n-th key asked for
    ``label`` (a variable shard, a table shard) is a hash of (seed, label, n)."""

    def __init__(self, seed: bytes, from_batch: bool = True):
        self.seed, self.from_batch = seed, from_batch
        self._counts: dict[str, int] = {}

    def next(self, label: str) -> int:
        n = self._counts.get(label, 0)
        self._counts[label] = n + 1
        h = hashlib.blake2b(self.seed, digest_size=8,
                            person=b"pstrain-upd-key")
        h.update(len(label).to_bytes(4, "little") + label.encode())
        h.update(n.to_bytes(8, "little"))
        return (int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)) or 1


@contextlib.contextmanager
def update_key_scope(seed: bytes | None, from_batch: bool = True):
    """Inside the body, on this thread, ``new_update_id(label)`` derives its
    keys from ``seed`` (None: random keys, as outside any scope). A step run
    twice in scopes of the same seed, making the same pushes in the same
    order per label, sends the same keys both times: a parameter server that
    applied one drops the other (it remembers the keys of its last
    APPLIED_IDS_KEPT updates per shard, psserver/core/replication.py).
    ``from_batch``: the seed names an exactly-once batch (whose every run
    sends the same data), not a step's run on a worker."""
    previous = getattr(_keys, "scope", None)
    _keys.scope = None if seed is None else _DerivedKeys(seed, from_batch)
    try:
        yield
    finally:
        _keys.scope = previous


def keys_from_batch() -> bool:
    """Whether they are derived from an exactly-once batch (the same data
    whichever run sends them)."""
    return getattr(getattr(_keys, "scope", None), "from_batch", False)


def new_update_id(label: str = "") -> int:
    """A non-zero 63-bit idempotency key: random, or inside update_key_scope
    derived from its seed, ``label`` (what the key is for: a variable shard
    "name#k", a table shard "~table~name#i") and how many keys this step asked
    for that label before."""
    scope = getattr(_keys, "scope", None)
    if scope is None:
        return (int.from_bytes(os.urandom(8), "little") >> 1) or 1
    return scope.next(label)
