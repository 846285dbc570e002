"""Variable shards moved whole off a parameter server being drained (issue 34).

``remove_parameter_server(address)`` moves every variable shard on
``address``, whole, to the job's other servers: each goes to the one that
holds the fewest variable bytes then (``plan_drain``). Moves run between
two steps of training (no closure runs meanwhile: Cluster.between_steps),
one shard at a time, with the replication protocol's planned hand-over
(psserver.core.replication), each change fenced by an epoch above the
shard's:

1. SET_BACKUP on the source: it copies the shard's whole state (value,
   optimizer slots, version, sync steps, the memory of applied update keys,
   so a resent update is still recognised) to a copy of the same name on
   the destination, and returns once that copy holds it;
2. DEMOTE on the source: it refuses updates and waits until the
   destination acknowledged every version;
3. PROMOTE on the destination: that copy is the shard from now on (no
   backup: a job that elastic servers serve does not replicate);
4. the source's copy is deleted.

Then the process records the shard's new place (coordinator/placement.py),
which ``Shard.address`` reads and closures carry to workers.

A move that fails part way leaves the shard whole on one server: before
step 3, on the source (its link to the destination dropped, made primary
again if step 2 had run; the destination's copy deleted); from step 3 on,
on the destination (a source copy left behind is a backup: it refuses
every call and goes with its server). The error goes up; calling again
moves what is left. Refused before anything moves: a destination that
holds a variable of the same name already (ValueError), a source that
restarted since the job knew it (FailedPrecondition: recovery restores it
first).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from coordinator import metrics as _metrics
from coordinator import placement, ps_pool
from psserver.contract import (
    DEMOTE,
    DROP_BACKUP,
    PROMOTE,
    ROLE_PRIMARY,
    SET_BACKUP,
    Peer,
)
from psserver.errors import FailedPrecondition, NotFound, PSError

log = logging.getLogger("coordinator")

#: Seconds one shard's copy may take (a destination that refuses it, or does
#: not answer, fails the move then), and per MiB of it on top.
COPY_SECONDS, COPY_SECONDS_PER_MIB = 30.0, 0.5


@dataclasses.dataclass
class VariableMove:
    """What draining a server moved of one variable shard."""
    variable: str
    shard: str
    source: str
    destination: str
    bytes: int = 0      # value and optimizer slots
    version: int = 0
    seconds: float = 0.0


def shard_bytes(v, s) -> int:
    """Bytes of shard ``s`` of variable ``v``'s value (its slots not counted)."""
    return s.rows * int(np.prod(v.shape[1:], dtype=np.int64)) * np.dtype(v.dtype).itemsize


def plan_drain(variables, servers, address: str) -> list[tuple]:
    """(variable, shard, destination) for each shard on ``address``: largest
    first, each to the server of ``servers`` (not ``address``) holding the
    fewest variable bytes then (ties: the first in ``servers``)."""
    others = [a for a in servers if a != address]
    if not others:
        return []
    load = dict.fromkeys(others, 0)
    leaving = []
    for v in variables:
        for s in v.shards:
            where = s.address
            if where == address:
                leaving.append((v, s))
            elif where in load:
                load[where] += shard_bytes(v, s)
    plan = []
    for v, s in sorted(leaving, key=lambda vs: -shard_bytes(*vs)):
        dest = min(others, key=lambda a: load[a])
        load[dest] += shard_bytes(v, s)
        plan.append((v, s, dest))
    return plan


def plan_spread(variables, servers, address: str) -> list[tuple]:
    """(variable, shard, ``address``) for the shards an added server takes so
    that the variable bytes even out: while it holds less than an even share
    (the total over ``servers``, itself included), the most loaded server
    gives it its largest shard that fits in what it lacks and leaves that
    server holding at least what the new one will; none where no shard fits
    (a shard is never split: the partitioner's shards stay as made)."""
    load = dict.fromkeys(servers, 0)
    on: dict[str, list] = {a: [] for a in servers}
    for v in variables:
        for s in v.shards:
            where = s.address
            if where in load:
                load[where] += shard_bytes(v, s)
                on[where].append((v, s))
    if address not in load:
        return []
    share = sum(load.values()) / len(load)
    plan = []
    while True:
        lack = share - load[address]
        best = None
        for source in sorted((a for a in load if a != address), key=lambda a: -load[a]):
            fits = [(shard_bytes(v, s), i) for i, (v, s) in enumerate(on[source])
                    if 0 < shard_bytes(v, s) <= lack
                    and load[source] - shard_bytes(v, s) >= load[address] + shard_bytes(v, s)]
            if fits:
                best = (source, max(fits)[1])
                break
        if best is None:
            return plan
        source, i = best
        v, s = on[source].pop(i)
        load[source] -= shard_bytes(v, s)
        load[address] += shard_bytes(v, s)
        plan.append((v, s, address))


def spread_to(strategy, address: str) -> list[VariableMove]:
    """After ``address`` was added: move variable shards to it (``plan_spread``)
    between the same two steps. A move that fails is logged and ends the
    spread (the add stands: the shard stays whole where it was)."""
    moves = []
    try:
        for v, s, dest in plan_spread(strategy.variables, strategy.parameter_servers, address):
            moves.append(move_shard(v, s, dest, strategy.server_ids))
    except (PSError, ValueError) as exc:
        log.warning("adding %s: moving variable shards there stopped after %d (%s); the "
                    "others stay where they are", address, len(moves), exc)
    finally:
        strategy.__dict__.pop("_held_by_name", None)
    return moves


def drain_variables(strategy, address: str) -> list[VariableMove]:
    """Move every variable shard on ``address`` to the job's other servers
    (see the module); the moves made. Raises what a move raised (the shards
    moved before it stay moved; calling again moves the rest). ValueError,
    nothing moved, where the server holds a variable (a primary copy) that
    is not one of this strategy's shards there: a coordinator made again
    that has not declared it yet, or another job's; the drain would leave it
    on a server that may stop."""
    plan = plan_drain(strategy.variables, strategy.parameter_servers, address)
    ours = {s.name for v in strategy.variables for s in v.shards if s.address == address}
    stray = sorted(m.name for m in ps_pool.client_for(address).list_variables()
                   if m.role == ROLE_PRIMARY and m.name not in ours)
    if stray:
        raise ValueError(f"{address} holds variables this coordinator does not know "
                         f"({', '.join(stray[:5])}{'...' if len(stray) > 5 else ''}); nothing "
                         "moved. Declare them first (create_variable, with reuse_existing=True "
                         "for a coordinator made again) or delete them")
    try:
        return [move_shard(v, s, dest, strategy.server_ids) for v, s, dest in plan]
    finally:
        strategy.__dict__.pop("_held_by_name", None)   # (places() asks the servers again)


def move_shard(v, s, destination: str, known: dict | None = None) -> VariableMove:
    """Move shard ``s`` of ``v`` whole to ``destination`` (see the module);
    ``known``: server address -> the server_id the job knows it by (a
    server that restarted since, the source or the destination, is refused:
    its recovery is due, and would restore a shard moved there from the
    last checkpoint)."""
    source = s.address
    src, dst = ps_pool.client_for(source), ps_pool.client_for(destination)
    for address, client in ((source, src), (destination, dst)):
        if known and address in known and client.server_info().server_id != known[address]:
            raise FailedPrecondition(f"{address} restarted since the job knew it; nothing "
                                     "moved. Wait for its recovery, then remove the server "
                                     "again")
    try:
        there = dst.get_meta(s.name)
    except NotFound:
        there = None
    if there is not None and there.role == ROLE_PRIMARY:
        raise ValueError(f"{destination} holds a variable named {s.name!r} already; nothing "
                         f"moved. Delete it there, or remove {source} after the job that "
                         "made it is done with it")
    if there is not None:   # (a backup copy an earlier move of it left there: stale)
        log.info("deleting the copy of %s an earlier move left on %s", s.name, destination)
        dst.delete_variable(s.name)
    meta = src.get_meta(s.name)
    e, peer, start = meta.epoch, Peer(destination, s.name), time.monotonic()
    moved = VariableMove(v.name, s.name, source, destination,
                         meta.nbytes + meta.slot_nbytes, meta.version)
    log.info("moving variable shard %s (%.1f MiB with its slots) from %s to %s", s.name,
             moved.bytes / 2**20, source, destination)
    promoted, seconds = False, COPY_SECONDS + moved.bytes / 2**20 * COPY_SECONDS_PER_MIB
    try:
        src.reconfigure([(s.name, SET_BACKUP, e + 1, peer)], timeout=seconds)
        src.reconfigure([(s.name, DEMOTE, e + 2, None)], timeout=seconds)
        after = dst.reconfigure([(s.name, PROMOTE, e + 3, None)], timeout=seconds)[0]
        promoted = True
        moved.version = after.version
    finally:
        if not promoted:
            _metrics.VARIABLE_MOVES.labels("failed").inc()
            _keep_at_source(src, dst, s.name, e)
    placement.record(s.made_at, s.name, destination)
    _metrics.VARIABLE_MOVES.labels("done").inc()
    _metrics.VARIABLE_BYTES_MOVED.inc(moved.bytes)
    try:
        src.delete_variable(s.name)
    except PSError as exc:   # (a backup copy left there refuses every call)
        log.warning("moved variable shard %s to %s, but deleting its copy on %s failed (%s); "
                    "that copy refuses calls and goes with its server", s.name, destination,
                    source, exc)
    moved.seconds = time.monotonic() - start
    log.info("moved variable shard %s to %s: version %d, %.1f MiB in %.2fs", s.name,
             destination, moved.version, moved.bytes / 2**20, moved.seconds)
    return moved


def _keep_at_source(src, dst, name: str, e: int) -> None:
    """A move that failed before the destination's copy was promoted: make
    the source's copy the only primary again and delete the destination's."""
    try:
        meta = src.get_meta(name)
        epoch = max(meta.epoch, e + 3) + 1
        if meta.role == ROLE_PRIMARY:
            src.reconfigure([(name, DROP_BACKUP, epoch, None)], timeout=COPY_SECONDS)
        else:   # (demoted: it holds every version, the destination acknowledged them)
            src.reconfigure([(name, PROMOTE, epoch, None)], timeout=COPY_SECONDS)
    except PSError as exc:
        log.warning("a failed move of variable shard %s left its source unsettled (%s)",
                    name, exc)
        return
    try:
        dst.delete_variable(name)
    except PSError:
        pass   # (never made there, or that server is gone)


def places(strategy, name: str, n: int, placed: list[str]) -> list[str]:
    """The servers of variable ``name``'s ``n`` shards, about to be created
    or adopted: ``placed`` (round-robin), but for a coordinator made again
    (``reuse_existing``, no replication) each shard's server is the one of
    the job's servers whose copy of it leads (primary; the newest epoch),
    wherever a drain moved it or however the job's servers changed since it
    was made. ValueError where copies exist and none leads (a move cut off
    at its hand-over). This process's record of a move of a shard of that
    name made on one of these servers is dropped (the shard is there now:
    a new job that reuses a name is not sent to an old job's copy)."""
    out = list(placed)
    if strategy.reuse_existing and not strategy.replication:
        held = _held_by_name(strategy)
        for i, addr in enumerate(placed):
            sname = name if n == 1 else f"{name}/part_{i}"
            copies = held.get(sname, [])
            leads = [(m.epoch, a) for a, m in copies if m.role == ROLE_PRIMARY]
            if copies and not leads:
                raise ValueError(
                    f"variable shard {sname!r} has copies on {[a for a, _ in copies]} but "
                    "none leads (a drain's move of it was cut off at its hand-over); "
                    "restore the job from a checkpoint")
            out[i] = max(leads)[1] if leads else addr
    for i, addr in enumerate(out):
        placement.settled(addr, name if n == 1 else f"{name}/part_{i}")
    return out


def _held_by_name(strategy) -> dict[str, list]:
    """shard name -> [(server, VariableMeta)] over the job's servers (a
    server that does not answer is left out), asked again once the job's
    servers changed or a drain moved shards."""
    servers = tuple(strategy.parameter_servers)
    servers_then, held = strategy.__dict__.get("_held_by_name") or ((), None)
    if held is None or servers_then != servers:
        held = {}
        for address in servers:
            try:
                metas = ps_pool.client_for(address).list_variables()
            except PSError:
                continue   # (then made on its placed server, or refused there, as before)
            for m in metas:
                held.setdefault(m.name, []).append((address, m))
        strategy._held_by_name = (servers, held)
    return held
