"""Which copy of a replicated shard takes a process's calls: ``Routes``.

With ``replication=True`` each shard has two copies: ``v.shards[k]`` (its
primary when created) and ``v.backups[k]``. The coordinator moves the
primary role between them (a failover promotes the backup, a fail-back
hands the role back; see coordinator.recovery), fenced by epochs on the
servers (psserver.core.replication). A ShardedVariable (or DynamicEmbedding) is a
picklable description that workers keep, so it does not change; instead
every process keeps this table (in its ParameterServers,
coordinator/ps_pool.py) of shards whose primary is the backup copy now, and
of shards whose other copy is gone, and learns it by asking:

* a call that a copy refuses (NotPrimary), or that cannot reach its server,
  makes the caller read both copies' role and epoch (``refresh``) and, if
  the primary moved, send the call again where it is now (the update keys
  stay the same, so nothing is applied twice);
* ``decide`` is the rule, a pure function of the two copies' metadata.

``route(v, k)`` is the one place a call asks which copy leads: a step asks
it once per shard (``primary``/``targets`` take the route it gave).
Sync-mode pushes go to both copies (a backup gathers a step's gradients
too, so a promoted backup can finish that step), except where the primary
says it has no backup.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Sequence

from psserver.contract import ROLE_PRIMARY


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a replicated shard's calls go: ``flipped`` (the backup copy is
    primary) and ``alone`` (the primary has no backup now)."""
    flipped: bool = False
    alone: bool = False


DEFAULT = Route()


def key(shard) -> tuple[str, str]:
    """A shard's key in the table: the created copy's (address, name) (a
    variable's shard names are unique; a dynamic table's shards share one
    name on different servers); for a variable's, the address it was made
    on (``made_at``: a drain may have moved it since, coordinator/placement.py)."""
    return getattr(shard, "made_at", shard.address), shard.name


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


class Routes:
    """The table (see the module); thread-safe."""

    def __init__(self):
        self._table: dict[tuple[str, str], Route] = {}
        self._lock = threading.Lock()

    def get(self, shard_key: tuple[str, str]) -> Route:
        return self._table.get(shard_key, DEFAULT)

    def route(self, v, k: int) -> Route:
        """Shard k of v's route now (DEFAULT for an unreplicated shard)."""
        return self._table.get(key(v.shards[k]), DEFAULT) if v.backups else DEFAULT

    @staticmethod
    def primary_of(v, k: int, r: Route):
        """The copy that takes shard k's calls under route r."""
        return v.backups[k] if r.flipped and v.backups else v.shards[k]

    @staticmethod
    def targets_of(v, k: int, r: Route, sync: bool) -> tuple:
        """The copies an update of shard k goes to under route r: its
        primary; in sync mode both copies, unless one is gone."""
        if not v.backups:
            return (v.shards[k],)
        first, other = (v.backups[k], v.shards[k]) if r.flipped else (v.shards[k], v.backups[k])
        return (first,) if r.alone or not sync else (first, other)

    def primary(self, v, k: int):
        """The Shard (copy) that takes shard k's calls now."""
        return self.primary_of(v, k, self.route(v, k))

    def primaries(self, v) -> list:
        """primary(v, k) for every shard k."""
        if not v.backups:
            return list(v.shards)
        return [self.primary(v, k) for k in range(v.num_shards)]

    def sync_targets(self, v, k: int) -> tuple:
        """The copies a sync-mode push of shard k goes to: both, unless one is gone."""
        return self.targets_of(v, k, self.route(v, k), True)

    def set(self, shard, r: Route) -> None:
        """Record where the calls of the shard created as ``shard`` go."""
        with self._lock:
            if r == DEFAULT:
                self._table.pop(key(shard), None)
            else:
                self._table[key(shard)] = r

    def refresh(self, pairs: Sequence[tuple], ask: Callable) -> bool:
        """Ask both copies of each (variable or table, k) who is primary
        (``ask(shard) -> VariableMeta or None``); update the table. Returns
        whether any shard's route changed (its primary moved, or its backup
        left or came back)."""
        moved = False
        seen = set()
        for v, k in pairs:
            if not v.backups or key(v.shards[k]) in seen:
                continue
            seen.add(key(v.shards[k]))
            new = decide(ask(v.shards[k]), ask(v.backups[k]))
            if new is None:
                continue
            if new != self.route(v, k):
                moved = True
                self.set(v.shards[k], new)
        return moved

    def reset(self) -> None:
        """Forget every route (tests; a new cluster)."""
        with self._lock:
            self._table.clear()
