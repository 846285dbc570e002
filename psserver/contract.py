"""What both sides of the wire agree on, free of grpc and protobuf.

The status codes, the typed errors and their one mapping from a code, the
protocol's constants and call metadata, and the plain records a call
carries (initializer, sync step, variable metadata). The parameter-server
logic (``psserver.store``, ``optimizers``, ``sync``, ``replication``) imports
from here and runs where neither grpc nor protobuf is installed; the
transports (``psserver.errors`` for gRPC, ``psserver.ipc`` for sockets)
turn a code on the wire into these errors with ``error_for`` and nothing
else: no error is ever classified by its message text.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Mapping


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
#: psserver/methods.py's WORKER): a worker's ABORTED is its fence, not a
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


# -- the protocol --------------------------------------------------------------------

#: 2: replication is chain replication (Replicate, Reconfigure; backups refuse
#: client updates), so a version-1 peer would break it. 3: dynamic-table
#: look-ups and updates ride the bulk Read and Push (ReadRequest.table_lookups,
#: PushRequest.table_updates); ServerInfo.data_port, WorkerInfo.ipc_socket and
#: data_port, ShmAttachReply.ipc_socket are gone (HostInfo says them). Peers
#: of different versions refuse each other, saying which is older.
PROTOCOL_VERSION = 3

#: Largest message either side accepts, and so the most tensor bytes one unary
#: call carries. Larger tensors go over ReadStream / Upload in frames of
#: DEFAULT_CHUNK_BYTES. 64 MiB keeps one message's copies cheap next to the
#: machine's memory while letting typical layers travel in one call.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
#: Frame size on the streams. Measured in bench/bench_ps.py on a 2-core machine:
#: 1-2 MiB frames moved 64 MiB fastest; 8 MiB and larger were 1.5-3x slower
#: (each frame is copied a few times, and small frames stay in the L2 cache).
DEFAULT_CHUNK_BYTES = 1 << 20
#: Tensors above this go over the streams even when they would fit one
#: message. Streams win for large tensors (a 16 MiB read in 1 MiB frames was
#: 1.8-4.7x faster than unary, bench/bench_ps.py sweep) but cost a thread and
#: per-frame work: the MLP benchmark's 1.33 MB shard transfers ran its steps
#: 1.36x faster unary (bench/suite.py A/B, with MALLOC_ENV).
DEFAULT_STREAM_THRESHOLD_BYTES = 4 << 20
#: Room for the non-tensor fields of a message on top of its tensor bytes.
MESSAGE_OVERHEAD = 64 << 10

#: Environment variable holding the shared auth token (see docs/configuration.md).
TOKEN_ENV = "PSTRAIN_AUTH_TOKEN"
#: Metadata key of the token on every call.
TOKEN_METADATA_KEY = "authorization"
#: Metadata key carrying the caller's protocol version (PROTOCOL_VERSION).
PROTOCOL_METADATA_KEY = "x-pstrain-protocol"


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata every client call carries: the protocol version, the token."""
    md = ((PROTOCOL_METADATA_KEY, str(PROTOCOL_VERSION)),)
    return md + ((TOKEN_METADATA_KEY, f"Bearer {token}"),) if token else md


# -- what calls carry ------------------------------------------------------------------

#: Steps, versions and step counts stay below this (they grow by one at a
#: time, and must fit the wire's int64 with room to spare).
MAX_COUNT = 1 << 62

#: Replica roles of a variable's copy (ReplicaRole in ps.proto).
ROLE_PRIMARY, ROLE_BACKUP = 0, 1


@dataclasses.dataclass(frozen=True)
class Peer:
    """The other copy of a replicated variable: its server and its name there."""
    address: str
    name: str


@dataclasses.dataclass(frozen=True)
class Initializer:
    kind: str = "zeros"
    value: float = 0.0
    mean: float = 0.0
    stddev: float = 1.0
    minval: float = 0.0
    maxval: float = 1.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class VariableMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    version: int
    optimizer: str
    optimizer_params: Mapping[str, float]
    nbytes: int
    slot_nbytes: int
    allow_nonfinite: bool
    sync_steps: int = 0
    dropped_gradients: int = 0
    role: int = ROLE_PRIMARY
    epoch: int = 0
    backup: Peer | None = None


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """Which step and replica a sync gradient belongs to (see SyncInfo in ps.proto)."""
    step: int
    replica: int
    num_replicas: int
    required: int
    sum: bool = False
    step_timeout: float = 0.0
    #: Hybrid mode: only dense gradients join the step; row-wise ones (tables)
    #: are applied on arrival (servers refuse a row-wise sync push marked so).
    hybrid: bool = False

    @classmethod
    def of(cls, info) -> "SyncSpec":
        """The SyncSpec a SyncInfo message (ps.proto) carries (not validated)."""
        return cls(info.step, info.replica, info.num_replicas, info.required, info.sum,
                   info.step_timeout, info.hybrid)

    def validate(self) -> "SyncSpec":
        if not 0 <= self.step < MAX_COUNT:
            raise InvalidArgument(f"sync step must be in [0, 2**62), got {self.step}")
        if not 0 < self.required <= self.num_replicas:
            raise InvalidArgument(
                f"sync push needs 0 < required ({self.required}) <= num_replicas "
                f"({self.num_replicas})")
        if not 0 <= self.replica < self.num_replicas:
            raise InvalidArgument(
                f"sync replica {self.replica} is not in [0, {self.num_replicas})")
        if not self.step_timeout >= 0:
            raise InvalidArgument(f"step_timeout must be >= 0, got {self.step_timeout}")
        return self


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


# -- names ---------------------------------------------------------------------------

#: Replication names of dynamic table shards: "~table~<table name>" ("~" starts
#: no variable name), so GetMeta, Reconfigure and replication records reach
#: a table shard as they reach a variable.
TABLE_PREFIX = "~table~"
#: Names of the backup copies of replicated table shards and variable shards
#: ("_backup/<name>" on the next server: coordinator.strategy and
#: coordinator.embedding make them); a table of such a name is refused at Create.
BACKUP_PREFIX = "_backup/"
