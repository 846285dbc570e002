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
