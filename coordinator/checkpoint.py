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

Guarantees:

* Atomic: a checkpoint is written under ``ckpt-XXXX.tmp-<id>/`` and renamed
  to ``ckpt-XXXX/`` only after every shard file and the manifest are on disk.
  A crash at any point (of a parameter server or of the coordinator) leaves
  the previous checkpoints intact; ``latest()`` never returns a partial one,
  and the next ``save`` clears leftovers.
* Keeps the newest ``max_to_keep`` checkpoints, deleting older ones after a
  save succeeds.
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

import json
import logging
import os
import re
import shutil
import time
import uuid
from concurrent import futures
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from coordinator import metrics as _metrics
from coordinator import routes
from coordinator import variables as V
from psserver.errors import DeadlineExceeded, NotFound, Unavailable

log = logging.getLogger("coordinator.checkpoint")

FORMAT_VERSION = 1
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, or does not match the variables."""


class CheckpointManager:
    """Save and restore the strategy's variables under ``directory``.

    Args:
      strategy: the ParameterServerStrategy whose variables to save.
      directory: where checkpoints go (created if missing).
      max_to_keep: how many newest checkpoints survive a save.
      every_n_steps / every_seconds: what ``maybe_save`` waits for between
        saves (either may be None).
    """

    def __init__(self, strategy, directory: str, *, max_to_keep: int = 5,
                 every_n_steps: int | None = None, every_seconds: float | None = None):
        if max_to_keep < 1:
            raise ValueError("max_to_keep must be >= 1")
        self.strategy = strategy
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.every_n_steps, self.every_seconds = every_n_steps, every_seconds
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
        replaces its checkpoint.
        Raises PSError if a parameter server fails; nothing is left behind
        as a checkpoint then.
        """
        self._clear_leftovers()
        ps_index = {addr: i for i, addr in enumerate(self.strategy.cluster_spec.ps)}
        # With replication, each shard is saved from the copy that is primary now.
        final, nbytes = write_checkpoint(self.directory, step, self.strategy.variables,
                                         V.client_for, copies=routes.primaries,
                                         ps_index=ps_index, extra=extra,
                                         tables=self.strategy.tables)
        self._last_step, self._last_time = step, time.monotonic()
        for old in self.checkpoints()[:-self.max_to_keep]:
            remove_checkpoint(old)
        _metrics.checkpoint_bytes("save", nbytes)
        return final

    def _clear_leftovers(self) -> None:
        clear_leftovers(self.directory)

    # -- restoring ------------------------------------------------------------------------
    @_metrics.timed_checkpoint("restore")
    def restore(self, path: str | None = None, *, address: str | None = None) -> dict:
        """Load a checkpoint (default: the latest) into the strategy's variables.

        Every variable of the strategy must be in the checkpoint with the same
        shape, dtype and optimizer (its sharding may differ). With
        ``address``, only the shards on that parameter server are restored
        (recovering a server that restarted). Returns {"step", "extra",
        "path"}. Raises CheckpointError.
        """
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        chosen = [v for v in self.strategy.variables
                  if address is None or any(s.address == address for s in routes.primaries(v))]
        # Into the copy that is primary now; a replicated one copies its new
        # state to its backup before answering (psserver/replication.py).
        return restore_checkpoint(path, chosen, V.client_for, copies=routes.primaries,
                                  address=address, tables=self.strategy.tables)


# -- the one implementation of save and restore (CheckpointManager, coordinator checkpoint) --
def write_checkpoint(directory: str, step: int, variables: Sequence[V.ShardedVariable],
                     client_for: Callable[[str], Any], *,
                     copies: Callable[[V.ShardedVariable], Sequence[V.Shard]] = lambda v: v.shards,
                     ps_index: Mapping[str, int] | None = None, extra: dict | None = None,
                     replace: bool = True, tables: Sequence = ()) -> tuple[str, int]:
    """Write checkpoint ``step`` of ``variables`` under ``directory``: each
    server saves its shards (``copies(v)``: the copies to save from, in shard
    order) through ``client_for(address)``, then the manifest is written and
    the directory renamed into place. Returns (its path, shard bytes).

    ``replace``: a checkpoint of the same step is replaced; else refused
    (CheckpointError). A failed save (PSError from a server, OSError,
    CheckpointError) leaves nothing listed.
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
    files: dict[str, Any] = {}
    table_files: dict[str, list] = {}
    try:
        os.makedirs(tmp)
        addresses = set(by_ps) | {a for t in tables for a in t.addresses}
        with futures.ThreadPoolExecutor(max(1, len(addresses))) as pool:
            subs = {}
            for addr in addresses:
                subs[addr] = os.path.join(tmp, f"ps-{ps_index.get(addr, addr)}")
                os.makedirs(subs[addr])
            jobs = {addr: pool.submit(client_for(addr).save, subs[addr], names)
                    for addr, names in by_ps.items()}
            copies = {t.name: t.primaries() for t in tables}   # (replication: primaries)
            table_jobs = {t.name: [pool.submit(client_for(c.address).save_table, c.table,
                                               subs[c.address]) for c in copies[t.name]]
                          for t in tables}
            for addr, job in jobs.items():
                for f in job.result():
                    files[f.name] = {"file": os.path.relpath(os.path.join(subs[addr], f.file),
                                                             tmp),
                                     "version": f.version, "bytes": f.bytes}
            for t in tables:
                table_files[t.name] = [
                    {"file": os.path.relpath(os.path.join(subs[a], r.file), tmp),
                     "rows": r.rows, "bytes": r.bytes, "step": r.step}
                    for a, r in zip((c.address for c in copies[t.name]),
                                    (j.result() for j in table_jobs[t.name]))]
        gone = [c.name for v in variables for c in chosen[v.name] if c.name not in files]
        if gone:
            raise CheckpointError(f"these shards disappeared during the save: {', '.join(gone)}")
        manifest = {
            "format_version": FORMAT_VERSION, "step": step, "time": time.time(),
            "extra": extra or {},
            "variables": {v.name: {
                "shape": list(v.shape), "dtype": v.dtype, "optimizer": v.optimizer,
                "shards": [{"name": s.name, "offset": s.offset, "rows": s.rows,
                            **files[c.name]} for s, c in zip(v.shards, chosen[v.name])]}
                for v in variables},
            "tables": {t.name: {"dim": t.dim, "dtype": t.dtype, "shards": table_files[t.name]}
                       for t in tables},
        }
        _write_json(os.path.join(tmp, "manifest.json"), manifest)
        replaced = None
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
    return final, (sum(f["bytes"] for f in files.values())
                   + sum(f["bytes"] for fs in table_files.values() for f in fs))


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint ``path``, checked to be one this version reads."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the manifest of {path}: {exc}") from None
    saved = manifest.get("variables") if isinstance(manifest, dict) else None
    if not isinstance(saved, dict) or "step" not in manifest:
        raise CheckpointError(f"the manifest of {path} lacks its variables or step; "
                              "nothing was restored")
    if manifest.get("format_version", 1) > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {manifest['format_version']}; this "
                              f"version of pstrain reads up to {FORMAT_VERSION}")
    return manifest


def restore_checkpoint(path: str, variables: Sequence[V.ShardedVariable],
                       client_for: Callable[[str], Any], *,
                       copies: Callable[[V.ShardedVariable], Sequence[V.Shard]] = lambda v: v.shards,
                       address: str | None = None, tables: Sequence = ()) -> dict:
    """Load checkpoint ``path`` into ``variables`` (into ``copies(v)``, with
    ``address``: only those on that server). Values and slots are
    reassembled and cut again by each variable's shards (any layout); a
    shard restored into the cut it was saved in keeps its version and
    idempotency keys. Everything is read and checked before any server is
    written: a checkpoint that lacks anything its manifest promises is
    refused (CheckpointError) with nothing changed. Returns {"step",
    "extra", "path"}; a server's failure raises its PSError."""
    manifest = read_manifest(path)
    saved = manifest["variables"]
    loaded = [_load_variable(v, saved.get(v.name), path) for v in variables]
    saved_tables = manifest.get("tables", {})
    table_states = [_load_table(t, saved_tables.get(t.name), path) for t in tables]
    with futures.ThreadPoolExecutor(4) as pool:
        handles = [h for v, state in zip(variables, loaded)
                   for h in _write_variable(v, state, pool, client_for, copies, address)]
        handles += [h for t, (state, step) in zip(tables, table_states)
                    for h in _write_table(t, state, step, pool, client_for, address)]
        for h in handles:
            h.result()
    return {"step": manifest["step"], "extra": manifest.get("extra", {}), "path": path}


def _load_variable(v: V.ShardedVariable, info: dict | None, path: str) -> dict:
    """The variable's whole state from checkpoint ``path`` (checked)."""
    if info is None:
        raise CheckpointError(f"variable {v.name!r} is not in checkpoint {path}")
    try:
        same = (tuple(info["shape"]), info["dtype"], info["optimizer"]) == (
            v.shape, v.dtype, v.optimizer)
        entries = list(info["shards"])
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"the manifest of {path} is incomplete: {v.name!r} lacks "
                              f"{exc}; nothing was restored") from None
    if not same:
        raise CheckpointError(
            f"variable {v.name!r} is {v.dtype} {list(v.shape)} {v.optimizer} here but "
            f"{info['dtype']} {info['shape']} {info['optimizer']} in {path}")
    if not entries:
        raise CheckpointError(f"the manifest of {path} lists no shard of {v.name!r}")
    if v.shape:   # the shards must cover the rows in order, each once
        covered = 0
        for e in entries:
            if e.get("offset") != covered or not isinstance(e.get("rows"), int):
                break
            covered += e["rows"]
        if covered != v.shape[0] or e.get("offset") is None:
            raise CheckpointError(f"the shards of {v.name!r} in {path} do not cover its "
                                  f"{v.shape[0]} rows in order; nothing was restored")
    loaded = [load_checked_shard(path, e, v.dtype, v.shape, v.optimizer) for e in entries]
    _metrics.checkpoint_bytes("restore", sum(e.get("bytes", 0) for e in entries))
    parts = [tensors for tensors, _ in loaded]
    meta = loaded[0][1]
    slots = {}
    for key in parts[0]:
        if key.startswith("slot/"):
            arrays = [p[key] for p in parts]
            slots[key[5:]] = (np.max(arrays).astype(arrays[0].dtype).reshape(())
                              if arrays[0].ndim == 0 else _join(arrays, v.shape))
    # A shard restored into the same place keeps its version, idempotency keys
    # and scalar slots (same_cut).
    return {"value": _join([p["value"] for p in parts], v.shape), "slots": slots,
            "optimizer_params": json.loads(meta.get("optimizer_params", "{}")),
            "allow_nonfinite": json.loads(meta.get("allow_nonfinite", "false")),
            "version": max(int(e["version"]) for e in entries),
            "same_cut": {(e["name"], e["offset"], e["rows"]):
                         (int(e["version"]), p.get("applied_ids", ()),
                          {k[5:]: a for k, a in p.items() if k.startswith("slot/") and a.ndim == 0})
                         for e, p in zip(entries, parts)}}


def _load_table(t, info: dict | None, path: str) -> tuple[dict[str, np.ndarray], int]:
    """A dynamic table's rows from checkpoint ``path``, every shard file
    joined (keys unique), and the largest shard step; checked against the
    table ``t`` (dim, dtype) and the files against the manifest."""
    if info is None:
        raise CheckpointError(f"dynamic table {t.name!r} is not in checkpoint {path}")
    try:
        same = (int(info["dim"]), info["dtype"]) == (t.dim, t.dtype)
        entries = list(info["shards"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest of {path} is incomplete: table {t.name!r} lacks "
                              f"{exc}; nothing was restored") from None
    if not same:
        raise CheckpointError(f"dynamic table {t.name!r} has dim {t.dim} {t.dtype} here but "
                              f"{info['dim']} {info['dtype']} in {path}")
    parts, step = [], 0
    for e in entries:
        try:
            file, rows = os.path.join(path, e["file"]), int(e["rows"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the manifest of {path} is incomplete: a shard of table "
                                  f"{t.name!r} lacks {exc}; nothing was restored") from None
        tensors, meta = _load_shard(file)
        keys = tensors.get("keys")
        values = tensors.get("values")
        if keys is None or keys.shape != (rows,) or values is None or \
                values.shape != (rows, t.dim) or values.dtype.name != t.dtype:
            raise CheckpointError(f"checkpoint file {file} does not hold the {rows} rows of "
                                  f"dim {t.dim} {t.dtype} its manifest promises; nothing was "
                                  "restored (restore an older one: coordinator checkpoint list)")
        parts.append(tensors)
        step = max(step, int(meta.get("step", "0")))
    from psserver import optimizers as optim
    slots = optim.make_optimizer(t.optimizer, {}).create_slots(np.zeros((1, t.dim)))
    names = {"keys", "values", "age_steps", "age_seconds", "freq"} | {f"slot/{n}" for n in slots}
    for e, p in zip(entries, parts):
        if set(p) != names:
            raise CheckpointError(
                f"checkpoint file {os.path.join(path, e['file'])} holds {sorted(p)}, not the "
                f"arrays of a {t.optimizer} table ({sorted(names)}); nothing was restored")
    state = {k: (np.max([p[k] for p in parts]).astype(parts[0][k].dtype).reshape(())
                 if parts[0][k].ndim == 0 else np.concatenate([p[k] for p in parts]))
             for k in names}
    if state and np.unique(state["keys"]).size != state["keys"].size:
        raise CheckpointError(f"the shard files of table {t.name!r} in {path} hold a key "
                              "twice; nothing was restored")
    if state:   # by key, whatever the shards were
        order = np.argsort(state["keys"], kind="stable")
        state = {k: a if a.ndim == 0 else a[order] for k, a in state.items()}
    _metrics.checkpoint_bytes("restore", sum(e.get("bytes", 0) for e in entries))
    return state, step


def _write_table(t, state: dict, step: int, pool: futures.Executor, client_for,
                 address: str | None = None) -> list[futures.Future]:
    """Each current shard of ``t`` emptied and given the saved rows its keys
    send it now (psserver.dynamic_table.shard_of: any number of servers)."""
    from psserver.dynamic_table import shard_of
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


def load_checked_shard(ckpt: str, entry: Mapping[str, Any], dtype: str, shape: Sequence[int],
                       optimizer: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of one shard file of checkpoint ``ckpt``, checked
    to hold all its manifest entry promises for a shard of a ``dtype``
    variable of ``shape`` (its rows) with ``optimizer``: the value, every
    slot the optimizer keeps, each of the right dtype and shape, readable
    metadata. Raises CheckpointError naming the file and what is missing."""
    from psserver import optimizers as optim

    try:
        file = os.path.join(ckpt, entry["file"])
        rows, version = int(entry["rows"]), int(entry["version"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest of {ckpt} is incomplete: a shard entry of "
                              f"{entry.get('name', '?')!r} lacks {exc}; the checkpoint cannot "
                              "be restored (restore an older one: coordinator checkpoint "
                              "list)") from None
    tensors, meta = _load_shard(file)
    want = tuple(shape) if not shape else (rows,) + tuple(shape[1:])

    def refuse(what: str):
        raise CheckpointError(f"checkpoint file {file} {what}: the checkpoint is incomplete "
                              "or damaged and nothing was restored (restore an older one: "
                              "coordinator checkpoint list)")
    value = tensors.get("value")
    if value is None:
        refuse("holds no value")
    if value.dtype.name != dtype or value.shape != want:
        refuse(f"holds a {value.dtype.name} {list(value.shape)} value, not {dtype} {list(want)}")
    if meta.get("optimizer", optimizer) != optimizer:
        refuse(f"was saved with optimizer {meta.get('optimizer')}, not {optimizer}")
    try:
        params = json.loads(meta.get("optimizer_params", "{}"))
        json.loads(meta.get("allow_nonfinite", "false"))
        expected = optim.make_optimizer(optimizer, params).create_slots(
            np.zeros(want, np.dtype(dtype)))
    except (ValueError, TypeError) as exc:
        refuse(f"has unreadable metadata ({exc})")
    for name, proto in expected.items():
        got = tensors.get(f"slot/{name}")
        if got is None:
            refuse(f"lacks the optimizer slot {name!r} that {optimizer} keeps")
        if got.dtype != proto.dtype or got.shape != proto.shape:
            refuse(f"holds slot {name!r} as {got.dtype.name} {list(got.shape)}, not "
                   f"{proto.dtype.name} {list(proto.shape)}")
    extra = sorted(k[5:] for k in tensors if k.startswith("slot/") and k[5:] not in expected)
    if extra:
        refuse(f"holds slots {extra} that {optimizer} does not keep")
    if version < 0:
        refuse(f"has version {version}")
    return tensors, meta


def _load_shard(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of one shard file."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="np") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from None


def _join(arrays: list[np.ndarray], shape) -> np.ndarray:
    if not shape:
        return arrays[0]
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def find_checkpoints(directory: str) -> list[str]:
    """Complete checkpoints (ckpt-N/ with a manifest) in directory, oldest
    first, as CheckpointManager.checkpoints() sees them; [] when the
    directory does not exist."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        m = _CKPT_RE.match(name)
        path = os.path.join(directory, name)
        if m and os.path.isfile(os.path.join(path, "manifest.json")):
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]
