"""A step's update keys, and the words for a task that does not answer.

* ``new_update_id`` / ``update_key_scope``: a push's idempotency key, random,
  or inside a step of an exactly-once sharded dataset derived from its batch
  (coordinator/sharded.py), so a re-run of the batch sends the same keys.
* ``CONNECT_SECONDS`` / ``reachability`` / ``not_answering``: how long a
  task may stay silent before the coordinator names it, and the words for
  one that does not answer (which, where, what to check).

(How a step's calls are sent, settled and resent: coordinator/ps_pool.py.)
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading

from psserver.tls import CA_ENV, CERT_ENV, KEY_ENV, TLSConfig


# -- tasks that do not answer ---------------------------------------------------
#: How long a task may not answer the coordinator's first call before it is
#: named (seconds): ParameterServerStrategy raises Unavailable for a parameter
#: server, ClusterCoordinator logs a warning for a worker and keeps waiting
#: (workers may start late). A task that is up answers in milliseconds; 10 s
#: leaves room for a slow start or a loaded machine, and is short enough that
#: a wrong address is named before anyone wonders. ``PSTRAIN_CONNECT_SECONDS``.
CONNECT_SECONDS = float(os.environ.get("PSTRAIN_CONNECT_SECONDS", "10"))


def reachability(address: str, timeout: float) -> tuple[str, str]:
    """("dns" | "closed" | "open", detail): can a TCP connection to address open?"""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError, UnicodeError) as exc:
        return "dns", f"cannot resolve {host!r}: {exc}"
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(timeout)
                s.connect(sockaddr)
                return "open", ""
        except OSError as exc:
            last = exc
    if isinstance(last, TimeoutError):   # socket.timeout is TimeoutError
        return "closed", f"no answer to a TCP connect within {timeout:g}s"
    return "closed", (last.strerror if last is not None and last.strerror else str(last))


def tls_words(tls: TLSConfig | None) -> str:
    """How this process speaks to the tasks, for a message about a mismatch."""
    if tls is None:
        return f"plaintext (no ${CERT_ENV} / ${KEY_ENV} / ${CA_ENV} set)"
    return ("TLS with a client certificate" if tls.cert else "TLS without a client certificate") \
        + (" and a CA" if tls.ca else " and the system's trusted CAs")


def not_answering(what: str, address: str, seconds: float, tls: TLSConfig | None,
                  where: str = "the cluster spec") -> str:
    """What to tell a person about task ``what`` ("ps 0", "worker 1") at
    ``address`` that did not answer within ``seconds``: which one, and what to
    check (running? the right host and port? a firewall? TLS?). Opens a TCP
    connection to it (up to 2 s) to tell those apart."""
    program = "psserver" if what.startswith("ps") else "psworker"
    kind, why = reachability(address, 2.0)
    head = f"{what} at {address} does not answer (nothing within {seconds:g}s"
    if kind == "dns":
        return (f"{head}: {why}): check the address in {where}: is the host name right and "
                "resolvable from here?")
    if kind == "closed":
        return (f"{head}; a TCP connection: {why}): check that its {program} is running there, "
                f"that the host and port in {where} are right, and that no firewall blocks "
                "the port")
    return (f"{head}, though it accepts connections): most likely a TLS mismatch: this "
            f"process speaks {tls_words(tls)}; set ${CA_ENV} (and ${CERT_ENV} / ${KEY_ENV} "
            "when the tasks demand client certificates) as the tasks have them, or unset "
            "them if the tasks run plaintext. Else it is not a pstrain task, or too "
            "loaded to answer")


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
        return (int.from_bytes(os.urandom(8), "little") >> 1) or 1
    return scope.next(label)
