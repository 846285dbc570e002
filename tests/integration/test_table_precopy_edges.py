"""The edges of a move's copy ahead (psserver/core/table_moves.py), on real
server processes, each found by review 24 with the code of d2144ce..50def1d
failing it: rows of a copy evicted at the destination before the move; a
copy ahead that arrives after its move; a drain to two destinations; a
checkpoint committed between the copy and the move; change tracking after
moves; update steps where the destination counts more steps than the
source; a copy refused at the destination; a copy that would lower the
destination's capacity."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from psserver.client import PSClient
from psserver.contract import TOKEN_ENV
from psserver.contract.keys import BUCKETS, bitmap_of_buckets, bucket_of
from psserver.errors import InvalidArgument, NotFound, NotPrimary
from tests.integration.test_table_moves import KEYS, TOKEN, _layout

pytestmark = pytest.mark.timeout(180)

MASK = np.zeros(BUCKETS, bool)
MASK[: BUCKETS // 3] = True
MOVING = KEYS[MASK[bucket_of(KEYS)]]
REST = KEYS[~MASK[bucket_of(KEYS)]]
OTHER = np.arange(1, 20000, dtype=np.int64) * 104729 + 3
OTHER = OTHER[~MASK[bucket_of(OTHER)]]   # keys of buckets the destination holds


def _servers(start_ps, tmp_path, n: int, **table) -> list[PSClient]:
    out = []
    for i in range(n):
        d = tmp_path / f"s{i}"
        d.mkdir(parents=True)
        c = PSClient(start_ps("--checkpoint-dir", str(d), env={TOKEN_ENV: TOKEN}).address,
                     token=TOKEN)
        c.create_table("emb", 4, initializer="random_uniform", optimizer="sgd",
                       optimizer_params={"learning_rate": 0.1}, seed=7, **table)
        c.dir = d
        out.append(c)
    return out


def _ahead(src: PSClient, dst: PSClient, mask=MASK, epoch: int = 1, **kw):
    return src.move_table_buckets("emb", bitmap_of_buckets(mask), dst.address,
                                  layout_epoch=epoch, precopy=True, **kw)


def _move(src: PSClient, dst: PSClient, mask=MASK, epoch: int = 1, **kw):
    return src.move_table_buckets("emb", bitmap_of_buckets(mask), dst.address,
                                  layout_epoch=epoch, layout=_layout(epoch, mask), **kw)


def _saved(c: PSClient, tag: str, **kw) -> dict:
    (c.dir / tag).mkdir()
    return load_file(str(c.dir / tag / c.save_table("emb", str(c.dir / tag), **kw).file))


def test_rows_of_a_copy_evicted_at_the_destination_are_sent_whole_by_the_move(start_ps,
                                                                                tmp_path):
    src, dst = _servers(start_ps, tmp_path, 2)
    own, new = OTHER[:1000], OTHER[1000:1300]
    with src, dst:
        dst.delete_table("emb")   # (the destination full of its own rows, LRU)
        dst.create_table("emb", 4, initializer="random_uniform", optimizer="sgd",
                         optimizer_params={"learning_rate": 0.1}, seed=7, capacity=own.size,
                         policy="lru")
        src.lookup("emb", KEYS)
        src.update_table("emb", KEYS, np.ones((KEYS.size, 4), np.float32), update_id=1)
        dst.lookup("emb", own)
        want = src.lookup("emb", MOVING, admit=False)
        cap = own.size + MOVING.size   # (its part after taking them)
        _ahead(src, dst, destination_capacity=cap)
        dst.lookup("emb", own)   # its own traffic: the copy's rows are the least recent
        dst.lookup("emb", new)   # 300 evicted
        got = _move(src, dst, destination_capacity=cap)
        assert got.sent == got.rows == MOVING.size   # (the copy lost rows: sent whole)
        np.testing.assert_array_equal(dst.lookup("emb", MOVING, admit=False), want)


def test_a_copy_ahead_that_arrives_after_its_move_is_refused(start_ps, tmp_path):
    src, dst = _servers(start_ps, tmp_path, 2)
    with src, dst:
        src.lookup("emb", KEYS)
        _move(src, dst)
        want = dst.lookup("emb", MOVING, admit=False)
        with pytest.raises(NotPrimary, match="came too late"):   # (a late or replayed copy)
            dst.import_table("emb", {k: v for k, v in _saved(dst, "a").items()}, 1,
                             staged=True, incoming=(MASK, 1))
        np.testing.assert_array_equal(dst.lookup("emb", MOVING, admit=False), want)
        dst.move_table_buckets("emb", b"", "", layout_epoch=1, layout=_layout(1, MASK),
                               layout_only=True, shard=1)
        np.testing.assert_array_equal(dst.lookup("emb", MOVING, admit=False), want)


def test_a_drain_to_two_destinations_sends_each_only_what_changed(start_ps, tmp_path):
    src, a, b = _servers(start_ps, tmp_path, 3)
    half = np.zeros(BUCKETS, bool)
    half[: BUCKETS // 2] = True
    with src, a, b:
        src.lookup("emb", KEYS)
        _ahead(src, a, half, 1)
        _ahead(src, b, ~half, 2)
        src.lookup("emb", KEYS[:10])
        first, second = _move(src, a, half, 1), _move(src, b, ~half, 2)
        assert first.rows + second.rows == KEYS.size
        assert first.sent <= 10 and second.sent <= 10


def _committed_save(src: PSClient) -> str:
    """A first save (id 1, stream "ck") of the source, committed: its incarnation."""
    (src.dir / "c").mkdir()
    s = src.save_table("emb", str(src.dir / "c"), save_id=1, stream="ck")
    src.commit_save(1, "ck", s.incarnation)
    return s.incarnation


def _churn_saves(src: PSClient, rounds: int, since: int, incarnation: str,
                 mask=MASK) -> list[int]:
    """Every row (of buckets outside ``mask``) replaced between two
    incremental saves, each committed: the source's bytes after each (its
    change tracking included)."""
    sizes, k = [], 10**9
    for i in range(since + 1, since + 1 + rounds):
        fresh = np.arange(k, k + KEYS.size, dtype=np.int64) * 31 + 1
        k += KEYS.size
        src.lookup("emb", fresh[~mask[bucket_of(fresh)]])
        src.save_table("emb", str(src.dir / "c"), save_id=i, since=i - 1,
                       incarnation=incarnation, stream="ck")
        src.commit_save(i, "ck", incarnation)
        sizes.append(src.table_info("emb").bytes)
    return sizes


def test_a_checkpoint_committed_between_the_copy_and_the_move_keeps_its_change_point(
        start_ps, tmp_path):
    src, dst = _servers(start_ps, tmp_path, 2)
    with src, dst:
        src.lookup("emb", KEYS)
        incarnation = _committed_save(src)
        _ahead(src, dst)
        src.lookup("emb", KEYS[:5])
        src.save_table("emb", str(src.dir / "c"), save_id=2, since=1, incarnation=incarnation,
                       stream="ck")
        src.commit_save(2, "ck", incarnation)
        got = _move(src, dst)
        assert got.rows == MOVING.size and got.sent <= 5


def test_change_tracking_does_not_grow_after_a_move_made_from_a_copy(start_ps, tmp_path):
    src, dst = _servers(start_ps, tmp_path, 2, capacity=KEYS.size, policy="lru")
    eighth = np.zeros(BUCKETS, bool)
    eighth[: BUCKETS // 8] = True
    with src, dst:
        src.lookup("emb", KEYS)
        incarnation = _committed_save(src)
        _ahead(src, dst, eighth)
        _move(src, dst, eighth)
        sizes = _churn_saves(src, 30, 1, incarnation, eighth)
        assert max(sizes[10:]) <= sizes[5], sizes   # (no interval kept past its commit)


def test_rows_copied_ahead_keep_their_update_steps_as_the_rows_moved_whole(start_ps,
                                                                             tmp_path):
    ends = []
    for ahead in (False, True):
        src, dst = _servers(start_ps, tmp_path / str(ahead), 2)
        own = OTHER[:100]
        with src, dst:
            src.lookup("emb", KEYS)
            src.update_table("emb", KEYS, np.ones((KEYS.size, 4), np.float32))
            dst.lookup("emb", own)
            for _ in range(30):   # the destination counts more steps than the source
                dst.update_table("emb", own, np.ones((own.size, 4), np.float32))
            if ahead:
                _ahead(src, dst)
            for _ in range(10):   # the source steps on its other rows only
                src.update_table("emb", REST, np.ones((REST.size, 4), np.float32))
            _move(src, dst)
            ends.append(_saved(dst, "after"))
    np.testing.assert_array_equal(ends[1]["keys"], ends[0]["keys"])
    np.testing.assert_array_equal(ends[1]["age_steps"], ends[0]["age_steps"])
    assert ends[0]["age_steps"].max() > 0


def test_a_copy_the_destination_refuses_changes_nothing_at_the_source(start_ps, tmp_path):
    src, dst = _servers(start_ps, tmp_path, 2)
    with src, dst:
        src.lookup("emb", KEYS)
        dst.delete_table("emb")
        before = src.table_info("emb").bytes
        with pytest.raises(NotFound):
            _ahead(src, dst)
        assert src.table_info("emb").bytes == before   # (no tracking started, no point)


def test_a_copy_ahead_never_lowers_the_destinations_capacity(start_ps, tmp_path):
    src, dst = _servers(start_ps, tmp_path, 2, capacity=5000)
    with src, dst:
        src.lookup("emb", KEYS)
        dst.lookup("emb", OTHER[:100])
        for capacity in (1, 4999):
            with pytest.raises(InvalidArgument, match="never lowers"):
                _ahead(src, dst, destination_capacity=capacity)
        assert (dst.table_info("emb").rows, dst.table_info("emb").spec.capacity) == (100, 5000)
        _ahead(src, dst, destination_capacity=6000)   # (raised: a drain's destination)
        assert dst.table_info("emb").spec.capacity == 6000


def test_rows_copied_ahead_do_not_expire_by_the_destinations_steps(start_ps, tmp_path):
    """The destination counts its own steps meanwhile: by them, a copy's rows
    would pass max_age_steps there, where the source keeps them fresh; the
    source expires its rows (the move drops those), not the destination."""
    src, dst = _servers(start_ps, tmp_path, 2, max_age_steps=20)
    own = OTHER[:100]
    with src, dst:
        src.lookup("emb", KEYS)
        src.update_table("emb", KEYS, np.ones((KEYS.size, 4), np.float32))
        want = src.lookup("emb", MOVING, admit=False)
        _ahead(src, dst)
        for _ in range(30):   # (each look-up sweeps the destination's rows for age)
            dst.lookup("emb", own)
            dst.update_table("emb", own, np.ones((own.size, 4), np.float32))
        got = _move(src, dst)
        assert got.rows == MOVING.size and got.sent == 0   # (the copy whole: nothing sent)
        np.testing.assert_array_equal(dst.lookup("emb", MOVING, admit=False), want)


@pytest.mark.parametrize("ends", ["fenced", "told-a-layout"])
def test_a_copy_whose_move_never_comes_keeps_no_change_point(start_ps, tmp_path, ends):
    """Review 25: a copy ahead anchored its change point until its move; a move
    that never came (the add failed, the steps did not end) kept it, and
    every save after kept what changed since. A fence or a layout told (what
    the coordinator does after a failed move or add) releases it."""
    src, dst = _servers(start_ps, tmp_path, 2, capacity=KEYS.size, policy="lru")
    with src, dst:
        src.lookup("emb", KEYS)
        incarnation = _committed_save(src)
        _ahead(src, dst)
        if ends == "fenced":
            assert not src.move_table_buckets("emb", b"", "", layout_epoch=1, fence=True).moved
        else:
            src.move_table_buckets("emb", b"", "", layout_epoch=0, layout=_layout(0, MASK),
                                   layout_only=True, shard=0)
        sizes = _churn_saves(src, 30, 1, incarnation)
        assert max(sizes[10:]) <= sizes[5], sizes


def test_a_copy_ahead_of_buckets_the_destination_holds_rows_of_is_refused(start_ps, tmp_path):
    src, dst = _servers(start_ps, tmp_path, 2)
    own = KEYS[MASK[bucket_of(KEYS)]][:50]   # (rows of those buckets the destination has)
    with src, dst:
        src.lookup("emb", KEYS)
        dst.lookup("emb", own)
        with pytest.raises(InvalidArgument, match="holds rows of"):
            _ahead(src, dst)
        assert dst.table_info("emb").rows == own.size
        np.testing.assert_array_equal(dst.lookup("emb", own, admit=False).shape, (own.size, 4))


def test_a_copy_ahead_keeps_one_source_step_and_its_changes_come_at_it_or_later(start_ps,
                                                                                 tmp_path):
    src, dst = _servers(start_ps, tmp_path, 2)
    with src, dst:
        src.lookup("emb", KEYS)
        state = {k: v for k, v in _saved(src, "a").items() if k != "evicted"}
        keep = MASK[bucket_of(state["keys"])]
        part = {k: (v[keep] if np.ndim(v) and v.shape[:1] == keep.shape else v)
                for k, v in state.items()}
        dst.import_table("emb", part, 1000, staged=True, incoming=(MASK, 1))
        for step, kw, match in [(999, dict(staged=True), "one step of its source"),
                                (1, dict(dropped=np.zeros(0, np.int64)), "or later")]:
            one = {k: (v[:1] if np.ndim(v) and v.shape[:1] == part["keys"].shape else v)
                   for k, v in part.items()}   # (a later staged piece, then changes)
            with pytest.raises(InvalidArgument, match=match):
                _later_piece(dst, one, step, **kw)
        with pytest.raises(InvalidArgument, match="copy ahead of another server's move"):
            dst.move_table_buckets("emb", bitmap_of_buckets(MASK), src.address, layout_epoch=3,
                                   layout=_layout(3, ~MASK))


def _later_piece(c: PSClient, state: dict, step: int, staged: bool = False, dropped=None):
    """One ImportTable piece of a move of epoch 1 (not its first)."""
    from protos.pstrain.v1 import tables_pb2
    from psserver.client.admin import _fill_rows
    from psserver.link import methods
    from psserver.link import tensor_proto as TP
    req = tables_pb2.ImportTableRequest(name="emb", step=step, staged=staged,
                                        delta=dropped is not None)
    _fill_rows(req, state, 0, state["keys"].size, (MASK, 1))
    if dropped is not None:
        TP.fill(req.dropped, dropped)
    return c._call(methods.TABLE_IMPORT, req)
