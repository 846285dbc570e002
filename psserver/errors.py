"""Typed errors of the service, and their one mapping to gRPC status codes.

Server code raises these; the servicer turns them into a gRPC status with the
same message (``abort``); the client turns a gRPC status back into the same
type (``from_rpc_error``). Nothing classifies errors by message text.
"""
from __future__ import annotations

import grpc


class PSError(Exception):
    """Base class of every error the service reports.

    ``address`` is the parameter server the failed call went to, when the
    error came from a call (the coordinator uses it to recover that server).
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    address: str = ""


class InvalidArgument(PSError, ValueError):
    """The request is malformed: wrong shape, dtype, ids, hyper-parameter..."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PSError, KeyError):
    """No variable of that name on this parameter server."""

    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class AlreadyExists(PSError):
    """A variable of that name exists already."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(PSError):
    """The request is too large for a message, or for the server's memory."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(PSError):
    """The request is valid but the server's state does not allow it now."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotPrimary(PSError):
    """Replication: this copy of the variable does not take client updates now
    (it is a backup, or handing over to or superseded by the other copy).
    The caller asks both copies who is primary (VariableMeta.role, .epoch) and
    sends the call there; nothing was applied here."""

    code = grpc.StatusCode.ABORTED


class PermissionDenied(PSError):
    """The caller may not do this here (a path outside the server's
    checkpoint directories, a worker that runs no code without a token)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(PSError):
    """The call carried no token, or the wrong one."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(PSError, ConnectionError):
    """The server cannot be reached, or is shutting down. Retrying may help."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PSError, TimeoutError):
    """The call did not finish before its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(PSError):
    """A bug on the server side: the message says what happened."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[PSError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, AlreadyExists, ResourceExhausted,
                FailedPrecondition, NotPrimary, PermissionDenied, Unauthenticated, Unavailable,
                DeadlineExceeded, Internal)
}
# Codes gRPC itself produces that mean the same to a caller.
_BY_CODE[grpc.StatusCode.CANCELLED] = Unavailable


def from_rpc_error(exc: grpc.RpcError, target: str = "") -> PSError:
    """The typed error for a failed call (``raise from_rpc_error(e) from e``)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, PSError)
    where = f" [{target}]" if target else ""
    err = cls(f"{details}{where}")
    err.code = code
    err.address = target
    return err
