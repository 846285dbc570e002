"""Where each variable shard is now, where a drain moved it (issue 34).

A ShardedVariable is a picklable description that names, for each shard,
the server it was made on (``Shard.made_at``). Removing a parameter server
(``remove_parameter_server``, coordinator/variable_moves.py) moves the
variable shards it holds, whole, to the job's other servers. The
description does not change (workers and user code hold copies of it);
instead every process keeps this table of the shards that moved, and
``Shard.address`` reads it: every call, recovery, save and restore asks
``Shard.address``, so all of them follow a move.

The coordinator records each move (``record``). A step closure carries the
coordinator's whole table when it is sent (``known``), and its worker takes
that table as its own before it unpickles the arguments (``learn_known``:
the table is replaced, not merged, so a worker that outlives its
coordinator never keeps a move the new one does not know). Moves run
between steps (Cluster.between_steps): no step runs while a shard is in
transit, and every step sent afterwards carries the move.
"""
from __future__ import annotations

import threading

#: (server made on, shard name) -> the server holding it now, for each
#: shard that moved (a shard moved back keeps its entry). Read without a
#: lock (a dict read); replaced whole, never changed in place.
MOVED: dict[tuple[str, str], str] = {}

#: Changes each time MOVED does: a call planned before a change is planned
#: again (coordinator/ps_pool.py: a shard's copy refused or gone meanwhile).
GENERATION = 0

_lock = threading.Lock()
_known: list[tuple[str, str, str]] = []   # MOVED as closures carry it


def where(made_at: str, name: str) -> str:
    """The server holding the shard ``name`` made on ``made_at``."""
    return MOVED.get((made_at, name), made_at)


def _set(table: dict[tuple[str, str], str]) -> None:
    """MOVED replaced by ``table`` (a new dict), with ``known()``'s list; the
    generation moves if it changed (``_lock`` held)."""
    global MOVED, _known, GENERATION
    if table != MOVED:
        GENERATION += 1
    MOVED, _known = table, [(m, n, a) for (m, n), a in table.items()]


def record(made_at: str, name: str, address: str) -> None:
    """The shard ``name`` made on ``made_at`` is on ``address`` from now on."""
    with _lock:
        _set({**MOVED, (made_at, name): address})


def settled(made_at: str, name: str) -> None:
    """The shard ``name`` is made on (or adopted at) ``made_at``: a move
    recorded before for that pair no longer applies."""
    if (made_at, name) in MOVED:
        with _lock:
            _set({k: a for k, a in MOVED.items() if k != (made_at, name)})


def known() -> list[tuple[str, str, str]]:
    """(made on, shard name, address now) of every moved shard: what a closure
    carries to its worker."""
    return _known


def parse(entries) -> dict[tuple[str, str], str]:
    """A closure's table (``known()``'s entries) as a table for ``take``.
    ValueError for an entry that is not three non-empty printable strings of
    at most 1,024 characters."""
    table = {}
    for entry in entries:
        if len(entry) != 3 or not all(isinstance(s, str) and s and len(s) <= 1024
                                      and s.isprintable() for s in entry):
            raise ValueError(f"a moved shard is (made on, name, address now), three "
                             f"non-empty printable strings; got {entry!r:.200}")
        table[(entry[0], entry[1])] = entry[2]
    return table


def take(table: dict[tuple[str, str], str]) -> None:
    """Make ``table`` (``parse``'s) this process's own, replacing what it had."""
    if table or MOVED:
        with _lock:
            _set(dict(table))


def learn_known(entries) -> None:
    """take(parse(entries)): a closure's table as this process's own."""
    take(parse(entries))


def forget() -> None:
    """No shard moved (tests; a process that starts a new job)."""
    learn_known(())
