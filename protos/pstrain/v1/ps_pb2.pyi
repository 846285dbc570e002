from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_PRIMARY: _ClassVar[ReplicaRole]
    ROLE_BACKUP: _ClassVar[ReplicaRole]

class SaveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAVE_FULL: _ClassVar[SaveKind]
    SAVE_DELTA: _ClassVar[SaveKind]
    SAVE_UNCHANGED: _ClassVar[SaveKind]
ROLE_PRIMARY: ReplicaRole
ROLE_BACKUP: ReplicaRole
SAVE_FULL: SaveKind
SAVE_DELTA: SaveKind
SAVE_UNCHANGED: SaveKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Initializer(_message.Message):
    __slots__ = ("kind", "value", "mean", "stddev", "minval", "maxval", "seed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STDDEV_FIELD_NUMBER: _ClassVar[int]
    MINVAL_FIELD_NUMBER: _ClassVar[int]
    MAXVAL_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: float
    mean: float
    stddev: float
    minval: float
    maxval: float
    seed: int
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[float] = ..., mean: _Optional[float] = ..., stddev: _Optional[float] = ..., minval: _Optional[float] = ..., maxval: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Mapping[str, float]] = ...) -> None: ...

class CreateVariableRequest(_message.Message):
    __slots__ = ("name", "dtype", "shape", "initial_value", "initializer", "optimizer", "allow_nonfinite", "exist_ok", "slots", "version", "overwrite", "applied_ids", "role", "epoch", "backup", "sync_steps")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    initial_value: Tensor
    initializer: Initializer
    optimizer: OptimizerSpec
    allow_nonfinite: bool
    exist_ok: bool
    slots: _containers.RepeatedCompositeFieldContainer[SlotValue]
    version: int
    overwrite: bool
    applied_ids: _containers.RepeatedScalarFieldContainer[int]
    role: ReplicaRole
    epoch: int
    backup: ReplicaPeer
    sync_steps: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., initial_value: _Optional[_Union[Tensor, _Mapping]] = ..., initializer: _Optional[_Union[Initializer, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., allow_nonfinite: _Optional[bool] = ..., exist_ok: _Optional[bool] = ..., slots: _Optional[_Iterable[_Union[SlotValue, _Mapping]]] = ..., version: _Optional[int] = ..., overwrite: _Optional[bool] = ..., applied_ids: _Optional[_Iterable[int]] = ..., role: _Optional[_Union[ReplicaRole, str]] = ..., epoch: _Optional[int] = ..., backup: _Optional[_Union[ReplicaPeer, _Mapping]] = ..., sync_steps: _Optional[int] = ...) -> None: ...

class ReplicaPeer(_message.Message):
    __slots__ = ("address", "name")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class SlotValue(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SyncInfo(_message.Message):
    __slots__ = ("step", "replica", "num_replicas", "required", "sum", "step_timeout", "hybrid")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    HYBRID_FIELD_NUMBER: _ClassVar[int]
    step: int
    replica: int
    num_replicas: int
    required: int
    sum: bool
    step_timeout: float
    hybrid: bool
    def __init__(self, step: _Optional[int] = ..., replica: _Optional[int] = ..., num_replicas: _Optional[int] = ..., required: _Optional[int] = ..., sum: _Optional[bool] = ..., step_timeout: _Optional[float] = ..., hybrid: _Optional[bool] = ...) -> None: ...

class SyncRead(_message.Message):
    __slots__ = ("step", "step_timeout")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    step: int
    step_timeout: float
    def __init__(self, step: _Optional[int] = ..., step_timeout: _Optional[float] = ...) -> None: ...

class VariableMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "version", "optimizer", "nbytes", "slot_nbytes", "allow_nonfinite", "sync_steps", "dropped_gradients", "role", "epoch", "backup", "gathering")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_NBYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    GATHERING_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    version: int
    optimizer: OptimizerSpec
    nbytes: int
    slot_nbytes: int
    allow_nonfinite: bool
    sync_steps: int
    dropped_gradients: int
    role: ReplicaRole
    epoch: int
    backup: ReplicaPeer
    gathering: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., nbytes: _Optional[int] = ..., slot_nbytes: _Optional[int] = ..., allow_nonfinite: _Optional[bool] = ..., sync_steps: _Optional[int] = ..., dropped_gradients: _Optional[int] = ..., role: _Optional[_Union[ReplicaRole, str]] = ..., epoch: _Optional[int] = ..., backup: _Optional[_Union[ReplicaPeer, _Mapping]] = ..., gathering: _Optional[int] = ...) -> None: ...

class VariableRef(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("variables",)
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedCompositeFieldContainer[VariableMeta]
    def __init__(self, variables: _Optional[_Iterable[_Union[VariableMeta, _Mapping]]] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("names", "max_bytes", "sync", "value_dtype", "gathers", "table_lookups")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    VALUE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    GATHERS_FIELD_NUMBER: _ClassVar[int]
    TABLE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    max_bytes: int
    sync: SyncRead
    value_dtype: str
    gathers: _containers.RepeatedCompositeFieldContainer[RowLookup]
    table_lookups: _containers.RepeatedCompositeFieldContainer[TableLookup]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., max_bytes: _Optional[int] = ..., sync: _Optional[_Union[SyncRead, _Mapping]] = ..., value_dtype: _Optional[str] = ..., gathers: _Optional[_Iterable[_Union[RowLookup, _Mapping]]] = ..., table_lookups: _Optional[_Iterable[_Union[TableLookup, _Mapping]]] = ...) -> None: ...

class TableLookup(_message.Message):
    __slots__ = ("name", "keys", "counts", "no_admit", "offsets", "weights", "sync")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    NO_ADMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    name: str
    keys: Tensor
    counts: Tensor
    no_admit: bool
    offsets: Tensor
    weights: Tensor
    sync: SyncRead
    def __init__(self, name: _Optional[str] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., counts: _Optional[_Union[Tensor, _Mapping]] = ..., no_admit: _Optional[bool] = ..., offsets: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[_Union[Tensor, _Mapping]] = ..., sync: _Optional[_Union[SyncRead, _Mapping]] = ...) -> None: ...

class TableRows(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: Tensor
    def __init__(self, rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RowLookup(_message.Message):
    __slots__ = ("name", "ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: Tensor
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class VariableValue(_message.Message):
    __slots__ = ("name", "version", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    value: Tensor
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ReadReply(_message.Message):
    __slots__ = ("values", "gathered", "table_rows")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    GATHERED_FIELD_NUMBER: _ClassVar[int]
    TABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[VariableValue]
    gathered: _containers.RepeatedCompositeFieldContainer[GatherReply]
    table_rows: _containers.RepeatedCompositeFieldContainer[TableRows]
    def __init__(self, values: _Optional[_Iterable[_Union[VariableValue, _Mapping]]] = ..., gathered: _Optional[_Iterable[_Union[GatherReply, _Mapping]]] = ..., table_rows: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ...) -> None: ...

class ReadFrame(_message.Message):
    __slots__ = ("value", "chunk")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    value: VariableValue
    chunk: bytes
    def __init__(self, value: _Optional[_Union[VariableValue, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class DenseUpdate(_message.Message):
    __slots__ = ("name", "tensor", "update_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    update_id: int
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., update_id: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("updates", "sync", "sparse", "table_updates")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    TABLE_UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DenseUpdate]
    sync: SyncInfo
    sparse: _containers.RepeatedCompositeFieldContainer[SparseUpdate]
    table_updates: _containers.RepeatedCompositeFieldContainer[TableGradient]
    def __init__(self, updates: _Optional[_Iterable[_Union[DenseUpdate, _Mapping]]] = ..., sync: _Optional[_Union[SyncInfo, _Mapping]] = ..., sparse: _Optional[_Iterable[_Union[SparseUpdate, _Mapping]]] = ..., table_updates: _Optional[_Iterable[_Union[TableGradient, _Mapping]]] = ...) -> None: ...

class TableGradient(_message.Message):
    __slots__ = ("name", "keys", "grads", "update_id", "sync", "offsets", "weights")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    keys: Tensor
    grads: Tensor
    update_id: int
    sync: SyncInfo
    offsets: Tensor
    weights: Tensor
    def __init__(self, name: _Optional[str] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., grads: _Optional[_Union[Tensor, _Mapping]] = ..., update_id: _Optional[int] = ..., sync: _Optional[_Union[SyncInfo, _Mapping]] = ..., offsets: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SparseUpdate(_message.Message):
    __slots__ = ("name", "ids", "values", "sync", "update_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: Tensor
    values: Tensor
    sync: SyncInfo
    update_id: int
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., sync: _Optional[_Union[SyncInfo, _Mapping]] = ..., update_id: _Optional[int] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DenseUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[DenseUpdate, _Mapping]]] = ...) -> None: ...

class UpdateReply(_message.Message):
    __slots__ = ("versions", "dropped", "tables")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    dropped: _containers.RepeatedScalarFieldContainer[bool]
    tables: _containers.RepeatedCompositeFieldContainer[TableUpdated]
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Iterable[bool]] = ..., tables: _Optional[_Iterable[_Union[TableUpdated, _Mapping]]] = ...) -> None: ...

class TableUpdated(_message.Message):
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

class GatherRequest(_message.Message):
    __slots__ = ("name", "ids", "sync")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: Tensor
    sync: SyncRead
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., sync: _Optional[_Union[SyncRead, _Mapping]] = ...) -> None: ...

class GatherReply(_message.Message):
    __slots__ = ("version", "rows")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    version: int
    rows: Tensor
    def __init__(self, version: _Optional[int] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PushSparseRequest(_message.Message):
    __slots__ = ("name", "ids", "values", "sync", "update_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: Tensor
    values: Tensor
    sync: SyncInfo
    update_id: int
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., sync: _Optional[_Union[SyncInfo, _Mapping]] = ..., update_id: _Optional[int] = ...) -> None: ...

class UploadFrame(_message.Message):
    __slots__ = ("create", "push", "assign", "push_sparse", "replicate", "chunk")
    CREATE_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    PUSH_SPARSE_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    create: CreateVariableRequest
    push: PushRequest
    assign: AssignRequest
    push_sparse: PushSparseRequest
    replicate: ReplicateRequest
    chunk: bytes
    def __init__(self, create: _Optional[_Union[CreateVariableRequest, _Mapping]] = ..., push: _Optional[_Union[PushRequest, _Mapping]] = ..., assign: _Optional[_Union[AssignRequest, _Mapping]] = ..., push_sparse: _Optional[_Union[PushSparseRequest, _Mapping]] = ..., replicate: _Optional[_Union[ReplicateRequest, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("created", "updated", "replicated")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    created: VariableMeta
    updated: UpdateReply
    replicated: ReplicateReply
    def __init__(self, created: _Optional[_Union[VariableMeta, _Mapping]] = ..., updated: _Optional[_Union[UpdateReply, _Mapping]] = ..., replicated: _Optional[_Union[ReplicateReply, _Mapping]] = ...) -> None: ...

class AbandonRequest(_message.Message):
    __slots__ = ("step", "replica")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    step: int
    replica: int
    def __init__(self, step: _Optional[int] = ..., replica: _Optional[int] = ...) -> None: ...

class AbandonReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("directory", "names", "save_id", "since", "incarnation", "stream", "weights_only")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    names: _containers.RepeatedScalarFieldContainer[str]
    save_id: int
    since: int
    incarnation: str
    stream: str
    weights_only: bool
    def __init__(self, directory: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., save_id: _Optional[int] = ..., since: _Optional[int] = ..., incarnation: _Optional[str] = ..., stream: _Optional[str] = ..., weights_only: _Optional[bool] = ...) -> None: ...

class SaveReply(_message.Message):
    __slots__ = ("files", "incarnation")
    FILES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[SavedFile]
    incarnation: str
    def __init__(self, files: _Optional[_Iterable[_Union[SavedFile, _Mapping]]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class SavedFile(_message.Message):
    __slots__ = ("name", "file", "version", "bytes", "kind", "rows", "crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    file: str
    version: int
    bytes: int
    kind: SaveKind
    rows: int
    crc32: int
    def __init__(self, name: _Optional[str] = ..., file: _Optional[str] = ..., version: _Optional[int] = ..., bytes: _Optional[int] = ..., kind: _Optional[_Union[SaveKind, str]] = ..., rows: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class CommitSaveRequest(_message.Message):
    __slots__ = ("save_id", "stream", "incarnation")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    save_id: int
    stream: str
    incarnation: str
    def __init__(self, save_id: _Optional[int] = ..., stream: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class CommitSaveReply(_message.Message):
    __slots__ = ("variables", "tables")
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    variables: int
    tables: int
    def __init__(self, variables: _Optional[int] = ..., tables: _Optional[int] = ...) -> None: ...

class ReplicaRecord(_message.Message):
    __slots__ = ("name", "epoch", "version", "update_id", "sync_steps", "kind", "tensor", "ids", "evicted")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DENSE: _ClassVar[ReplicaRecord.Kind]
        SPARSE: _ClassVar[ReplicaRecord.Kind]
        ASSIGN: _ClassVar[ReplicaRecord.Kind]
        TABLE_ROWS: _ClassVar[ReplicaRecord.Kind]
        TABLE_UPDATE: _ClassVar[ReplicaRecord.Kind]
    DENSE: ReplicaRecord.Kind
    SPARSE: ReplicaRecord.Kind
    ASSIGN: ReplicaRecord.Kind
    TABLE_ROWS: ReplicaRecord.Kind
    TABLE_UPDATE: ReplicaRecord.Kind
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEPS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    version: int
    update_id: int
    sync_steps: int
    kind: ReplicaRecord.Kind
    tensor: Tensor
    ids: Tensor
    evicted: Tensor
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ..., version: _Optional[int] = ..., update_id: _Optional[int] = ..., sync_steps: _Optional[int] = ..., kind: _Optional[_Union[ReplicaRecord.Kind, str]] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., evicted: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[ReplicaRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[ReplicaRecord, _Mapping]]] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("name", "version", "status")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[ReplicaAck.Status]
        NEEDS_STATE: _ClassVar[ReplicaAck.Status]
        FENCED: _ClassVar[ReplicaAck.Status]
    OK: ReplicaAck.Status
    NEEDS_STATE: ReplicaAck.Status
    FENCED: ReplicaAck.Status
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    status: ReplicaAck.Status
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., status: _Optional[_Union[ReplicaAck.Status, str]] = ...) -> None: ...

class ReplicateReply(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[ReplicaAck]
    def __init__(self, acks: _Optional[_Iterable[_Union[ReplicaAck, _Mapping]]] = ...) -> None: ...

class ReplicaChange(_message.Message):
    __slots__ = ("name", "epoch", "action", "backup")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PROMOTE: _ClassVar[ReplicaChange.Action]
        SET_BACKUP: _ClassVar[ReplicaChange.Action]
        DROP_BACKUP: _ClassVar[ReplicaChange.Action]
        DEMOTE: _ClassVar[ReplicaChange.Action]
    PROMOTE: ReplicaChange.Action
    SET_BACKUP: ReplicaChange.Action
    DROP_BACKUP: ReplicaChange.Action
    DEMOTE: ReplicaChange.Action
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    action: ReplicaChange.Action
    backup: ReplicaPeer
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ..., action: _Optional[_Union[ReplicaChange.Action, str]] = ..., backup: _Optional[_Union[ReplicaPeer, _Mapping]] = ...) -> None: ...

class ReconfigureRequest(_message.Message):
    __slots__ = ("changes", "timeout")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[ReplicaChange]
    timeout: float
    def __init__(self, changes: _Optional[_Iterable[_Union[ReplicaChange, _Mapping]]] = ..., timeout: _Optional[float] = ...) -> None: ...

class ReconfigureReply(_message.Message):
    __slots__ = ("variables",)
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedCompositeFieldContainer[VariableMeta]
    def __init__(self, variables: _Optional[_Iterable[_Union[VariableMeta, _Mapping]]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ("drains",)
    DRAINS_FIELD_NUMBER: _ClassVar[int]
    drains: bool
    def __init__(self, drains: _Optional[bool] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("protocol_version", "server_id", "max_message_bytes", "num_variables", "total_bytes", "host", "leaving")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_VARIABLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    server_id: str
    max_message_bytes: int
    num_variables: int
    total_bytes: int
    host: HostInfo
    leaving: bool
    def __init__(self, protocol_version: _Optional[int] = ..., server_id: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., num_variables: _Optional[int] = ..., total_bytes: _Optional[int] = ..., host: _Optional[_Union[HostInfo, _Mapping]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class HostInfo(_message.Message):
    __slots__ = ("boot_id", "net_ns", "pid_ns", "uid", "ipc_socket", "shared_memory", "data_port")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    NET_NS_FIELD_NUMBER: _ClassVar[int]
    PID_NS_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    IPC_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    net_ns: int
    pid_ns: int
    uid: int
    ipc_socket: str
    shared_memory: bool
    data_port: int
    def __init__(self, boot_id: _Optional[str] = ..., net_ns: _Optional[int] = ..., pid_ns: _Optional[int] = ..., uid: _Optional[int] = ..., ipc_socket: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., data_port: _Optional[int] = ...) -> None: ...

class ShmAttachRequest(_message.Message):
    __slots__ = ("name", "nbytes", "pid", "fd")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    name: str
    nbytes: int
    pid: int
    fd: int
    def __init__(self, name: _Optional[str] = ..., nbytes: _Optional[int] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ...) -> None: ...

class ShmAttachReply(_message.Message):
    __slots__ = ("segment",)
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    segment: int
    def __init__(self, segment: _Optional[int] = ...) -> None: ...

class ShmDetachRequest(_message.Message):
    __slots__ = ("segment",)
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    segment: int
    def __init__(self, segment: _Optional[int] = ...) -> None: ...

class ShmDetachReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShmTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "version", "update_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    version: int
    update_id: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., version: _Optional[int] = ..., update_id: _Optional[int] = ...) -> None: ...

class ShmGather(_message.Message):
    __slots__ = ("name", "ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: ShmTensor
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Union[ShmTensor, _Mapping]] = ...) -> None: ...

class ShmReadRequest(_message.Message):
    __slots__ = ("segment", "names", "sync", "gathers", "out_offset")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    GATHERS_FIELD_NUMBER: _ClassVar[int]
    OUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    segment: int
    names: _containers.RepeatedScalarFieldContainer[str]
    sync: SyncRead
    gathers: _containers.RepeatedCompositeFieldContainer[ShmGather]
    out_offset: int
    def __init__(self, segment: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., sync: _Optional[_Union[SyncRead, _Mapping]] = ..., gathers: _Optional[_Iterable[_Union[ShmGather, _Mapping]]] = ..., out_offset: _Optional[int] = ...) -> None: ...

class ShmReadReply(_message.Message):
    __slots__ = ("values", "gathered")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    GATHERED_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[ShmTensor]
    gathered: _containers.RepeatedCompositeFieldContainer[ShmTensor]
    def __init__(self, values: _Optional[_Iterable[_Union[ShmTensor, _Mapping]]] = ..., gathered: _Optional[_Iterable[_Union[ShmTensor, _Mapping]]] = ...) -> None: ...

class ShmSparse(_message.Message):
    __slots__ = ("name", "ids", "rows", "update_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: ShmTensor
    rows: ShmTensor
    update_id: int
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Union[ShmTensor, _Mapping]] = ..., rows: _Optional[_Union[ShmTensor, _Mapping]] = ..., update_id: _Optional[int] = ...) -> None: ...

class ShmPushRequest(_message.Message):
    __slots__ = ("segment", "updates", "sync", "sparse")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    segment: int
    updates: _containers.RepeatedCompositeFieldContainer[ShmTensor]
    sync: SyncInfo
    sparse: _containers.RepeatedCompositeFieldContainer[ShmSparse]
    def __init__(self, segment: _Optional[int] = ..., updates: _Optional[_Iterable[_Union[ShmTensor, _Mapping]]] = ..., sync: _Optional[_Union[SyncInfo, _Mapping]] = ..., sparse: _Optional[_Iterable[_Union[ShmSparse, _Mapping]]] = ...) -> None: ...

class ShmShareRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class ShmShared(_message.Message):
    __slots__ = ("name", "path", "nbytes", "dtype", "shape", "tag")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    nbytes: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    tag: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., nbytes: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., tag: _Optional[int] = ...) -> None: ...

class ShmShareReply(_message.Message):
    __slots__ = ("variables",)
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedCompositeFieldContainer[ShmShared]
    def __init__(self, variables: _Optional[_Iterable[_Union[ShmShared, _Mapping]]] = ...) -> None: ...
