"""Elastic parameter servers: add a server to a running job, or drain one
(issue 34, first part): ``ClusterCoordinator.add_parameter_server(address)``
and ``remove_parameter_server(address)`` (``drain_table``, ``plan_remove``:
the reverse of what follows, each other shard taking an even share).

Each dynamic table gives the new server its share of the key space, between
two steps of training (no closure runs meanwhile: Cluster.between_steps):
``plan_add`` gives it about 1/(n+1) of the 4,096 buckets
(psserver.contract.keys), taken from each shard in proportion to what it
holds, so that about 1/(n+1) of the rows move and the others stay where
they are. Then, one source shard at a time, the source hands those
buckets' rows to the new server (tables.proto MoveBuckets,
psserver/core/table_moves.py: values, optimizer slots, look-up counts, ages
and the memory of applied update keys, under the source shard's lock, so
that calls to that shard wait for the copy) and refuses their keys from
then on, serving the table's layout after its move. Calls planned on the
older layout are refused there and planned again on the newer one
(coordinator/layouts.py), so no step fails and no row is served from a
shard that no longer holds it. Each move's layout is numbered one higher
(``layout_epoch``), and names only the buckets moved so far.

Before the steps wait, training going on, each of those moves has its
source copy the rows to the destination ahead of it (``copy_ahead``:
tables.proto MoveBucketsRequest.precopy; the destination holds them aside,
refusing their keys and saving none), so that the move between two steps
sends only the rows changed since and the keys gone (or the rows whole
where the destination lost its copy): the pause is about what a second of
training touches, not the table's size.

The coordinator's own description of each table (the strategy's, which
step closures carry) is brought to each layout as the move is made, so
closures scheduled from then on route there at once; closures sent before
learn it from the first refusal.

Variable shards move whole, after the tables (coordinator/variable_moves.py:
an added server takes about an even share, a drained one gives its shards
away; in hybrid mode, where a step's dense gradients gather across its
closures, the pause comes between two whole steps: Cluster.between_steps).
What an add does not move: a table's admission counters of keys not
admitted yet stay at the source (such a key counts again from zero at the
new server).

Refused (ValueError, nothing changed): with ``replication=True`` in a job
with dynamic tables (a moved table shard would need its backup moved too;
variables' copies move: coordinator/variable_moves.py), an address the job
has already, or a server that does not answer. In sync and hybrid modes the
pause comes between two whole steps (Cluster.between_steps: a step that
started ends first), so every shard, a new one too, counts every replica of
each step after it. A move that fails part-way (the new server or a source
lost) keeps the buckets moved so far where they went and the others where
they were (a fence on the failed move's source says which), every shard is
told that layout, and the error goes up: calling again resumes (an add:
the table it stopped in gets the rest of the new shard's share, plan_fill).
An add of a server whose drain failed part way is not refused: it fills
that server's shards back to their share.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import numpy as np

from coordinator import layouts, ps_pool
from coordinator import metrics as _metrics
from psserver.contract.keys import BUCKETS, BucketMap, bitmap_of_buckets, split_capacity
from psserver.errors import NotFound, PSError, Unavailable, Unimplemented

log = logging.getLogger("coordinator")

#: Seconds one source shard's move may take (its rows copied to the new server:
#: about 1 s a million rows here).
MOVE_SECONDS = 120.0
#: Held while tables' layouts change (an add) and while a checkpoint is
#: written (coordinator/checkpoint.py): a save never sees rows in transit.
LAYOUT_LOCK = threading.RLock()


def plan_add(buckets: BucketMap) -> BucketMap:
    """The map with one more shard (index n): it takes BUCKETS // (n + 1)
    buckets, each from the shard holding the most at that point (so the
    counts end as even as they can), the last buckets of each shard's runs;
    every other bucket stays with its shard."""
    n = buckets.num_shards + 1
    return BucketMap(_fill(buckets.owner, n, n - 1), n)


def plan_fill(buckets: BucketMap, j: int) -> BucketMap:
    """The map where shard j holds its share, BUCKETS // n of n shards (one
    whose add failed part way), the buckets it lacks taken as plan_add
    takes them; the same map where it holds that already."""
    return BucketMap(_fill(buckets.owner, buckets.num_shards, j), buckets.num_shards)


def _fill(owner: np.ndarray, n: int, j: int) -> np.ndarray:
    """plan_fill's owners, of n shards (j may hold nothing yet)."""
    owner = owner.astype(np.int64)
    held = np.bincount(owner, minlength=n)
    held[j] = -BUCKETS   # (never chosen)
    give = np.zeros(n, np.int64)
    for _ in range(BUCKETS // n - int((owner == j).sum())):
        k = int(np.argmax(held - give))
        give[k] += 1
    out = owner.copy()
    for k in np.flatnonzero(give):
        out[np.flatnonzero(owner == k)[-give[k]:]] = j
    return out


def lacks_share(table, address: str) -> bool:
    """Whether ``table`` has no shard on ``address`` or one that holds less
    than its share: an add that failed part way (add_parameter_server
    completes it when called again), or a drain that did (an add then
    fills that shard back to its share). Moves that end give every shard
    at least its share."""
    now = layouts.snapshot(table)   # (one layout, whatever a move does meanwhile)
    if address not in now.addresses:
        return True
    j = now.addresses.index(address)
    return int((now.buckets.owner == j).sum()) < BUCKETS // now.buckets.num_shards


def plan_remove(buckets: BucketMap, j: int) -> BucketMap:
    """The map without shard j (shards past it numbered one lower): each of
    its buckets to the other shard holding the fewest at that point (so the
    counts end as even as they can); every other bucket stays."""
    n = buckets.num_shards
    if n < 2:
        raise ValueError("a table's last server cannot be removed")
    owner = buckets.owner.astype(np.int64)
    held = np.bincount(owner, minlength=n)
    held[j] = BUCKETS + 1   # (never chosen)
    mine = np.flatnonzero(owner == j)
    gets = np.zeros(n, np.int64)
    for _ in range(mine.size):
        k = int(np.argmin(held + gets))
        gets[k] += 1
    out = owner.copy()   # each its share as one run of j's buckets (few runs: a small map)
    for k, run in zip(range(n), np.split(mine, np.cumsum(gets)[:-1])):
        out[run] = k
    return BucketMap(np.where(out > j, out - 1, out), n - 1)


@dataclasses.dataclass
class TableMove:
    """What adding a server moved of one table."""
    table: str
    buckets: int = 0    # buckets moved
    rows: int = 0       # rows moved
    kept: int = 0       # rows the sources kept (each as its move left it)
    bytes: int = 0      # bytes moved (values and per-row slots)
    seconds: float = 0.0
    started: float = 0.0   # time.time() when its first move began
    sent: int = 0       # rows sent between two steps (those changed since the copy ahead)
    ahead: "Ahead | None" = None   # what was copied ahead, while training went on


def check_add(strategy, address: str, probe: float | None = None) -> None:
    """ValueError (nothing changed) where a server cannot be added (see the
    module). ``probe``: also ask the server (within that many seconds: an
    error if it does not answer), and refuse one that is a server of the job
    already under another name (the same process: its server_id)."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"a parameter server's address is host:port, got {address!r}")
    if address in strategy.parameter_servers and \
            not any(lacks_share(t, address) for t in strategy.tables):   # (else: resume it)
        raise ValueError(f"{address} is a parameter server of this job already")
    _check_mode(strategy, "adding")
    if probe is not None:   # (reached with the job's token and TLS, as its other servers)
        ps_pool.servers().give([address], strategy.token, strategy.tls)
        try:
            sid = ps_pool.client_for(address).server_info(timeout=probe).server_id
        except Unimplemented:   # (a worker, or another gRPC service, answers there)
            raise ValueError(f"{address} answers but is not a parameter server (a worker's "
                             "address?); nothing changed. Give the address of a running "
                             "psserver") from None
        same = [a for a, known in strategy.server_ids.items() if known == sid and a != address]
        if same:
            raise ValueError(f"{address} is the parameter server {same[0]} of this job (the "
                             "same process, named another way); nothing changed. Name each "
                             "server one way everywhere (the cluster spec, the calls)")


def _check_mode(strategy, what: str) -> None:
    if strategy.replication and strategy.tables:
        raise ValueError(f"{what} a parameter server with replication=True in a job with "
                         "dynamic tables is not supported yet (a moved table shard's backup "
                         "would have to move too; variables' copies move); checkpoint and "
                         "restore into the other cluster instead")


def check_remove(strategy, address: str) -> None:
    """ValueError (nothing changed) where a server cannot be removed: not
    one of the job's, the last one, or with replication and tables."""
    if address not in strategy.parameter_servers:
        raise ValueError(f"{address} is not a parameter server of this job")
    if len(strategy.parameter_servers) < 2:
        raise ValueError("the job's last parameter server cannot be removed")
    _check_mode(strategy, "removing")


def creation_now(table, address: str, creation: dict) -> dict:
    """``creation`` (create_table's keywords for ``table``'s shard on
    ``address``) with the capacity part that shard has as the table's
    buckets are spread now (moves change the parts; recovery recreates a
    lost shard with this)."""
    now = layouts.snapshot(table)   # (one layout, whatever a move does meanwhile)
    if not now.capacity or address not in now.addresses:
        return creation
    parts = split_capacity(now.capacity, now.buckets.counts())
    return dict(creation, capacity=parts[now.addresses.index(address)])


def _add_steps(table, address: str, creation: dict) -> tuple[list, bool, BucketMap]:
    """An add's moves of ``table`` to ``address`` (see _run), whether it
    resumes one that failed part way, and the map before; ``creation``
    gets the capacity part the new shard takes."""
    old = table.buckets
    resumed = address in table.addresses   # (an add that failed part way: completed)
    if resumed:
        n = table.addresses.index(address)
        final = plan_fill(old, n)
        addresses = tuple(table.addresses)
    else:
        n = old.num_shards
        final = plan_add(old)
        addresses = tuple(table.addresses) + (address,)
    parts = split_capacity(table.capacity, final.counts()) if table.capacity else \
        [0] * final.num_shards
    creation["capacity"] = parts[n]
    owner = old.owner.astype(np.int64)
    steps = []
    for k in (k for k in range(final.num_shards) if k != n):   # (each source)
        mask = (final.owner == n) & (old.owner == k)
        if mask.any():
            owner = np.where(mask, n, owner)
            steps.append((addresses[k], address, mask, parts[k] or None, parts[n] or None,
                          addresses, BucketMap(owner, final.num_shards), False))
    return steps, resumed, old


def _make_shard(table, address: str, creation: dict) -> None:
    """``table``'s shard on an added server (``creation``: create_table's
    keywords; a server drained before takes its shard back, with its seed)."""
    client = ps_pool.client_for(address)
    try:
        creation["seed"] = int(client.table_info(table.name).spec.seed)
    except NotFound:
        pass
    client.create_table(table.name, table.dim, exist_ok=True, **creation)


def move_table(table, address: str, creation: dict, known=None) -> TableMove:
    """Give the server at ``address`` its share of ``table`` (see the module):
    its shard made there (``creation``: create_table's keywords, updated in
    place with the capacity part it gets and, for a server drained before,
    whose shard is taken back, that shard's seed), then each source's
    buckets moved in turn, the table's description brought to each layout
    as it is made. ``known``: address -> the server_id each source had when
    the job last knew it (the strategy's ``server_ids``: a source that
    restarted since refuses its move, and its recovery refills it first)."""
    steps, resumed, old = _add_steps(table, address, creation)
    if not resumed:
        _make_shard(table, address, creation)
    return _run(table, steps, address, cleanup=lambda: _forget_added(table, address, old),
                known=known)


def _forget_added(table, address: str, old: BucketMap) -> None:
    """After an add of ``address`` failed with nothing moved: its shard there goes."""
    if address not in table.addresses and table.num_shards == old.num_shards:
        ps_pool.client_for(address).delete_table(table.name)


def _drain_steps(table, address: str) -> list:
    """A drain's moves of ``table``'s buckets on ``address`` (see _run)."""
    j = table.addresses.index(address)
    old = table.buckets
    final = plan_remove(old, j)   # (numbered without j)
    rest = [a for a in table.addresses if a != address]
    parts = split_capacity(table.capacity, final.counts()) if table.capacity else \
        [None] * len(rest)
    owner = old.owner.astype(np.int64)
    renumbered = np.where(np.arange(old.num_shards) > j, np.arange(old.num_shards) - 1,
                          np.arange(old.num_shards))
    gets = [(d, (old.owner == j) & (final.owner == renumbered[d]))
            for d in range(old.num_shards) if d != j]
    gets = [(d, mask) for d, mask in gets if mask.any()]
    steps = []
    for i, (d, mask) in enumerate(gets):
        owner = np.where(mask, d, owner)
        last = i == len(gets) - 1
        steps.append((address, table.addresses[d], mask, None, parts[renumbered[d]] or None,
                      tuple(rest) if last else tuple(table.addresses),
                      final if last else BucketMap(owner, old.num_shards), last))
    return steps


def drain_table(table, address: str, known=None) -> TableMove:
    """Move every bucket of ``table``'s shard on ``address`` to its other
    shards (plan_remove), one destination at a time; the last move's layout
    leaves that server out (its shard stays, refusing every key, so that a
    description older than the drain learns the layout there); ``known``:
    as move_table's."""
    return _run(table, _drain_steps(table, address), address, cleanup=lambda: None, known=known)


@dataclasses.dataclass
class Ahead:
    """What an add or a drain copied of one table ahead of its moves."""
    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0


def copy_ahead(strategy, address: str, adding: bool) -> dict[str, Ahead]:
    """Before an add of ``address`` (``adding``) or a drain of it, while
    training goes on: each move it will make of a table's buckets (the same
    plan: nothing changes layouts meanwhile, LAYOUT_LOCK held) has its
    source copy the rows to the destination ahead of it (tables.proto
    MoveBucketsRequest.precopy), so that the move, between two steps, sends
    only the rows changed since. A copy that fails is logged (its move
    sends the rows whole). Returns, by table, what was copied."""
    out = {}
    for table in list(strategy.tables):
        try:
            if adding:
                if not lacks_share(table, address):
                    continue
                kw = dict(strategy.creation_at(table, address)[0])
                steps, resumed, _ = _add_steps(table, address, kw)
                if not resumed:
                    _make_shard(table, address, kw)
            elif address in table.addresses:
                steps = _drain_steps(table, address)
            else:
                continue
            out[table.name] = _copy_steps(table, steps, strategy.server_ids)
        except PSError as exc:
            log.warning("table %r: copying rows ahead of the move failed (%s: %s); the move "
                        "sends them whole", table.name, type(exc).__name__, exc)
    return out


def _copy_steps(table, steps: list, known: dict) -> Ahead:
    start, ahead = time.monotonic(), Ahead()
    for i, (source_address, dest, mask, _, theirs, _, _, _) in enumerate(steps):
        source = ps_pool.client_for(source_address)
        reply = source.move_table_buckets(
            table.name, bitmap_of_buckets(mask), dest, destination_capacity=theirs,
            layout_epoch=table.layout_epoch + 1 + i, precopy=True,
            source_server_id=known.get(source_address, ""), timeout=MOVE_SECONDS)
        ahead.rows += reply.rows
        ahead.bytes += reply.bytes
    ahead.seconds = time.monotonic() - start
    _metrics.TABLE_ROWS_AHEAD.inc(ahead.rows)
    log.info("table %r: %d rows (%.1f MiB) copied ahead of the move in %.2fs", table.name,
             ahead.rows, ahead.bytes / 2**20, ahead.seconds)
    return ahead


def drop_ahead(strategy, address: str, adding: bool, epochs: dict) -> None:
    """After copy_ahead, where the moves did not follow (the steps did not
    end in time): the copies go (each shard told its layout: a destination
    drops its copies, a source releases their change points; an added
    server's shard deleted where it holds no bucket). Not for a table a
    move changed since (its layout at copy_ahead's start: ``epochs``): the
    move's own failure handling told its shards (_run). Failures are logged."""
    for table in [t for t in strategy.tables if t.layout_epoch == epochs.get(t.name)]:
        steps = [lambda t=table: serve_layout(t)]
        if adding and address not in table.addresses:
            steps.insert(0, lambda t=table: ps_pool.client_for(address).delete_table(t.name))
        for step in steps:   # (each tried: a source lost meanwhile fails its own)
            try:
                step()
            except PSError as exc:
                log.warning("table %r: dropping the rows copied ahead of a move that did not "
                            "happen failed (%s: %s)", table.name, type(exc).__name__, exc)


def _run(table, steps: list, address: str, cleanup, known=None) -> TableMove:
    """Make ``steps`` [(source, destination, buckets, source capacity,
    destination capacity, addresses and map after it, whether the source
    holds no bucket after it)] in turn, the table's
    description brought to each layout as it is made, then every shard told
    the last. A step that fails: its source is fenced (the move made or
    not, for sure), the table is at the layout the steps made (numbered past
    the fence), every shard is told it (``cleanup()`` first: with nothing
    moved, an added server's shard goes), and the error goes up."""
    start = time.monotonic()
    report = TableMove(table.name, int(sum(s[2].sum() for s in steps)), started=time.time())
    kept: dict[str, int] = {}   # each source's rows after its last move
    left, remaining = _metrics.TABLE_MOVE_LEFT.labels(table.name), report.buckets
    left.set(remaining)
    try:
        for source_address, dest, mask, mine, theirs, addresses, bmap, leaves in steps:
            layout = layouts.Layout(table.layout_epoch + 1, addresses, bmap)
            source = ps_pool.client_for(source_address)
            # the process the job knows there (one that restarted refuses: its recovery first)
            process = (known or {}).get(source_address) or \
                source.server_info(timeout=MOVE_SECONDS).server_id
            until = time.monotonic() + MOVE_SECONDS   # (the source commits nothing past it)
            try:
                reply = source.move_table_buckets(
                    table.name, bitmap_of_buckets(mask), dest, capacity=mine,
                    destination_capacity=theirs, layout_epoch=layout.epoch,
                    layout=layouts.to_json(layout), source_server_id=process,
                    source_leaves=leaves, timeout=MOVE_SECONDS)
            except BaseException as exc:
                moved = _fence(source, table.name, layout.epoch, until, process)
                if moved is None:
                    raise MoveUndetermined(
                        f"table {table.name!r}: the move from {source_address} failed "
                        f"({type(exc).__name__}: {exc}) and that server cannot say whether it "
                        "happened; nothing was cleaned up. Check the server and call "
                        "add_parameter_server (remove_parameter_server) again") from exc
                # the layout as it is (the move made or not), numbered past the fence
                layouts.learn(table, layout if moved else layouts.Layout(
                    layout.epoch, tuple(table.addresses), table.buckets))
                raise
            layouts.learn(table, layout)
            report.rows += reply.rows
            kept[source_address] = reply.held
            report.kept = sum(kept.values())
            report.bytes += reply.bytes
            report.sent += reply.sent
            remaining -= int(mask.sum())
            left.set(remaining)
            _progress(report, remaining, start)
        serve_layout(table)
    except BaseException as exc:
        if not isinstance(exc, MoveUndetermined):
            _after_failure(table, cleanup)
        _metrics.TABLE_MOVES.labels("failed").inc()
        raise
    finally:
        left.set(0)
    report.seconds = time.monotonic() - start
    _metrics.TABLE_MOVES.labels("done").inc()
    _metrics.TABLE_ROWS_MOVED.inc(report.rows)
    _metrics.TABLE_BYTES_MOVED.inc(report.bytes)
    _metrics.TABLE_MOVE_SECONDS.observe(report.seconds)
    log.info("table %r: %d buckets, %d rows (%.1f MiB) moved (server %s) in %.2fs, %d rows "
             "sent then (the others copied ahead)", table.name, report.buckets, report.rows,
             report.bytes / 2**20, address, report.seconds, report.sent)
    return report


def _progress(report: TableMove, left: int, start: float) -> None:
    """The log line of a move's progress after each source's part."""
    took = time.monotonic() - start
    done = report.buckets - left
    log.info("table %r: %d of %d buckets moved (%d rows, %.1f MiB) in %.2fs, about %.1fs "
             "left", report.table, done, report.buckets, report.rows, report.bytes / 2**20,
             took, took / max(done, 1) * left)


def serve_layout(table, client_for=None) -> None:
    """Tell each shard of ``table`` its place in the table's layout: it
    serves the layout (a refused caller reads it) and refuses keys of the
    buckets other shards hold. After an add's last move (the sources served
    the layout of their own move until then), and after a restore into a
    layout moves made (a restore empties the shards, layout and all).
    ``client_for``: address -> client (default: this process's, with its
    token and TLS)."""
    client_for = client_for or ps_pool.client_for
    failed = None
    with LAYOUT_LOCK:   # (never a layout an add in progress is changing)
        text = layouts.to_json(layouts.of(table))
        for i, address in enumerate(table.addresses):
            try:   # (every shard told, one that fails or not: the first error goes up)
                client_for(address).move_table_buckets(
                    table.name, b"", "", layout_epoch=table.layout_epoch, layout=text,
                    layout_only=True, shard=i, timeout=MOVE_SECONDS)
            except PSError as exc:
                failed = failed or exc
    if failed is not None:
        raise failed


class MoveUndetermined(RuntimeError):
    """A source's move failed and the source cannot say whether it happened."""


def _fence(source, name: str, epoch: int, until: float, process: str) -> bool | None:
    """Whether a source's move of ``epoch`` happened although its call
    failed; if not, the source refuses it from now on (a fence, answered
    after any move running there: tables.proto MoveBucketsRequest.fence).
    False, at once, for a source that restarted (not the ``process``, its
    server_id, that was moving: what it held went with it, and its recovery
    brings back what a checkpoint has, which no move is part of: saves and
    moves exclude each other), and for one that does not answer before
    ``until`` (its deadline for the move) and 30 s more; None (cannot say)
    for one that keeps answering with another error."""
    end = until + 30.0
    while True:
        try:
            return bool(source.move_table_buckets(
                name, b"", "", layout_epoch=epoch, fence=True,
                timeout=max(5.0, end - time.monotonic())).moved)
        except Unavailable:
            if time.monotonic() > end:
                return False
        except PSError:
            if time.monotonic() > end:
                return None
        try:
            if source.server_info(timeout=5.0).server_id != process:
                return False
        except PSError:
            pass
        time.sleep(0.5)


def _after_failure(table, cleanup) -> None:
    """After a move of ``table`` failed: ``cleanup()`` (with nothing moved, an
    added server's shard goes), then every shard is told the layout the
    moves made (a destination drops what a failed move left there). A
    failure here is logged: the move's own error goes up."""
    try:
        cleanup()
        serve_layout(table)
    except Exception as exc:
        log.warning("table %r: after a failed move, %s: %s", table.name, type(exc).__name__, exc)


def settle(tables) -> None:
    """Every shard of each table that moves laid out told its place again
    (serve_layout), before an add or a drain: an earlier one may have failed
    before it told them, leaving stray rows. (Each move's own ``_run`` tells
    its table's shards after it.)"""
    for table in tables:
        if table.layout_epoch:
            serve_layout(table)
