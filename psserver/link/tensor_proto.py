"""numpy arrays in and out of ``ps_pb2.Tensor`` messages (the unary calls
and the fields the hand-framed codec does not cover: psserver/contract/wire.py).

The dtype and shape checks are the contract's (psserver/contract/tensor.py);
this module is where protobuf comes in, so the contract layer stays free of it.
"""
from __future__ import annotations

import numpy as np

from protos.pstrain.v1 import ps_pb2
from psserver.contract.tensor import (
    WIRE_DTYPES,
    _check_wire,
    check_dtype,
    check_shape,
    dtype_name,
    nbytes_of,
    to_bytes,
)
from psserver.errors import InvalidArgument


def fill(t: ps_pb2.Tensor, arr: np.ndarray, with_data: bool = True) -> ps_pb2.Tensor:
    """Write arr into the Tensor field t in place (without data: a frame header).

    Filling the field of the message being built, instead of building a
    Tensor and copying it in, saves a copy of the data per message level.
    """
    arr = np.asarray(arr)
    _check_wire(arr)
    t.dtype = dtype_name(arr.dtype)
    t.shape.extend(arr.shape)
    if with_data:
        t.data = to_bytes(arr)
    return t


def encode(arr: np.ndarray) -> ps_pb2.Tensor:
    return fill(ps_pb2.Tensor(), arr)


def spec(t: ps_pb2.Tensor, allowed=WIRE_DTYPES, what: str = "tensor") -> tuple[np.dtype, tuple[int, ...], int]:
    """Validated (dtype, shape, nbytes) of a Tensor message (or a ShmTensor)."""
    dt = check_dtype(t.dtype, allowed, f"{what} dtype")
    shape = check_shape(t.shape, f"{what} shape")
    return dt, shape, nbytes_of(shape, dt)


def decode(t: ps_pb2.Tensor, allowed=WIRE_DTYPES, what: str = "tensor") -> np.ndarray:
    """The array a Tensor message holds (read-only view of its bytes)."""
    dt, shape, n = spec(t, allowed, what)
    data = t.data   # each access of a bytes field makes a new copy: take it once
    if len(data) != n:
        raise InvalidArgument(
            f"{what} data has {len(data)} bytes but dtype {t.dtype} and shape "
            f"{list(shape)} need {n}")
    return np.frombuffer(data, dtype=dt).reshape(shape)
