"""Parameter servers that follow the cluster spec (issue 34):
``ClusterCoordinator(strategy, elastic_servers=True)`` (or
``PSTRAIN_ELASTIC_SERVERS=1``, which ``coordinator run --ps-dns`` sets)
re-reads the spec as it does for workers, and

* **adds** each parameter server the spec gains (a TF_CONFIG file or
  ConfigMap rewritten, ``--ps-dns`` finding one more address, a
  StatefulSet scaled up after its ConfigMap lists the new pod), and each
  that the spec listed when the coordinator started but the job did not have;
* **drains** each that the spec loses while it is one of the job's (the
  spec listed it before and lists it no more), after which it may stop.

Both go through ``ClusterCoordinator.add_parameter_server`` and
``remove_parameter_server`` (coordinator/elastic.py says what moves), one at
a time, on this module's thread, between two steps. Only changes of the
spec are acted on: a server added or drained by the Python API stays as
the API left it until the spec's own list of it changes.

A server is asked first whether it answers (``probe_seconds``): one that
does not (a pod whose DNS name exists before its process serves; a server
that left the spec because it died) is tried again at the next look, with
one warning per outage, and training is not paused for it. A refusal
(ValueError: replication, sync mode, a server holding variable shards,
the last server) is logged once and not tried again until the spec
changes for that address. Addresses are compared as written: list a
server the same way everywhere (a DNS name, or an IP address, not both).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from coordinator import ps_pool
from psserver.errors import PSError

log = logging.getLogger("coordinator")

#: The environment variable that turns following on for a ClusterCoordinator
#: made without ``elastic_servers`` ("1").
ELASTIC_ENV = "PSTRAIN_ELASTIC_SERVERS"


def wanted(explicit: bool | None, environ=os.environ) -> bool:
    """``elastic_servers`` as given, or from PSTRAIN_ELASTIC_SERVERS when None."""
    return bool(explicit) if explicit is not None else environ.get(ELASTIC_ENV, "") == "1"


class ServerFollower:
    """Looks at ``strategy``'s cluster spec every ``interval`` seconds and
    calls ``add(address)`` / ``remove(address)`` (the ClusterCoordinator's)
    for the servers it gained or lost (see the module). ``pending``:
    address -> "add" or "remove", what is still to be done."""

    def __init__(self, strategy, add: Callable, remove: Callable, interval: float = 1.0,
                 probe_seconds: float = 2.0):
        self.strategy, self._add, self._remove = strategy, add, remove
        self.interval, self.probe_seconds = interval, probe_seconds
        self.pending: dict[str, str] = {}
        self.looks = 0   # looks at the spec so far
        self.done: list[tuple[str, str]] = []   # (what, address) of each add and drain made
        self._seen: list[str] | None = None
        self._told: dict[str, str] = {}   # address -> the last thing logged of it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "ServerFollower":
        """Look now and every ``interval`` seconds, on a thread of its own."""
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="ParameterServerFollower")
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more looks; an add or drain under way finishes first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.look()
            except Exception:   # (a bug here must not end the following: said, and on)
                log.exception("following the cluster spec's parameter servers failed")
            self._stop.wait(self.interval)

    # -- one look --------------------------------------------------------------
    def look(self) -> None:
        """Read the spec, note what changed, then act on what is pending."""
        self.looks += 1
        try:
            listed = list(self.strategy.cluster_resolver.cluster_spec().ps)
        except Exception as exc:   # a rewritten file may be briefly invalid: keep the last
            log.debug("cannot read the cluster spec: %s", exc)
            return
        job = set(self.strategy.parameter_servers)
        if self._seen is None:   # the start: what the spec lists and the job lacks
            changes = {a: "add" for a in listed if a not in job}
        else:
            changes = {a: "add" for a in listed if a not in self._seen}
            changes.update({a: "remove" for a in self._seen if a not in listed})
        self._seen = listed
        for address, what in changes.items():
            self._told.pop(address, None)   # (a new change: say again what happens)
            self.pending[address] = what
        for address, what in list(self.pending.items()):
            if self._stop.is_set():
                return
            self._act(address, what)

    def _act(self, address: str, what: str) -> None:
        job = self.strategy.parameter_servers
        if what == "add" and address in job and all(
                address in t.addresses for t in self.strategy.tables):
            self.pending.pop(address)   # (the API added it meanwhile)
            return
        if what == "remove" and address not in job:
            self.pending.pop(address)
            return
        try:
            ps_pool.client_for(address).server_info(timeout=self.probe_seconds)
        except PSError as exc:
            self._tell(address, logging.WARNING, (
                f"parameter server {address} {'joined' if what == 'add' else 'left'} the "
                f"cluster spec but does not answer ({exc}); "
                f"{'it is added' if what == 'add' else 'it is drained'} once it answers"
                + ("" if what == "add" else " (while it does not, its rows are unavailable: "
                   "a server that failed is recovered as any other)")))
            return
        try:
            moves = (self._add if what == "add" else self._remove)(address)
        except ValueError as exc:   # refused, nothing changed: not again until the spec changes
            self.pending.pop(address)
            self._tell(address, logging.ERROR, f"parameter server {address} "
                       f"{'joined' if what == 'add' else 'left'} the cluster spec, but "
                       f"{'adding' if what == 'add' else 'draining'} it was refused: {exc}")
            return
        except (PSError, TimeoutError, OSError) as exc:   # tried again at the next look
            self._tell(address, logging.WARNING, f"{'adding' if what == 'add' else 'draining'}"
                       f" parameter server {address} failed ({exc}); trying again")
            return
        self.pending.pop(address)
        self._told.pop(address, None)
        self.done.append((what, address))
        rows = sum(m.rows for m in moves)
        log.warning("parameter server %s %s (the cluster spec %s it): %d table(s), %d rows "
                    "moved in %.2fs%s", address, "added" if what == "add" else "drained",
                    "lists" if what == "add" else "no longer lists", len(moves), rows,
                    sum(m.seconds for m in moves), "" if what == "add" else "; it may stop")

    def _tell(self, address: str, level: int, message: str) -> None:
        if self._told.get(address) != message:
            self._told[address] = message
            log.log(level, "%s", message)
