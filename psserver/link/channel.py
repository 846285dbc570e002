"""How one client's calls reach one task: ``TaskChannel``.

A channel asks its task once where it runs and what it offers
(GetServerInfo for a parameter server, GetWorkerInfo for a worker), plans
the route from that (psserver/contract/routing.py: the same-host Unix socket, the
data port, or gRPC alone), opens the socket the route names, and keeps a
table {Method: transport} made from the plan, so a call looks its
transport up once. Everything else takes gRPC.

The one fallback rule, for a call on a socket:

* a request that never reached the task (``send`` raised: a refused or lost
  connection, another task answering) is made over gRPC (nothing ran), and
  the route is planned again on the next call (a restarted task has other
  sockets);
* a connection lost after the request went drops the socket and the route;
  an idempotent call (``methods.IDEMPOTENT``) is then made again over gRPC,
  any other fails with ``Unavailable``, as it would over gRPC (applied or
  not: resend it with the same update keys).

A route that refuses the client (``refuse``: its Unix socket, its shared
memory, its data port) is planned without, until the task restarts. The
task's process id (``task_id``: ServerInfo.server_id, WorkerInfo.worker_id)
is learnt with every plan: ``incarnation`` grows when it changes, and what
a client keeps about a task (mapped memory, segments, sizes) must be
dropped then (no value of a dead process is ever served).

While the first plan is being asked for, other threads' calls take gRPC;
a task that does not answer is asked again a second later.

Transports may be given (``transports={"grpc": ..., "unix": ..., "tcp":
...}``): tests and users pass fakes (psserver/link/transport.FakeTransport)
or their own, and the channel plans and falls back over them as over its
own.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Mapping

import grpc

from psserver.contract import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    TOKEN_ENV,
    call_metadata,
    routing,
    wire,
)
from psserver.errors import DeadlineExceeded, FailedPrecondition, PSError, Unavailable
from psserver.link import methods
from psserver.link.diagnose import diagnosed
from psserver.link.grpc_common import client_options
from psserver.link.methods import Method
from psserver.link.pending import Pending
from psserver.link.transport import GrpcTransport, SocketTransport, Transport
from psserver.tls import TLSConfig, client_config, make_channel

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0
#: How long a client waits for the task's info to plan its route.
_ASK_SECONDS = 5.0
#: The route while it is being learnt, or could not be: gRPC, asked again later.
_UNPLANNED = routing.Plan(why="not learnt yet: gRPC meanwhile")
#: The services whose socket calls each kind of task serves.
_SERVICES = {"ps": (methods.PS, methods.BULK, methods.SHM, methods.TABLES),
             "worker": (methods.WORKER,)}
_INFO = {"ps": methods.SERVER_INFO, "worker": methods.WORKER_INFO}


def check_version(theirs: int, address: str) -> None:
    """Refuse a task that announces another protocol version (its ServerInfo
    or WorkerInfo), saying which side is older: the task's own check of
    the client's version (psserver/serve/server.py) is the other half."""
    if theirs != PROTOCOL_VERSION:
        older = "this client" if PROTOCOL_VERSION < theirs else "the task"
        raise FailedPrecondition(
            f"protocol version mismatch: {address} speaks pstrain protocol {theirs}, this "
            f"client speaks {PROTOCOL_VERSION}; {older} is older: install the same pstrain "
            "version on every task and the coordinator")


class TaskChannel:
    """The connection of one client to one task at ``address`` (see the module).

    Args:
      role: "ps" (a parameter server) or "worker".
      token: the cluster's auth token; None: ``$PSTRAIN_AUTH_TOKEN`` if set.
      tls: a TLSConfig (its CA, and a certificate for mutual TLS); None:
        ``$PSTRAIN_TLS_CERT`` / ``_KEY`` / ``_CA`` if set, else plaintext;
        False: plaintext (psserver.tls.client_config).
      timeout: each call's deadline in seconds (None: none).
      wait_for_ready: gRPC calls wait for a task that is down (until their
        deadline) instead of failing at once with UNAVAILABLE.
      shared_memory / data_port: this client may use the same-host path /
        the data port where the route allows (PSTRAIN_SHM=0, PSTRAIN_DATA=0
        turn them off for the process).
      max_free: idle socket connections kept (one per concurrent call).
      abortable: ``abort()`` cuts calls waiting for their replies (a
        worker's closures, when the coordinator gives up on them).
      transports: transports to use instead of making them (see the module).
      diagnose: until the task answers, a call that cannot reach it fails
        with an error that says why (psserver/link/diagnose.py: a probe tells
        a wrong host, nothing listening and a TLS mismatch apart) and what
        to check. False: gRPC's own words (callers that explain it themselves).
    """

    def __init__(self, address: str, *, role: str = "ps", token: str | None = None,
                 tls: TLSConfig | bool | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, wait_for_ready: bool = False,
                 shared_memory: bool = True, data_port: bool = True, max_free: int = 8,
                 abortable: bool = False, transports: Mapping[str, Transport] | None = None,
                 diagnose: bool = True):
        if role not in _SERVICES:
            raise ValueError(f"role must be 'ps' or 'worker', got {role!r}")
        self.address, self.role, self.timeout = address, role, timeout
        self.max_message_bytes = max_message_bytes
        self._token = token or os.environ.get(TOKEN_ENV) or None
        self._tls = tls = client_config(tls)
        self._max_free, self._abortable = max_free, abortable
        given = dict(transports or {})
        grpc_t = given.pop("grpc", None)
        if grpc_t is None:
            channel = make_channel(address, client_options(max_message_bytes), tls)
            grpc_t = GrpcTransport(channel, address, call_metadata(self._token), wait_for_ready,
                                   chunk_bytes=max(1, min(chunk_bytes, max_message_bytes)),
                                   diagnose=functools.partial(diagnosed, role=role, tls=tls)
                                   if diagnose else None)
        self.grpc = grpc_t
        self._given = given   # sockets to use instead of opening them: kind -> transport
        self._same_host_ok = shared_memory and routing.same_host_available()
        self._data_ok = data_port and routing.data_available()
        self._lock = threading.Lock()
        self._plan: routing.Plan | None = None
        self.current: routing.Plan | None = None   # the plan, None until made (``plan`` asks)
        self._routes: dict[Method, Transport] = {}
        self._socket: Transport | None = None
        self._planning = False
        self._ask_after = 0.0   # a task that did not answer is asked again after this
        self._refused: frozenset = frozenset()
        self._closed = False
        self.info = None        # the task's last ServerInfo / WorkerInfo
        self.task_id = ""       # its process's id, "" until asked
        self.incarnation = 0    # grows each time task_id changes

    # -- the route ---------------------------------------------------------------------
    @property
    def plan(self) -> routing.Plan:
        """How calls reach the task (routing.Plan: ``socket`` "unix", "tcp" or
        "" for gRPC only, ``shm``, ``why``); asks the task the first time."""
        p = self._plan
        if p is None:
            self._learn()
            p = self._plan or _UNPLANNED
        return p

    def ask(self, timeout: float | None = None, *, wait_for_ready: bool = False):
        """The task's info, asked now (raises its PSError); plans the route
        again from it when the task restarted or nothing is planned."""
        t = _ASK_SECONDS if timeout is None else timeout
        info = self._ask_info(t, wait_for_ready)
        if self._plan is None or self._id_of(info) != self.task_id:
            self._replan_from(info)
        return info

    def _ask_info(self, timeout: float, wait_for_ready: bool, diagnose: bool = True):
        """The task's info; ``diagnose``: a failure says why (its transport's
        diagnose), else gRPC's words (an error no one sees)."""
        method = _INFO[self.role]
        request = method.request()
        g = self.grpc
        if isinstance(g, GrpcTransport) and ((wait_for_ready and not g.wait_for_ready)
                                             or (not diagnose and g.diagnose is not None
                                                 and not g.answered)):
            once = GrpcTransport(g.channel, self.address, g.metadata,
                                 wait_for_ready or g.wait_for_ready,
                                 diagnose=g.diagnose if diagnose and not g.answered else None)
            info = once.call(method, request, timeout)
            g.answered = True
        else:
            info = g.call(method, request, timeout)
        check_version(info.protocol_version, self.address)
        return info

    @staticmethod
    def _id_of(info) -> str:
        return getattr(info, "server_id", "") or getattr(info, "worker_id", "")

    def _learn(self) -> None:
        """Plan the route (once; other threads meanwhile take gRPC)."""
        if not (self._same_host_ok or self._data_ok or self._given):
            self._plan = self.current = routing.Plan(why="sockets switched off here: gRPC")
            return
        with self._lock:
            if self._plan is not None or self._planning or time.monotonic() < self._ask_after:
                return
            self._planning = True
        try:   # briefly, without waiting for a task that is down: gRPC meanwhile
            info = self._ask_info(min(self.timeout or _ASK_SECONDS, _ASK_SECONDS), False,
                                  diagnose=False)   # the call that follows says why
        except FailedPrecondition:   # another protocol version: no call may go
            raise
        except PSError:
            self._ask_after = time.monotonic() + 1.0
            return
        finally:
            self._planning = False
        self._replan_from(info)

    def _replan_from(self, info) -> None:
        task_id = self._id_of(info)
        with self._lock:
            if self._closed:
                return
            if task_id != self.task_id:
                if self.task_id:
                    self.incarnation += 1
                self.task_id, self._refused = task_id, frozenset()
            self.info = info
            refused = self._refused
        offer = routing.offer_of(info.host)
        identity = f"{info.protocol_version}:{task_id}"
        while True:
            p = routing.plan(routing.this_host(), offer, same_host_ok=self._same_host_ok,
                             data_ok=self._data_ok, refused=refused)
            sock = self._open(p, offer, identity) if p.socket != routing.GRPC else None
            if sock is not None or p.socket == routing.GRPC:
                break
            refused |= {p.socket}   # it would not take us: plan without it
        services = _SERVICES[self.role]
        routes = {m: sock for m in methods.SOCKET
                  if m.service in services and sock is not None
                  and routing.carries(p, m.shm) == sock.kind}
        with self._lock:
            old, self._socket = self._socket, sock
            self._refused = refused
            self._plan, self._routes = p, routes
            self.current = p
        if old is not None and old is not sock:
            old.close()
        log.debug("route to %s: %s (%s)", self.address, p.socket or "grpc", p.why)

    def _open(self, p: routing.Plan, offer: routing.Offer, identity: str) -> Transport | None:
        """The connected socket transport ``p`` names; None when it cannot be
        (a firewall, a NetworkPolicy, a port mapping to another task, a
        refused token)."""
        given = self._given.get(p.socket)
        if given is not None:
            return given
        what = "local socket" if p.socket == routing.UNIX else "data port"
        try:
            if p.socket == routing.UNIX:
                sock = SocketTransport(routing.UNIX, self.address, self._token,
                                       name=offer.ipc_socket, identity=identity,
                                       max_free=self._max_free, abortable=self._abortable)
            else:
                host = self.address.rsplit(":", 1)[0]
                ctx = self._tls.ssl_client_context() if self._tls is not None else None
                sock = SocketTransport(routing.TCP, self.address, self._token,
                                       tcp=(host, offer.data_port), ssl_context=ctx,
                                       identity=identity, max_free=self._max_free,
                                       abortable=self._abortable)
            sock.connect()
            return sock
        except (OSError, ValueError, PSError) as exc:
            log.warning("cannot use the %s of %s (%s); using %s", what, self.address, exc,
                        "its data port" if p.socket == routing.UNIX and offer.data_port
                        else "gRPC")
            return None

    def refuse(self, what: str) -> None:
        """The task refused ``what`` of its offer (routing.UNIX, SHM, TCP) to
        this client: plan without it until the task restarts."""
        with self._lock:
            self._refused |= {what}
            info = self.info
        if info is not None:
            self._replan_from(info)

    def replan(self, sock: Transport | None = None) -> None:
        """Forget the route (of ``sock``, if given: a socket that broke), to
        be asked again on the next call (a restarted task has other sockets)."""
        with self._lock:
            if sock is not None and sock is not self._socket:
                return
            old, self._socket = self._socket, None
            self._plan, self._routes, self.current = None, {}, None
        if old is not None and old not in self._given.values():
            old.close()

    @property
    def socket(self) -> Transport | None:
        """The socket transport the route uses now (None: gRPC only)."""
        return self._socket

    def alive(self) -> bool:
        """Whether the task's process is there (its Unix socket's watch), as
        far as the same-host route tells: False drops the route."""
        sock = self._socket
        if sock is None or sock.kind != routing.UNIX:
            return False
        if sock.alive():
            return True
        self.replan(sock)
        return False

    # -- calls -------------------------------------------------------------------------
    def send(self, method: Method, request, timeout: float | None = None, *, post=None,
             recover=None, receiver=None) -> Pending:
        """``method`` sent now on the transport the route gives it (see the
        module for what happens when its socket fails)."""
        t = self.timeout if timeout is None else timeout
        if self._plan is None:
            self._learn()
        sock = self._routes.get(method)
        if sock is None:
            return self.grpc.send(method, request, t, post=post, recover=recover,
                                  receiver=receiver)
        try:
            return sock.send(method, request, t, post=post, receiver=receiver,
                             recover=functools.partial(self._lost, sock, method, request, t,
                                                       receiver, post, recover))
        except PSError:   # nothing ran: over gRPC (joined now, while the arrays are as they were)
            self.replan(sock)
            return self.grpc.send(method, wire.joined(request), t, post=post, recover=recover,
                                  receiver=receiver)

    def _lost(self, sock: Transport, method: Method, request, timeout, receiver, post, recover,
              exc: PSError):
        """A socket call's error: a connection lost under it drops the
        socket; an idempotent call is then made again over gRPC."""
        if isinstance(exc, Unavailable) and not isinstance(exc, DeadlineExceeded):
            self.replan(sock)
            if method in methods.IDEMPOTENT:
                reply = self.grpc.call(method, wire.joined(request), timeout, receiver=receiver)
                return reply if post is None else post(reply)
        if recover is None:
            raise exc
        return recover(exc)

    def call(self, method: Method, request, timeout: float | None = None, *, receiver=None):
        """A blocking call (``send(...).result()``; over gRPC, on this thread)."""
        if self._plan is None or method.id is None:
            if method.id is None or (self._plan is None and not self._learn_now()):
                return self.grpc.call(method, request,
                                      self.timeout if timeout is None else timeout,
                                      receiver=receiver)
        return self.send(method, request, timeout, receiver=receiver).result()

    def _learn_now(self) -> bool:
        self._learn()
        return self._plan is not None

    def upload(self, kind: str, request, arrays, timeout: float | None = None):
        return self.grpc.upload(kind, request, arrays,
                                self.timeout if timeout is None else timeout)

    def read_stream(self, request, timeout: float | None = None):
        return self.grpc.read_stream(request, self.timeout if timeout is None else timeout)

    # -- lifecycle ---------------------------------------------------------------------
    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the task answers (DeadlineExceeded after timeout)."""
        channel = getattr(self.grpc, "channel", None)
        if channel is None:
            return
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            err = DeadlineExceeded(f"task {self.address} not ready after {timeout}s; is it "
                                   "running and is the address right?")
            err.address = self.address
            diagnose = getattr(self.grpc, "diagnose", None)
            if diagnose is not None and not self.grpc.answered:
                err = diagnose(err)   # which of those, and what to check
            raise err from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._socket = self._socket, None
            self._plan, self._routes, self.current = None, {}, None
        if sock is not None:
            sock.close()
        for t in self._given.values():
            t.close()
        self.grpc.close()

    def abort(self) -> None:
        """close(), cutting calls waiting for their replies on the socket."""
        sock = self._socket
        if sock is not None and hasattr(sock, "abort"):
            sock.abort()
        self.close()

    def __enter__(self) -> "TaskChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
