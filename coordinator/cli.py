"""The ``coordinator`` command (also ``python -m coordinator``): deployment and operator tools.

    coordinator run [--wait-ready S] [--worker-dns HOST:PORT] SCRIPT [ARGS...]
        Run a training script as the chief of the cluster in TF_CONFIG /
        TF_CONFIG_FILE, once every parameter server and worker answers the
        gRPC health check.
    coordinator health [--timeout S] HOST:PORT
        Exit 0 when the task at HOST:PORT reports SERVING (compose health checks).
    coordinator task --type {ps,worker} [--index N] [-- TASK ARGS...]
        Start this pod's psserver / psworker: the index is the StatefulSet
        ordinal of the hostname (ps-1 -> 1), the port that entry's port.

Operator tools, on the cluster in TF_CONFIG / TF_CONFIG_FILE or
``--ps HOST:PORT,...`` (token: $PSTRAIN_AUTH_TOKEN or --token; TLS: $PSTRAIN_TLS_*):

    coordinator ps list [--json]
        Every variable on every parameter server: its logical variable and
        shard, dtype, shape, version, optimizer, bytes; per-server totals.
    coordinator ps health [--json]
        gRPC health of every ps and worker; server_info of each ps.
    coordinator checkpoint save DIR [--step N] [--extra JSON] [--json]
        Have the parameter servers write a checkpoint under DIR, in
        CheckpointManager's format; prints its path.
    coordinator checkpoint restore DIR [--path ckpt-N] [--json]
        Put a checkpoint (default: the latest) back into the running
        servers, shard by shard; the layout must be the same.
    coordinator checkpoint list DIR [--json]
        The complete checkpoints in DIR.

Exit status: run: 2 for a bad cluster description, 3 when tasks do not come
up. Operator tools: 0 ok, 1 failure (a task unreachable or refusing, no
checkpoint, a layout mismatch), 2 usage or configuration (bad arguments, no
or malformed cluster description, unreadable TLS files).
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import runpy
import shutil
import socket
import sys
import tempfile
import threading
import time
from concurrent import futures
from typing import Any, Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator import checkpoint as C
from coordinator.cluster_spec import (TF_CONFIG_ENV, TF_CONFIG_FILE_ENV, ClusterConfigError,
                                      TFConfigClusterResolver, parse_tf_config)
from psserver.client import PSClient
from psserver.contract import Code
from psserver.errors import PSError, from_rpc_error
from psserver.server import TOKEN_ENV, TOKEN_METADATA_KEY, join_host_port
from psserver.tls import CA_ENV, CERT_ENV, KEY_ENV, TLSConfig, make_channel

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG, EXIT_NOT_READY = 0, 1, 2, 3
_MODULES = {"ps": "psserver", "worker": "psworker"}


class NotReady(RuntimeError):
    """Some tasks did not pass the health check in time."""


# -- health -----------------------------------------------------------------------------------
def check_health(address: str, timeout: float = 5.0, service: str = "",
                 environ: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """(serving?, what the task said) for the grpc.health.v1 service at address.

    Health checks are public; the token ($PSTRAIN_AUTH_TOKEN) is sent only if
    the task asks for it. TLS settings come from $PSTRAIN_TLS_*.
    """
    return _health_check(address, timeout, service, environ)[:2]


def _health_check(address: str, timeout: float, service: str = "",
            environ: Mapping[str, str] = os.environ) -> tuple[bool, str, Code | None]:
    """check_health, and the status code of a failed check (None: it answered)."""
    try:
        tls = TLSConfig.from_env(environ)
    except ValueError as exc:
        return False, f"bad TLS settings: {exc}", None
    token = environ.get(TOKEN_ENV) or None
    with make_channel(address, [], tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            try:
                reply = stub.Check(request, timeout=timeout)
            except grpc.RpcError as exc:
                if from_rpc_error(exc).code != Code.UNAUTHENTICATED or not token:
                    raise
                reply = stub.Check(request, timeout=timeout,
                                   metadata=((TOKEN_METADATA_KEY, f"Bearer {token}"),))
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            return False, f"{err.code.name}: {exc.details()}", err.code
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status, None


def wait_ready(resolver, timeout: float, poll: float = 1.0, out=None) -> None:
    """Wait until every ps and worker in the (re-read) spec is SERVING.

    Raises NotReady naming the tasks that are not, with what they answered.
    """
    out = out or sys.stderr
    deadline = time.monotonic() + timeout
    ready: set[str] = set()
    while True:
        spec = resolver.cluster_spec()
        problems = []
        for role, addrs in (("ps", spec.ps), ("worker", spec.worker)):
            for i, addr in enumerate(addrs):
                if addr in ready:
                    continue
                left = deadline - time.monotonic()
                ok, detail = check_health(addr, timeout=min(5.0, max(0.5, left)))
                if ok:
                    ready.add(addr)
                    print(f"coordinator: {role} {i} at {addr} is serving", file=out, flush=True)
                else:
                    problems.append(f"{role} {i} at {addr}: {detail}")
        if not spec.worker:
            problems.append('no workers: the cluster has no "worker" addresses (add them to '
                            "TF_CONFIG, or pass --worker-dns SERVICE:PORT)")
        if not problems:
            return
        if time.monotonic() >= deadline:
            raise NotReady(
                f"after {timeout:g}s these tasks are still not serving:\n  "
                + "\n  ".join(problems)
                + "\nCheck that they run (their logs), that their names resolve from here "
                  "and the ports match the cluster spec, that $PSTRAIN_TLS_* match theirs; "
                  "or wait longer with --wait-ready SECONDS")
        time.sleep(poll)


# -- worker discovery by DNS (compose --scale, a Kubernetes headless Service) -----------------
def resolve_workers(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as sorted "ip:port" (IPv4 if it has any)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    ips = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    v4 = {ip for ip in ips if ip.version == 4}
    return [join_host_port(str(ip), port) for ip in sorted(v4 or ips)]


def _config_text(environ: Mapping[str, str]) -> str:
    path = environ.get(TF_CONFIG_FILE_ENV)
    if path:
        with open(path) as f:
            return f.read()
    return environ.get(TF_CONFIG_ENV, "")


class WorkerDiscovery:
    """Keeps a TF_CONFIG file whose workers are the configured ones plus the
    addresses a DNS name resolves to now; the coordinator re-reads the file,
    so workers that come and go (``--scale worker=N``) join and leave the job.
    """

    def __init__(self, target: str, environ: Mapping[str, str], interval: float = 2.0):
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise ClusterConfigError(f"--worker-dns wants HOST:PORT, got {target!r}")
        self.host, self.port, self.interval = host.strip("[]"), int(port), interval
        self._environ = dict(environ)
        TFConfigClusterResolver(environ=self._environ)   # missing or malformed: say so now
        self.path = os.path.join(tempfile.mkdtemp(prefix="pstrain-"), "tf_config.json")
        self._text = None
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="WorkerDiscovery")
        self._thread.start()

    def refresh(self) -> None:
        try:
            cfg = json.loads(_config_text(self._environ))
            cluster = cfg["cluster"]
            listed = list(cluster.get("worker", []))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return   # a file being rewritten: keep the last good one
        cluster["worker"] = listed + [a for a in resolve_workers(self.host, self.port)
                                      if a not in listed]
        text = json.dumps(cfg)
        if text != self._text:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
            self._text = text
            print(f"coordinator: workers now {cluster['worker']}", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


# -- task entry point (Kubernetes StatefulSets) -----------------------------------------------
def ordinal(hostname: str) -> int:
    """The StatefulSet ordinal of a pod's hostname: "ps-1" -> 1."""
    m = re.fullmatch(r".+-(\d+)", hostname.split(".")[0])
    if not m:
        raise ClusterConfigError(
            f"cannot take a task index from hostname {hostname!r}: expected a StatefulSet "
            "pod name ending in -N (e.g. ps-0); pass --index N")
    return int(m.group(1))


def task_command(config_text: str, task_type: str, index: int, host: str = "0.0.0.0",
                 extra: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """(argv, TF_CONFIG) that start task ``task_type:index`` of the cluster in config_text."""
    parse_tf_config(config_text)   # a clear error for anything malformed
    cluster = json.loads(config_text)["cluster"]
    tf_config = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    spec, _ = parse_tf_config(tf_config)   # checks the index is in the cluster
    port = getattr(spec, task_type)[index].rsplit(":", 1)[1]
    argv = [sys.executable, "-m", _MODULES[task_type], "--host", host, "--port", port, *extra]
    return argv, tf_config


# -- commands ---------------------------------------------------------------------------------
def _run(args) -> int:
    discovery = None
    try:
        try:
            if args.worker_dns:
                discovery = WorkerDiscovery(args.worker_dns, os.environ)
                os.environ[TF_CONFIG_FILE_ENV] = discovery.path
            resolver = TFConfigClusterResolver()
            spec, task = resolver.cluster_spec(), resolver.task()
            if not spec.ps:
                raise ClusterConfigError('the cluster has no parameter servers: add "ps" '
                                         "addresses to TF_CONFIG")
            if task is not None and task.type != "chief":
                raise ClusterConfigError(
                    f"TF_CONFIG's task is {task.type}:{task.index}, but `coordinator run` is "
                    'the chief: drop "task", or make it {"type": "chief", "index": 0}')
            if not os.path.isfile(args.script):
                raise ClusterConfigError(f"no such script: {args.script}")
            if args.wait_ready > 0:
                print(f"coordinator: waiting up to {args.wait_ready:g}s for {len(spec.ps)} ps "
                      "and the workers to serve", file=sys.stderr, flush=True)
                wait_ready(resolver, args.wait_ready)
        except ClusterConfigError as exc:
            print(f"coordinator: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        except NotReady as exc:
            print(f"coordinator: {exc}", file=sys.stderr)
            return EXIT_NOT_READY
        script = os.path.abspath(args.script)
        sys.argv = [args.script, *args.script_args]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")   # its SystemExit / errors propagate
        return 0
    finally:
        if discovery is not None:
            discovery.stop()


def _health(args) -> int:
    ok, detail = check_health(args.address, timeout=args.timeout, service=args.service)
    print(f"{args.address}: {detail}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def _task(args) -> int:
    index = args.index if args.index is not None else ordinal(args.hostname or socket.gethostname())
    extra = args.task_args[1:] if args.task_args[:1] == ["--"] else args.task_args
    try:
        text = _config_text(os.environ)
    except OSError as exc:
        raise ClusterConfigError(f"cannot read cluster file {os.environ[TF_CONFIG_FILE_ENV]}: "
                                 f"{exc}") from None
    if not text:
        TFConfigClusterResolver()   # raises: no cluster description
    argv, tf_config = task_command(text, args.type, index, args.host, tuple(extra))
    env = {k: v for k, v in os.environ.items() if k != TF_CONFIG_FILE_ENV}
    env[TF_CONFIG_ENV] = tf_config
    print(f"coordinator: starting {args.type} {index}: {' '.join(argv[1:])}", flush=True)
    os.execve(argv[0], argv, env)   # the task becomes this process (it gets the signals)


# == operator tools: coordinator ps list|health, coordinator checkpoint save|restore|list =====
class OperatorError(Exception):
    """A failure to report to the operator, with the exit status to end with."""

    def __init__(self, message: str, code: int = EXIT_FAILURE):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True)
class Target:
    """The cluster an operator command talks to, and how."""
    ps: tuple[str, ...]
    worker: tuple[str, ...]
    source: str                 # where the addresses came from (for messages)
    token: str | None
    tls: TLSConfig | None
    timeout: float

    def client(self, address: str) -> PSClient:
        return PSClient(address, token=self.token, tls=self.tls, timeout=self.timeout)

    def health_environ(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.token:
            env[TOKEN_ENV] = self.token
        return env


def _split_addresses(text: str | None, flag: str) -> tuple[str, ...]:
    out = tuple(a.strip() for a in (text or "").split(",") if a.strip())
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ClusterConfigError(f'bad {flag} address {a!r}: expected "host:port"')
    return out


def target_from_args(args, environ: Mapping[str, str] = os.environ) -> Target:
    """The cluster of --ps/--worker, else of TF_CONFIG / TF_CONFIG_FILE.

    Raises ClusterConfigError (exit 2) when there is none or it is malformed.
    """
    try:
        tls = TLSConfig.from_env(environ)
    except ValueError as exc:
        raise ClusterConfigError(f"bad TLS settings (${CERT_ENV}, ${KEY_ENV}, ${CA_ENV}): "
                                 f"{exc}") from None
    token = args.token or environ.get(TOKEN_ENV) or None
    if args.ps or args.worker:
        ps, worker = _split_addresses(args.ps, "--ps"), _split_addresses(args.worker, "--worker")
        source = "--ps" if not worker else "--ps / --worker"
    else:
        try:
            spec = TFConfigClusterResolver(environ=environ).cluster_spec()
        except ClusterConfigError as exc:
            if "no cluster description" in str(exc):
                raise ClusterConfigError(f"{exc}; or pass --ps HOST:PORT,HOST:PORT") from None
            raise
        ps, worker = spec.ps, spec.worker
        path = environ.get(TF_CONFIG_FILE_ENV)
        source = f"{TF_CONFIG_FILE_ENV}={path}" if path else TF_CONFIG_ENV
    if not ps:
        raise ClusterConfigError(f"the cluster in {source} has no parameter servers: list their "
                                 'addresses under "ps" (or pass --ps HOST:PORT,...)')
    return Target(tuple(ps), tuple(worker), source, token, tls, args.timeout)


# -- errors a person can act on ---------------------------------------------------------------
def _reachability(address: str, timeout: float) -> tuple[str, str]:
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


def _tls_words(tls: TLSConfig | None) -> str:
    if tls is None:
        return f"plaintext (no ${CERT_ENV} / ${KEY_ENV} / ${CA_ENV} set)"
    return ("TLS with a client certificate" if tls.cert else "TLS without a client certificate") \
        + (" and a CA" if tls.ca else " and the system's trusted CAs")


def explain(target: Target, what: str, address: str, code: Code | None,
            details: str) -> str:
    """What went wrong calling ``what`` ("ps 0") at address, and what to do about it."""
    details = details.replace(f" [{address}]", "")
    where = f"{what} at {address}"
    if code == Code.UNAUTHENTICATED:
        if not target.token:
            return (f"{where} demands the cluster's auth token and none was given: set "
                    f"${TOKEN_ENV} (or pass --token) to the token the tasks were started with")
        return (f"{where} refused the auth token (UNAUTHENTICATED): ${TOKEN_ENV} (or --token) is "
                "not this cluster's token; use the one the tasks were started with (Kubernetes: "
                f"Secret pstrain-auth, key token; compose: {TOKEN_ENV} in .env)")
    if code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, None):
        kind, why = _reachability(address, min(5.0, target.timeout))
        if kind == "dns":
            return (f"{where}: {why}. Check the address in {target.source}: is the host name "
                    "right and resolvable from here?")
        if kind == "closed":
            return (f"nothing answers at {address} ({what}, from {target.source}): {why}. Check "
                    f"that the address in {target.source} is right and that the task is running "
                    "there")
        if code == Code.DEADLINE_EXCEEDED:
            return (f"{where} accepts connections but did not answer within {target.timeout:g}s: "
                    "it may be overloaded or not a pstrain task; try a longer --timeout")
        return (f"{where} accepts connections but the gRPC handshake fails ({details}): most "
                f"likely a TLS mismatch. This command speaks {_tls_words(target.tls)}; set "
                f"${CA_ENV} to the CA that signed the tasks' certificate (and ${CERT_ENV} / "
                f"${KEY_ENV} when they demand client certificates), or unset all three if the "
                "tasks run plaintext; the tasks' certificate must name the address used")
    return f"{where}: {code.name}: {details}"


def _explain_error(target: Target, what: str, address: str, exc: Exception,
                   answered: bool = False) -> str:
    """explain() for an exception; ``answered``: the task answered earlier calls of this
    command, so losing it now means it went away (not a wrong address)."""
    lost = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED)
    if answered and isinstance(exc, PSError) and exc.code in lost:
        return (f"{what} at {address} stopped answering ({exc.code.name}: "
                f"{str(exc).replace(f' [{address}]', '')}); it answered moments before, so it "
                "probably crashed or restarted: check its logs and health "
                "(coordinator ps health)")
    if isinstance(exc, PSError):
        return explain(target, what, address, exc.code, str(exc))
    return f"{what} at {address}: {type(exc).__name__}: {exc}"


def _fan_out(fn: Callable, items: Sequence,
             threads: int = 16) -> list[tuple[Any, Exception | None]]:
    """[(fn(item), None) or (None, the exception)] in the order of items."""
    def safe(item):
        try:
            return fn(item), None
        except Exception as exc:  # noqa: BLE001 -- reported per item by the caller
            return None, exc
    if not items:
        return []
    with futures.ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(safe, items))


def _listing(target: Target) -> list[tuple[int, str, list | None, str | None]]:
    """(index, address, variables or None, error or None) of every parameter server."""
    def one(address):
        with target.client(address) as c:
            return c.list_variables()
    out = []
    for i, (addr, (metas, exc)) in enumerate(zip(target.ps, _fan_out(one, target.ps))):
        out.append((i, addr, metas, None if exc is None
                    else _explain_error(target, f"ps {i}", addr, exc)))
    return out


def _listing_or_fail(target: Target) -> dict[str, list]:
    """{address: variables} of every parameter server; OperatorError if one fails."""
    listing = _listing(target)
    errors = [err for _, _, _, err in listing if err]
    if errors:
        raise OperatorError("\n".join(errors))
    return {addr: metas for _, addr, metas, _ in listing}


# -- formatting ---------------------------------------------------------------------------------
def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return f"{n} B"   # not reached


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: set[int] = frozenset(),
           indent: str = "") -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append((indent + "  ".join(parts)).rstrip())
    return "\n".join(lines)


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


# -- coordinator ps list --------------------------------------------------------------------
def _ps_list(args) -> int:
    target = target_from_args(args)
    listing = _listing(target)
    good = {addr: metas for _, addr, metas, err in listing if err is None}
    counts: dict[str, int] = {}
    for metas in good.values():
        for m in metas:
            base, index = C.split_shard_name(m.name)
            if index is not None:
                counts[base] = counts.get(base, 0) + 1
    cuts: dict[str, tuple[int, int]] = {}
    if len(good) == len(listing):
        try:
            for v in C.layout_from_listing(good):
                cuts.update({s.name: (s.offset, s.rows) for s in v.shards if v.shape})
        except C.CheckpointError:
            pass   # not one consistent layout: shown without row ranges
    servers, grand = [], {"variables": 0, "value_bytes": 0, "slot_bytes": 0, "bytes": 0}
    for i, addr, metas, err in listing:
        if err is not None:
            servers.append({"index": i, "address": addr, "error": err})
            continue
        rows = []
        for m in metas:
            base, index = C.split_shard_name(m.name)
            offset, nrows = cuts.get(m.name, (None, None))
            rows.append({
                "name": m.name, "variable": base, "shard": index,
                "num_shards": counts.get(base) if index is not None else 1,
                "offset": offset, "rows": nrows, "dtype": m.dtype, "shape": list(m.shape),
                "version": m.version, "optimizer": m.optimizer,
                "optimizer_params": dict(m.optimizer_params),
                "value_bytes": m.nbytes, "slot_bytes": m.slot_nbytes,
                "bytes": m.nbytes + m.slot_nbytes})
        total = {"variables": len(rows), "value_bytes": sum(r["value_bytes"] for r in rows),
                 "slot_bytes": sum(r["slot_bytes"] for r in rows)}
        total["bytes"] = total["value_bytes"] + total["slot_bytes"]
        for k in grand:
            grand[k] += total[k]
        servers.append({"index": i, "address": addr, "variables": rows, "total": total})
    failed = [s for s in servers if "error" in s]
    if args.json:
        _print_json({"source": target.source, "servers": servers, "total": grand})
    elif len(failed) < len(servers):
        for s in servers:
            if "error" in s:
                print(f"ps {s['index']} at {s['address']}: not listed (see the error below)\n")
                continue
            print(f"ps {s['index']} at {s['address']}")
            if s["variables"]:
                print(_table(
                    ["NAME", "VARIABLE", "SHARD", "ROWS", "DTYPE", "SHAPE", "VERSION",
                     "OPTIMIZER", "BYTES"],
                    [[r["name"], r["variable"],
                      "-" if r["shard"] is None else f"{r['shard']} of {r['num_shards']}",
                      "-" if r["offset"] is None else f"{r['offset']}:{r['offset'] + r['rows']}",
                      r["dtype"], _shape(r["shape"]), r["version"], r["optimizer"],
                      human_bytes(r["bytes"])] for r in s["variables"]],
                    right={6, 8}, indent="  "))
            else:
                print("  (no variables)")
            t = s["total"]
            print(f"  total: {t['variables']} variable(s), {human_bytes(t['bytes'])} "
                  f"(values {human_bytes(t['value_bytes'])} + slots "
                  f"{human_bytes(t['slot_bytes'])})\n")
        print(f"all: {grand['variables']} variable(s) on {len(servers) - len(failed)} of "
              f"{len(servers)} parameter server(s), {human_bytes(grand['bytes'])}")
    for s in failed:
        print(f"coordinator: {s['error']}", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


# -- coordinator ps health --------------------------------------------------------------------
def _ps_health(args) -> int:
    target = target_from_args(args)
    env = target.health_environ()
    tasks = [("ps", i, a) for i, a in enumerate(target.ps)] + \
            [("worker", i, a) for i, a in enumerate(target.worker)]

    def probe(task):
        role, i, addr = task
        ok, detail, code = _health_check(addr, target.timeout, environ=env)
        entry: dict[str, Any] = {"role": role, "index": i, "address": addr,
                                 "status": detail if ok else detail.split(":", 1)[0],
                                 "serving": ok, "server_info": None, "error": None}
        if not ok:
            rest = detail.partition(": ")[2]
            entry["error"] = (explain(target, f"{role} {i}", addr, code, rest) if code
                              else f"{role} {i} at {addr}: {detail}")
            return entry
        if role == "ps":
            try:
                with target.client(addr) as c:
                    info = c.server_info()
                entry["server_info"] = {
                    "protocol_version": info.protocol_version, "server_id": info.server_id,
                    "num_variables": info.num_variables, "total_bytes": info.total_bytes,
                    "max_message_bytes": info.max_message_bytes}
            except PSError as exc:
                entry["error"] = _explain_error(target, f"{role} {i}", addr, exc)
        return entry
    entries = [r for r, _ in _fan_out(probe, tasks)]
    bad = [e for e in entries if e["error"] or not e["serving"]]
    if args.json:
        _print_json({"source": target.source, "ok": not bad, "tasks": entries})
    else:
        rows = []
        for e in entries:
            si = e["server_info"] or {}
            rows.append([e["role"], e["index"], e["address"], e["status"],
                         si.get("protocol_version", ""), si.get("server_id", ""),
                         si.get("num_variables", ""),
                         human_bytes(si["total_bytes"]) if si else ""])
        print(_table(["ROLE", "TASK", "ADDRESS", "HEALTH", "PROTOCOL", "SERVER ID", "VARIABLES",
                      "BYTES"], rows, right={1, 4, 6, 7}))
        print(f"{len(entries) - len(bad)} of {len(entries)} task(s) healthy"
              + ("" if target.worker else f" (no workers in {target.source})"))
    for e in bad:
        why = e["error"] or f"{e['role']} {e['index']} at {e['address']}: {e['status']}"
        print(f"coordinator: {why}", file=sys.stderr)
    return EXIT_FAILURE if bad else EXIT_OK


# -- coordinator checkpoint save / restore / list ------------------------------------------
def _step_of(path: str) -> int:
    return int(os.path.basename(path).split("-", 1)[1])


def _ckpt_save(args) -> int:
    target = target_from_args(args)
    try:
        extra = json.loads(args.extra) if args.extra else {}
    except ValueError as exc:
        raise ClusterConfigError(f"--extra is not valid JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ClusterConfigError('--extra must be a JSON object, e.g. \'{"epoch": 3}\'')
    if args.step is not None and args.step < 0:
        raise ClusterConfigError(f"--step must be >= 0, got {args.step}")
    listing = _listing_or_fail(target)
    try:
        layout = C.layout_from_listing(listing)
    except C.CheckpointError as exc:
        raise OperatorError(f"{exc}\nNo checkpoint written. Check that {target.source} lists "
                            "every parameter server.") from None
    if not layout:
        raise OperatorError("nothing to save: the parameter servers hold no variables")
    directory = os.path.abspath(args.directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise OperatorError(f"cannot create checkpoint directory {directory}: {exc}") from None
    existing = C.find_checkpoints(directory)
    if args.step is not None:
        step = args.step
    else:
        step = max(m.version for metas in listing.values() for m in metas)
        if existing:
            step = max(step, _step_of(existing[-1]) + 1)
    ps_index = {addr: i for i, addr in enumerate(target.ps)}
    with _Clients(target) as clients:
        try:
            final, nbytes = C.write_checkpoint(directory, step, layout, clients.get,
                                               ps_index=ps_index, extra=extra, replace=False)
        except C.CheckpointError as exc:
            raise OperatorError(f"{exc}\nNo checkpoint written.") from None
        except PSError as exc:
            raise OperatorError(
                _explain_error(target, f"ps {ps_index.get(exc.address, '?')}", exc.address,
                               exc, answered=True)
                + "\nThe parameter servers write the shard files themselves: DIR must be on "
                "storage they see at the same path (a shared volume); run this command where "
                "it is mounted (e.g. kubectl exec into the coordinator pod).\nNo checkpoint "
                "written.") from None
        except OSError as exc:
            raise OperatorError(f"cannot write the checkpoint under {directory}: {exc}") from None
    by_ps = {s.address for v in layout for s in v.shards}
    nshards = sum(len(v.shards) for v in layout)
    if args.json:
        _print_json({"path": final, "step": step, "variables": len(layout), "shards": nshards,
                     "bytes": nbytes, "parameter_servers": len(by_ps)})
    else:
        print(final)
        print(f"coordinator: saved {len(layout)} variable(s) ({nshards} shard(s), "
              f"{human_bytes(nbytes)}) from {len(by_ps)} parameter server(s) as step {step}",
              file=sys.stderr)
    return EXIT_OK


def _checkpoint_path(directory: str, path: str | None) -> str:
    """The checkpoint to restore: --path (under DIR, or as given), else DIR's latest."""
    if path:
        candidates = [path] if os.path.isabs(path) else [os.path.join(directory, path), path]
        for p in candidates:
            if os.path.isfile(os.path.join(p, "manifest.json")):
                return os.path.abspath(p)
        raise OperatorError(f"no checkpoint at {' or '.join(map(os.path.abspath, candidates))} "
                            "(no manifest.json there); `coordinator checkpoint list "
                            f"{directory}` shows the checkpoints")
    if not os.path.isdir(directory):
        raise OperatorError(f"no checkpoint found: {directory} does not exist")
    found = C.find_checkpoints(directory)
    if not found:
        raise OperatorError(f"no checkpoint found in {directory}: no ckpt-NNNNNNNN/ directory "
                            "with a manifest.json (unfinished ckpt-*.tmp-* saves do not count)")
    return found[-1]


class _Clients:
    """One PSClient per parameter server an operator command talks to, closed after."""

    def __init__(self, target: Target):
        self._target, self._clients = target, {}

    def get(self, address: str) -> PSClient:
        if address not in self._clients:
            self._clients[address] = self._target.client(address)
        return self._clients[address]

    def __enter__(self) -> "_Clients":
        return self

    def __exit__(self, *exc) -> None:
        for c in self._clients.values():
            c.close()


def _ckpt_restore(args) -> int:
    target = target_from_args(args)
    directory = os.path.abspath(args.directory)
    path = _checkpoint_path(directory, args.path)
    try:
        manifest = C.read_manifest(path)
    except C.CheckpointError as exc:
        raise OperatorError(str(exc)) from None
    listing = _listing_or_fail(target)
    try:
        layout = C.layout_from_listing(listing)
        plan = C.restore_plan(layout, manifest, path)
    except C.CheckpointError as exc:
        raise OperatorError(
            f"{exc}\nNothing was restored. `coordinator checkpoint restore` overwrites each "
            "shard by name, so the checkpoint must have the layout of the variables on the "
            "servers (the same variables, partitioner and number of parameter servers). To "
            "restore into another layout, restore from the training program: "
            f"CheckpointManager(strategy, {directory!r}).restore({path!r}) reassembles each "
            "variable and reshards it.") from None
    ps_index = {addr: i for i, addr in enumerate(target.ps)}
    with _Clients(target) as clients:
        try:   # everything read and checked first; nothing written on a bad checkpoint
            C.restore_checkpoint(path, layout, clients.get)
        except C.CheckpointError as exc:
            raise OperatorError(str(exc)) from None
        except PSError as exc:
            raise OperatorError(
                _explain_error(target, f"ps {ps_index.get(exc.address, '?')}", exc.address,
                               exc, answered=True)
                + f"\nThe restore of {path} stopped part-way: shards written before the "
                "failure hold the checkpoint, the others their own state. Fix the cause and "
                "restore again.") from None
    nvars = len({v.name for v, _, _ in plan})
    if args.json:
        _print_json({"path": path, "step": manifest.get("step"), "extra": manifest.get("extra", {}),
                     "variables": nvars, "shards": len(plan)})
    else:
        print(f"restored {path} (step {manifest.get('step')}): {nvars} variable(s), "
              f"{len(plan)} shard(s) on {len(target.ps)} parameter server(s)")
    return EXIT_OK


def _ckpt_list(args) -> int:
    directory = os.path.abspath(args.directory)
    out = []
    for path in C.find_checkpoints(directory):
        try:
            with open(os.path.join(path, "manifest.json")) as f:
                m = json.load(f)
            shards = [s for v in m["variables"].values() for s in v["shards"]]
            out.append({"path": path, "step": m.get("step"), "time": m.get("time"),
                        "variables": len(m["variables"]), "shards": len(shards),
                        "bytes": sum(s.get("bytes", 0) for s in shards),
                        "extra": m.get("extra", {})})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            out.append({"path": path, "error": f"unreadable manifest: {exc}"})
    if args.json:
        _print_json({"directory": directory, "checkpoints": out})
        return EXIT_OK
    if not out:
        print(f"no checkpoint in {directory}", file=sys.stderr)
        return EXIT_OK
    print(_table(["STEP", "SAVED", "VARIABLES", "SHARDS", "BYTES", "PATH"], [
        [c.get("step", "?"), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["time"]))
         if c.get("time") else "?", c.get("variables", "?"), c.get("shards", "?"),
         human_bytes(c["bytes"]) if "bytes" in c else c.get("error"), c["path"]]
        for c in out], right={0, 2, 3, 4}))
    return EXIT_OK


_OPERATOR_COMMANDS = {("ps", "list"): _ps_list, ("ps", "health"): _ps_health,
                      ("checkpoint", "save"): _ckpt_save,
                      ("checkpoint", "restore"): _ckpt_restore,
                      ("checkpoint", "list"): _ckpt_list}


def _operator(args) -> int:
    try:
        return _OPERATOR_COMMANDS[(args.command, args.action)](args)
    except ClusterConfigError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OperatorError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return exc.code
    except C.CheckpointError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coordinator", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a training script as the chief of the TF_CONFIG cluster")
    r.add_argument("--wait-ready", type=float, default=120.0, metavar="SECONDS",
                   help="wait up to this long for every ps and worker to pass the health "
                        "check (default 120; 0: do not wait)")
    r.add_argument("--worker-dns", metavar="HOST:PORT",
                   help="also use as workers every address HOST resolves to, looked up again "
                        "every 2s (docker compose --scale, a headless Service)")
    r.add_argument("script", help="the training script, run as __main__")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")

    h = sub.add_parser("health", help="exit 0 if the task at HOST:PORT is SERVING")
    h.add_argument("address", metavar="HOST:PORT")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    h.add_argument("--service", default="", help='health service name (default "": the server)')

    t = sub.add_parser("task", help="start this pod's psserver/psworker from the cluster spec")
    t.add_argument("--type", required=True, choices=sorted(_MODULES))
    t.add_argument("--index", type=int, help="task index (default: the hostname's ordinal)")
    t.add_argument("--hostname", help=argparse.SUPPRESS)
    t.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    t.add_argument("task_args", nargs=argparse.REMAINDER,
                   help="after --: more arguments for psserver/psworker")

    # Operator tools: the cluster's address, token and TLS; output format.
    cluster = argparse.ArgumentParser(add_help=False)
    cluster.add_argument("--ps", metavar="HOST:PORT,...",
                         help="parameter servers, in order (default: the cluster in TF_CONFIG / "
                              "TF_CONFIG_FILE, which --ps / --worker replace)")
    cluster.add_argument("--worker", metavar="HOST:PORT,...", help="workers (ps health)")
    cluster.add_argument("--token", help=f"auth token (default ${TOKEN_ENV}; prefer the "
                                         "variable: arguments are visible to other users)")
    cluster.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                         help="deadline of each call (default 10; saves get at least 600)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    epilog = ("TLS: $PSTRAIN_TLS_CERT, $PSTRAIN_TLS_KEY, $PSTRAIN_TLS_CA. Exit status: 0 ok, "
              "1 failure, 2 usage or configuration.")

    ps = sub.add_parser("ps", help="inspect the parameter servers and workers",
                        description="Inspect the cluster's parameter servers and workers.",
                        epilog=epilog)
    ps_sub = ps.add_subparsers(dest="action", required=True)
    ps_sub.add_parser("list", parents=[cluster, as_json], epilog=epilog,
                      help="every variable on every parameter server",
                      description="Every variable on every parameter server: its logical "
                                  "variable and shard (x/part_3 is shard 3 of x), rows, dtype, "
                                  "shape, version, optimizer, bytes of value + slots; "
                                  "per-server totals.")
    ps_sub.add_parser("health", parents=[cluster, as_json], epilog=epilog,
                      help="gRPC health of every ps and worker, server info of each ps",
                      description="The gRPC health status of every parameter server and "
                                  "worker, and each parameter server's server_info (protocol, "
                                  "server id, variables, bytes). Exit 1 unless all serve.")

    ck = sub.add_parser("checkpoint", help="save, restore, list checkpoints of the variables",
                        description="Checkpoints of the variables on the parameter servers, in "
                                    "CheckpointManager's format.", epilog=epilog)
    ck_sub = ck.add_subparsers(dest="action", required=True)
    sv = ck_sub.add_parser("save", parents=[cluster, as_json], epilog=epilog,
                           help="have the parameter servers write a checkpoint under DIR",
                           description="Have every parameter server write its shards into a "
                                       "new DIR/ckpt-NNNNNNNN (atomically: a tmp directory "
                                       "renamed when complete), with the manifest "
                                       "CheckpointManager writes and restores. DIR must be on "
                                       "storage the parameter servers see at the same path. "
                                       "Prints the checkpoint's path.")
    sv.add_argument("directory", metavar="DIR")
    sv.add_argument("--step", type=int,
                    help="the checkpoint's step (default: the largest shard version, or one "
                         "past DIR's latest checkpoint if that is larger)")
    sv.add_argument("--extra", metavar="JSON",
                    help='JSON object stored as the manifest\'s "extra" (e.g. \'{"epoch": 3}\')')
    rs = ck_sub.add_parser("restore", parents=[cluster, as_json], epilog=epilog,
                           help="put a checkpoint back into the running parameter servers",
                           description="Overwrite every shard on the running parameter servers "
                                       "(value, optimizer slots, version) from a checkpoint. "
                                       "The layout must be the same; to reshard, use "
                                       "CheckpointManager.restore in the training program.")
    rs.add_argument("directory", metavar="DIR")
    rs.add_argument("--path", help="the checkpoint: a ckpt-NNNNNNNN under DIR or a path "
                                   "(default: DIR's latest)")
    ls = ck_sub.add_parser("list", parents=[as_json], help="the checkpoints in DIR")
    ls.add_argument("directory", metavar="DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command in ("ps", "checkpoint"):
        return _operator(args)
    try:
        return _health(args) if args.command == "health" else _task(args)
    except ClusterConfigError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
