"""Checkpoints: every variable with its optimizer slots, written by the shards.

    ckpt = CheckpointManager(strategy, "/checkpoints", max_to_keep=3)
    ckpt.save(step=100, extra={"epoch": 4})     # after coord.join(), for a consistent cut
    ...
    state = ckpt.restore()                      # the latest, into the strategy's variables

Layout of one checkpoint (a directory; readable without this package)::

    ckpt-00000100/
      manifest.json              the variables, their shards and files (each
                                 with its size and CRC-32), step, extra
      ps-0/<shard name>.safetensors   written by parameter server 0: "value",
      ps-1/...                        "slot/<name>" tensors; name, version and
                                      optimizer in the file's metadata

Incremental checkpoints (``incremental=True``): a full *base* now and then
(every ``full_every`` saves, and whenever the layout changed), and between
them *deltas* holding only what changed since the previous checkpoint: the
variables that changed, the rows a row-wise update touched (with their
slots; scalar slots, version and update keys whole), a dynamic table's rows
made, updated or looked up and the keys it evicted. Each parameter server
knows what changed in its shards since a save (psserver/core/tracking.py) and
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
* Checked: each file's CRC-32 (computed by the server that wrote it) is in
  the manifest, and every reader (restore, Snapshot, the side evaluator)
  refuses a file whose bytes no longer match, naming it, before anything
  is written (coordinator/shard_files.py). Checkpoints written before
  checksums (no ``"checksum"`` in the manifest) are read unchecked.
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

import hashlib
import logging
import os
import secrets
import time
from typing import Any, Callable, Mapping, Sequence

from coordinator import elastic, ps_pool
from coordinator import metrics as _metrics
from coordinator import variables as V
from coordinator.checkpoint_files import (
    CheckpointError,
    chain_of,
    find_checkpoints,
    load_variable,
    read_manifest,
)
from coordinator.checkpoint_io import (
    Incremental,
    clear_leftovers,
    remove_checkpoint,
    restore_checkpoint,
    write_checkpoint,
)
from psserver.contract.tensor import all_finite
from psserver.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    Unavailable,
)

log = logging.getLogger("coordinator.checkpoint")


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
        # Whose saves these are, for the servers (psserver/core/tracking.py): each
        # directory's points are committed apart from any other's.
        self.stream = ("export:" if weights_only else "ckpt:") + hashlib.sha256(
            self.directory.encode()).hexdigest()[:24]
        self._parent: str | None = None   # the checkpoint the next delta follows
        self._force_full = False
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        #: Checkpoints max_to_keep never removes (with what their chains need):
        #: CheckpointCallback's best, and its candidates awaiting validation.
        self.pinned: set[str] = set()
        self._candidates: set[str] = set()   # saved as candidates since (remove)
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
    def save(self, step: int, extra: dict | None = None, *, candidate: bool = False) -> str:
        """Write a checkpoint of every variable; return its directory.
        ``candidate``: one that ``remove`` may take back (CheckpointCallback's
        save_best_only), until a save of the same step that is not one.

        ``extra`` (JSON-serialisable: epoch, data positions...) is stored in
        the manifest and returned by ``restore``. Saving a step again
        replaces its checkpoint (then it is a full one, and checkpoints
        whose chains needed the replaced one are removed).
        Raises PSError if a parameter server fails; nothing is left behind
        as a checkpoint then (an incremental save that failed is taken
        again by the next one).
        """
        self._clear_leftovers()
        ps_index = {addr: i for i, addr in enumerate(self.strategy.parameter_servers)}
        final = os.path.join(self.directory, f"ckpt-{step:08d}")
        orphans = dependents(self.directory, final) if os.path.exists(final) else []
        incremental = None
        if self.incremental:
            parent = None if os.path.exists(final) else self._parent_for_next()
            incremental = Incremental(secrets.randbits(63) + 1, self.stream, parent,
                                      self.weights_only)

        mirrored = self._replicas()   # (all-reduce mode: one worker's, after its steps)

        def write(incremental):   # with replication: from the copies that are primary now
            return write_checkpoint(self.directory, step, self.strategy.variables,
                                    self._client_for, copies=_primaries,
                                    ps_index=ps_index, extra=extra,
                                    tables=self.strategy.tables, incremental=incremental,
                                    mirrored=mirrored)
        try:
            with elastic.LAYOUT_LOCK:   # (no bucket moves under a save)
                final, nbytes = write(incremental)
        except FailedPrecondition as exc:
            if incremental is None or incremental.parent is None:
                raise
            # A server has forgotten the parent's save (it took too many since): a base.
            log.warning("incremental checkpoint at step %d written whole: %s", step, exc)
            with elastic.LAYOUT_LOCK:
                final, nbytes = write(Incremental(secrets.randbits(63) + 1, self.stream, None,
                                                  self.weights_only))
        self._last_step, self._last_time = step, time.monotonic()
        self._parent, self._force_full = final, False
        (self._candidates.add if candidate else self._candidates.discard)(final)
        for orphan in orphans:
            log.warning("removing %s: it was a delta of %s, which was just saved again",
                        orphan, final)
            remove_checkpoint(orphan)
        self._prune()
        _metrics.checkpoint_bytes("save", nbytes)
        return final

    def _coordinator(self):
        coord = getattr(self.strategy, "replicas_from", lambda: None)()
        if coord is None:
            raise CheckpointError(
                "this strategy's variables are mirrored on its workers (mode=\"allreduce\"): "
                "saving or restoring them needs the ClusterCoordinator that trains them; "
                "make it first")
        return coord

    def _replicas(self) -> dict:
        """name -> (variable, (value, slots, version)) of all-reduce mode's
        variables, from the worker whose replicas applied the most updates."""
        variables = getattr(self.strategy, "mirrored_variables", [])
        if not variables:
            return {}
        states = self._coordinator().replica_states(variables)
        return {v.name: (v, states[v.name]) for v in variables}

    def remove(self, path: str) -> bool:
        """Remove checkpoint ``path``, saved as a candidate, unless a save of
        its step since was not one (another caller wants it) or another
        checkpoint's chain needs it (False: then it stays, and retention
        removes it in time)."""
        if path not in self._candidates:
            return False
        others = [p for p in self.checkpoints() if p != path]
        for other in others:
            try:
                if path in (p for p, _ in chain_of(other)):
                    return False
            except CheckpointError:
                pass
        self.pinned.discard(path)
        self._candidates.discard(path)
        if self._parent == path:
            self._parent = None   # the next save does not follow it
        remove_checkpoint(path)
        return True

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
                not same_layout(manifest, self.strategy.variables, self.strategy.tables,
                                getattr(self.strategy, "mirrored_variables", [])):
            return None
        return path, manifest

    def _prune(self) -> None:
        """Remove all but the newest max_to_keep checkpoints and what their
        chains need."""
        ckpts = self.checkpoints()
        keep = set(ckpts[-self.max_to_keep:]) | (self.pinned & set(ckpts))
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
        mirrored = getattr(self.strategy, "mirrored_variables", []) if address is None else []
        if mirrored:   # read and checked before anything is written
            coord, chain = self._coordinator(), chain_of(path)
            if chain[-1][1].get("weights_only"):
                raise CheckpointError(f"{path} is a serving export: restore a checkpoint")
            loaded = [load_variable(v, chain) for v in mirrored]
            for v, state in zip(mirrored, loaded):
                if not v.allow_nonfinite and not all_finite(state["value"]):
                    raise CheckpointError(f"variable {v.name!r} in {path} holds NaN or Inf, "
                                          "which it does not allow; nothing was restored")
        # Into the copy that is primary now; a replicated one copies its new
        # state to its backup before answering (psserver/core/replication.py).
        with elastic.LAYOUT_LOCK:   # (not into tables an add is moving)
            out = restore_checkpoint(path, chosen, self._client_for, copies=_primaries,
                                     address=address, tables=self.strategy.tables)
        if mirrored:   # onto every worker's replicas
            coord.set_replicas({v.name: (state["value"], state["slots"], state["version"])
                                for v, state in zip(mirrored, loaded)}, mirrored)
            # steps go on from the replicas' update count (batches chosen by step:
            # not those of the steps before again)
            self.strategy.allreduce_steps.at_least(max(int(s["version"]) for s in loaded))
        if address is None:   # the servers hold that checkpoint now: the next save is a base
            self._force_full = True
        return out


def same_layout(manifest: Mapping[str, Any], variables: Sequence[V.ShardedVariable],
                tables: Sequence = (), mirrored: Sequence = ()) -> bool:
    """Whether a checkpoint has these variables (shapes, dtypes, optimizers,
    shards), these ``mirrored`` ones (all-reduce mode's: one shard each,
    written whole each time) and dynamic tables (dims, dtypes, number of
    shards): a delta can follow it only then."""
    saved, saved_tables = manifest.get("variables", {}), manifest.get("tables", {})
    for m in mirrored:
        info = saved.get(m.name, {})
        if (info.get("shape"), info.get("dtype"), info.get("optimizer")) != (
                list(m.shape), m.dtype.name, m.optimizer) or \
                [(s.get("name"), s.get("offset"), s.get("rows"))
                 for s in info.get("shards", ())] != [(m.name, 0, m.shape[0] if m.shape else 0)]:
            return False
    saved = {k: v for k, v in saved.items() if k not in {m.name for m in mirrored}}
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
