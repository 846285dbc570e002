"""Where a dynamic table's keys are now: its ``Layout``, and how a process
learns a newer one.

A table's layout is its servers (``addresses``: shard i on addresses[i]) and
its ``BucketMap`` (psserver.contract.keys: which shard holds each bucket of
the key space), numbered by ``epoch``. A DynamicEmbedding is a picklable
description (coordinator/embedding.py) carrying the layout it was made or
sent with; adding a parameter server (coordinator/elastic.py) moves buckets
to it, and every description made before is then stale. It learns the new
layout this way:

* a server refuses a key of a bucket its shard handed over (NotPrimary,
  nothing applied: psserver/core/table_moves.py) and serves the layout that
  move left (TableInfo.layout, JSON: ``to_json``);
* the refused call reads it (coordinator/ps_pool.py), and ``learn`` records
  it for this process, if newer than what the process knew, and brings the
  table in place to it; every other description of the same table in this
  process is brought to it before its next call (``current``, in
  coordinator/step_calls.py's plans), and the call is planned again: its
  keys go where the layout says, with their update keys (so an update that
  was applied before the move is answered, not applied again, where the
  rows went: the move carried the memory of applied update keys).

A table is known by its name and ``table_id`` (made at creation, the same
in every copy of its description), so that two tables of one name in one
process (two clusters, a re-created table) never take each other's layout.
Layouts only grow in epoch: a move of several sources gives each source
the layout after its own move, so a process never learns a bucket at a
server before its rows are there.
"""
from __future__ import annotations

import copy
import dataclasses
import threading

from psserver.contract.keys import BucketMap, layout_json, parse_layout
from psserver.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class Layout:
    epoch: int
    addresses: tuple[str, ...]
    buckets: BucketMap


def of(table) -> Layout:
    return Layout(table.layout_epoch, tuple(table.addresses), table.buckets)


def to_json(layout: Layout) -> str:
    return layout_json(layout.epoch, layout.addresses, layout.buckets)


def parse(text: str) -> Layout | None:
    """The layout a server served (None: none, or not one: a server of
    another version, or damaged; the call's refusal then goes up)."""
    try:
        return Layout(*parse_layout(text)) if text else None
    except InvalidArgument:
        return None


def newest(infos) -> Layout | None:
    """The newest layout a table's shards serve (their TableInfo's; None:
    none moved buckets, so the table is as created)."""
    served = [lay for lay in (parse(i.layout) for i in infos) if lay is not None]
    return max(served, key=lambda lay: lay.epoch, default=None)


_lock = threading.Lock()
_latest: dict[tuple[str, str], Layout] = {}


def _key(table) -> tuple[str, str]:
    return table.name, table.table_id


def _adopt(table, layout: Layout) -> None:
    """Changed in one step (a dict update made in C: another thread's
    copy.copy sees all of it or none; snapshot)."""
    table.__dict__.update({
        "origin_shards": table.origin_shards or len(table.addresses),   # (its update keys'
        "addresses": layout.addresses, "buckets": layout.buckets,       # shards stay)
        "layout_epoch": layout.epoch})


def learn(table, layout: Layout) -> bool:
    """Record ``layout`` for ``table`` in this process if it is newer than
    any known, and bring the table to the newest; whether the table changed."""
    _record(_key(table), layout)
    return current(table)


def _record(key: tuple[str, str], layout: Layout) -> None:
    global _known
    with _lock:
        known = _latest.get(key)
        if known is None or layout.epoch > known.epoch:
            _latest[key] = layout
            _known = None


#: Every layout this process knows, as (name, table_id, JSON): made again
#: after a change (a closure sent carries them: coordinator/closures.py).
_known: list[tuple[str, str, str]] | None = None


def known() -> list[tuple[str, str, str]]:
    """(table name, table_id, layout JSON) of every table whose layout this
    process knows: what a closure carries to its worker (``learn_known``)."""
    global _known
    out = _known
    if out is None:
        with _lock:   # (made under the lock that a change clears it under)
            if _known is None:
                _known = [(name, tid, to_json(lay)) for (name, tid), lay in _latest.items()]
            out = _known
    return out


_parsed: dict[str, Layout] = {}   # layout JSON -> Layout, as closures carried them


def learn_known(entries) -> None:
    """Record layouts a closure carried ((name, table_id, layout JSON) each,
    ``known()``'s): the tables of its arguments are brought to them as they
    are used (``current``). ValueError for one that is not a layout."""
    for name, table_id, text in entries:
        layout = _parsed.get(text)
        if layout is None:   # (a closure carries the same few step after step)
            layout = parse(text)
            if layout is not None:
                if len(_parsed) >= 256:
                    _parsed.clear()
                _parsed[text] = layout
        if layout is None or not isinstance(name, str) or not isinstance(table_id, str):
            raise ValueError(f"the layout of table {name!r:.100} is not one (JSON "
                             '{"epoch", "addresses", "buckets"}, as a server serves it)')
        _record((name, table_id), layout)


def current(table) -> bool:
    """Bring ``table`` (in place) to the newest layout this process knows of
    it; whether it changed (a call planned on the older one is planned
    again)."""
    known = _latest.get(_key(table))   # (a dict read: no lock on the hot path)
    if known is None or known.epoch <= table.layout_epoch:
        return False
    with _lock:
        known = _latest[_key(table)]
        if known.epoch <= table.layout_epoch:
            return False
        _adopt(table, known)
        return True


def snapshot(table):
    """A copy of ``table``'s description at the newest layout this process
    knows, read whole: a call plans on it from start to end (another thread
    may bring the table to a newer layout meanwhile). About 2 us."""
    current(table)
    return copy.copy(table)
