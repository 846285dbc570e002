"""Where a parameter server writes checkpoint files, and how: a save's
directory is opened once, each part of it below the ``--checkpoint-dir`` it
lies in opened without following a symbolic link, and every file is
written relative to that open directory. A part swapped for a link after
the check (issue 33 item 4: a save wrote ``outside/~table~race.safetensors``)
then changes nothing: the files land in the directory that was checked, or
the save is refused. psserver.core.saving (variables) and table_store
(table shards) write through here. Free of grpc and protobuf.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import sys

import numpy as np

from psserver.contract.checkpoint_format import crc32_of_file, crc32_of_parts
from psserver.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)

#: Testing switch: a parameter server with this set dies in the middle of a
#: save (after writing a temporary file, before renaming it); set to
#: "delta", only in the middle of writing a delta.
FAULT_CRASH_IN_SAVE_ENV = "PSTRAIN_FAULT_CRASH_IN_SAVE"

_DIR = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class SaveDir:
    """A save's directory, open (``fd``) for the length of a ``with`` block;
    ``path``: its resolved path, for messages."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    def __enter__(self) -> "SaveDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_save_dir(directory: str, real: str, root: str | None) -> SaveDir:
    """``real`` (``directory`` resolved) opened: from ``root`` (a
    --checkpoint-dir, resolved; None: anywhere) down, no part of it a
    symbolic link. InvalidArgument where it does not exist, PermissionDenied
    where a part of it is a link or not a directory now (it changed since it
    was resolved)."""
    parts = [] if root is None or real == root else os.path.relpath(real, root).split(os.sep)
    fd = -1
    try:
        fd = os.open(real if root is None else root, _DIR | (_NOFOLLOW if root else 0))
        for part in parts:
            inner = os.open(part, _DIR | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        if isinstance(exc, FileNotFoundError):
            raise InvalidArgument(f"checkpoint directory {directory!r} does not exist on this "
                                  "parameter server (it must see the same filesystem)") from None
        raise _refused(directory, exc) from None
    return SaveDir(real, fd)


def _refused(directory: str, exc: OSError) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return PermissionDenied(
            f"checkpoint directory {directory!r} changed while it was opened: a part of it is "
            "now a symbolic link or not a directory; nothing was written. Save into a "
            "directory no one else changes")
    return _write_error(directory, exc)


def write_tensors(target: SaveDir, file: str, tensors: dict, meta: dict,
                  delta: bool = False) -> tuple[int, int]:
    """Write a safetensors file atomically into ``target``: under a
    temporary name in a directory of its own made for this call (a random
    name, created exclusively, 0700: two saves of one shard never share it,
    and nothing planted at a name known in advance is written through),
    fsync, chmod 0644 (a coordinator of another user reads it), rename into
    ``target``, fsync it; all relative to the open directory. Returns (its
    bytes, its CRC-32: psserver.contract.checkpoint_format.CHECKSUM, from
    what was written: _crc32_written). ``delta``: the file is a delta
    (FAULT_CRASH_IN_SAVE_ENV=delta).
    A failure to write (disk full, permissions, the directory gone) raises
    a PSError saying so: ResourceExhausted, PermissionDenied or
    FailedPrecondition; nothing is left under the file's name."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    dfd, path = target.fd, os.path.join(target.path, file)
    try:
        private = _private_dir(dfd)
        pfd = os.open(private, _DIR | _NOFOLLOW, dir_fd=dfd)
        try:
            # The private directory by its descriptor (no path is resolved again).
            where = f"/proc/self/fd/{pfd}"
            tmp = os.path.join(where if os.path.isdir(where)
                               else os.path.join(target.path, private), file)
            arrays = {k: _little(np.ascontiguousarray(v) if np.ndim(v) else np.asarray(v))
                      for k, v in tensors.items()}   # (0-d stays)
            save_file(arrays, tmp, metadata=meta)
            fault = os.environ.get(FAULT_CRASH_IN_SAVE_ENV)
            if fault and (delta or fault != "delta"):   # fault injection for tests
                os._exit(3)
            fd = os.open(file, os.O_RDONLY | _NOFOLLOW, dir_fd=pfd)
            try:
                size = os.fstat(fd).st_size
                crc = _crc32_written(fd, size, arrays)
                os.fsync(fd)    # on disk before it gets its final name
                os.fchmod(fd, 0o644)
            finally:
                os.close(fd)
            os.replace(file, file, src_dir_fd=pfd, dst_dir_fd=dfd)
        finally:
            try:
                os.unlink(file, dir_fd=pfd)   # (a write that failed half-way)
            except OSError:
                pass
            os.close(pfd)
            try:
                os.rmdir(private, dir_fd=dfd)
            except OSError:
                pass
        os.fsync(dfd)    # and the name on disk
        return size, crc
    except (OSError, EOFError, SafetensorError) as exc:
        raise _write_error(path, exc) from None


_LITTLE = sys.byteorder == "little"


def _little(a: np.ndarray) -> np.ndarray:
    """``a`` with little-endian bytes (as safetensors writes them; a copy
    only where they are not)."""
    return a if a.dtype.byteorder in "|<" or (a.dtype.byteorder == "=" and _LITTLE) \
        else a.astype(a.dtype.newbyteorder("<"))


def _crc32_written(fd: int, size: int, arrays: dict) -> int:
    """CRC-32 of the safetensors file of ``size`` bytes just written to
    ``fd`` from ``arrays``: its header read back (8 bytes and its JSON), then
    each array's bytes from memory, in the order of the file's offsets, so
    the data are not read again. A file laid out otherwise (safetensors
    padding between tensors, or writing them otherwise) is read whole instead."""
    try:
        head = os.pread(fd, 8, 0)
        n = int.from_bytes(head, "little")
        if len(head) != 8 or not 0 < n <= size - 8:
            raise ValueError("no header")
        header = os.pread(fd, n, 8)
        spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k)
                       for k, e in json.loads(header).items() if k != "__metadata__")
        at = 0
        for start, end, k in spans:
            if len(header) != n or start != at or end - start != arrays[k].nbytes:
                raise ValueError("not laid out as written")
            at = end
        if 8 + n + at != size or len(spans) != len(arrays):
            raise ValueError("not laid out as written")
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return crc32_of_file(fd, size)
    return crc32_of_parts([head, header] + [arrays[k] for _, _, k in spans])


def _private_dir(dfd: int) -> str:
    for _ in range(100):
        name = f".saving-{secrets.token_hex(8)}"
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
            return name
        except FileExistsError:
            continue
    raise FileExistsError("no free temporary directory name")


def _write_error(path: str, exc: Exception) -> Exception:
    """The PSError a failed write of checkpoint file ``path`` raises."""
    text = f"cannot write checkpoint file {path} ({exc}); nothing was saved there"
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{text}: free space on that filesystem, or save elsewhere")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"{text}: the parameter server's user must be able to write "
                                "there")
    return FailedPrecondition(f"{text}: check that the directory exists, is a directory "
                              "the parameter server can write, and holds no directory of "
                              "that name")
