"""What PSClient's parts share (psserver/client.py, channel.py, client_shm.py):
the results of calls (``Snapshot``, ``Handle``) and request helpers.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from protos.pstrain.v1 import ps_pb2
from psserver import replication as R
from psserver import tensor as T
from psserver.contract import InvalidArgument, PSError, SyncSpec, VariableMeta


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A variable's value as read, with the version it belongs to."""
    name: str
    version: int
    value: np.ndarray


def _meta_from_proto(m: ps_pb2.VariableMeta) -> VariableMeta:
    backup = R.Peer(m.backup.address, m.backup.name) if m.HasField("backup") else None
    return VariableMeta(m.name, m.dtype, tuple(m.shape), m.version, m.optimizer.name,
                        dict(m.optimizer.params), m.nbytes, m.slot_nbytes, m.allow_nonfinite,
                        m.sync_steps, m.dropped_gradients, int(m.role), m.epoch, backup)


def _set_sync_read(req, sync_step: int | None) -> None:
    if sync_step is not None:
        req.sync.step = sync_step


def _sync_info(sync: SyncSpec):
    """The SyncInfo message of a SyncSpec."""
    return ps_pb2.SyncInfo(**dataclasses.asdict(sync))


def _set_sync(req, sync: SyncSpec | None) -> None:
    if sync is not None:
        req.sync.CopyFrom(_sync_info(sync))


class Handle:
    """The pending result of a non-blocking call."""

    def __init__(self, fut, post: Callable = lambda r: r, target: str = "",
                 recover: Callable[[PSError], object] | None = None):
        self._fut, self._post, self._target = fut, post, target
        self._recover = recover   # may turn an error into a result, or re-raise

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None):
        """Block until the call finishes; return its value or raise its PSError."""
        try:
            return self._post(self._fut.result(timeout))
        except PSError as exc:
            if self._recover is None:
                raise
            return self._recover(exc)

    wait = result


def _dest(out: Sequence[np.ndarray | None] | None, i: int, like,
          widen: bool = False) -> np.ndarray | None:
    """out[i] when the caller gave it with ``like``'s shape and dtype (with
    ``widen``, also a float dtype when ``like`` is float16: a value read as
    float16), else None (the value goes into a new array)."""
    dest = out[i] if out is not None and i < len(out) else None
    if dest is None or dest.shape != like.shape:
        return None
    if dest.dtype == like.dtype or (widen and like.dtype == np.float16
                                    and dest.dtype.kind == "f"):
        return dest
    return None


def _halved(snaps: list[Snapshot]) -> list[Snapshot]:
    """Snapshots with float values rounded to float16 (as a read with
    value_dtype "float16" sends them): in place where the value is the
    caller's array, else as a new float16 array."""
    done = []
    for s in snaps:
        v = s.value
        if v.dtype.kind == "f" and v.dtype.itemsize > 2:
            if v.flags.writeable:
                np.copyto(v, T.as_float16(v))
            else:
                s = Snapshot(s.name, s.version, T.as_float16(v))
        done.append(s)
    return done


def _fill(snaps: list[Snapshot], out: Sequence[np.ndarray | None]) -> list[Snapshot]:
    """Snapshots with their values copied into out's arrays (where given and
    fitting; a float16 value into a wider float array)."""
    filled = []
    for i, s in enumerate(snaps):
        dest = _dest(out, i, s.value, widen=True)
        if dest is not None and dest is not s.value:   # (received into it already: as is)
            if s.value.dtype == np.float16 and dest.dtype != np.float16:
                T.widen_float16(s.value, dest.dtype, out=dest)
            else:
                np.copyto(dest, s.value)
            s = Snapshot(s.name, s.version, dest)
        filled.append(s)
    return filled


def _as_ids(ids, what: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} ids must be integers, got {ids.dtype.name}")
    if ids.dtype.kind == "u" or ids.dtype.itemsize not in (4, 8):
        ids = ids.astype(np.int64)
    return ids
