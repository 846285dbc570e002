"""EmbeddingCollection: a table per feature, declared together, looked up and
updated together (coordinator/embedding_collection.py), on real clusters."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from coordinator import (
    CheckpointManager,
    EmbeddingCollection,
    EmbeddingConfig,
    IndexedSlices,
    LocalCluster,
    ParameterServerStrategy,
    push_gradients,
    read_variables,
)
from coordinator.embedding_collection import feature_salt, groups, keys_in

pytestmark = pytest.mark.timeout(120)

SGD = dict(optimizer="sgd", optimizer_params={"learning_rate": 1.0})
FEATURES = {"user": EmbeddingConfig(dim=4, capacity=100, **SGD),
            "item": EmbeddingConfig(dim=4, capacity=50, **SGD),
            "country": EmbeddingConfig(dim=2, initializer="ones", **SGD)}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_ps=2, num_workers=0) as c:
        yield c


def test_features_of_one_configuration_share_a_table_and_never_each_others_rows(cluster):
    strategy = ParameterServerStrategy(cluster.spec)
    emb = EmbeddingCollection(strategy, "c1", FEATURES)
    assert sorted(emb.features) == ["country", "item", "user"]
    assert len(emb.tables) == 2                       # user + item share one, country its own
    assert emb.table_of("user") is emb.table_of("item")
    assert emb.table_of("user").name == "c1/item"          # a group: its first feature's name
    assert emb.table_of("country").name == "c1/country"
    assert emb.table_of("country").dim == 2
    assert {t.name for t in strategy.tables} == {t.name for t in emb.tables.values()}
    ids = {"user": np.array([1, 2, 1]), "item": np.array([[1, 7]]), "country": np.array([1])}
    w = strategy.create_variable("c1/w", initial_value=np.zeros(3, np.float32), **SGD)
    rows, wv = read_variables([emb.lookup(ids), w])
    assert rows["user"].shape == (3, 4) and rows["item"].shape == (1, 2, 4)
    np.testing.assert_array_equal(rows["country"], np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(wv, np.zeros(3, np.float32))
    # user 1 twice (summed), item 1 once: the same raw id, two features, two rows
    push_gradients([(emb, {"user": IndexedSlices(np.ones((3, 4), np.float32), ids["user"]),
                           "item": IndexedSlices(np.full((1, 2, 4), 3, np.float32),
                                                 ids["item"])}),
                    (w, np.ones(3, np.float32))])
    rows = read_variables([emb.lookup({"user": [1, 2], "item": [1, 7], "country": [1]})])[0]
    np.testing.assert_array_equal(rows["user"], [[-2] * 4, [-1] * 4])
    np.testing.assert_array_equal(rows["item"], [[-3] * 4, [-3] * 4])
    np.testing.assert_array_equal(rows["country"], [[1, 1]])   # no gradient, unchanged
    np.testing.assert_array_equal(w.read(), -np.ones(3, np.float32))
    # where the rows are: the group table, under the feature's qualified keys
    name, keys = keys_in("c1", FEATURES, "item", [1, 7])
    assert name == emb.table_of("item").name
    np.testing.assert_array_equal(keys, np.array([1, 7]) ^ feature_salt("item"))
    np.testing.assert_array_equal(emb.table_of("item").lookup(keys, admit=False), rows["item"])
    # the group's capacity is its features' together; stats sum the groups
    assert _capacities(emb.table_of("user")) == [75, 75]   # 150, per shard
    assert _capacities(emb.table_of("country")) == [0, 0]
    assert emb.stats().rows == 2 + 2 + 1


def _capacities(table):
    from coordinator import ps_pool
    return [ps_pool.servers().client(c.address).table_info(c.table).spec.capacity
            for c in table.primaries()]


def test_admit_false_makes_no_row_and_bad_input_says_what_to_do(cluster):
    strategy = ParameterServerStrategy(cluster.spec)
    emb = EmbeddingCollection(strategy, "c2", FEATURES)
    rows = read_variables([emb.lookup({"user": [5, 6]}, admit=False)])[0]
    np.testing.assert_array_equal(rows["user"], np.zeros((2, 4), np.float32))
    assert emb.stats().rows == 0
    with pytest.raises(KeyError, match="no feature 'age'.*'country', 'item', 'user'"):
        emb.lookup({"age": [1]})
    with pytest.raises(ValueError, match="no features given"):
        emb.lookup({})
    with pytest.raises(ValueError, match="int64"):
        emb.lookup({"user": np.array([1.5])})
    # gradients: a feature's values must be its ids' shape + (dim,), as a table's are
    ids = np.arange(6).reshape(2, 3)
    with pytest.raises(ValueError, match=r"feature 'user': gradient of shape \(3, 2, 4\) for "
                                         r"ids of shape \(2, 3\); .* \(2, 3, 4\)"):
        push_gradients([(emb, {"user": IndexedSlices(np.ones((3, 2, 4), np.float32), ids)})])
    with pytest.raises(TypeError, match="feature 'user': its gradient must be IndexedSlices"):
        push_gradients([(emb, {"user": np.ones((2, 4), np.float32)})])
    with pytest.raises(TypeError, match=r"\{feature: IndexedSlices\(values, ids\)\}"):
        push_gradients([(emb, IndexedSlices(np.ones((2, 4), np.float32), [1, 2]))])
    assert emb.stats().rows == 0                      # nothing of those was applied
    push_gradients([(emb, {"user": IndexedSlices(np.zeros((0, 4), np.float32), []),
                           "country": IndexedSlices(np.ones((1, 2), np.float32), [3])})])
    with pytest.raises(TypeError, match="EmbeddingConfig"):
        EmbeddingCollection(strategy, "c3", {"user": 4})
    with pytest.raises(ValueError, match="dim must be an int >= 1"):
        EmbeddingCollection(strategy, "c3", {"user": EmbeddingConfig(dim=0)})
    with pytest.raises(ValueError, match="has no features"):
        EmbeddingCollection(strategy, "c3", {})
    assert not [t for t in strategy.tables if t.name.startswith("c3/")]


def test_groups_are_a_function_of_the_declarations():
    """A reader of a checkpoint (no cluster) finds the same tables, and a
    change of anything but capacity makes another group."""
    a = {k: sorted(v[1]) for k, v in groups("x", FEATURES).items()}
    b = {k: sorted(v[1]) for k, v in groups("x", dict(reversed(FEATURES.items()))).items()}
    assert a == b and sorted(a.values()) == [["country"], ["item", "user"]]
    other = {**FEATURES, "item": EmbeddingConfig(dim=4, capacity=50, optimizer="sgd",
                                                 optimizer_params={"learning_rate": 0.5})}
    assert len(groups("x", other)) == 3
    assert len(groups("x", {**FEATURES, "item": EmbeddingConfig(dim=4, capacity=7, **SGD)})) == 2
    # the same settings changed for every feature (a new learning rate): the same tables
    slower = {f: dataclasses.replace(c, optimizer_params={"learning_rate": 1})
              for f, c in FEATURES.items()}
    assert set(groups("x", slower)) == set(groups("x", FEATURES)) == {"country", "item"}


def test_a_collection_checkpoints_and_restores_into_another_number_of_servers(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ids = {"user": np.arange(20), "item": np.arange(10), "country": np.arange(3)}
    with LocalCluster(num_ps=2, num_workers=0, checkpoint_dirs=(str(tmp_path),)) as c:
        strategy = ParameterServerStrategy(c.spec)
        emb = EmbeddingCollection(strategy, "ck", FEATURES)
        rows = read_variables([emb.lookup(ids)])[0]
        push_gradients([(emb, {f: IndexedSlices(np.random.default_rng(1).normal(
            size=r.shape).astype(np.float32), ids[f]) for f, r in rows.items()})])
        before = read_variables([emb.lookup(ids, admit=False)])[0]
        CheckpointManager(strategy, ckpt).save(step=1)
    with LocalCluster(num_ps=3, num_workers=0, checkpoint_dirs=(str(tmp_path),)) as c:
        strategy = ParameterServerStrategy(c.spec)
        emb = EmbeddingCollection(strategy, "ck", FEATURES)
        CheckpointManager(strategy, ckpt).restore()
        after = read_variables([emb.lookup(ids, admit=False)])[0]
    for f in ids:
        np.testing.assert_array_equal(after[f], before[f])
        assert (before[f] != 0).any()


def test_a_push_reuses_the_sort_of_every_group_its_step_looked_up(cluster, monkeypatch):
    """The push of a step's row gradients sums them in the order its look-up
    sorted the keys in, for each of the step's tables (not only the last
    looked up): no key is sorted twice in a step of two group tables."""
    from coordinator import step_calls
    strategy = ParameterServerStrategy(cluster.spec)
    emb = EmbeddingCollection(strategy, "c4", FEATURES)
    ids = {"user": np.array([3, 1, 3]), "item": np.array([9, 9]), "country": np.array([2, 7])}
    rows = read_variables([emb.lookup(ids)])[0]
    sorts = []
    real = step_calls.shard_order
    monkeypatch.setattr(step_calls, "shard_order",
                        lambda *a, **k: sorts.append(a[0].name) or real(*a, **k))
    push_gradients([(emb, {f: IndexedSlices(np.ones_like(r), ids[f]) for f, r in rows.items()})])
    assert sorts == []
    after = read_variables([emb.lookup(ids, admit=False)])[0]
    np.testing.assert_array_equal(after["user"][0], rows["user"][0] - 2)   # 3 twice: summed
    np.testing.assert_array_equal(after["item"][0], rows["item"][0] - 2)
    np.testing.assert_array_equal(after["country"], rows["country"] - 1)
    # other keys than those looked up: sorted afresh (and right)
    sorts.clear()
    push_gradients([(emb, {"user": IndexedSlices(np.ones((1, 4), np.float32), [1])})])
    assert sorts == [emb.table_of("user").name]


def test_features_given_as_the_columns_of_one_matrix_read_and_push_as_one_table(cluster):
    """columns(): a batch's (n, k) ids of k features of one group are that
    table's keys (each column qualified as its feature), rows (n, k, dim)
    with no copy per feature: the same rows as the dict look-up gives."""
    from coordinator import Lookup
    strategy = ParameterServerStrategy(cluster.spec)
    emb = EmbeddingCollection(strategy, "c5", FEATURES)
    ids = np.array([[1, 1], [2, 9], [1, 3]])
    table, keys = emb.columns(["user", "item"], ids)
    assert table is emb.table_of("user") and keys.shape == (3, 2)
    np.testing.assert_array_equal(keys[:, 1], emb.qualify("item", ids[:, 1]))
    rows = read_variables([Lookup(table, keys)])[0]
    assert rows.shape == (3, 2, 4)
    push_gradients([(table, IndexedSlices(np.ones((6, 4), np.float32), keys.reshape(-1)))])
    by_dict = read_variables([emb.lookup({"user": ids[:, 0], "item": ids[:, 1]})])[0]
    np.testing.assert_array_equal(by_dict["user"], rows[:, 0] - [[2], [1], [2]])   # 1 twice
    np.testing.assert_array_equal(by_dict["item"], rows[:, 1] - 1)
    with pytest.raises(ValueError, match="one group table.*use lookup"):
        emb.columns(["user", "country"], ids)
    with pytest.raises(ValueError, match="the last axis must be the features'"):
        emb.columns(["user", "item"], ids.T)



def test_a_look_ups_gradients_per_id_reach_each_features_rows(cluster):
    """look.gradients({feature: (n, dim)}) of a per-id look-up: every
    feature's gradients pushed under its own keys, duplicates summed, whether
    all the features looked up are given (their look-up's keys reused) or
    some; a gradient of another shape is a ValueError and pushes nothing."""
    strategy = ParameterServerStrategy(cluster.spec)
    emb = EmbeddingCollection(strategy, "grads", {
        "user": EmbeddingConfig(dim=2, initializer="random_normal", seed=1, **SGD),
        "item": EmbeddingConfig(dim=2, initializer="random_normal", seed=1, **SGD),
        "tag": EmbeddingConfig(dim=3, initializer="random_uniform", seed=2, **SGD)})
    assert len(emb.tables) == 2   # user and item share a group
    ids = {"user": np.array([[5, 6], [5, 7]]), "item": np.array([5, 9]),
           "tag": np.array([1, 1, 2])}
    look = emb.lookup(ids)
    before = read_variables([look])[0]
    g = {f: np.arange(before[f].size, dtype=np.float32).reshape(before[f].shape) / 10
         for f in ids}

    def want(f, grads):
        out = before[f].copy()
        for j, k in enumerate(ids[f].reshape(-1)):   # every occurrence of a key: summed
            out[(ids[f] == k)] -= grads.reshape(-1, before[f].shape[-1])[j]
        return out
    with pytest.raises(ValueError, match="feature 'tag': gradient of shape"):
        look.gradients({**g, "tag": g["tag"][:2]})
    push_gradients(look.gradients(g))   # all of them
    now = read_variables([emb.lookup(ids, admit=False)])[0]
    for f in ids:
        np.testing.assert_allclose(now[f], want(f, g[f]), rtol=1e-6)
    before = now
    push_gradients(look.gradients({"item": g["item"]}))   # one of them
    now = read_variables([emb.lookup(ids, admit=False)])[0]
    np.testing.assert_allclose(now["item"], want("item", g["item"]), rtol=1e-6)
    for f in ("user", "tag"):
        np.testing.assert_array_equal(now[f], before[f])


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_pooled_look_ups_give_each_bag_its_rows_pooled_and_its_gradient_to_its_ids(
        cluster, pooling):
    """lookup(..., pooling=) gives (bags, dim) per feature (Bags with offsets
    and weights, or a matrix of fixed-size bags) in the same read as a
    per-id look-up; the lookup's gradients() give each id its bag's gradient
    (times its weight, over the bag's size for "mean"), applied by the
    servers as SGD at 1 would."""
    from coordinator import Bags
    strategy = ParameterServerStrategy(cluster.spec)
    emb = EmbeddingCollection(strategy, f"pool-{pooling}", {
        "item": EmbeddingConfig(dim=3, initializer="random_normal", seed=4, **SGD),
        "tag": EmbeddingConfig(dim=2, initializer="random_uniform", seed=5, **SGD)})
    items = Bags(np.array([7, 8, 8, 9, 3]), np.array([0, 3, 3]), np.array([1, 2, 3, 4, 5.0]))
    tags = np.array([[1, 2], [2, 2]])
    read_variables([emb.lookup({"item": items.ids, "tag": tags.reshape(-1)})])   # admitted
    rows = read_variables([emb.lookup({"item": items.ids, "tag": tags}, admit=False)])[0]
    item_rows, tag_rows = rows["item"], rows["tag"]           # per id, before
    look = emb.lookup({"item": items, "tag": tags}, pooling=pooling, admit=False)
    pooled = read_variables([look])[0]
    w = items.weights
    mean = pooling == "mean"
    want_items = np.stack([(w[:3, None] * item_rows[:3]).sum(0) / (3 if mean else 1),
                           np.zeros(3), (w[3:, None] * item_rows[3:]).sum(0) / (2 if mean else 1)])
    np.testing.assert_allclose(pooled["item"], want_items, rtol=1e-5)   # bag 1 empty: zeros
    np.testing.assert_allclose(pooled["tag"], tag_rows.reshape(2, 2, 2).sum(1) / (
        2 if mean else 1), rtol=1e-5)
    g_item = np.arange(9, dtype=np.float32).reshape(3, 3)
    g_tag = np.ones((2, 2), np.float32)
    push_gradients(look.gradients({"item": g_item, "tag": g_tag}))
    after = read_variables([emb.lookup({"item": np.array([7, 8, 9, 3]),
                                        "tag": np.array([1, 2])}, admit=False)])[0]
    s = (lambda n: 1 / n) if mean else (lambda n: 1)
    np.testing.assert_allclose(after["item"], np.stack([
        item_rows[0] - g_item[0] * w[0] * s(3),
        item_rows[1] - g_item[0] * (w[1] + w[2]) * s(3),   # 8 twice in bag 0
        item_rows[3] - g_item[2] * w[3] * s(2),
        item_rows[4] - g_item[2] * w[4] * s(2)]), rtol=1e-5)
    np.testing.assert_allclose(after["tag"], np.stack([
        tag_rows[0, 0] - g_tag[0] * s(2), tag_rows[0, 1] - (g_tag[0] + 2 * g_tag[1]) * s(2)]),
        rtol=1e-5)


def test_pooled_look_ups_refuse_what_is_not_bags(cluster):
    from coordinator import Bags
    strategy = ParameterServerStrategy(cluster.spec)
    emb = EmbeddingCollection(strategy, "pool-bad", {"item": EmbeddingConfig(dim=2, **SGD)})
    for bad, words in ((np.array([1, 2]), "matrix"),
                       (Bags(np.array([1, 2]), np.array([1])), "offsets"),
                       (Bags(np.array([1, 2]), np.array([0, 3])), "offsets"),
                       (Bags(np.array([1, 2]), np.array([0]), np.ones(3)), "weights"),
                       (Bags(np.array([1, 2]), np.array([], np.int64)), "ids need one")):
        with pytest.raises(ValueError, match=words):
            emb.lookup({"item": bad}, pooling="sum")
    assert emb.stats().lookups == 0   # refused before anything was sent
    with pytest.raises(ValueError, match="pooling"):
        emb.lookup({"item": np.array([[1]])}, pooling="max")
    empty = read_variables([emb.lookup({"item": Bags([], [])}, pooling="mean")])[0]
    assert empty["item"].shape == (0, 2)
    look = emb.lookup({"item": np.array([[1, 2]])}, pooling="sum")
    with pytest.raises(ValueError, match="1 bags of dim 2"):
        look.gradients({"item": np.ones((2, 2))})
    with pytest.raises(KeyError, match="not looked up"):
        look.gradients({"user": np.ones((1, 2))})
