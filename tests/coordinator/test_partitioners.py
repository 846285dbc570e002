"""Tests for coordinator.partitioners.

Every expected value below was worked out by hand from TensorFlow's algorithms
(tensorflow/python/ops/partitioned_variables.py and the split in
ParameterServerStrategyV2._create_variable) or copied from TensorFlow's
docstring examples; the arithmetic is in the comment on each row.
"""

import doctest

import numpy as np
import pytest

from coordinator import partitioners as P
from coordinator.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    num_shards_of,
    shard_row_offsets,
)

KiB = 1 << 10
MiB = 1 << 20

# ---------------------------------------------------------------------------
# FixedShardsPartitioner: partitions[axis] = min(num_shards, shape[axis])
# ---------------------------------------------------------------------------
FIXED_CASES = [
    # (num_shards, shape, dtype, axis, expected)
    (2, (10, 3), np.float32, 0, [2, 1]),     # TF docstring example
    (3, (10,), "float32", 0, [3]),           # rank 1
    (1, (7, 4), "int64", 0, [1, 1]),         # one shard
    (8, (5, 3), np.float32, 0, [5, 1]),      # min(8, 5) = 5: capped at the row count
    (5, (5, 3), np.float32, 0, [5, 1]),      # min(5, 5) = 5
    (4, (0, 3), np.float32, 0, [0, 1]),      # min(4, 0) = 0 (TF returns 0 too)
    (2, (3, 10), np.float32, 1, [1, 2]),     # along axis 1
    (2, (3, 10), np.float32, -1, [1, 2]),    # negative axis, as Python indexing in TF
    (4, (3, 10, 2), "string", 0, [3, 1, 1]), # dtype ignored; min(4, 3) = 3
]


@pytest.mark.parametrize("num_shards,shape,dtype,axis,expected", FIXED_CASES)
def test_fixed_shards(num_shards, shape, dtype, axis, expected):
    assert FixedShardsPartitioner(num_shards)(shape, dtype, axis=axis) == expected


# ---------------------------------------------------------------------------
# MinSizePartitioner:
#   shards = max(1, min(shape[axis], max_shards, ceil(total_bytes / min_shard_bytes)))
# ---------------------------------------------------------------------------
MIN_CASES = [
    # (min_shard_bytes, max_shards, bytes_per_string, shape, dtype, axis, expected)
    # TF docstring: 6x1 float32 = 24 B; 24/4 = 6; min(6 rows, 2, 6) = 2
    (4, 2, 16, (6, 1), np.float32, 0, [2, 1]),
    # TF docstring: 24/4 = 6; min(6 rows, 10, 6) = 6
    (4, 10, 16, (6, 1), np.float32, 0, [6, 1]),
    # TF docstring: 1024x1024 float32 = 4194304 B; /262144 = 16; min(1024, 32, 16) = 16
    (256 * KiB, 32, 16, (1024, 1024), "float32", 0, [16, 1]),
    # same, max_shards 8 < 16 -> 8
    (256 * KiB, 8, 16, (1024, 1024), "float32", 0, [8, 1]),
    # 1000x64 float32 = 256000 B; /262144 = 0.977 -> ceil 1 -> 1 shard
    (256 * KiB, 4, 16, (1000, 64), np.float32, 0, [1, 1]),
    # 1024x64 float32 = 262144 B exactly; /262144 = 1.0 -> 1 shard
    (256 * KiB, 4, 16, (1024, 64), np.float32, 0, [1, 1]),
    # 1025x64 float32 = 262400 B; /262144 = 1.001 -> ceil 2 -> 2 shards
    (256 * KiB, 4, 16, (1025, 64), np.float32, 0, [2, 1]),
    # 1,000,000x64 float32 = 256,000,000 B; /262144 = 976.6 -> 977; min(1e6, 2, 977) = 2
    (256 * KiB, 2, 16, (1_000_000, 64), np.float32, 0, [2, 1]),
    # default max_shards=1: min(1e6, 1, 977) = 1
    (256 * KiB, 1, 16, (1_000_000, 64), np.float32, 0, [1, 1]),
    # 3x1000 float32 = 12000 B; /4 = 3000; min(3 rows, 100, 3000) = 3: capped at rows
    (4, 100, 16, (3, 1000), np.float32, 0, [3, 1]),
    # 100x8 int64 = 800*8 = 6400 B; /1000 = 6.4 -> 7; min(100, 10, 7) = 7
    (1000, 10, 16, (100, 8), np.int64, 0, [7, 1]),
    # 100x8 float16 = 800*2 = 1600 B; /1000 = 1.6 -> 2
    (1000, 10, 16, (100, 8), "float16", 0, [2, 1]),
    # 512x256 bfloat16 = 131072*2 = 262144 B; /65536 = 4; min(512, 10, 4) = 4
    (64 * KiB, 10, 16, (512, 256), "bfloat16", 0, [4, 1]),
    # 100x10 string, 16 B/string: 1000*16 = 16000 B; /1000 = 16; min(100, 32, 16) = 16
    (1000, 32, 16, (100, 10), "string", 0, [16, 1]),
    # 100x10 string, 64 B/string: 1000*64 = 64000 B; /1000 = 64; min(100, 100, 64) = 64
    (1000, 100, 64, (100, 10), "string", 0, [64, 1]),
    # numpy object dtype counts as string: 1000*64 = 64000 B; same 64
    (1000, 100, 64, (100, 10), np.object_, 0, [64, 1]),
    # 0x64 float32 = 0 B; ceil(0) = 0; min(0, 4, 0) = 0; max(1, 0) = 1
    (256 * KiB, 4, 16, (0, 64), np.float32, 0, [1, 1]),
    # 10x0 float32 = 0 B -> max(1, min(10, 4, 0)) = 1
    (256 * KiB, 4, 16, (10, 0), np.float32, 0, [1, 1]),
    # axis 1: 4x1024 float32 = 16384 B; /1024 = 16; min(1024 cols, 8, 16) = 8
    (1024, 8, 16, (4, 1024), np.float32, 1, [1, 8]),
]


@pytest.mark.parametrize(
    "min_bytes,max_shards,bps,shape,dtype,axis,expected", MIN_CASES)
def test_min_size(min_bytes, max_shards, bps, shape, dtype, axis, expected):
    p = MinSizePartitioner(min_shard_bytes=min_bytes, max_shards=max_shards,
                           bytes_per_string=bps)
    assert p(shape, dtype, axis=axis) == expected


def test_min_size_defaults():
    # defaults: min 256 KiB, max_shards 1 -> always 1 shard
    # 1024x1024 float32 = 4 MiB -> 16, but min(1024, 1, 16) = 1
    assert MinSizePartitioner()((1024, 1024), np.float32) == [1, 1]


# ---------------------------------------------------------------------------
# MaxSizePartitioner:
#   bytes_per_slice  = (num_elements / shape[axis]) * element_size
#   slices_per_shard = max(1, floor(max_shard_bytes / bytes_per_slice))
#   shards = ceil(shape[axis] / slices_per_shard), then min(max_shards, .) if set
# ---------------------------------------------------------------------------
MAX_CASES = [
    # (max_shard_bytes, max_shards, bytes_per_string, shape, dtype, axis, expected)
    # TF docstring: 4 B/row; floor(4/4) = 1 row/shard; ceil(6/1) = 6
    (4, None, 16, (6, 1), np.float32, 0, [6, 1]),
    # TF docstring: 6 shards capped by max_shards 2 -> 2
    (4, 2, 16, (6, 1), np.float32, 0, [2, 1]),
    # TF docstring: floor(1024/4) = 256 rows/shard; ceil(6/256) = 1
    (1024, None, 16, (6, 1), np.float32, 0, [1, 1]),
    # 100x10 float32: 40 B/row; floor(100/40) = 2 rows/shard; ceil(100/2) = 50
    (100, None, 16, (100, 10), "float32", 0, [50, 1]),
    # row (40 B) bigger than the limit (30 B): floor(0.75) = 0 -> 1 row/shard -> 100
    (30, None, 16, (100, 10), "float32", 0, [100, 1]),
    # 1,000,000x64 float32: 256 B/row; 64 MiB/256 = 262144 rows/shard;
    # ceil(1e6/262144) = ceil(3.81) = 4
    (64 * MiB, None, 16, (1_000_000, 64), np.float32, 0, [4, 1]),
    # same capped by max_shards 3 -> 3
    (64 * MiB, 3, 16, (1_000_000, 64), np.float32, 0, [3, 1]),
    # max_shards above the need does nothing: min(10, 4) = 4
    (64 * MiB, 10, 16, (1_000_000, 64), np.float32, 0, [4, 1]),
    # TF's suggested (64<<20)-1 = 67108863: /256 = 262143.996 -> 262143 rows/shard;
    # ceil(1e6/262143) = ceil(3.81) = 4
    ((64 * MiB) - 1, None, 16, (1_000_000, 64), np.float32, 0, [4, 1]),
    # whole variable fits: 1000x64 float32 = 256000 B; 256 B/row; floor(262144/256) = 1024
    # rows/shard; ceil(1000/1024) = 1
    (256 * KiB, None, 16, (1000, 64), np.float32, 0, [1, 1]),
    # 10x3 int8: 3 B/row; floor(7/3) = 2 rows/shard; ceil(10/2) = 5
    (7, None, 16, (10, 3), np.int8, 0, [5, 1]),
    # 1000x4 string at 32 B: 128 B/row; floor(1000/128) = 7; ceil(1000/7) = ceil(142.86) = 143
    (1000, None, 32, (1000, 4), "string", 0, [143, 1]),
    # same at default 16 B: 64 B/row; floor(1000/64) = 15; ceil(1000/15) = ceil(66.67) = 67
    (1000, None, 16, (1000, 4), "string", 0, [67, 1]),
    # axis 1: 4x100 float32: slice = (400/100)*4 = 16 B; floor(64/16) = 4; ceil(100/4) = 25
    (64, None, 16, (4, 100), np.float32, 1, [1, 25]),
]


@pytest.mark.parametrize(
    "max_bytes,max_shards,bps,shape,dtype,axis,expected", MAX_CASES)
def test_max_size(max_bytes, max_shards, bps, shape, dtype, axis, expected):
    p = MaxSizePartitioner(max_shard_bytes=max_bytes, max_shards=max_shards,
                           bytes_per_string=bps)
    assert p(shape, dtype, axis=axis) == expected


@pytest.mark.parametrize("shape", [(0, 64), (10, 0)])
def test_max_size_zero_dim_raises(shape):
    # TensorFlow divides by zero here (ZeroDivisionError); we raise ValueError.
    with pytest.raises(ValueError, match="0 dimension"):
        MaxSizePartitioner(1024)(shape, np.float32)


# ---------------------------------------------------------------------------
# shard_row_offsets: "div" split, first num_rows % n shards get one extra row,
# n = min(num_shards, num_rows)
# ---------------------------------------------------------------------------
OFFSET_CASES = [
    # (num_rows, num_shards, expected offsets)
    (10, 3, [0, 4, 7, 10]),           # 10 = 3*3 + 1 -> sizes [4, 3, 3]
    (10, 4, [0, 3, 6, 8, 10]),        # TF's comment: 10 = 4*2 + 2 -> [3, 3, 2, 2]
    (11, 4, [0, 3, 6, 9, 11]),        # 11 = 4*2 + 3 -> [3, 3, 3, 2]
    (9, 3, [0, 3, 6, 9]),             # even: [3, 3, 3]
    (10, 1, [0, 10]),                 # one shard
    (7, 7, [0, 1, 2, 3, 4, 5, 6, 7]),  # one row each
    (2, 5, [0, 1, 2]),                # min(5, 2) = 2 shards of 1 row
    (1_000_000, 2, [0, 500_000, 1_000_000]),
    (1_000_001, 2, [0, 500_001, 1_000_001]),  # extra row on shard 0
    (0, 1, [0, 0]),                   # empty variable: one empty shard
    (0, 3, [0, 0]),
]


@pytest.mark.parametrize("num_rows,num_shards,expected", OFFSET_CASES)
def test_shard_row_offsets(num_rows, num_shards, expected):
    assert shard_row_offsets(num_rows, num_shards) == expected


def test_uneven_split_sizes():
    offs = shard_row_offsets(10, 3)
    assert [b - a for a, b in zip(offs, offs[1:])] == [4, 3, 3]


def test_end_to_end_million_row_table():
    # 1,000,000x64 float32 = 256,000,000 B -> 977 by size, capped at max_shards 2
    parts = MinSizePartitioner(256 << 10, max_shards=2)((1_000_000, 64), np.float32)
    n = num_shards_of(parts)
    assert n == 2
    assert shard_row_offsets(1_000_000, n) == [0, 500_000, 1_000_000]


# ---------------------------------------------------------------------------
# num_shards_of
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("parts,expected", [([3, 1], 3), ([1], 1), ((4, 1, 1), 4)])
def test_num_shards_of(parts, expected):
    assert num_shards_of(parts) == expected


@pytest.mark.parametrize("parts", [[], [0, 1], [2, 2], [1, 3], [-1], [2.0, 1]])
def test_num_shards_of_rejects(parts):
    with pytest.raises(ValueError):
        num_shards_of(parts)


def test_fixed_on_empty_rows_rejected_by_num_shards_of():
    # FixedShards gives [0, 1] for 0 rows, as TF does; ParameterServerStrategy
    # rejects a 0 first element, and so does num_shards_of.
    with pytest.raises(ValueError):
        num_shards_of(FixedShardsPartitioner(4)((0, 3), np.float32))


# ---------------------------------------------------------------------------
# dtype forms
# ---------------------------------------------------------------------------
class _FakeTfDType:
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("dtype,size", [
    (np.float32, 4), (np.dtype("float32"), 4), ("float32", 4), ("float64", 8),
    ("int32", 4), ("int8", 1), ("bool", 1), ("complex64", 8), ("bfloat16", 2),
    ("string", 16), (np.object_, 16), (np.bytes_, 16), (np.str_, 16),
    (_FakeTfDType("float16"), 2), (_FakeTfDType("string"), 16),
])
def test_element_size(dtype, size):
    assert P.element_size(dtype, 16) == size


def test_dtype_forms_agree():
    # 100x10 float32 = 4000 B; /1000 = 4 -> 4 shards, whatever the dtype's form
    p = MinSizePartitioner(1000, max_shards=10)
    for dt in (np.float32, np.dtype(np.float32), "float32", _FakeTfDType("float32")):
        assert p((100, 10), dt) == [4, 1]
    # shape as a list
    assert p([100, 10], "float32") == [4, 1]


# ---------------------------------------------------------------------------
# argument validation
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("make,exc", [
    (lambda: FixedShardsPartitioner(0), ValueError),
    (lambda: FixedShardsPartitioner(-1), ValueError),
    (lambda: FixedShardsPartitioner(2.0), TypeError),
    (lambda: FixedShardsPartitioner(True), TypeError),
    (lambda: FixedShardsPartitioner("2"), TypeError),
    (lambda: FixedShardsPartitioner(None), TypeError),
    (lambda: MinSizePartitioner(min_shard_bytes=0), ValueError),
    (lambda: MinSizePartitioner(min_shard_bytes=-5), ValueError),
    (lambda: MinSizePartitioner(min_shard_bytes=1.5), TypeError),
    (lambda: MinSizePartitioner(max_shards=0), ValueError),
    (lambda: MinSizePartitioner(max_shards=None), TypeError),
    (lambda: MinSizePartitioner(bytes_per_string=0), ValueError),
    (lambda: MaxSizePartitioner(0), ValueError),
    (lambda: MaxSizePartitioner(-1), ValueError),
    (lambda: MaxSizePartitioner(None), TypeError),
    (lambda: MaxSizePartitioner(100, max_shards=0), ValueError),  # TF lets 0 mean "no limit"
    (lambda: MaxSizePartitioner(100, max_shards=-2), ValueError),
    (lambda: MaxSizePartitioner(100, bytes_per_string=0), ValueError),
])
def test_constructor_validation(make, exc):
    with pytest.raises(exc):
        make()


def test_validation_messages_name_the_argument():
    with pytest.raises(ValueError, match="num_shards"):
        FixedShardsPartitioner(0)
    with pytest.raises(ValueError, match="min_shard_bytes"):
        MinSizePartitioner(min_shard_bytes=0)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        MaxSizePartitioner(0)
    with pytest.raises(ValueError, match="max_shards"):
        MaxSizePartitioner(10, max_shards=0)


ALL_PARTITIONERS = [
    FixedShardsPartitioner(2),
    MinSizePartitioner(4, max_shards=4),
    MaxSizePartitioner(16),
]


@pytest.mark.parametrize("p", ALL_PARTITIONERS, ids=repr)
@pytest.mark.parametrize("shape,dtype,axis,exc", [
    ((), np.float32, 0, ValueError),          # scalar
    ((None, 3), np.float32, 0, ValueError),   # not fully defined
    ((-1, 3), np.float32, 0, ValueError),     # negative dim
    ((2.0, 3), np.float32, 0, TypeError),     # non-int dim
    ("abc", np.float32, 0, TypeError),        # not a shape
    (5, np.float32, 0, TypeError),            # not a sequence
    ((4, 3), np.float32, 2, ValueError),      # axis out of range (TF: ValueError)
    ((4, 3), np.float32, -3, ValueError),
    ((4, 3), np.float32, 0.0, TypeError),
])
def test_call_validation(p, shape, dtype, axis, exc):
    with pytest.raises(exc):
        p(shape, dtype, axis=axis)


@pytest.mark.parametrize("p", ALL_PARTITIONERS[1:], ids=repr)
def test_bad_dtype(p):
    with pytest.raises(TypeError):
        p((4, 3), "not_a_dtype")


@pytest.mark.parametrize("args,exc", [
    ((-1, 2), ValueError), ((10, 0), ValueError), ((10, -2), ValueError),
    ((10, 2.0), TypeError), ((10.0, 2), TypeError),
])
def test_shard_row_offsets_validation(args, exc):
    with pytest.raises(exc):
        shard_row_offsets(*args)


def test_base_class():
    with pytest.raises(NotImplementedError):
        Partitioner()((4, 3), np.float32)
    for p in ALL_PARTITIONERS:
        assert isinstance(p, Partitioner)


def test_docstring_examples():
    result = doctest.testmod(P, extraglobs={"np": np})
    assert result.attempted > 0
    assert result.failed == 0
