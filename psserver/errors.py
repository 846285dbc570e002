"""The typed errors every role raises and catches, free of grpc and protobuf.

One class per status code (``Code``, numbered as gRPC's), and the one
mapping from a code to its class (``error_for``) that every transport uses:
the gRPC one (``psserver.link.grpc_common.from_rpc_error``) and the sockets'
(``psserver.link.frames``). No error is ever classified by its message
text. ``except psserver.errors.PSError`` catches every error the service
reports; ``NotFound`` is also a ``KeyError``, ``InvalidArgument`` a
``ValueError``, ``Unavailable`` a ``ConnectionError`` and
``DeadlineExceeded`` a ``TimeoutError``.
"""
from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """Status codes, numbered as gRPC's (the sockets send the number)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class PSError(Exception):
    """Base class of every error the service reports.

    ``code`` is the status the call ended with; ``address`` is the task the
    failed call went to, when the error came from a call (the coordinator
    uses it to recover that server).
    """

    code: Code = Code.UNKNOWN
    address: str = ""


class InvalidArgument(PSError, ValueError):
    """The request is malformed: wrong shape, dtype, ids, hyper-parameter..."""

    code = Code.INVALID_ARGUMENT


class NotFound(PSError, KeyError):
    """No variable of that name on this parameter server."""

    code = Code.NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class AlreadyExists(PSError):
    """A variable of that name exists already."""

    code = Code.ALREADY_EXISTS


class ResourceExhausted(PSError):
    """The request is too large for a message, or for the server's memory."""

    code = Code.RESOURCE_EXHAUSTED


class FailedPrecondition(PSError):
    """The request is valid but the server's state does not allow it now."""

    code = Code.FAILED_PRECONDITION


class NotPrimary(PSError):
    """Replication: this copy of the variable does not take client updates now
    (it is a backup, or handing over to or superseded by the other copy).
    The caller asks both copies who is primary (VariableMeta.role, .epoch) and
    sends the call there; nothing was applied here."""

    code = Code.ABORTED


class PermissionDenied(PSError):
    """The caller may not do this here (a path outside the server's
    checkpoint directories, a worker that runs no code without a token)."""

    code = Code.PERMISSION_DENIED


class Unauthenticated(PSError):
    """The call carried no token, or the wrong one."""

    code = Code.UNAUTHENTICATED


class Unimplemented(PSError):
    """The server does not offer this call (an older server, or a service
    switched off there)."""

    code = Code.UNIMPLEMENTED


class OutOfRange(PSError):
    """The request reaches past what it may use (a shared-memory segment too
    small for the read it names): nothing was done."""

    code = Code.OUT_OF_RANGE


class Unavailable(PSError, ConnectionError):
    """The server cannot be reached, or is shutting down. Retrying may help."""

    code = Code.UNAVAILABLE


class NotSent(Unavailable):
    """The request never reached the task (a refused or lost connection before
    it went out): nothing ran there, so any call may be made again, another
    way (psserver/link/channel.py sends it over gRPC)."""


class WorkerRestarted(PSError):
    """A worker call fenced to an earlier run of that worker (its process
    restarted, and its datasets with it): reconnect and create them again."""

    code = Code.ABORTED


class DeadlineExceeded(PSError, TimeoutError):
    """The call did not finish before its deadline."""

    code = Code.DEADLINE_EXCEEDED


class Internal(PSError):
    """A bug on the server side: the message says what happened."""

    code = Code.INTERNAL


_BY_CODE: dict[Code, type[PSError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, AlreadyExists, ResourceExhausted,
                FailedPrecondition, NotPrimary, PermissionDenied, Unauthenticated,
                Unimplemented, OutOfRange, Unavailable, DeadlineExceeded, Internal)
}
# Codes a transport itself produces that mean the same to a caller.
_BY_CODE[Code.CANCELLED] = Unavailable
#: Where a service gives a code a meaning of its own (by service name:
#: psserver/link/methods.py's WORKER): a worker's ABORTED is its fence, not a
#: replica's.
_BY_SERVICE: dict[str, dict[Code, type[PSError]]] = {
    "pstrain.v1.Worker": {Code.ABORTED: WorkerRestarted}}


def error_for(code: int | Code, message: str, target: str = "", service: str = "") -> PSError:
    """The typed error for a call that ended with ``code`` (a Code or its
    number), as every transport makes it: one class per code (per
    ``service`` where it has its own), the message as the server wrote it,
    ``[target]`` appended."""
    try:
        code = Code(int(code))
    except ValueError:
        code = Code.UNKNOWN
    cls = _BY_SERVICE[service].get(code) if service in _BY_SERVICE else None
    cls = cls or _BY_CODE.get(code, PSError)
    err = cls(f"{message} [{target}]" if target else message)
    err.code = code
    err.address = target
    return err


def as_error(exc: BaseException) -> PSError:
    """What a handler's exception tells the caller: a PSError as it is; running
    out of memory as RESOURCE_EXHAUSTED; anything else is a bug, INTERNAL
    with its type and message (the transport logs its traceback on the
    server)."""
    if isinstance(exc, PSError):
        return exc
    if isinstance(exc, MemoryError):
        return ResourceExhausted(
            "the task ran out of memory for this request. Requests are checked in full "
            "before anything changes, but an update of several variables may have been "
            "applied to some of them: resend it with the same update keys")
    return Internal(f"internal error: {type(exc).__name__}: {exc}")
