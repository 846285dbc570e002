"""psserver.core.dynamic_table: the hash index, admission, eviction, initial rows
and updates of one dynamic-table shard (pure logic: no processes)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from psserver.contract import Initializer
from psserver.contract.keys import BucketMap, initial_rows, mix64
from psserver.contract.optimizers import make_optimizer
from psserver.contract.rows import sum_duplicates
from psserver.core import eviction
from psserver.core.dynamic_table import DynamicTable
from psserver.core.key_index import KeyIndex
from psserver.core.table_config import TableConfig
from psserver.errors import InvalidArgument

I64 = np.iinfo(np.int64)


class Clock:
    """A clock the test moves."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(dim=4, optimizer="sgd", params=None, clock=None, **config) -> DynamicTable:
    config.setdefault("initializer", Initializer(kind="ones"))
    return DynamicTable(TableConfig(dim=dim, **config),
                        make_optimizer(optimizer, params or {"learning_rate": 1.0}),
                        clock=clock or Clock(), initial_rows_hint=16)


def k(*keys) -> np.ndarray:
    return np.array(keys, np.int64)


def live(t: DynamicTable) -> set[int]:
    return set(int(x) for x in t.index.items()[0])


# -- the index ---------------------------------------------------------------------------------
@pytest.mark.parametrize("span", [40, 5000, None])
def test_the_index_agrees_with_a_dict_through_inserts_deletes_and_rebuilds(span):
    """Random batches of inserts and deletes; small key spans crowd buckets
    (long probe chains, deleted slots reused), None spans all of int64
    (its extremes included)."""
    rng = np.random.default_rng(span or 7)
    index, model = KeyIndex(), {}
    for _ in range(120):
        if span:
            keys = np.unique(rng.integers(-span, span, 300))
        else:
            keys = np.unique(np.r_[rng.integers(I64.min, I64.max, 300, dtype=np.int64),
                                   [I64.min, I64.max, 0, -1, -2]])
        got = index.find(keys)
        assert [model.get(int(x), -1) for x in keys] == got.tolist()
        new = keys[got < 0]
        rows = rng.integers(0, 1 << 40, new.size)
        index.insert(new, rows)
        model.update(zip(new.tolist(), rows.tolist()))
        gone = np.unique(rng.choice(keys, keys.size // 3))
        removed = index.delete(gone)
        assert sorted(removed.tolist()) == sorted(model.pop(int(x)) for x in gone
                                                 if int(x) in model)
        assert index.size == len(model)
        assert 2 * index.used <= index.keys.size   # at most half the slots used
    items = dict(zip(*(a.tolist() for a in index.items())))
    assert items == model


def test_keys_spread_over_shards_by_hash_not_by_value():
    keys = np.arange(0, 8000, 8, dtype=np.int64)   # all share their low bits
    counts = np.bincount(BucketMap.even(3).shard_of(keys), minlength=3)
    assert counts.min() > 0.28 * keys.size
    assert (BucketMap.even(3).shard_of(keys) == BucketMap.even(3).shard_of(keys.copy())).all()
    assert mix64(k(1))[0] != mix64(k(2))[0]


# -- admission ---------------------------------------------------------------------------------
def test_a_key_gets_a_row_on_its_min_count_th_look_up_and_not_before():
    t = table(min_count=3)
    for seen in (1, 2):
        np.testing.assert_array_equal(t.lookup(k(7)), np.zeros((1, 4)))   # the default row
        assert len(t) == 0 and t.stats.not_admitted == seen
    np.testing.assert_array_equal(t.lookup(k(7)), np.ones((1, 4)))        # the third: admitted
    assert len(t) == 1 and t.stats.admitted == 1 and t.stats.not_admitted == 2
    # Occurrences within one look-up count: three at once is enough, two is not.
    np.testing.assert_array_equal(t.lookup(k(8, 9, 8, 8, 9)),
                                  [[1] * 4, [0] * 4, [1] * 4, [1] * 4, [0] * 4])
    assert live(t) == {7, 8}
    t.lookup(k(9))   # 2 + 1
    assert live(t) == {7, 8, 9}


def test_gradients_for_keys_without_a_row_are_dropped_and_counted():
    t = table(min_count=2)
    t.lookup(k(1, 2, 1))   # 1 admitted (twice), 2 not yet
    before = t.export()
    assert t.apply_gradients(k(1, 2, 3), np.ones((3, 4), np.float32)) == 1
    assert t.stats.dropped == 2 and t.stats.updated == 1
    after = t.export()
    np.testing.assert_array_equal(after["keys"], before["keys"])
    np.testing.assert_array_equal(after["values"], before["values"] - 1)
    np.testing.assert_array_equal(t.lookup(k(2), admit=False), np.zeros((1, 4)))


def test_an_update_after_its_look_up_reaches_the_keys_rows_as_they_are_now():
    """A step's update finds its keys' rows from its own look-up while no row
    was evicted: keys admitted since (by another look-up) get their gradient,
    and after an eviction (a row handed to another key) the index decides."""
    t = table(min_count=2, capacity=3)
    first = k(1, 2)
    t.lookup(first, counts=k(2, 1))         # 1 admitted, 2 not yet
    t.lookup(k(2))                          # another step admits 2
    assert t.apply_gradients(first, np.ones((2, 4), np.float32)) == 2
    np.testing.assert_array_equal(t.lookup(first, admit=False), np.zeros((2, 4)))   # 1 - 1
    t.lookup(first, counts=k(2, 2))         # remembered: rows of 1 and 2
    t.lookup(k(5, 6), counts=k(2, 2))       # capacity 3: evicts, and 5, 6 take the rows
    t.apply_gradients(first, np.full((2, 4), 3, np.float32))
    assert live(t) == {5, 6} | (live(t) & {1, 2}) and len(live(t)) == 3
    np.testing.assert_array_equal(t.lookup(k(5, 6), admit=False), np.ones((2, 4)))   # untouched
    assert t.stats.dropped == 2 - len(live(t) & {1, 2})


def test_probability_admission_admits_about_that_share_and_is_seeded():
    n, p = 20_000, 0.25
    keys = np.arange(n, dtype=np.int64) * 7919
    counts = []
    for _ in range(2):
        t = table(probability=p, seed=3)
        t.lookup(keys)
        counts.append(len(t))
    sigma = (n * p * (1 - p)) ** 0.5
    assert abs(counts[0] - n * p) < 5 * sigma
    assert counts[0] == counts[1]                           # same seed, same keys admitted
    assert t.stats.not_admitted == n - counts[1]
    t.lookup(keys)   # each not admitted key gets another chance
    assert len(t) > counts[1]


def test_look_ups_without_admission_change_nothing():
    t = table(min_count=2, capacity=2)
    t.lookup(k(1, 1, 2, 2))
    before, stats = t.export(), dict(vars(t.stats))
    out = t.lookup(k(1, 3, 3, 3), admit=False)
    np.testing.assert_array_equal(out, [[1] * 4, [0] * 4, [0] * 4, [0] * 4])
    assert dict(vars(t.stats)) == stats and live(t) == {1, 2}
    for name, arr in t.export().items():
        np.testing.assert_array_equal(arr, before[name])


# -- eviction ----------------------------------------------------------------------------------
def test_capacity_evicts_the_least_recently_used_and_keeps_exactly_capacity():
    t = table(capacity=4)
    for key in (1, 2, 3, 4):
        t.lookup(k(key))
    assert live(t) == {1, 2, 3, 4} and t.stats.evicted_capacity == 0   # 4 fit
    t.lookup(k(1))                 # 2 is now the least recently used
    t.lookup(k(5))
    assert live(t) == {1, 3, 4, 5} and t.stats.evicted_capacity == 1
    t.lookup(k(6, 7))              # two more: 3 and 4 go
    assert live(t) == {1, 5, 6, 7} and t.stats.evicted_capacity == 3


def test_lfu_evicts_the_least_often_looked_up():
    t = table(capacity=3, policy="lfu")
    t.lookup(k(1, 2, 3))
    for _ in range(3):
        t.lookup(k(1))
    t.lookup(k(3))
    t.lookup(k(4))                 # 2 was looked up once: it goes
    assert live(t) == {1, 3, 4}
    t.lookup(k(5))                 # 4 once, 3 twice: 4 goes
    assert live(t) == {1, 3, 5}


def test_a_look_up_larger_than_the_capacity_answers_every_key_consistently():
    t = table(capacity=3)
    out = t.lookup(k(1, 2, 3, 4, 5, 1))
    assert len(t) == 3
    have = live(t)
    for key, row in zip([1, 2, 3, 4, 5, 1], out):
        np.testing.assert_array_equal(row, np.ones(4) if key in have else np.zeros(4))


def test_rows_not_updated_for_max_age_steps_are_evicted_at_that_step():
    t = table(max_age_steps=2)
    t.lookup(k(1, 2))
    g = np.ones((1, 4), np.float32)
    t.apply_gradients(k(1), g)     # step 1: 1 updated at 1, 2 created at step 0
    assert t.expire() == 0 and live(t) == {1, 2}   # 2: 1 step without an update
    t.apply_gradients(k(1), g)     # step 2: 2 is 2 steps old
    assert t.expire() == 1 and live(t) == {1}
    t.apply_gradients(k(3), g)     # step 3 (3 has no row: dropped); 1 is 1 step old
    assert t.expire() == 0
    t.apply_gradients(k(3), g)     # step 4: 1 is 2 steps old
    assert t.expire() == 1 and len(t) == 0 and t.stats.evicted_age == 2


def test_rows_not_updated_for_max_age_seconds_are_evicted():
    clock = Clock()
    t = table(max_age_seconds=10.0, clock=clock)
    t.lookup(k(1, 2))
    clock.now += 9.5
    t.apply_gradients(k(1), np.ones((1, 4), np.float32))
    clock.now += 0.49              # 2 is 9.99 s old
    t.lookup(k(3))
    assert live(t) == {1, 2, 3}
    clock.now += 0.01              # 2 is 10 s old: gone at the next look-up
    t.lookup(k(3))
    assert live(t) == {1, 3}


def test_an_evicted_key_starts_over_admission_and_value_included():
    t = table(min_count=2, capacity=1)
    t.lookup(k(1, 1))
    t.apply_gradients(k(1), np.full((1, 4), 0.5, np.float32))
    np.testing.assert_array_equal(t.lookup(k(1)), [[0.5] * 4])
    t.lookup(k(2, 2))              # evicts 1
    assert live(t) == {2}
    np.testing.assert_array_equal(t.lookup(k(1)), [[0] * 4])   # seen once since: not admitted
    np.testing.assert_array_equal(t.lookup(k(1)), [[1] * 4])   # twice: a fresh row


# -- rows and updates --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random_normal", "truncated_normal", "random_uniform"])
def test_initial_rows_depend_on_seed_and_key_only(kind):
    init = Initializer(kind=kind, mean=0.5, stddev=2.0, minval=-3.0, maxval=1.0, seed=11)
    keys = np.random.default_rng(0).integers(I64.min, I64.max, 4000, dtype=np.int64)
    f32 = np.dtype(np.float32)
    rows = initial_rows(keys, 16, f32, init)
    order = np.random.default_rng(1).permutation(keys.size)
    np.testing.assert_array_equal(initial_rows(keys[order], 16, f32, init), rows[order])
    other = dataclasses.replace(init, seed=12)
    assert np.mean(initial_rows(keys, 16, f32, other) == rows) < 0.01
    # The admission seed (each shard its own) does not change rows.
    a, b = table(initializer=init, seed=1), table(initializer=init, seed=2)
    np.testing.assert_array_equal(a.lookup(keys[:50]), b.lookup(keys[:50][::-1])[::-1])
    if kind == "random_uniform":
        assert rows.min() >= -3.0 and rows.max() <= 1.0 and abs(rows.mean() + 1.0) < 0.05
    else:
        assert abs(rows.mean() - 0.5) < 0.05
        if kind == "random_normal":
            assert abs(rows.std() - 2.0) < 0.05
        else:
            assert np.abs(rows - 0.5).max() <= 4.0 + 1e-6


@pytest.mark.parametrize("optimizer,params", [
    ("sgd", {"learning_rate": 0.1}),
    ("adagrad", {"learning_rate": 0.1}),
    ("adam", {"learning_rate": 0.01}),
    ("momentum", {"learning_rate": 0.1, "momentum": 0.9}),
    ("ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01, "beta": 0.2}),
])
def test_updates_are_the_optimizers_sparse_updates_on_the_keys_rows(optimizer, params):
    """The table's rows change exactly as a fixed table's rows do under the
    same optimizer and the same (summed) row gradients."""
    init = Initializer(kind="random_normal", stddev=0.1, seed=2)
    t = table(dim=8, optimizer=optimizer, params=params, initializer=init)
    keys = k(101, -5, 1 << 50, 9)
    start = t.lookup(keys)
    fixed = start.astype(np.float32).copy()
    opt = make_optimizer(optimizer, params)
    slots = opt.create_slots(fixed)
    rng = np.random.default_rng(3)
    for _ in range(4):
        pick = rng.integers(0, keys.size, 6)
        grads = rng.standard_normal((6, 8)).astype(np.float32)
        t.apply_gradients(keys[pick], grads)
        ids, rows = sum_duplicates(pick, grads)
        opt.apply_sparse(fixed, slots, ids, rows)
    np.testing.assert_array_equal(t.lookup(keys, admit=False), fixed)


def test_bad_input_is_refused_and_changes_nothing():
    t = table(min_count=1)
    t.lookup(k(1, 2))
    before, stats, step = t.export(), dict(vars(t.stats)), t.step
    bad = [
        (lambda: t.lookup(np.array([1.5])), "int64"),
        (lambda: t.lookup(np.array([1], np.uint64)), "int64"),
        (lambda: t.apply_gradients(k(1), np.ones((1, 3), np.float32)), "shape"),
        (lambda: t.apply_gradients(k(1, 2), np.ones((1, 4), np.float32)), "shape"),
        (lambda: t.apply_gradients(k(1), np.full((1, 4), np.nan, np.float32)), "NaN"),
        (lambda: t.apply_gradients(k(1), np.ones((1, 4), np.int32)), "floating"),
    ]
    for call, words in bad:
        with pytest.raises(InvalidArgument, match=words):
            call()
    assert dict(vars(t.stats)) == stats and t.step == step
    for name, arr in t.export().items():
        np.testing.assert_array_equal(arr, before[name])


@pytest.mark.parametrize("change,words", [
    ({"dim": 0}, "dim"), ({"dim": -3}, "dim"), ({"dtype": "int32"}, "dtype"),
    ({"min_count": 0}, "min_count"), ({"probability": 0.0}, "probability"),
    ({"probability": 1.5}, "probability"), ({"capacity": -1}, "capacity"),
    ({"policy": "fifo"}, "policy"), ({"max_age_seconds": float("nan")}, "max_age_seconds"),
    ({"max_age_steps": -2}, "max_age_steps"),
])
def test_bad_table_configs_say_what_to_change(change, words):
    with pytest.raises(InvalidArgument, match=words):
        TableConfig(**{"dim": 4, **change}).check()


def test_memory_per_row_is_the_row_and_its_slots_plus_the_stated_overhead():
    """100k rows of dim 32 under Adagrad (one slot): every array the shard
    holds, per row, within 1.5x of dim x 4 x (1 + slots) plus the 104
    bytes of per-key overhead the module states."""
    t = DynamicTable(TableConfig(dim=32), make_optimizer("adagrad", {}), initial_rows_hint=16)
    keys = np.random.default_rng(0).integers(I64.min, I64.max, 100_000, dtype=np.int64)
    for part in np.array_split(keys, 20):
        t.lookup(part)
    per_row = t.nbytes / len(t)
    assert per_row <= 1.5 * (32 * 4 * 2) + 104, per_row


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_export_then_import_into_other_shards_gives_the_same_rows(optimizer):
    """A table's rows exported, split by shard_of over 3 new shards and
    imported: the same keys, values, slots and ages, bit for bit; trained
    on, they move as the original does."""
    clock = Clock()
    src = table(dim=3, optimizer=optimizer, params={"learning_rate": 0.1}, clock=clock,
                initializer=Initializer(kind="random_normal", seed=4))
    keys = np.random.default_rng(0).integers(I64.min, I64.max, 500, dtype=np.int64)
    src.lookup(keys)
    for i in range(3):
        src.apply_gradients(keys[i::3], np.full((len(keys[i::3]), 3), 0.5 + i, np.float32))
    clock.now += 7.0
    saved = src.export()
    shards = [table(dim=3, optimizer=optimizer, params={"learning_rate": 0.1}, clock=clock,
                    initializer=Initializer(kind="random_normal", seed=4)) for _ in range(3)]
    which = BucketMap.even(3).shard_of(saved["keys"])
    for i, t in enumerate(shards):
        part = {k: (v if v.ndim == 0 else v[which == i]) for k, v in saved.items()}
        assert t.import_rows(part, src.step, reset=True) == int((which == i).sum())
    merged = [t.export() for t in shards]
    order = np.argsort(np.concatenate([m["keys"] for m in merged]))
    for name, want in saved.items():
        got = (merged[0][name] if want.ndim == 0 else
               np.concatenate([m[name] for m in merged])[order])
        np.testing.assert_array_equal(got, want, err_msg=name)
    g = np.ones((4, 3), np.float32)   # one update of the source, one per shard it touches
    src.apply_gradients(keys[:4], g)
    w = BucketMap.even(3).shard_of(keys[:4])
    for i, t in enumerate(shards):
        if (w == i).any():
            t.apply_gradients(keys[:4][w == i], g[w == i])
    got = np.stack([shards[w[j]].lookup(keys[j:j + 1], admit=False)[0] for j in range(4)])
    np.testing.assert_array_equal(got, src.lookup(keys[:4], admit=False))


def test_a_bad_import_is_refused_whole():
    t = table(dim=2)
    t.lookup(k(1, 2))
    before = t.export()
    good = {"keys": k(5, 6), "values": np.ones((2, 2), np.float32),
            "age_steps": np.zeros(2, np.int64), "age_seconds": np.zeros(2),
            "freq": np.ones(2, np.int64)}
    bad = [({**good, "keys": k(5, 5)}, "unique"),
           ({**good, "values": np.ones((2, 3), np.float32)}, "values"),
           ({**good, "values": np.full((2, 2), np.nan, np.float32)}, "NaN"),
           ({**good, "age_steps": np.array([-1, 0])}, "negative"),
           ({**good, "keys": k(1, 7)}, "holds already"),
           ({**good, "bogus": np.zeros(2)}, "unknown")]
    for state, words in bad:
        with pytest.raises(InvalidArgument, match=words):
            t.import_rows(state, 0, reset=False)
    with pytest.raises(InvalidArgument, match="step"):
        t.import_rows({**good, "age_steps": np.array([3, 0])}, 2, reset=False)
    with pytest.raises(InvalidArgument, match="step"):   # would overflow the int64 steps
        t.import_rows(good, 1 << 63, reset=False)
    for name, arr in t.export().items():
        np.testing.assert_array_equal(arr, before[name])
    assert t.import_rows(good, 0, reset=False) == 4


def _same_rows(a: DynamicTable, b: DynamicTable) -> None:
    ea, eb = a.export(), b.export()
    assert ea.keys() == eb.keys()
    for name in ea:
        if name not in ("freq", "age_seconds"):   # look-up counts and clocks are each copy's
            assert ea[name].tobytes() == eb[name].tobytes(), name
    assert a.step == b.step


@pytest.mark.parametrize("optimizer,params,config", [
    ("adagrad", {"learning_rate": 0.1}, dict(capacity=40, policy="lru", min_count=2)),
    ("adam", {"learning_rate": 0.01}, dict(capacity=40, policy="lfu", probability=0.5)),
    ("ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01},
     dict(max_age_steps=3, min_count=3)),
], ids=["adagrad-lru-count", "adam-lfu-probability", "ftrl-age"])
def test_a_backup_following_its_primarys_journal_holds_the_same_rows(optimizer, params, config):
    """Replication (psserver/core/table_copy.py): the backup applies what each of the
    primary's calls changed (rows evicted, rows made, rows updated), never
    deciding itself, and holds the same keys, values, slots and ages to the
    bit after every call, whatever admission and eviction did."""
    init = Initializer(kind="random_normal", stddev=0.1, seed=3)
    primary = table(optimizer=optimizer, params=params, initializer=init, **config)
    backup = table(optimizer=optimizer, params=params, initializer=init, **config)
    rng = np.random.default_rng(7)
    followed = 0
    for i in range(120):
        keys = rng.zipf(1.3, 48).astype(np.int64) % 200
        primary.start_journal()
        if i % 3 == 2:
            grads = rng.normal(size=(keys.size, 4)).astype(np.float32)
            primary.apply_gradients(keys, grads)
            evicted, created, (ukeys, rows) = primary.take_journal()
            assert evicted.size == created.size == 0
            backup.follow_update(ukeys, rows)
        else:
            primary.lookup(keys)
            evicted, created, update = primary.take_journal()
            assert update is None
            followed += bool(evicted.size or created.size)
            backup.follow_rows(evicted, created)
        _same_rows(primary, backup)
    assert followed > 10 and primary.stats.evicted_capacity + primary.stats.evicted_age > 0


def test_a_backup_refuses_changes_that_do_not_fit_it_and_keeps_its_rows():
    """A record that does not fit the copy (a key to evict it lacks, a row to
    make it has, an update for a key without a row) is refused whole (the
    primary then copies its whole state): nothing changes."""
    b = table()
    b.follow_rows(k(), k(1, 2, 3))
    before = b.export()
    for evicted, created in [(k(9), k()), (k(1), k(4, 2)), (k(1, 1), k()), (k(), k(5, 5))]:
        with pytest.raises(InvalidArgument):
            b.follow_rows(evicted, created)
    with pytest.raises(InvalidArgument):
        b.follow_update(k(1, 7), np.ones((2, 4), np.float32))
    with pytest.raises(InvalidArgument):
        b.follow_update(k(1), np.ones((1, 4), np.float64))   # not the table's dtype
    after = b.export()
    assert all(before[n].tobytes() == after[n].tobytes() for n in before) and b.step == 0


def test_a_look_up_of_unique_keys_with_their_counts_is_a_look_up_of_the_whole_batch():
    """coordinator.DynamicEmbedding sends each distinct key once with how
    often it occurs: admission, LFU counts, eviction and statistics come
    out as if the whole batch had been sent."""
    rng = np.random.default_rng(11)
    whole = table(min_count=3, capacity=60, policy="lfu")
    unique = table(min_count=3, capacity=60, policy="lfu")
    for _ in range(30):
        batch = rng.zipf(1.4, 80).astype(np.int64) % 150
        whole.lookup(batch)
        keys, counts = np.unique(batch, return_counts=True)
        unique.lookup(keys, counts=counts)
        a, b = whole.export(), unique.export()
        assert all(a[n].tobytes() == b[n].tobytes() for n in a)   # freq included
        assert whole.stats == unique.stats
    assert whole.stats.evicted_capacity > 0 and whole.stats.not_admitted > 0


@pytest.mark.parametrize("counts", [np.array([1, 0]), np.array([1]), np.array([1.0, 2.0]),
                                    np.array([[1, 1]]), np.array([1, 2**31 + 1])],
                         ids=["zero", "short", "float", "2-D", "huge"])
def test_bad_look_up_counts_are_refused_and_change_nothing(counts):
    t = table(min_count=2)
    t.lookup(k(1, 2))
    before, stats = t.export(), dataclasses.replace(t.stats)
    with pytest.raises(InvalidArgument, match="counts"):
        t.lookup(k(1, 2), counts=counts)
    after = t.export()
    assert all(before[n].tobytes() == after[n].tobytes() for n in before) and t.stats == stats


# -- issue 32, items 1-4, 6, 8, 9: what the docstrings promise ---------------------------------
def test_a_look_up_without_admission_evicts_nothing_by_age_and_reads_old_rows_as_absent():
    """Item 1: ``admit=False`` counts, creates and evicts nothing; a row past
    its age reads as the default row (the next admitting look-up evicts it)."""
    t = table(max_age_steps=1)
    t.lookup(k(1, 2))
    t.apply_gradients(k(1), np.full((1, 4), 0.5, np.float32))   # step 1: 2 is 1 step old
    before, stats = t.export(), dict(vars(t.stats))
    out = t.lookup(k(1, 2), admit=False)
    np.testing.assert_array_equal(out, [[0.5] * 4, [0] * 4])
    assert live(t) == {1, 2} and dict(vars(t.stats)) == stats
    for name, arr in t.export().items():
        np.testing.assert_array_equal(arr, before[name])
    t.lookup(k(1))
    assert live(t) == {1} and t.stats.evicted_age == 1


def test_lfu_counts_the_look_ups_made_before_a_key_had_a_row():
    """Item 2: a new row starts with every look-up of its key so far (in the
    admitting look-up, and before it while it waited for min_count)."""
    t = table(capacity=2, policy="lfu")
    t.lookup(k(*[10] * 5))
    t.lookup(k(11))
    t.lookup(k(11))
    t.lookup(k(12))                 # 10 was looked up 5 times, 11 twice: 11 goes
    assert live(t) == {10, 12}
    t = table(capacity=2, policy="lfu", min_count=2)
    t.lookup(k(1))
    t.lookup(k(1, 1, 1))            # admitted after 4 look-ups
    t.lookup(k(2, 2))
    t.lookup(k(2))                  # 3 look-ups
    t.lookup(k(3, 3))               # 2 (3) goes, not 1 (4)
    assert live(t) == {1, 3}


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_a_look_up_never_evicts_a_key_it_found(policy):
    """Item 3: the rows a look-up hit keep their keys, so their gradients
    are not dropped; new keys get the rows that are left."""
    t = table(capacity=2, policy=policy)
    t.lookup(k(20))
    for _ in range(3):
        t.lookup(k(21))
    out = t.lookup(k(20, 22))       # LFU's victim would be 20 (2 look-ups against 3)
    np.testing.assert_array_equal(out, np.ones((2, 4)))
    assert live(t) == {20, 22}
    out = t.lookup(k(20, 22, 23))   # both hit: 23 gets no row, nothing is evicted
    np.testing.assert_array_equal(out[:, 0], [1, 1, 0])
    assert live(t) == {20, 22} and t.stats.evicted_capacity == 1
    assert t.apply_gradients(k(20, 22, 23), np.ones((3, 4), np.float32)) == 2


@pytest.mark.parametrize("age", [dict(max_age_steps=2), dict(max_age_seconds=10.0)])
def test_a_gradient_for_a_row_past_its_age_is_dropped_and_does_not_revive_it(age):
    """Item 4: a row past its age is gone for updates too, not only at the next look-up."""
    clock = Clock()
    t = table(clock=clock, **age)
    t.lookup(k(1, 2))
    g = np.ones((1, 4), np.float32)
    t.apply_gradients(k(1), g)
    t.apply_gradients(k(1), g)      # step 2: 2 is 2 steps old
    clock.now += 10.0               # and 10 s
    dropped = t.stats.dropped
    assert t.apply_gradients(k(2), g) == 0 and t.stats.dropped == dropped + 1
    t.lookup(k(3))                  # the next look-up evicts 2 (1 too, by seconds)
    assert 2 not in live(t) and t.stats.evicted_age >= 1
    np.testing.assert_array_equal(t.lookup(k(2)), [[1] * 4])   # it starts over


def test_capacity_ties_go_to_the_least_recently_updated_then_to_the_smaller_key():
    """Item 6: as the module docstring says (LRU and LFU alike)."""
    for policy in ("lru", "lfu"):
        t = table(capacity=3, policy=policy)
        t.lookup(k(50, 30, 40))     # one look-up: tied on use and count
        t.apply_gradients(k(50), np.ones((1, 4), np.float32))   # 50 updated at step 1
        t.lookup(k(9))              # 30 and 40 not updated since made: 30 goes
        assert live(t) == {40, 50, 9}, policy
        t.lookup(k(10))             # 40 (step 0) before 50 (step 1)
        assert live(t) == {50, 9, 10}, policy


def test_look_up_counts_saturate_and_a_saved_shard_imports_again():
    """Item 8: a count near the int64 maximum does not wrap negative."""
    t = table()
    t.lookup(k(1))
    state = t.export()
    state["freq"] = np.array([I64.max - 5], np.int64)
    t.import_rows(state, 0, reset=True)
    t.lookup(k(1), counts=np.array([1 << 31]))
    t.lookup(k(1, 1))
    saved = t.export()
    assert saved["freq"][0] > 0
    other = table()
    assert other.import_rows(saved, 0, reset=True) == 1
    np.testing.assert_array_equal(other.export()["freq"], saved["freq"])


def test_a_gradient_beyond_the_tables_dtype_is_refused_and_changes_nothing():
    """Item 9: finite in float64 but not in the float32 table, or repeated
    keys that sum beyond its range: refused whole, nothing applied."""
    t = table()
    t.lookup(k(1, 2))
    before = t.export()
    with pytest.raises(InvalidArgument, match="float32's range"):
        t.apply_gradients(k(1, 2), np.array([[1e300] * 4, [1.0] * 4]))
    with pytest.raises(InvalidArgument, match="sum beyond float32's range"):
        t.apply_gradients(k(1, 1), np.full((2, 4), 3e38, np.float32))
    for name, arr in t.export().items():
        np.testing.assert_array_equal(arr, before[name])
    assert t.step == 0
    assert t.apply_gradients(k(1), np.full((1, 4), 0.25)) == 1   # float64, in range: applied
    np.testing.assert_array_equal(t.lookup(k(1), admit=False), [[0.75] * 4])


# -- issue 32 item 7: eviction in time independent of the shard's size -------------------------
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_large_shard_evicts_the_policys_worst_of_a_sample(policy):
    """Past eviction.EXACT_ROWS a look-up's victims are the worst of a random
    sample of live rows, not of all of them: each is among the least
    recently used (LFU: least often) few percent, never a row just used."""
    n = 4 * eviction.EXACT_ROWS
    t = table(dim=1, capacity=n, policy=policy)
    for lo in range(0, n, 512):   # key i looked up at tick i // 512 + 1 (LFU: once)
        t.lookup(np.arange(lo, lo + 512))
    if policy == "lfu":           # all but the first quarter looked up once more
        t.lookup(np.arange(n // 4, n))
    evicted = set(range(n))
    for r in range(4):
        t.lookup(np.arange(n + 256 * r, n + 256 * (r + 1)))   # 256 new keys each time
        assert len(t) == n
    evicted -= live(t)
    assert len(evicted) == 4 * 256 and t.stats.evicted_capacity == 1024
    assert max(evicted) < n // 4, sorted(evicted)[-5:]   # all from the oldest quarter


def test_rows_past_their_age_are_absent_at_once_and_swept_a_part_per_look_up():
    n = 3 * eviction.SWEEP
    t = table(dim=1, max_age_steps=1)
    for lo in range(0, n, 4096):
        t.lookup(np.arange(lo, lo + 4096))
    t.apply_gradients(k(), np.zeros((0, 1), np.float32))   # step 1: every row 1 step old
    assert len(t) == n and t.stats.evicted_age == 0
    np.testing.assert_array_equal(t.lookup(k(5, n - 1), admit=False), [[0], [0]])
    assert t.apply_gradients(k(5), np.ones((1, 1), np.float32)) == 0   # absent: dropped
    t.lookup(k(n - 1))            # found past its age: evicted now (and made again), plus a sweep
    assert t.stats.evicted_age == eviction.SWEEP + 1 and len(t) == n - eviction.SWEEP
    t.lookup(k(-1))
    t.lookup(k(-2))
    assert t.stats.evicted_age == n and live(t) == {n - 1, -1, -2}


@pytest.mark.parametrize("scale", [1, 8])
def test_the_admission_counter_forgets_the_keys_seen_longest_ago(scale):
    """Past its limit the counter forgets the keys seen longest ago: all of
    them compared in a small counter, the oldest of a sample in a large one
    (in time independent of its size: psserver/core/eviction.py)."""
    n = scale * 1024                 # 1,024 (exact) or 8,192 keys (sampled)
    t = table(dim=1, min_count=3, admission_capacity=n)
    for lo in range(0, n, 256):      # key i seen once, at look-up i // 256 + 1
        t.lookup(np.arange(lo, lo + 256))
    assert t.pending.size == n and len(t) == 0
    t.lookup(np.arange(n, n + 256))  # 256 more: 256 forgotten
    assert t.pending.size == n
    gone = [key for key in range(n) if t.pending.counts(k(key))[0] == 0]
    assert len(gone) == 256
    assert max(gone) < (256 if scale == 1 else n // 4), max(gone)
    t.lookup(k(gone[0], gone[0]))    # forgotten: counted from 0 again (2 < 3)
    assert len(t) == 0
    t.lookup(k(n + 1, n + 1))        # remembered: its third look-up admits it
    assert len(t) == 1
