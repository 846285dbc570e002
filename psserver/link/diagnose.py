"""Tasks that cannot be reached: what to tell a person about one (which task,
where, and what to check).

One diagnosis for every caller: a client's first calls (``diagnosed``:
TaskChannel gives it to its GrpcTransport, so a PSClient's error says it),
the operator commands (coordinator/cli_ops.py: ``unreachable``),
ParameterServerStrategy for a parameter server that does not answer its
first call and the coordinator's worker threads for a worker that does not
(``not_answering``; how long they wait: coordinator/diagnose.py). Each opens
a TCP connection to the task (``reachability``) to tell a wrong host, a
port nobody listens on (or a firewall), and a TLS mismatch apart, then says
what to check for that case (``advice``).
"""
from __future__ import annotations

import os
import socket

from psserver.errors import Code, PSError, error_for
from psserver.tls import CA_ENV, CERT_ENV, KEY_ENV, TLSConfig

#: How long a probe waits for its TCP connection (seconds).
PROBE_SECONDS = 2.0
#: A client's own probe, after its call failed: a task that is up accepts a
#: connection in milliseconds, so a short wait is enough to say "silent".
_CLIENT_PROBE_SECONDS = 1.0
#: The codes of a call that did not reach a task (or got no answer from it).
UNREACHED = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED)


def reachability(address: str, timeout: float = PROBE_SECONDS) -> tuple[str, str]:
    """(kind, detail): can a TCP connection to ``address`` open? ``kind`` is
    "dns" (the host does not resolve), "closed" (refused or unreachable:
    nobody listens there, known at once), "silent" (no answer within
    ``timeout``: a firewall dropping packets, a host that is down) or "open"."""
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
        return "silent", f"no answer to a TCP connect within {timeout:g}s"
    return "closed", (last.strerror if last is not None and last.strerror else str(last))


def tls_words(tls: TLSConfig | None) -> str:
    """How this process speaks to the tasks, for a message about a mismatch."""
    if tls is None:
        unset = not any(os.environ.get(k) for k in (CERT_ENV, KEY_ENV, CA_ENV))
        return f"plaintext{f' (no ${CERT_ENV} / ${KEY_ENV} / ${CA_ENV} set)' if unset else ''}"
    return ("TLS with a client certificate" if tls.cert else "TLS without a client certificate") \
        + (" and a CA" if tls.ca else " and the system's trusted CAs")


def _program(what: str) -> str:
    if what.startswith("ps") or what.startswith("parameter server"):
        return "psserver"
    return "psworker" if what.startswith("worker") else "psserver or psworker"


def advice(kind: str, what: str, where: str, tls: TLSConfig | None,
           speaker: str = "this process") -> str:
    """What to check about task ``what`` ("ps 0", "worker 1", "task") that
    does not answer, given what a TCP connection to it found
    (``reachability``'s kind). ``where``: where its address came from ("the
    cluster spec", "TF_CONFIG"); ``speaker``: who speaks ``tls`` ("this
    command")."""
    if kind == "dns":
        return f"check the address in {where}: is the host name right and resolvable from here?"
    if kind in ("closed", "silent"):
        return (f"check that its {_program(what)} is running there, that the host and port in "
                f"{where} are right, and that no firewall blocks the port")
    return (f"most likely a TLS mismatch: {speaker} speaks {tls_words(tls)}; set ${CA_ENV} to "
            f"the CA that signed the tasks' certificate (and ${CERT_ENV} / ${KEY_ENV} when the "
            "tasks demand client certificates), or unset all three if the tasks run plaintext; "
            "the tasks' certificate must name the address used. Else it is not a pstrain task, "
            "or too loaded to answer")


def unreachable(what: str, address: str, tls: TLSConfig | None, *, where: str,
                speaker: str = "this process", details: str = "", timed_out: bool = False,
                longer: str = "a longer timeout", probe: float = PROBE_SECONDS) -> str:
    """Why a call to task ``what`` at ``address`` failed without an answer
    (UNAVAILABLE, or DEADLINE_EXCEEDED: ``timed_out``), what a TCP probe of
    it found, and what to check: one line. ``details``: the call's error;
    ``longer``: how to wait longer, for a task that accepts connections but
    was too slow."""
    kind, why = reachability(address, probe)
    if kind == "dns":
        head = f"{what} at {address}: {why}"
    elif kind in ("closed", "silent"):
        head = f"nothing answers at {address} ({what}, from {where}): {why}"
    elif timed_out:
        return (f"{what} at {address} accepts connections but did not answer in time "
                f"({details}): it may be overloaded (try {longer}); if it is not, "
                f"{advice(kind, what, where, tls, speaker)}")
    else:
        head = f"{what} at {address} accepts connections but the gRPC handshake fails ({details})"
    return f"{head}: {advice(kind, what, where, tls, speaker)}"


def not_answering(what: str, address: str, seconds: float | None, tls: TLSConfig | None,
                  where: str = "the cluster spec",
                  found: tuple[str, str] | None = None) -> str:
    """What to tell a person about task ``what`` ("ps 0", "worker 1") at
    ``address`` that did not answer within ``seconds`` (None: its first call
    failed): which one, and what to check (running? the right host and port?
    a firewall? TLS?). ``found``: ``reachability``'s answer when known, else
    a TCP connection to the task (up to 2 s) tells those apart."""
    kind, why = found if found is not None else reachability(address)
    said = {"dns": f": {why}", "closed": f"; a TCP connection: {why}",
            "silent": f"; a TCP connection: {why}",
            "open": ", though it accepts connections"}[kind]
    when = "its first call failed" if seconds is None else f"nothing within {seconds:g}s"
    return (f"{what} at {address} does not answer ({when}{said}): "
            f"{advice(kind, what, where, tls)}")


def diagnosed(err: PSError, role: str, tls: TLSConfig | None) -> PSError:
    """``err`` (a client's call to a task that has not answered it yet,
    failed with a code of UNREACHED) made to say why: the same error class,
    code and address, its message ``unreachable``'s line (with the call's
    own error in it where it tells more)."""
    address = err.address
    details = str(err).replace(f" [{address}]", "")
    what = "parameter server" if role == "ps" else role
    text = unreachable(what, address, tls, where="the address this client was given",
                       speaker="this client", details=details,
                       timed_out=err.code == Code.DEADLINE_EXCEEDED,
                       longer="a longer timeout= for the client", probe=_CLIENT_PROBE_SECONDS)
    return error_for(err.code, text, address)
