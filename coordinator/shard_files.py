"""Reading one checkpoint or export file (the coordinator's restores,
Snapshot, the side evaluator: coordinator/checkpoint_files.py): opened
without blocking and without following a link, read only if it is a
regular file of the size its manifest says (issue 33: a FIFO in an export
froze every thread of a reader; a shard file that was a link to a file
outside the export was read)."""
from __future__ import annotations

import errno
import os
import stat
from typing import Any

import numpy as np


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, or does not match the variables
    (here with its first use; coordinator.checkpoint_files is its home)."""


def load_shard(path: str, nbytes: Any = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of one shard file, opened without blocking and
    without following a link, and read only if it is a regular file (a FIFO
    froze a reader, a link was read from outside: issue 33 items 5, 7);
    with ``nbytes`` (its manifest entry's), a file of another size is
    refused first (cut short, damaged)."""
    from safetensors import SafetensorError, safe_open

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        why = "it is a symbolic link (a checkpoint's files are its own)" \
            if exc.errno == errno.ELOOP else str(exc)
        raise CheckpointError(f"cannot read checkpoint file {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"checkpoint file {path} is not a regular file (a FIFO, a "
                                  "device or a directory): refused, nothing was read")
        if isinstance(nbytes, int) and st.st_size != nbytes:
            raise CheckpointError(f"checkpoint file {path} has {st.st_size} bytes, not the "
                                  f"{nbytes} its manifest says: it is damaged; nothing was "
                                  "restored")
        opened = f"/proc/self/fd/{fd}"   # the file checked, whatever its path is now
        with safe_open(opened if os.path.exists(opened) else path, framework="np") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (OSError, ValueError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from None
    finally:
        os.close(fd)
