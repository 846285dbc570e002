"""A move's rows copied ahead of it (MoveBuckets ``precopy``, a staged import:
psserver/core/table_moves.py), on real server processes: the move then sends
only the rows changed since (made, updated, looked up) and the keys gone
(evicted), and ends exactly as the same move made whole; the destination
refuses the copy's keys and never saves its rows until the move; a
destination that lost the copy gets the rows whole; malformed copies and
changes are refused and change nothing; the call needs the token."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from protos.pstrain.v1 import tables_pb2
from psserver.client import PSClient
from psserver.contract import TOKEN_ENV
from psserver.contract.keys import BUCKETS, bitmap_of_buckets, bucket_of
from psserver.errors import FailedPrecondition, InvalidArgument, NotPrimary, Unauthenticated
from psserver.link import methods
from psserver.link import tensor_proto as TP
from tests.integration.test_table_moves import KEYS, TOKEN, _layout

pytestmark = pytest.mark.timeout(120)

NEW = np.arange(1, 301, dtype=np.int64) * 104729 + 3   # keys made between copy and move
MASK = np.zeros(BUCKETS, bool)
MASK[: BUCKETS // 3] = True
CAPACITY = KEYS.size + 100   # (NEW's rows evict 200 of the least recently used)


def _server(start_ps, tmp_path, name: str) -> PSClient:
    d = tmp_path / name
    d.mkdir()
    c = PSClient(start_ps("--checkpoint-dir", str(d), env={TOKEN_ENV: TOKEN}).address,
                 token=TOKEN)
    c.create_table("emb", 4, initializer="random_uniform", optimizer="adam",
                   optimizer_params={"learning_rate": 0.1}, capacity=CAPACITY, policy="lru",
                   seed=7)
    c.dir = d
    return c


def _trained(c: PSClient) -> None:
    c.lookup("emb", KEYS)
    grads = np.linspace(-1, 1, KEYS.size * 4, dtype=np.float32).reshape(-1, 4)
    c.update_table("emb", KEYS, grads, update_id=11)


def _changes(c: PSClient) -> None:
    """What training does between the copy ahead and the move: updates,
    look-ups that only count, rows made, rows evicted."""
    part = KEYS[::3]
    c.update_table("emb", part, np.full((part.size, 4), 0.5, np.float32), update_id=21)
    c.lookup("emb", KEYS[1::7])
    c.lookup("emb", NEW)


def _saved(c: PSClient, tag: str) -> dict:
    (c.dir / tag).mkdir()
    saved = c.save_table("emb", str(c.dir / tag))
    return load_file(str(c.dir / tag / saved.file))


def _move(src: PSClient, dst: PSClient, **kw):
    return src.move_table_buckets("emb", bitmap_of_buckets(MASK), dst.address, layout_epoch=1,
                                  layout=_layout(1, MASK), destination_capacity=CAPACITY, **kw)


def _ahead(src: PSClient, dst: PSClient):
    return src.move_table_buckets("emb", bitmap_of_buckets(MASK), dst.address, layout_epoch=1,
                                  destination_capacity=CAPACITY, precopy=True)


def _same_rows(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if name == "age_seconds":   # (each server's clock)
            np.testing.assert_allclose(a[name], b[name], atol=5.0)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_move_copied_ahead_ends_as_the_same_move_made_whole(start_ps, tmp_path):
    src, dst, ref_src, ref_dst = (_server(start_ps, tmp_path, n) for n in "abcd")
    with src, dst, ref_src, ref_dst:
        for c in (src, ref_src):
            _trained(c)
        ahead = _ahead(src, dst)
        moving = MASK[bucket_of(KEYS)]
        assert (ahead.rows, ahead.held) == (moving.sum(), KEYS.size)   # (nothing moved yet)
        assert dst.table_info("emb").rows == moving.sum()
        for c in (src, ref_src):
            _changes(c)
        evicted = np.setdiff1d(KEYS, _saved(src, "src")["keys"])
        assert (MASK[bucket_of(evicted)]).any()   # (keys gone since the copy: dropped there)
        got, want = _move(src, dst), _move(ref_src, ref_dst)
        assert (got.rows, got.bytes, got.held) == (want.rows, want.bytes, want.held)
        assert want.sent == want.rows and 0 < got.sent < got.rows
        _same_rows(_saved(dst, "after"), _saved(ref_dst, "after"))
        _same_rows(_saved(src, "after"), _saved(ref_src, "after"))
        # the update keys moved with the rows: a resend is not applied again
        keys = np.concatenate([KEYS, NEW])
        keys = keys[MASK[bucket_of(keys)]]
        before = dst.lookup("emb", keys, admit=False)
        dst.update_table("emb", keys, np.ones((keys.size, 4), np.float32), update_id=21)
        np.testing.assert_array_equal(dst.lookup("emb", keys, admit=False), before)
        # and a new update applies as at the shard moved whole (slots, Adam's count)
        for c in (dst, ref_dst):
            c.update_table("emb", keys, np.ones((keys.size, 4), np.float32), update_id=31)
        np.testing.assert_array_equal(dst.lookup("emb", keys, admit=False),
                                      ref_dst.lookup("emb", keys, admit=False))


def test_rows_copied_ahead_are_refused_and_not_saved_until_the_move(start_ps, tmp_path):
    src, dst = _server(start_ps, tmp_path, "a"), _server(start_ps, tmp_path, "b")
    with src, dst:
        _trained(src)
        dst.lookup("emb", NEW[~MASK[bucket_of(NEW)]])   # rows of its own
        own = _saved(dst, "before")
        _ahead(src, dst)
        moving = KEYS[MASK[bucket_of(KEYS)]]
        info = dst.table_info("emb")
        for call in (lambda: dst.lookup("emb", moving[:3]),
                     lambda: dst.lookup("emb", moving[:1], admit=False),
                     lambda: dst.update_table("emb", moving[:5], np.ones((5, 4), np.float32),
                                              update_id=5)):
            with pytest.raises(NotPrimary):
                call()
        assert dst.table_info("emb").step == info.step
        _same_rows(_saved(dst, "during"), own)   # (a save writes none of the copy's rows)
        src.lookup("emb", moving[:10])   # (the source serves them meanwhile)
        _move(src, dst)
        assert np.isin(moving, _saved(dst, "after")["keys"]).all()


@pytest.mark.parametrize("lost", ["told-a-layout", "restarted"])
def test_a_destination_that_lost_the_copy_gets_the_rows_whole(start_ps, tmp_path, lost):
    src, dst = _server(start_ps, tmp_path, "a"), _server(start_ps, tmp_path, "b")
    with src, dst:
        _trained(src)
        _ahead(src, dst)
        _changes(src)
        if lost == "told-a-layout":   # (its copy dropped as another shard's rows)
            dropped = dst.move_table_buckets("emb", b"", "", layout_epoch=0,
                                             layout=_layout(0, MASK), layout_only=True, shard=0)
            assert dropped.rows > 0
        else:   # (a fresh table there, as a server back after a restart would have)
            dst.delete_table("emb")
            dst.create_table("emb", 4, initializer="random_uniform", optimizer="adam",
                             optimizer_params={"learning_rate": 0.1}, capacity=CAPACITY,
                             policy="lru", seed=7)
        want = _saved(src, "before")
        keep = MASK[bucket_of(want["keys"])]
        got = _move(src, dst)
        assert got.sent == got.rows == keep.sum()
        have = _saved(dst, "after")
        np.testing.assert_array_equal(have["keys"], want["keys"][keep])
        np.testing.assert_array_equal(have["values"], want["values"][keep])


def _import(c: PSClient, keys, staged=False, delta=False, dropped=None, reset=False,
            mask=MASK, epoch=1):
    req = tables_pb2.ImportTableRequest(name="emb", reset=reset, step=1, staged=staged,
                                        delta=delta, buckets=bitmap_of_buckets(mask),
                                        layout_epoch=epoch)
    keys = np.asarray(keys, np.int64)
    TP.fill(req.keys, keys)
    TP.fill(req.values, np.ones((keys.size, 4), np.float32))
    for field in ("age_steps", "freq"):
        TP.fill(getattr(req, field), np.zeros(keys.size, np.int64))
    TP.fill(req.age_seconds, np.zeros(keys.size, np.float64))
    for slot in ("m", "v"):
        TP.fill(req.slots.add(name=slot).tensor, np.zeros((keys.size, 4), np.float32))
    TP.fill(req.slots.add(name="t").tensor, np.zeros((), np.float32))
    if dropped is not None:
        TP.fill(req.dropped, np.asarray(dropped, np.int64))
    return c._call(methods.TABLE_IMPORT, req)


def test_malformed_copies_and_changes_are_refused_and_change_nothing(start_ps, tmp_path):
    src, dst = _server(start_ps, tmp_path, "a"), _server(start_ps, tmp_path, "b")
    with src, dst:
        _trained(src)
        inside = KEYS[MASK[bucket_of(KEYS)]][:5]
        outside = KEYS[~MASK[bucket_of(KEYS)]][:5]
        before = _saved(dst, "before"), dst.table_info("emb")
        cases = [
            (InvalidArgument, "of the buckets it brings", dict(keys=outside, staged=True,
                                                                reset=True)),
            (InvalidArgument, "was not started", dict(keys=inside, staged=True)),
            (FailedPrecondition, "no copy of this move", dict(keys=inside, delta=True,
                                                               dropped=[])),
            (InvalidArgument, "dropped keys only with delta", dict(keys=inside,
                                                                   dropped=inside)),
            (InvalidArgument, "never empty the shard", dict(keys=inside, delta=True,
                                                            reset=True)),
        ]
        for error, match, kw in cases:
            with pytest.raises(error, match=match):
                _import(dst, **kw)
        # a real copy ahead, then changes that would drop keys of other buckets
        _ahead(src, dst)
        held = dst.table_info("emb").rows
        for error, match, kw in [
                (InvalidArgument, "dropped keys are of the buckets", dict(
                    keys=inside[:0], delta=True, dropped=outside)),
                (InvalidArgument, "of the buckets it brings", dict(
                    keys=outside, delta=True, dropped=[]))]:
            with pytest.raises(error, match=match):
                _import(dst, **kw)
        assert dst.table_info("emb").rows == held
        for kw, match in [(dict(capacity=5), "names no capacity"),
                          (dict(layout=_layout(1, MASK)), "names no capacity"),
                          (dict(source_leaves=True), "names no capacity")]:
            with pytest.raises(InvalidArgument, match=match):
                src.move_table_buckets("emb", bitmap_of_buckets(MASK), dst.address,
                                       layout_epoch=1, precopy=True, **kw)
        with pytest.raises(InvalidArgument, match="epoch"):
            src.move_table_buckets("emb", bitmap_of_buckets(MASK), dst.address,
                                   layout_epoch=0, precopy=True)
        dst.move_table_buckets("emb", b"", "", layout_epoch=0, layout=_layout(0, MASK),
                               layout_only=True, shard=1)   # (the copy dropped)
        _same_rows(_saved(dst, "after"), before[0])
        assert src.table_info("emb").rows == KEYS.size


def test_a_copy_ahead_needs_the_token(start_ps, tmp_path):
    src, dst = _server(start_ps, tmp_path, "a"), _server(start_ps, tmp_path, "b")
    with src, dst:
        _trained(src)
        for token in ("wrong", None):
            with PSClient(src.address, token=token) as bad:
                with pytest.raises(Unauthenticated):
                    _ahead(bad, dst)
            with PSClient(dst.address, token=token) as bad:
                with pytest.raises(Unauthenticated):
                    _import(bad, KEYS[MASK[bucket_of(KEYS)]][:5], staged=True, reset=True)
        assert dst.table_info("emb").rows == 0
