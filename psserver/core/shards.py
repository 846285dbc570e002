"""Every shard copy a parameter server holds, and the memory they may take.

A *shard copy* is a variable (psserver/core/variable.py: ``Variable``) or a
dynamic table's shard (psserver/core/table_copy.py: ``TableShardCopy``). Both
are a ``CopyState``: what replication, sync steps and saves need of a copy,
and the rules both kinds follow, written here once (who takes client
updates, which state copy may replace a copy, which update keys it has).

``ShardRegistry`` finds each copy by its *replication name*: a variable's
name, or ``TABLE_PREFIX + table`` for a table shard (psserver.contract), so
GetMeta, Reconfigure and replication records reach both kinds. The variable
store (psserver/core/store.py) and the table store (psserver/core/table_store.py) are
built with one registry and one ``MemoryBudget`` (``--max-memory-bytes``):
each adds and removes its own kind, and both check the same budget.

Locking: the registry's lock guards only its maps (taken briefly, never
while waiting); each copy's state is guarded by the copy's own ``lock``.
Free of grpc and protobuf.
"""
from __future__ import annotations

import collections
import re
import threading
import urllib.parse

from psserver.contract import BACKUP_PREFIX, ROLE_BACKUP, ROLE_PRIMARY, TABLE_PREFIX
from psserver.errors import InvalidArgument, NotFound, NotPrimary, ResourceExhausted

ROLE_NAMES = {ROLE_PRIMARY: "primary", ROLE_BACKUP: "backup"}

# Names are path-like so sharded variables can be called "dense/kernel/part_0".
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-/:]{1,256}$")


#: The longest file name a filesystem takes (NAME_MAX).
MAX_FILE_NAME = 255


def check_name(name: str) -> str:
    """``name`` if it may name a variable or a dynamic table (1 to 256 of
    letters, digits and ``_ . - / :``, and its checkpoint file's name, its
    backup's and its table shard's included, at most MAX_FILE_NAME bytes:
    a name every save would fail on is refused at once), else InvalidArgument."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"invalid variable name {name!r}: use 1 to 256 characters from "
            "letters, digits and _ . - / :")
    base = name[len(BACKUP_PREFIX):] if name.startswith(BACKUP_PREFIX) else name
    longest = len(TABLE_PREFIX + urllib.parse.quote(BACKUP_PREFIX + base, safe="")
                  + ".safetensors")
    if longest > MAX_FILE_NAME:
        raise InvalidArgument(
            f"name {name[:40]!r}... ({len(name)} characters) would make checkpoint file names "
            f"of up to {longest} bytes, over the {MAX_FILE_NAME} a filesystem takes, so no "
            "save of it could be written; use a shorter name (each / and : counts 3)")
    return name


class CopyState:
    """What every copy of a shard keeps, guarded by its ``lock`` (``cond``
    is signalled on that lock when its version or sync state moves):

    ``name`` (its replication name), ``role`` and ``epoch`` (its fencing
    token), ``link`` (a primary's psserver.core.replication.Link to its backup,
    or None), ``draining`` (a planned hand-over), ``version``, ``applied``
    (update keys applied: key -> the version it made, oldest first), the
    sync state (``acc``: the step being gathered, psserver.core.sync;
    ``sync_steps``, ``dropped``) and ``tracker`` (psserver.core.tracking: what
    changed since a save point, or None).

    Each kind brings its own ``meta``, ``forget_changes``, ``held_bytes``,
    ``apply_step`` (a complete sync step), ``take_state`` (the whole copy
    for its backup) and the record methods its backup runs:
    ``check_record``, ``fits`` and ``follow`` (psserver.core.replication)."""

    name: str
    lock: threading.Lock
    cond: threading.Condition
    version: int
    role: int
    epoch: int
    link: object
    draining: bool
    applied: collections.OrderedDict
    #: Whether this is a dynamic table's shard (its records are TABLE_*).
    is_table = False

    #: How many update keys a copy remembers: a resent update older than
    #: this many later updates would be applied again. Retries come within
    #: seconds, when far fewer updates have happened.
    APPLIED_IDS_KEPT = 8192

    def applied_at(self, update_id: int) -> int | None:
        """The version update_id made, if it was applied already (lock held)."""
        return self.applied.get(update_id) if update_id else None

    def remember(self, update_id: int) -> None:
        """Record that update_id made the current version (lock held)."""
        if update_id:
            self.applied[update_id] = self.version
            if len(self.applied) > self.APPLIED_IDS_KEPT:
                self.applied.popitem(last=False)

    def forget_changes(self) -> None:
        """Drop what an incremental save would ask about (psserver.core.tracking;
        lock held): the state was replaced, or the copy changed role."""
        raise NotImplementedError

    @property
    def held_bytes(self) -> int:
        """Bytes this copy holds, for the MemoryBudget (read without the lock:
        an estimate while it changes)."""
        raise NotImplementedError

    def check_primary(self) -> None:
        """Raise NotPrimary unless this copy takes client updates now (lock held
        or not: a role read is atomic)."""
        if self.role != ROLE_PRIMARY or self.draining:
            what = "handing over to its other copy" if self.draining else "a backup copy"
            raise NotPrimary(
                f"{self.name!r} on this server is {what} (epoch {self.epoch}) and takes no "
                "client updates; nothing was applied. Send it to the primary copy (ask "
                "both copies' GetMeta for role and epoch; coordinator.routes does)")

    def accept_state_copy(self, epoch: int) -> None:
        """Raise NotPrimary (lock held; nothing changes) unless a primary's
        whole state of ``epoch`` may replace this copy: it may unless this
        copy has a newer epoch, or the same one as a primary that was not
        superseded (its records were not refused with a newer epoch). The
        one rule for variables and table shards (psserver.core.replication)."""
        stale = self.epoch > epoch or (
            self.epoch == epoch and self.role == ROLE_PRIMARY
            and not (self.link is not None and self.link.fenced))
        if stale:
            raise NotPrimary(
                f"{self.name!r} here is at epoch {self.epoch} ({ROLE_NAMES[self.role]}); "
                f"a state copy of epoch {epoch} comes from a superseded primary and was "
                "refused")


class ShardRegistry:
    """Every shard copy on this server, by replication name.

    Variables are found by their name, table shards by their table name
    (their replication name is ``TABLE_PREFIX + table``): no variable can
    be reached as a table or the other way round. ``add`` and ``remove``
    are atomic; the lists are snapshots (a copy made or removed meanwhile
    may be missing or still there)."""

    def __init__(self):
        self._lock = threading.Lock()   # guards the two maps (not the copies)
        self._variables: dict[str, CopyState] = {}
        self._tables: dict[str, CopyState] = {}   # by table name

    def _map_of(self, name: str) -> tuple[dict, str]:
        if name.startswith(TABLE_PREFIX):
            return self._tables, name[len(TABLE_PREFIX):]
        return self._variables, name

    def variable(self, name: str) -> CopyState:
        """The variable ``name``; NotFound if there is none."""
        try:
            return self._variables[name]
        except KeyError:
            raise NotFound(
                f"no variable {name!r} on this parameter server; create it first "
                "(or check the name and which server holds it)") from None

    def table(self, name: str) -> CopyState:
        """Table ``name``'s shard (by table name); NotFound if there is none."""
        try:
            return self._tables[name]
        except KeyError:
            raise NotFound(f"no dynamic table {name!r} on this server; create it first "
                           "(ParameterServerStrategy.create_embedding_table, or "
                           "PSClient.create_table)") from None

    def find(self, name: str) -> CopyState | None:
        """The copy replication name ``name`` names, or None."""
        found, key = self._map_of(name)
        return found.get(key)

    def copy(self, name: str) -> CopyState:
        """The copy replication name ``name`` names; NotFound if there is none."""
        if name.startswith(TABLE_PREFIX):
            return self.table(name[len(TABLE_PREFIX):])
        return self.variable(name)

    def add(self, copy: CopyState) -> CopyState:
        """Register ``copy`` under its replication name unless a copy has that
        name already: returns the copy registered now (``copy``, or the one
        that was there first; nothing is replaced)."""
        found, key = self._map_of(copy.name)
        with self._lock:
            return found.setdefault(key, copy)

    def remove(self, copy: CopyState) -> bool:
        """Unregister ``copy`` if it is the one registered under its name;
        whether it was."""
        found, key = self._map_of(copy.name)
        with self._lock:
            if found.get(key) is not copy:
                return False
            del found[key]
            return True

    def variables(self) -> list[CopyState]:
        with self._lock:
            return list(self._variables.values())

    def tables(self) -> list[CopyState]:
        with self._lock:
            return list(self._tables.values())

    def copies(self) -> list[CopyState]:
        """Every copy: the variables, then the table shards."""
        with self._lock:
            return [*self._variables.values(), *self._tables.values()]

    def variable_count(self) -> int:
        return len(self._variables)


class MemoryBudget:
    """The server's ``--max-memory-bytes``: ``limit`` (None: no limit but the
    machine's) over what its copies hold (``held``: every copy's
    ``held_bytes``: variables' values, slots and change tracking; table
    shards' rows, slots, index, admission counters, change tracking and a
    state copy being received).

    ``check`` refuses, before anything is made, what would take ``held``
    past the limit. Nothing is reserved: calls checked at the same time
    each see what is held, so the limit holds to within the requests in
    flight. (Issue 33, gradients a sync step has gathered but not applied:
    one more term of each copy's ``held_bytes``, and one more ``check``
    where a step's gradient is added.)"""

    def __init__(self, limit: int | None, registry: ShardRegistry):
        self.limit = limit
        self._registry = registry

    def held(self) -> int:
        """Bytes every copy holds now (an estimate: read without their locks)."""
        return sum(c.held_bytes for c in self._registry.copies())

    def check(self, need: int, what: str, advice: str) -> None:
        """ResourceExhausted (nothing changes) when ``need`` more bytes for
        ``what`` would take the server past its limit; ``advice`` ends the
        message (what to change)."""
        if self.limit is None:
            return
        held = self.held()
        if held + need > self.limit:
            raise ResourceExhausted(
                f"{what} needs {need} bytes, but this server holds {held} of its "
                f"{self.limit}-byte limit (--max-memory-bytes); {advice}")
