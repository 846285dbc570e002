"""Click-through-rate data shaped like Criteo's, generated (no download).

Each example: 13 dense features (non-negative, heavy-tailed counts,
floor(lognormal(1, 1.4)), given ``log1p``-transformed as DLRM feeds them;
``raw_counts`` gives the counts back), 26 categorical features as int64 ids
(hashes: spread over the whole int64 range), and a click label.

* Categorical feature f draws a rank from a Zipf-like power law (exponent
  ``ZIPF_A``) over a vocabulary of ``VOCABS[f]`` values (3 to 50 million:
  most far larger than any fixed table one would size), and its id is the
  rank hashed with f (splitmix64): the same value of f always has the same
  id, different features never share one. ``vocabs=`` gives other sizes
  (the same rank keeps its id, so a small setting is the head of the big
  one's values).
* The label is Bernoulli(sigmoid(logit)) of a planted logistic model:
  ``logit = BIAS + sum_f weight(f, id) + dense @ DENSE_WEIGHTS``, where each
  id's weight is a normal of scale ``WEIGHT_SCALE[f]`` derived from the id
  by hashing (no table of weights is stored). The click rate is about
  23.5% (23.4-23.6% over seeds; 24% with every vocabulary cut to 1,000).
  ``planted_logits`` gives the true logits: their AUC is the ceiling any
  model can reach on this data (``bayes_auc``: 0.867 on 200,000 examples).
* Random access and deterministic: ``batch(seed, index, size)`` is batch
  ``index`` of the stream ``seed`` without generating the ones before it,
  so each worker makes its own (``shard``: worker i of n takes batches i,
  i + n, ...).

numpy only; about 250,000 examples per second on one core (batches of
1,024 to 8,192; 320,000 at 256), so it is not what limits training.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from psserver.contract.keys import mix64  # splitmix64's finalizer: the ids' hash

NUM_DENSE, NUM_SPARSE = 13, 26
#: Values of each categorical feature (Criteo's 26 run from 3 to ~10M).
VOCABS = (50_000_000, 30_000, 10_000_000, 2_000_000, 300, 24, 12_000, 600, 3, 90_000,
          5_000, 8_000_000, 3_000, 27, 10_000, 5_000_000, 10, 5_000, 2_000, 4,
          7_000_000, 18, 15, 300_000, 100, 100_000)
ZIPF_A = 1.1
BIAS = -2.4
#: Scale of the planted per-id weights: the large vocabularies carry signal
#: only in their frequent values, which a model can learn.
WEIGHT_SCALE = tuple(0.45 if v > 1000 else 0.25 for v in VOCABS)
DENSE_WEIGHTS = np.linspace(-0.12, 0.12, NUM_DENSE).astype(np.float64)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class Batch(NamedTuple):
    dense: np.ndarray    # (n, 13) float32, log1p of counts
    sparse: np.ndarray   # (n, 26) int64 ids
    labels: np.ndarray   # (n,) float32, 0 or 1


def _zipf_ranks(u: np.ndarray, vocab: int, a: float = ZIPF_A) -> np.ndarray:
    """Ranks 0..vocab-1 by the inverse CDF of a continuous power law x**-a on
    [1, vocab + 1): rank 0 is the most frequent."""
    lo, hi = 1.0, float(vocab + 1)
    e = 1.0 - a
    x = (lo**e + u * (hi**e - lo**e)) ** (1.0 / e)
    return np.minimum(x.astype(np.int64) - 1, vocab - 1)


def ids_of(ranks: np.ndarray) -> np.ndarray:
    """(n, 26) ranks -> int64 ids: each rank hashed with its feature."""
    salts = (np.arange(NUM_SPARSE, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
    with np.errstate(over="ignore"):
        return mix64(ranks.astype(np.uint64) ^ salts).view(np.int64)


def id_weights(ids: np.ndarray) -> np.ndarray:
    """The planted weight of each (n, 26) id: a normal derived from its hash."""
    h = mix64(ids.view(np.uint64) ^ np.uint64(0x5DEECE66D))
    u1 = ((h >> np.uint64(38)).astype(np.float64) + 0.5) * 2.0 ** -26
    u2 = ((h & np.uint64((1 << 26) - 1)).astype(np.float64) + 0.5) * 2.0 ** -26
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)
    return z * np.asarray(WEIGHT_SCALE)


def planted_logits(dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """The true logits of examples (dense as ``batch`` gives it)."""
    return BIAS + id_weights(sparse).sum(axis=1) + dense.astype(np.float64) @ DENSE_WEIGHTS


def _check_vocabs(vocabs) -> tuple[int, ...]:
    vocabs = tuple(int(v) for v in vocabs)
    if len(vocabs) != NUM_SPARSE or min(vocabs) < 1:
        raise ValueError(f"vocabs must be {NUM_SPARSE} sizes >= 1, got {vocabs}")
    return vocabs


def raw_counts(dense: np.ndarray) -> np.ndarray:
    """The counts (float64, whole numbers) of ``dense`` as ``batch`` gives it."""
    return np.rint(np.expm1(np.asarray(dense, np.float64)))


def batch(seed: int, index: int, size: int, vocabs=VOCABS) -> Batch:
    """Batch ``index`` of stream ``seed``: ``size`` examples, the same every
    time, made without the batches before it."""
    vocabs = _check_vocabs(vocabs)
    if index < 0 or size < 0:
        raise ValueError(f"index {index} and size {size} must be >= 0")
    rng = np.random.default_rng([int(seed), int(index), 0x7C7])
    counts = np.floor(np.exp(rng.normal(1.0, 1.4, (size, NUM_DENSE))))
    dense = np.log1p(counts).astype(np.float32)
    u = rng.random((size, NUM_SPARSE))
    ranks = np.stack([_zipf_ranks(u[:, f], v) for f, v in enumerate(vocabs)], axis=1)
    sparse = ids_of(ranks)
    p = 1.0 / (1.0 + np.exp(-planted_logits(dense, sparse)))
    labels = (rng.random(size) < p).astype(np.float32)
    return Batch(dense, sparse, labels)


def shard(seed: int, worker: int, num_workers: int, size: int, start: int = 0,
          vocabs=VOCABS):
    """Worker ``worker`` of ``num_workers``'s batches: index start + worker,
    then every num_workers-th, forever."""
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is not one of 0..{num_workers - 1}")
    vocabs = _check_vocabs(vocabs)
    index = start + worker
    while True:
        yield batch(seed, index, size, vocabs)
        index += num_workers


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by ranks (ties get their average rank): the probability that a
    random positive scores above a random negative (ties count half)."""
    labels = np.asarray(labels).reshape(-1) > 0.5
    scores = np.asarray(scores, np.float64).reshape(-1)
    pos = int(labels.sum())
    neg = labels.size - pos
    if pos == 0 or neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(s.size, np.float64)
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0          # 1-based average rank of each run of ties
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def bayes_auc(seed: int = 12345, n: int = 200_000, vocabs=VOCABS) -> float:
    """The AUC of the planted logits on ``n`` examples: no model does better."""
    b = batch(seed, 0, n, vocabs)
    return auc(b.labels, planted_logits(b.dense, b.sparse))
