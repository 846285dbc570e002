"""This process's parameter servers: ``ParameterServers``.

One object per process holds what every call to a parameter server needs:

* the connections, one PSClient per server address, with the token and TLS
  this process was configured with (``client``);
* the routes table: which copy of each replicated shard takes calls now
  (``routes``, coordinator/routes.py);
* the one way a step's calls are sent, settled and resent (``settle``).

The strategy configures it (``configure``: the cluster's token and TLS) on
the coordinator; a worker process finds it through ``servers()``, made on
first use from the environment the worker was started with
($PSTRAIN_AUTH_TOKEN, $PSTRAIN_TLS_*). ShardedVariable and DynamicEmbedding
are small picklable descriptions that travel to the workers: every call
they make goes through this object, variables' and tables' alike.

``settle`` guarantees, for a step's calls (``Op``, one per server, each with
its update keys fixed before the first send):

* all are sent at once (a socket call is sent on this thread and its reply
  read after the others went; a gRPC call runs on a kept thread), then
  each reply is read, in order;
* one that fails with UNAVAILABLE, NOT_FOUND (a restarted server before it
  was restored) or DEADLINE_EXCEEDED is resent, the same request (so the
  same update keys: a server that applied it drops the second), with
  backoff, for up to ``RETRY_SECONDS`` (``PSTRAIN_RETRY_SECONDS``, 120);
* one that reaches replicated shards and fails that way, or meets a copy
  that is not primary (NotPrimary), makes the routes be asked again
  (``Routes.refresh``); if any route it was planned on is no longer the
  current one (whoever found out), every call is planned again on the new
  routes and resent (``plan`` is called again; its update keys stay);
* one whose dynamic table keys the server refused as handed to another
  server (NotPrimary) reads the table's layout there
  (coordinator/layouts.py) and, if newer, every call is planned again on it;
* one that fails while this process records a variable shard's move
  (coordinator/placement.py: a copy demoted, NotPrimary, or deleted) is
  resent with backoff, and every call is planned again once the move is
  recorded (``placement.GENERATION`` changed since the plan);
* every reply is read before an error goes up (each holds a connection or
  a shared-memory segment until it is).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from concurrent import futures
from typing import Callable, Sequence

from coordinator import layouts, placement
from coordinator.routes import Routes
from psserver.client import PSClient
from psserver.contract import TOKEN_ENV
from psserver.errors import DeadlineExceeded, NotFound, NotPrimary, PSError, Unavailable
from psserver.link.diagnose import not_answering
from psserver.link.pending import Pending
from psserver.tls import TLSConfig

#: How long calls are resent while a parameter server is away (seconds).
RETRY_SECONDS = float(os.environ.get("PSTRAIN_RETRY_SECONDS", "120"))
_RETRYABLE = (Unavailable, NotFound, DeadlineExceeded, NotPrimary)
#: Seconds to wait for each copy's metadata when asking who is primary.
ASK_SECONDS = 2.0
#: Seconds a call to an unreplicated shard refused as not primary is resent
#: before the refusal goes up: a variable shard's move (coordinator/
#: variable_moves.py) refuses calls from its hand-over until this process
#: records it, a few milliseconds; nothing else makes it go away.
MOVE_WAIT_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class Op:
    """One call to one parameter server for ``settle``: ``send(client)``
    sends it and returns its Pending. ``routes``: the (shard key, Route) of
    the replicated shards it reaches, as planned (``Routes.key``); the call
    is planned again if one of them changes."""
    address: str
    send: Callable[[PSClient], Pending]
    routes: tuple = ()
    pairs: tuple = ()   # the (variable or table, shard index) it reaches, for refresh
    tables: tuple = ()  # (table, layout epoch planned on) of unreplicated dynamic tables


class _Rerouted(Exception):
    """A route a call was planned on changed: plan the calls again."""


class ParameterServers:
    """See the module. ``token``/``tls``: the cluster's (None: plaintext, no token)."""

    def __init__(self, token: str | None = None, tls: TLSConfig | None = None):
        self.token, self.tls = token, tls   # for an address no cluster was given for
        # address -> (token, tls) of the cluster it belongs to (``give``): two
        # strategies of two clusters in one process each reach their own
        # servers with their own credentials.
        self._given: dict[str, tuple] = {}
        self._clients: dict[str, PSClient] = {}
        self._lock = threading.Lock()
        self.routes = Routes()

    # -- connections -----------------------------------------------------------------
    def client(self, address: str) -> PSClient:
        """The PSClient for a server address (made on first use). Its calls
        fail at once when the server is down (UNAVAILABLE): settle resends
        data calls, and control calls say so."""
        c = self._clients.get(address)
        if c is None:
            with self._lock:
                c = self._clients.get(address)
                if c is None:
                    token, tls = self._given.get(address, (self.token, self.tls))
                    # (tls was settled already: None is plaintext, not "ask the env")
                    c = self._clients[address] = PSClient(address, token=token,
                                                          tls=tls or False)
        return c

    def give(self, addresses, token: str | None, tls: TLSConfig | None) -> None:
        """Reach ``addresses`` (one cluster's servers) with ``token`` and
        ``tls``; a client made with other credentials is closed (made again
        on use)."""
        stale = []
        with self._lock:
            for a in addresses:
                if self._given.get(a, (self.token, self.tls)) != (token, tls) \
                        and a in self._clients:
                    stale.append(self._clients.pop(a))
                self._given[a] = (token, tls)
        for c in stale:
            c.close()

    def set_default(self, token: str | None, tls: TLSConfig | None) -> None:
        """The credentials of addresses no cluster was given for; their
        clients made with others are closed."""
        stale = []
        with self._lock:
            if (self.token, self.tls) != (token, tls):
                self.token, self.tls = token, tls
                for a in [a for a in self._clients if a not in self._given]:
                    stale.append(self._clients.pop(a))
        for c in stale:
            c.close()

    def use(self, address: str, client: PSClient) -> None:
        """Make ``client`` this process's client of ``address`` (one with
        transports of its own: psserver/link/channel.py); the old one is closed."""
        with self._lock:
            old, self._clients[address] = self._clients.get(address), client
        if old is not None and old is not client:
            old.close()

    def probe(self, address: str, timeout: float = 2.0):
        """The server's ServerInfo, asked with a short deadline (the watch,
        coordinator/recovery.py). Raises PSError."""
        return self.client(address).server_info(timeout=timeout)

    def meta_or_none(self, shard):
        """A copy's VariableMeta, or None when unreachable or missing."""
        try:
            return self.client(shard.address).get_meta(shard.name, timeout=ASK_SECONDS)
        except PSError:
            return None

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    # -- a step's calls -----------------------------------------------------------------
    def settle(self, plan: Callable[[], Sequence[Op]]) -> list:
        """Send the calls ``plan()`` makes (on the current routes), all at
        once, and return their results in order, resending as the module
        says. Raises the first call's error that is not resent."""
        return self._finish(plan, None, None, time.monotonic() + RETRY_SECONDS)

    def start(self, plan: Callable[[], Sequence[Op]]) -> Pending:
        """settle, its calls sent now: ``result()`` collects (and resends)."""
        placed = placement.GENERATION
        ops = plan()
        pending = [self._send(op) for op in ops]
        return Pending(functools.partial(self._finish, plan, ops, pending,
                                         time.monotonic() + RETRY_SECONDS, placed))

    def _finish(self, plan, ops, pending, deadline: float, placed: int = 0) -> list:
        while True:
            if ops is None:
                placed = placement.GENERATION
                ops = plan()
                pending = [self._send(op) for op in ops]
            try:
                return self._collect(ops, pending, deadline, placed)
            except _Rerouted:
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"the primaries of replicated shards kept moving for {RETRY_SECONDS:.0f}s "
                        "(PSTRAIN_RETRY_SECONDS)") from None
                ops = None

    def _send(self, op: Op) -> Pending:
        try:
            return op.send(self._clients.get(op.address) or self.client(op.address))
        except _RETRYABLE as exc:   # failed while sending: reported by its result
            return Pending.failed(exc)

    def _collect(self, ops: Sequence[Op], pending: list, deadline: float,
                 placed: int) -> list:
        out = []
        for k, (op, p) in enumerate(zip(ops, pending)):
            backoff, refused_until = 0.05, None
            while True:
                try:
                    out.append(p.result())
                    break
                except _RETRYABLE as exc:
                    if (op.routes and self._moved(op)) or placement.GENERATION != placed or (
                            isinstance(exc, NotPrimary) and op.tables and self._relaid(op)):
                        _drain(pending[k + 1:])   # (a variable shard moved since: plan again)
                        raise _Rerouted() from None
                    now = time.monotonic()
                    if isinstance(exc, NotPrimary) and not op.routes:   # (unreplicated)
                        # a variable shard's copy handed over in a move refuses until
                        # the move is recorded here: wait that long, no longer
                        refused_until = refused_until or now + MOVE_WAIT_SECONDS
                        if op.tables or now > refused_until:
                            _drain(pending[k + 1:])
                            raise
                    if now > deadline:
                        _drain(pending[k + 1:])
                        raise
                    time.sleep(backoff)   # the server is restarting: wait before resending
                    backoff = min(backoff * 2, 1.0)
                    p = self._send(op)
                except BaseException:
                    _drain(pending[k + 1:])
                    raise
        return out

    def _moved(self, op: Op) -> bool:
        """Ask the copies of op's shards who leads; whether a route op was
        planned on is not the current one (moved since, found out by anyone)."""
        self.refresh(op.pairs)
        return any(self.routes.get(key) != seen for key, seen in op.routes)

    def _relaid(self, op: Op) -> bool:
        """Ask op's server for the layout of op's tables (a move of buckets
        refused some of their keys there: coordinator/layouts.py); whether a
        table is at another layout now than op was planned on (found out by
        this or another call)."""
        for table, _ in op.tables:
            try:
                info = self.client(op.address).table_info(table.name, timeout=ASK_SECONDS)
            except PSError:
                continue
            layout = layouts.parse(info.layout)
            if layout is not None:
                layouts.learn(table, layout)
        return any(layouts.current(t) or t.layout_epoch != planned for t, planned in op.tables)

    def refresh(self, pairs) -> bool:
        """Ask both copies of each (variable or table, shard index) who leads
        (coordinator/routes.py); whether a route changed."""
        return self.routes.refresh(pairs, self.meta_or_none)


def _drain(pending: list) -> None:
    """Collect the other calls' replies before an error goes up (each holds a
    connection and a shared-memory segment until its reply is read)."""
    for p in pending:
        try:
            p.result()
        except BaseException:
            pass


# -- the process's ----------------------------------------------------------------------
_servers: ParameterServers | None = None
_servers_lock = threading.Lock()


def servers() -> ParameterServers:
    """This process's ParameterServers (made from the environment on first use)."""
    s = _servers
    if s is None:
        with _servers_lock:
            if _servers is None:
                _set(ParameterServers(os.environ.get(TOKEN_ENV) or None, TLSConfig.from_env()))
            s = _servers
    return s


def _set(s: ParameterServers) -> None:
    global _servers
    _servers = s


def configure(token: str | None, tls: TLSConfig | None = None,
              addresses: Sequence[str] = ()) -> ParameterServers:
    """Use ``token`` and ``tls`` for this process's connections to
    ``addresses`` (a cluster's parameter servers) and to any address no
    cluster was given for (closing connections made with other
    credentials); the process's ParameterServers. A strategy configures its
    cluster's servers, so two clusters in one process (two LocalClusters,
    say) each keep their own token and TLS."""
    with _servers_lock:
        s = _servers
        if s is None:
            s = ParameterServers(token, tls)
            _set(s)
        else:
            s.set_default(token, tls)
        if addresses:
            s.give(addresses, token, tls)
        return s


def client_for(address: str) -> PSClient:
    """The process's PSClient for a parameter-server address."""
    return servers().client(address)


def close_clients() -> None:
    """Close this process's connections (they are made again on use)."""
    s = _servers
    if s is not None:
        s.close()


def delete_copies(v, delete) -> None:
    """``delete(copy)`` on each shard's primary as the routes have it now
    (its errors raised), then on its other copy unless the primary is alone
    (that copy is gone: a server lost for good holds nothing to delete); an
    other copy whose server does not answer is skipped (issue 33 item 10:
    the shipped job failed at its clean-up after a server was lost)."""
    routes = servers().routes
    for k in range(v.num_shards):   # (the copies a sync push reaches: the primary first)
        primary, *other = routes.targets_of(v, k, routes.route(v, k), True)
        delete(primary)
        for copy in other:
            try:
                delete(copy)
            except (Unavailable, DeadlineExceeded):
                pass


def check_answer(addresses: Sequence[str], timeout: float, tls) -> None:
    """Every server at ``addresses`` answers within ``timeout`` (all asked at
    once), else Unavailable naming each that does not and what to check. A
    server that answers with an error (a wrong token: UNAUTHENTICATED)
    raises that error, which says what to do."""
    def silent(i_addr: tuple[int, str]) -> str | None:
        i, addr = i_addr
        try:
            client_for(addr).server_info(timeout=timeout)
        except (DeadlineExceeded, Unavailable):   # the client waits for a server that is down
            return not_answering(f"ps {i}", addr, timeout, tls)
        return None
    with futures.ThreadPoolExecutor(min(16, len(addresses)),
                                    thread_name_prefix="ps-connect") as pool:
        problems = [p for p in pool.map(silent, enumerate(addresses)) if p]
    if problems:
        raise Unavailable("\n".join(problems) + f". To wait longer than {timeout:g}s: "
                          "ParameterServerStrategy(connect_timeout=...) or "
                          "$PSTRAIN_CONNECT_SECONDS")
