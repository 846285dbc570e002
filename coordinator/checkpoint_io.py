"""The one implementation of saving and restoring a checkpoint: what
``CheckpointManager`` (coordinator/checkpoint.py, whose docstring has the
layout and the guarantees) and ``coordinator checkpoint save|restore`` both
call. ``write_checkpoint`` has every parameter server write its shards and
then commits the manifest; ``restore_checkpoint`` checks the files
(coordinator/checkpoint_files.py) and loads them into the shards.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import shutil
import threading
import time
import urllib.parse
import uuid
from concurrent import futures
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from coordinator import elastic
from coordinator import metrics as _metrics
from coordinator import variables as V
from coordinator.checkpoint_files import (  # noqa: F401
    CHAIN_VERSION,
    FORMAT_VERSION,
    CheckpointError,
    chain_of,
    check_restorable,
    find_checkpoints,
    load_checked_shard,
    load_table,
    load_variable,
    read_manifest,
)
from coordinator.shard_files import crc32_of_path, write_new
from psserver.contract.checkpoint_format import CHECKSUM
from psserver.contract.checkpoint_format import fsync_dir as _fsync_dir
from psserver.contract.keys import fill_capacity, split_capacity
from psserver.errors import (
    DeadlineExceeded,
    PSError,
    Unavailable,
)

log = logging.getLogger("coordinator.checkpoint")

#: SavedFile.kind / SaveTableReply.kind (ps.proto SaveKind) as manifests write them.
_KIND_NAMES = {0: "full", 1: "delta", 2: "unchanged"}


def _kind(kind: int) -> str:
    if kind not in _KIND_NAMES:
        raise CheckpointError(f"a parameter server wrote a shard of kind {kind}, which this "
                              "version of pstrain does not know; upgrade the coordinator")
    return _KIND_NAMES[kind]


@dataclasses.dataclass(frozen=True)
class Incremental:
    """An incremental save: its id, its stream (psserver/core/tracking.py), the
    checkpoint it is a delta of ((path, manifest); None: a base) and whether
    it holds weights only (a serving export)."""
    save_id: int
    stream: str
    parent: tuple[str, dict] | None = None
    weights_only: bool = False


def write_checkpoint(directory: str, step: int, variables: Sequence[V.ShardedVariable],
                     client_for: Callable[[str], Any], *,
                     copies: Callable[[V.ShardedVariable], Sequence[V.Shard]] = lambda v: v.shards,
                     ps_index: Mapping[str, int] | None = None, extra: dict | None = None,
                     replace: bool = True, tables: Sequence = (),
                     incremental: Incremental | None = None,
                     mirrored: Mapping[str, tuple] | None = None) -> tuple[str, int]:
    """Write checkpoint ``step`` of ``variables`` under ``directory``: each
    server saves its shards (``copies(v)``: the copies to save from, in shard
    order) through ``client_for(address)``, then the manifest is written and
    the directory renamed into place. Returns (its path, shard bytes).

    ``replace``: a checkpoint of the same step is replaced; else refused
    (CheckpointError). A failed save (PSError from a server, OSError,
    CheckpointError) leaves nothing listed. ``incremental``: the save is a
    save point on the servers, and with a parent each shard is written as
    its changes since the parent where its server can tell them; once the
    checkpoint is in place the servers are told (CommitSave: a server that
    cannot be told keeps the changes, and the next save takes them again).
    ``mirrored``: all-reduce mode's variables, name -> (MirroredVariable,
    (value, slots, version) of one worker's replica), written here whole
    (``replicas/``), listed as variables of one shard each.
    """
    final = os.path.join(directory, f"ckpt-{step:08d}")
    if not replace and os.path.exists(final):
        raise CheckpointError(f"{final} exists already: pass another step, or delete it first")
    tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
    ps_index = ps_index or {}
    chosen = {v.name: list(copies(v)) for v in variables}
    by_ps: dict[str, list[str]] = {}
    for v in variables:
        for c in chosen[v.name]:
            by_ps.setdefault(c.address, []).append(c.name)
    inc = incremental or Incremental(0, "")
    parent = inc.parent[1] if inc.parent else {}
    known = parent.get("servers", {})

    def fields(addr: str) -> dict:
        return dict(save_id=inc.save_id, since=parent.get("save_id", 0),
                    incarnation=known.get(addr, ""), stream=inc.stream,
                    weights_only=inc.weights_only)
    files: dict[str, Any] = {}
    table_files: dict[str, list] = {}
    servers: dict[str, str] = {}
    saves = _Saves()
    try:
        os.makedirs(tmp)
        addresses = set(by_ps) | {a for t in tables for a in t.addresses}
        subs = {}
        for addr in addresses:
            subs[addr] = os.path.join(tmp, f"ps-{ps_index.get(addr, addr)}")
            os.makedirs(subs[addr])
        jobs = {addr: saves.submit(addr, client_for(addr).save_incremental, subs[addr],
                                   names, **fields(addr))
                for addr, names in by_ps.items()}
        copies = {t.name: t.primaries() for t in tables}   # (replication: primaries)
        table_jobs = {t.name: [saves.submit(c.address, client_for(c.address).save_table,
                                            c.table, subs[c.address], **fields(c.address))
                               for c in copies[t.name]]
                      for t in tables}
        watched: dict[str, list] = {}
        for addr, job in jobs.items():
            watched.setdefault(addr, []).append(job)
        for t in tables:
            for c, job in zip(copies[t.name], table_jobs[t.name]):
                watched.setdefault(c.address, []).append(job)
        _await_saves(watched, client_for)
        for addr, job in jobs.items():
            reply = job.result()
            servers[addr] = reply.incarnation
            for f in reply.files:
                entry = {"version": f.version, "bytes": f.bytes, "kind": _kind(f.kind)}
                if f.file:
                    entry["file"] = os.path.relpath(os.path.join(subs[addr], f.file), tmp)
                    entry["crc32"] = _crc32(f, os.path.join(subs[addr], f.file))
                if f.kind == 1:
                    entry["delta_rows"] = f.rows
                files[f.name] = entry
        for t in table_jobs:
            table_files[t] = []
            for c, job in zip(copies[t], table_jobs[t]):
                r = job.result()
                servers[c.address] = r.incarnation
                table_files[t].append(
                    {"file": os.path.relpath(os.path.join(subs[c.address], r.file), tmp),
                     "rows": r.rows, "bytes": r.bytes, "step": r.step,
                     "crc32": _crc32(r, os.path.join(subs[c.address], r.file)),
                     "kind": _kind(r.kind), **({"evicted": r.evicted} if r.kind else {})})
        replica_files = _write_replicas(tmp, mirrored or {}, inc.weights_only)
        gone = [c.name for v in variables for c in chosen[v.name] if c.name not in files]
        if gone:
            raise CheckpointError(f"these shards disappeared during the save: {', '.join(gone)}")
        saved = {v.name: {
            "shape": list(v.shape), "dtype": v.dtype, "optimizer": v.optimizer,
            "shards": [{"name": s.name, "offset": s.offset, "rows": s.rows,
                        **files[c.name]} for s, c in zip(v.shards, chosen[v.name])]}
            for v in variables}
        manifest = {   # every file with its checksum (coordinator/shard_files.py)
            "format_version": 1, "checksum": CHECKSUM, "step": step, "time": time.time(),
            "extra": extra or {}, "variables": {**saved, **replica_files},
            "tables": {t.name: {"dim": t.dim, "dtype": t.dtype, "buckets": t.buckets.ranges(),
                                "shards": table_files[t.name]} for t in tables},
        }
        if tables:   # keys by bucket: readers before buckets must not read it
            manifest["format_version"] = FORMAT_VERSION
        if inc.save_id:
            manifest.update(save_id=inc.save_id, stream=inc.stream, servers=servers)
            if inc.weights_only:
                manifest["weights_only"] = True
            kinds = [e["kind"] for e in files.values()] + \
                [e["kind"] for es in table_files.values() for e in es]
            if inc.parent and any(k != "full" for k in kinds):   # else it stands alone: a base
                link = parent.get("chain", {})
                manifest["format_version"] = max(manifest["format_version"], CHAIN_VERSION)
                manifest["chain"] = {
                    "parent": os.path.basename(inc.parent[0]), "parent_id": parent["save_id"],
                    "base": link.get("base", os.path.basename(inc.parent[0])),
                    "depth": link.get("depth", 0) + 1}
        _write_json(os.path.join(tmp, "manifest.json"), manifest)
        _fsync_dir(tmp)   # its entries (manifest, ps-N/) on disk before it is renamed into
        replaced = None   # place (the servers fsynced each ps-N/ after their files)
        if os.path.exists(final):
            if not replace:
                raise CheckpointError(f"{final} appeared during the save (another saver?)")
            replaced = _set_aside(final, _REPLACED)   # saving the same step again replaces it
        os.replace(tmp, final)
        _fsync_dir(directory)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    except BaseException:
        saves.close()   # the calls not started never start; those running end;
        saves.settle(PROBE_SECONDS)   # then the files go
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        saves.close()
    if inc.save_id:
        _commit(inc, servers, client_for)
    return final, (sum(f["bytes"] for f in files.values())
                   + sum(f["shards"][0]["bytes"] for f in replica_files.values())
                   + sum(f["bytes"] for fs in table_files.values() for f in fs))


#: While servers save, each one still saving is asked for its ServerInfo
#: every PROBE_EVERY seconds (a PROBE_SECONDS deadline); PROBE_MISSES
#: unanswered in a row fail the save then (within about 20 s), saying which
#: server and why. A hung server, or a host whose packets are dropped,
#: answers nothing, where a busy one still answers. Before, such a save
#: ended when gRPC's keepalive gave up on the stream (about 60 s here:
#: "Stream removed (ping timeout)"), or at the call's deadline.
PROBE_EVERY, PROBE_SECONDS, PROBE_MISSES = 2.0, 5.0, 3


class _Saves:
    """The save calls of one checkpoint: each server's one after another (as
    many at once would each copy a shard under its lock and fill the
    server's request threads), in a daemon thread per server, so a save
    abandoned because its server hangs keeps no process from exiting.
    ``submit`` gives a future; ``close`` cancels the calls not started and
    lets the threads end."""

    def __init__(self):
        self._queues: dict[str, queue.SimpleQueue] = {}
        self.submitted: list[futures.Future] = []

    def submit(self, address: str, fn, *args, **kwargs) -> futures.Future:
        q = self._queues.get(address)
        if q is None:
            q = self._queues[address] = queue.SimpleQueue()
            threading.Thread(target=self._run, args=(q,), daemon=True,
                             name=f"checkpoint-save-{address}").start()
        done: futures.Future = futures.Future()
        q.put((done, fn, args, kwargs))
        self.submitted.append(done)
        return done

    def close(self) -> None:
        for f in self.submitted:
            f.cancel()   # (only those not started)
        for q in self._queues.values():
            q.put(None)
        self._queues.clear()

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the calls running now (after
        close: no other will start), so that a failed save's files are
        removed after its servers stopped writing them (a hung server's call
        is not waited for past the timeout)."""
        futures.wait([f for f in self.submitted if not f.done()], timeout=timeout)

    @staticmethod
    def _run(q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not None:
            done, fn, args, kwargs = item
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args, **kwargs))
                except BaseException as exc:   # (raised where the result is asked for)
                    done.set_exception(exc)


def _await_saves(jobs: Mapping[str, list], client_for: Callable[[str], Any]) -> None:
    """Wait for every server's save calls (``jobs``: address -> futures). A
    failed one ends the wait with its error (the others may still be
    running). A server with calls outstanding that answers no ServerInfo
    PROBE_MISSES times in a row (no reply in time, or no connection: an
    error reply means it is alive) fails the save: Unavailable naming it."""
    missed: dict[str, int] = {}
    since: dict[str, float] = {}
    every = [f for fs in jobs.values() for f in fs]
    while True:
        pending = [f for f in every if not f.done()]
        if pending:
            futures.wait(pending, timeout=PROBE_EVERY, return_when=futures.FIRST_EXCEPTION)
        for f in every:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()
        if all(f.done() for f in every):
            return
        for addr, fs in jobs.items():
            if all(f.done() for f in fs):
                continue
            asked = time.monotonic()
            try:
                client_for(addr).server_info(timeout=PROBE_SECONDS)
            except (Unavailable, DeadlineExceeded) as exc:
                since.setdefault(addr, asked)
                missed[addr] = missed.get(addr, 0) + 1
                if missed[addr] >= PROBE_MISSES:
                    raise Unavailable(
                        f"parameter server {addr} answered nothing for "
                        f"{time.monotonic() - since[addr]:.0f} s while it was saving (last: "
                        f"{type(exc).__name__}): it hangs, or its host is unreachable. The "
                        "save is abandoned and nothing was listed; check or restart that "
                        "server, then save again") from None
                continue
            except PSError:   # it answered (an error): alive
                pass
            missed.pop(addr, None)
            since.pop(addr, None)


def _crc32(reply, path: str) -> int:
    """The CRC-32 of a file a server wrote (``reply``: a SavedFile or a
    SaveTableReply); computed here from the file where the server sent none
    (a server of a pstrain that predates checksums)."""
    return reply.crc32 if reply.HasField("crc32") else crc32_of_path(path)


def _commit(inc: Incremental, servers: Mapping[str, str], client_for) -> None:
    """Tell every server that saved that the save is in place (CommitSave).
    A server that cannot be told keeps what the save took (the next delta
    is then larger, never wrong): logged, not raised."""
    for addr, incarnation in servers.items():
        try:
            client_for(addr).commit_save(inc.save_id, inc.stream, incarnation)
        except PSError as exc:
            log.warning("parameter server %s was not told that save %d is in place (%s); its "
                        "next incremental save takes those changes again", addr, inc.save_id,
                        exc)


def restore_checkpoint(path: str, variables: Sequence[V.ShardedVariable],
                       client_for: Callable[[str], Any], *,
                       copies: Callable[[V.ShardedVariable], Sequence[V.Shard]] = lambda v: v.shards,
                       address: str | None = None, tables: Sequence = ()) -> dict:
    """Load checkpoint ``path`` into ``variables`` (into ``copies(v)``, with
    ``address``: only those on that server). A delta is composed with its
    chain first (checkpoint_files.chain_of). Values and slots are
    reassembled and cut again by each variable's shards (any layout); a
    shard restored into the cut it was saved in keeps its version and
    idempotency keys. Everything is read and checked before any server is
    written, every variable and every table, as the servers check it
    (checkpoint_files.check_restorable): a checkpoint that lacks anything
    its manifest promises, holds what a server would refuse, or whose chain
    is broken, is refused (CheckpointError) with nothing changed. Returns
    {"step", "extra", "path"}. A server that fails, or refuses its part for
    a reason of its own (its --max-memory-bytes, a copy that is not
    primary), raises its PSError after the others may have been written:
    restore again once it is fixed."""
    chain = chain_of(path)
    manifest = chain[-1][1]
    if manifest.get("weights_only"):
        raise CheckpointError(f"{path} is a serving export (weights without optimizer state, "
                              "coordinator.serving): restore a checkpoint instead")
    loaded = [load_variable(v, chain) for v in variables]
    table_states = [load_table(t, chain) for t in tables]
    check_restorable(path, variables, loaded, tables, table_states)   # all before any write
    _metrics.checkpoint_bytes("restore", sum(
        e.get("bytes", 0) for _, m in chain for section in ("variables", "tables")
        for info in m.get(section, {}).values() for e in info.get("shards", ())))
    with futures.ThreadPoolExecutor(4) as pool:
        handles = [h for v, state in zip(variables, loaded)
                   for h in _write_variable(v, state, pool, client_for, copies, address)]
        handles += [h for t, (state, step) in zip(tables, table_states)
                    for h in _write_table(t, state, step, pool, client_for, address)]
        for h in handles:
            h.result()
    for t in tables:   # a layout moves made: the emptied shards are told it again
        if getattr(t, "layout_epoch", 0):
            elastic.serve_layout(t, client_for)
    return {"step": manifest["step"], "extra": manifest.get("extra", {}), "path": path}


def _write_table(t, state: dict, step: int, pool: futures.Executor, client_for,
                 address: str | None = None) -> list[futures.Future]:
    """Each current shard of ``t`` emptied and given the saved rows its keys
    send it now (``t.shard_of``: any number of servers), with its part of
    the table's capacity (table_capacities)."""
    keys = state.get("keys", np.zeros(0, np.int64))
    which = t.shard_of(keys)
    copies = t.primaries()   # (replication: each primary copies itself to its backup)
    limits = table_capacities(t, np.bincount(which, minlength=len(copies)), copies,
                              client_for, address)
    handles = []
    for i, copy in enumerate(copies):
        if address is not None and copy.address != address:
            continue
        mine = which == i
        part = {k: (a if a.ndim == 0 else a[mine]) for k, a in state.items()}
        if not part:
            part = {"keys": keys}
        handles.append(pool.submit(client_for(copy.address).import_table, copy.table,
                                   _full(part, t), step, reset=True, capacity=limits[i]))
    return handles


def table_capacities(t, rows, copies, client_for, address: str | None) -> list:
    """Each shard's capacity after a restore of ``rows[i]`` rows into shard
    i (psserver.contract.keys.fill_capacity: room for all of them and the
    rest of ``t.capacity`` by buckets, the parts summing to it; more rows
    than that: as near the shares as the rows allow). Restoring one
    server's shards (``address``): what the other shards' parts leave, as
    their servers have them (None, unchanged, if one cannot say)."""
    if not t.capacity:   # none (or a handle that does not know it): each as it is
        return [None] * len(copies)
    shares = t.buckets.counts()
    if address is None:
        if rows.sum() > t.capacity:
            log.warning("restoring %d rows of table %r into a capacity of %d: the servers "
                        "evict the rest by the table's policy", rows.sum(), t.name, t.capacity)
        return fill_capacity(t.capacity, shares, rows)
    mine = [i for i, c in enumerate(copies) if c.address == address]
    try:
        others = sum(client_for(c.address).table_info(c.table).spec.capacity
                     for i, c in enumerate(copies) if i not in mine)
    except PSError:
        return [None] * len(copies)
    limits: list = [None] * len(copies)
    for i, part in zip(mine, split_capacity(max(len(mine), t.capacity - others), shares[mine])):
        limits[i] = max(1, part)   # (0 would be no limit)
    return limits


def _full(part: dict, t) -> dict:
    """An import's arrays, the bookkeeping ones made for an empty table."""
    n = part["keys"].size
    defaults = {"values": np.zeros((n, t.dim), np.dtype(t.dtype)),
                "age_steps": np.zeros(n, np.int64), "age_seconds": np.zeros(n),
                "freq": np.zeros(n, np.int64)}
    return {**defaults, **part}


def _write_variable(v: V.ShardedVariable, state: dict, pool: futures.Executor, client_for,
                    copies, address: str | None = None) -> list[futures.Future]:
    handles = []
    for s, c in zip(v.shards, copies(v)):
        if address is not None and c.address != address:
            continue

        def cut(a, lo=s.offset, hi=s.offset + s.rows):
            return a if a.ndim == 0 else a[lo:hi]
        # Into the cut it was saved in: its own version, keys and scalar slots
        # (Adam's step count); resharded: the largest of each.
        version, applied, scalars = state["same_cut"].get((s.name, s.offset, s.rows),
                                                          (state["version"], (), {}))
        handles.append(pool.submit(
            client_for(c.address).create_variable, c.name, None, v.dtype,
            initial_value=cut(state["value"]), optimizer=v.optimizer,
            optimizer_params=state["optimizer_params"],
            allow_nonfinite=state["allow_nonfinite"],
            slots={k: scalars.get(k, cut(a)) for k, a in state["slots"].items()},
            version=version, overwrite=True, applied_ids=applied))
    return handles


def _write_replicas(tmp: str, mirrored: Mapping[str, tuple], weights_only: bool) -> dict:
    """Mirrored variables' files under ``tmp/replicas/``, as a server writes
    a shard (value, ``slot/<name>`` unless ``weights_only``, the same
    metadata), each a variable of one shard: their manifest entries, by name."""
    import zlib

    from safetensors.numpy import save
    out = {}
    if not mirrored:
        return out
    os.makedirs(os.path.join(tmp, "replicas"))
    for name, (v, (value, slots, version)) in mirrored.items():
        meta = {"name": name, "version": str(version), "optimizer": v.optimizer,
                "optimizer_params": json.dumps(v.optimizer_config()),
                "allow_nonfinite": json.dumps(v.allow_nonfinite), "kind": "full"}
        arrays = {"value": value, **{f"slot/{k}": a for k, a in slots.items()
                                     if not weights_only}}
        data = save({k: np.ascontiguousarray(a) if np.ndim(a) else np.asarray(a)   # (0-d
                     for k, a in arrays.items()}, metadata=meta)                   # stays)
        file = os.path.join("replicas", urllib.parse.quote(name, safe="") + ".safetensors")
        write_new(os.path.join(tmp, file), data)
        out[name] = {"shape": list(v.shape), "dtype": v.dtype.name, "optimizer": v.optimizer,
                     "shards": [{"name": name, "offset": 0, "rows": v.shape[0] if v.shape
                                 else 0, "version": version, "bytes": len(data),
                                 "kind": "full", "file": file, "crc32": zlib.crc32(data)}]}
    _fsync_dir(os.path.join(tmp, "replicas"))
    return out


def _write_json(path: str, obj) -> None:
    write_new(path, json.dumps(obj, indent=1).encode())   # a new file, no link followed




#: Names a checkpoint directory takes while it is being removed (deleted by
#: max_to_keep, or replaced by a new save of its step): out of the listed
#: namespace (ckpt-N) first, so a listed checkpoint is always complete, even
#: when the coordinator dies half-way through removing one.
_DELETING, _REPLACED = ".deleting-", ".replaced-"


def _set_aside(path: str, prefix: str) -> str:
    """Rename a checkpoint out of the listed namespace, durably; its new path."""
    parent, name = os.path.split(path)
    aside = os.path.join(parent, f"{prefix}{name}-{uuid.uuid4().hex[:8]}")
    os.replace(path, aside)
    _fsync_dir(parent)
    return aside


def remove_checkpoint(path: str) -> None:
    """Remove a checkpoint: unlisted at once (a rename), then deleted."""
    try:
        aside = _set_aside(path, _DELETING)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def clear_leftovers(directory: str) -> None:
    """What a coordinator that died mid-save or mid-removal left: unfinished
    saves and checkpoints set aside are deleted; a checkpoint set aside to be
    replaced whose replacement never landed is put back."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(_REPLACED):
            original = os.path.join(directory, name[len(_REPLACED):].rsplit("-", 1)[0])
            if not os.path.exists(original):
                os.replace(path, original)
                continue
        if (".tmp-" in name and name.startswith("ckpt-")) or \
                name.startswith((_DELETING, _REPLACED)):
            shutil.rmtree(path, ignore_errors=True)
