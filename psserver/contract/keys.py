"""What a dynamic-table key maps to wherever it is held: the shard that owns
it (``shard_of``) and its first row (``initial_rows``) are functions of the
key alone (and the table's initializer), so clients, servers and checkpoint
readers agree, and a table resharded or re-created gives the same rows.

Pure numpy (no grpc, no protobuf, no server state): the coordinator's
embedding, serving and checkpoint code import it without the parameter
server's table (psserver/core/dynamic_table.py), whose hash index
(psserver/core/key_index.py) hashes with ``mix64`` too.
"""
from __future__ import annotations

import numpy as np

from psserver.contract import Initializer
from psserver.errors import InvalidArgument

_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 (a new array): a key's hash."""
    z = np.asarray(x).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _C1
        z ^= z >> np.uint64(27)
        z *= _C2
        z ^= z >> np.uint64(31)
    return z


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """Which of ``num_shards`` shards owns each key (by hash, not by value:
    keys that are small integers or share low bits still spread)."""
    h = mix64(np.asarray(keys, np.int64).view(np.uint64) ^ _GOLDEN)
    return (h % np.uint64(num_shards)).astype(np.int64)


def check_keys(keys) -> np.ndarray:
    """``keys`` as int64; InvalidArgument (a ValueError) for any other kind."""
    a = np.asarray(keys)
    if a.size == 0 and a.dtype.kind in "fiub":   # an empty list: no keys, whatever numpy guessed
        return a.astype(np.int64)
    if a.dtype.kind not in "iu" or (a.dtype.kind == "u" and a.dtype.itemsize == 8):
        raise InvalidArgument(
            f"dynamic table keys must be int64 (or a narrower integer type), got {a.dtype}; "
            "hash string features to int64 first")
    return a.astype(np.int64, copy=False)


def initial_rows(keys: np.ndarray, dim: int, dtype: np.dtype, init: Initializer) -> np.ndarray:
    """Rows for new ``keys``, each a function of (``init.seed``, key) alone,
    whichever shard holds the key. Counter-based: element (key, j) hashes
    (splitmix64) the key, the seed and j; uniforms take 53 bits of it;
    normals take two 26-bit halves of one hash for Box-Muller, whose cosine
    and sine give elements j and j + ceil(dim / 2); a truncated normal's
    element beyond 2 stddev is drawn again from the next counter."""
    keys = np.asarray(keys, np.int64).reshape(-1)
    shape = (keys.size, dim)
    fixed = {"zeros": 0.0, "ones": 1.0, "constant": init.value}.get(init.kind)
    if fixed is not None:   # the same row for every key
        return np.full(shape, fixed, dtype)
    with np.errstate(over="ignore"):
        base = mix64(keys.view(np.uint64) ^ mix64(np.uint64(init.seed) + _GOLDEN))

    def hashed(rows, cols, salt: int) -> np.ndarray:
        with np.errstate(over="ignore"):
            return mix64(base[rows] + cols * _GOLDEN + np.uint64(salt) * _C2)

    if init.kind == "random_uniform":
        u = hashed(np.arange(keys.size)[:, None], np.arange(dim, dtype=np.uint64), 1)
        u = ((u >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53
        return (init.minval + (init.maxval - init.minval) * u).astype(dtype)
    work = np.float64 if np.dtype(dtype) == np.float64 else np.float32

    def box_muller(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        u1 = ((h >> np.uint64(38)).astype(work) + work(0.5)) * work(2.0 ** -26)
        u2 = ((h & np.uint64((1 << 26) - 1)).astype(work) + work(0.5)) * work(2.0 ** -26)
        r = np.sqrt(work(-2.0) * np.log(u1))
        return r * np.cos(work(2 * np.pi) * u2), r * np.sin(work(2 * np.pi) * u2)

    half = (dim + 1) // 2
    c, s_ = box_muller(hashed(np.arange(keys.size)[:, None], np.arange(half, dtype=np.uint64), 2))
    z = np.concatenate([c, s_], axis=1)[:, :dim]
    if init.kind == "truncated_normal":   # redraw beyond 2 stddev, as TensorFlow does
        salt = 3
        bad_i, bad_j = np.nonzero(np.abs(z) > 2)
        while bad_i.size:
            z[bad_i, bad_j] = box_muller(hashed(bad_i, bad_j.astype(np.uint64), salt))[0]
            salt += 1
            keep = np.abs(z[bad_i, bad_j]) > 2
            bad_i, bad_j = bad_i[keep], bad_j[keep]
    return (init.mean + init.stddev * z).astype(dtype)
