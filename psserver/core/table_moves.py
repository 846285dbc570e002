"""Elastic servers: a table shard hands the rows of some buckets of its key
space to the shard of the same table on another server (tables.proto
MoveBuckets; the coordinator's side is coordinator/elastic.py).

Under the shard's lock, so that no look-up or update of this shard runs
meanwhile: the rows of the buckets (their values, per-row slots, look-up
counts and ages, psserver.core.dynamic_table.DynamicTable.export) and the
shard's memory of applied update keys go to the destination (its Import, in
pieces); only once it has them all are they dropped here, and the shard
refuses keys of those buckets from then on (TableShardCopy.check_here:
NotPrimary, nothing applied; the caller reads the table's layout, which
Info serves, and sends them where it says). A
copy that fails changes nothing here; the destination may hold some of the
rows until it is told the table's layout (``set_layout``: it drops rows of
buckets other shards hold). A caller whose move call failed learns for sure
whether it happened with a ``fence``. The rows are dropped as evicted for
the shard's change tracking, so the next incremental save records them
gone; the shard's statistics do not count them as evictions. Not for a
replicated shard (its backup would have to follow the move: refused,
FailedPrecondition).
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from psserver.contract import keys as K
from psserver.contract.keys import MAX_LAYOUT_BYTES, bucket_of
from psserver.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument

#: Testing switch: "source:FILE" or "destination:FILE": the server dies
#: (exit 3) in the middle of a move, as its source (the rows sent, before it
#: commits) or as its destination (a piece of them received), once: only
#: while FILE does not exist (made first, so a restarted server moves on).
FAULT_CRASH_IN_MOVE_ENV = "PSTRAIN_FAULT_CRASH_IN_MOVE"


def crash_point(role: str) -> None:
    """Die here if FAULT_CRASH_IN_MOVE_ENV names ``role`` (tests only)."""
    want, _, flag = os.environ.get(FAULT_CRASH_IN_MOVE_ENV, "").partition(":")
    if want == role and flag and not os.path.exists(flag):
        open(flag, "w").close()
        os._exit(3)


def parse_layout(epoch: int, layout: str) -> np.ndarray:
    """The owner of each bucket in ``layout`` (psserver.contract.keys
    layout_json's text, of epoch ``epoch``); InvalidArgument for anything else."""
    if not 0 <= epoch < 1 << 62:
        raise InvalidArgument(f"a move's layout epoch is in [0, 2**62), got {epoch}")
    if len(layout.encode()) > MAX_LAYOUT_BYTES:
        raise InvalidArgument(f"a move's layout takes at most {MAX_LAYOUT_BYTES} bytes")
    got, _, buckets = K.parse_layout(layout)
    if got != epoch:
        raise InvalidArgument(f"a layout is JSON of the move's epoch {epoch}, got epoch {got}")
    return buckets.owner


def set_layout(copy, epoch: int, layout: str, shard: int) -> int:
    """This shard is shard ``shard`` of ``layout`` (of ``epoch``) from now on,
    moving nothing: it serves the layout, refuses keys of the buckets it
    gives other shards, and drops rows of such keys (a copy a failed move
    left on its destination). A layout older than the shard's is ignored.
    Returns the rows dropped."""
    owner = parse_layout(epoch, layout)
    if not 0 <= shard < int(owner.max()) + 1:
        raise InvalidArgument(f"shard {shard} is not one of the layout's")
    with copy.lock:
        if epoch < copy.moved_epoch:
            return 0
        others = owner != shard
        copy.moved = others if others.any() else None
        copy.moved_epoch, copy.layout = epoch, layout
        t = copy.table
        keys, _ = t.index.items()
        stray = keys[others[bucket_of(keys)]]
        if stray.size:
            t.drop(stray)
            copy.version += 1
        return int(stray.size)


def fence(copy, epoch: int) -> bool:
    """Whether a move of ``epoch`` was made from this shard; if not, none of
    ``epoch`` or earlier is made from now on (answered under the shard's
    lock: after any move running now; the same answer every time)."""
    if not 0 < epoch < 1 << 62:
        raise InvalidArgument(f"a fence's layout epoch is in [1, 2**62), got {epoch}")
    with copy.lock:
        if epoch in copy.move_epochs:
            return True
        copy.fenced_epoch = max(copy.fenced_epoch, epoch)
        return False


def check_move(capacity: int | None, epoch: int, layout: str,
               destination_capacity: int | None = None) -> None:
    """A move's capacities and layout, checked (InvalidArgument)."""
    for c in (capacity, destination_capacity):
        if c is not None and not 0 <= c < 1 << 40:
            raise InvalidArgument(f"a move's capacities are integers in [0, 2**40), got {c}")
    parse_layout(epoch, layout)


def move_buckets(copy, mask: np.ndarray, send: Callable[[dict, int, list], None],
                 capacity: int | None, epoch: int, layout: str,
                 deadline: float | None = None, leaves: bool = False) -> tuple[int, int, int]:
    """Hand the rows of the buckets in ``mask`` to another server: ``send(state,
    step, applied)`` puts them there with the update keys applied to them
    (TableShardCopy.export_applied), raising if it could not (nothing
    changes here then). ``capacity``: this shard's part of the table's capacity
    afterwards (None: unchanged); ``epoch``: the table's layout epoch
    after the move, named in refusals, and ``layout`` that layout (JSON,
    served by Info from then on: the caller of a refused key reads it);
    ``leaves``: the shard holds no bucket afterwards (a drain's last move:
    ``copy.drained``, what a leaving server waits for). Past ``deadline``
    (time.monotonic()) once the rows are sent, nothing changes here
    (DeadlineExceeded: the caller gave up). Returns (rows, bytes, rows held)."""
    check_move(capacity, epoch, layout)
    with copy.lock:
        copy.check_primary()
        if copy.link is not None:
            raise FailedPrecondition(
                f"table {copy.table_name!r}: this shard is replicated (it has a backup copy); "
                "moving its buckets to another server is not supported with replication yet. "
                "Nothing was moved")
        if copy.acc is not None:
            raise FailedPrecondition(
                f"table {copy.table_name!r}: a sync step is being gathered on this shard; move "
                "its buckets between steps (nothing was moved)")
        if epoch <= max(copy.moved_epoch, copy.fenced_epoch):
            raise InvalidArgument(f"table {copy.table_name!r}: layout epoch {epoch} is not newer "
                                  f"than this shard's ({max(copy.moved_epoch, copy.fenced_epoch)})"
                                  "; nothing was moved")
        if copy.moved is not None and (copy.moved & mask).any():
            raise InvalidArgument(f"table {copy.table_name!r}: some of these buckets were "
                                  "handed to another server already; nothing was moved")
        t = copy.table
        keys, _ = t.index.items()
        keys = np.sort(keys[mask[bucket_of(keys)]])
        state = t.export(keys)
        state.pop("evicted", None)
        send(state, t.step, copy.export_applied(mask))
        crash_point("source")
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineExceeded(
                f"table {copy.table_name!r}: the move's rows reached the destination after "
                "the caller's deadline; nothing moved here (the destination drops its copy "
                "when told the table's layout)")
        nbytes = sum(a.nbytes for k, a in state.items()
                     if k == "values" or (k.startswith("slot/") and np.ndim(a)))
        t.drop(keys)
        copy.moved = mask.copy() if copy.moved is None else copy.moved | mask
        copy.moved_epoch, copy.layout = epoch, layout
        copy.drained = copy.drained or leaves
        copy.move_epochs.append(epoch)
        if capacity is not None:   # (rows past it evicted now)
            t.set_capacity(capacity, evict=True)
            copy.spec = copy.spec.with_capacity(capacity)
        copy.version += 1
        return int(keys.size), int(nbytes), len(t)
