"""The unary calls a client makes, in one table: ``Method``.

Every gRPC method of every service is served by ``psserver/serve/rpc.py`` from the
generated descriptors; the hot ones (those with a socket ``id``) are also
served on the tasks' sockets (same-host Unix socket, TCP data port) with the
same servicer handlers. A call is declared here once: its id on the wire
(None: gRPC only), its gRPC service and method, its request and reply
messages (None: bytes framed by hand, psserver/contract/wire.py), the servicer
attribute that handles it, and whether it needs shared memory (then only the
Unix socket serves it).

Adding a call: one ``Method`` here, its handler on the servicer (and the rpc
in protos/). The transports (psserver/link/transport.py: any Method over
gRPC, those with an id over a socket), the task channel's route table
(psserver/link/channel.py), the gRPC retry policy (``IDEMPOTENT``:
psserver/link/grpc_common.py) and the socket servers (``socket_handlers``,
and the metrics of their calls) take what they need from here. (Streams,
ReadStream and Upload, are not unary calls: GrpcTransport's methods.)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from protos.pstrain.v1 import ps_pb2, tables_pb2, worker_pb2

PS, BULK, SHM = ("pstrain.v1.ParameterServer", "pstrain.v1.ParameterServerBulk",
                 "pstrain.v1.SharedMemory")
WORKER = "pstrain.v1.Worker"
TABLES = "pstrain.v1.DynamicTables"


#: The socket frame protocol's own calls (psserver/link/frames.py): the
#: hello a connection opens with (its token), and IDENTITY (the task's id
#: and protocol version). No Method takes these ids.
HELLO, IDENTITY = 0, 8


@dataclasses.dataclass(frozen=True, eq=False)   # each is one object: hashed by identity,
class Method:                                    # as fast as a dict lookup gets
    id: int | None     # on the wire (psserver/link/frames.py frame header); None:
    #                    a gRPC-only call
    service: str
    name: str
    request: type | None   # None: the handler takes the request's bytes as they came
    reply: type | None     # None: the handler returns bytes framed by hand
    handler: str           # servicer attribute
    shm: bool = False      # needs shared-memory segments: Unix socket only

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


SHM_READ = Method(1, SHM, "Read", ps_pb2.ShmReadRequest, ps_pb2.ShmReadReply, "Read", shm=True)
SHM_PUSH = Method(2, SHM, "Push", ps_pb2.ShmPushRequest, ps_pb2.UpdateReply, "Push", shm=True)
GATHER = Method(3, PS, "Gather", ps_pb2.GatherRequest, ps_pb2.GatherReply, "Gather")
PUSH_SPARSE = Method(4, PS, "PushSparse", ps_pb2.PushSparseRequest, ps_pb2.UpdateReply,
                     "PushSparse")
RUN_CLOSURE = Method(5, WORKER, "RunClosure", worker_pb2.ClosureRequest,
                     worker_pb2.ClosureReply, "RunClosure")
BULK_READ = Method(6, BULK, "Read", ps_pb2.ReadRequest, None, "bulk_read")
BULK_PUSH = Method(7, BULK, "Push", None, ps_pb2.UpdateReply, "bulk_push")
REPLICATE = Method(9, PS, "Replicate", ps_pb2.ReplicateRequest, ps_pb2.ReplicateReply,
                   "Replicate")
TABLE_LOOKUP = Method(10, TABLES, "Lookup", tables_pb2.LookupRequest, tables_pb2.LookupReply,
                      "Lookup")
TABLE_UPDATE = Method(11, TABLES, "Update", tables_pb2.TableUpdateRequest,
                      tables_pb2.TableUpdateReply, "Update")
COLLECTIVE = Method(12, WORKER, "Collective", None, worker_pb2.CollectiveReply, "Collective")

SOCKET = (SHM_READ, SHM_PUSH, GATHER, PUSH_SPARSE, RUN_CLOSURE, BULK_READ, BULK_PUSH, REPLICATE,
          TABLE_LOOKUP, TABLE_UPDATE, COLLECTIVE)
BY_ID: dict[int, Method] = {m.id: m for m in SOCKET}
assert len(BY_ID) == len(SOCKET) and not {HELLO, IDENTITY} & set(BY_ID), "socket ids collide"


def _grpc_only(service: str, name: str, request: type, reply: type) -> Method:
    return Method(None, service, name, request, reply, name)


# gRPC only: control calls, and the unary forms of the calls above.
SERVER_INFO = _grpc_only(PS, "GetServerInfo", ps_pb2.ServerInfoRequest, ps_pb2.ServerInfo)
CREATE = _grpc_only(PS, "CreateVariable", ps_pb2.CreateVariableRequest, ps_pb2.VariableMeta)
DELETE = _grpc_only(PS, "DeleteVariable", ps_pb2.VariableRef, ps_pb2.DeleteReply)
META = _grpc_only(PS, "GetMeta", ps_pb2.VariableRef, ps_pb2.VariableMeta)
LIST = _grpc_only(PS, "ListVariables", ps_pb2.ListRequest, ps_pb2.ListReply)
READ = _grpc_only(PS, "Read", ps_pb2.ReadRequest, ps_pb2.ReadReply)
PUSH = _grpc_only(PS, "Push", ps_pb2.PushRequest, ps_pb2.UpdateReply)
ASSIGN = _grpc_only(PS, "Assign", ps_pb2.AssignRequest, ps_pb2.UpdateReply)
ABANDON = _grpc_only(PS, "AbandonStep", ps_pb2.AbandonRequest, ps_pb2.AbandonReply)
SAVE = _grpc_only(PS, "Save", ps_pb2.SaveRequest, ps_pb2.SaveReply)
COMMIT_SAVE = _grpc_only(PS, "CommitSave", ps_pb2.CommitSaveRequest, ps_pb2.CommitSaveReply)
RECONFIGURE = _grpc_only(PS, "Reconfigure", ps_pb2.ReconfigureRequest,
                         ps_pb2.ReconfigureReply)
SHM_SHARE = _grpc_only(SHM, "Share", ps_pb2.ShmShareRequest, ps_pb2.ShmShareReply)
SHM_ATTACH = _grpc_only(SHM, "Attach", ps_pb2.ShmAttachRequest, ps_pb2.ShmAttachReply)
SHM_DETACH = _grpc_only(SHM, "Detach", ps_pb2.ShmDetachRequest, ps_pb2.ShmDetachReply)
WORKER_INFO = _grpc_only(WORKER, "GetWorkerInfo", worker_pb2.WorkerInfoRequest,
                         worker_pb2.WorkerInfo)
CREATE_DATASET = _grpc_only(WORKER, "CreateDataset", worker_pb2.CreateDatasetRequest,
                            worker_pb2.CreateDatasetReply)
TABLE_CREATE = _grpc_only(TABLES, "Create", tables_pb2.CreateTableRequest, tables_pb2.TableInfo)
TABLE_INFO = _grpc_only(TABLES, "Info", tables_pb2.TableRef, tables_pb2.TableInfo)
TABLE_LIST = _grpc_only(TABLES, "List", tables_pb2.ListTablesRequest, tables_pb2.ListTablesReply)
TABLE_DELETE = _grpc_only(TABLES, "Delete", tables_pb2.TableRef, tables_pb2.DeleteTableReply)
TABLE_SAVE = _grpc_only(TABLES, "Save", tables_pb2.SaveTableRequest, tables_pb2.SaveTableReply)
TABLE_IMPORT = _grpc_only(TABLES, "Import", tables_pb2.ImportTableRequest,
                          tables_pb2.ImportTableReply)
TABLE_MOVE = _grpc_only(TABLES, "MoveBuckets", tables_pb2.MoveBucketsRequest,
                        tables_pb2.MoveBucketsReply)

ALL = SOCKET + (SERVER_INFO, CREATE, DELETE, META, LIST, READ, PUSH, ASSIGN, ABANDON, SAVE,
                COMMIT_SAVE, RECONFIGURE, SHM_SHARE, SHM_ATTACH, SHM_DETACH, WORKER_INFO, CREATE_DATASET,
                TABLE_CREATE, TABLE_INFO, TABLE_LIST, TABLE_DELETE, TABLE_SAVE, TABLE_IMPORT,
                TABLE_MOVE)
#: Calls that change nothing: made again, over gRPC, after a socket broke
#: under them, and retried by gRPC itself on UNAVAILABLE (the channel's
#: service config is built from this set: psserver/link/grpc_common.py).
#: (A table look-up counts and admits: not one of them.)
IDEMPOTENT = frozenset({SERVER_INFO, META, LIST, READ, BULK_READ, GATHER, SHM_READ, SHM_SHARE,
                        ABANDON, WORKER_INFO, TABLE_INFO, TABLE_LIST})


def socket_handlers(servicers: Mapping[str, object], *, shm: bool
                    ) -> dict[int, tuple[Callable | None, Callable]]:
    """{id: (parse, handler)} for psserver/ipc_server.IpcServer: every Method of a
    service in ``servicers`` (service name -> the object whose attribute
    handles it); the shared-memory ones only with ``shm``."""
    out = {}
    for m in SOCKET:
        servicer = servicers.get(m.service)
        if servicer is None or (m.shm and not shm):
            continue
        out[m.id] = (None if m.request is None else m.request.FromString,
                     getattr(servicer, m.handler))
    return out
