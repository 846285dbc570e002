"""psserver.contract.memory: arrays that grow in place (a dynamic table's)."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from psserver.contract.memory import MAPPED_BYTES, grow_rows, mapped


def _mapping(a: np.ndarray):
    base = a.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


@pytest.mark.parametrize("tail", [(), (64,)])
def test_a_large_array_grows_in_its_own_mapping_keeping_its_rows(tail):
    rows = MAPPED_BYTES // 8 // (tail[0] if tail else 1) + 10
    holder = {"a": mapped((rows,) + tail, np.float64)}
    first = _mapping(holder["a"])
    assert isinstance(first, mmap.mmap) and not holder["a"].any()
    holder["a"][:] = np.arange(rows).reshape((rows,) + (1,) * len(tail))
    grow_rows(holder, "a", rows * 2, rows)
    a = holder["a"]
    assert a.shape == (rows * 2,) + tail and _mapping(a) is first   # the same mapping, grown
    np.testing.assert_array_equal(a[:rows].reshape(rows, -1)[:, 0], np.arange(rows))
    assert not a[rows:].any()


def test_a_view_still_alive_makes_it_a_copy_and_loses_nothing():
    holder = {"a": mapped((MAPPED_BYTES // 8 + 10,), np.int64)}
    holder["a"][:5] = [1, 2, 3, 4, 5]
    view = holder["a"][:5]   # (another reader's view: the mapping cannot move)
    grow_rows(holder, "a", MAPPED_BYTES // 4, 5)
    np.testing.assert_array_equal(holder["a"][:5], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(view, [1, 2, 3, 4, 5])   # still valid: not moved
    assert _mapping(holder["a"]) is not _mapping(view)
    holder["a"][0] = 9
    assert view[0] == 1


def test_small_arrays_stay_on_the_heap_and_grow_by_a_copy_into_a_mapping_when_large():
    holder = {"a": mapped((16, 4), np.float32)}
    assert not isinstance(_mapping(holder["a"]), mmap.mmap)
    holder["a"][:3] = 7
    grow_rows(holder, "a", MAPPED_BYTES // 16 + 1, 3)
    assert isinstance(_mapping(holder["a"]), mmap.mmap)
    assert (holder["a"][:3] == 7).all() and not holder["a"][3:].any()


class _FailingMap:
    """An mmap whose resize fails as a system without mremap (or out of
    memory) fails it; everything else is the real mapping's."""

    def __init__(self, error):
        self.error = error

    def __enter__(self):
        import psserver.contract.memory as M
        self.real, self.M = mmap.mmap, M
        error = self.error

        class Failing(mmap.mmap):
            def resize(self, n):
                raise error
        M.mmap = type("mmapmod", (), {"mmap": Failing, "PAGESIZE": mmap.PAGESIZE})
        return self

    def __exit__(self, *exc):
        self.M.mmap = mmap


@pytest.mark.parametrize("error", [SystemError("mmap: resizing not available--no mremap()"),
                                   OSError(12, "Cannot allocate memory"), KeyboardInterrupt()])
def test_a_grow_that_fails_leaves_the_array_as_it_was_or_copies_it(error):
    """A failed remap (no mremap, ENOMEM) falls back to a copy; an error that
    is not a refusal is raised, the array back in place as it was, never missing."""
    import psserver.contract.memory as M
    with _FailingMap(error):
        holder = {"a": M.mapped((MAPPED_BYTES // 8 + 10,), np.int64)}
        assert isinstance(_mapping(holder["a"]), M.mmap.mmap)
        holder["a"][:3] = [4, 5, 6]
        if isinstance(error, KeyboardInterrupt):
            with pytest.raises(KeyboardInterrupt):
                grow_rows(holder, "a", MAPPED_BYTES // 4, 3)
            assert holder["a"].shape == (MAPPED_BYTES // 8 + 10,)
        else:
            grow_rows(holder, "a", MAPPED_BYTES // 4, 3)
            assert holder["a"].shape == (MAPPED_BYTES // 4,)
        np.testing.assert_array_equal(holder["a"][:3], [4, 5, 6])


def test_an_array_being_remapped_is_never_missing_to_a_reader_without_the_lock():
    """MemoryBudget reads a table's bytes without its lock: the name is there
    (a 0-row stand-in at worst) all through a grow."""
    import threading
    holder = {"a": mapped((MAPPED_BYTES // 8 + 10,), np.int64)}
    stop, missing = threading.Event(), []

    def read():
        while not stop.is_set():
            try:
                holder["a"].nbytes
            except KeyError:
                missing.append(1)
    t = threading.Thread(target=read)
    t.start()
    try:
        for k in range(2, 60):
            grow_rows(holder, "a", (MAPPED_BYTES // 8 + 10) * k // 2, 1)
    finally:
        stop.set()
        t.join()
    assert not missing


_HEAP_PROBE = r"""
import ctypes, sys
from psserver.contract.memory import bound_heap
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
                .split()]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
assert bound_heap(int(sys.argv[1]))
blocks = [libc.malloc(900_000) for _ in range(40)]   # 36 MB of heap, each under 1 MiB
for b in blocks:
    libc.free(b)
print(libc.mallinfo2().arena >> 20)
"""


@pytest.mark.parametrize("limit, kept", [(64 << 20, False), (1 << 30, True), (64 << 30, True)])
def test_a_bounded_servers_heap_is_trimmed_at_an_eighth_of_its_limit(limit, kept):
    """bound_heap: freed heap above limit // 8 goes back, at most 256 MiB kept
    (mallopt takes a C int: a 64 GiB limit wrapped to a threshold of 0, and
    every free trimmed the heap, 14x slower). Run in a process of its own."""
    import ctypes
    import os
    import subprocess
    import sys
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("no glibc mallinfo2 here")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, str(limit)], capture_output=True,
                         text=True, timeout=60, check=True, cwd=root)
    heap_mib = int(out.stdout.split()[-1])
    assert (heap_mib >= 30) == kept, (limit, heap_mib)
