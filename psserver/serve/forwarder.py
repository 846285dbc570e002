"""The network side of replication: a primary's records and state copies to its backups.

One ``_PeerSender`` thread per backup server sends, in rounds: first the
whole state of every variable whose backup needs it (``Link.needs_state``),
then every pending record of the others in one ``Replicate`` call (records
of one variable in version order; several variables per call). One thread
per peer keeps each variable's records in order on the wire; records that
arrive while a call is out go in the next one, so a busy primary sends few,
large calls. A call that fails to reach the peer is retried with backoff
until it succeeds or the coordinator changes the link (DROP_BACKUP,
PROMOTE elsewhere): updates wait for their acknowledgement meanwhile (see
psserver.core.replication).

The sender talks to its peer with the server's own token and TLS files (the
cluster's: LocalCluster gives every task one certificate, valid as client
and server).
"""
from __future__ import annotations

import logging
import threading

from psserver.contract import TABLE_PREFIX, Peer
from psserver.core import replication as R
from psserver.errors import NotPrimary, PSError
from psserver.serve.tables import spec_message

log = logging.getLogger(__name__)

#: Records sent in one Replicate call at most (bytes of tensors); a larger
#: single record goes alone, streamed (the client's Upload path).
MAX_BATCH_BYTES = 4 << 20
#: Seconds one Replicate call may take, and one state copy per MiB on top of 60.
CALL_SECONDS = 30.0
COPY_SECONDS_PER_MIB = 0.5
#: Backoff between attempts to reach a peer that does not answer.
MIN_BACKOFF, MAX_BACKOFF = 0.05, 1.0


class Forwarder(R.Forwarding):
    """A store's senders, one per backup server (made on first use)."""

    def __init__(self, token: str | None = None, tls=None):
        self._token, self._tls = token, tls
        self._senders: dict[str, _PeerSender] = {}
        self._lock = threading.Lock()
        self._stopped = False

    def waker(self, replicator, var, peer: Peer):
        sender = self._sender(peer.address)
        return lambda notify=True: sender.wake(replicator, var, notify)

    def flusher(self, replicator, var, peer: Peer):
        sender = self._sender(peer.address)
        return lambda: sender.flush(replicator, var)

    def _sender(self, address: str) -> "_PeerSender":
        with self._lock:
            s = self._senders.get(address)
            if s is None:
                s = self._senders[address] = _PeerSender(address, self._client)
                if not self._stopped:
                    s.start()
            return s

    def peer_client(self, address: str):
        """A new client of the server at ``address`` with this server's token
        and TLS (a table shard's move sends its rows with it; close it)."""
        return self._client(address)

    def _client(self, address: str):
        from psserver.client.data import (
            PSClient,  # the server process only: it imports grpc
        )
        # A peer on this host is reached over its local socket (no TLS to
        # pay for: measured, TLS on the data port was most of a replicated
        # push's cost between two servers of one host), else its data port.
        return PSClient(address, token=self._token, tls=self._tls or False,
                        timeout=CALL_SECONDS)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            senders = list(self._senders.values())
        for s in senders:
            s.stop()


class _PeerSender:
    def __init__(self, address: str, make_client):
        self.address = address
        self._make_client = make_client
        self._client = None
        self._dirty: dict[int, tuple] = {}   # id(var) -> (replicator, var)
        # Held for a round of sends: one at a time per peer keeps each
        # variable's records in order (the thread's rounds and flush()'s).
        self._round_lock = threading.Lock()
        # Signalled when a variable has work (records, a state to copy) or on stop.
        self._work = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"replicate-to-{address}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._work:
            self._work.notify_all()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if self._client is not None:
            self._client.close()

    def wake(self, replicator, var, notify: bool = True) -> None:
        """var has work; ``notify``: wake the thread for it (else a flush
        follows, which sends it with whatever else is noted)."""
        with self._work:
            self._dirty[id(var)] = (replicator, var)
            if notify:
                self._work.notify()

    def _loop(self) -> None:
        backoff = MIN_BACKOFF
        while not self._stop.is_set():
            with self._work:
                while not self._dirty and not self._stop.is_set():
                    self._work.wait()
                work, self._dirty = self._dirty, {}
            if self._stop.is_set():
                return
            try:
                with self._round_lock:
                    if self._client is None:
                        self._client = self._make_client(self.address)
                    self._round(list(work.values()))
                backoff = MIN_BACKOFF
            except Exception as exc:   # the peer is away: try again, same work
                log.log(logging.INFO if isinstance(exc, PSError) else logging.ERROR,
                        "replication to %s failed (%s: %s); retrying in %.2fs", self.address,
                        type(exc).__name__, exc, backoff, exc_info=not isinstance(exc, PSError))
                with self._work:
                    for key, item in work.items():
                        self._dirty.setdefault(key, item)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    def flush(self, replicator, var) -> None:
        """Send var's pending records (or its state) now, on the calling
        thread: an update's handler waits for them anyway, so this saves the
        hand-over to the sender's thread and back. Other variables' records
        queued meanwhile go in the same call. A failure leaves the work to
        the sender's thread (it retries with backoff)."""
        if self._stop.is_set():
            return
        with self._round_lock:
            with self._work:
                work, self._dirty = self._dirty, {}
            work[id(var)] = (replicator, var)
            try:
                if self._client is None:
                    self._client = self._make_client(self.address)
                self._round(list(work.values()))
            except Exception:
                with self._work:
                    for key, item in work.items():
                        self._dirty.setdefault(key, item)
                    self._work.notify()

    def _round(self, work: list[tuple]) -> None:
        copies, batch = [], []
        for replicator, var in work:
            link = var.link
            if link is None or link.fenced or link.peer.address != self.address:
                continue
            if link.needs_state:
                with var.lock:   # a consistent copy (the link may have changed meanwhile)
                    if var.link is link and link.needs_state:
                        copies.append((replicator, var, link, link.generation,
                                       var.take_state(link)))
                continue
            # Records are taken without the variable's lock: the next may be
            # being applied here meanwhile (it went ahead), overlapping its send.
            generation, recs = link.generation, link.records()
            if recs:
                batch.append((replicator, var, link, generation, recs))
        for replicator, var, link, generation, state in copies:
            self._copy(replicator, var, link, generation, state)
        for group in _batches(batch):
            self._send(group)

    def _copy(self, replicator, var, link: R.Link, generation: int, state: dict) -> None:
        """Copy a whole state (the copy's take_state) to the peer, which
        creates or replaces its copy."""
        try:
            if link.peer.name.startswith(TABLE_PREFIX):   # a table shard: psserver/core/table_copy.py
                mib = sum(a.nbytes for a in state["rows"].values()) / 2**20
                self._client.import_table(
                    link.peer.name[len(TABLE_PREFIX):], state["rows"], state["step"],
                    replica=dict(spec=spec_message(state["spec"]), epoch=state["epoch"],
                                 version=state["version"], applied_ids=state["applied_ids"],
                                 sync_steps=state["sync_steps"]),
                    timeout=60.0 + mib * COPY_SECONDS_PER_MIB)
            else:
                mib = (state["initial_value"].nbytes
                       + sum(a.nbytes for a in state["slots"].values())) / 2**20
                self._client.create_variable(link.peer.name,
                                             timeout=60.0 + mib * COPY_SECONDS_PER_MIB, **state)
            status = R.OK
        except NotPrimary:   # a newer epoch owns the peer's copy: this primary is stale
            status = R.FENCED
        except BaseException:
            with var.lock:   # copy it again next time
                if var.link is link and link.generation == generation:
                    link.needs_state = True
            raise
        with var.lock:
            replicator.acknowledged(var, link, generation, state["version"], status)

    def _send(self, group: list[tuple]) -> None:
        records = [r for *_, recs in group for r in recs]
        acks = self._client.replicate(records, timeout=CALL_SECONDS)
        by_name = {name: (version, status) for name, version, status in acks}
        for replicator, var, link, generation, recs in group:
            version, status = by_name.get(link.peer.name, (-1, R.NEEDS_STATE))
            with var.lock:
                replicator.acknowledged(var, link, generation, version, status)


def _batches(batch: list[tuple]):
    """Groups of per-variable record lists, each at most MAX_BATCH_BYTES (a
    variable's records are never split across groups)."""
    group, size = [], 0
    for item in batch:
        n = sum(r.nbytes for r in item[-1])
        if group and size + n > MAX_BATCH_BYTES:
            yield group
            group, size = [], 0
        group.append(item)
        size += n
    if group:
        yield group
