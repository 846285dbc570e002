"""The calls that ride on the sockets (psserver/ipc.py), in one table.

Every gRPC method of every service is served by ``psserver/rpc.py`` from the
generated descriptors; the hot ones are also served on the tasks' sockets
(same-host Unix socket, TCP data port) with the same servicer handlers. This
table is where a socket call is declared, once: its id on the wire, the gRPC
method it stands for (metrics, and the call made instead when no socket
carries it), its request and reply messages (None: bytes framed by hand,
psserver/wire.py), the servicer attribute that handles it, and whether it
needs shared memory (then only the Unix socket serves it).

Adding a socket call: one ``Method`` here, its handler on the servicer. The
servers (``socket_handlers``), the clients (``PSClient._local_send``,
the coordinator's worker channel), the route planner (``shm``) and the
metrics take what they need from here.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from protos.pstrain.v1 import ps_pb2, worker_pb2

PS, BULK, SHM = ("pstrain.v1.ParameterServer", "pstrain.v1.ParameterServerBulk",
                 "pstrain.v1.SharedMemory")
WORKER = "pstrain.v1.Worker"


@dataclasses.dataclass(frozen=True)
class Method:
    id: int            # on the wire (psserver/ipc.py frame header); 0 and 8 are the protocol's
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

ALL = (SHM_READ, SHM_PUSH, GATHER, PUSH_SPARSE, RUN_CLOSURE, BULK_READ, BULK_PUSH, REPLICATE)
BY_ID: dict[int, Method] = {m.id: m for m in ALL}


def socket_handlers(servicers: Mapping[str, object], *, shm: bool
                    ) -> dict[int, tuple[Callable | None, Callable]]:
    """{id: (parse, handler)} for psserver/ipc_server.IpcServer: every Method of a
    service in ``servicers`` (service name -> the object whose attribute
    handles it); the shared-memory ones only with ``shm``."""
    out = {}
    for m in ALL:
        servicer = servicers.get(m.service)
        if servicer is None or (m.shm and not shm):
            continue
        out[m.id] = (None if m.request is None else m.request.FromString,
                     getattr(servicer, m.handler))
    return out
