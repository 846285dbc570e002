"""psserver/link/buffers.py: large frame buffers used again, never while in use."""
import collections
import gc
import importlib.util
import threading

import numpy as np
import pytest

from psserver.link import buffers as B


@pytest.fixture(autouse=True)
def _own_pool(monkeypatch):
    """Each test its own free lists (buffers an earlier test let go stay out)."""
    monkeypatch.setattr(B, "_free", [])
    monkeypatch.setattr(B, "_returned", collections.deque())


def test_a_buffer_is_not_handed_out_again_while_anything_made_from_it_lives(monkeypatch):
    monkeypatch.setattr(B, "_free", [])
    first = memoryview(B.take(B.MIN_BYTES + 100))
    np.frombuffer(first, np.uint8)[:] = 7
    kept = np.frombuffer(first, np.float32, count=16, offset=64)[2:]   # a view of a view
    expect = kept.copy()
    del first
    gc.collect()
    other = B.take(B.MIN_BYTES + 100)   # must be another buffer: `kept` still reads the first
    other[:] = 0
    np.testing.assert_array_equal(kept, expect)
    del kept, other
    gc.collect()
    free = B.free_bytes()   # both back in the pool now
    assert free >= 2 * (B.MIN_BYTES + 100)
    again = B.take(B.MIN_BYTES + 100)   # one of them, handed out again
    assert B.free_bytes() < free and again.size == B.MIN_BYTES + 100


def test_numpy_views_of_a_taken_buffer_keep_it_out_of_the_pool(monkeypatch):
    """A reshape or dtype view of what take() gives (numpy points such a view
    at the memory's owner, past the array handed out) holds the buffer too."""
    monkeypatch.setattr(B, "_free", [])
    kept = B.take(B.MIN_BYTES + 64).view(np.float32).reshape(-1, 16)[1:]
    kept[:] = 3.0
    gc.collect()
    other = B.take(B.MIN_BYTES + 64)   # must be another buffer: `kept` still uses the first
    other[:] = 0
    assert (kept == 3.0).all()
    assert B.free_bytes() == 0
    del kept
    gc.collect()
    assert B.free_bytes() >= B.MIN_BYTES + 64
    del other
    gc.collect()


def test_a_buffer_given_back_while_the_pool_is_locked_waits_for_no_one():
    """A finalizer runs wherever a collection runs, inside the pool's lock on
    the same thread too: giving a buffer back there must not wait for that
    lock (it would wait for itself, and every later take with it). On a
    module of its own: a failure here leaves its lock held."""
    spec = importlib.util.spec_from_file_location("buffers_copy", B.__file__)
    pool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool)
    done = threading.Event()

    def give_inside_the_lock():
        with pool._lock:
            pool._give(np.empty(pool.MIN_BYTES, np.uint8))
        done.set()
    threading.Thread(target=give_inside_the_lock, daemon=True).start()
    assert done.wait(10)
    assert pool.free_bytes() == pool.MIN_BYTES
    # given back with the lock free, it is settled at once: kept within the bound
    pool.keep_at_most(pool.MIN_BYTES)
    pool._give(np.empty(pool.MIN_BYTES, np.uint8))
    assert not pool._returned and sum(b.size for b in pool._free) == pool.MIN_BYTES


def test_small_buffers_are_not_pooled_and_the_pool_is_bounded(monkeypatch):
    monkeypatch.setattr(B, "_free", [])
    small = B.take(1000)
    assert small.size == 1000
    del small
    gc.collect()
    assert B.free_bytes() == 0
    monkeypatch.setattr(B, "MAX_FREE_BYTES", 3 * B.MIN_BYTES)
    bufs = [B.take(B.MIN_BYTES) for _ in range(5)]
    del bufs
    gc.collect()
    assert 0 < B.free_bytes() <= 3 * B.MIN_BYTES


def test_a_server_with_a_memory_limit_keeps_fewer_free_buffers(monkeypatch):
    """psserver --max-memory-bytes L keeps at most L/8 of free frame buffers
    (buffers.keep_at_most): they are resident memory counted nowhere else
    (6 readers of 32 MiB variables left a 128 MiB server 2.8x over it)."""
    monkeypatch.setattr(B, "_free", [])
    monkeypatch.setattr(B, "_max_free", None)
    bufs = [B.take(B.MIN_BYTES) for _ in range(4)]
    del bufs
    gc.collect()
    assert B.free_bytes() == 4 * B.MIN_BYTES
    B.keep_at_most(2 * B.MIN_BYTES)   # the ones over it let go now
    assert B.free_bytes() == 2 * B.MIN_BYTES
    bufs = [B.take(B.MIN_BYTES) for _ in range(4)]
    del bufs
    gc.collect()
    assert B.free_bytes() == 2 * B.MIN_BYTES
