"""This process's calls to the parameter servers: its connection pool, and how
a step's calls are sent, settled and retried.

* ``client_for`` / ``configure`` / ``close_clients``: one PSClient per server
  address, with the token and TLS this process was configured with.
* ``CONNECT_SECONDS`` / ``reachability`` / ``not_answering``: how long a
  task may stay silent before the coordinator names it, and the words for
  one that does not answer (which, where, what to check).
* ``_Op``: one call to one server (a dense push, a sparse push, a read) that
  can be re-planned; ``_settle`` sends a step's calls all at once, then
  resends those that failed with UNAVAILABLE / NOT_FOUND / DEADLINE_EXCEEDED
  (or met a copy that is not primary: NotPrimary) where coordinator.routes
  says the primary is now, with the same idempotency keys, for up to
  ``RETRY_SECONDS``.
* ``new_update_id`` / ``update_key_scope``: a push's idempotency key, random,
  or inside a step of an exactly-once sharded dataset derived from its batch
  (coordinator/sharded.py), so a re-run of the batch sends the same keys.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import secrets
import socket
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from coordinator import routes
from psserver.client import PSClient
from psserver.errors import DeadlineExceeded, NotFound, NotPrimary, Unavailable
from psserver.server import TOKEN_ENV
from psserver.tls import CA_ENV, CERT_ENV, KEY_ENV, TLSConfig

if TYPE_CHECKING:
    from coordinator.variables import Shard


# -- this process's connections ------------------------------------------------
_clients: dict[tuple[str, bool], PSClient] = {}
_clients_lock = threading.Lock()
_token: str | None = os.environ.get(TOKEN_ENV) or None
_tls: TLSConfig | None = TLSConfig.from_env()


def configure(token: str | None, tls: TLSConfig | None = None) -> None:
    """Set the token and TLS this process's connections use (closes old ones)."""
    global _token, _tls
    with _clients_lock:
        if (token, tls) != (_token, _tls):
            for c in _clients.values():
                c.close()
            _clients.clear()
        _token, _tls = token, tls


def client_for(address: str, fail_fast: bool = False) -> PSClient:
    """The shared PSClient for a parameter-server address (created on first use).

    Its calls wait for a server that is down to come back (until their
    deadline), riding out a restart. ``fail_fast``: another client whose
    calls to a server that is down fail at once (UNAVAILABLE), for replicated
    shards, whose other copy may take over (coordinator.routes)."""
    key = (address, fail_fast)
    c = _clients.get(key)
    if c is None:
        with _clients_lock:
            c = _clients.get(key)
            if c is None:
                c = _clients[key] = PSClient(address, token=_token, tls=_tls,
                                             wait_for_ready=not fail_fast)
    return c


#: How long calls are resent while a parameter server is away (seconds).
RETRY_SECONDS = float(os.environ.get("PSTRAIN_RETRY_SECONDS", "120"))
_RETRYABLE = (Unavailable, NotFound, DeadlineExceeded)


class _FanOut:
    """This process's threads for calls to several parameter servers at once.

    Threads are started once and kept (daemons, blocked on a queue when
    idle): a gRPC future costs a thread start on every call (the channel's
    polling thread, when it goes from no call to one in flight), measured at
    about a fifth of a worker's CPU per small call; a blocking call on a
    kept thread costs a queue hand-off.
    """

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, fn: Callable, *args) -> futures.Future:
        fut: futures.Future = futures.Future()
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._queue.put((fut, fn, args))
        if start:
            threading.Thread(target=self._work, name="ps-fanout", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)
            del fut, fn, args
            with self._lock:
                self._idle += 1


_fanout = _FanOut()


class _Failed:
    def __init__(self, exc: BaseException):
        self._exc = exc

    def result(self):
        raise self._exc


class _Now:
    """A call run when its result is asked for, on the asking thread."""

    def __init__(self, fn: Callable[[], object]):
        self._fn = fn

    def result(self):
        return self._fn()


class _Op:
    """One call to one parameter server, for _settle: ``start(first)`` returns
    something whose ``result()`` is the call's. A client with the same-host
    socket (psserver/ipc.py) sends the request at once and reads the reply in
    result(): calls to several servers overlap on this thread. Otherwise the
    first call runs on this thread and the others on the fan-out threads.
    ``pairs``: the replicated (variable, shard index) it reaches, whose
    routes are asked again when it fails (coordinator.routes)."""

    def __init__(self, address: str, blocking: Callable[[PSClient], object],
                 non_blocking: Callable[[PSClient], object] | None = None, pairs=()):
        self.address, self.blocking, self.non_blocking = address, blocking, non_blocking
        self.pairs = [p for p in pairs if p[0].backups]

    def __call__(self, first: bool):
        client = client_for(self.address, fail_fast=bool(self.pairs))
        if self.non_blocking is not None and client.local:
            return self.non_blocking(client)
        if first:
            return _Now(lambda: self.blocking(client))
        return _fanout.submit(self.blocking, client)


_op = _Op


def _dense_op(address: str, updates: list, sync, pairs=()) -> _Op:
    return _Op(address, lambda c: c.push_many(updates, sync=sync),
               lambda c: c.push_many_async(updates, sync=sync), pairs)


def _sparse_op(target: "Shard", ids: np.ndarray, rows: np.ndarray, sync, uid: int,
               pairs=()) -> _Op:
    return _Op(target.address,
               lambda c: c.push_sparse(target.name, ids, rows, sync=sync, update_id=uid),
               lambda c: c.push_sparse_async(target.name, ids, rows, sync=sync, update_id=uid),
               pairs)


class _Rerouted(Exception):
    """A replicated shard's primary moved (or its backup left): plan the
    calls again (coordinator.routes); the update keys stay the same."""


def _routed(plan: Callable[[], object]):
    """Run ``plan()`` (which builds its calls from the current routes and
    settles them), again each time a route changed under it."""
    deadline = time.monotonic() + RETRY_SECONDS
    while True:
        try:
            return plan()
        except _Rerouted:
            if time.monotonic() > deadline:
                raise Unavailable(f"the primaries of replicated shards kept moving for "
                                  f"{RETRY_SECONDS:.0f}s (PSTRAIN_RETRY_SECONDS)") from None


def _settle(starts: Sequence[Callable]) -> list:
    """Run calls (made by _Op, one per parameter server) at once; resend one
    that failed in a retryable way (same request, so same idempotency keys)
    until RETRY_SECONDS. One that reaches replicated shards asks where their
    primaries are first: if one moved, _Rerouted goes up (to _routed) once the
    other calls are in. Returns their results in order."""
    deadline = time.monotonic() + RETRY_SECONDS

    def begin(start, first: bool):
        try:
            return start(first)
        except (*_RETRYABLE, NotPrimary) as exc:   # failed while sending: report it in result()
            return _Failed(exc)
    pending = [begin(start, i == 0) for i, start in enumerate(starts)]
    out = []
    for k, (start, p) in enumerate(zip(starts, pending)):
        backoff = 0.05
        while True:
            try:
                out.append(p.result())
                break
            except (*_RETRYABLE, NotPrimary) as exc:
                pairs = getattr(start, "pairs", ())
                if pairs and routes.refresh(pairs):
                    _drain(pending[k + 1:])
                    raise _Rerouted() from None
                if time.monotonic() > deadline or (isinstance(exc, NotPrimary) and not pairs):
                    _drain(pending[k + 1:])
                    raise
                time.sleep(backoff)   # the server is restarting: wait before resending
                backoff = min(backoff * 2, 1.0)
                p = begin(start, True)
            except BaseException:
                _drain(pending[k + 1:])
                raise
    return out


def _drain(pending: list) -> None:
    """Collect the other calls' replies before an error goes up (each holds a
    connection and a shared-memory segment until its reply is read)."""
    for p in pending:
        try:
            p.result()
        except BaseException:
            pass


# -- update keys -----------------------------------------------------------------
_keys = threading.local()


class _DerivedKeys:
    """Update keys of one step, derived from ``seed`` (what the step is: an
    exactly-once batch, coordinator/sharded.py): the n-th key asked for
    ``label`` (a variable shard, a table shard) is a hash of (seed, label, n)."""

    def __init__(self, seed: bytes):
        self.seed = seed
        self._counts: dict[str, int] = {}

    def next(self, label: str) -> int:
        n = self._counts.get(label, 0)
        self._counts[label] = n + 1
        h = hashlib.blake2b(self.seed, digest_size=8,
                            person=b"pstrain-upd-key")
        h.update(len(label).to_bytes(4, "little") + label.encode())
        h.update(n.to_bytes(8, "little"))
        return (int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)) or 1


@contextlib.contextmanager
def update_key_scope(seed: bytes | None):
    """Inside the body, on this thread, ``new_update_id(label)`` derives its
    keys from ``seed`` (None: random keys, as outside any scope). A step run
    twice in scopes of the same seed, making the same pushes in the same
    order per label, sends the same keys both times: a parameter server that
    applied one drops the other (it remembers the keys of its last
    APPLIED_IDS_KEPT updates per shard, psserver/replication.py)."""
    previous = getattr(_keys, "scope", None)
    _keys.scope = None if seed is None else _DerivedKeys(seed)
    try:
        yield
    finally:
        _keys.scope = previous


def new_update_id(label: str = "") -> int:
    """A non-zero 63-bit idempotency key: random, or inside update_key_scope
    derived from its seed, ``label`` (what the key is for: a variable shard
    "name#k", a table shard "~table~name#i") and how many keys this step asked
    for that label before."""
    scope = getattr(_keys, "scope", None)
    if scope is None:
        return secrets.randbits(63) or 1
    return scope.next(label)


def close_clients() -> None:
    with _clients_lock:
        for c in _clients.values():
            c.close()
        _clients.clear()
