"""Checkpoints: every variable with its optimizer slots, written by the shards.

    ckpt = CheckpointManager(strategy, "/checkpoints", max_to_keep=3)
    ckpt.save(step=100, extra={"epoch": 4})     # after coord.join(), for a consistent cut
    ...
    state = ckpt.restore()                      # the latest, into the strategy's variables

Layout of one checkpoint (a directory; readable without this package)::

    ckpt-00000100/
      manifest.json              the variables, their shards and files, step, extra
      ps-0/<shard name>.safetensors   written by parameter server 0: "value",
      ps-1/...                        "slot/<name>" tensors; name, version and
                                      optimizer in the file's metadata

Incremental checkpoints (``incremental=True``): a full *base* now and then
(every ``full_every`` saves, and whenever the layout changed), and between
them *deltas* holding only what changed since the previous checkpoint: the
variables that changed, the rows a row-wise update touched (with their
slots; scalar slots, version and update keys whole), a dynamic table's rows
made, updated or looked up and the keys it evicted. Each parameter server
knows what changed in its shards since a save (psserver/tracking.py) and
writes the delta itself; where it cannot tell (it restarted, a shard was
restored or failed over since) it writes that shard whole: never a wrong
delta. A delta's manifest names its ``base`` and ``parent``; restoring it
applies base + every delta of the chain in order, which gives exactly what
a full checkpoint of that moment holds (coordinator/checkpoint_files.py).
The servers forget what a save took only once its manifest is renamed into
place (``CommitSave``): a save that fails is taken again by the next one.

Guarantees:

* Atomic: a checkpoint is written under ``ckpt-XXXX.tmp-<id>/`` and renamed
  to ``ckpt-XXXX/`` only after every shard file and the manifest are on disk.
  A crash at any point (of a parameter server or of the coordinator) leaves
  the previous checkpoints intact; ``latest()`` never returns a partial one,
  and the next ``save`` clears leftovers.
* Keeps the newest ``max_to_keep`` checkpoints, and every checkpoint their
  chains need, deleting the others after a save succeeds.
* Consistency: each shard is copied under its lock (one consistent value +
  slots + version per shard). Shards are taken one after another, so with
  asynchronous training in flight the checkpoint is not one global cut; save
  between steps (after ``ClusterCoordinator.join()``) for that. In sync mode
  that cut is exact (in hybrid mode too, after ``join()``: every push of
  the steps scheduled has been applied).
* Restore reshards: values and slots are reassembled along axis 0 from the
  saved shards and split again by the *current* variables' shards, so a
  checkpoint restores into any number of parameter servers or any
  partitioner. Adam's per-shard step count becomes the largest saved one.

Operators can do the same from outside the training program: ``coordinator
checkpoint save DIR`` builds the layout from the parameter servers' listing
(``checkpoint_layout.layout_from_listing``) and writes this same format; ``coordinator
checkpoint restore DIR`` checks that the checkpoint has the layout of the
servers (``checkpoint_layout.restore_plan``) and restores it. Both call the one implementation
here (``write_checkpoint``, ``restore_checkpoint``). See coordinator.cli.

The parameter servers write their own shard files, so every parameter
server must see ``directory`` at the same path (a shared volume: the
Kubernetes PersistentVolumeClaim, the compose named volume, or simply the
local disk for LocalCluster). The coordinator writes the manifest and reads
the files back on restore.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
import uuid
from concurrent import futures
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from coordinator import metrics as _metrics
from coordinator import ps_pool
from coordinator import variables as V
from coordinator.checkpoint_files import (FORMAT_VERSION, CheckpointError,  # noqa: F401
                                          chain_of, check_restorable, find_checkpoints,
                                          load_checked_shard, load_table, load_variable,
                                          read_manifest)
from psserver.errors import (DeadlineExceeded, FailedPrecondition, NotFound, PSError,
                             Unavailable)
from psserver.saving import fsync_dir as _fsync_dir

log = logging.getLogger("coordinator.checkpoint")

#: SavedFile.kind / SaveTableReply.kind (ps.proto SaveKind) as manifests write them.
_KIND_NAMES = {0: "full", 1: "delta", 2: "unchanged"}


def _kind(kind: int) -> str:
    if kind not in _KIND_NAMES:
        raise CheckpointError(f"a parameter server wrote a shard of kind {kind}, which this "
                              "version of pstrain does not know; upgrade the coordinator")
    return _KIND_NAMES[kind]



def _primaries(v) -> list:
    """Each shard's copy that is primary now (coordinator/routes.py)."""
    return ps_pool.servers().routes.primaries(v)

class CheckpointManager:
    """Save and restore the strategy's variables under ``directory``.

    Args:
      strategy: the ParameterServerStrategy whose variables to save.
      directory: where checkpoints go (created if missing).
      max_to_keep: how many newest checkpoints survive a save (with every
        checkpoint their chains need).
      every_n_steps / every_seconds: what ``maybe_save`` waits for between
        saves (either may be None).
      incremental: write a full base, then deltas chained to it (see the
        module); ``full_every``: a full base at least every that many saves.
      weights_only: values only, no optimizer state, update keys or table
        bookkeeping: a serving copy (coordinator.serving.Exporter), which
        ``restore`` refuses.
      client_for: address -> PSClient (default: the process's connection
        pool; the operator CLI passes its own).
    """

    def __init__(self, strategy, directory: str, *, max_to_keep: int = 5,
                 every_n_steps: int | None = None, every_seconds: float | None = None,
                 incremental: bool = False, full_every: int = 10, weights_only: bool = False,
                 client_for: Callable[[str], Any] | None = None):
        if max_to_keep < 1:
            raise ValueError("max_to_keep must be >= 1")
        if full_every < 1:
            raise ValueError("full_every must be >= 1 (1: every save is full)")
        self.strategy = strategy
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.every_n_steps, self.every_seconds = every_n_steps, every_seconds
        self.incremental, self.full_every = incremental, full_every
        self.weights_only = weights_only
        self._client_for = client_for or ps_pool.client_for
        # Whose saves these are, for the servers (psserver/tracking.py): each
        # directory's points are committed apart from any other's.
        self.stream = ("export:" if weights_only else "ckpt:") + hashlib.sha256(
            self.directory.encode()).hexdigest()[:24]
        self._parent: str | None = None   # the checkpoint the next delta follows
        self._force_full = False
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        os.makedirs(self.directory, exist_ok=True)

    # -- listing -----------------------------------------------------------------------
    def checkpoints(self) -> list[str]:
        """Complete checkpoints, oldest first."""
        return find_checkpoints(self.directory)

    def latest(self) -> str | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def restore_or_initialize(self) -> dict | None:
        """Restore the latest checkpoint if there is one (a restarted
        coordinator resumes from it); else leave the variables as created.
        Returns restore()'s dict, or None when there was nothing to restore."""
        return self.restore() if self.latest() else None

    # -- saving ---------------------------------------------------------------------------
    def maybe_save(self, step: int, extra: dict | None = None) -> str | None:
        """Save if every_n_steps steps or every_seconds seconds have passed.

        A save that fails because a parameter server is unreachable is
        skipped with a warning (the next one is due at once): a periodic
        checkpoint must not end a job that the coordinator is recovering.
        """
        due = False
        if self.every_n_steps and (self._last_step is None
                                   or step - self._last_step >= self.every_n_steps):
            due = True
        if self.every_seconds and time.monotonic() - self._last_time >= self.every_seconds:
            due = True
        if not due:
            return None
        try:
            return self.save(step, extra)
        except (Unavailable, DeadlineExceeded, NotFound) as exc:
            log.warning("checkpoint at step %d skipped: %s", step, exc)
            return None

    @_metrics.timed_checkpoint("save")
    def save(self, step: int, extra: dict | None = None) -> str:
        """Write a checkpoint of every variable; return its directory.

        ``extra`` (JSON-serialisable: epoch, data positions...) is stored in
        the manifest and returned by ``restore``. Saving a step again
        replaces its checkpoint (then it is a full one, and checkpoints
        whose chains needed the replaced one are removed).
        Raises PSError if a parameter server fails; nothing is left behind
        as a checkpoint then (an incremental save that failed is taken
        again by the next one).
        """
        self._clear_leftovers()
        ps_index = {addr: i for i, addr in enumerate(self.strategy.cluster_spec.ps)}
        final = os.path.join(self.directory, f"ckpt-{step:08d}")
        orphans = dependents(self.directory, final) if os.path.exists(final) else []
        incremental = None
        if self.incremental:
            parent = None if os.path.exists(final) else self._parent_for_next()
            incremental = Incremental(secrets.randbits(63) + 1, self.stream, parent,
                                      self.weights_only)

        def write(incremental):   # with replication: from the copies that are primary now
            return write_checkpoint(self.directory, step, self.strategy.variables,
                                    self._client_for, copies=_primaries,
                                    ps_index=ps_index, extra=extra,
                                    tables=self.strategy.tables, incremental=incremental)
        try:
            final, nbytes = write(incremental)
        except FailedPrecondition as exc:
            if incremental is None or incremental.parent is None:
                raise
            # A server has forgotten the parent's save (it took too many since): a base.
            log.warning("incremental checkpoint at step %d written whole: %s", step, exc)
            final, nbytes = write(Incremental(secrets.randbits(63) + 1, self.stream, None,
                                              self.weights_only))
        self._last_step, self._last_time = step, time.monotonic()
        self._parent, self._force_full = final, False
        for orphan in orphans:
            log.warning("removing %s: it was a delta of %s, which was just saved again",
                        orphan, final)
            remove_checkpoint(orphan)
        self._prune()
        _metrics.checkpoint_bytes("save", nbytes)
        return final

    def _parent_for_next(self) -> tuple[str, dict] | None:
        """(path, manifest) the next save is a delta of, or None: a full base
        is due (none yet, full_every reached, the layout changed, restored)."""
        if self._force_full:
            return None
        path = self._parent or self.latest()
        if path is None or not os.path.isdir(path):
            return None
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            return None
        depth = manifest.get("chain", {}).get("depth", 0)
        if manifest.get("stream") != self.stream or not manifest.get("save_id") or \
                depth + 1 >= self.full_every or \
                not same_layout(manifest, self.strategy.variables, self.strategy.tables):
            return None
        return path, manifest

    def _prune(self) -> None:
        """Remove all but the newest max_to_keep checkpoints and what their
        chains need."""
        ckpts = self.checkpoints()
        keep = set(ckpts[-self.max_to_keep:])
        for path in list(keep):
            try:
                keep.update(p for p, _ in chain_of(path))
            except CheckpointError:
                pass   # (a broken chain keeps nothing else)
        for old in ckpts:
            if old not in keep:
                remove_checkpoint(old)

    def _clear_leftovers(self) -> None:
        clear_leftovers(self.directory)

    # -- restoring ------------------------------------------------------------------------
    @_metrics.timed_checkpoint("restore")
    def restore(self, path: str | None = None, *, address: str | None = None) -> dict:
        """Load a checkpoint (default: the latest) into the strategy's variables.

        Every variable of the strategy must be in the checkpoint with the same
        shape, dtype and optimizer (its sharding may differ). A delta is
        restored with its whole chain (base + every delta in order). With
        ``address``, only the shards on that parameter server are restored
        (recovering a server that restarted). Returns {"step", "extra",
        "path"}. Raises CheckpointError (a broken chain, a serving export
        among them).
        """
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        chosen = [v for v in self.strategy.variables
                  if address is None or any(s.address == address for s in _primaries(v))]
        # Into the copy that is primary now; a replicated one copies its new
        # state to its backup before answering (psserver/replication.py).
        out = restore_checkpoint(path, chosen, self._client_for, copies=_primaries,
                                 address=address, tables=self.strategy.tables)
        if address is None:   # the servers hold that checkpoint now: the next save is a base
            self._force_full = True
        return out


@dataclasses.dataclass(frozen=True)
class Incremental:
    """An incremental save: its id, its stream (psserver/tracking.py), the
    checkpoint it is a delta of ((path, manifest); None: a base) and whether
    it holds weights only (a serving export)."""
    save_id: int
    stream: str
    parent: tuple[str, dict] | None = None
    weights_only: bool = False


def same_layout(manifest: Mapping[str, Any], variables: Sequence[V.ShardedVariable],
                tables: Sequence = ()) -> bool:
    """Whether a checkpoint has these variables (shapes, dtypes, optimizers,
    shards) and dynamic tables (dims, dtypes, number of shards): a delta
    can follow it only then."""
    saved, saved_tables = manifest.get("variables", {}), manifest.get("tables", {})
    if set(saved) != {v.name for v in variables} or set(saved_tables) != {t.name for t in tables}:
        return False
    for v in variables:
        info = saved[v.name]
        if (info.get("shape"), info.get("dtype"), info.get("optimizer")) != (
                list(v.shape), v.dtype, v.optimizer) or \
                [(s.get("name"), s.get("offset"), s.get("rows")) for s in info.get("shards", ())] != \
                [(s.name, s.offset, s.rows) for s in v.shards]:
            return False
    return all((saved_tables[t.name].get("dim"), saved_tables[t.name].get("dtype"),
                len(saved_tables[t.name].get("shards", ()))) == (t.dim, t.dtype, t.num_shards)
               for t in tables)


def dependents(directory: str, path: str) -> list[str]:
    """The checkpoints in ``directory`` whose chains need ``path`` (not itself)."""
    out = []
    for other in find_checkpoints(directory):
        if other == path:
            continue
        try:
            if path in (p for p, _ in chain_of(other)):
                out.append(other)
        except CheckpointError:
            pass
    return out


# -- the one implementation of save and restore (CheckpointManager, coordinator checkpoint) --
def write_checkpoint(directory: str, step: int, variables: Sequence[V.ShardedVariable],
                     client_for: Callable[[str], Any], *,
                     copies: Callable[[V.ShardedVariable], Sequence[V.Shard]] = lambda v: v.shards,
                     ps_index: Mapping[str, int] | None = None, extra: dict | None = None,
                     replace: bool = True, tables: Sequence = (),
                     incremental: Incremental | None = None) -> tuple[str, int]:
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
    try:
        os.makedirs(tmp)
        addresses = set(by_ps) | {a for t in tables for a in t.addresses}
        with futures.ThreadPoolExecutor(max(1, len(addresses))) as pool:
            subs = {}
            for addr in addresses:
                subs[addr] = os.path.join(tmp, f"ps-{ps_index.get(addr, addr)}")
                os.makedirs(subs[addr])
            jobs = {addr: pool.submit(client_for(addr).save_incremental, subs[addr], names,
                                      **fields(addr))
                    for addr, names in by_ps.items()}
            copies = {t.name: t.primaries() for t in tables}   # (replication: primaries)
            table_jobs = {t.name: [pool.submit(client_for(c.address).save_table, c.table,
                                               subs[c.address], **fields(c.address))
                                   for c in copies[t.name]]
                          for t in tables}
            for addr, job in jobs.items():
                reply = job.result()
                servers[addr] = reply.incarnation
                for f in reply.files:
                    entry = {"version": f.version, "bytes": f.bytes, "kind": _kind(f.kind)}
                    if f.file:
                        entry["file"] = os.path.relpath(os.path.join(subs[addr], f.file), tmp)
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
                         "kind": _kind(r.kind), **({"evicted": r.evicted} if r.kind else {})})
        gone = [c.name for v in variables for c in chosen[v.name] if c.name not in files]
        if gone:
            raise CheckpointError(f"these shards disappeared during the save: {', '.join(gone)}")
        manifest = {
            "format_version": 1, "step": step, "time": time.time(),
            "extra": extra or {},
            "variables": {v.name: {
                "shape": list(v.shape), "dtype": v.dtype, "optimizer": v.optimizer,
                "shards": [{"name": s.name, "offset": s.offset, "rows": s.rows,
                            **files[c.name]} for s, c in zip(v.shards, chosen[v.name])]}
                for v in variables},
            "tables": {t.name: {"dim": t.dim, "dtype": t.dtype, "shards": table_files[t.name]}
                       for t in tables},
        }
        if inc.save_id:
            manifest.update(save_id=inc.save_id, stream=inc.stream, servers=servers)
            if inc.weights_only:
                manifest["weights_only"] = True
            kinds = [e["kind"] for e in files.values()] + \
                [e["kind"] for es in table_files.values() for e in es]
            if inc.parent and any(k != "full" for k in kinds):   # else it stands alone: a base
                link = parent.get("chain", {})
                manifest.update(format_version=FORMAT_VERSION, chain={
                    "parent": os.path.basename(inc.parent[0]), "parent_id": parent["save_id"],
                    "base": link.get("base", os.path.basename(inc.parent[0])),
                    "depth": link.get("depth", 0) + 1})
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
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if inc.save_id:
        _commit(inc, servers, client_for)
    return final, (sum(f["bytes"] for f in files.values())
                   + sum(f["bytes"] for fs in table_files.values() for f in fs))


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
    return {"step": manifest["step"], "extra": manifest.get("extra", {}), "path": path}


def _write_table(t, state: dict, step: int, pool: futures.Executor, client_for,
                 address: str | None = None) -> list[futures.Future]:
    """Each current shard of ``t`` emptied and given the saved rows its keys
    send it now (psserver.dynamic_table.shard_of: any number of servers)."""
    from psserver.keys import shard_of
    keys = state.get("keys", np.zeros(0, np.int64))
    which = shard_of(keys, len(t.addresses))
    handles = []
    for i, copy in enumerate(t.primaries()):   # (replication: each primary copies
        if address is not None and copy.address != address:   # itself to its backup)
            continue
        mine = which == i
        part = {k: (a if a.ndim == 0 else a[mine]) for k, a in state.items()}
        if not part:
            part = {"keys": keys}
        handles.append(pool.submit(client_for(copy.address).import_table, copy.table,
                                   _full(part, t), step, reset=True))
    return handles


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


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())




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
