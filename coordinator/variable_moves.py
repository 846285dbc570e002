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
which ``Shard.address`` reads and closures carry to workers. An added
server takes shards the same way, until it holds about an even share of
the variable bytes (``plan_spread``).

With replication (``rehome``), each shard keeps two copies on two servers:
a copy on the drained server that leads hands the primary role to the
other copy first (DEMOTE, PROMOTE: the planned hand-over of a fail-back);
then the primary copies its whole state to a copy of the same name on a
server holding neither copy (SET_BACKUP) and forwards to it from then on,
and the old copy is deleted. An added server takes backup copies. Every
process learns the new primaries as after a failover (coordinator/routes.py:
a refusal, then both copies asked; ``routes.key`` is the copy's ``made_at``).

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
    BACKUP_PREFIX,
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


def copies(v) -> list:
    """Every copy of ``v``'s shards: each shard, and with replication its backup."""
    return list(v.shards) + list(v.backups)


def other_copy(v, s):
    """The other copy of the shard ``s`` is a copy of (None: not replicated)."""
    for c, b in zip(v.shards, v.backups):
        if s == c:
            return b
        if s == b:
            return c
    return None


def plan_drain(variables, servers, address: str) -> list[tuple]:
    """(variable, copy, destination) for each shard copy on ``address`` (with
    replication, primaries and backups alike): largest first, each to the
    server of ``servers`` holding the fewest variable bytes then (ties: the
    first in ``servers``), never ``address`` nor the server of its other
    copy. ValueError where no server is left for a copy (replication: each
    shard keeps its two copies on two servers)."""
    others = [a for a in servers if a != address]
    if not others:
        return []   # (the last server: check_remove refuses it)
    load = dict.fromkeys(others, 0)
    leaving = []
    for v in variables:
        for s in copies(v):
            where = s.address
            if where == address:
                leaving.append((v, s))
            elif where in load:
                load[where] += shard_bytes(v, s)
    plan = []
    for v, s in sorted(leaving, key=lambda vs: -shard_bytes(*vs)):
        other = other_copy(v, s)
        allowed = [a for a in others if other is None or a != other.address]
        if not allowed:
            raise ValueError(f"no server is left for {s.name!r} (its other copy is on "
                             f"{other.address}): with replication a drain needs a server "
                             "that holds neither copy of each shard; add one first")
        dest = min(allowed, key=lambda a: load[a])
        load[dest] += shard_bytes(v, s)
        plan.append((v, s, dest))
    return plan


def plan_spread(variables, servers, address: str, movable=None) -> list[tuple]:
    """(variable, copy, ``address``) for the shard copies an added server
    takes so that the variable bytes even out: while it holds less than an
    even share (the total over ``servers``, itself included), the most
    loaded server gives it its largest copy that fits in what it lacks and
    leaves that server holding at least what the new one will; none where no
    copy fits (a shard is never split: the partitioner's shards stay as
    made). ``movable``: the copies that may move, as Shards (default: every
    shard; with replication the caller gives the backup copies, one per
    shard); every copy counts in the loads."""
    load = dict.fromkeys(servers, 0)
    on: dict[str, list] = {a: [] for a in servers}   # (nbytes, v, copy) that may move
    for v in variables:
        for s in copies(v):
            where = s.address
            if where in load:
                load[where] += shard_bytes(v, s)
                if s in (movable if movable is not None else v.shards):
                    on[where].append((shard_bytes(v, s), v, s))
    if address not in load:
        return []
    share = sum(load.values()) / len(load)
    plan = []
    while True:
        lack = share - load[address]
        best = None
        for source in sorted((a for a in load if a != address), key=lambda a: -load[a]):
            fits = [(n, i) for i, (n, _, _) in enumerate(on[source])
                    if 0 < n <= lack and load[source] - n >= load[address] + n]
            if fits:
                best = (source, max(fits)[1])
                break
        if best is None:
            return plan
        source, i = best
        n, v, s = on[source].pop(i)
        load[source] -= n
        load[address] += n
        plan.append((v, s, address))


def spread_to(strategy, address: str) -> list[VariableMove]:
    """After ``address`` was added: move variable shards to it (``plan_spread``)
    between the same two steps. A move that fails is logged and ends the
    spread (the add stands: the shard stays whole where it was)."""
    moves, movable = [], None
    try:
        if strategy.replication:   # (the backup copies move: the primaries keep serving)
            pool = ps_pool.servers()
            pairs = [(v, k) for v in strategy.variables for k in range(len(v.backups))]
            pool.refresh(pairs)
            movable = {v.shards[k] if pool.routes.route(v, k).flipped else v.backups[k]
                       for v, k in pairs}
        for v, s, dest in plan_spread(strategy.variables, strategy.parameter_servers, address,
                                      movable):
            moves.append(_move(v, s, dest, strategy.server_ids))
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
    on a server that may stop. In hybrid mode the moves come between two
    whole steps (Cluster.between_steps lets a started step's replicas end:
    a step's dense gradients gather on a shard across them); a copy still
    gathering one is refused (FailedPrecondition, nothing moved)."""
    plan = plan_drain(strategy.variables, strategy.parameter_servers, address)
    ours = {s.name for v in strategy.variables for s in copies(v) if s.address == address}
    stray = sorted(m.name for m in ps_pool.client_for(address).list_variables()
                   if (m.role == ROLE_PRIMARY or strategy.replication) and m.name not in ours)
    if stray:
        raise ValueError(f"{address} holds variables this coordinator does not know "
                         f"({', '.join(stray[:5])}{'...' if len(stray) > 5 else ''}); nothing "
                         "moved. Declare them first (create_variable, with reuse_existing=True "
                         "for a coordinator made again) or delete them")
    taken: dict[str, set] = {}   # (every destination asked before anything moves)
    for v, s, dest in plan:
        if dest not in taken:
            taken[dest] = {m.name for m in ps_pool.client_for(dest).list_variables()
                           if m.role == ROLE_PRIMARY}
        if s.name in taken[dest]:
            raise ValueError(f"{dest} holds a variable named {s.name!r} already; nothing "
                             f"moved. Delete it there, or drain {address} once the job that "
                             "made it is done with it")
    try:
        return [_move(v, s, dest, strategy.server_ids) for v, s, dest in plan]
    finally:
        strategy.__dict__.pop("_held_by_name", None)   # (places() asks the servers again)


def _move(v, s, destination: str, known: dict | None) -> VariableMove:
    other = other_copy(v, s)
    if other is None:
        return move_shard(v, s, destination, known)
    return rehome(v, s, other, destination, known)


def rehome(v, s, other, destination: str, known: dict | None = None) -> VariableMove:
    """With replication: move the copy ``s`` (on the server being drained, or
    a backup given to an added one) to ``destination``, the shard keeping
    two copies: if ``s`` leads, the primary role is handed to ``other``
    first (DEMOTE ``s``, PROMOTE ``other``: the planned hand-over a
    fail-back makes); then ``other`` copies its whole state to a copy named
    as ``s`` on ``destination`` and forwards to it from then on (SET_BACKUP);
    then ``s``'s old copy is deleted. Each change fenced by an epoch above
    both copies'. A failure puts the shard back as it was where it can (the
    role handed back, the backup link back to ``s``'s copy) and goes up."""
    source = s.address
    src, oth, dst = (ps_pool.client_for(a) for a in (source, other.address, destination))
    _check_known(known, ((source, src), (other.address, oth), (destination, dst)))
    _clear_way(dst, destination, s.name, source)
    sm, om = _not_gathering(src.get_meta(s.name)), _not_gathering(oth.get_meta(other.name))
    e, start = max(sm.epoch, om.epoch), time.monotonic()
    led = sm.role == ROLE_PRIMARY and (om.role != ROLE_PRIMARY or sm.epoch > om.epoch)
    lead, lm, follow, fm = (s, sm, other, om) if led else (other, om, s, sm)
    if lm.role != ROLE_PRIMARY or fm.role == ROLE_PRIMARY or \
            lm.backup != Peer(follow.address, follow.name):
        raise FailedPrecondition(
            f"{s.name!r} and {other.name!r} are not a primary and its backup now (a failover "
            "not rebuilt yet: the copy that leads has no backup, or another); nothing moved. "
            "Wait for the job's recovery to rebuild the backup, then try again")
    moved = VariableMove(v.name, s.name, source, destination,
                         sm.nbytes + sm.slot_nbytes, lm.version)
    log.info("moving the copy %s of a replicated variable shard (%.1f MiB with its slots) "
             "from %s to %s", s.name, moved.bytes / 2**20, source, destination)
    seconds = COPY_SECONDS + moved.bytes / 2**20 * COPY_SECONDS_PER_MIB
    if led:   # (hand the primary role to its backup: DEMOTE waits until it has every version)
        demoted = src.reconfigure([(s.name, DEMOTE, e + 1, None)], timeout=seconds)[0]
        try:
            promoted = oth.reconfigure([(other.name, PROMOTE, e + 2, None)], timeout=seconds)[0]
            if promoted.version != demoted.version:
                raise FailedPrecondition(
                    f"{other.name!r} was promoted at version {promoted.version}, its primary "
                    f"was demoted at {demoted.version}: handed back; nothing moved")
        except BaseException:
            _metrics.VARIABLE_MOVES.labels("failed").inc()
            _settle_role(src, s.name, e + 3, Peer(other.address, other.name))
            raise
        e += 2
    try:
        oth.reconfigure([(other.name, SET_BACKUP, e + 1, Peer(destination, s.name))],
                        timeout=seconds)
    except BaseException:
        _metrics.VARIABLE_MOVES.labels("failed").inc()
        _settle_role(oth, other.name, e + 2, Peer(source, s.name), set_backup=True)
        try:
            dst.delete_variable(s.name)
        except PSError:
            pass
        raise
    _done(s, moved, src, start)
    ps_pool.servers().refresh([(v, k) for k in range(len(v.backups))])
    log.info("moved the copy %s to %s (its shard led by %s): %.1f MiB in %.2fs", s.name,
             destination, other.address, moved.bytes / 2**20, moved.seconds)
    return moved


def _settle_role(client, name: str, epoch: int, peer: Peer, set_backup: bool = False) -> None:
    """A hand-over or a re-homing that failed: make the copy ``name`` lead
    again with ``peer`` (the copy it had) as its backup, copied again."""
    try:
        action = SET_BACKUP if set_backup else PROMOTE
        client.reconfigure([(name, action, epoch, peer)], timeout=COPY_SECONDS)
    except PSError as exc:
        log.warning("a failed move of %s left it unsettled (%s); the job's recovery settles "
                    "it when it next looks at that server", name, exc)


def _not_gathering(meta):
    """``meta``; FailedPrecondition, nothing moved, for a copy gathering a
    sync step (hybrid mode between two whole steps gathers none: a replica
    whose abandonment has not reached it yet)."""
    if meta.gathering:
        raise FailedPrecondition(
            f"{meta.name!r} is gathering sync step {meta.gathering - 1} (a replica of it has "
            "not pushed or been abandoned); nothing moved. Move it between two steps: call "
            "again")
    return meta


def move_shard(v, s, destination: str, known: dict | None = None) -> VariableMove:
    """Move shard ``s`` of ``v`` whole to ``destination`` (see the module);
    ``known``: server address -> the server_id the job knows it by (a
    server that restarted since, the source or the destination, is refused:
    its recovery is due, and would restore a shard moved there from the
    last checkpoint)."""
    source = s.address
    src, dst = ps_pool.client_for(source), ps_pool.client_for(destination)
    _check_known(known, ((source, src), (destination, dst)))
    _clear_way(dst, destination, s.name, source)
    meta = _not_gathering(src.get_meta(s.name))
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
    try:   # (the destination, as promoted, before the source's copy goes: it restarted?)
        held = dst.get_meta(s.name)
        _check_known(known, ((destination, dst),))
    except PSError:
        _metrics.VARIABLE_MOVES.labels("failed").inc()
        _keep_at_source(src, dst, s.name, e)   # (the demoted source holds every version)
        raise
    if held.version != moved.version:
        log.warning("moved variable shard %s: version %d there, %d here", s.name,
                    held.version, moved.version)
    _done(s, moved, src, start)
    log.info("moved variable shard %s to %s: version %d, %.1f MiB in %.2fs", s.name,
             destination, moved.version, moved.bytes / 2**20, moved.seconds)
    return moved


def _check_known(known: dict | None, servers) -> None:
    """FailedPrecondition where one of ``servers`` ((address, client) each)
    restarted since the job knew it (``known``: address -> server_id): its
    recovery is due, and would restore a shard moved there from the last
    checkpoint."""
    for address, client in servers:
        if known and address in known and client.server_info().server_id != known[address]:
            raise FailedPrecondition(f"{address} restarted since the job knew it; this shard "
                                     "did not move (shards moved before it stay moved). Wait "
                                     "for its recovery, then try again")


def _clear_way(dst, destination: str, name: str, source: str) -> None:
    """Refuse (ValueError) a destination that holds a primary copy named
    ``name``; delete a backup copy of that name an earlier move left there."""
    try:
        there = dst.get_meta(name)
    except NotFound:
        return
    if there.role == ROLE_PRIMARY:
        raise ValueError(f"{destination} holds a variable named {name!r} already; {name!r} "
                         "did not move (shards moved before it stay moved). Delete it there, "
                         f"or move {source}'s once the job that made it is done with it")
    log.info("deleting the copy of %s an earlier move left on %s", name, destination)
    dst.delete_variable(name)


def _done(s, moved: VariableMove, src, start: float) -> None:
    """A move that went through: recorded here (``Shard.address`` follows
    it), counted, the source's copy deleted, its seconds noted."""
    placement.record(s.made_at, s.name, moved.destination)
    _metrics.VARIABLE_MOVES.labels("done").inc()
    _metrics.VARIABLE_BYTES_MOVED.inc(moved.bytes)
    try:
        src.delete_variable(s.name)
    except PSError as exc:   # (a backup copy left there refuses every call)
        log.warning("moved variable shard %s to %s, but deleting its copy on %s failed (%s); "
                    "that copy refuses calls and goes with its server", s.name,
                    moved.destination, moved.source, exc)
    moved.seconds = time.monotonic() - start


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
    (``reuse_existing``) each shard's server is the one of the job's servers
    whose copy of it leads (primary; the newest epoch), wherever a drain or
    an add moved it or however the job's servers changed since it was made
    (with replication: the copy of that name, whatever its role, newest
    epoch first; the routes then learn which copy leads). ValueError where
    copies exist and none leads (a move cut off at its hand-over). This
    process's record of a move of a shard of that name made on one of these
    servers is dropped (the shard is there now: a new job that reuses a
    name is not sent to an old job's copy)."""
    out = list(placed)
    if strategy.reuse_existing:
        held = _held_by_name(strategy)
        for i, addr in enumerate(placed):
            sname = name if n == 1 else f"{name}/part_{i}"
            found = held.get(sname, [])
            if strategy.replication:
                out[i] = max((m.epoch, a) for a, m in found)[1] if found else addr
                continue
            leads = [(m.epoch, a) for a, m in found if m.role == ROLE_PRIMARY]
            if found and not leads:
                raise ValueError(
                    f"variable shard {sname!r} has copies on {[a for a, _ in found]} but "
                    "none leads (a drain's move of it was cut off at its hand-over: each "
                    "holds every acknowledged version); promote one (PSClient(address)."
                    f"reconfigure([({sname!r}, PROMOTE, epoch + 1, None)]), then delete the "
                    "other) or restore the job from a checkpoint")
            out[i] = max(leads)[1] if leads else addr
    for i, addr in enumerate(out):
        placement.settled(addr, name if n == 1 else f"{name}/part_{i}")
    return out


def backup_place(strategy, sname: str, addr: str) -> str:
    """With replication: the server of shard ``sname``'s backup copy, its
    primary copy going on ``addr``: the next server after it, but for a
    coordinator made again the one holding the copy named BACKUP_PREFIX +
    ``sname`` (newest epoch), wherever a drain or an add re-homed it."""
    servers = strategy.parameter_servers
    out = servers[(servers.index(addr) + 1) % len(servers)]
    if strategy.reuse_existing:
        found = [(m.epoch, a) for a, m in _held_by_name(strategy).get(BACKUP_PREFIX + sname, ())
                 if a != addr]
        out = max(found)[1] if found else out
    placement.settled(out, BACKUP_PREFIX + sname)
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
