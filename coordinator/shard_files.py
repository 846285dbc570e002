"""Reading one checkpoint or export file (the coordinator's restores,
Snapshot, the side evaluator: coordinator/checkpoint_files.py), and the
manifests and state files the coordinator reads and writes (``read_small``,
``write_new``: no link followed, regular files only, a new file created
exclusively): opened
without blocking and without following a link, read only if it is a
regular file of the size its manifest says and, where its manifest gives
one, of its checksum (issue 33: a FIFO in an export froze every thread of
a reader; a shard file that was a link to a file outside the export was
read; a file with one bit flipped, of the same size, was loaded and served).

Checksums (psserver.contract.checkpoint_format.CHECKSUM: CRC-32, computed
by the parameter server as it wrote the file): a manifest that says
``"checksum": "crc32"`` gives every file it lists a ``"crc32"``, and a file
whose bytes do not match is refused as damaged before anything is taken
from it. A manifest without ``"checksum"`` predates checksums (written
before them, e.g. tests/data/ckpt-808e9e1/): its files are read as they
were then, unchecked. A checksum finds damage, not an attacker who can
rewrite the manifest too.
"""
from __future__ import annotations

import errno
import os
import stat
from typing import Any

import numpy as np

from psserver.contract.checkpoint_format import CHECKSUM, crc32_of_file

_OPEN = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, or does not match the variables
    (here with its first use; coordinator.checkpoint_files is its home)."""


def load_shard(path: str, nbytes: Any = None, crc32: Any = None
               ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of one shard file, opened without blocking and
    without following a link, and read only if it is a regular file (a FIFO
    froze a reader, a link was read from outside: issue 33 items 5, 7);
    with ``nbytes`` (its manifest entry's), a file of another size is
    refused first (cut short, damaged); with ``crc32`` (its entry's), a
    file whose bytes have another CRC-32 is refused as damaged (read once
    for it, in pieces, before safetensors maps the same pages to parse it)."""
    from safetensors import SafetensorError, safe_open

    fd = _open(path)
    try:
        st = os.fstat(fd)
        if isinstance(nbytes, int) and st.st_size != nbytes:
            raise CheckpointError(f"checkpoint file {path} has {st.st_size} bytes, not the "
                                  f"{nbytes} its manifest says: it is damaged; nothing was "
                                  "restored")
        if crc32 is not None:
            check_crc32(path, fd, st.st_size, crc32)
        opened = f"/proc/self/fd/{fd}"   # the file checked, whatever its path is now
        with safe_open(opened if os.path.exists(opened) else path, framework="np") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (OSError, EOFError, ValueError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from None
    finally:
        os.close(fd)


def _open(path: str) -> int:
    """``path`` opened for reading: a regular file, not through a link."""
    try:
        fd = os.open(path, _OPEN)
    except OSError as exc:
        why = "it is a symbolic link (a checkpoint's files are its own)" \
            if exc.errno == errno.ELOOP else str(exc)
        raise CheckpointError(f"cannot read checkpoint file {path}: {why}") from None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        why = "is not a regular file (a FIFO, a device or a directory): refused, nothing was read"
    except OSError as exc:
        why = f"cannot be read: {exc}"
    os.close(fd)
    raise CheckpointError(f"checkpoint file {path} {why}")


def check_crc32(path: str, fd: int, size: int, want: Any) -> None:
    """Refuse (CheckpointError, saying the file is damaged) the open file
    ``fd`` of ``size`` bytes unless its CRC-32 is ``want``."""
    if not _is_crc32(want):
        raise CheckpointError(f"the manifest entry of checkpoint file {path} has the checksum "
                              f"{want!r}, not a CRC-32; it is damaged and nothing was restored")
    got = crc32_of_file(fd, size)
    if got != want:
        raise CheckpointError(
            f"checkpoint file {path} is damaged: its bytes have the CRC-32 {got:08x}, not the "
            f"{want:08x} its manifest says (changed on disk or in a copy since it was "
            "written); nothing was restored from it. Restore an older checkpoint "
            "(coordinator checkpoint list), or copy the file again from where it is whole")


def crc32_of_path(path: str) -> int:
    """CRC-32 of the regular file ``path`` (not through a link): what a
    manifest records for a file whose server sent no checksum (one that
    predates them). CheckpointError where it cannot be read."""
    fd = _open(path)
    try:
        return crc32_of_file(fd, os.fstat(fd).st_size)
    except (OSError, EOFError) as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from None
    finally:
        os.close(fd)


def check_checksums(path: str, manifest: dict) -> None:
    """The checksums of checkpoint ``path``'s manifest, checked (see the
    module): with ``"checksum": "crc32"`` every shard entry that names a
    file (of kind full or delta) has a ``"crc32"`` in [0, 2**32); without,
    the manifest predates checksums and an entry may lack it. A checksum of
    another kind (a newer pstrain's) or a malformed one: CheckpointError."""
    kind = manifest.get("checksum")
    if kind is not None and kind != CHECKSUM:
        raise CheckpointError(f"the manifest of {path} gives its files {kind!r} checksums, "
                              f"which this version of pstrain does not know (it knows "
                              f"{CHECKSUM!r}); upgrade pstrain to read it")
    for section in ("variables", "tables"):
        infos = manifest.get(section, {})
        for name, info in infos.items() if isinstance(infos, dict) else ():
            shards = info.get("shards") if isinstance(info, dict) else None
            for i, e in enumerate(shards if isinstance(shards, list) else ()):
                if not isinstance(e, dict) or e.get("kind", "full") == "unchanged" or \
                        (kind is None and "crc32" not in e) or _is_crc32(e.get("crc32")):
                    continue
                raise CheckpointError(
                    f"the manifest of {path} gives shard {i} of {name!r} the checksum "
                    f"{e.get('crc32')!r}, not a CRC-32 (its files all have one); it is "
                    "damaged and nothing was restored (restore an older one: coordinator "
                    "checkpoint list)")


def _is_crc32(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32


#: The largest manifest or state file read (a manifest lists every shard of
#: every variable and table: 64 MiB is millions of entries).
MAX_SMALL_FILE = 64 << 20


def read_small(path: str, limit: int = MAX_SMALL_FILE) -> bytes:
    """The bytes of a manifest or state file: opened without blocking and
    without following a link, a regular file of at most ``limit`` bytes
    (OSError otherwise, saying which), as load_shard opens a shard file."""
    fd = os.open(path, _OPEN)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{path} has {st.st_size} bytes, more than the "
                                       f"{limit} a manifest or state file may have")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def write_new(path: str, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` (created exclusively, 0644, no
    link followed: a name planted there beforehand, a symbolic link to a file
    elsewhere included, is an OSError, never written through), fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
