"""What every task process (psserver, psworker) does around its service: the
command line they share (address, data port, auth, CPUs, TLS, metrics,
logging), the checks before listening (a token or loopback), and running
until a signal or until the process that started it is gone.

``begin(args, role, job)`` is a task's start, once: logging, its port
(``--port`` or its TF_CONFIG entry), the token and the auth check, CPUs,
profiling, TLS and the metrics endpoint; ``serve(handle)`` runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
import textwrap
import threading

from psserver import metrics, profiling
from psserver import tls as TLS
from psserver.contract import TOKEN_ENV, join_host_port, tf_config

log = logging.getLogger("psserver")


def add_task_arguments(p: argparse.ArgumentParser, grace: str) -> None:
    """The options every task takes: where it listens, its data port, the
    port file, the grace period (``grace``: what finishes in it), logging,
    auth, CPUs, TLS and metrics."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 or [::] listens on all "
                        "interfaces)")
    p.add_argument("--port", type=int, default=None,
                   help="port to bind; 0 picks a free one (default: this task's TF_CONFIG "
                        "entry, else 0)")
    add_data_port_argument(p)
    p.add_argument("--port-file", help="write the bound port to this file once serving")
    p.add_argument("--grace", type=float, default=5.0,
                   help=f"seconds {grace} in flight get to finish on SIGTERM (default 5)")
    add_log_level_argument(p)
    add_auth_argument(p)
    add_cpus_argument(p)
    TLS.add_arguments(p)
    metrics.add_arguments(p)


@dataclasses.dataclass
class Start:
    """What ``begin`` made: the address to bind, the token, TLS, and the
    metrics endpoint ((registry, server) or None)."""
    address: str
    token: str | None
    tls: object
    served: tuple | None


def begin(args, role: str, job: str) -> Start | None:
    """A task's start (see the module); None after printing why it cannot
    (the command then exits 2)."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {role} %(levelname)s %(message)s")
    token = os.environ.get(TOKEN_ENV) or None
    try:
        port = args.port if args.port is not None else tf_config.task_port(job, role)
        check_auth(args, role, token)
        tls, served = task_setup(args, role)
    except (tf_config.ClusterConfigError, TaskSetupError) as exc:
        print(f"{role}: {exc}", file=sys.stderr)
        return None
    return Start(join_host_port(args.host, port), token, tls, served)


def write_port_file(path: str, port: int) -> None:
    """Write the port atomically, so a reader never sees a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


#: Set by psserver.process.start_task: the task stops when that process is gone,
#: so a LocalCluster whose program was killed leaves no tasks behind.
PARENT_PID_ENV = "PSTRAIN_PARENT_PID"


def _exit_with_parent(stop: threading.Event) -> None:
    pid = int(os.environ.get(PARENT_PID_ENV) or 0)
    if not pid:
        return
    if os.getppid() == 0:
        # The first process of a new PID namespace (a test host's `unshare
        # --fork --kill-child`): its parent is outside and reads as 0, and
        # the namespace ends with that parent.
        return

    def watch() -> None:
        while not stop.wait(1.0):   # a check a second: the parent has no way to tell us
            if os.getppid() != pid:
                log.warning("parent process %d is gone: stopping", pid)
                stop.set()
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()

def serve(handle, *, grace: float = 5.0, port_file: str | None = None,
          host: str = "127.0.0.1", role: str = "psserver", leave=None) -> None:
    """Run ``handle`` (a ServerHandle: psserver/serve/server.py) until SIGTERM or
    SIGINT, or until the process that started this one is gone; then stop
    gracefully. ``leave(again)``: run at the first signal, the task stops
    when it returns (``again()``: whether another signal came since, to stop
    at once; psserver/serve/leave.py)."""
    stop = threading.Event()
    fired: list[int] = []

    def stop_after_leave() -> None:
        try:
            if leave is not None:
                leave(lambda: len(fired) > 1)
        finally:
            stop.set()

    def on_signal(signum, frame) -> None:
        # A handler runs in the main thread between two bytecodes, maybe
        # inside stop.wait(), or inside this handler's own Thread.start()
        # holding threading's locks: a second signal there that took a lock
        # (LocalCluster sends two) deadlocked the task until SIGKILL. So only
        # the first starts a thread (which takes the locks); later ones append.
        # (Looked at before the append: a signal landing between the two starts
        # its own thread, rather than leaving none started.)
        first = not fired
        fired.append(signum)
        if first:
            threading.Thread(target=stop_after_leave, name="signal-stop", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    _exit_with_parent(stop)
    handle.start()
    if port_file:   # before the announcement, so a reader of either sees both
        write_port_file(port_file, handle.port)
    if handle.data is not None:
        print(f"{role} data port on {host}:{handle.data.port}", flush=True)
    print(f"{role} listening on {host}:{handle.port}", flush=True)
    stop.wait()
    log.info("signal received: stopping (grace %.1fs)", grace)
    handle.stop(grace)
    if profiling.active is not None:   # PSTRAIN_PROFILE: the last calls' profiles too
        profiling.active.write_all()

def task_epilog(role: str) -> str:
    """The end of a task's --help (psserver, psworker): the environment it
    reads beyond the defaults its options name (docs/configuration.md has all)."""
    job = "ps" if role == "psserver" else "worker"
    unset = ("this server listens on loopback only (unless --insecure-no-auth) and any "
             "user of this machine may read and change every variable" if role == "psserver"
             else "this worker runs no closures and listens on loopback only (unless "
             "--insecure-no-auth)")
    entries = [
        (TOKEN_ENV, "the cluster's auth token: a shared secret, the same on every task and "
                    "the coordinator. Every call but health checks must carry it. Unset: "
                    f"{unset}"),
        ("TF_CONFIG, TF_CONFIG_FILE", "the cluster in TensorFlow's JSON (or a file holding "
                                      "it): without --port, this task binds the port of its "
                                      f'"task" entry, which must be a "{job}" one'),
        (profiling.ENV, "a directory: profile every call this task serves (cProfile) into "
                        "<role>-*.prof files there; python -m psserver.profiling DIR prints "
                        "them merged"),
    ]
    lines = ["environment:"]
    for name, text in entries:
        lines.append(f"  {name}")
        lines += textwrap.wrap(text, 76, initial_indent="      ", subsequent_indent="      ")
    lines += ["", "Every option and variable: docs/configuration.md"]
    return "\n".join(lines)

def help_formatter(prog: str) -> argparse.HelpFormatter:
    """Options wrapped as usual; the description and epilog kept as written."""
    return argparse.RawDescriptionHelpFormatter(prog)

def add_log_level_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", metavar="LEVEL",
                   help="log messages of this level and above: DEBUG, INFO, WARNING, ERROR "
                        "(default INFO)")

class TaskSetupError(Exception):
    """A task's TLS files, metrics port or CPU list are unusable (the command exits 2)."""

def add_data_port_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-port", type=int, default=0, metavar="PORT",
                   help="TCP port of the data port: the hot calls framed by hand beside "
                        "gRPC, for clients on other hosts (same host, TLS and token); 0 picks "
                        "a free one (default; clients learn it over gRPC), -1 turns it off. "
                        "Fix it where a firewall or Kubernetes Service must name it")

def data_port_of(args) -> int | None:
    return None if args.data_port < 0 else args.data_port

INSECURE_FLAG = "--insecure-no-auth"

def add_auth_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(INSECURE_FLAG, action="store_true",
                   help=f"run without ${TOKEN_ENV} where that is refused (listening beyond "
                        "loopback; a worker running closures): anyone who reaches the task "
                        "may then change its state and, on a worker, run code as this user. "
                        "For isolated test networks only")

def is_loopback(host: str) -> bool:
    """Whether every address ``host`` binds is a loopback one (127/8, ::1,
    a name resolving only to those). 0.0.0.0 and :: listen everywhere."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    try:
        return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                   for a in addrs)
    except ValueError:
        return False

def check_auth(args, role: str, token: str | None) -> None:
    """Refuse (TaskSetupError) a tokenless task asked to listen beyond
    loopback without --insecure-no-auth; warn, on every start, about any
    tokenless task. The token is what stands between the network and this
    task's state (and, on a worker, running code)."""
    if token:
        return
    exposed = not is_loopback(args.host)
    if exposed and not args.insecure_no_auth:
        raise TaskSetupError(
            f"refusing to listen on {args.host} without an auth token: anyone who reaches "
            f"it could change this {role}'s state{' and run code on it' if role == 'psworker' else ''}. "
            f"Set ${TOKEN_ENV} (the same secret on every task and the coordinator), or pass "
            f"{INSECURE_FLAG} on an isolated network")
    if role == "psworker" and not args.insecure_no_auth:   # (psworker/worker.py: trusted)
        log.warning("no %s: this worker runs no closures (it refuses every function, by name "
                    "or by value). Set %s on every task and the coordinator, or pass %s on an "
                    "isolated network to run them without one", TOKEN_ENV, TOKEN_ENV,
                    INSECURE_FLAG)
        return
    who = "anyone who can reach it" if exposed else "any user of this machine"
    what = ("run any code as this user (closures)" if role == "psworker"
            else "read and change every variable")
    log.warning("SECURITY: no %s: %s can %s%s. Set %s on every task", TOKEN_ENV, who, what,
                f" ({INSECURE_FLAG})" if args.insecure_no_auth else "", TOKEN_ENV)

def add_cpus_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpus", metavar="LIST",
                   help="run on these CPUs only, as taskset -c takes them (0-3,8): binds "
                        "the task to cores, as MPI and Horovod bind ranks (default: every "
                        "CPU it was given)")

def parse_cpus(text: str) -> set[int]:
    """The CPU numbers of a list such as "0-3,8" (ValueError when malformed)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--cpus {text!r}: expected CPU numbers and ranges such as 0-3,8")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"--cpus {text!r}: range {part.strip()!r} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus

def bind_cpus(text: str | None) -> None:
    """Bind this process to the CPUs of ``text`` (before it starts threads:
    they inherit it). Raises TaskSetupError saying which CPUs there are."""
    if not text:
        return
    try:
        cpus = parse_cpus(text)
    except ValueError as exc:
        raise TaskSetupError(str(exc)) from None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise TaskSetupError(f"--cpus {text!r}: CPU {min(cpus - allowed)} is not one this task "
                             f"may use; it may use {_cpu_list(allowed)}")
    os.sched_setaffinity(0, cpus)

def _cpu_list(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))

def task_setup(args, role: str):
    """(TLS config, metrics endpoint) from a task's command line, shared by
    psserver and psworker; binds the process to ``--cpus``; profiles its
    calls when $PSTRAIN_PROFILE says (psserver/profiling.py). Raises
    TaskSetupError with what to change."""
    bind_cpus(args.cpus)
    try:
        profiling.start_from_env(role)
    except ValueError as exc:
        raise TaskSetupError(str(exc)) from None
    try:
        tls = TLS.from_arguments(args)
    except ValueError as exc:
        raise TaskSetupError(str(exc)) from None
    try:
        served = metrics.start_from_arguments(args, role, args.host)
    except (ValueError, OSError) as exc:
        raise TaskSetupError(f"cannot serve metrics: {exc}. Pick another --metrics-port, "
                             "or 0 for a free one") from None
    return tls, served
