"""EmbeddingCollection: narrower features padded into the widest table of
their settings (coordinator/embedding_collection.py, groups() and PAD_SHARE):
which features are padded, and that a padded feature trains, checkpoints
and reads exactly as a table of its own width would, on a real cluster."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import (
    Bags,
    CheckpointManager,
    EmbeddingCollection,
    EmbeddingConfig,
    IndexedSlices,
    Initializer,
    LocalCluster,
    ParameterServerStrategy,
    push_gradients,
    read_variables,
)
from coordinator.embedding_collection import PAD_SHARE, groups, lookup_in

pytestmark = pytest.mark.timeout(120)

ADAM = dict(optimizer="adam", optimizer_params={"learning_rate": 0.1})
INIT = Initializer(kind="random_uniform", minval=-1.0, maxval=1.0, seed=3)


def _f(dim: int, capacity: int, **kw) -> EmbeddingConfig:
    return EmbeddingConfig(dim=dim, capacity=capacity, **{"initializer": INIT, **ADAM, **kw})


# padding: tag 50 * (8 - 2) = 300 and item 100 * (8 - 4) = 400, within
# PAD_SHARE (1/8) of user's 8 * 1,000 = 1,000
FEATURES = {"user": _f(8, 1000), "tag": _f(2, 50), "item": _f(4, 100)}


def _tables(features) -> dict:
    return {label: (g.dim, sorted(g.members)) for label, g in groups("x", features).items()}


def test_narrower_features_join_the_widest_table_while_their_padding_fits():
    assert PAD_SHARE == 1 / 8
    assert _tables(FEATURES) == {"item": (8, ["item", "tag", "user"])}
    assert list(groups("x", FEATURES)["item"].members) == ["user", "tag", "item"]   # declared
    assert _tables(dict(reversed(FEATURES.items()))) == _tables(FEATURES)
    # cheapest first: with room for 600 of padding, tag (300) joins and item (400) does not
    small = {**FEATURES, "user": _f(8, 600)}
    assert _tables(small) == {"tag": (8, ["tag", "user"]), "item": (4, ["item"])}
    # exactly the budget still fits (1,000 of 1,000)
    assert len(_tables({**FEATURES, "tag": _f(2, 100)})) == 1
    assert len(_tables({**FEATURES, "tag": _f(2, 101)})) == 2
    # no capacity (unbounded): the padding cannot be bounded
    assert len(_tables({**FEATURES, "user": _f(8, 0)})) == 3
    assert _tables({**FEATURES, "tag": _f(2, 0)}) == {"item": (8, ["item", "user"]),
                                                      "tag": (2, ["tag"])}
    # other settings than dim and capacity: never in one table
    assert _tables({**FEATURES, "tag": _f(2, 50, min_count=2)}) == {
        "item": (8, ["item", "user"]), "tag": (2, ["tag"])}
    # narrower features of one width that did not fit keep a table of their width
    assert _tables({**FEATURES, "a": _f(2, 5000), "b": _f(2, 5000)}) == {
        "a": (2, ["a", "b"]), "item": (8, ["item", "tag", "user"])}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("padding"))
    with LocalCluster(num_ps=2, num_workers=0, checkpoint_dirs=(ckpt,)) as c:
        c.ckpt = ckpt
        yield c


def _step(emb, ids, seed, how):
    """One step of look-up and push, each feature's gradient from (``seed``,
    the feature), pushed ``how``: "rows" (look.gradients), "slices" (by
    feature, as IndexedSlices: EmbeddingCollection.gradients) or "bags" (each feature's ids as
    two bags, pooled by mean; the look-up's gradients). Returns the rows
    read (before the push)."""
    if how == "bags":
        look = emb.lookup({f: Bags(i.reshape(-1), np.array([0, 1])) for f, i in ids.items()},
                          pooling="mean")
    else:
        look = emb.lookup(ids)
    got = read_variables([look])[0]
    grads = {f: np.random.default_rng([seed, list(FEATURES).index(f)]).normal(
        size=r.shape).astype(np.float32) for f, r in got.items()}
    push_gradients(look.gradients(grads) if how != "slices" else
                   [(emb, {f: IndexedSlices(grads[f], ids[f]) for f in ids})])
    return got


def test_a_padded_feature_trains_checkpoints_and_reads_as_a_table_of_its_width(cluster):
    """The padded collection against three collections of one feature each
    (tables of each feature's own width; the same qualified keys and
    initializer, so the same first rows): after Adam steps pushed by rows,
    by IndexedSlices and by bags, every feature's rows are bit-identical,
    of its own width, in reads, in a checkpoint and in the table's first
    columns; the feature-wise calls a padded table cannot take say why."""
    strategy = ParameterServerStrategy(cluster.spec)
    emb = EmbeddingCollection(strategy, "pad", FEATURES)
    alone = {f: EmbeddingCollection(strategy, f"alone-{f}", {f: c}) for f, c in FEATURES.items()}
    (table,) = emb.tables.values()
    assert (table.name, table.dim) == ("pad/item", 8)
    assert [alone[f].table_of(f).dim for f in FEATURES] == [8, 2, 4]
    assert [emb.dim_of(f) for f in FEATURES] == [8, 2, 4]
    ids = {"user": np.array([3, 1, 3]), "tag": np.array([[7, 7], [2, 9]]),
           "item": np.array([4, 5])}
    for seed, how in enumerate(["rows", "rows", "slices", "bags", "rows"]):
        got = _step(emb, ids, seed, how)
        for f in FEATURES:
            want = _step(alone[f], {f: ids[f]}, seed, how)[f]
            shape = (2,) if how == "bags" else ids[f].shape
            assert got[f].shape == want.shape == shape + (FEATURES[f].dim,)
            np.testing.assert_array_equal(got[f], want, err_msg=f"step {seed} ({how}) {f}")
    final = read_variables([emb.lookup(ids, admit=False)])[0]
    for f in FEATURES:
        mine = read_variables([alone[f].lookup({f: ids[f]}, admit=False)])[0][f]
        np.testing.assert_array_equal(final[f], mine)
        assert final[f].shape == ids[f].shape + (FEATURES[f].dim,)
        wide = table.lookup(emb.qualify(f, ids[f]), admit=False)
        np.testing.assert_array_equal(wide[..., :FEATURES[f].dim], final[f])
    # a checkpoint reads each feature at its width (keys_in's table, cut by lookup_in)
    from coordinator.evaluation import read_checkpoint
    path = CheckpointManager(strategy, f"{cluster.ckpt}/ck").save(step=1)
    checkpoint = read_checkpoint(path)
    for f in FEATURES:
        np.testing.assert_array_equal(lookup_in(checkpoint, "pad", FEATURES, f, ids[f]),
                                      final[f])
    with pytest.raises(ValueError, match=r"\['tag'\] are padded into a wider one: use lookup"):
        emb.columns(["user", "tag"], np.array([[1, 2]]))
    with pytest.raises(ValueError, match=r"feature 'tag': gradient of shape \(2, 2, 8\) .* "
                                         r"\(2, 2, 2\)"):
        push_gradients([(emb, {"tag": IndexedSlices(np.ones((2, 2, 8), np.float32),
                                                    ids["tag"])})])
    np.testing.assert_array_equal(read_variables([emb.lookup(ids, admit=False)])[0]["tag"],
                                  final["tag"])   # refused: nothing applied
