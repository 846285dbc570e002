"""Checkpoint plans from a parameter-server listing, for the operator CLI
(`coordinator checkpoint save|restore`): the logical variables behind the
servers' shards (``layout_from_listing``), and whether a checkpoint has
their layout (``restore_plan``).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from coordinator import layouts
from coordinator import variables as V
from coordinator.checkpoint_files import CheckpointError
from psserver.contract import ROLE_BACKUP, ROLE_PRIMARY

# -- plans from a parameter-server listing (the operator CLI: coordinator checkpoint ...) ------
_PART_RE = re.compile(r"^(?P<base>.+)/part_(?P<index>0|[1-9]\d*)$")


class LayoutMismatch(CheckpointError):
    """A checkpoint's variables or shards differ from those on the servers.

    ``differences`` lists them, one line each.
    """

    def __init__(self, message: str, differences: list[str]):
        super().__init__(message)
        self.differences = differences


def split_shard_name(name: str) -> tuple[str, int | None]:
    """(logical variable, shard index) of a name on a parameter server.

    ``"x/part_3"`` is shard 3 of ``"x"`` (ParameterServerStrategy's naming);
    any other name is a whole variable: ``("x", None)``.
    """
    m = _PART_RE.match(name)
    return (m.group("base"), int(m.group("index"))) if m else (name, None)


def layout_from_listing(listing: Mapping[str, Sequence[Any]]) -> list[V.ShardedVariable]:
    """The logical variables held by the parameter servers, from their listings.

    ``listing`` maps each server's address to its variables (VariableMeta,
    or anything with name, dtype, shape, optimizer). Shards ``x/part_0``,
    ``x/part_1``... are grouped into ``x`` in part order, with row offsets
    from the cumulative rows (as ParameterServerStrategy cut them); any
    other name is a variable of one shard. Returns the variables sorted by
    name, each shard with the address holding it: what CheckpointManager
    sees as ``strategy.variables``.

    Raises CheckpointError when the listing is not a consistent layout: a
    name on two servers (but for a backup copy a drain's move left beside
    the primary: the primary's is taken), a missing part (a server not listed, or one that
    restarted empty), parts that differ in dtype, optimizer or row shape.
    """
    where: dict[str, tuple[str, Any]] = {}
    problems: list[str] = []
    for address, metas in listing.items():
        for m in metas:
            if m.name in where:
                roles = (getattr(where[m.name][1], "role", 0), getattr(m, "role", 0))
                if sorted(roles) == [ROLE_PRIMARY, ROLE_BACKUP]:   # (a move's leftover copy)
                    if roles[1] == ROLE_PRIMARY:
                        where[m.name] = (address, m)
                    continue
                problems.append(f"{m.name!r} is on both {where[m.name][0]} and {address}")
                continue
            where[m.name] = (address, m)
    groups: dict[str, dict[int | None, tuple[str, Any]]] = {}
    for name, entry in where.items():
        base, index = split_shard_name(name)
        groups.setdefault(base, {})[index] = entry
    out = []
    for base in sorted(groups):
        parts = groups[base]
        if None in parts:
            if len(parts) > 1:
                others = sorted(m.name for k, (_, m) in parts.items() if k is not None)
                problems.append(f"{base!r} is both a whole variable and sharded "
                                f"({', '.join(others)})")
                continue
            address, m = parts[None]
            shape = tuple(int(d) for d in m.shape)
            out.append(V.ShardedVariable(base, shape, m.dtype, (V.Shard(
                address, m.name, 0, shape[0] if shape else 0),), m.optimizer))
            continue
        indices = sorted(parts)
        missing = sorted(set(range(indices[-1] + 1)) - set(indices))
        if missing:
            problems.append(
                f"{base!r}: shard(s) {', '.join(f'part_{i}' for i in missing)} missing (found "
                f"{', '.join(f'part_{i}' for i in indices)})")
            continue
        metas = [parts[i][1] for i in indices]
        first = metas[0]
        kinds = {(m.dtype, m.optimizer, tuple(m.shape[1:]), len(m.shape)) for m in metas}
        if len(kinds) > 1 or len(first.shape) == 0:
            problems.append(f"{base!r}: its shards differ in dtype, optimizer or row shape, or "
                            "are scalars: " + "; ".join(
                                f"{m.name} {m.dtype} {list(m.shape)} {m.optimizer}" for m in metas))
            continue
        shards, offset = [], 0
        for i in indices:
            address, m = parts[i]
            rows = int(m.shape[0])
            shards.append(V.Shard(address, m.name, offset, rows))
            offset += rows
        shape = (offset,) + tuple(int(d) for d in first.shape[1:])
        out.append(V.ShardedVariable(base, shape, first.dtype, tuple(shards), first.optimizer))
    if problems:
        raise CheckpointError("the variables on the parameter servers are not a consistent "
                              "layout:\n  " + "\n  ".join(problems))
    return out


def restore_plan(variables: Sequence[V.ShardedVariable], manifest: Mapping[str, Any],
                 path: str = "the checkpoint") -> list[tuple[V.ShardedVariable, V.Shard, dict]]:
    """(variable, shard on a server, its manifest entry) for every shard, to
    restore a checkpoint shard by shard, by name, into the same layout.

    Raises LayoutMismatch listing every difference when the checkpoint's
    variables, shapes, dtypes, optimizers or shards (names, offsets, rows)
    are not those of ``variables``. (CheckpointManager.restore reshards
    instead; this plan does not.)
    """
    saved = manifest.get("variables", {})
    here = {v.name: v for v in variables}
    diffs = [f"{name!r} is in the checkpoint but on no parameter server"
             for name in sorted(set(saved) - set(here))]
    diffs += [f"{name!r} is on the parameter servers but not in the checkpoint"
              for name in sorted(set(here) - set(saved))]
    plan = []
    for name in sorted(set(here) & set(saved)):
        v, info = here[name], saved[name]
        if (tuple(info["shape"]), info["dtype"], info["optimizer"]) != (v.shape, v.dtype,
                                                                       v.optimizer):
            diffs.append(f"{name!r} is {v.dtype} {list(v.shape)} {v.optimizer} on the servers "
                         f"but {info['dtype']} {list(info['shape'])} {info['optimizer']} in the "
                         "checkpoint")
            continue
        cut_here = [(s.name, s.offset, s.rows) for s in v.shards]
        cut_saved = [(s["name"], s["offset"], s["rows"]) for s in info["shards"]]
        if cut_here != cut_saved:
            diffs.append(f"{name!r} is cut into {len(cut_here)} shard(s) on the servers "
                         f"(rows {_cuts(cut_here)}) but {len(cut_saved)} in the checkpoint "
                         f"(rows {_cuts(cut_saved)})")
            continue
        plan += [(v, s, entry) for s, entry in zip(v.shards, info["shards"])]
    if diffs:
        shown = diffs[:12] + ([f"... and {len(diffs) - 12} more"] if len(diffs) > 12 else [])
        raise LayoutMismatch(f"{path} does not have the layout of the variables on the "
                             "parameter servers:\n  " + "\n  ".join(shown), diffs)
    return plan


def _cuts(cuts: Sequence[tuple[str, int, int]]) -> str:
    return ", ".join(f"{o}:{o + r}" for _, o, r in cuts)


def tables_from_listing(listing: Mapping[str, Sequence[Any]], ps: Sequence[str]) -> list:
    """The dynamic tables held by the parameter servers ``ps`` (in the
    cluster's order: a table's keys go to servers by their index), from
    each server's TableInfo list. A table must be on every server with the
    same dim, dtype and optimizer (else CheckpointError: a server restarted
    empty, or tables of another job). A table with backup copies is
    replicated (ask coordinator.routes where its primaries are before use)."""
    from coordinator.embedding import DynamicEmbedding
    from psserver.contract import BACKUP_PREFIX
    every = {t.name for infos in listing.values() for t in infos}
    # "_backup/<name>": the backup copies of a replicated table's shards
    names = sorted(n for n in every if not n.startswith(BACKUP_PREFIX))
    out, problems = [], []
    for name in names:
        specs, caps = {}, []
        for address in ps:
            info = next((t for t in listing.get(address, ()) if t.name == name), None)
            if info is None:
                problems.append(f"dynamic table {name!r} is not on {address}")
                continue
            specs[address] = (int(info.spec.dim), info.spec.dtype or "float32",
                              info.spec.optimizer.name or "sgd")
            caps.append(int(info.spec.capacity))
        if len(set(specs.values())) > 1:
            problems.append(f"dynamic table {name!r} differs between servers: {specs}")
        elif specs and len(specs) == len(ps):
            dim, dtype, optimizer = next(iter(specs.values()))
            # After servers were added, the layout the last move left (its
            # servers in its order, its bucket map), as the servers serve it
            last = layouts.newest(t for a in ps for t in listing[a] if t.name == name)
            if last is not None and sorted(last.addresses) != sorted(ps):
                problems.append(f"dynamic table {name!r} is laid out over {last.addresses}, "
                                f"not the cluster's parameter servers {list(ps)}")
                continue
            out.append(DynamicEmbedding(
                name, dim, dtype, tuple(ps) if last is None else last.addresses, optimizer,
                replicated=BACKUP_PREFIX + name in every, capacity=0 if 0 in caps else sum(caps),
                buckets=None if last is None else last.buckets,
                layout_epoch=0 if last is None else last.epoch))
    if problems:
        raise CheckpointError("; ".join(problems))
    return out
