"""Parameter servers that follow the cluster spec (issue 34):
``ClusterCoordinator(strategy, elastic_servers=True)`` (or
``PSTRAIN_ELASTIC_SERVERS=1``, which ``coordinator run --ps-dns`` sets)
re-reads the spec as it does for workers, and

* **adds** each parameter server the spec gains (a TF_CONFIG file or
  ConfigMap rewritten, ``--ps-dns`` finding one more address, a
  StatefulSet scaled up after its ConfigMap lists the new pod), and each
  that the spec listed when the coordinator started but the job did not have;
* **drains** each that the spec no longer lists, once it has been missing
  for ``grace`` seconds in a row (ten looks: a spec rewritten in two steps,
  or a name that briefly does not resolve, drains nothing), after which it
  may stop.

Both go through ``ClusterCoordinator.add_parameter_server`` and
``remove_parameter_server`` (coordinator/elastic.py says what moves), one at
a time, on this module's thread, between two steps. Only changes of the
spec are acted on: a server added or drained by the Python API stays as
the API left it until the spec's own list of it changes.

What is not done, and said once in the log:

* A look at a spec that lists no parameter server changes nothing.
* A server that does not answer (a pod's DNS name exists before its process
  serves; a server that left the spec because it died) is asked again at
  later looks, and training is not paused for it. One being recovered
  (coordinator/recovery.py) waits for its recovery.
* A server that left the spec and restarted since (its server_id changed)
  failed: it is recovered as any other, not drained.
* A server the spec now names another way (the same process: its
  server_id) is neither added under the new name nor drained: name each
  server one way everywhere.
* A refusal (ValueError: replicated tables, sync mode, the last server, a
  server that holds a variable of the name a drained shard has) or a move
  whose outcome a source cannot tell (elastic.MoveUndetermined: it needs a
  person) is not tried again until the spec changes for that address.
  Other failures are tried again, each time after twice as long (up to a
  minute), said every tenth try.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Callable

from coordinator import elastic, ps_pool
from psserver.errors import PSError

log = logging.getLogger("coordinator")

#: The environment variable that turns following on for a ClusterCoordinator
#: made without ``elastic_servers`` ("1").
ELASTIC_ENV = "PSTRAIN_ELASTIC_SERVERS"
#: Looks a server must be missing from the spec, in a row, before it is drained.
GRACE_LOOKS = 10
#: The longest wait between two tries of a failing add or drain (seconds).
MAX_BACKOFF = 60.0


def wanted(explicit: bool | None, environ=os.environ) -> bool:
    """``elastic_servers`` as given, or from PSTRAIN_ELASTIC_SERVERS when None."""
    return bool(explicit) if explicit is not None else environ.get(ELASTIC_ENV, "") == "1"


class ServerFollower:
    """Looks at ``strategy``'s cluster spec every ``interval`` seconds and
    calls ``add(address)`` / ``remove(address)`` (the ClusterCoordinator's)
    for the servers it gained or lost (see the module); ``busy(address)``:
    whether that server is being recovered. ``pending``: address -> "add"
    or "remove", what is still to be done; ``done``: (what, address) of
    each made."""

    def __init__(self, strategy, add: Callable, remove: Callable, interval: float = 1.0,
                 busy: Callable[[str], bool] = lambda address: False,
                 probe_seconds: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.strategy, self._add, self._remove, self._busy = strategy, add, remove, busy
        self.interval, self.probe_seconds, self._clock = interval, probe_seconds, clock
        self.grace = GRACE_LOOKS * interval
        self.pending: dict[str, str] = {}
        self.done: list[tuple[str, str]] = []
        self.looks = 0   # looks at the spec so far
        self._seen: list[str] | None = None
        self._missing: dict[str, tuple[float, str | None]] = {}   # since, its server_id then
        self._tries: dict[str, tuple[int, float]] = {}   # failed tries, not before
        self._told: dict[str, str] = {}   # address -> the last thing logged of it
        self._refused: set[str] = set()   # refused: not again until the spec changes for it
        self._tables_seen: set[str] = set()
        # Servers drained because they were leaving: address -> that process's
        # server_id. Listed still and answering as another process (it restarted
        # there: a rolling restart, an evicted pod), such a server is added back.
        self._leavers: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "ServerFollower":
        """Look now and every ``interval`` seconds, on a thread of its own."""
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="ParameterServerFollower")
        self._thread.start()
        return self

    def stop_soon(self) -> None:
        """No more looks, nor adds or drains not started yet."""
        self._stop.set()

    def stop(self, timeout: float = 30.0) -> None:
        """stop_soon, then wait (at most ``timeout`` s) for one under way."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.look()
            except Exception:   # (a bug here must not end the following: said, and on)
                log.exception("following the cluster spec's parameter servers failed")
            self._stop.wait(self.interval)

    # -- one look --------------------------------------------------------------
    def look(self) -> None:
        """Read the spec, note what changed, then act on what is due."""
        self.looks += 1
        try:
            listed = list(self.strategy.cluster_resolver.cluster_spec().ps)
        except Exception as exc:   # a rewritten file may be briefly invalid: keep the last
            log.debug("cannot read the cluster spec: %s", exc)
            return
        if not listed:   # (never "drain them all": a spec half written, a name not resolving)
            self._tell("", logging.WARNING, "the cluster spec lists no parameter servers: "
                       "ignored (the job keeps its servers)")
            return
        self._told.pop("", None)
        job = set(self.strategy.parameter_servers)
        if self._seen is None:   # the start: what the spec lists and the job lacks
            changes = {a: "add" for a in listed if a not in job}
        else:
            changes = {a: "add" for a in listed if a not in self._seen}
            changes.update({a: "remove" for a in self._seen if a not in listed})
        self._seen = listed
        # a server of the job that a table new to the follower is not on (one a
        # coordinator made again adopted over the servers it was made on, before
        # the spec grew): added. (Tables seen before: only as the spec changes, so
        # a drain by the API, under way or failed part way, is not undone.)
        new = [t for t in self.strategy.tables if t.name not in self._tables_seen]
        self._tables_seen.update(t.name for t in new)
        for a in listed:
            if a in job and a not in self.pending and a not in self._refused and any(
                    a not in t.addresses for t in new):
                changes.setdefault(a, "add")
        for address in self._back(listed, job):
            changes.setdefault(address, "add")
        now = self._clock()
        known = getattr(self.strategy, "server_ids", {})   # address -> its process's id
        for address, what in changes.items():
            self._refused.discard(address)
            self._told.pop(address, None)   # (a new change: say again what happens)
            self._tries.pop(address, None)
            if what == "remove":
                self._missing[address] = (now, known.get(address))
            else:
                self._missing.pop(address, None)
            self.pending[address] = what
        for address in self._leaving(job):   # drained now: it waits for that to stop
            self._missing[address] = (now - self.grace, known.get(address))
            self.pending[address] = "remove"
        with self._keeping():   # (leaving servers asked on while adds and drains run)
            for address, what in list(self.pending.items()):
                if self._stop.is_set():
                    return
                if self._due(address, what, now):
                    try:
                        self._act(address, what, listed)
                    except Exception as exc:   # (one address's trouble holds up no other)
                        self._failed(address, what, exc)

    def _leaving(self, job) -> list[str]:
        """The servers of the job that say they are leaving (SIGTERM with
        psserver --leave-timeout: each waits to be drained, then stops;
        psserver/serve/leave.py), asked each look; not one refused already,
        being recovered or drained already."""
        out = []
        for address in job:   # (asked each look, a drain pending or not: so it waits on)
            if self._stop.is_set() or address in self._refused or self._busy(address):
                continue
            info = self._ask(address, min(self.probe_seconds, self.interval * 2))
            if info is None:
                continue
            if getattr(info, "leaving", False) and self.pending.get(address) != "remove":
                log.warning("parameter server %s is leaving (it was asked to stop): draining "
                            "it now", address)
                self._leavers[address] = info.server_id
                self._tries.pop(address, None)
                out.append(address)
        return out

    @staticmethod
    def _ask(address: str, timeout: float):
        """The server's ServerInfo, asked as one that drains it if it is
        leaving (so that it waits on: psserver/serve/leave.py); None where it
        does not answer."""
        try:
            return ps_pool.client_for(address).server_info(timeout=timeout, drains=True)
        except PSError:
            return None

    def _back(self, listed: list[str], job) -> list[str]:
        """Servers drained as they left that the spec still lists and that
        answer as another process now (they restarted there): to be added."""
        out = []
        for address, gone in list(self._leavers.items()):
            if address not in listed:   # (scaled away: the spec lost it too)
                del self._leavers[address]
                continue
            if address in job or address in self.pending or self._stop.is_set():
                continue
            try:
                info = ps_pool.client_for(address).server_info(timeout=self.probe_seconds)
            except PSError:
                continue
            if info.server_id != gone and not getattr(info, "leaving", False):
                log.warning("parameter server %s is back (a new process where the one drained "
                            "as it left was): adding it again", address)
                del self._leavers[address]
                out.append(address)
        return out

    @contextlib.contextmanager
    def _keeping(self):
        """While this look adds and drains (a drain first waits for the steps in
        flight, then moves each table), ask each second about every leaving
        server not drained yet, so that each waits on (psserver/serve/leave.py)."""
        if not self._leavers:
            yield
            return
        done = threading.Event()

        def ask() -> None:
            while not done.wait(max(0.2, min(1.0, self.interval))):
                for address in list(self._leavers):   # (a copy: the look changes it)
                    if address in self.strategy.parameter_servers:
                        self._ask(address, self.probe_seconds)
        t = threading.Thread(target=ask, daemon=True, name="keep-leaving")
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()

    def _due(self, address: str, what: str, now: float) -> bool:
        if what == "remove" and now - self._missing.get(address, (now, None))[0] < self.grace:
            return False
        return now >= self._tries.get(address, (0, 0.0))[1] and not self._busy(address)

    def _act(self, address: str, what: str, listed: list[str]) -> None:
        job = self.strategy.parameter_servers
        if (what == "add" and address in job and not any(
                elastic.lacks_share(t, address) for t in self.strategy.tables)) or (
                what == "remove" and address not in job):
            self._finish(address)   # (the API did it meanwhile)
            return
        verb = "joined" if what == "add" else "left"
        token, tls = getattr(self.strategy, "token", None), getattr(self.strategy, "tls", None)
        ps_pool.servers().give([address, *(a for a in listed if a not in job)], token, tls)
        try:
            sid = ps_pool.client_for(address).server_info(timeout=self.probe_seconds).server_id
        except PSError as exc:
            self._tell(address, logging.WARNING, (
                f"parameter server {address} {verb} the cluster spec but does not answer "
                f"({exc}); {'it is added' if what == 'add' else 'it is drained'} once it "
                "answers" + ("" if what == "add" else " (while it does not, its rows are "
                             "unavailable: a server that failed is recovered as any other)")))
            return
        if what == "remove":
            if sid != (self._missing.get(address, (0, None))[1] or sid):
                self._finish(address, logging.WARNING, (
                    f"parameter server {address} left the cluster spec and restarted since: "
                    "a failure, not a removal; it is recovered as any other, not drained"))
                return
            for other in (a for a in listed if a not in job):
                try:
                    same = ps_pool.client_for(other).server_info(
                        timeout=self.probe_seconds).server_id == sid
                except PSError:
                    continue
                if same:
                    self._finish(address, logging.ERROR, (
                        f"the cluster spec names parameter server {address} as {other} now: "
                        "not drained, nor added again. Name each server one way everywhere"))
                    return
        try:
            moves = (self._add if what == "add" else self._remove)(address)
        except (ValueError, elastic.MoveUndetermined) as exc:   # not again until the spec changes
            self._refused.add(address)
            self._finish(address, logging.ERROR, (
                f"parameter server {address} {verb} the cluster spec, but "
                f"{'adding' if what == 'add' else 'draining'} it was refused: {exc}"
                if isinstance(exc, ValueError) else
                f"{'adding' if what == 'add' else 'draining'} parameter server {address} "
                f"needs a person: {exc}"))
            return
        except Exception as exc:   # (PSError, TimeoutError, ...): again, later and later
            self._failed(address, what, exc)
            return
        self._finish(address, drained=what == "remove")
        self.done.append((what, address))
        tables = [m for m in moves if hasattr(m, "rows")]   # (elastic.TableMove)
        shards = [m for m in moves if hasattr(m, "shard")]   # (variable_moves.VariableMove)
        log.warning("parameter server %s %s (%s): %d table(s), %d rows moved, %d variable "
                    "shard(s) (%.2f MiB) moved in %.2fs%s",
                    address, "added" if what == "add" else "drained",
                    "the cluster spec lists it" if what == "add" else "it is leaving"
                    if address in listed else "the cluster spec no longer lists it",
                    len(tables), sum(m.rows for m in tables), len(shards),
                    sum(m.bytes for m in shards) / 2**20, sum(m.seconds for m in moves),
                    "" if what == "add" else "; it may stop")

    def _failed(self, address: str, what: str, exc: Exception) -> None:
        """An add or drain that failed: tried again after twice as long as
        the last time (up to MAX_BACKOFF), said every tenth try."""
        if self._stop.is_set():   # (the coordinator shut down meanwhile)
            return
        tries = self._tries.get(address, (0, 0.0))[0] + 1
        wait = min(MAX_BACKOFF, self.interval * 2 ** min(tries, 20))
        self._tries[address] = (tries, self._clock() + wait)
        if tries % 10 == 1:
            log.warning("%s parameter server %s failed (%s: %s; %d tries); trying again in "
                        "%.1fs", "adding" if what == "add" else "draining", address,
                        type(exc).__name__, exc, tries, wait)

    def _finish(self, address: str, level: int | None = None, message: str = "",
                drained: bool = False) -> None:
        """Nothing more to do for ``address`` until the spec changes for it
        (``drained``: a remove that drained it; any other end of a remove
        forgets that it was leaving: a later API drain is not undone)."""
        if self.pending.get(address) == "remove" and not drained:
            self._leavers.pop(address, None)
        self.pending.pop(address, None)
        self._missing.pop(address, None)
        self._tries.pop(address, None)
        if level is None:
            self._told.pop(address, None)
        else:
            self._tell(address, level, message)

    def _tell(self, address: str, level: int, message: str) -> None:
        if self._told.get(address) != message:
            self._told[address] = message
            log.log(level, "%s", message)
