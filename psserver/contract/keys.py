"""What a dynamic-table key maps to wherever it is held: its bucket
(``bucket_of``) and its first row (``initial_rows``) are functions of the key
alone (and the table's initializer), so clients, servers and checkpoint
readers agree, and a table resharded or re-created gives the same rows.

Keys map to shards in two steps, as Redis Cluster's hash slots do: a key's
hash picks one of ``BUCKETS`` buckets, the same for every table and cluster
size, and a table's ``BucketMap`` gives each bucket its shard (contiguous
ranges, as even as 4,096 divides: ``BucketMap.even``). A shard's share of
the table (its capacity: ``split_capacity``) is its share of the buckets; a
checkpoint records the map of each table (``ranges``), and a table moved to
more or fewer servers can move whole buckets, not rows one by one. Manifests
written before buckets (no "buckets" entry) used ``hash % shards``:
``legacy_shard_of`` reads them.

Pure numpy (no grpc, no protobuf, no server state): the coordinator's
embedding, serving and checkpoint code import it without the parameter
server's table (psserver/core/dynamic_table.py), whose hash index
(psserver/core/key_index.py) hashes with ``mix64`` too.
"""
from __future__ import annotations

import functools
import json

import numpy as np

from psserver.contract import Initializer
from psserver.errors import InvalidArgument

_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 (a new array): a key's hash."""
    z = np.asarray(x).astype(np.uint64, copy=True)
    # (in place on an array, 0-d too: numpy wraps unsigned products silently)
    z ^= z >> np.uint64(30)
    z *= _C1
    z ^= z >> np.uint64(27)
    z *= _C2
    z ^= z >> np.uint64(31)
    return z


#: Buckets of every table's key space (a power of two: a bucket is the top
#: bits of the key's hash; the low bits index psserver.core.key_index).
BUCKET_BITS = 12
BUCKETS = 1 << BUCKET_BITS


def _key_hash(keys) -> np.ndarray:
    """By hash, not by value: keys that are small integers or share low bits still spread."""
    return mix64(np.asarray(keys, np.int64).view(np.uint64) ^ _GOLDEN)


def bucket_of(keys) -> np.ndarray:
    """The bucket (0 .. BUCKETS-1) of each int64 key."""
    return (_key_hash(keys) >> np.uint64(64 - BUCKET_BITS)).astype(np.intp)


def legacy_shard_of(keys, num_shards: int) -> np.ndarray:
    """The shard of each key in checkpoints written before buckets (``hash % shards``)."""
    return (_key_hash(keys) % np.uint64(num_shards)).astype(np.int64)


class BucketMap:
    """Which shard of a table holds each bucket: ``owner[b]`` for b in
    0 .. BUCKETS-1, every shard from 0 to ``num_shards``-1 given at least one.
    Immutable; equal maps compare equal."""

    __slots__ = ("owner", "num_shards", "_hash")

    def __init__(self, owner, num_shards: int):
        owner = np.array(owner, np.int64)
        if owner.shape != (BUCKETS,) or num_shards < 1 or owner.min() < 0 or \
                owner.max() >= num_shards or not np.bincount(owner, minlength=num_shards).all():
            raise InvalidArgument(f"a bucket map gives each of {BUCKETS} buckets one of "
                                  f"{num_shards} shard(s), each shard at least one bucket")
        owner = owner.astype(np.int16 if num_shards <= 1 << 15 else np.int32)
        owner.setflags(write=False)
        self.owner, self.num_shards = owner, int(num_shards)
        self._hash = hash((self.num_shards, owner.tobytes()))   # (tables are dict keys)

    @classmethod
    def even(cls, num_shards: int) -> "BucketMap":
        """Shard i holds buckets [i*B//n, (i+1)*B//n): contiguous, as even as B allows."""
        if not isinstance(num_shards, (int, np.integer)) or not 1 <= num_shards <= BUCKETS:
            raise InvalidArgument(f"a table has 1 to {BUCKETS} shards, got {num_shards!r}")
        return _even(int(num_shards))

    @classmethod
    def from_ranges(cls, ranges, num_shards: int) -> "BucketMap":
        """The map ``ranges()`` wrote ([first, end, shard] runs covering
        0 .. BUCKETS in order); InvalidArgument for anything else."""
        owner = np.full(BUCKETS, -1, np.int64)
        at = 0
        try:
            for first, end, shard in ranges:
                if not all(isinstance(x, int) and not isinstance(x, bool)
                           for x in (first, end, shard)) or first != at or not at < end <= BUCKETS:
                    raise ValueError
                owner[first:end] = shard
                at = end
        except (TypeError, ValueError):
            at = -1
        if at != BUCKETS:
            raise InvalidArgument(f"a bucket map is a list of [first, end, shard] runs covering "
                                  f"buckets 0 to {BUCKETS} in order, got {ranges!r:.200}")
        return cls(owner, num_shards)

    def ranges(self) -> list[list[int]]:
        """[first, end, shard] runs of equal owners, in bucket order (JSON-able)."""
        cut = np.flatnonzero(np.diff(self.owner)) + 1
        starts = [0, *cut.tolist()]
        ends = [*cut.tolist(), BUCKETS]
        return [[a, b, int(self.owner[a])] for a, b in zip(starts, ends)]

    def shard_of(self, keys) -> np.ndarray:
        """The shard of each int64 key."""
        return self.owner[bucket_of(keys)].astype(np.int64)

    def counts(self) -> np.ndarray:
        """Buckets per shard."""
        return np.bincount(self.owner, minlength=self.num_shards)

    def __eq__(self, other) -> bool:
        return self is other or isinstance(other, BucketMap) and self._hash == other._hash \
            and self.num_shards == other.num_shards and bool((self.owner == other.owner).all())

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"BucketMap({self.num_shards} shards, {len(self.ranges())} runs)"

    def __reduce__(self):   # small in a pickled step closure: its runs, not 4,096 owners
        if self is _even(self.num_shards):
            return BucketMap.even, (self.num_shards,)
        return BucketMap.from_ranges, (self.ranges(), self.num_shards)


@functools.lru_cache(maxsize=64)
def _even(n: int) -> BucketMap:
    return BucketMap(np.arange(BUCKETS) * n // BUCKETS, n)


def fill_capacity(capacity: int, shares, rows) -> list[int]:
    """Each shard's part of ``capacity`` after a restore of ``rows[i]`` rows
    into shard i (``shares``: its buckets): room for every restored row and
    the rest by shares when they fit; else each shard keeps at most its rows,
    the parts as near the shares as that allows (water-filling). Every part
    at least 1 (0 would mean no limit) where ``capacity`` >= the shards, and
    the parts sum to ``capacity`` exactly. 0 (no limit) stays 0."""
    rows = np.asarray(rows, np.int64)
    n = rows.size
    if not capacity:
        return [0] * n
    shares = np.asarray(shares, np.float64)
    if rows.sum() <= capacity:
        parts = rows + np.asarray(split_capacity(capacity - int(rows.sum()), shares), np.int64)
    else:
        parts = np.zeros(n, np.int64)
        open_ = np.ones(n, bool)
        left = capacity
        while left and open_.any():   # each round: the shares of what is left, capped at rows
            give = np.zeros(n, np.int64)
            give[open_] = split_capacity(left, shares[open_])
            give = np.minimum(give, rows - parts)
            if not give.any():   # rounding gave nothing to the shards with room: one each
                give[np.flatnonzero(open_ & (rows > parts))[:left]] = 1
            parts += give
            left -= int(give.sum())
            open_ &= parts < rows
    for i in np.flatnonzero(parts == 0):   # at least one each: from room left, else the largest
        room = parts - rows
        j = int(np.argmax(room)) if room.max() > 0 and parts[np.argmax(room)] > 1 \
            else int(np.argmax(parts))
        if parts[j] > 1:
            parts[j] -= 1
            parts[i] = 1
    return parts.tolist()


def split_capacity(capacity: int, weights) -> list[int]:
    """``capacity`` cut in proportion to ``weights`` (a shard's buckets, or
    room), whole numbers summing to it exactly (largest remainders first,
    ties to the first); 0 (no limit) stays 0 for every part."""
    w = np.asarray(weights, np.float64)
    if not capacity:
        return [0] * w.size
    exact = capacity * w / w.sum()
    part = np.floor(exact).astype(np.int64)
    short = capacity - int(part.sum())
    part[np.argsort(-(exact - part), kind="stable")[:short]] += 1
    return part.tolist()


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


#: A move request's bitmap of buckets: one bit per bucket.
BITMAP_BYTES = BUCKETS // 8


def buckets_of_bitmap(raw: bytes) -> np.ndarray:
    """The bool mask of the buckets a bitmap names (bucket b: bit b % 8 of
    byte b // 8); InvalidArgument for another length or no bucket."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != BITMAP_BYTES:
        raise InvalidArgument(f"a move names its buckets as a bitmap of {BITMAP_BYTES} bytes "
                              f"({BUCKETS} buckets), got {len(raw)} bytes")
    mask = np.unpackbits(np.frombuffer(bytes(raw), np.uint8), bitorder="little").astype(bool)
    if not mask.any():
        raise InvalidArgument("a move names no bucket: name at least one")
    return mask


def bitmap_of_buckets(mask) -> bytes:
    """The bitmap of a bool mask of BUCKETS buckets (buckets_of_bitmap's inverse)."""
    mask = np.asarray(mask, bool)
    if mask.shape != (BUCKETS,):
        raise ValueError(f"a bucket mask has {BUCKETS} entries, got shape {mask.shape}")
    return np.packbits(mask, bitorder="little").tobytes()


#: Bytes of a table's layout (JSON) at most: any bucket map, 4,096 runs, and its addresses.
MAX_LAYOUT_BYTES = 256 << 10


def layout_json(epoch: int, addresses, buckets: BucketMap) -> str:
    """A table's layout as servers serve it (TableInfo.layout) and moves give
    it (MoveBucketsRequest.layout): epoch, shard addresses, bucket runs."""
    return json.dumps({"epoch": epoch, "addresses": list(addresses),
                       "buckets": buckets.ranges()}, separators=(",", ":"))


def parse_layout(text: str) -> tuple[int, tuple[str, ...], BucketMap]:
    """(epoch, addresses, bucket map) of layout_json's text; InvalidArgument
    for anything else (too long, not JSON, deep nesting, huge numbers, an
    epoch outside [0, 2**62), addresses not 1 to 4,096 non-empty strings, a
    map that does not fit them)."""
    try:
        if len(text.encode()) > MAX_LAYOUT_BYTES:
            raise ValueError
        d = json.loads(text)
        epoch, addresses = d["epoch"], d["addresses"]
        if type(epoch) is not int or not 0 <= epoch < 1 << 62 or \
                not isinstance(addresses, list) or not 0 < len(addresses) <= BUCKETS or \
                not all(isinstance(a, str) and a for a in addresses):
            raise ValueError
        return epoch, tuple(addresses), BucketMap.from_ranges(d["buckets"], len(addresses))
    except Exception:   # (any malformed text, deep nesting, huge numbers: refused)
        raise InvalidArgument("a layout is JSON {\"epoch\", \"addresses\": [host:port ...], "
                              "\"buckets\": [[first, end, shard] ...]} with a bucket map over "
                              "its addresses") from None
