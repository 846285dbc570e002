"""Large buffers used again instead of made anew: ``take(n)``.

A 64 MiB frame received or encoded into fresh memory costs more in page
faults than its copy: glibc serves allocations of 64 MiB and more made on
any thread but the main one from mmap (a thread's arena cannot hold them),
whatever MALLOC_MMAP_THRESHOLD_ says, so every such frame touched fresh pages
(measured on a data-port read of 64 MiB: 70% of the server's time in the
reply's allocation). ``take(n)`` hands out a view of a kept buffer; the
buffer goes back to the pool when the last view of it (and every array made
from one) is gone, so a result that a caller keeps is never overwritten.
Buffers below ``MIN_BYTES`` are not pooled (malloc reuses those well).
"""
from __future__ import annotations

import collections
import threading
import weakref

import numpy as np

#: Sizes below this come from np.empty each time.
MIN_BYTES = 4 << 20
#: The most bytes of free buffers the pool keeps (per process; a
#: psserver with --max-memory-bytes keeps at most an eighth of its limit:
#: ``keep_at_most``).
MAX_FREE_BYTES = 512 << 20
_max_free: int | None = None   # keep_at_most's bound

_lock = threading.Lock()
_free: list[np.ndarray] = []   # whole buffers nobody uses, smallest first
# Buffers given back and not yet in _free: a finalizer puts them here and
# takes the lock only if it is free (it runs wherever a collection runs, maybe
# inside the lock on this very thread, which would then wait for itself);
# else the holder of the lock moves them over when it lets go (_settle_soon).
_returned: collections.deque = collections.deque()


def _size_class(n: int) -> int:
    """n rounded up to a multiple of a quarter of its power of two (at most
    25% unused), so buffers fit several nearby sizes."""
    step = max(MIN_BYTES, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


def take(n: int) -> np.ndarray:
    """A uint8 array of n bytes (contents undefined), from the pool when one
    fits; back in the pool once it and everything made from it are gone."""
    if n < MIN_BYTES:
        return np.empty(n, np.uint8)
    want = _size_class(n)
    with _lock:
        _settle()
        for i, buf in enumerate(_free):
            if want <= buf.size <= 2 * want:
                del _free[i]
                break
        else:
            buf = None
    _settle_soon()
    if buf is None:
        buf = np.empty(want, np.uint8)
    view = buf[:n]
    weakref.finalize(view, _give, buf)
    # Handed out through a memoryview of ``view``: numpy collapses a view of a
    # view onto the array that owns the memory (``buf``), so an array made
    # by slicing, .view() or .reshape() of ``view`` itself would not keep it
    # alive; one made from the memoryview (not an array) keeps it, and so
    # does every array made from that.
    return np.frombuffer(memoryview(view), np.uint8)


def keep_at_most(n: int) -> None:
    """Keep at most ``n`` bytes of free buffers from now on (a server's
    memory limit bounds its resident memory: free buffers count nowhere
    else). Buffers over it are let go now."""
    global _max_free
    with _lock:
        _max_free = max(0, int(n))
        _settle()
        _trim()
    _settle_soon()


def _trim() -> None:
    """Drop the largest free buffers until the rest fit (lock held). (A
    bounded server takes such buffers from mappings of their own,
    psserver.contract.memory.bound_heap: dropped, their pages go back.)"""
    most = MAX_FREE_BYTES if _max_free is None else min(_max_free, MAX_FREE_BYTES)
    while _free and sum(b.size for b in _free) > most:
        _free.pop()   # the largest goes


def _give(buf: np.ndarray) -> None:
    _returned.append(buf)   # (see _returned)
    _settle_soon()


def _settle_soon() -> None:
    """Settle what was given back if the lock is free; a holder of it calls
    this after letting go, so a buffer given back meanwhile is settled by
    one of the two (the pool stays within its bound: keep_at_most)."""
    if _returned and _lock.acquire(blocking=False):
        try:
            _settle()
        finally:
            _lock.release()


def _settle() -> None:
    """Buffers given back into _free, smallest first, trimmed (lock held;
    nothing to do, as on most takes, when none was given back)."""
    if not _returned:
        return
    while _returned:
        _free.append(_returned.popleft())
    _free.sort(key=lambda b: b.size)
    _trim()


def free_bytes() -> int:
    """Bytes of buffers the pool keeps free now."""
    with _lock:
        _settle()
        free = sum(b.size for b in _free)
    _settle_soon()
    return free
