"""Tasks that do not answer: how long one may stay silent, and what to tell a
person about it (which task, where, and what to check).

One diagnosis for every caller: ParameterServerStrategy for a parameter server
that does not answer its first call, the coordinator's worker threads for a
worker that stays silent (coordinator/worker_channel.py), and the operator
commands (coordinator/cli_ops.py). Each opens a TCP connection to the task
(``reachability``) to tell a wrong host, a task not running (or a firewall),
and a TLS mismatch apart, then says what to check for that case (``advice``).
"""
from __future__ import annotations

import os
import socket

from psserver.tls import CA_ENV, CERT_ENV, KEY_ENV, TLSConfig

#: How long a task may not answer the coordinator's first call before it is
#: named (seconds): ParameterServerStrategy raises Unavailable for a parameter
#: server, ClusterCoordinator logs a warning for a worker and keeps waiting
#: (workers may start late). A task that is up answers in milliseconds; 10 s
#: leaves room for a slow start or a loaded machine, and is short enough that
#: a wrong address is named before anyone wonders. ``PSTRAIN_CONNECT_SECONDS``.
CONNECT_SECONDS = float(os.environ.get("PSTRAIN_CONNECT_SECONDS", "10"))

#: How long ``not_answering`` waits for its TCP connection (seconds).
_PROBE_SECONDS = 2.0


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


def advice(kind: str, what: str, where: str, tls: TLSConfig | None,
           speaker: str = "this process") -> str:
    """What to check about task ``what`` ("ps 0", "worker 1") that does not
    answer, given what a TCP connection to it found (``reachability``'s
    kind). ``where``: where its address came from ("the cluster spec",
    "TF_CONFIG"); ``speaker``: who speaks ``tls`` ("this command")."""
    if kind == "dns":
        return f"check the address in {where}: is the host name right and resolvable from here?"
    if kind == "closed":
        program = "psserver" if what.startswith("ps") else "psworker"
        return (f"check that its {program} is running there, that the host and port in {where} "
                "are right, and that no firewall blocks the port")
    return (f"most likely a TLS mismatch: {speaker} speaks {tls_words(tls)}; set ${CA_ENV} to "
            f"the CA that signed the tasks' certificate (and ${CERT_ENV} / ${KEY_ENV} when the "
            "tasks demand client certificates), or unset all three if the tasks run plaintext; "
            "the tasks' certificate must name the address used. Else it is not a pstrain task, "
            "or too loaded to answer")


def not_answering(what: str, address: str, seconds: float, tls: TLSConfig | None,
                  where: str = "the cluster spec") -> str:
    """What to tell a person about task ``what`` ("ps 0", "worker 1") at
    ``address`` that did not answer within ``seconds``: which one, and what to
    check (running? the right host and port? a firewall? TLS?). Opens a TCP
    connection to it (up to 2 s) to tell those apart."""
    kind, why = reachability(address, _PROBE_SECONDS)
    found = {"dns": f": {why}", "closed": f"; a TCP connection: {why}",
             "open": ", though it accepts connections"}[kind]
    return (f"{what} at {address} does not answer (nothing within {seconds:g}s{found}): "
            f"{advice(kind, what, where, tls)}")
