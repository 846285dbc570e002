"""Which copy of a replicated shard takes this process's calls.

With ``replication=True`` each shard has two copies: ``v.shards[k]`` (its
primary when created) and ``v.backups[k]``. The coordinator moves the
primary role between them (a failover promotes the backup, a fail-back
hands the role back; see coordinator.recovery), fenced by epochs on the
servers (psserver.replication). A ``ShardedVariable`` is a picklable
description that workers keep, so it does not change; instead every
process keeps this small table of shards whose primary is the backup copy
now, and of shards whose other copy is gone, and learns it by asking:

* a call that a copy refuses (NotPrimary), or that cannot reach its server,
  makes the caller read both copies' role and epoch (``refresh``) and,
  if the primary moved, send the call again where it is now (the update keys
  stay the same, so nothing is applied twice);
* ``decide`` is the rule, a pure function of the two copies' metadata.

Sync-mode pushes go to both copies (a backup gathers a step's gradients too,
so a promoted backup can finish that step), except where the primary says it
has no backup.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

from psserver.errors import PSError
from psserver.replication import ROLE_PRIMARY

#: Seconds to wait for each copy's metadata when deciding where calls go.
ASK_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a replicated shard's calls go: ``flipped`` (the backup copy is
    primary) and ``alone`` (the primary has no backup now)."""
    flipped: bool = False
    alone: bool = False


# by the created copy's (address, name): a variable's shard names are unique,
# a dynamic table's shards share one name on different servers
_routes: dict[tuple[str, str], Route] = {}
_lock = threading.Lock()


def route(v, k: int) -> Route:
    return _routes.get(_key(v.shards[k]), _DEFAULT) if v.backups else _DEFAULT


def _key(shard) -> tuple[str, str]:
    return shard.address, shard.name


_DEFAULT = Route()


def primary(v, k: int):
    """The Shard (copy) that takes shard k's calls now."""
    return v.backups[k] if v.backups and route(v, k).flipped else v.shards[k]


def primaries(v) -> list:
    """primary(v, k) for every shard k."""
    if not v.backups:
        return list(v.shards)
    return [primary(v, k) for k in range(v.num_shards)]


def sync_targets(v, k: int) -> tuple:
    """The copies a sync-mode push of shard k goes to: both, unless one is gone."""
    if not v.backups:
        return (v.shards[k],)
    r = route(v, k)
    first, other = (v.backups[k], v.shards[k]) if r.flipped else (v.shards[k], v.backups[k])
    return (first,) if r.alone else (first, other)


def set_route(shard, r: Route) -> None:
    """Record where the calls of the shard created as ``shard`` go."""
    with _lock:
        if r == _DEFAULT:
            _routes.pop(_key(shard), None)
        else:
            _routes[_key(shard)] = r


def decide(created, other) -> Route | None:
    """The route given the two copies' VariableMeta (None: unreachable or
    missing), or None when neither is primary now (a change in progress:
    ask again later). The primary with the newer epoch wins (a copy that was
    superseded may not know it yet); on a tie, the copy created primary."""
    candidates = [(m.epoch, flipped, m) for flipped, m in ((False, created), (True, other))
                  if m is not None and m.role == ROLE_PRIMARY]
    if not candidates:
        return None
    epoch, flipped, meta = max(candidates, key=lambda c: (c[0], not c[1]))
    return Route(flipped=flipped, alone=meta.backup is None)


def refresh(pairs: Sequence[tuple]) -> bool:
    """Ask both copies of each (variable, k) who is primary; update the
    table. Returns whether any shard's route changed (its primary moved, or
    its backup left or came back)."""
    from coordinator.calls import client_for

    def ask(shard):
        try:
            return client_for(shard.address, fail_fast=True).get_meta(shard.name,
                                                                      timeout=ASK_SECONDS)
        except PSError:
            return None
    moved = False
    seen = set()
    for v, k in pairs:
        if not v.backups or _key(v.shards[k]) in seen:
            continue
        seen.add(_key(v.shards[k]))
        new = decide(ask(v.shards[k]), ask(v.backups[k]))
        if new is None:
            continue
        if new != route(v, k):
            moved = True
            set_route(v.shards[k], new)
    return moved


def reset() -> None:
    """Forget every route (tests; a new cluster)."""
    with _lock:
        _routes.clear()
