from protos.pstrain.v1 import ps_pb2 as _ps_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FunctionRef(_message.Message):
    __slots__ = ("qualified_name", "pickled", "digest")
    QUALIFIED_NAME_FIELD_NUMBER: _ClassVar[int]
    PICKLED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    qualified_name: str
    pickled: bytes
    digest: bytes
    def __init__(self, qualified_name: _Optional[str] = ..., pickled: _Optional[bytes] = ..., digest: _Optional[bytes] = ...) -> None: ...

class CreateDatasetRequest(_message.Message):
    __slots__ = ("dataset_id", "fn", "worker_index", "num_workers", "worker_id")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    FN_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    fn: FunctionRef
    worker_index: int
    num_workers: int
    worker_id: str
    def __init__(self, dataset_id: _Optional[str] = ..., fn: _Optional[_Union[FunctionRef, _Mapping]] = ..., worker_index: _Optional[int] = ..., num_workers: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class CreateDatasetReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BatchAssignment(_message.Message):
    __slots__ = ("dataset_id", "epoch", "shard", "start", "count", "exactly_once")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    EXACTLY_ONCE_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    epoch: int
    shard: int
    start: int
    count: int
    exactly_once: bool
    def __init__(self, dataset_id: _Optional[str] = ..., epoch: _Optional[int] = ..., shard: _Optional[int] = ..., start: _Optional[int] = ..., count: _Optional[int] = ..., exactly_once: _Optional[bool] = ...) -> None: ...

class ClosureRequest(_message.Message):
    __slots__ = ("closure_id", "fn", "args", "worker_id", "sync", "batches", "collective", "layouts", "moved")
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    FN_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    closure_id: str
    fn: FunctionRef
    args: bytes
    worker_id: str
    sync: _ps_pb2.SyncInfo
    batches: _containers.RepeatedCompositeFieldContainer[BatchAssignment]
    collective: CollectiveInfo
    layouts: _containers.RepeatedCompositeFieldContainer[TableLayout]
    moved: _containers.RepeatedCompositeFieldContainer[ShardPlace]
    def __init__(self, closure_id: _Optional[str] = ..., fn: _Optional[_Union[FunctionRef, _Mapping]] = ..., args: _Optional[bytes] = ..., worker_id: _Optional[str] = ..., sync: _Optional[_Union[_ps_pb2.SyncInfo, _Mapping]] = ..., batches: _Optional[_Iterable[_Union[BatchAssignment, _Mapping]]] = ..., collective: _Optional[_Union[CollectiveInfo, _Mapping]] = ..., layouts: _Optional[_Iterable[_Union[TableLayout, _Mapping]]] = ..., moved: _Optional[_Iterable[_Union[ShardPlace, _Mapping]]] = ...) -> None: ...

class ShardPlace(_message.Message):
    __slots__ = ("made_at", "name", "address")
    MADE_AT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    made_at: str
    name: str
    address: str
    def __init__(self, made_at: _Optional[str] = ..., name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class TableLayout(_message.Message):
    __slots__ = ("name", "table_id", "layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TABLE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    table_id: str
    layout: str
    def __init__(self, name: _Optional[str] = ..., table_id: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class CollectiveInfo(_message.Message):
    __slots__ = ("group", "members", "rank", "step", "timeout", "sum", "compression", "job")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    group: str
    members: _containers.RepeatedScalarFieldContainer[str]
    rank: int
    step: int
    timeout: float
    sum: bool
    compression: str
    job: str
    def __init__(self, group: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., timeout: _Optional[float] = ..., sum: _Optional[bool] = ..., compression: _Optional[str] = ..., job: _Optional[str] = ...) -> None: ...

class ErrorInfo(_message.Message):
    __slots__ = ("type", "message", "traceback", "ps_address", "ps_code")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    PS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PS_CODE_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    traceback: str
    ps_address: str
    ps_code: str
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., ps_address: _Optional[str] = ..., ps_code: _Optional[str] = ...) -> None: ...

class ClosureReply(_message.Message):
    __slots__ = ("result", "error")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result: bytes
    error: ErrorInfo
    def __init__(self, result: _Optional[bytes] = ..., error: _Optional[_Union[ErrorInfo, _Mapping]] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("protocol_version", "worker_id", "datasets", "closures_run", "host")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    CLOSURES_RUN_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker_id: str
    datasets: _containers.RepeatedScalarFieldContainer[str]
    closures_run: int
    host: _ps_pb2.HostInfo
    def __init__(self, protocol_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., datasets: _Optional[_Iterable[str]] = ..., closures_run: _Optional[int] = ..., host: _Optional[_Union[_ps_pb2.HostInfo, _Mapping]] = ...) -> None: ...

class CollectiveChunk(_message.Message):
    __slots__ = ("group", "op", "step", "sender", "data", "receiver", "member", "signature", "abort")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    group: bytes
    op: int
    step: int
    sender: int
    data: _ps_pb2.Tensor
    receiver: bytes
    member: bytes
    signature: int
    abort: str
    def __init__(self, group: _Optional[bytes] = ..., op: _Optional[int] = ..., step: _Optional[int] = ..., sender: _Optional[int] = ..., data: _Optional[_Union[_ps_pb2.Tensor, _Mapping]] = ..., receiver: _Optional[bytes] = ..., member: _Optional[bytes] = ..., signature: _Optional[int] = ..., abort: _Optional[str] = ...) -> None: ...

class CollectiveReply(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: bytes
    def __init__(self, member: _Optional[bytes] = ...) -> None: ...
