"""Embedding tables declared together, one per feature, looked up and
updated together: one call per parameter server for all of them.

A recommendation model usually has a table per categorical feature, each
with its own dimension, initializer, optimizer, admission and eviction (as
TorchRec's ``EmbeddingCollection`` of ``EmbeddingConfig``s, or one Keras
``Embedding`` per feature)::

    emb = EmbeddingCollection(strategy, "ctr", {
        "user": EmbeddingConfig(dim=32, optimizer="adagrad", min_count=2, capacity=10_000_000),
        "item": EmbeddingConfig(dim=32, optimizer="adagrad", min_count=2, capacity=1_000_000),
        "country": EmbeddingConfig(dim=8)})

    def step(it):                                     # on a worker
        ids = next(it)                                # {"user": (n,), "item": (n,), ...}
        rows, w = read_variables([emb.lookup(ids), w_var])   # rows: {feature: (n, dim)}
        ...
        push_gradients([(emb, {f: IndexedSlices(grads[f], ids[f]) for f in ids}),
                        (w_var, dw)])

How: features whose configurations are equal but for ``capacity`` share
one dynamic table on the servers (a *group*, named ``NAME/<its first
feature by name>``); so do narrower ones of the same settings, padded into
the widest's table (named ``<first>.pad<dim>-<hash of its features>``)
where that changes no value until the table evicts (element-wise
optimizers without a step count, initializers whose first columns do not
depend on the width; the group's rows are evicted over all its features,
as a group of one width's are), every
feature involved has a capacity and the padding costs at most
``PAD_SHARE`` (1/8) of the widest features' rows (``groups``: one table,
so one look-up per server, instead of one per width; a padded feature's
rows are the table's first ``dim`` columns, the others never read and
zero in every gradient). Each feature's keys are qualified by the library:
XORed with a 64-bit hash of the feature's name (``qualify``). That is a
bijection per feature, so one feature's keys never collide with each other;
two features' keys meet only where ``k1 ^ k2`` equals the XOR of their two
hashes, which ids of the usual kinds (small integers, hashes of strings:
about n^2 / 2^64 pairs) do not. A step's look-ups of every feature of a
group are one look-up of the group's table (each distinct qualified key
once), riding the same call to each server as the step's dense reads; its
row gradients likewise. A group's capacity is the sum of its features'
(0, unbounded, if any feature's is): rows are evicted over the group by its
policy, whichever feature they belong to. Everything a dynamic table has,
a group has: checkpoints, exports, replication, sync steps, the operator
tools (which list the groups); ``lookup_in`` reads a feature's rows from a
checkpoint or a serving copy, found from the declarations alone
(``lookup_in(snapshot, "ctr", features, "user", ids)``; ``where`` and
``keys_in``: where they are).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from coordinator.embedding import DynamicEmbedding, TableStats
from coordinator.step_calls import IndexedSlices, Lookup
from psserver.contract import Initializer
from psserver.contract.keys import check_keys, mix64


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
    """One feature's table (the arguments of
    ``ParameterServerStrategy.create_embedding_table``, which says what each does)."""
    dim: int
    dtype: str = "float32"
    initializer: Initializer | str | None = None
    optimizer: str = "sgd"
    optimizer_params: Mapping[str, float] | None = None
    min_count: int = 1
    probability: float = 1.0
    capacity: int = 0
    policy: str = "lru"
    max_age_steps: int = 0
    max_age_seconds: float = 0.0
    seed: int = 0

    def table_args(self) -> dict:
        """create_embedding_table's keyword arguments but capacity, normalized
        (what features must share to share a table)."""
        init = self.initializer
        if init is None or isinstance(init, str):
            init = Initializer(kind=init or "zeros", seed=self.seed)
        return dict(dtype=np.dtype(self.dtype).name, initializer=init,
                    optimizer=self.optimizer,
                    optimizer_params=dict(sorted((self.optimizer_params or {}).items())),
                    min_count=self.min_count, probability=self.probability,
                    policy=self.policy, max_age_steps=self.max_age_steps,
                    max_age_seconds=self.max_age_seconds, seed=self.seed)


def feature_salt(feature: str) -> np.int64:
    """The 64 bits a feature's keys are XORed with (a function of its name alone)."""
    digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
    return mix64(np.frombuffer(digest, np.uint64))[0].view(np.int64)


#: Narrower features join the widest table of their settings, padded to its
#: width, while the padding costs at most this share of that table's rows
#: (by capacity): one table instead of one per width.
PAD_SHARE = 1 / 8
#: Settings under which a padded feature trains exactly as in a table of its
#: own width: optimizers whose update of an element depends on that element
#: alone and has no step count (a zero gradient leaves it as it is: Adam
#: counts the table's steps, FTRL divides 0 by 0 at a zero accumulator),
#: initializers whose first columns do not depend on the width (a normal's
#: pairs do), and no age in table steps.
PADDED_OPTIMIZERS = ("sgd", "momentum", "adagrad")
#: A padded table's name ends so (``groups``: ``<first>.pad<dim>-<hash>``).
PADDED_NAME = re.compile(r"\.pad\d+-[0-9a-f]{8}$")
PADDED_INITIALIZERS = ("zeros", "ones", "constant", "random_uniform")


class Group(NamedTuple):
    """A group table: create_embedding_table's arguments but dim and
    capacity, its features (in declaration order) and its width (the widest
    feature's; a narrower feature's rows are its first ``dim`` columns)."""
    args: dict
    members: list
    dim: int


def groups(name: str, features: Mapping[str, EmbeddingConfig]) -> dict[str, Group]:
    """group label -> Group: features whose arguments are equal but for
    capacity share a group, whose table is ``NAME/<label>``, the label being
    its first feature by name (so a change of settings that keeps the
    grouping, a learning rate of every feature, keeps the table's name: a
    restore or a restart finds it). Features of the widest dim of such
    settings take narrower ones into their group, padded (their rows the
    table's first columns, zero gradients for the others), where the
    settings are PADDED_OPTIMIZERS', PADDED_INITIALIZERS' and without
    max_age_steps (so a padded feature trains exactly as in a table of its
    width until the table evicts: rows are evicted over the whole group, as
    a group of one width's are), every feature involved has a capacity, and the padding
    (capacity times the missing columns, cheapest first) stays within
    ``PAD_SHARE`` of the widest features' rows; the others make a group per
    dim. A padded group's label also names its width and features
    (``<first>.pad<dim>-<hash>``), so a checkpoint or a reader of other
    declarations (a capacity that moved a feature in or out) finds no table
    of that name rather than one without the feature's rows. A function of
    the declarations alone: a reader of a checkpoint finds a feature's
    table without a cluster (``keys_in``)."""
    if not features:
        raise ValueError(f"embedding collection {name!r} has no features")
    found: list[tuple[dict, dict[int, list[str]]]] = []   # args -> {dim: features}
    for feature, config in features.items():
        if not isinstance(config, EmbeddingConfig):
            raise TypeError(f"feature {feature!r}: an EmbeddingConfig, got {config!r}")
        if not isinstance(config.dim, int) or config.dim < 1:
            raise ValueError(f"feature {feature!r}: dim must be an int >= 1, got "
                             f"{config.dim!r}")
        args = config.table_args()
        for other, by_dim in found:
            if other == args:
                by_dim.setdefault(config.dim, []).append(feature)
                break
        else:
            found.append((args, {config.dim: [feature]}))
    salts = [feature_salt(f) for f in features]
    if len(set(salts)) != len(salts):   # two names of one 64-bit hash: refuse, never mix
        raise ValueError(f"embedding collection {name!r}: two feature names hash alike; "
                         "rename one")
    order = {f: i for i, f in enumerate(features)}
    out = {}
    for args, by_dim in found:
        for dim, members in (_padded(by_dim, features) if _paddable(args) else by_dim).items():
            members = sorted(members, key=order.__getitem__)
            label = min(members)
            if any(features[f].dim != dim for f in members):
                digest = hashlib.blake2b(repr(sorted((f, features[f].dim) for f in members))
                                         .encode(), digest_size=4).hexdigest()
                label = f"{label}.pad{dim}-{digest}"
            out[label] = Group(args, members, dim)
    return out


def _paddable(args: dict) -> bool:
    return args["optimizer"].strip().lower() in PADDED_OPTIMIZERS and \
        args["initializer"].kind in PADDED_INITIALIZERS and not args["max_age_steps"]


def _padded(by_dim: dict[int, list[str]], features: Mapping[str, EmbeddingConfig]
            ) -> dict[int, list[str]]:
    """Features of one set of arguments by dim -> by their table's width:
    the narrower ones that fit groups()'s rule moved to the widest."""
    wide = max(by_dim)
    capacity = {f: features[f].capacity for fs in by_dim.values() for f in fs}
    out = {dim: [] for dim in by_dim}
    out[wide] = list(by_dim[wide])
    budget = PAD_SHARE * wide * sum(capacity[f] for f in out[wide]) \
        if all(capacity[f] > 0 for f in out[wide]) else 0
    for cost, f, dim in sorted((capacity[f] * (wide - dim), f, dim)
                               for dim, fs in by_dim.items() if dim != wide for f in fs):
        if capacity[f] > 0 and cost <= budget:
            budget -= cost
            out[wide].append(f)
        else:
            out[dim].append(f)
    return {dim: fs for dim, fs in out.items() if fs}


def where(name: str, features: Mapping[str, EmbeddingConfig]
          ) -> dict[str, tuple[str, np.int64, int]]:
    """feature -> (its table's name, the salt its keys are XORed with there,
    its width): where a checkpoint or a serving copy holds each feature's
    rows (the first ``width`` columns of the table's), from the declarations
    alone. Work it out once for many look-ups (``lookup_in`` does it each call)."""
    return {f: (f"{name}/{label}", feature_salt(f), features[f].dim)
            for label, group in groups(name, features).items() for f in group.members}


def keys_in(name: str, features: Mapping[str, EmbeddingConfig], feature: str,
            keys) -> tuple[str, np.ndarray]:
    """(table name, keys there) of ``feature``'s ``keys``: where a checkpoint
    or a serving copy holds their rows (``snapshot.lookup(*keys_in(...))``
    gives rows of the table's width; a feature padded into a wider table is
    their first ``dim`` columns: ``lookup_in`` cuts them)."""
    found = where(name, features).get(feature)
    if found is None:
        raise KeyError(f"embedding collection {name!r} has no feature {feature!r}")
    return found[0], check_keys(keys) ^ found[1]


def lookup_in(reader, name: str, features: Mapping[str, EmbeddingConfig], feature: str,
              ids) -> np.ndarray:
    """``feature``'s rows of ``ids`` (ids.shape + (its dim,)) from a
    checkpoint or a serving copy (``reader.lookup(table, keys)``), found
    from the declarations alone (keys_in)."""
    rows = reader.lookup(*keys_in(name, features, feature, ids))
    return rows[..., :features[feature].dim]


class EmbeddingCollection:
    """See the module. ``features``: feature name -> EmbeddingConfig. The
    group tables are created on the strategy's servers (or adopted, as
    create_embedding_table adopts a table made with the same arguments)."""

    def __init__(self, strategy, name: str, features: Mapping[str, EmbeddingConfig]):
        self.name = name
        self.tables: dict[str, DynamicEmbedding] = {}   # group label -> its table
        self._where: dict[str, tuple[str, np.int64]] = {}   # feature -> (group, salt)
        made = groups(name, features)   # (features checked)
        self._dims = {f: c.dim for f, c in features.items()}   # (a table may be wider)
        for label, (args, members, dim) in made.items():
            caps = [features[f].capacity for f in members]
            self.tables[label] = strategy.create_embedding_table(
                f"{name}/{label}", dim, capacity=0 if 0 in caps else sum(caps), **args)
            for f in members:
                self._where[f] = (label, feature_salt(f))

    @property
    def features(self) -> list[str]:
        return list(self._where)

    def table_of(self, feature: str) -> DynamicEmbedding:
        """The table holding ``feature``'s rows (its group's; it may be wider:
        the feature's rows are its first ``dim_of(feature)`` columns)."""
        return self.tables[self._group(feature)]

    def dim_of(self, feature: str) -> int:
        """``feature``'s width (its rows' and gradients' last dimension)."""
        self._group(feature)
        return self._dims[feature]

    def qualify(self, feature: str, keys) -> np.ndarray:
        """``feature``'s keys as its group's table holds them (int64)."""
        self._group(feature)
        return check_keys(keys) ^ self._where[feature][1]

    def lookup(self, ids: Mapping[str, Any], *, admit: bool = True,
               pooling: str | None = None) -> "CollectionLookup":
        """An item for read_variables, whose value is {feature: rows of
        ``ids[feature]``, shape ids.shape + (dim,)}, for the features given
        (any subset). ``admit=False`` (evaluation): nothing counted, created
        or evicted. ``pooling`` "sum" or "mean": each feature's ids are bags
        (``Bags(ids, offsets, weights)``, or ids (B, n): B bags of n), and
        its value is the bags' rows pooled, (B, dim), as TorchRec's
        EmbeddingBagCollection gives them; ``lookup.gradients({feature:
        (B, dim)})`` turns the bags' gradients into the rows' for
        push_gradients. Each distinct key's row crosses the wire once
        either way (pooled here, on the worker)."""
        if pooling not in (None, "sum", "mean"):
            raise ValueError(f"pooling must be None, 'sum' or 'mean', got {pooling!r}")
        bags = {f: Bags.of(v, f) for f, v in ids.items()} if pooling else None
        groups = self._by_group({f: b.ids for f, b in bags.items()} if bags else ids,
                                lambda f, k: k.shape)
        return CollectionLookup(self, groups, admit, bags, pooling)

    def columns(self, features: Sequence[str], ids) -> tuple[DynamicEmbedding, np.ndarray]:
        """For ids that come as a matrix, a column per feature (``ids[..., j]``
        of ``features[j]``, as a Criteo batch's (n, 26)) whose features share
        one group: (that table, the keys there, of ids' shape). Read and push
        them as that one table's, with no copy per feature:
        ``read_variables([Lookup(table, keys), ...])`` gives rows of
        ids.shape + (dim,); ``push_gradients([(table, IndexedSlices(
        grads.reshape(-1, dim), keys.reshape(-1)))])``. ValueError if the
        features are of several groups, or padded into a wider table."""
        labels = {self._group(f) for f in features}
        if len(labels) != 1:
            raise ValueError(f"columns() takes features of one group table; {list(features)} "
                             f"are in {sorted(labels)}: use lookup() with a dict")
        narrow = [f for f in features if self._dims[f] != self.table_of(f).dim]
        if narrow:
            raise ValueError(f"columns() takes features as wide as their table; {narrow} are "
                             "padded into a wider one: use lookup() with a dict")
        keys = check_keys(ids)
        if keys.ndim < 1 or keys.shape[-1] != len(features):
            raise ValueError(f"ids of shape {keys.shape} for {len(features)} features: the "
                             f"last axis must be the features'")
        salts = np.array([self._where[f][1] for f in features], np.int64)
        return self.tables[labels.pop()], keys ^ salts

    def gradients(self, grads: Mapping[str, IndexedSlices]) -> list[tuple]:
        """push_gradients' pairs for row gradients by feature
        (``IndexedSlices(values, keys)``, values of shape keys.shape + (dim,)):
        one (group table, IndexedSlices) per group."""
        if not isinstance(grads, Mapping):
            raise TypeError(f"the gradients of embedding collection {self.name!r} are "
                            "{feature: IndexedSlices(values, ids)}, got "
                            f"{type(grads).__name__}")
        for f, g in grads.items():
            if not isinstance(g, IndexedSlices):
                raise TypeError(f"feature {f!r}: its gradient must be IndexedSlices(values, "
                                f"ids), got {type(g).__name__}")

        def values(f: str, q: np.ndarray) -> np.ndarray:
            return self._gradient_rows(f, grads[f].values, q.shape)
        out = []
        for label, (keys, members) in self._by_group({f: g.indices for f, g in grads.items()},
                                                     values).items():
            table = self.tables[label]
            out.append((table, IndexedSlices(_stacked([v for *_, v in members], table.dim),
                                             keys)))
        return out

    def _gradient_rows(self, feature: str, values, shape: tuple) -> np.ndarray:
        """``feature``'s gradient for ids of ``shape`` as rows (n, its dim),
        checked: ValueError naming the feature."""
        v, dim = np.asarray(values), self._dims[feature]
        if v.shape != shape + (dim,):
            raise ValueError(f"feature {feature!r}: gradient of shape {v.shape} for ids of "
                             f"shape {shape}; it must be ids.shape + (dim,) = "
                             f"{shape + (dim,)}")
        return v.reshape(-1, dim)

    #: push_gradients expands ``(collection, {feature: IndexedSlices})`` with this.
    expand_push = gradients

    def stats(self) -> TableStats:
        """Counters summed over the group tables (features of a group share
        theirs: ``{label: t.stats() for label, t in emb.tables.items()}``)."""
        each = [t.stats() for t in self.tables.values()]
        return TableStats(**{f.name: sum(getattr(x, f.name) for x in each)
                             for f in dataclasses.fields(TableStats)})

    def _group(self, feature: str) -> str:
        try:
            return self._where[feature][0]
        except KeyError:
            raise KeyError(f"embedding collection {self.name!r} has no feature {feature!r}; "
                           f"it has {sorted(self._where)}") from None

    def _by_group(self, ids: Mapping[str, Any], extra) -> dict[str, tuple]:
        """group label -> (its features' qualified keys one after another,
        [(feature, its qualified keys: a view of those, extra(feature, keys))])."""
        if not ids:
            raise ValueError("no features given")
        given: dict[str, list[tuple]] = {}
        for feature, keys in ids.items():
            given.setdefault(self._group(feature), []).append((feature, check_keys(keys)))
        out = {}
        for label, members in given.items():   # qualified in one pass (a copy: theirs kept)
            flat = np.concatenate([k.reshape(-1) for _, k in members]) ^ np.repeat(
                np.array([self._where[f][1] for f, _ in members], np.int64),
                [k.size for _, k in members])
            at, views = 0, []
            for feature, k in members:
                q = flat[at:at + k.size].reshape(k.shape)
                views.append((feature, q, extra(feature, q)))
                at += k.size
            out[label] = (flat, views)
        return out


@dataclasses.dataclass(frozen=True)
class Bags:
    """A feature's bags for a pooled look-up: ``ids`` 1-D, bag i being
    ``ids[offsets[i]:offsets[i + 1]]`` (the last to the end; an empty bag
    pools to zeros), each id's row times ``weights`` (same length, optional),
    as ``nn.EmbeddingBag`` takes them. ``Bags.of`` also takes ids (B, n)."""
    ids: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None = None

    @classmethod
    def of(cls, value, feature: str = "") -> "Bags":
        """``value`` as Bags (a Bags, or ids (B, n): B bags of n); ValueError
        saying what is wrong (``feature`` names it)."""
        if not isinstance(value, Bags):
            ids = check_keys(value)
            if ids.ndim != 2:
                raise ValueError(f"feature {feature!r}: pooled ids are Bags(ids, offsets) or "
                                 f"a matrix (bags, ids per bag); got shape {ids.shape}")
            return cls(ids.reshape(-1), np.arange(0, ids.size, max(1, ids.shape[1]))
                       if ids.shape[1] else np.zeros(ids.shape[0], np.int64))
        ids, offsets = check_keys(value.ids), np.asarray(value.offsets)
        if offsets.size == 0 and offsets.dtype.kind == "f":   # [] : no bags
            offsets = offsets.astype(np.int64)
        weights = None if value.weights is None else np.asarray(value.weights, np.float32)
        if ids.ndim != 1 or offsets.ndim != 1 or offsets.dtype.kind not in "iu" or (
                offsets.size and (offsets[0] != 0 or (np.diff(offsets) < 0).any()
                                  or offsets[-1] > ids.size)) or (
                not offsets.size and ids.size) or (
                weights is not None and weights.shape != ids.shape):
            raise ValueError(f"feature {feature!r}: Bags take ids 1-D, offsets 1-D integers "
                             "from 0 (a bag per offset; ids need one), non-decreasing, within "
                             "the ids, and weights (optional) one per id")
        return cls(ids, offsets.astype(np.int64), weights)

    def segments(self) -> np.ndarray:
        """The bag of each id."""
        return np.repeat(np.arange(self.offsets.size),
                         np.diff(np.append(self.offsets, self.ids.size)))

    def pool(self, rows: np.ndarray, mode: str) -> np.ndarray:
        """Rows (one per id) pooled per bag: (bags, dim)."""
        w = self.scale(mode)
        out = np.zeros((self.offsets.size, rows.shape[-1]), rows.dtype)
        np.add.at(out, self.segments(), rows if w is None else rows * w[:, None])
        return out

    def scale(self, mode: str) -> np.ndarray | None:
        """Each id's factor in its bag's pool (weights; "mean": over the bag's size)."""
        if mode != "mean":
            return self.weights
        sizes = np.diff(np.append(self.offsets, self.ids.size))
        per = (1.0 / np.maximum(sizes, 1))[self.segments()].astype(np.float32)
        return per if self.weights is None else per * self.weights


class CollectionLookup:
    """A collection's look-up as read_variables takes it: ``parts``, one
    Lookup per group table (its features' qualified keys in one array), and
    ``fold`` (their rows -> {feature: rows}, pooled per bag with ``pooling``)."""

    def __init__(self, collection: EmbeddingCollection, groups: dict[str, tuple],
                 admit: bool, bags: "dict[str, Bags] | None" = None,
                 pooling: str | None = None):
        self._collection, self._bags, self._pooling = collection, bags, pooling
        self._groups = [(label, members) for label, (_, members) in groups.items()]
        self.parts = [Lookup(collection.tables[label], keys, admit)
                      for label, (keys, _) in groups.items()]

    def fold(self, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for (_, members), got in zip(self._groups, rows):
            at = 0
            for feature, q, shape in members:
                dim = self._collection._dims[feature]
                mine = got[at:at + q.size, :dim].reshape(shape + (dim,))
                out[feature] = mine if self._bags is None else \
                    self._bags[feature].pool(mine, self._pooling)
                at += q.size
        return out

    def gradients(self, grads: Mapping[str, Any]) -> list[tuple]:
        """push_gradients' pairs for the gradients of this look-up's values
        ({feature: array of the value's shape}): pooled, each bag's gradient
        given to its ids (times their weights; "mean": over the bag's size)."""
        looked = {f: q for _, members in self._groups for f, q, _ in members}
        for f in grads:
            if f not in looked:
                raise KeyError(f"feature {f!r} was not looked up here; these were: "
                               f"{sorted(looked)}")
        if self._bags is None and len(grads) == len(looked):
            return self._rows_gradients(grads)
        salt = {f: w[1] for f, w in self._collection._where.items()}
        out = {}
        for f, g in grads.items():
            g = np.asarray(g)
            if self._bags is None:   # (the collection qualifies the ids again)
                out[f] = IndexedSlices(g, looked[f] ^ salt[f])
                continue
            b = self._bags[f]
            dim = self._collection.dim_of(f)
            if g.shape != (b.offsets.size, dim):
                raise ValueError(f"feature {f!r}: gradient of shape {g.shape} for "
                                 f"{b.offsets.size} bags of dim {dim}")
            w = b.scale(self._pooling)
            rows = g[b.segments()]
            out[f] = IndexedSlices(rows if w is None else rows * w[:, None], b.ids)
        return self._collection.gradients(out)

    def _rows_gradients(self, grads: Mapping[str, Any]) -> list[tuple]:
        """gradients() of every feature looked up, per id: each group's rows in
        the order of its look-up's keys, which are the keys pushed."""
        out, c = [], self._collection
        for (label, members), part in zip(self._groups, self.parts):
            table = c.tables[label]
            rows = [c._gradient_rows(f, grads[f], shape) for f, _, shape in members]
            out.append((table, IndexedSlices(_stacked(rows, table.dim), part.ids)))
        return out


def _stacked(blocks: list[np.ndarray], width: int) -> np.ndarray:
    """Row blocks (n_i, dim_i <= width) one after another as (sum n_i,
    width): a narrower block's other columns zero (its feature is padded)."""
    if all(b.shape[1] == width for b in blocks):
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
    out = np.empty((sum(b.shape[0] for b in blocks), width),
                   np.result_type(*(b.dtype for b in blocks)))
    at = 0
    for b in blocks:
        n, dim = b.shape
        out[at:at + n, :dim] = b
        if dim < width:
            out[at:at + n, dim:] = 0
        at += n
    return out
