"""A parameter server's checkpoint files: each variable's value, slots and
idempotency keys in a safetensors file, written under a directory the
operator allowed (``psserver --checkpoint-dir``) and nowhere else.
``SaveMethods`` is a mixin of psserver.store.VariableStore (it uses the
store's _get, _lock, _vars and checkpoint_dirs). Free of grpc and protobuf.
"""
from __future__ import annotations

import json
import os
import urllib.parse
from typing import Sequence

import numpy as np

from psserver.contract import InvalidArgument, PermissionDenied


#: Testing switch: a parameter server with this set dies in the middle of a
#: save (after writing a temporary file, before renaming it).
FAULT_CRASH_IN_SAVE_ENV = "PSTRAIN_FAULT_CRASH_IN_SAVE"

def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SaveMethods:
    """Checkpoint files of the store's variables (see the module)."""

    def save(self, directory: str, names: Sequence[str] = ()) -> list[tuple[str, str, int, int]]:
        """Write variables to directory, one safetensors file each.

        Each file holds "value" and "slot/<name>" tensors and, in its
        metadata, the variable's name, version and optimizer. It is written
        under a temporary name and renamed, so a file that exists is whole.
        Each variable is copied under its lock first (a consistent snapshot of
        that variable; variables are taken one after another). Returns
        (name, file, version, bytes) per variable.
        """
        from safetensors.numpy import save_file

        directory = self._confined(directory)
        if not os.path.isdir(directory):
            raise InvalidArgument(f"checkpoint directory {directory!r} does not exist on this "
                                  "parameter server (it must see the same filesystem)")
        with self._lock:
            chosen = [self._get(n) for n in names] if names else list(self._vars.values())
        out = []
        for var in chosen:
            with var.lock:
                tensors = {"value": var.value.copy(),
                           **{f"slot/{k}": v.copy() for k, v in var.slots.items()},
                           "applied_ids": np.fromiter(var.applied, np.uint64, len(var.applied))}
                meta = {"name": var.name, "version": str(var.version),
                        "optimizer": var.optimizer.name,
                        "optimizer_params": json.dumps(var.optimizer.config()),
                        "allow_nonfinite": json.dumps(var.allow_nonfinite)}
                version = var.version
            file = urllib.parse.quote(var.name, safe="") + ".safetensors"
            path = os.path.join(directory, file)
            tmp = f"{path}.tmp{os.getpid()}"
            save_file(tensors, tmp, metadata=meta)
            if os.environ.get(FAULT_CRASH_IN_SAVE_ENV):   # fault injection for tests
                os._exit(3)
            _fsync_file(tmp)    # on disk before it gets its final name
            os.chmod(tmp, 0o644)   # safetensors writes 0600: let a coordinator of another user read it
            os.replace(tmp, path)
            out.append((var.name, file, version, os.path.getsize(path)))
        return out

    def _confined(self, directory: str) -> str:
        """``directory`` resolved (symbolic links, ``..``), if it lies in a
        checkpoint directory this server was given. Raises PermissionDenied."""
        if not isinstance(directory, str) or not directory or "\0" in directory:
            raise InvalidArgument("give the checkpoint directory as a path")
        real = os.path.realpath(directory)
        if self.checkpoint_dirs is None:
            return real
        if not self.checkpoint_dirs:
            raise PermissionDenied(
                "this parameter server writes no checkpoint files: it was started without "
                "--checkpoint-dir; start it with --checkpoint-dir DIR (a directory the "
                "coordinator's CheckpointManager writes under, on the same filesystem)")
        if not any(real == d or real.startswith(d.rstrip(os.sep) + os.sep)
                   for d in self.checkpoint_dirs):
            raise PermissionDenied(
                f"{directory!r} is outside this parameter server's checkpoint directories "
                f"({', '.join(self.checkpoint_dirs)}); nothing was written. Save under one of "
                "them, or start the server with --checkpoint-dir covering it")
        return real
