"""``Pending``: a call's result to come, the only future type of the client side.

Every call a transport makes returns one (psserver/link/transport.py), and so
does every ``*_async`` method of PSClient: the request is sent before it is
returned, and ``result()`` waits for the reply, turns it into the value
(``post``) and returns it, or raises the call's typed error
(psserver.errors), once an error handler (``recover``) had its say.

Guarantees:

* ``result()`` computes the outcome once, on the first thread that asks
  (thread-safe); every later call returns the same value or raises the same
  error. A socket call's reply is read by that thread: until some thread
  asks, the call holds its connection (ask, even after an error elsewhere).
* ``result(timeout)`` waits at most ``timeout`` seconds for the reply to
  arrive and raises ``DeadlineExceeded`` (a ``TimeoutError``) if it has not;
  the call is then still pending (ask again). The call's own deadline, set
  when it was sent, bounds how long it can stay so.
* ``done()`` never blocks: whether ``result()`` would return without waiting
  for the network.
* ``then(fn)`` / ``recover(fn)``: a new Pending of ``fn(result)`` / of
  ``result``, where an error ``e`` (a PSError) becomes ``fn(e)`` (which may
  raise). The one they are made from may still be asked too.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, Sequence, TypeVar

from psserver.errors import DeadlineExceeded, PSError

T = TypeVar("T")

_PENDING, _OK, _FAILED = 0, 1, 2


class Pending(Generic[T]):
    """See the module. ``fetch()`` waits for the reply and returns it;
    ``wait(seconds) -> bool`` says whether it arrived within that time (0:
    now; None: ``result(timeout)`` cannot honour a timeout, so it waits);
    ``post(reply)`` makes the value; ``recover(error)`` answers an error."""

    __slots__ = ("_fetch", "_wait", "_post", "_recover", "_lock", "_state", "_value")

    def __init__(self, fetch: Callable[[], object], wait: Callable[[float], bool] | None = None,
                 post: Callable[[object], T] | None = None,
                 recover: Callable[[PSError], T] | None = None):
        self._fetch, self._wait, self._post, self._recover = fetch, wait, post, recover
        self._lock = threading.Lock()
        self._state, self._value = _PENDING, None

    @classmethod
    def of(cls, value: T) -> "Pending[T]":
        """A Pending that is done, with ``value``."""
        p = cls.__new__(cls)
        p._fetch = p._wait = p._post = p._recover = None
        p._lock, p._state, p._value = None, _OK, value
        return p

    @classmethod
    def failed(cls, error: BaseException) -> "Pending":
        """A Pending that is done, with ``error``."""
        p = cls.of(None)
        p._state, p._value = _FAILED, error
        return p

    def done(self) -> bool:
        return self._state != _PENDING or (self._wait is not None and self._wait(0))

    def result(self, timeout: float | None = None) -> T:
        """The value, or the call's error raised (see the module)."""
        if self._state == _PENDING:
            with self._lock:
                if self._state == _PENDING:
                    if timeout is not None and self._wait is not None and \
                            not self._wait(timeout):
                        raise DeadlineExceeded(f"no reply within {timeout}s; the call is "
                                               "still pending (ask its result again)")
                    try:
                        value = self._fetch()
                        if self._post is not None:
                            value = self._post(value)
                    except PSError as exc:
                        if self._recover is None:
                            self._state, self._value = _FAILED, exc
                        else:
                            try:
                                self._state, self._value = _OK, self._recover(exc)
                            except BaseException as again:   # noqa: BLE001 (raised below)
                                self._state, self._value = _FAILED, again
                    except BaseException as exc:   # noqa: BLE001 (raised below)
                        self._state, self._value = _FAILED, exc
                    else:
                        self._state, self._value = _OK, value
                    self._fetch = self._post = self._recover = None
        if self._state == _FAILED:
            raise self._value
        return self._value

    wait = result   # ps-lite's Wait(ts)

    def _waiter(self) -> Callable[[float], bool]:
        return self._wait_until_done if self._wait is not None else None

    def _wait_until_done(self, seconds: float) -> bool:
        return self._state != _PENDING or self._wait(seconds)

    def then(self, fn: Callable[[T], object]) -> "Pending":
        """A Pending of ``fn(self.result())``."""
        return Pending(self.result, self._waiter(), fn)

    def recover(self, fn: Callable[[PSError], object]) -> "Pending":
        """A Pending of ``self.result()``, a PSError ``e`` answered by ``fn(e)``."""
        return Pending(self.result, self._waiter(), None, fn)


def gathered(pendings: Sequence[Pending], combine: Callable[[list], T] = list) -> Pending[T]:
    """One Pending over calls sent already: its result reads every reply (each
    may hold a connection until read, so all are read even when one failed),
    then raises the first error or returns ``combine([results])``."""
    pendings = list(pendings)

    def collect():
        got, first = [], None
        for p in pendings:
            try:
                got.append(p.result())
            except BaseException as exc:   # noqa: BLE001 (raised below, after the rest)
                first = first or exc
        if first is not None:
            raise first
        return combine(got)

    def wait(seconds: float) -> bool:
        return all(p.done() for p in pendings) if not seconds else _wait_all(pendings, seconds)
    return Pending(collect, wait)


def _wait_all(pendings: Sequence[Pending], seconds: float) -> bool:
    import time
    end = time.monotonic() + seconds
    for p in pendings:
        w = p._waiter() if p._state == _PENDING else None
        if w is not None and not w(max(0.0, end - time.monotonic())):
            return False
    return True
