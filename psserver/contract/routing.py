"""Which transport carries calls to a task: decided from what both ends
announce, never discovered by a failing call.

A task announces where it runs and what it offers (``HostInfo`` in
ServerInfo / WorkerInfo: kernel boot id, network and pid namespaces, uid,
its abstract Unix socket, shared memory, its data port); a client asks once
when it connects (GetServerInfo / GetWorkerInfo) and ``plan`` decides:

=====================  ===========  ===========  ==========  ===================
same kernel, network   unix socket  pid         data port   route
namespace and user     offered      namespace                (``Plan``)
=====================  ===========  ===========  ==========  ===================
yes                    yes          same        any         unix + shared memory
yes                    yes          another     any         unix (bytes framed)
no (another host,      -            -           yes         tcp (the data port)
netns or user)
no                     -            -           no          gRPC only
=====================  ===========  ===========  ==========  ===================

An abstract Unix socket exists in one network namespace only and serves
its own user only (SO_PEERCRED), and a shared-memory segment is opened by
the server as /proc/<client pid>/fd/<fd> (same pid namespace); memory shared without the network (pods or
``--ipc=host`` containers on one node) therefore takes the data port: that
guess used to put 1.37 MB reads through shared memory with gRPC around them,
14x slower than TCP. A client switched off from same-host paths
(``PSTRAIN_SHM=0``, ``shared_memory=False``) plans as if on another host;
``PSTRAIN_DATA=0`` (``data_port=False``) keeps it off the data port.

A route the task offered that then refused this client (its Unix socket
would not take us: another user's; its segments: the server cannot open
this process's memory; its data port: a firewall) is an input too
(``refused``): the client plans again without it, and keeps to that until
the task restarts. That is the only way a route changes after a call.

Per call (``carries``): the sockets serve the calls of psserver/link/methods.py
(the shared-memory ones the Unix socket only); every other call takes
gRPC. How one data call travels on its route (``form``): straight from the
server's memory (DIRECT), through a shared-memory segment (SEGMENT), in one
socket frame (FRAME), in one gRPC message (UNARY), or in gRPC's streams or
several calls (STREAM), by its kind and size.

This module is pure (no grpc, no sockets): its decisions are tested as
tables (tests/contract/test_routing.py).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import socket
import sys

UNIX, TCP, GRPC = "unix", "tcp", ""
#: What may refuse a client besides its sockets: the task's shared-memory segments.
SHM = "shm"

#: The switches of this process's routes (docs/configuration.md): 0 turns off
#: the same-host path (Unix socket, shared memory) / the data ports.
SHM_ENV, DATA_ENV = "PSTRAIN_SHM", "PSTRAIN_DATA"


def same_host_available() -> bool:
    """Whether this process may serve and use local sockets (Linux; not
    turned off with PSTRAIN_SHM=0, the switch of the whole same-host path)."""
    return (os.environ.get(SHM_ENV, "1") != "0" and hasattr(socket, "AF_UNIX")
            and hasattr(socket, "SO_PEERCRED") and sys.platform.startswith("linux"))


def data_available() -> bool:
    """Whether this process uses data ports (PSTRAIN_DATA=0 keeps those calls
    on gRPC)."""
    return os.environ.get(DATA_ENV, "1") != "0"


@dataclasses.dataclass(frozen=True)
class Host:
    """Where a process runs, as far as transports care."""
    boot_id: str = ""   # the kernel's boot id: same machine (and boot)
    net_ns: int = 0     # network namespace (inode): abstract Unix sockets reach
    pid_ns: int = 0     # pid namespace (inode): /proc/<pid> of the other side resolves
    uid: int = -1


@dataclasses.dataclass(frozen=True)
class Offer:
    """What a task announced: where it runs and the transports it serves."""
    host: Host = Host()
    ipc_socket: str = ""        # abstract Unix socket name, "" none
    shared_memory: bool = False  # takes shared-memory segments (SharedMemory.Attach)
    data_port: int = 0          # TCP data port, 0 none


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one client reaches one task: the socket (UNIX, TCP, or GRPC: none)
    and whether tensor bytes go through shared memory (UNIX only)."""
    socket: str = GRPC
    shm: bool = False
    why: str = "not planned yet"


def _ns(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


@functools.lru_cache(maxsize=1)
def this_host() -> Host:
    """This process's Host (read once; namespaces do not change under a process
    that never calls setns)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return Host(boot_id, _ns("net"), _ns("pid"), os.getuid())


def plan(mine: Host, offer: Offer, *, same_host_ok: bool = True,
         data_ok: bool = True, refused: frozenset = frozenset()) -> Plan:
    """The route from a client at ``mine`` to the task that made ``offer``.

    ``same_host_ok``: the client may use the Unix socket and shared memory
    (PSTRAIN_SHM, ``shared_memory``); ``data_ok``: it may use the data port
    (PSTRAIN_DATA, ``data_port``); ``refused``: what of the offer refused
    this client (UNIX, SHM, TCP: see the module).
    """
    theirs = offer.host
    same_kernel = bool(mine.boot_id) and mine.boot_id == theirs.boot_id
    same_net = same_kernel and mine.net_ns != 0 and mine.net_ns == theirs.net_ns
    if same_host_ok and same_net and offer.ipc_socket and mine.uid == theirs.uid \
            and UNIX not in refused:
        shm = offer.shared_memory and mine.pid_ns != 0 and mine.pid_ns == theirs.pid_ns
        why = "same host and network namespace"
        if SHM in refused and shm:
            shm, why = False, why + "; its shared memory refused this process"
        elif not shm:
            why += "; no shared memory (another pid namespace, or not offered)"
        return Plan(UNIX, shm, why)
    if data_ok and offer.data_port and TCP not in refused:
        why = ("same host, its Unix socket refused this process" if UNIX in refused
               else "same host, another network namespace" if same_kernel and not same_net
               else "same host, another user" if same_kernel and mine.uid != theirs.uid
               else "same host, same-host paths switched off" if same_kernel
               else "another host")
        return Plan(TCP, False, why + ": the data port")
    if refused:
        return Plan(GRPC, False, f"its {' and '.join(sorted(refused))} refused this process: gRPC")
    return Plan(GRPC, False, "no socket offered or allowed: gRPC")


def carries(p: Plan, shm: bool = False) -> str:
    """The socket that carries a socket call (psserver/link/methods.py) under plan
    ``p``; ``shm``: the call needs shared memory. GRPC: none does."""
    if shm and not p.shm:
        return GRPC
    return p.socket


def announce(msg, *, ipc_socket: str = "", shared_memory: bool = False,
             data_port: int = 0):
    """Fill a HostInfo message (ps.proto) with this process's Host and offer."""
    h = this_host()
    msg.boot_id, msg.net_ns, msg.pid_ns, msg.uid = h.boot_id, h.net_ns, h.pid_ns, h.uid
    msg.ipc_socket, msg.shared_memory, msg.data_port = ipc_socket, shared_memory, data_port
    return msg


def offer_of(msg) -> Offer:
    """The Offer in a HostInfo message (all zero from a task that sends none)."""
    return Offer(Host(msg.boot_id, msg.net_ns, msg.pid_ns, msg.uid), msg.ipc_socket,
                 msg.shared_memory, msg.data_port)


# -- the form of one data call --------------------------------------------------------
DIRECT, SEGMENT, FRAME, UNARY, STREAM = "direct", "segment", "frame", "unary", "stream"
#: The data calls a client plans a form for (psserver/client/data.py).
READ, PUSH, GATHER, TABLE = "read", "push", "gather", "table"


@dataclasses.dataclass(frozen=True)
class Limits:
    """The most tensor bytes one call carries: in a socket frame, in one gRPC
    message (past ``stream_bytes``, dense values go in gRPC's streams,
    which are faster for them), in one message at all."""
    frame_bytes: int
    stream_bytes: int
    message_bytes: int


def form(op: str, nbytes: int, p: Plan, limits: Limits, *, direct: bool = False,
         sync: bool = False, segments: bool = True) -> str:
    """How a data call of kind ``op`` carrying ``nbytes`` of tensors travels
    under plan ``p``:

    * READ (dense values, with or without rows looked up): DIRECT, straight
      from the server's memory, where the client maps it (``direct``) and
      the read waits for no sync step; else as PUSH.
    * PUSH (dense and row-wise gradients): SEGMENT where the route has shared
      memory; FRAME on a socket while it fits a frame; UNARY while under
      the stream threshold; else STREAM. (``segments=False``: as if the
      route had no shared memory: a call made again without its segment.)
    * GATHER (rows by id): as PUSH, but a gRPC message may hold up to the
      message limit (STREAM: split into several calls).
    * TABLE (dynamic-table look-ups and updates): FRAME on a socket while it
      fits; UNARY up to the message limit; else STREAM (several calls).
    """
    if p.shm and segments and op != TABLE:
        return DIRECT if op == READ and direct and not sync else SEGMENT
    if p.socket != GRPC and nbytes <= limits.frame_bytes:
        return FRAME
    if op in (GATHER, TABLE):
        return UNARY if nbytes <= limits.message_bytes else STREAM
    return UNARY if nbytes <= limits.stream_bytes else STREAM
