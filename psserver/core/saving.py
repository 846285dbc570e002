"""A parameter server's checkpoint files: each variable's value, slots and
idempotency keys in a safetensors file, written under a directory the
operator allowed (``psserver --checkpoint-dir``) and nowhere else.
``Saver`` writes the variables of a psserver.core.shards.ShardRegistry, keeps the
save points this server took, and commits them on every shard copy (table
shards too: psserver/core/table_store.py writes their files with the same
checks), through psserver/core/save_files.py (the directory opened once,
no symbolic link followed below the --checkpoint-dir). Free of grpc and
protobuf.

Incremental saves (coordinator/checkpoint.py, psserver/core/tracking.py): a save
with a ``save_id`` is a save point of every shard it writes; with ``since``
(a point taken on this server, ``incarnation`` naming this server process)
each shard is written as a *delta* holding only the rows changed since that
point (or ``UNCHANGED``: no file), or whole where the server cannot prove
what changed (``FULL``). ``commit_save`` tells the server that a save is on
disk for good; only then are the changes it took forgotten.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
import urllib.parse
import uuid
from typing import Sequence

import numpy as np

from psserver.core.save_files import SaveDir, open_save_dir, write_tensors
from psserver.core.tracking import VariableTracker
from psserver.errors import FailedPrecondition, InvalidArgument, PermissionDenied

#: How a shard was written (ps.proto SaveKind).
FULL, DELTA, UNCHANGED = 0, 1, 2
KIND_NAMES = {FULL: "full", DELTA: "delta", UNCHANGED: "unchanged"}
#: Save ids a server remembers having taken (to tell a forgotten one from a
#: wrong one), per stream (one stream's saves never push out another's), of
#: at most this many streams (the least recently saved forgotten first),
#: and the longest stream name.
SAVES_KEPT = 1024
STREAMS_KEPT = 64
MAX_STREAM = 128


@dataclasses.dataclass(frozen=True)
class SavedShard:
    """One variable shard a save wrote: ``file`` ("" when UNCHANGED), the
    version it holds, its bytes, ``kind``, for a delta its rows, and the
    file's CRC-32 (None: no file; psserver/core/save_files.py)."""
    name: str
    file: str
    version: int
    bytes: int
    kind: int = FULL
    rows: int = 0
    crc32: int | None = None


@dataclasses.dataclass(frozen=True)
class SaveSpec:
    """An incremental save's parameters, checked (``Saver.begin_save``):
    ``since`` is 0 where the base is not this server's (write whole)."""
    save_id: int = 0
    since: int = 0
    stream: str = ""
    weights_only: bool = False


class Saver:
    """Checkpoint files of ``registry``'s variables, and the save points this
    server took (see the module). ``checkpoint_dirs``: where saves may write,
    inside one of these (None: anywhere, for in-process use; a psserver task
    sets what --checkpoint-dir says). Each variable is copied under its own
    lock; the save points have a lock of their own."""

    def __init__(self, registry, checkpoint_dirs: Sequence[str] | None = None):
        self._registry = registry
        self.checkpoint_dirs = None if checkpoint_dirs is None else tuple(
            os.path.realpath(d) for d in checkpoint_dirs)
        #: This server process; a save point is known only to the incarnation
        #: that took it (a restarted server writes its next save whole).
        self.incarnation = uuid.uuid4().hex
        self._saves: dict[int, str] = {}   # save id -> its stream
        self._streams: collections.OrderedDict[str, collections.OrderedDict] = \
            collections.OrderedDict()      # stream -> its save ids, oldest first
        self._saves_lock = threading.Lock()

    def begin_save(self, save_id: int = 0, since: int = 0, incarnation: str = "",
                   stream: str = "", weights_only: bool = False) -> SaveSpec:
        """Check an incremental save's fields (check_save) and note
        ``save_id`` as taken here (note_save)."""
        return self.note_save(self.check_save(save_id, since, incarnation, stream, weights_only))

    def check_save(self, save_id: int = 0, since: int = 0, incarnation: str = "",
                   stream: str = "", weights_only: bool = False) -> SaveSpec:
        """An incremental save's fields, checked; nothing changes. ``since``
        from another incarnation (or none named) is unknown: every shard is
        written whole. Raises InvalidArgument, and FailedPrecondition when
        ``since`` names no save this incarnation took (nothing is written)."""
        for what, v in (("save_id", save_id), ("since", since)):
            if not isinstance(v, int) or not 0 <= v < 1 << 64:
                raise InvalidArgument(f"{what} must be an integer in [0, 2**64), got {v!r}")
        if not isinstance(stream, str) or len(stream) > MAX_STREAM or \
                not (stream.isascii() and stream.isprintable()):
            raise InvalidArgument(f"a save's stream must be printable ASCII of at most "
                                  f"{MAX_STREAM} characters, got {stream!r}")
        if not isinstance(incarnation, str) or len(incarnation) > 64:
            raise InvalidArgument("incarnation must be a server's incarnation (<= 64 characters)")
        if since and not save_id:
            raise InvalidArgument("a save since a save point needs a save_id of its own "
                                  "(the point it makes); nothing was written")
        if since and since == save_id:
            raise InvalidArgument(f"save {save_id} cannot be its own base")
        known = bool(since) and incarnation == self.incarnation
        with self._saves_lock:
            if known and since not in self._saves:
                raise FailedPrecondition(
                    f"save id {since} is unknown to this parameter server (incarnation "
                    f"{self.incarnation}): it took no such save, so it cannot tell what "
                    "changed since; nothing was written. Save a full checkpoint (since=0)")
            if known and self._saves[since] != stream:
                raise InvalidArgument(f"save {since} belongs to stream "
                                      f"{self._saves[since]!r}, not {stream!r}")
        return SaveSpec(save_id, since if known else 0, stream, bool(weights_only))

    def note_save(self, spec: SaveSpec) -> SaveSpec:
        """Note ``spec.save_id`` (if any) as taken here, once everything about
        the save was checked (a refused save notes nothing)."""
        if spec.save_id:
            with self._saves_lock:
                self._note_save(spec.save_id, spec.stream)
        return spec

    def _note_save(self, save_id: int, stream: str) -> None:
        """Remember save_id as one of ``stream``'s (saves lock held)."""
        if self._saves.get(save_id, stream) != stream:   # (an id reused by another stream)
            self._streams[self._saves[save_id]].pop(save_id, None)
        self._saves[save_id] = stream
        ids = self._streams.setdefault(stream, collections.OrderedDict())
        ids[save_id] = None
        ids.move_to_end(save_id)
        self._streams.move_to_end(stream)
        while len(ids) > SAVES_KEPT:
            self._saves.pop(ids.popitem(last=False)[0], None)
        while len(self._streams) > STREAMS_KEPT:
            for old in self._streams.popitem(last=False)[1]:
                self._saves.pop(old, None)

    def commit_save(self, save_id: int, stream: str = "", incarnation: str = "") -> tuple[int, int]:
        """Save ``save_id`` of ``stream`` is on disk for good (its manifest
        renamed into place): every shard forgets the changes that save and
        the earlier ones of its stream took. Returns (variables, table
        shards) that had the point. Raises FailedPrecondition (nothing
        changed) when this incarnation took no such save."""
        if not isinstance(save_id, int) or not 0 < save_id < 1 << 64:
            raise InvalidArgument(f"commit needs a save id in [1, 2**64), got {save_id!r}")
        if incarnation != self.incarnation:
            raise FailedPrecondition(
                f"save {save_id} was taken on parameter server incarnation {incarnation!r}, "
                f"but this is {self.incarnation!r} (the server restarted since): nothing to "
                "commit; its next incremental save is written whole")
        with self._saves_lock:
            if save_id not in self._saves:
                raise FailedPrecondition(f"save id {save_id} is unknown to this parameter "
                                         "server; nothing was committed")
            if self._saves[save_id] != stream:
                raise InvalidArgument(f"save {save_id} belongs to stream "
                                      f"{self._saves[save_id]!r}, not {stream!r}")
        counts = {False: 0, True: 0}   # is_table -> shards that had the point
        for copy in self._registry.copies():
            with copy.lock:
                tracker = copy.tracker
                if tracker is not None and tracker.log.commit(save_id, stream):
                    counts[copy.is_table] += 1
        return counts[False], counts[True]

    def save(self, directory: str, names: Sequence[str] = (),
             spec: SaveSpec = SaveSpec()) -> list[SavedShard]:
        """Write variables to directory, one safetensors file each.

        Each file holds "value" and "slot/<name>" tensors and, in its
        metadata, the variable's name, version and optimizer. It is written
        under a temporary name and renamed, so a file that exists is whole.
        Each variable is copied under its lock first (a consistent snapshot of
        that variable; variables are taken one after another).

        ``spec`` (begin_save's): with a save id the copy is that save point
        of the variable; a delta holds "rows" (int64) and only those rows of
        the value and of each per-row slot (scalar slots and update keys
        whole); with ``weights_only`` only the value (or its rows).
        """
        with self.save_directory(directory) as target:
            return self._write_shards(target, self._chosen(names), spec)

    def save_point(self, directory: str, names: Sequence[str] = (), **fields) -> list[SavedShard]:
        """A Save call: its incremental fields (check_save's), the directory
        and the names checked, then the save id noted, then save(). A refused
        call (InvalidArgument, FailedPrecondition, PermissionDenied,
        NotFound) notes nothing and writes nothing."""
        spec = self.check_save(**fields)
        with self.save_directory(directory) as target:
            chosen = self._chosen(names)
            return self._write_shards(target, chosen, self.note_save(spec))

    def save_directory(self, directory: str) -> SaveDir:
        """``directory``, opened (psserver/core/save_files.py), if this server
        may write there and it exists (PermissionDenied, InvalidArgument);
        close it after (``with``)."""
        real, root = self._confined(directory)
        return open_save_dir(directory, real, root)

    def _chosen(self, names: Sequence[str]) -> list:
        return [self._registry.variable(n) for n in names] if names \
            else self._registry.variables()

    def _write_shards(self, target: SaveDir, chosen: list, spec: SaveSpec) -> list[SavedShard]:
        out = []
        for var in chosen:
            with var.lock:
                kind, rows = FULL, None
                if spec.save_id:
                    if var.tracker is None:
                        var.tracker = VariableTracker(var.value.shape)
                    changes = var.tracker.take(spec.save_id, spec.stream, spec.since)
                    if changes is not None and not changes.whole:
                        kind = DELTA if changes.touched else UNCHANGED
                        rows = np.flatnonzero(changes.rows)
                tensors = {} if kind == UNCHANGED else self._copy_out(var, rows, spec.weights_only)
                meta = {"name": var.name, "version": str(var.version),
                        "optimizer": var.optimizer.name,
                        "optimizer_params": json.dumps(var.optimizer.config()),
                        "allow_nonfinite": json.dumps(var.allow_nonfinite),
                        "kind": KIND_NAMES[kind]}
                version = var.version
            if kind == UNCHANGED:
                out.append(SavedShard(var.name, "", version, 0, kind))
                continue
            file = urllib.parse.quote(var.name, safe="") + ".safetensors"
            nbytes, crc = write_tensors(target, file, tensors, meta, delta=kind == DELTA)
            out.append(SavedShard(var.name, file, version, nbytes, kind,
                                  0 if rows is None else int(rows.size), crc))
        return out

    @staticmethod
    def _copy_out(var, rows: np.ndarray | None, weights_only: bool) -> dict[str, np.ndarray]:
        """The arrays a file holds (lock held): all, or only ``rows`` of the
        value and of the per-row slots."""
        pick = (lambda a: a.copy()) if rows is None else (lambda a: a[rows])
        out = {"value": pick(var.value)}
        if rows is not None:
            out["rows"] = rows.astype(np.int64)
        if weights_only:
            return out
        for k, a in var.slots.items():
            out[f"slot/{k}"] = pick(a) if a.shape == var.value.shape else a.copy()
        out["applied_ids"] = np.fromiter(var.applied, np.uint64, len(var.applied))
        return out

    def _confined(self, directory: str) -> tuple[str, str | None]:
        """(``directory`` resolved (symbolic links, ``..``), the checkpoint
        directory this server was given that it lies in (None: any)). Raises
        PermissionDenied."""
        if not isinstance(directory, str) or not directory or "\0" in directory:
            raise InvalidArgument("give the checkpoint directory as a path")
        try:
            real = os.path.realpath(directory)
        except OSError as exc:   # (a part changed while it was resolved)
            raise PermissionDenied(f"checkpoint directory {directory!r} changed while it was "
                                   f"resolved ({exc.strerror}); nothing was written. Save into "
                                   "a directory no one else changes") from None
        if self.checkpoint_dirs is None:
            return real, None
        if not self.checkpoint_dirs:
            raise PermissionDenied(
                "this parameter server writes no checkpoint files: it was started without "
                "--checkpoint-dir; start it with --checkpoint-dir DIR (a directory the "
                "coordinator's CheckpointManager writes under, on the same filesystem)")
        roots = [d for d in self.checkpoint_dirs
                 if real == d or real.startswith(d.rstrip(os.sep) + os.sep)]
        if not roots:
            raise PermissionDenied(
                f"{directory!r} is outside this parameter server's checkpoint directories "
                f"({', '.join(self.checkpoint_dirs)}); nothing was written. Save under one of "
                "them, or start the server with --checkpoint-dir covering it")
        return real, max(roots, key=len)
