"""EmbeddingCollection: narrower features padded into the widest table of
their settings (coordinator/embedding_collection.py, groups() and PAD_SHARE):
which features are padded, and that a padded feature trains, checkpoints
and reads exactly as a table of its own width would, on a real cluster."""
from __future__ import annotations

import dataclasses
import re

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
from coordinator.checkpoint_files import CheckpointError
from coordinator.embedding_collection import (
    PAD_SHARE,
    PADDED_INITIALIZERS,
    PADDED_OPTIMIZERS,
    groups,
    lookup_in,
    where,
)

pytestmark = pytest.mark.timeout(120)

ADAGRAD = dict(optimizer="adagrad", optimizer_params={"learning_rate": 0.1})
INIT = Initializer(kind="random_uniform", minval=-1.0, maxval=1.0, seed=3)


def _f(dim: int, capacity: int, **kw) -> EmbeddingConfig:
    return EmbeddingConfig(dim=dim, capacity=capacity, **{"initializer": INIT, **ADAGRAD, **kw})


# padding: tag 50 * (8 - 2) = 300 and item 100 * (8 - 4) = 400, within
# PAD_SHARE (1/8) of user's 8 * 1,000 = 1,000
FEATURES = {"user": _f(8, 1000), "tag": _f(2, 50), "item": _f(4, 100)}


def _tables(features) -> dict:
    """label (a padded one's without its hash) -> (width, features)."""
    out = {}
    for label, g in groups("x", features).items():
        padded = any(features[f].dim != g.dim for f in g.members)
        assert bool(re.fullmatch(rf"{min(g.members)}\.pad{g.dim}-[0-9a-f]{{8}}", label)) \
            if padded else label == min(g.members), label
        out[label.rsplit("-", 1)[0] if padded else label] = (g.dim, sorted(g.members))
    return out


def test_narrower_features_join_the_widest_table_while_their_padding_fits():
    assert PAD_SHARE == 1 / 8
    assert _tables(FEATURES) == {"item.pad8": (8, ["item", "tag", "user"])}
    (label, group), = groups("x", FEATURES).items()
    assert group.members == ["user", "tag", "item"]   # in declaration order
    assert groups("x", dict(reversed(FEATURES.items()))).keys() == {label}
    # cheapest first: with room for 600 of padding, tag (300) joins and item (400) does not
    small = {**FEATURES, "user": _f(8, 600)}
    assert _tables(small) == {"tag.pad8": (8, ["tag", "user"]), "item": (4, ["item"])}
    # exactly the budget still fits (1,000 of 1,000)
    assert len(_tables({**FEATURES, "tag": _f(2, 100)})) == 1
    assert len(_tables({**FEATURES, "tag": _f(2, 101)})) == 2
    # no capacity (unbounded): the padding cannot be bounded
    assert len(_tables({**FEATURES, "user": _f(8, 0)})) == 3
    assert _tables({**FEATURES, "tag": _f(2, 0)}) == {"item.pad8": (8, ["item", "user"]),
                                                      "tag": (2, ["tag"])}
    # other settings than dim and capacity: never in one table
    assert _tables({**FEATURES, "tag": _f(2, 50, min_count=2)}) == {
        "item.pad8": (8, ["item", "user"]), "tag": (2, ["tag"])}
    # narrower features of one width that did not fit keep a table of their width
    assert _tables({**FEATURES, "a": _f(2, 5000), "b": _f(2, 5000)}) == {
        "a": (2, ["a", "b"]), "item.pad8": (8, ["item", "tag", "user"])}


@pytest.mark.parametrize("changed", [
    dict(optimizer="adam", optimizer_params={"learning_rate": 0.1}),   # the table's step count
    dict(optimizer="ftrl", optimizer_params={"learning_rate": 0.1,     # 0 / 0 in the padding
                                             "initial_accumulator_value": 0.0}),
    dict(initializer=Initializer(kind="random_normal", seed=3)),    # pairs across the width
    dict(initializer=Initializer(kind="truncated_normal", seed=3)),
    dict(max_age_steps=10)])                                        # the table's steps
def test_settings_under_which_padding_would_change_a_feature_pad_nothing(changed):
    """Only where a padded feature trains exactly as in a table of its width."""
    declared = {f: dataclasses.replace(c, **changed) for f, c in FEATURES.items()}
    assert _tables(declared) == {f: (c.dim, [f]) for f, c in FEATURES.items()}
    assert {(c.optimizer, c.initializer.kind) for c in FEATURES.values()} == {
        ("adagrad", "random_uniform")} and PADDED_OPTIMIZERS == ("sgd", "momentum", "adagrad")
    assert PADDED_INITIALIZERS == ("zeros", "ones", "constant", "random_uniform")


def test_a_padded_tables_name_changes_with_its_features():
    """A capacity that moves a feature in or out of the padded table renames
    it: a checkpoint or a reader of the other declarations finds no table of
    that name, never the table without the feature's rows."""
    names = [frozenset(groups("x", d)) for d in (
        FEATURES, {**FEATURES, "tag": _f(2, 101)}, {**FEATURES, "item": _f(4, 1000)},
        {**FEATURES, "user": _f(8, 100)})]   # all three, user and item, user and tag, none
    assert len(set(names)) == 4 and names[-1] == {"user", "tag", "item"}
    # the same grouping from other capacities: the same names
    assert names[2] == frozenset(groups("x", {**FEATURES, "user": _f(8, 600)}))
    assert set(groups("x", {**FEATURES, "tag": _f(2, 40)})) == set(groups("x", FEATURES))


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
    initializer, so the same first rows): after Adagrad steps pushed by rows,
    by IndexedSlices and by bags, every feature's rows are bit-identical,
    of its own width, in reads, in a checkpoint and in the table's first
    columns; the feature-wise calls a padded table cannot take say why; a
    restore or a reader of declarations that pad other features finds no
    table of the padded one's name, never its table without their rows."""
    strategy = ParameterServerStrategy(cluster.spec)
    emb = EmbeddingCollection(strategy, "pad", FEATURES)
    alone = {f: EmbeddingCollection(strategy, f"alone-{f}", {f: c}) for f, c in FEATURES.items()}
    (table,) = emb.tables.values()
    assert re.fullmatch(r"pad/item\.pad8-[0-9a-f]{8}", table.name) and table.dim == 8
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
    at = where("pad", FEATURES)
    for f in FEATURES:
        np.testing.assert_array_equal(lookup_in(checkpoint, "pad", FEATURES, f, ids[f]),
                                      final[f])
        assert at[f][0] == table.name and at[f][2] == FEATURES[f].dim
    # declarations that pad other features (tag's capacity: out of the padded
    # table), and back: no table of the padded one's name, never it without tag
    apart = {**FEATURES, "tag": _f(2, 101)}
    with pytest.raises(KeyError):
        lookup_in(checkpoint, "pad", apart, "user", ids["user"])
    other = ParameterServerStrategy(cluster.spec)
    _step(EmbeddingCollection(other, "pad2", apart), ids, 0, "rows")
    path = CheckpointManager(other, f"{cluster.ckpt}/ck2").save(step=1)
    with pytest.raises(KeyError):
        lookup_in(read_checkpoint(path), "pad2", FEATURES, "tag", ids["tag"])
    with LocalCluster(num_ps=1, num_workers=0, checkpoint_dirs=(cluster.ckpt,)) as fresh:
        into = ParameterServerStrategy(fresh.spec)
        EmbeddingCollection(into, "pad2", FEATURES)
        with pytest.raises(CheckpointError, match=r"dynamic table 'pad2/item\.pad8-[0-9a-f]{8}"
                                                  r"' is not in checkpoint .*: an Embedding"
                                                  r"Collection's padded table.*capacity=0"):
            CheckpointManager(into, f"{cluster.ckpt}/ck2").restore()
    with pytest.raises(ValueError, match=r"\['tag'\] are padded into a wider one: use lookup"):
        emb.columns(["user", "tag"], np.array([[1, 2]]))
    with pytest.raises(ValueError, match=r"feature 'tag': gradient of shape \(2, 2, 8\) .* "
                                         r"\(2, 2, 2\)"):
        push_gradients([(emb, {"tag": IndexedSlices(np.ones((2, 2, 8), np.float32),
                                                    ids["tag"])})])
    np.testing.assert_array_equal(read_variables([emb.lookup(ids, admit=False)])[0]["tag"],
                                  final["tag"])   # refused: nothing applied
