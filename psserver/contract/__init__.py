"""What every role agrees on, free of grpc and protobuf: the contract layer.

The protocol's version and limits, the call metadata, the plain records a
call carries (initializer, sync step, variable metadata, a replica's peer),
the replication actions and the names that mark table shards and backups.
The modules of this package are the rest of the contract: the wire formats
(``wire``, ``wire_decode``, ``tensor``), which transport a call takes
(``routing``), the key-to-shard function (``keys``), shared-memory segments
(``shm``), the checkpoint format (``checkpoint_format``), TF_CONFIG
(``tf_config``) and the optimizers' arithmetic (``optimizers``, ``rows``),
which servers apply and the coordinator checks checkpoints against. The typed
errors are ``psserver.errors``. Nothing here imports grpc, protobuf or any
other layer (tests/contract/test_layers.py).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from psserver import errors as _errors

# -- the protocol --------------------------------------------------------------------

#: 2: replication is chain replication (Replicate, Reconfigure; backups refuse
#: client updates), so a version-1 peer would break it. 3: dynamic-table
#: look-ups and updates ride the bulk Read and Push (ReadRequest.table_lookups,
#: PushRequest.table_updates); ServerInfo.data_port, WorkerInfo.ipc_socket and
#: data_port, ShmAttachReply.ipc_socket are gone (HostInfo says them). 4:
#: dynamic-table keys go to shards by bucket (psserver.contract.keys), not
#: hash % shards: a version-3 coordinator and a version-4 one would look for
#: a key's row on different servers of one table. Peers of different
#: versions refuse each other, saying which is older.
PROTOCOL_VERSION = 4

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


def join_host_port(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- what calls carry ------------------------------------------------------------------

#: Steps, versions and step counts stay below this (they grow by one at a
#: time, and must fit the wire's int64 with room to spare).
MAX_COUNT = 1 << 62

#: Replica roles of a variable's copy (ReplicaRole in ps.proto).
ROLE_PRIMARY, ROLE_BACKUP = 0, 1
#: Replica changes (ReplicaChange.Action in ps.proto) a coordinator sends.
PROMOTE, SET_BACKUP, DROP_BACKUP, DEMOTE = 0, 1, 2, 3
ACTION_NAMES = {PROMOTE: "PROMOTE", SET_BACKUP: "SET_BACKUP", DROP_BACKUP: "DROP_BACKUP",
                DEMOTE: "DEMOTE"}

#: Epochs stay below this: a coordinator adds one per change, within int64.
MAX_EPOCH = 1 << 62


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
    gathering: int = 0   # a sync step being gathered here: its number + 1 (0: none)


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
            raise _errors.InvalidArgument(f"sync step must be in [0, 2**62), got {self.step}")
        if not 0 < self.required <= self.num_replicas:
            raise _errors.InvalidArgument(
                f"sync push needs 0 < required ({self.required}) <= num_replicas "
                f"({self.num_replicas})")
        if not 0 <= self.replica < self.num_replicas:
            raise _errors.InvalidArgument(
                f"sync replica {self.replica} is not in [0, {self.num_replicas})")
        if not self.step_timeout >= 0:
            raise _errors.InvalidArgument(f"step_timeout must be >= 0, got {self.step_timeout}")
        return self



@dataclasses.dataclass(frozen=True)
class TableRead:
    """One look-up of a dynamic table's shard in a read (ReadRequest.table_lookups): ``keys`` (with
    ``counts``, their occurrences in the batch; or bags: ``offsets`` and
    ``weights``, psserver/core/bags.py), ``admit`` (False: nothing counted,
    created or evicted), ``sync_step`` (wait for earlier steps first)."""
    name: str
    keys: np.ndarray
    counts: np.ndarray | None = None
    admit: bool = True
    offsets: np.ndarray | None = None
    weights: np.ndarray | None = None
    sync_step: int | None = None


@dataclasses.dataclass(frozen=True)
class TableWrite:
    """One update of a dynamic table's shard in a push (PushRequest.table_updates): gradient rows of
    ``keys`` (or of bags: ``offsets``, ``weights``), applied once per
    non-zero ``update_id``; ``sync``: this replica's share of a step."""
    name: str
    keys: np.ndarray
    grads: np.ndarray
    update_id: int = 0
    sync: SyncSpec | None = None
    offsets: np.ndarray | None = None
    weights: np.ndarray | None = None


# -- names ---------------------------------------------------------------------------

#: Replication names of dynamic table shards: "~table~<table name>" ("~" starts
#: no variable name), so GetMeta, Reconfigure and replication records reach
#: a table shard as they reach a variable.
TABLE_PREFIX = "~table~"
#: Names of the backup copies of replicated table shards and variable shards
#: ("_backup/<name>" on the next server: coordinator.strategy and
#: coordinator.embedding make them); a table of such a name is refused at Create.
BACKUP_PREFIX = "_backup/"


def __getattr__(name: str):
    """The typed errors lived here before psserver.errors held them: the old
    path still works, deprecated (docs/client.md, "Moved names")."""
    import warnings

    from psserver import errors
    if name in errors.__dict__ and not name.startswith("_") and name not in (
            "annotations", "enum"):
        warnings.warn(f"psserver.contract.{name} moved to psserver.errors.{name}; import it "
                      "from there", DeprecationWarning, stacklevel=2)
        return getattr(errors, name)
    raise AttributeError(f"module 'psserver.contract' has no attribute {name!r}")
