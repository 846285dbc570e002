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
from psserver.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotPrimary

#: Testing switch: "source:FILE", "destination:FILE" or "ahead:FILE": the
#: server dies (exit 3) in the middle of a move, as its source (the rows
#: sent, before it commits), as its destination (a piece of them received)
#: or as the destination of its copy ahead (a piece of it received), once:
#: only while FILE does not exist (made first, so a restarted server moves on).
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
    left on its destination) and every copy ahead of a move held here (a
    move that took it in unstaged it). A layout older than the shard's is
    ignored. Returns the rows dropped."""
    owner = parse_layout(epoch, layout)
    if not 0 <= shard < int(owner.max()) + 1:
        raise InvalidArgument(f"shard {shard} is not one of the layout's")
    with copy.lock:
        if epoch < copy.moved_epoch:
            return 0
        others = owner != shard
        copy.moved = others if others.any() else None
        copy.moved_epoch, copy.layout = epoch, layout
        if copy.staged_mask is not None:   # (copies ahead no move took in: they go too)
            others = others | copy.staged_mask
            copy.unstage(None)
        _release_upto(copy, None)   # (and, as a source, its copies' change points)
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
        _release_upto(copy, epoch)
        if epoch in copy.move_epochs:
            return True
        copy.fenced_epoch = max(copy.fenced_epoch, epoch)
        return False


def check_move(capacity: int | None, epoch: int, layout: str,
               destination_capacity: int | None = None, layout_needed: bool = True) -> None:
    """A move's capacities and layout (``layout_needed``: a copy ahead names
    none, only its epoch), checked (InvalidArgument)."""
    for c in (capacity, destination_capacity):
        if c is not None and not 0 <= c < 1 << 40:
            raise InvalidArgument(f"a move's capacities are integers in [0, 2**40), got {c}")
    if layout_needed:
        parse_layout(epoch, layout)
    elif not 0 < epoch < 1 << 62:
        raise InvalidArgument(f"a move's layout epoch is in [1, 2**62), got {epoch}")


def _check_source(copy, mask: np.ndarray, epoch: int, moving: bool = True) -> None:
    """A move's (or, not ``moving``, its copy ahead's: a sync step may be
    gathered meanwhile, its rows then sent as changed) checks on its
    source (lock held)."""
    copy.check_primary()
    if copy.link is not None:
        raise FailedPrecondition(
            f"table {copy.table_name!r}: this shard is replicated (it has a backup copy); "
            "moving its buckets to another server is not supported with replication yet. "
            "Nothing was moved")
    if moving and copy.acc is not None:
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
    if copy.staged_mask is not None and (copy.staged_mask & mask).any():
        raise InvalidArgument(f"table {copy.table_name!r}: some of these buckets are held here "
                              "only as a copy ahead of another server's move; nothing was moved")


def _rows_in(t, mask: np.ndarray, ordered: bool = True) -> np.ndarray:
    """The keys of ``t``'s rows in the buckets of ``mask`` (sorted: ``ordered``)."""
    keys, _ = t.index.items()
    keys = keys[mask[bucket_of(keys)]]
    return np.sort(keys) if ordered else keys


#: The change-tracking streams of moves' copies ahead (saves name theirs).
MOVE_STREAM = "~move"


def precopy(copy, mask: np.ndarray, destination: str, send: Callable[[dict, int], None],
            epoch: int) -> tuple[int, int]:
    """Copy the rows of the buckets in ``mask`` to ``destination`` ahead of
    their move of ``epoch`` (``send(state, step)``: its staged import),
    while this shard goes on serving them: the rows are taken under the
    lock with a change point (psserver.core.tracking: stream
    ``MOVE_STREAM/<epoch>``, anchored until the move takes what changed
    since, so no save's commit drops it), sent without it. The move then
    sends only the rows changed since (move_buckets); a failed send leaves
    no copy to build on (the move sends the rows whole). Returns (rows,
    bytes) copied."""
    stream = f"{MOVE_STREAM}/{epoch}"
    with copy.lock:
        _check_source(copy, mask, epoch, moving=False)
        _release(copy, copy.precopied.pop(epoch, None))
        t = copy.table
        copy.move_points -= 1
        point = copy.move_points
        t.take_changes(point, stream, 0)
        t.tracker.log.commit(point, stream)
        state = t.export(_rows_in(t, mask))
        state.pop("evicted", None)
        step = t.step
    try:
        send(state, step)
    except BaseException:
        with copy.lock:
            if copy.table is t and t.tracker is not None:
                t.tracker.log.release(stream)
        raise
    with copy.lock:   # (a restore, a fence or the move meanwhile: nothing to build on)
        if copy.table is t and t.tracker is not None and \
                epoch > max(copy.moved_epoch, copy.fenced_epoch):
            _release(copy, copy.precopied.pop(epoch, None))
            copy.precopied[epoch] = (mask.copy(), destination, point, stream,
                                     time.monotonic())
            while len(copy.precopied) > MAX_PRECOPIED:   # (the oldest plan's go first)
                _release(copy, copy.precopied.pop(min(copy.precopied)))
        elif t.tracker is not None:
            t.tracker.log.release(stream)
    return int(state["keys"].size), int(state["keys"].size) * t.moved_row_bytes


#: Copies ahead a source shard keeps the change points of (one per move
#: planned from it: a drain to several servers).
MAX_PRECOPIED = 16


#: Seconds a copy ahead's change point is kept for its move (the moves come
#: once the steps end: the coordinator waits 300 s by default); past them a
#: save releases it (a coordinator that died or gave up: changes pile up).
PRECOPY_KEEP_SECONDS = 900.0


def expire_copies(copy) -> None:
    """Release the change points of copies ahead older than
    PRECOPY_KEEP_SECONDS (lock held; a save calls it: their move then
    sends the rows whole)."""
    old = time.monotonic() - PRECOPY_KEEP_SECONDS
    for e in [e for e, pre in copy.precopied.items() if pre[4] < old]:
        _release(copy, copy.precopied.pop(e))


def _release_upto(copy, epoch: int | None) -> None:
    """Copies ahead of moves of ``epoch`` or earlier (None: every one) are
    built on no more: their change points released (lock held)."""
    for e in [e for e in copy.precopied if epoch is None or e <= epoch]:
        _release(copy, copy.precopied.pop(e))


def _release(copy, pre: tuple | None) -> None:
    """A copy ahead's change point is asked for no more (lock held)."""
    if pre is not None and copy.table.tracker is not None:
        copy.table.tracker.log.release(pre[3])


def _changes_since(copy, mask: np.ndarray, destination: str, epoch: int):
    """The keys of ``mask``'s buckets changed (made, updated, looked up,
    evicted) since this move's copy ahead reached ``destination``, sorted;
    None where there was none or what changed is not known (lock held)."""
    pre = copy.precopied.pop(epoch, None)
    t = copy.table
    if pre is None or pre[1] != destination or not np.array_equal(pre[0], mask) or \
            t.tracker is None:
        _release(copy, pre)
        return None
    copy.move_points -= 1
    changes = t.take_changes(copy.move_points, pre[3], pre[2])
    _release(copy, pre)
    if changes is None or changes.whole:
        return None
    keys = changes.keys if changes.keys is not None else np.zeros(0, np.int64)
    return keys[mask[bucket_of(keys)]]


def move_buckets(copy, mask: np.ndarray, send: Callable[..., None],
                 capacity: int | None, epoch: int, layout: str,
                 deadline: float | None = None, leaves: bool = False,
                 destination: str = "") -> tuple[int, int, int, int]:
    """Hand the rows of the buckets in ``mask`` to another server: ``send(state,
    step, applied, dropped)`` puts them there with the update keys applied
    to them (TableShardCopy.export_applied), raising if it could not
    (nothing changes here then). Where their copy reached ``destination``
    ahead of the move (precopy), only the rows changed since are sent, and
    ``dropped`` are the keys gone since (else None: the rows whole; also
    where the destination refuses the changes: FailedPrecondition, it lost
    the copy). ``capacity``: this shard's part of the table's capacity
    afterwards (None: unchanged); ``epoch``: the table's layout epoch
    after the move, named in refusals, and ``layout`` that layout (JSON,
    served by Info from then on: the caller of a refused key reads it);
    ``leaves``: the shard holds no bucket afterwards (a drain's last move:
    ``copy.drained``, what a leaving server waits for). Past ``deadline``
    (time.monotonic()) once the rows are sent, nothing changes here
    (DeadlineExceeded: the caller gave up). Returns (rows, bytes, rows held,
    rows sent): the rows the destination holds of those buckets now, their
    bytes, the rows left here, and the rows this call sent."""
    check_move(capacity, epoch, layout)
    with copy.lock:
        _check_source(copy, mask, epoch)
        t = copy.table
        keys = _rows_in(t, mask, ordered=False)
        changed = _changes_since(copy, mask, destination, epoch)
        applied, sent = copy.export_applied(mask), False
        if changed is not None:
            state = t.export(changed)
            dropped = state.pop("evicted")
            try:
                send(state, t.step, applied, dropped)
                sent = True
            except FailedPrecondition:   # (the destination lost the copy: send them whole)
                pass
        if not sent:
            keys = np.sort(keys)
            state = t.export(keys)
            state.pop("evicted", None)
            send(state, t.step, applied, None)
        crash_point("source")
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineExceeded(
                f"table {copy.table_name!r}: the move's rows reached the destination after "
                "the caller's deadline; nothing moved here (the destination drops its copy "
                "when told the table's layout)")
        nbytes = keys.size * t.moved_row_bytes
        t.drop(keys)
        copy.moved = mask.copy() if copy.moved is None else copy.moved | mask
        copy.moved_epoch, copy.layout = epoch, layout
        copy.drained = copy.drained or leaves
        copy.move_epochs.append(epoch)
        if capacity is not None:   # (rows past it evicted now)
            t.set_capacity(capacity, evict=True)
            copy.spec = copy.spec.with_capacity(capacity)
        copy.version += 1
        return int(keys.size), int(nbytes), len(t), int(state["keys"].size)


def receive(copy, state: dict, incoming: tuple, first: bool, staged: bool,
            dropped: np.ndarray | None, step: int = 0,
            capacity: int | None = None) -> np.ndarray | None:
    """Before a move's piece goes into this shard (lock held; checked, nothing
    changed yet where it raises): ``staged``, a piece of its copy ahead
    (precopy: the rows go in beside the shard's own, their buckets not its
    own yet); ``dropped`` (not None), a piece of the rows changed since the
    copy (each replaces the copy's row; ``dropped``: keys gone since);
    else a piece of the rows whole. The first piece of a copy ahead or of
    the rows whole replaces what earlier copies ahead of those buckets left
    here (and nothing else: a row the shard holds of them is refused), as
    a first piece of changes drops the keys gone. FailedPrecondition for
    changes with no whole copy ahead here to apply them to (none, or one
    that lost a row since: evicted here). A copy ahead's pieces come at one
    ``step`` of its source, its changes at that step or later; it never
    lowers the shard's ``capacity``, nor takes buckets the shard holds rows
    of. Returns the keys whose rows the piece replaces
    (DynamicTable.import_rows' ``replace``)."""
    mask, epoch = incoming
    keys = state["keys"].reshape(-1)
    if not 0 < epoch < 1 << 62:
        raise InvalidArgument(f"a move's layout epoch is in [1, 2**62), got {epoch}")
    if staged and copy.link is not None:   # (its backup would copy the rows as its own)
        raise FailedPrecondition(f"table {copy.table_name!r}: this shard is replicated; a "
                                 "move's copy ahead is not taken here (nothing changed)")
    if staged and epoch <= max(copy.moved_epoch, copy.move_in_epoch):
        raise NotPrimary(f"table {copy.table_name!r}: this shard knows the table's layout "
                         f"epoch {max(copy.moved_epoch, copy.move_in_epoch)}; a copy ahead of a "
                         f"move of epoch {epoch} came too late and was not taken")
    if staged and copy.received_at is not None and (
            mask & (copy.received_at > 0) & (True if copy.moved is None else ~copy.moved)).any():
        raise InvalidArgument(f"table {copy.table_name!r}: a copy ahead of buckets this shard "
                              "holds (moved here); nothing changed")
    if keys.size and not mask[bucket_of(keys)].all():
        raise InvalidArgument(f"table {copy.table_name!r}: a move's rows are of the buckets "
                              "it brings only; nothing was imported")
    if dropped is not None and (staged or not first and dropped.size):
        raise InvalidArgument("a move's dropped keys come with the first piece of its changes")
    if dropped is not None and dropped.size and not mask[bucket_of(dropped)].all():
        raise InvalidArgument(f"table {copy.table_name!r}: a move's dropped keys are of the "
                              "buckets it brings only; nothing was imported")
    if dropped is not None and first and not (
            epoch in copy.staged and np.array_equal(copy.staged[epoch], mask)):
        raise FailedPrecondition(
            f"table {copy.table_name!r}: no copy of this move's rows (epoch {epoch}) is here "
            "to apply its changes to (this server restarted, or was told the layout since); "
            "nothing changed. Send the rows whole")
    if dropped is not None and first and copy.table.guard_hit[mask].any():
        raise FailedPrecondition(
            f"table {copy.table_name!r}: the copy of this move's rows (epoch {epoch}) lost "
            "rows here since (evicted by capacity or age); nothing changed. Send the rows whole")
    if dropped is not None and not first and copy.move_in_epoch != epoch:
        raise InvalidArgument(f"table {copy.table_name!r}: a piece of a move's changes that "
                              "was not started; nothing changed")
    if staged and not first and epoch not in copy.staged:
        raise InvalidArgument(f"table {copy.table_name!r}: a piece of a copy ahead of a move "
                              "that was not started (the first piece has reset); nothing changed")
    at = copy.staged_base.get(epoch, (0, 0))[1]
    if (staged and not first and step != at) or (dropped is not None and first and step < at):
        raise InvalidArgument(f"table {copy.table_name!r}: a copy ahead's pieces come at one "
                              f"step of its source ({at}) and its changes at that step or later, "
                              f"got {step}; nothing changed")
    before = copy.table.config.capacity
    if staged and capacity and (not before or capacity < before):
        raise InvalidArgument("a move's copy ahead raises the shard's capacity, never "
                              f"lowers it ({before} to {capacity}); nothing changed")
    if staged and first:   # (rows of those buckets outside earlier copies: its own)
        mine = mask if copy.staged_mask is None else mask & ~copy.staged_mask
        if _rows_in(copy.table, mine, ordered=False).size:
            raise InvalidArgument(f"table {copy.table_name!r}: a copy ahead of buckets this "
                                  "shard holds rows of; nothing changed")
    if first and dropped is None:   # (what earlier copies ahead of these buckets left)
        earlier = [m for m in copy.staged.values() if (m & mask).any()]
        return _rows_in(copy.table, np.logical_or.reduce(earlier)) if earlier else None
    if dropped is not None:   # (the rows it replaces, and those gone)
        return np.union1d(keys, dropped.reshape(-1)) if first else keys
    return None


def shift_of(copy, incoming: tuple, step: int, dropped) -> int:
    """For the first piece of a move's changes (``dropped`` not None), at
    ``step`` of its source: how far its copy ahead's other rows' update
    steps are from where the rows sent whole would put them (the shard's
    step counted from the later of its own and the source's, less the
    source's: a copy ahead took both earlier); 0 otherwise (lock held)."""
    if dropped is None or incoming[1] not in copy.staged_base:
        return 0
    t = copy.table
    return max(t.step, step) - step - copy.staged_base[incoming[1]][0]


def rebase(copy, mask: np.ndarray, sent: np.ndarray, shift: int) -> None:
    """After the first piece of a move's changes (lock held): its copy
    ahead's other rows (``mask``'s but the keys ``sent``) as the rows sent
    whole would be: update steps moved by ``shift``, and, where a capacity
    evicts by recency, used now (a whole move's rows are the newest)."""
    t = copy.table
    if not shift and not t.config.capacity:
        return
    rows = t.index.find(np.setdiff1d(_rows_in(t, mask), sent, assume_unique=True))
    t.updated_step[rows] += shift
    t.used_step[rows] = t._tick   # (as DynamicTable.import_rows gives the rows it takes)


def watch(copy, mask: np.ndarray) -> np.ndarray:
    """Before a copy ahead's first piece goes in (lock held): its buckets
    watched (a row evicted from then on marks the copy not whole), their
    marks cleared; returns the marks as they were (unwatch)."""
    t = copy.table
    was = t.guard_hit.copy()
    t.guard = mask if t.guard is None else t.guard | mask
    t.guard_hit[mask] = False
    return was


def unwatch(copy, was: np.ndarray) -> None:
    """The first piece was refused (nothing imported): the marks as they were."""
    copy.table.guard_hit[:] = was
    copy.unstage(())


def staged_in(copy, incoming: tuple, first: bool, step: int) -> None:
    """After a copy ahead's piece went in (lock held): the copy held here
    (the first replaced earlier copies of its buckets: receive), what its
    import evicted still marked."""
    t, (mask, epoch) = copy.table, incoming
    lost = t.guard_hit & mask
    if first:
        copy.unstage([e for e, m in copy.staged.items() if (m & mask).any()])
        copy.stage(epoch, mask, (max(t.step, step) - step, step))
    t.guard_hit |= lost


def unstaged(copy, state: dict) -> dict:
    """``state`` (an export of this shard, lock held) without the rows of a
    move's copy ahead held here (not the shard's rows yet: never saved)."""
    if copy.staged_mask is None or not state["keys"].size:
        return state
    keep = ~copy.staged_mask[bucket_of(state["keys"])]
    return {k: (a[keep] if np.ndim(a) and k != "evicted" and a.shape[:1] == keep.shape else a)
            for k, a in state.items()}
