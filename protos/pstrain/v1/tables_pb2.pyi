from protos.pstrain.v1 import ps_pb2 as _ps_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TableSpec(_message.Message):
    __slots__ = ("dim", "dtype", "initializer", "optimizer", "min_count", "probability", "capacity", "policy", "max_age_steps", "max_age_seconds", "admission_capacity", "seed")
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_AGE_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    dim: int
    dtype: str
    initializer: _ps_pb2.Initializer
    optimizer: _ps_pb2.OptimizerSpec
    min_count: int
    probability: float
    capacity: int
    policy: str
    max_age_steps: int
    max_age_seconds: float
    admission_capacity: int
    seed: int
    def __init__(self, dim: _Optional[int] = ..., dtype: _Optional[str] = ..., initializer: _Optional[_Union[_ps_pb2.Initializer, _Mapping]] = ..., optimizer: _Optional[_Union[_ps_pb2.OptimizerSpec, _Mapping]] = ..., min_count: _Optional[int] = ..., probability: _Optional[float] = ..., capacity: _Optional[int] = ..., policy: _Optional[str] = ..., max_age_steps: _Optional[int] = ..., max_age_seconds: _Optional[float] = ..., admission_capacity: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("name", "spec", "exist_ok")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: TableSpec
    exist_ok: bool
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[TableSpec, _Mapping]] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class TableRef(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("name", "spec", "rows", "step", "lookups", "hits", "admitted", "not_admitted", "evicted_capacity", "evicted_age", "updated", "dropped", "bytes", "sync_steps", "late", "layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    EVICTED_AGE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEPS_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: TableSpec
    rows: int
    step: int
    lookups: int
    hits: int
    admitted: int
    not_admitted: int
    evicted_capacity: int
    evicted_age: int
    updated: int
    dropped: int
    bytes: int
    sync_steps: int
    late: int
    layout: str
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[TableSpec, _Mapping]] = ..., rows: _Optional[int] = ..., step: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., admitted: _Optional[int] = ..., not_admitted: _Optional[int] = ..., evicted_capacity: _Optional[int] = ..., evicted_age: _Optional[int] = ..., updated: _Optional[int] = ..., dropped: _Optional[int] = ..., bytes: _Optional[int] = ..., sync_steps: _Optional[int] = ..., late: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("name", "keys", "no_admit", "counts", "sync")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NO_ADMIT_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    name: str
    keys: _ps_pb2.Tensor
    no_admit: bool
    counts: _ps_pb2.Tensor
    sync: _ps_pb2.SyncRead
    def __init__(self, name: _Optional[str] = ..., keys: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., no_admit: _Optional[bool] = ..., counts: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., sync: _Optional[_Union[_ps_pb2.SyncRead, _Mapping]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _ps_pb2.Tensor
    def __init__(self, rows: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TableUpdateRequest(_message.Message):
    __slots__ = ("name", "keys", "grads", "update_id", "sync")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    name: str
    keys: _ps_pb2.Tensor
    grads: _ps_pb2.Tensor
    update_id: int
    sync: _ps_pb2.SyncInfo
    def __init__(self, name: _Optional[str] = ..., keys: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., grads: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., update_id: _Optional[int] = ..., sync: _Optional[_Union[_ps_pb2.SyncInfo, _Mapping]] = ...) -> None: ...

class TableUpdateReply(_message.Message):
    __slots__ = ("updated", "dropped", "step", "late")
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    updated: int
    dropped: int
    step: int
    late: bool
    def __init__(self, updated: _Optional[int] = ..., dropped: _Optional[int] = ..., step: _Optional[int] = ..., late: _Optional[bool] = ...) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesReply(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ...) -> None: ...

class DeleteTableReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class SaveTableRequest(_message.Message):
    __slots__ = ("name", "directory", "save_id", "since", "incarnation", "stream", "weights_only")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    name: str
    directory: str
    save_id: int
    since: int
    incarnation: str
    stream: str
    weights_only: bool
    def __init__(self, name: _Optional[str] = ..., directory: _Optional[str] = ..., save_id: _Optional[int] = ..., since: _Optional[int] = ..., incarnation: _Optional[str] = ..., stream: _Optional[str] = ..., weights_only: _Optional[bool] = ...) -> None: ...

class SaveTableReply(_message.Message):
    __slots__ = ("file", "rows", "bytes", "step", "kind", "evicted", "incarnation", "crc32")
    FILE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    file: str
    rows: int
    bytes: int
    step: int
    kind: _ps_pb2.SaveKind
    evicted: int
    incarnation: str
    crc32: int
    def __init__(self, file: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[_ps_pb2.SaveKind, str]] = ..., evicted: _Optional[int] = ..., incarnation: _Optional[str] = ..., crc32: _Optional[int] = ...) -> None: ...

class ImportTableRequest(_message.Message):
    __slots__ = ("name", "reset", "keys", "values", "slots", "age_steps", "age_seconds", "freq", "step", "replica", "capacity", "applied", "buckets", "layout_epoch", "staged", "delta", "dropped")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    AGE_STEPS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FREQ_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    name: str
    reset: bool
    keys: _ps_pb2.Tensor
    values: _ps_pb2.Tensor
    slots: _containers.RepeatedCompositeFieldContainer[_ps_pb2.SlotValue]
    age_steps: _ps_pb2.Tensor
    age_seconds: _ps_pb2.Tensor
    freq: _ps_pb2.Tensor
    step: int
    replica: ReplicaCopy
    capacity: int
    applied: _containers.RepeatedCompositeFieldContainer[AppliedKeys]
    buckets: bytes
    layout_epoch: int
    staged: bool
    delta: bool
    dropped: _ps_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., reset: _Optional[bool] = ..., keys: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., slots: _Optional[_Iterable[_Union[_ps_pb2.SlotValue, _Mapping]]] = ..., age_steps: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., age_seconds: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., freq: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., step: _Optional[int] = ..., replica: _Optional[_Union[ReplicaCopy, _Mapping]] = ..., capacity: _Optional[int] = ..., applied: _Optional[_Iterable[_Union[AppliedKeys, _Mapping]]] = ..., buckets: _Optional[bytes] = ..., layout_epoch: _Optional[int] = ..., staged: _Optional[bool] = ..., delta: _Optional[bool] = ..., dropped: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AppliedKeys(_message.Message):
    __slots__ = ("buckets", "ids")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    buckets: bytes
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, buckets: _Optional[bytes] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaCopy(_message.Message):
    __slots__ = ("spec", "epoch", "version", "complete", "applied_ids", "sync_steps")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_IDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEPS_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    epoch: int
    version: int
    complete: bool
    applied_ids: _containers.RepeatedScalarFieldContainer[int]
    sync_steps: int
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., epoch: _Optional[int] = ..., version: _Optional[int] = ..., complete: _Optional[bool] = ..., applied_ids: _Optional[_Iterable[int]] = ..., sync_steps: _Optional[int] = ...) -> None: ...

class ImportTableReply(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class MoveBucketsRequest(_message.Message):
    __slots__ = ("name", "buckets", "destination", "capacity", "layout_epoch", "layout", "layout_only", "shard", "fence", "destination_capacity", "source_server_id", "source_leaves", "precopy")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ONLY_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LEAVES_FIELD_NUMBER: _ClassVar[int]
    PRECOPY_FIELD_NUMBER: _ClassVar[int]
    name: str
    buckets: bytes
    destination: str
    capacity: int
    layout_epoch: int
    layout: str
    layout_only: bool
    shard: int
    fence: bool
    destination_capacity: int
    source_server_id: str
    source_leaves: bool
    precopy: bool
    def __init__(self, name: _Optional[str] = ..., buckets: _Optional[bytes] = ..., destination: _Optional[str] = ..., capacity: _Optional[int] = ..., layout_epoch: _Optional[int] = ..., layout: _Optional[str] = ..., layout_only: _Optional[bool] = ..., shard: _Optional[int] = ..., fence: _Optional[bool] = ..., destination_capacity: _Optional[int] = ..., source_server_id: _Optional[str] = ..., source_leaves: _Optional[bool] = ..., precopy: _Optional[bool] = ...) -> None: ...

class MoveBucketsReply(_message.Message):
    __slots__ = ("rows", "bytes", "held", "moved", "sent")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    rows: int
    bytes: int
    held: int
    moved: bool
    sent: int
    def __init__(self, rows: _Optional[int] = ..., bytes: _Optional[int] = ..., held: _Optional[int] = ..., moved: _Optional[bool] = ..., sent: _Optional[int] = ...) -> None: ...
