"""A table shard hands buckets of its key space to another server
(DynamicTables.MoveBuckets, psserver/core/table_moves.py), on real server
processes: the rows arrive whole (values, optimizer slots, look-up counts,
ages) with the memory of applied update keys; the source refuses their
keys from then on; a refused or failed move changes nothing; the call
needs the token and refuses malformed input with INVALID_ARGUMENT."""
from __future__ import annotations

import json

import numpy as np
import pytest

from protos.pstrain.v1 import tables_pb2
from psserver.client import PSClient
from psserver.contract import TOKEN_ENV
from psserver.contract.keys import (
    BITMAP_BYTES,
    BUCKETS,
    BucketMap,
    bitmap_of_buckets,
    bucket_of,
)
from psserver.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    NotPrimary,
    PSError,
    Unauthenticated,
    Unavailable,
)
from psserver.link import methods

pytestmark = pytest.mark.timeout(120)

TOKEN = "move-token"
KEYS = np.arange(1, 2001, dtype=np.int64) * 7919


def _two(start_ps):
    a, b = start_ps(env={TOKEN_ENV: TOKEN}), start_ps(env={TOKEN_ENV: TOKEN})
    return PSClient(a.address, token=TOKEN), PSClient(b.address, token=TOKEN)


def _make(c: PSClient, capacity: int = 0, optimizer: str = "adam") -> None:
    c.create_table("emb", 4, initializer="ones", optimizer=optimizer,
                   optimizer_params={"learning_rate": 0.1}, capacity=capacity)


def _layout(epoch: int, mask: np.ndarray) -> str:
    """A layout of two shards after a move of ``mask``'s buckets to shard 1."""
    owner = np.where(mask, 1, 0)
    if (owner == owner[0]).all():   # (each shard holds a bucket)
        owner[0] = 1 - owner[0]
    return json.dumps({"epoch": epoch, "addresses": ["a:1", "b:2"],
                       "buckets": BucketMap(owner, 2).ranges()})


def _move(src: PSClient, mask, destination: str, epoch: int = 1, **kw):
    return src.move_table_buckets("emb", bitmap_of_buckets(mask), destination,
                                  layout_epoch=epoch, layout=_layout(epoch, mask), **kw)


def _trained(c: PSClient) -> None:
    """Rows for KEYS, updated twice (Adam: its slots and count move too), one
    update with a known key."""
    c.lookup("emb", KEYS)
    c.lookup("emb", KEYS[:500])   # counts: 2 for the first 500
    grads = np.linspace(-1, 1, KEYS.size * 4, dtype=np.float32).reshape(-1, 4)
    c.update_table("emb", KEYS, grads, update_id=11)
    c.update_table("emb", KEYS, grads * 2, update_id=12)


def test_moved_rows_arrive_whole_and_the_source_refuses_their_keys(start_ps):
    src, dst = _two(start_ps)
    with src, dst:
        _make(src)
        _make(dst)
        _trained(src)
        mask = np.zeros(BUCKETS, bool)
        mask[: BUCKETS // 3] = True
        moving = mask[bucket_of(KEYS)]
        assert 0 < moving.sum() < KEYS.size
        before = src.lookup("emb", KEYS, admit=False)
        info = src.table_info("emb")
        assert src.table_info("emb").layout == ""
        reply = _move(src, mask, dst.address, epoch=3)
        assert src.table_info("emb").layout == _layout(3, mask)   # what a refused caller reads
        assert [t.layout for t in src.list_tables()] == [_layout(3, mask)]
        assert (reply.rows, reply.held) == (moving.sum(), KEYS.size - moving.sum())
        assert reply.bytes == moving.sum() * 4 * 4 * 3   # values, Adam's m and v
        np.testing.assert_array_equal(dst.lookup("emb", KEYS[moving], admit=False),
                                      before[moving])
        np.testing.assert_array_equal(src.lookup("emb", KEYS[~moving], admit=False),
                                      before[~moving])
        assert dst.table_info("emb").rows == moving.sum()
        # the source refuses a moved key, whatever the call, and changes nothing
        for call in (lambda: src.lookup("emb", KEYS[moving][:3]),
                     lambda: src.lookup("emb", KEYS[moving][:1], admit=False),
                     lambda: src.update_table("emb", KEYS[:50], np.ones((50, 4), np.float32),
                                              update_id=99)):
            with pytest.raises(NotPrimary, match="layout epoch 3"):
                call()
        after = src.table_info("emb")
        assert (after.rows, after.step, after.lookups) == \
            (KEYS.size - moving.sum(), info.step, info.lookups)   # (admit=False counts none)
        # the same update again (a resend) is answered, not applied, on both sides
        grads = np.ones((KEYS.size, 4), np.float32)
        for c, part in ((src, ~moving), (dst, moving)):
            held = c.lookup("emb", KEYS[part], admit=False)
            c.update_table("emb", KEYS[part], grads[part], update_id=12)
            np.testing.assert_array_equal(c.lookup("emb", KEYS[part], admit=False), held)
        # a new update applies at the destination as it would have at the source,
        # from the moved slots and count (Adam): compare with a shard that kept them
        ref = PSClient(start_ps(env={TOKEN_ENV: TOKEN}).address, token=TOKEN)
        with ref:
            _make(ref)
            _trained(ref)
            ref.update_table("emb", KEYS[moving], grads[moving], update_id=13)
            dst.update_table("emb", KEYS[moving], grads[moving], update_id=13)
            np.testing.assert_array_equal(dst.lookup("emb", KEYS[moving], admit=False),
                                          ref.lookup("emb", KEYS[moving], admit=False))


def test_a_move_that_cannot_reach_its_destination_changes_nothing(start_ps):
    src, dst = _two(start_ps)
    with src, dst:
        _make(src)
        _trained(src)
        before = src.lookup("emb", KEYS, admit=False)
        rows = src.table_info("emb").rows
        mask = np.ones(BUCKETS, bool)
        with pytest.raises(NotFound):   # no table there
            _move(src, mask, dst.address)
        closed = start_ps(env={TOKEN_ENV: TOKEN})
        address = closed.address
        closed.kill()
        with pytest.raises((Unavailable, PSError)):
            _move(src, mask, address, timeout=10)
        np.testing.assert_array_equal(src.lookup("emb", KEYS, admit=False), before)
        assert src.table_info("emb").rows == rows
        src.update_table("emb", KEYS[:5], np.ones((5, 4), np.float32))   # still takes every key


def test_capacity_and_the_moved_buckets_follow_the_move(start_ps):
    src, dst = _two(start_ps)
    with src, dst:
        _make(src, capacity=5000, optimizer="sgd")
        _make(dst, capacity=1000, optimizer="sgd")
        _trained(src)
        mask = np.zeros(BUCKETS, bool)
        mask[::2] = True
        _move(src, mask, dst.address, capacity=4000)
        assert src.table_info("emb").spec.capacity == 4000
        with pytest.raises(InvalidArgument, match="handed to another server already"):
            _move(src, mask, dst.address, epoch=2)
        # a restore (an import with reset) gives the shard every bucket back, and no layout
        src.import_table("emb", {"keys": KEYS[:2], "values": np.zeros((2, 4), np.float32),
                                 "age_steps": np.zeros(2, np.int64),
                                 "age_seconds": np.zeros(2), "freq": np.ones(2, np.int64)},
                         0, reset=True)
        src.lookup("emb", KEYS)
        assert src.table_info("emb").layout == ""


def _raw(c: PSClient, **fields):
    fields = {"destination": "127.0.0.1:1", "layout_epoch": 1, "layout": GOOD, **fields}
    return c._call(methods.TABLE_MOVE, tables_pb2.MoveBucketsRequest(name="emb", **fields))


GOOD = _layout(1, np.arange(BUCKETS) < 7)


@pytest.mark.parametrize("fields, match", [
    (dict(buckets=b"", destination="127.0.0.1:1"), "bitmap of 512 bytes"),
    (dict(buckets=b"\x01" * (BITMAP_BYTES + 1), destination="127.0.0.1:1"), "512 bytes"),
    (dict(buckets=b"\x00" * BITMAP_BYTES, destination="127.0.0.1:1"), "names no bucket"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, destination="no port"), "host:port"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, destination="a:1; rm -rf /"), "host:port"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, destination="SELF"), "is this server"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, capacity=-1), "capacities"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, destination_capacity=1 << 41), "capacities"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, layout_epoch=-5), "layout epoch"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, layout="x" * 270000), "layout takes at most"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, layout=""), "a layout is JSON"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, layout="[" * 60000), "a layout is JSON"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, layout_epoch=2), "a layout is JSON"),   # epoch 1 in it
    (dict(buckets=b"\x01" * BITMAP_BYTES, layout=GOOD.replace('"b:2"]', '"b:2", 7]')),
     "a layout is JSON"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, layout=json.dumps(
        {"epoch": 1, "addresses": "ab", "buckets": [[0, BUCKETS, 0]]})), "a layout is JSON"),
    (dict(buckets=b"\x01" * BITMAP_BYTES, layout=json.dumps(
        {"epoch": 1, "addresses": ["a:1"], "buckets": [[0, BUCKETS, 1 << 70]]})),
     "a layout is JSON"),
    (dict(buckets=b"", destination="", layout_only=True, source_server_id="x"),
     "source server"),
    (dict(buckets=b"", destination="", layout="", fence=True, source_server_id="x"),
     "source server"),
    (dict(buckets=b"", destination="", layout_only=True, source_leaves=True), "drains nothing"),
    (dict(buckets=b"", destination="", layout="", fence=True, source_leaves=True),
     "drains nothing"),
])
def test_malformed_moves_are_refused_and_change_nothing(start_ps, fields, match):
    src, dst = _two(start_ps)
    with src, dst:
        _make(src)
        _trained(src)
        before = src.lookup("emb", KEYS, admit=False)
        if fields.get("destination") == "SELF":
            fields = dict(fields, destination=src.address)
        with pytest.raises(InvalidArgument, match=match):
            _raw(src, **fields)
        np.testing.assert_array_equal(src.lookup("emb", KEYS, admit=False), before)


def test_a_move_planned_from_another_process_of_the_source_is_refused(start_ps):
    """source_server_id: a source that is not the process the caller planned
    from (it restarted since) refuses the move, nothing moved."""
    src, dst = _two(start_ps)
    with src, dst:
        _make(src)
        _make(dst)
        _trained(src)
        before = src.lookup("emb", KEYS, admit=False)
        with pytest.raises(FailedPrecondition, match="restarted since the move was planned"):
            _move(src, np.ones(BUCKETS, bool), dst.address, source_server_id="an-older-one")
        np.testing.assert_array_equal(src.lookup("emb", KEYS, admit=False), before)
        assert dst.table_info("emb").rows == 0
        here = src.server_info().server_id   # (the right one: it moves)
        assert _move(src, np.ones(BUCKETS, bool), dst.address, source_server_id=here).rows > 0


def test_a_move_needs_the_token(start_ps):
    src, dst = _two(start_ps)
    with src, dst:
        _make(src)
        _make(dst)
        _trained(src)
        before = src.lookup("emb", KEYS, admit=False)
        for token in (None, "wrong"):
            with PSClient(src.address, token=token) as other:
                with pytest.raises(Unauthenticated):
                    _move(other, np.ones(BUCKETS, bool), dst.address)
        np.testing.assert_array_equal(src.lookup("emb", KEYS, admit=False), before)
        assert dst.table_info("emb").rows == 0


def test_update_keys_moved_in_cover_only_the_keys_of_their_buckets(start_ps):
    """The destination remembers the source's update keys per group of moved
    buckets: the same update key again leaves out keys of those buckets
    (applied before the move, their rows carry it) and applies the others
    (keys of buckets the destination held or got from elsewhere)."""
    src, dst = _two(start_ps)
    with src, dst:
        _make(src, optimizer="sgd")
        _make(dst, optimizer="sgd")
        src.lookup("emb", KEYS)
        src.update_table("emb", KEYS, np.ones((KEYS.size, 4), np.float32), update_id=21)
        mask = np.zeros(BUCKETS, bool)
        mask[: BUCKETS // 2] = True
        moving = mask[bucket_of(KEYS)]
        _move(src, mask, dst.address)
        other = np.arange(1, 400, dtype=np.int64) * 104729   # keys of the destination's own
        other = other[~mask[bucket_of(other)]]
        dst.lookup("emb", other)
        both = np.concatenate([KEYS[moving], other])
        moved_before = dst.lookup("emb", KEYS[moving], admit=False)
        dst.update_table("emb", both, np.ones((both.size, 4), np.float32), update_id=21)
        np.testing.assert_array_equal(dst.lookup("emb", KEYS[moving], admit=False),
                                      moved_before)   # applied at the source already
        np.testing.assert_allclose(dst.lookup("emb", other, admit=False),
                                   np.full((other.size, 4), 0.9), rtol=1e-6)   # 1 - 0.1: applied
        dst.update_table("emb", both, np.ones((both.size, 4), np.float32), update_id=21)
        np.testing.assert_allclose(dst.lookup("emb", other, admit=False),
                                   np.full((other.size, 4), 0.9), rtol=1e-6)   # once: its own
        np.testing.assert_array_equal(dst.lookup("emb", KEYS[moving], admit=False), moved_before)


def test_a_shard_told_its_place_in_a_layout_refuses_the_others_keys(start_ps):
    """layout_only: nothing moves; the shard serves the layout and refuses
    keys of buckets the layout gives other shards (after a restore into a
    layout moves made); an older layout than the one it has is ignored;
    a malformed one is refused with nothing changed."""
    src, dst = _two(start_ps)
    with src, dst:
        _make(src, optimizer="sgd")
        owner = np.zeros(BUCKETS, np.int64)
        owner[::3] = 1
        ranges = BucketMap(owner, 2).ranges()
        layout = json.dumps({"epoch": 4, "addresses": ["a:1", "b:2"], "buckets": ranges})
        src.lookup("emb", KEYS)
        reply = src.move_table_buckets("emb", b"", "", layout_epoch=4, layout=layout,
                                       layout_only=True, shard=0)
        assert src.table_info("emb").layout == layout
        theirs = owner[bucket_of(KEYS)] == 1
        # rows of the other shard's buckets (a failed move's copy) are dropped
        assert (reply.rows, reply.held) == (theirs.sum(), (~theirs).sum())
        assert src.table_info("emb").rows == (~theirs).sum()
        with pytest.raises(NotPrimary, match="layout epoch 4"):
            src.lookup("emb", KEYS[theirs][:2], admit=False)
        src.lookup("emb", KEYS[~theirs], admit=False)
        older = json.dumps({"epoch": 3, "addresses": ["a:1"], "buckets": [[0, BUCKETS, 0]]})
        src.move_table_buckets("emb", b"", "", layout_epoch=3, layout=older, layout_only=True)
        assert src.table_info("emb").layout == layout   # (ignored)
        for bad, shard, match in (("not json", 0, "a layout is JSON"),
                                  (json.dumps({"epoch": 5, "addresses": ["a:1"]}), 0,
                                   "a layout is JSON"),
                                  (json.dumps({"epoch": 5, "addresses": ["a:1", "b:2"],
                                               "buckets": [[0, 5, 0]]}), 0, "a layout is JSON"),
                                  (layout.replace('"epoch": 4', '"epoch": 5'), 2,
                                   "shard 2 is not one of")):
            with pytest.raises(InvalidArgument, match=match):
                src.move_table_buckets("emb", b"", "", layout_epoch=5, layout=bad,
                                       layout_only=True, shard=shard)
        with pytest.raises(InvalidArgument, match="names no buckets, destination"):
            src.move_table_buckets("emb", b"", dst.address, layout_epoch=5, layout=layout,
                                   layout_only=True)
        assert src.table_info("emb").layout == layout


def test_a_fence_says_whether_a_move_happened_and_refuses_it_if_not(start_ps):
    """A caller whose move call failed asks: a fence at that epoch answers
    whether the move happened, and if not, the move is refused from then on
    (it may still be on its way); an epoch not newer than the shard's is
    refused for a move too."""
    src, dst = _two(start_ps)
    with src, dst:
        _make(src, optimizer="sgd")
        _make(dst, optimizer="sgd")
        src.lookup("emb", KEYS)
        mask = np.zeros(BUCKETS, bool)
        mask[:100] = True
        fence = dict(layout_epoch=2, fence=True)
        assert not src.move_table_buckets("emb", b"", "", **fence).moved
        with pytest.raises(InvalidArgument, match="not newer than this shard's"):
            _move(src, mask, dst.address, epoch=2)   # (the move that was on its way)
        assert src.table_info("emb").rows == KEYS.size and dst.table_info("emb").rows == 0
        _move(src, mask, dst.address, epoch=3)
        for _ in range(2):   # (the same answers when asked again: a lost answer's retry)
            assert src.move_table_buckets("emb", b"", "", layout_epoch=3, fence=True).moved
            assert not src.move_table_buckets("emb", b"", "", **fence).moved
        for bad in (dict(buckets=b"\x01" * BITMAP_BYTES), dict(destination=dst.address),
                    dict(layout="{}"), dict(capacity=5), dict(layout_only=True)):
            with pytest.raises(InvalidArgument, match="a fence names no"):
                src.move_table_buckets("emb", bad.pop("buckets", b""), bad.pop("destination", ""),
                                       **fence, **bad)
        with pytest.raises(InvalidArgument, match="fence's layout epoch"):
            src.move_table_buckets("emb", b"", "", layout_epoch=0, fence=True)


def test_a_shard_that_takes_buckets_applies_its_own_update_keys_to_them_once(start_ps):
    """A drain into a shard that applied update key U for its own keys, from
    a shard that never got U: U again (a step run again) is a resend for the
    taker's own keys and applied for the keys that came in. A key of a
    bucket another shard holds is refused by an import unless the import
    brings that bucket; the taker holds the buckets from the first piece
    (it no longer refuses them), and a move's piece that comes after the
    shard was told that epoch or a later one is refused."""
    b, c = _two(start_ps)
    with b, c:
        for cl in (b, c):
            _make(cl, optimizer="sgd")
        keys = np.arange(2000, dtype=np.int64)
        half = np.zeros(BUCKETS, bool)
        half[BUCKETS // 2:] = True                       # c's buckets, b the others
        theirs = half[bucket_of(keys)]
        kb, kc = keys[~theirs][:50], keys[theirs][:50]
        b.lookup("emb", kb)
        c.lookup("emb", kc)
        layout = json.dumps({"epoch": 1, "addresses": ["b:1", "c:2"],
                             "buckets": BucketMap(half.astype(np.int64), 2).ranges()})
        b.move_table_buckets("emb", b"", "", layout_epoch=1, layout=layout, layout_only=True)
        with pytest.raises(NotPrimary):   # (a key of c's, not brought by a move)
            b.import_table("emb", {"keys": kc[:1], "values": np.zeros((1, 4), np.float32),
                                   "age_steps": np.zeros(1, np.int64),
                                   "age_seconds": np.zeros(1), "freq": np.ones(1, np.int64)},
                           0, reset=False)
        b.update_table("emb", kb, np.ones((kb.size, 4), np.float32), update_id=777)
        _move(c, half, b.address, epoch=2)               # c drained into b; c never got 777
        np.testing.assert_allclose(b.lookup("emb", kc, admit=False), 1.0)   # (taken, not refused)
        both = np.concatenate([kb, kc])
        for _ in range(2):   # the step run again, then resent
            b.update_table("emb", both, np.ones((both.size, 4), np.float32), update_id=777)
            np.testing.assert_allclose(b.lookup("emb", both, admit=False), 0.9)   # once each
        # applied after the buckets came, by a sender whose layout sent kc elsewhere:
        # it covers the keys it was applied to (kb's buckets), not kc's
        b.update_table("emb", kb, np.ones((kb.size, 4), np.float32), update_id=888)
        for _ in range(2):
            b.update_table("emb", both, np.ones((both.size, 4), np.float32), update_id=888)
            np.testing.assert_allclose(b.lookup("emb", both, admit=False), 0.8, rtol=1e-6)
        with pytest.raises(NotPrimary, match="came too late"):
            b.import_table("emb", {"keys": kc[:0], "values": np.zeros((0, 4), np.float32),
                                   "age_steps": np.zeros(0, np.int64),
                                   "age_seconds": np.zeros(0), "freq": np.ones(0, np.int64)},
                           0, reset=False, incoming=(half, 1))
