"""A parameter server asked to stop while it holds variables or tables' rows.

With ``--leave-timeout S`` (S > 0), the first SIGTERM or SIGINT does not stop
a server that holds variable shards or table shards holding buckets of their
tables: it says it is leaving (``ServerInfo.leaving``), serves on, and stops
once the job has drained it, that is once every table shard on it was left
no bucket by a drain's last move (``MoveBucketsRequest.source_leaves``) and
every variable shard copy moved away (coordinator/variable_moves.py; a
copy a failed delete left behind keeps it waiting): a coordinator that follows
its servers drains a leaving one at once (coordinator/ps_follow.py),
or after S seconds, or once no coordinator that drains its servers has
asked for its ServerInfo (``ServerInfoRequest.drains``) for
``ASKED_SECONDS`` (nothing would drain it), or at a second signal. It
stops at once, as without the option, where it holds none of these, or
where its table shards are replicated (replicated tables are not drained:
their backups take over). So ``docker
compose up --scale ps=N`` down, or a StatefulSet scaled down, drains the
server it stops (its stop grace period must cover S).
"""
from __future__ import annotations

import logging
import os
import time

from psserver.contract import ROLE_PRIMARY

log = logging.getLogger("psserver")


def _asked_seconds() -> float:
    try:
        seconds = float(os.environ.get("PSTRAIN_LEAVE_ASKED_SECONDS") or 15.0)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 86400:
        log.warning("PSTRAIN_LEAVE_ASKED_SECONDS must be seconds between 0 and a day: "
                    "taking 15")
        return 15.0
    return seconds


#: A leaving server that no follower asks about for this long stops (a follower
#: asks at each look, every membership_interval, and each second of a drain).
ASKED_SECONDS = _asked_seconds()
#: How often a leaving server looks whether it was drained.
POLL_SECONDS = 0.1


class Leaving:
    """The leave of one server: ``wait`` (the signal's thread), ``asked``
    (each GetServerInfo of a follower), ``leaving`` (what ServerInfo says)."""

    def __init__(self, registry, timeout: float, clock=time.monotonic):
        self.registry, self.timeout, self._clock = registry, timeout, clock
        self.leaving = False
        self._asked = clock()

    def asked(self, by_a_follower: bool) -> None:
        """A GetServerInfo came (from one that drains its servers, or not)."""
        if by_a_follower:
            self._asked = self._clock()

    def _held(self) -> list[str] | None:
        """The tables whose shards here still hold buckets, and the variable
        shard copies here (a drain moves them whole: primaries, and with
        replication backups too); None where a table shard here replicates to
        a backup (replicated tables are not drained: their backups take over)."""
        if any(c.link is not None or c.role != ROLE_PRIMARY for c in self.registry.tables()):
            return None   # (a replicated table's primary, or its backup)
        return [c.table_name for c in self.registry.tables() if not c.drained] + \
            [v.name for v in self.registry.variables()]

    def wait(self, again=lambda: False) -> None:
        """Return when the server may stop: at once, or once drained (see the
        module); ``again()``: whether a second signal came (stop at once)."""
        if self.timeout <= 0:
            return
        held = self._held()
        if held is None:
            log.warning("stopping: this server's table shards are replicated, and replicated "
                        "tables are not drained (their backups take over)")
            return
        if not held:
            return
        self.leaving, self._asked = True, self._clock()
        end = self._clock() + self.timeout
        log.warning("leaving: waiting up to %.0fs for the job to move %d variable or table "
                    "shard(s) to its other servers (a second signal stops at once)",
                    self.timeout, len(held))
        while not again():
            time.sleep(POLL_SECONDS)
            held = self._held()
            if held is not None and not held:
                log.warning("leaving: drained (every variable and table shard moved); stopping")
                return
            t = self._clock()
            if t > end:
                log.warning("leaving: not drained within %.0fs (shards of %s); stopping with "
                            "them here", self.timeout, held)
                return
            if t - self._asked > ASKED_SECONDS:
                log.warning("leaving: no coordinator that follows its servers asked about "
                            "this one for %.0fs (nothing drains it); stopping with "
                            "%s here", ASKED_SECONDS, held)
                return
