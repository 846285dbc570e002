"""The gRPC side of the typed errors (``psserver.contract``): one mapping.

The servicer aborts a call with ``grpc_code(exc.code)`` and the error's
message; the client turns a failed call back into the same type with
``from_rpc_error`` (``contract.error_for``). The error classes live in
``psserver.contract`` (free of grpc) and are re-exported here.
"""
from __future__ import annotations

import grpc

from psserver.contract import (  # noqa: F401  (re-exported)
    AlreadyExists, Code, DeadlineExceeded, FailedPrecondition, Internal, InvalidArgument,
    NotFound, NotPrimary, OutOfRange, PermissionDenied, PSError, ResourceExhausted,
    Unauthenticated, Unavailable, Unimplemented, error_for)

_GRPC = {c.value[0]: c for c in grpc.StatusCode}


def grpc_code(code: Code) -> grpc.StatusCode:
    """The gRPC status code of ``code`` (same number)."""
    return _GRPC[int(code)]


def from_rpc_error(exc: grpc.RpcError, target: str = "") -> PSError:
    """The typed error for a failed call (``raise from_rpc_error(e) from e``)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    number = code.value[0] if isinstance(code, grpc.StatusCode) else Code.UNKNOWN
    return error_for(number, details or "", target)
