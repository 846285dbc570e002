"""The tensors on the wire: which dtypes and shapes travel, and their bytes
(raw little-endian, row-major). The checks every decoder applies, float16
conversion, and ``all_finite``. Putting them in and out of protobuf
``Tensor`` messages is psserver/link/tensor_proto.py (decoding there is
``np.frombuffer`` over the message's bytes: no per-element work, no copy).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from psserver.errors import InvalidArgument

#: dtypes a variable may have (name -> little-endian numpy dtype).
VALUE_DTYPES = {name: np.dtype(name).newbyteorder("<")
                for name in ("float16", "float32", "float64")}
#: dtypes ids may have.
ID_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ("int32", "int64")}
WIRE_DTYPES = {**VALUE_DTYPES, **ID_DTYPES}
#: The name of each wire dtype, by dtype: an array whose dtype is here goes on
#: the wire as its bytes are (little-endian; hot paths look it up inline).
WIRE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in WIRE_DTYPES.items()}

MAX_RANK = 8

_NAMES: dict[np.dtype, str] = {}


def dtype_name(dt: np.dtype) -> str:
    """``dt.name``, remembered: numpy works it out in Python on every access
    (about 4 us, several times per tensor on the hot paths)."""
    try:
        return _NAMES[dt]
    except KeyError:
        name = dt.name
        if len(_NAMES) < 64:
            _NAMES[dt] = name
        return name


def check_dtype(name: str, allowed=VALUE_DTYPES, what: str = "dtype") -> np.dtype:
    try:
        return allowed[name]
    except KeyError:
        raise InvalidArgument(
            f"unsupported {what} {name!r}; use one of {sorted(allowed)}") from None


#: Most elements a shape may describe, counting a 0 dimension as 1 (numpy
#: refuses to even describe an array whose dimensions multiply past its index
#: range, empty or not: [0, 2**62] is "too big"). 2**48 elements is a petabyte
#: of float32, far beyond any one variable's shard.
MAX_ELEMENTS = 1 << 48


def check_shape(shape: Sequence[int], what: str = "shape") -> tuple[int, ...]:
    shape = tuple(map(int, shape))
    if len(shape) > MAX_RANK:
        raise InvalidArgument(f"{what} {list(shape)} has rank {len(shape)}; at most {MAX_RANK} is supported")
    if shape and min(shape) < 0:
        raise InvalidArgument(f"{what} {list(shape)} has a negative dimension")
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise InvalidArgument(f"{what} {list(shape)} is too large (over 2**48 elements, even "
                              "counting empty dimensions as 1); shard the variable instead")
    return shape


def nbytes_of(shape: Sequence[int], dtype: np.dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


FLOAT16_MAX = float(np.finfo(np.float16).max)   # 65504
SMALLEST_NORMAL16 = 2.0 ** -14                  # float16's smallest normal
#: ReadRequest.value_dtype: what a read may ask its float values to be sent as.
READ_AS = {"": None, "float16": np.dtype("<f2")}


def read_as(name: str) -> np.dtype | None:
    """The dtype a ReadRequest's ``value_dtype`` asks for (None: the values' own)."""
    if name not in READ_AS:
        raise InvalidArgument(
            f"value_dtype must be \"\" (values as they are) or \"float16\", got {name!r}")
    return READ_AS[name]


def as_float16(arr: np.ndarray) -> np.ndarray:
    """A float32/float64 array as float16, finite values clipped to +-65504
    (float16's largest finite value) and rounded to nearest even, bit for bit
    what numpy's ``astype(np.float16)`` gives; NaN and +-Inf stay NaN and
    +-Inf (a value that is already non-finite is never passed off as a
    large finite one); arrays of other dtypes as they are.
    Rounding twice gives what rounding once does, whichever side does it.

    numpy converts a value that lands below float16's smallest normal (2**-14,
    as small gradients do) about 25 times slower than the others (it raises
    the underflow flag per value): 90 ms for 4.5 MB of small gradients. A
    finite float32 array is converted here with integer arithmetic instead
    (_float32_to_16: the same ~4 ms whatever the values); float64 and arrays
    with NaN or Inf round their subnormals by hand (round(|x| * 2**24) units
    of 2**-24) and the rest with numpy.
    """
    arr = np.asarray(arr)
    if arr.dtype.kind != "f" or arr.dtype.itemsize <= 2:
        return arr
    if arr.dtype == np.float32 and arr.dtype.isnative:
        flat = np.ascontiguousarray(arr).reshape(-1)
        with np.errstate(all="ignore"):
            finite = np.isfinite(np.dot(flat, flat))   # NaN and Inf propagate (variable.py)
        if finite:
            return _float32_to_16(flat).reshape(arr.shape)
    mag = np.abs(arr)
    with np.errstate(invalid="ignore"):
        big = (mag > FLOAT16_MAX) & (mag != np.inf)   # finite, beyond float16's range
    if big.any():   # clipped; NaN compares False and Inf is left out: both kept
        arr = np.where(big, np.copysign(FLOAT16_MAX, arr), arr)
    tiny = mag < SMALLEST_NORMAL16
    if not tiny.any():
        return arr.astype(np.float16)
    half = np.where(tiny, 0, arr).astype(np.float16)
    small = arr[tiny]
    bits = np.rint(np.abs(small) * 2.0 ** 24).astype(np.uint16)   # 0 .. 1024 (1024: 2**-14)
    bits |= np.signbit(small).astype(np.uint16) << 15
    half.view(np.uint16)[tiny] = bits
    return half


def _float32_to_16(a: np.ndarray) -> np.ndarray:
    """Finite 1-D float32 -> float16 clipped to +-65504, round to nearest even,
    without branches (so without numpy's slow path): normal results by
    rebiasing the exponent and rounding the mantissa's low 13 bits; results
    below 2**-14 by adding 0.5 in float32 (which rounds at 2**-24, float16's
    subnormal unit); each element takes one of the two by arithmetic."""
    u = np.uint32
    bits = a.view(u)
    x = bits & u(0x7FFFFFFF)                       # |a|
    np.minimum(x, u(0x477FE000), out=x)            # clipped to 65504 (ordered as integers)
    n = x >> u(13)
    n &= u(1)                                      # the last kept mantissa bit: ties to even
    n += x
    n += u(0xC8000FFF)                             # exponent 127 -> 15 bias, + half a unit - 1
    n >>= u(13)                                    # float16 bits if normal
    sub = (x.view(np.float32) + np.float32(0.5)).view(u)
    sub -= u(0x3F000000)                           # float16 bits if below 2**-14
    tiny = (x < u(0x38800000)).view(np.uint8).astype(u)   # |a| < 2**-14
    sub -= n
    sub *= tiny
    n += sub                                       # n, or sub where tiny
    sign = bits >> u(16)
    sign &= u(0x8000)
    n |= sign
    return n.astype(np.uint16).view(np.float16)


_WIDE: dict = {}   # dtype -> the value of every float16 bit pattern in it (65536 of them)


def widen_float16(half: np.ndarray, dtype=np.float32, out: np.ndarray | None = None
                  ) -> np.ndarray:
    """A float16 array in ``dtype`` (float32 or float64), exactly, by table
    (numpy's own cast is ~5 times slower on float16 subnormals); into ``out``
    (of ``half``'s shape and that dtype) when given."""
    dt = np.dtype(dtype)
    table = _WIDE.get(dt)
    if table is None:
        table = _WIDE[dt] = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(dt)
    codes = np.asarray(half).view(np.uint16)
    if out is None:
        return np.take(table, codes)
    return np.take(table, codes, out=out)


def _check_wire(arr: np.ndarray) -> None:
    if dtype_name(arr.dtype) not in WIRE_DTYPES:
        raise InvalidArgument(
            f"cannot send dtype {arr.dtype.name!r}; use one of {sorted(WIRE_DTYPES)}")


def to_bytes(arr: np.ndarray) -> bytes:
    """The raw little-endian, row-major bytes of arr (one copy)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr).tobytes()


def all_finite(a: np.ndarray) -> bool:
    """No NaN or Inf in a. Fast path: a sum of squares (BLAS dot product, 1.7x
    faster than np.sum here) is finite only if every term is (NaN and Inf
    propagate; squares cannot cancel), and costs no temporary; only one
    that overflowed needs the element-wise check."""
    with np.errstate(all="ignore"):
        if a.dtype in (np.float32, np.float64) and a.flags.c_contiguous:
            flat = a.reshape(-1)
            fast = np.dot(flat, flat)
        else:
            fast = np.sum(a, dtype=np.float64 if a.dtype == np.float16 else None)
        if np.isfinite(fast):
            return True
    return bool(np.isfinite(a).all())
