"""Freed memory given back to the system. Tasks run with a high glibc trim
threshold (psserver.process.MALLOC_ENV: freed message buffers are kept, no
page faults to take them again), so large freed blocks stay resident until
``give_back_memory`` trims the heap: after a large frame (the data port's
reader, psserver/serve/ipc_server.py) and after a dynamic table's arrays
grew (the old arrays, psserver/core/dynamic_table.py), so that a server's
resident memory follows what it holds (``--max-memory-bytes``). Free of
grpc and protobuf.

Arrays that grow (a dynamic table's rows, slots and bookkeeping) live in
mappings of their own (``mapped``): ``grow_rows`` enlarges one in place
(Linux's mremap moves the page tables, not the data), so while a table grows
its old rows are never resident twice; where that cannot be done (another
view of the array is alive, or no mremap) the rows are copied, as before.
"""
from __future__ import annotations

import math
import mmap
from typing import MutableMapping

import numpy as np

#: Arrays smaller than this are ordinary heap arrays (a mapping costs a page
#: and a kernel map entry at least).
MAPPED_BYTES = 1 << 20
#: bound_heap's largest trim threshold (mallopt takes a C int).
MAX_TRIM_THRESHOLD = 256 << 20
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_remaps: bool | None = None   # whether this system can enlarge a mapping (mremap)


def _can_remap() -> bool:
    global _remaps
    if _remaps is None:
        try:
            probe = mmap.mmap(-1, mmap.PAGESIZE, flags=_FLAGS)
            probe.resize(2 * mmap.PAGESIZE)
            probe.close()
            _remaps = True
        except (AttributeError, OSError, SystemError, ValueError, TypeError):
            _remaps = False
    return _remaps


def mapped(shape: tuple, dtype) -> np.ndarray:
    """A new zeroed array, in a private anonymous mapping of its own when it
    is large and the system can enlarge mappings (pages not resident until
    written), else on the heap."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    if count * dtype.itemsize < MAPPED_BYTES or not _FLAGS or not _can_remap():
        return np.zeros(shape, dtype)
    mm = mmap.mmap(-1, count * dtype.itemsize, flags=_FLAGS)
    return np.frombuffer(mm, dtype, count=count).reshape(shape)


def owner(a):
    """What finally holds an array's memory: its base's base..., through
    memoryviews to what they view (an mmap, a bytes, a bytearray), or the
    array itself when it owns its data."""
    root = a
    while True:
        if isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        elif isinstance(root, memoryview) and root.obj is not None:
            root = root.obj
        else:
            return root


def owner_bytes(a) -> tuple[int, int]:
    """(id, bytes) of the buffer an array keeps alive (``owner``): its whole
    size, however little of it the array views; an owner that is no buffer
    counts as the array's own bytes."""
    root = owner(a)
    if isinstance(root, np.ndarray):
        return id(root), root.nbytes
    try:
        return id(root), memoryview(root).nbytes
    except TypeError:
        return id(root), np.asarray(a).nbytes


def grow_rows(holder: MutableMapping, name: str, rows: int, keep: int) -> None:
    """``holder[name]`` made ``rows`` rows long, its first ``keep`` rows
    kept (the rest zeros): remapped in place when it is a mapping's only
    array (no copy: its rows are never resident twice), else copied into a
    new array (``mapped``). The caller holds no other reference to it.
    ``holder[name]`` is never missing: a 0-row stand-in while it is
    remapped, and the array as it was if growing fails (MemoryError)."""
    a = holder[name]
    dtype, tail = a.dtype, a.shape[1:]
    width, old = math.prod(tail), a.shape[0]
    mm = owner(a)
    if isinstance(mm, mmap.mmap) and a.size == len(mm) // dtype.itemsize:
        holder[name] = np.zeros((0,) + tail, dtype)   # the mapping's only export goes
        del a
        try:
            mm.resize(rows * width * dtype.itemsize)
        except BaseException as exc:   # as it was; then copied, or the error raised
            holder[name] = a = np.frombuffer(mm, dtype, count=old * width).reshape(
                (old,) + tail)
            if not isinstance(exc, (BufferError, OSError, SystemError, ValueError)):
                raise
        else:
            holder[name] = np.frombuffer(mm, dtype, count=rows * width).reshape((rows,) + tail)
            return
    grown = mapped((rows,) + tail, dtype)   # (a MemoryError here leaves the array as it was)
    grown[:keep] = a[:keep]
    holder[name] = grown


def bound_heap(limit: int) -> bool:
    """A server with a memory limit: allocations of 1 MiB and more from
    mappings of their own (given back whole when freed), and freed heap
    above ``limit // 8`` trimmed (glibc's mallopt; the tasks' defaults,
    psserver.process.MALLOC_ENV, keep freed message buffers for speed,
    which a bounded server cannot afford: freed reply buffers stayed
    resident after large reads at once), at most MAX_TRIM_THRESHOLD.
    Whether it was applied."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # (a C int: a limit of 32 GiB and more trims at 256 MiB, not at a wrapped value)
    trim = min(max(MAPPED_BYTES, int(limit) // 8), MAX_TRIM_THRESHOLD)
    return bool(mallopt(m_mmap_threshold, MAPPED_BYTES)) and \
        bool(mallopt(m_trim_threshold, trim))


def give_back_memory() -> None:
    """Return freed heap memory to the system (glibc's malloc_trim; a no-op
    where there is none)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
