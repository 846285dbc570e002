"""Variable partitioners, mirroring TensorFlow's.

These reproduce, arithmetic included, the partitioners of
``tf.distribute.experimental.partitioners`` (TensorFlow's
``tensorflow/python/distribute/sharded_variable.py``, which delegates to
``variable_axis_size_partitioner`` / ``min_max_variable_partitioner`` in
``tensorflow/python/ops/partitioned_variables.py``), and the uneven "div" row
split that ``ParameterServerStrategyV2._create_variable`` uses to cut a
variable into shards.

A partitioner is called as ``partitioner(shape, dtype, axis=0)`` and returns a
list with one entry per axis of ``shape``: the number of partitions on that
axis (e.g. ``[2, 1]``).  Only one axis is ever split; callers of this service
only split axis 0 (see :func:`num_shards_of` and :func:`shard_row_offsets`).

Deliberate differences from TensorFlow, all of them stricter:

* constructor arguments are validated eagerly and by type (TensorFlow's
  ``FixedShardsPartitioner`` validates nothing, and ``MaxSizePartitioner``
  silently treats ``max_shards=0`` as "no limit" because it tests
  ``if max_shards and max_shards < 1``; here ``0`` is rejected);
* ``MaxSizePartitioner`` on a shape with a 0 dimension raises ``ValueError``
  (TensorFlow divides by zero and raises ``ZeroDivisionError``);
* shapes must be fully defined, non-negative, rank >= 1; an axis outside the
  shape raises ``ValueError``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np

__all__ = [
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "shard_row_offsets",
    "num_shards_of",
    "element_size",
]

# The dtype name TensorFlow uses for its variable-length string type.
STRING_DTYPE = "string"

# Types numpy does not know by name, with TensorFlow's ``DType.size``.
_EXTRA_DTYPE_SIZES = {"bfloat16": 2}


# ---------------------------------------------------------------------------
# argument helpers
# ---------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_positive_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise TypeError(
            f"Argument `{name}` must be an int. Received: {value!r} "
            f"(type {type(value).__name__})"
        )
    if value < 1:
        raise ValueError(f"Argument `{name}` must be positive. Received: {value}")
    return int(value)


def _normalize_shape(shape: Any) -> list[int]:
    """Returns ``shape`` as a list of Python ints, or raises."""
    if hasattr(shape, "as_list") and callable(shape.as_list):  # e.g. tf.TensorShape
        try:
            shape = shape.as_list()
        except ValueError as exc:  # unknown rank
            raise ValueError(f"shape is not fully defined: {shape}") from exc
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)):
        raise TypeError(
            f"shape must be a tuple or list of ints. Received: {shape!r} "
            f"(type {type(shape).__name__})"
        )
    dims = []
    for d in list(shape):
        if d is None:
            raise ValueError(f"shape is not fully defined: {tuple(shape)}")
        if not _is_int(d):
            raise TypeError(
                f"shape must contain only ints. Received: {tuple(shape)!r}"
            )
        if d < 0:
            raise ValueError(f"shape dimensions must be >= 0. Received: {tuple(shape)}")
        dims.append(int(d))
    if not dims:
        raise ValueError("Can not partition a rank-0 (scalar) shape: ()")
    return dims


def _normalize_axis(axis: Any, dims: list[int]) -> int:
    if not _is_int(axis):
        raise TypeError(f"axis must be an int. Received: {axis!r}")
    rank = len(dims)
    if not -rank <= axis < rank:
        raise ValueError(
            f"Can not partition variable along axis {axis} when shape is only {tuple(dims)}"
        )
    return int(axis) % rank


def element_size(dtype: Any, bytes_per_string: int = 16) -> int:
    """Bytes per element of ``dtype``, as TensorFlow counts them.

    ``dtype`` is a numpy dtype (or anything ``np.dtype`` accepts, such as
    ``np.float32`` or ``"float32"``), the name ``"string"`` / ``"bfloat16"``,
    or an object with a ``name`` attribute giving such a name (``tf.DType``).
    Strings (``"string"``, numpy ``object``, ``bytes_`` and ``str_`` dtypes)
    count ``bytes_per_string`` bytes per element, as TensorFlow's partitioners
    do for ``tf.string``.

    >>> element_size("float32"), element_size(np.int64), element_size("string", 16)
    (4, 8, 16)
    """
    if dtype is None:
        raise TypeError("dtype must be given (a numpy dtype, a dtype name, or 'string')")
    name = dtype if isinstance(dtype, str) else None
    if name is None and not isinstance(dtype, (np.dtype, type)):
        name = getattr(dtype, "name", None)
        if not isinstance(name, str):
            name = None
    if name is not None:
        if name == STRING_DTYPE:
            return bytes_per_string
        if name in _EXTRA_DTYPE_SIZES:
            return _EXTRA_DTYPE_SIZES[name]
    try:
        np_dtype = np.dtype(name if name is not None else dtype)
    except TypeError as exc:
        raise TypeError(f"dtype is not a recognised data type: {dtype!r}") from exc
    if np_dtype.kind in ("O", "S", "U"):
        return bytes_per_string
    if np_dtype.itemsize < 1:
        raise TypeError(f"dtype has no fixed element size: {dtype!r}")
    return int(np_dtype.itemsize)


# ---------------------------------------------------------------------------
# partitioners
# ---------------------------------------------------------------------------


class Partitioner:
    """Partitioner base class: all partitioners inherit from this class.

    Partitioners implement ``__call__(shape, dtype, axis=0)``, which returns a
    list of ints, the number of partitions on each axis of ``shape`` (the i-th
    value is for the i-th axis).  For example a partitioner that splits a
    ``[10, 3]`` float32 variable in two along axis 0 returns ``[2, 1]``.
    """

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        """Partitions ``shape`` and returns the partitions per axis.

        Args:
          shape: a tuple or list of ints, the full shape of the variable.
          dtype: a numpy dtype, a dtype name, or ``"string"``.
          axis: the axis to partition along. Default: outermost axis.

        Returns:
          A list of ints, the number of partitions on each axis.
        """
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """Partitioner that allocates a fixed number of shards.

    The number of shards is capped at the size of the partitioned axis, as
    TensorFlow does: ``min(num_shards, shape[axis])``.  So a 0-row shape gives
    ``0`` shards on that axis, which :func:`num_shards_of` rejects (as
    ``ParameterServerStrategy`` does).

    Example:

    >>> partitioner = FixedShardsPartitioner(num_shards=2)
    >>> partitioner((10, 3), np.float32)
    [2, 1]
    >>> FixedShardsPartitioner(num_shards=8)((5, 3), "float32")  # min(8, 5)
    [5, 1]
    """

    def __init__(self, num_shards: int):
        """Creates a new ``FixedShardsPartitioner``.

        Args:
          num_shards: ``int``, number of shards to partition into (>= 1).
        """
        self._num_shards = _check_positive_int("num_shards", num_shards)

    @property
    def num_shards(self) -> int:
        return self._num_shards

    def __call__(self, shape, dtype, axis=0):
        del dtype  # unused, as in TensorFlow
        dims = _normalize_shape(shape)
        axis = _normalize_axis(axis, dims)
        result = [1] * len(dims)
        result[axis] = min(self._num_shards, dims[axis])
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """Partitioner that allocates a minimum size per shard.

    This partitioner ensures each shard has at least ``min_shard_bytes``, and
    tries to allocate as many shards as possible, i.e., keeping shard size as
    small as possible. The maximum number of such shards (upper bound) is given
    by ``max_shards``.

    The count is TensorFlow's ``min_max_variable_partitioner``::

        total_bytes = num_elements * element_size
        shards = max(1, min(shape[axis], max_shards,
                            ceil(total_bytes / min_shard_bytes)))

    Examples:

    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32)
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32)
    [6, 1]
    >>> # 1024x1024 float32 = 4 MiB; 4 MiB / 256 KiB = 16 shards
    >>> MinSizePartitioner(256 << 10, max_shards=32)((1024, 1024), "float32")
    [16, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1,
                 bytes_per_string: int = 16):
        """Creates a new ``MinSizePartitioner``.

        Args:
          min_shard_bytes: Minimum bytes of each shard. Defaults to 256K.
          max_shards: Upper bound on the number of shards. Defaults to 1.
          bytes_per_string: If the partition value is of type string, this
            provides an estimate of how large each string is.
        """
        self._min_shard_bytes = _check_positive_int("min_shard_bytes", min_shard_bytes)
        self._max_shards = _check_positive_int("max_shards", max_shards)
        self._bytes_per_string = _check_positive_int("bytes_per_string", bytes_per_string)

    def __call__(self, shape, dtype, axis=0):
        dims = _normalize_shape(shape)
        axis = _normalize_axis(axis, dims)
        bytes_per_element = element_size(dtype, self._bytes_per_string)
        total_size_bytes = math.prod(dims) * bytes_per_element
        partitions = total_size_bytes / self._min_shard_bytes  # float, as in TF
        partitions_list = [1] * len(dims)
        # We can not partition the variable beyond what its shape or
        # `max_shards` allows.
        partitions_list[axis] = max(
            1, min(dims[axis], self._max_shards, int(math.ceil(partitions))))
        return partitions_list

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, "
                f"max_shards={self._max_shards}, "
                f"bytes_per_string={self._bytes_per_string})")


class MaxSizePartitioner(Partitioner):
    """Partitioner that keeps shards below ``max_shard_bytes``.

    This partitioner ensures each shard has at most ``max_shard_bytes``, and
    tries to allocate as few shards as possible, i.e., keeping shard size as
    large as possible.

    If the partitioner hits the ``max_shards`` limit, then each shard may end
    up larger than ``max_shard_bytes``. By default ``max_shards`` equals
    ``None`` and no limit on the number of shards is enforced.  If a single
    slice (row) is already larger than ``max_shard_bytes``, every slice becomes
    its own shard.

    The count is TensorFlow's ``variable_axis_size_partitioner``::

        bytes_per_slice = (num_elements / shape[axis]) * element_size
        slices_per_shard = max(1, floor(max_shard_bytes / bytes_per_slice))
        shards = ceil(shape[axis] / slices_per_shard)
        shards = min(max_shards, shards)   # if max_shards is set

    Examples:

    >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32)
    [6, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32)
    [2, 1]
    >>> MaxSizePartitioner(max_shard_bytes=1024)((6, 1), np.float32)
    [1, 1]
    >>> # 100x10 float32: 40 B/row; 100 B -> 2 rows/shard -> ceil(100/2) = 50
    >>> MaxSizePartitioner(max_shard_bytes=100)((100, 10), "float32")
    [50, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None,
                 bytes_per_string: int = 16):
        """Creates a new ``MaxSizePartitioner``.

        Args:
          max_shard_bytes: The maximum size any given shard is allowed to be.
          max_shards: The maximum number of shards in ``int`` created taking
            precedence over ``max_shard_bytes``; ``None`` for no limit.
          bytes_per_string: If the partition value is of type string, this
            provides an estimate of how large each string is.
        """
        self._max_shard_bytes = _check_positive_int("max_shard_bytes", max_shard_bytes)
        self._max_shards = (None if max_shards is None
                            else _check_positive_int("max_shards", max_shards))
        self._bytes_per_string = _check_positive_int("bytes_per_string", bytes_per_string)

    def __call__(self, shape, dtype, axis=0):
        dims = _normalize_shape(shape)
        axis = _normalize_axis(axis, dims)
        elem_size = element_size(dtype, self._bytes_per_string)
        num_elements = math.prod(dims)
        if num_elements == 0:
            raise ValueError(
                f"MaxSizePartitioner can not partition a shape with a 0 dimension: "
                f"{tuple(dims)} (TensorFlow divides by zero here)"
            )
        partitions = [1] * len(dims)
        # Same float arithmetic as TensorFlow.
        bytes_per_slice = 1.0 * (num_elements / dims[axis]) * elem_size
        # How many slices can we fit on one shard of size at most
        # max_shard_bytes?  At least one slice is required.
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        # How many shards do we need for axis given that each shard fits
        # slices_per_shard slices from a total of dims[axis] slices?
        axis_shards = int(math.ceil(1.0 * dims[axis] / slices_per_shard))
        if self._max_shards:
            axis_shards = min(self._max_shards, axis_shards)
        partitions[axis] = axis_shards
        return partitions

    def __repr__(self) -> str:
        return (f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, "
                f"max_shards={self._max_shards}, "
                f"bytes_per_string={self._bytes_per_string})")


# ---------------------------------------------------------------------------
# shard layout helpers
# ---------------------------------------------------------------------------


def num_shards_of(partitions: Sequence[int]) -> int:
    """Number of shards along axis 0 of a partitioner's result.

    Validates the result as ``ParameterServerStrategy`` does: it must be a
    non-empty list whose first element is a positive int and whose other
    elements are all 1 (only axis 0 may be split).

    >>> num_shards_of([3, 1])
    3
    """
    if isinstance(partitions, (str, bytes)) or not isinstance(partitions, (Sequence, np.ndarray)):
        raise TypeError(f"partitions must be a list of ints. Received: {partitions!r}")
    parts = list(partitions)
    if not parts or any(not _is_int(p) for p in parts):
        raise ValueError(
            "variable partitioner must return a non-empty list of ints. "
            f"Received: {partitions!r}"
        )
    if parts[0] < 1 or any(p != 1 for p in parts[1:]):
        raise ValueError(
            "variable partitioner must return a list/tuple whose elements are 1 "
            f"besides the first element (positive), got: {parts!r}"
        )
    return int(parts[0])


def shard_row_offsets(num_rows: int, num_shards: int) -> list[int]:
    """Row offsets of each shard along axis 0: ``num_shards + 1`` ints.

    Shard ``i`` holds rows ``offsets[i]:offsets[i + 1]``.  This is
    ``ParameterServerStrategy``'s "div" split: every shard gets
    ``num_rows // num_shards`` rows and the first ``num_rows % num_shards``
    shards get one extra row.

    As in TensorFlow, the shard count is first capped at the number of rows
    (``min(num_shards, num_rows)``), so no shard is ever empty and the result
    then has ``min(num_shards, num_rows) + 1`` entries.  A 0-row variable is a
    single empty shard: ``[0, 0]``.

    >>> shard_row_offsets(10, 3)   # shard sizes [4, 3, 3]
    [0, 4, 7, 10]
    >>> shard_row_offsets(10, 4)   # shard sizes [3, 3, 2, 2]
    [0, 3, 6, 8, 10]
    >>> shard_row_offsets(2, 5)    # capped at 2 shards
    [0, 1, 2]
    """
    if not _is_int(num_rows):
        raise TypeError(f"num_rows must be an int. Received: {num_rows!r}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0. Received: {num_rows}")
    num_shards = _check_positive_int("num_shards", num_shards)
    num_rows = int(num_rows)
    if num_rows == 0:
        return [0, 0]
    n = min(num_shards, num_rows)
    base, extra = divmod(num_rows, n)
    offsets = [0]
    for i in range(n):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    assert offsets[-1] == num_rows
    return offsets
