"""A DLRM-style click-through-rate model in numpy: forward and backward.

    bottom MLP   13 dense features -> 64 -> DIM (relu, relu)
    embeddings   26 rows of DIM, looked up elsewhere (dynamic tables); or
                 rows of their own widths (``dims``), each row narrower
                 than DIM projected to DIM by a matrix of its feature's
                 (no bias), as DLRM's mixed-dimension embeddings do
                 (facebookresearch/dlrm, ``--md-flag``): the matrices of
                 the k features of width d are one variable ``proj{d}/w``
                 (k, d, DIM), in the features' order
    interaction  pairwise dot products of the 27 vectors (bottom output and
                 the 26 rows), upper triangle: 351 values, with the bottom
                 output appended (DIM)
    top MLP      351 + DIM -> 64 -> 1 (relu, then linear): the click logit
    loss         sigmoid cross-entropy, mean over the batch (stable form)

The dense parameters are a dict of arrays (``init_params``), as
examples/nn.py's; ``loss_and_grads`` returns their gradients and the
gradient of every embedding row it was given, in the form given: an array
(n, 26, DIM) or a list of 26 blocks (n, DIM), or (n, dims[f]) with
``init_params(seed, dims=...)``'s projections. The caller pushes those as
sparse updates; the servers sum duplicate keys, and ``sum_rows`` does it on
the caller's side (unique ids, summed rows).

Parameters: bottom 13*64+64 + 64*16+16 = 1,936, top 367*64+64 + 64+1 =
23,617: 25,553 dense parameters, besides 16 per embedding row.
"""
from __future__ import annotations

import numpy as np

DIM = 16
NUM_DENSE, NUM_SPARSE = 13, 26
BOTTOM = (NUM_DENSE, 64, DIM)
_PAIRS = np.triu_indices(NUM_SPARSE + 1, k=1)
TOP = (len(_PAIRS[0]) + DIM, 64, 1)
# The pairs as positions in a flattened 27 x 27 matrix, and their mirror images.
_UPPER = _PAIRS[0] * (NUM_SPARSE + 1) + _PAIRS[1]
_LOWER = _PAIRS[1] * (NUM_SPARSE + 1) + _PAIRS[0]
# The symmetric 27 x 27 matrix of the pairs' gradients, flattened: where each
# of its entries is in [the 351 pairs' gradients, 0] (0 on the diagonal).
_SYMMETRIC = np.full((NUM_SPARSE + 1) ** 2, len(_PAIRS[0]))
_SYMMETRIC[_UPPER] = _SYMMETRIC[_LOWER] = np.arange(len(_PAIRS[0]))


def layer_names() -> list[str]:
    return [f"{part}{i}/{kind}" for part, sizes in (("bottom", BOTTOM), ("top", TOP))
            for i in range(len(sizes) - 1) for kind in ("w", "b")]


def init_params(seed: int = 0, dtype=np.float32, dims=None) -> dict[str, np.ndarray]:
    """Glorot-uniform weights, zero biases (Keras' Dense defaults). ``dims``
    (26 embedding widths, each 1 to DIM): also ``proj{d}/w`` (k, d, DIM)
    for each width d < DIM that k features have (the other weights are the
    same with or without)."""
    rng = np.random.default_rng(seed)
    out = {}
    for part, sizes in (("bottom", BOTTOM), ("top", TOP)):
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            limit = np.sqrt(6.0 / (n_in + n_out))
            out[f"{part}{i}/w"] = rng.uniform(-limit, limit, (n_in, n_out)).astype(dtype)
            out[f"{part}{i}/b"] = np.zeros(n_out, dtype)
    if dims is not None:
        dims = list(dims)
        if len(dims) != NUM_SPARSE or any(not 1 <= int(d) <= DIM for d in dims):
            raise ValueError(f"dims: {NUM_SPARSE} widths from 1 to {DIM}, got {dims}")
        for d in sorted(set(int(d) for d in dims) - {DIM}):
            limit = np.sqrt(6.0 / (d + DIM))
            out[f"proj{d}/w"] = rng.uniform(-limit, limit,
                                            (dims.count(d), d, DIM)).astype(dtype)
    return out


def _mlp(params, part: str, x: np.ndarray, layers: int, relu_last: bool):
    """Forward through an MLP; (output, cache of (input, pre-activation))."""
    cache = []
    for i in range(layers):
        z = x @ params[f"{part}{i}/w"] + params[f"{part}{i}/b"]
        cache.append((x, z))
        x = np.maximum(z, 0) if (i < layers - 1 or relu_last) else z
    return x, cache


def _mlp_back(params, part: str, cache, grad: np.ndarray, relu_last: bool, grads: dict):
    for i in reversed(range(len(cache))):
        x, z = cache[i]
        if i < len(cache) - 1 or relu_last:
            grad = grad * (z > 0)
        grads[f"{part}{i}/w"] = x.T @ grad
        grads[f"{part}{i}/b"] = grad.sum(axis=0)
        grad = grad @ params[f"{part}{i}/w"].T
    return grad


def _rows(rows, params=None, projections=None) -> np.ndarray:
    """(n, 26, DIM) from an array of that shape or a list of 26 blocks
    (n, DIM), or (n, d) where ``params`` have projections of width d
    (``projections``: _projections(params, rows), when made already)."""
    if isinstance(rows, (list, tuple)):
        if len(rows) != NUM_SPARSE:
            raise ValueError(f"{len(rows)} row blocks given, the model takes {NUM_SPARSE}")
        if params is None:   # (sum_rows: one width)
            if any(np.shape(b)[1:] != (DIM,) for b in rows):
                raise ValueError(f"row blocks of shapes {sorted({np.shape(b) for b in rows})}: "
                                 f"this takes blocks (n, {DIM}) (rows of other widths: sum "
                                 "each width's alone)")
            return _rows(np.stack(rows, axis=1))
        n = rows[0].shape[0] if rows[0].ndim == 2 else -1
        out = np.empty((max(n, 0), NUM_SPARSE, DIM), np.result_type(*rows, np.float32))
        if projections is None:
            projections = _projections(params, rows)
        for f, (block, w) in enumerate(zip(rows, projections)):
            if block.shape[0] != n:
                raise ValueError(f"feature {f}: {block.shape[0]} rows, feature 0 has {n}")
            if w is None:   # each into its place: no stack of 26 copies
                out[:, f] = block
            else:
                np.matmul(block, w, out=out[:, f])
        return out
    if params is not None and any(k.startswith("proj") for k in params):
        raise ValueError("a model with projections takes its rows as a list of 26 blocks")
    if rows.ndim != 3 or rows.shape[1:] != (NUM_SPARSE, DIM):
        raise ValueError(f"rows of shape {rows.shape}, the model takes (n, {NUM_SPARSE}, {DIM})")
    return rows


def _projections(params, blocks) -> list:
    """Each feature's projection (d, DIM), a view of ``proj{d}/w`` (the j-th
    feature of width d has its j-th matrix), or None for rows of DIM."""
    out, seen = [], {}
    for f, block in enumerate(blocks):
        d = block.shape[1] if block.ndim == 2 else -1
        w = params.get(f"proj{d}/w")
        if d != DIM and w is None:
            raise ValueError(f"feature {f}: rows of shape {block.shape}; the model takes "
                             f"(n, {DIM}) or a width it has projections for")
        j = seen[d] = seen.get(d, -1) + 1
        if d != DIM and j >= w.shape[0]:
            raise ValueError(f"feature {f}: more features of width {d} than the model's "
                             f"{w.shape[0]}")
        out.append(None if d == DIM else w[j])
    for name, w in params.items():
        if name.startswith("proj") and seen.get(w.shape[1], -1) + 1 != w.shape[0]:
            raise ValueError(f"{name} projects {w.shape[0]} features of width {w.shape[1]}; "
                             f"{seen.get(w.shape[1], -1) + 1} given")
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))      # no overflow for any x


def forward(params, dense: np.ndarray, rows):
    """Logits (n,) of examples: ``dense`` (n, 13), ``rows`` (n, 26, DIM) or
    a list of 26 (n, DIM) blocks (or (n, d) where ``params`` project d to DIM)."""
    blocks, projections = rows, None
    if isinstance(rows, (list, tuple)) and len(rows) == NUM_SPARSE:
        projections = _projections(params, rows)   # (once: the backward pass takes them too)
    rows = _rows(rows, params, projections)
    bottom, bcache = _mlp(params, "bottom", dense, len(BOTTOM) - 1, relu_last=True)
    z = np.concatenate([bottom[:, None, :], rows], axis=1)          # (n, 27, DIM)
    # Every pair's dot product (a contiguous transpose: BLAS's fast layout),
    # then the upper triangle's 351 (np.take along the flattened matrix).
    zz = np.matmul(z, np.ascontiguousarray(z.transpose(0, 2, 1)))
    dots = np.take(zz.reshape(len(z), -1), _UPPER, axis=1)           # (n, 351)
    top_in = np.concatenate([dots, bottom], axis=1)
    logits, tcache = _mlp(params, "top", top_in, len(TOP) - 1, relu_last=False)
    return logits[:, 0], (bcache, z, tcache, blocks, projections)


def predict(params, dense: np.ndarray, rows) -> np.ndarray:
    """Click probabilities (n,) (for AUC the logits, ``forward``'s, rank the same)."""
    return _sigmoid(forward(params, dense, rows)[0])


def loss_and_grads(params, dense: np.ndarray, rows, labels: np.ndarray):
    """(mean sigmoid cross-entropy, {name: gradient}, gradient of ``rows``
    in the form given: an array (n, 26, DIM) or a list of 26 blocks (n, d),
    with the gradients of the projections among the others)."""
    as_list = isinstance(rows, (list, tuple))
    logits, (bcache, z, tcache, blocks, projections) = forward(params, dense, rows)
    n = labels.shape[0]
    y = labels.astype(logits.dtype)
    # log(1 + e^x) - y x, stable for either sign of x
    loss = float(np.mean(np.maximum(logits, 0) - logits * y + np.log1p(np.exp(-np.abs(logits)))))
    g = ((_sigmoid(logits) - y) / n).astype(logits.dtype)[:, None]
    grads: dict[str, np.ndarray] = {}
    g_top_in = _mlp_back(params, "top", tcache, g, relu_last=False, grads=grads)
    pairs = len(_PAIRS[0])
    g_dots, g_bottom = g_top_in[:, :pairs], g_top_in[:, pairs:]
    # d(z_i . z_j) / d z: the pairs' gradients in a symmetric 27 x 27 matrix, times z.
    # (one gather: half the time of zeros and two scatters)
    g_pairs = np.empty((n, pairs + 1), logits.dtype)
    g_pairs[:, :pairs] = g_dots
    g_pairs[:, pairs] = 0
    m = np.take(g_pairs, _SYMMETRIC, axis=1)
    g_z = np.matmul(m.reshape(n, NUM_SPARSE + 1, NUM_SPARSE + 1), z)
    g_bottom = g_bottom + g_z[:, 0, :]
    _mlp_back(params, "bottom", bcache, g_bottom, relu_last=True, grads=grads)
    g_rows = g_z[:, 1:, :]
    if not as_list:
        return loss, grads, g_rows
    out = []
    for name, w in params.items():
        if name.startswith("proj"):
            grads[name] = np.empty_like(w)
    seen: dict[int, int] = {}
    for f, w in enumerate(projections):
        g = g_rows[:, f]
        if w is not None:   # rows @ w: d rows = g @ w.T, d w = rows.T @ g
            d = w.shape[0]
            j = seen[d] = seen.get(d, -1) + 1
            np.matmul(blocks[f].T, g, out=grads[f"proj{d}/w"][j])
            g = g @ w.T
        out.append(g)
    return loss, grads, out


def sum_rows(ids: np.ndarray, row_grads) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique int64 ids, their row gradients summed) from ids (n, 26)
    and row gradients as ``loss_and_grads`` returns them (array or list):
    one row per id, ready for a sparse push (psserver.contract.optimizers.sum_duplicates)."""
    from psserver.contract.rows import sum_duplicates
    return sum_duplicates(np.asarray(ids).reshape(-1), _rows(row_grads).reshape(-1, DIM))


def num_params(dims=None) -> int:
    return sum(a.size for a in init_params(dims=dims).values())
