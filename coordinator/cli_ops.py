"""Operator tools shared by the `coordinator` commands that talk to a running
cluster, and `coordinator ps list|health`: the target (addresses, token,
TLS from the environment), errors explained so a person can act on them,
listing and formatting.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from concurrent import futures
from typing import Any, Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator import checkpoint_layout as L
from coordinator.checkpoint_files import CheckpointError
from coordinator.cluster_spec import (
    TF_CONFIG_ENV,
    TF_CONFIG_FILE_ENV,
    ClusterConfigError,
    NoClusterDescription,
    TFConfigClusterResolver,
)
from protos.pstrain.v1 import worker_pb2
from psserver.client import PSClient
from psserver.contract import BACKUP_PREFIX, TOKEN_ENV, TOKEN_METADATA_KEY
from psserver.contract.keys import parse_layout
from psserver.errors import Code, PSError
from psserver.link import methods
from psserver.link.channel import TaskChannel
from psserver.link.diagnose import unreachable
from psserver.link.transport import from_rpc_error
from psserver.tls import CA_ENV, CERT_ENV, KEY_ENV, TLSConfig, make_channel

#: Exit statuses of every `coordinator` command.
EXIT_OK, EXIT_FAILURE, EXIT_CONFIG, EXIT_NOT_READY = 0, 1, 2, 3


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
        failed = []   # (what, address, detail, code)
        for role, addrs in (("ps", spec.ps), ("worker", spec.worker)):
            for i, addr in enumerate(addrs):
                if addr in ready:
                    continue
                left = min(5.0, max(0.5, deadline - time.monotonic()))
                ok, detail, code = _health_check(addr, left)
                if ok:
                    ready.add(addr)
                    print(f"coordinator: {role} {i} at {addr} is serving", file=out, flush=True)
                else:
                    failed.append((f"{role} {i}", addr, detail, code))
        if not failed and spec.worker:
            return
        if time.monotonic() >= deadline:
            # Each said once, at the end: why it cannot be reached, what to check
            # (their probes at once: a silent address waits for its own).
            where = spec_source()
            said = _fan_out(lambda f: f"{f[0]} at {f[1]}: " + explain_health(
                *f, where=where, timeout=timeout, timeout_flag="--wait-ready"), failed)
            problems = [text or f"{f[0]} at {f[1]}: {f[2]}" for (text, _), f in zip(said, failed)]
            if not spec.worker:
                problems.append('no workers: the cluster has no "worker" addresses (add them to '
                                "TF_CONFIG, or pass --worker-dns SERVICE:PORT)")
            raise NotReady(
                f"after {timeout:g}s these tasks are still not serving:\n  "
                + "\n  ".join(problems)
                + "\nCheck that they run (their logs), that their names resolve from here "
                  "and the ports match the cluster spec, that $PSTRAIN_TLS_* match theirs; "
                  "or wait longer with --wait-ready SECONDS")
        time.sleep(poll)



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
    token_flag: str | None = "--token"   # the command's option for the token (None: none)
    timeout_flag: str = "--timeout"      # the command's option for how long to wait

    # (self.tls is what the command settled on: None is plaintext; its errors
    # are explained with the command's words, explain(), not the client's.)
    def client(self, address: str) -> PSClient:
        return PSClient(address, token=self.token, tls=self.tls or False, timeout=self.timeout,
                        diagnose=False)

    def worker_info(self, address: str) -> worker_pb2.WorkerInfo:
        """The worker's GetWorkerInfo, with this command's token (raises PSError)."""
        with TaskChannel(address, role="worker", token=self.token, tls=self.tls or False,
                         timeout=self.timeout, diagnose=False) as channel:
            return channel.call(methods.WORKER_INFO, worker_pb2.WorkerInfoRequest())

    def ask(self, role: str, address: str) -> tuple:
        """The call that proves a task takes this command's token (its health
        check is public): a ps's (ServerInfo, its table shards), a worker's
        (WorkerInfo, ()). Raises PSError."""
        if role != "ps":
            return self.worker_info(address), ()
        with self.client(address) as c:
            return c.server_info(), c.list_tables()

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
    workers = getattr(args, "worker", None)   # only `ps health` offers --worker
    if args.ps or workers:
        ps, worker = _split_addresses(args.ps, "--ps"), _split_addresses(workers, "--worker")
        source = "--ps" if not worker else "--ps / --worker"
    else:
        try:
            spec = TFConfigClusterResolver(environ=environ).cluster_spec()
        except NoClusterDescription as exc:
            raise ClusterConfigError(f"{exc}; or pass --ps HOST:PORT,HOST:PORT") from None
        ps, worker = spec.ps, spec.worker
        source = spec_source(environ)
    if not ps:
        raise ClusterConfigError(f"the cluster in {source} has no parameter servers: list their "
                                 'addresses under "ps" (or pass --ps HOST:PORT,...)')
    return Target(tuple(ps), tuple(worker), source, token, tls, args.timeout)


# -- errors a person can act on ---------------------------------------------------------------
def explain(target: Target, what: str, address: str, code: Code | None,
            details: str) -> str:
    """What went wrong calling ``what`` ("ps 0") at address, and what to do about it."""
    details = details.replace(f" [{address}]", "")
    where = f"{what} at {address}"
    if code == Code.UNAUTHENTICATED:
        flag = target.token_flag
        if not target.token:
            return (f"{where} demands the cluster's auth token and none was given: set "
                    f"${TOKEN_ENV}{f' (or pass {flag})' if flag else ''} to the token the "
                    "tasks were started with")
        return (f"{where} refused the auth token (UNAUTHENTICATED): ${TOKEN_ENV}"
                f"{f' (or {flag})' if flag else ''} is not this cluster's token; use the one "
                "the tasks were started with (Kubernetes: Secret pstrain-auth, key token; "
                f"compose: {TOKEN_ENV} in .env)")
    if code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, None):
        return unreachable(what, address, target.tls, where=target.source,
                           speaker="this command", details=details,
                           timed_out=code == Code.DEADLINE_EXCEEDED,
                           longer=f"a longer {target.timeout_flag} than {target.timeout:g}s",
                           probe=min(5.0, target.timeout))
    return f"{where}: {code.name}: {details}"


def explain_health(what: str, address: str, detail: str, code: Code | None, where: str,
                   timeout: float, timeout_flag: str = "--timeout",
                   environ: Mapping[str, str] = os.environ) -> str:
    """A failed health check (``_health_check``'s detail and code) of task
    ``what`` at ``address`` (from ``where``; waited for ``timeout`` s, the
    command's ``timeout_flag``), said as explain() says a failed call:
    "CODE: why, what to check"."""
    if code not in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):   # it answered (or bad TLS
        return detail                                              # settings): as it said
    target = Target((), (), where, environ.get(TOKEN_ENV) or None, TLSConfig.from_env(environ),
                    timeout, token_flag=None, timeout_flag=timeout_flag)
    return f"{code.name}: {explain(target, what, address, code, detail.partition(': ')[2])}"


def spec_source(environ: Mapping[str, str] = os.environ) -> str:
    """Where TFConfigClusterResolver takes the cluster from, for messages."""
    path = environ.get(TF_CONFIG_FILE_ENV)
    return f"{TF_CONFIG_FILE_ENV}={path}" if path else TF_CONFIG_ENV


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


def _table_rows(target: Target) -> list[tuple[list | None, str | None]]:
    """(the dynamic-table shards as ``ps list --json`` shows them, or None;
    error or None) of every parameter server, in order."""
    def one(address):
        with target.client(address) as c:
            return [{"name": t.name, "table": t.name.removeprefix(BACKUP_PREFIX),
                     "copy": "backup" if t.name.startswith(BACKUP_PREFIX) else "primary",
                     "rows": t.rows, "dim": t.spec.dim, "dtype": t.spec.dtype or "float32",
                     "step": t.step, "optimizer": t.spec.optimizer.name, "bytes": t.bytes,
                     **_moved(t.layout, address, t.rows)}
                    for t in c.list_tables()]
    return [(rows, None if exc is None else _explain_error(target, f"ps {i}", addr, exc))
            for i, (addr, (rows, exc)) in enumerate(zip(target.ps, _fan_out(one, target.ps)))]


def _moved(layout: str, address: str, rows: int) -> dict:
    """A table shard's place in its table's layout after buckets moved
    (coordinator/elastic.py): {"layout_epoch", "buckets": of the 4,096 it
    holds: 0 for a drained shard (not in the layout, no rows), None where
    the layout names it otherwise}; both None if none moved."""
    if not layout:
        return {"layout_epoch": None, "buckets": None}
    try:
        epoch, addresses, buckets = parse_layout(layout)
    except PSError:
        return {"layout_epoch": None, "buckets": None}
    held = int((buckets.owner == addresses.index(address)).sum()) \
        if address in addresses else None if rows else 0
    return {"layout_epoch": epoch, "buckets": held}


def _listing_or_fail(target: Target) -> dict[str, list]:
    """{address: variables} of every parameter server; OperatorError if one fails."""
    listing = _listing(target)
    errors = [err for _, _, _, err in listing if err]
    if errors:
        raise OperatorError("\n".join(errors))
    return {addr: metas for _, addr, metas, _ in listing}


# -- formatting ---------------------------------------------------------------------------------
def _buckets(t: dict) -> str:
    """ps list's BUCKETS cell: "-" (none moved: an even share), "N (layout E)"
    after moves, "? (layout E)" where the layout names this server otherwise."""
    if t["layout_epoch"] is None:
        return "-"
    return f"{'?' if t['buckets'] is None else t['buckets']} (layout {t['layout_epoch']})"


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
    tables = _table_rows(target)
    listing = [(i, addr, metas, err or terr) for (i, addr, metas, err), (_, terr)
               in zip(_listing(target), tables)]
    good = {addr: metas for _, addr, metas, err in listing if err is None}
    counts: dict[str, int] = {}
    for metas in good.values():
        for m in metas:
            base, index = L.split_shard_name(m.name)
            if index is not None:
                counts[base] = counts.get(base, 0) + 1
    cuts: dict[str, tuple[int, int]] = {}
    if len(good) == len(listing):
        try:
            for v in L.layout_from_listing(good):
                cuts.update({s.name: (s.offset, s.rows) for s in v.shards if v.shape})
        except CheckpointError:
            pass   # not one consistent layout: shown without row ranges
    servers = []
    grand = {"variables": 0, "value_bytes": 0, "slot_bytes": 0, "tables": 0, "table_rows": 0,
             "table_bytes": 0, "bytes": 0}
    for i, addr, metas, err in listing:
        if err is not None:
            servers.append({"index": i, "address": addr, "error": err})
            continue
        rows = []
        for m in metas:
            base, index = L.split_shard_name(m.name)
            offset, nrows = cuts.get(m.name, (None, None))
            rows.append({
                "name": m.name, "variable": base, "shard": index,
                "num_shards": counts.get(base) if index is not None else 1,
                "offset": offset, "rows": nrows, "dtype": m.dtype, "shape": list(m.shape),
                "version": m.version, "optimizer": m.optimizer,
                "optimizer_params": dict(m.optimizer_params),
                "value_bytes": m.nbytes, "slot_bytes": m.slot_nbytes,
                "bytes": m.nbytes + m.slot_nbytes})
        shards = tables[i][0]
        total = {"variables": len(rows), "value_bytes": sum(r["value_bytes"] for r in rows),
                 "slot_bytes": sum(r["slot_bytes"] for r in rows), "tables": len(shards),
                 "table_rows": sum(t["rows"] for t in shards),
                 "table_bytes": sum(t["bytes"] for t in shards)}
        total["bytes"] = total["value_bytes"] + total["slot_bytes"] + total["table_bytes"]
        for k in grand:
            grand[k] += total[k]
        servers.append({"index": i, "address": addr, "variables": rows, "tables": shards,
                        "total": total})
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
            elif not s["tables"]:
                print("  (no variables)")
            if s["tables"]:
                print(_table(
                    ["TABLE SHARD", "TABLE", "COPY", "ROWS", "DIM", "DTYPE", "STEP", "OPTIMIZER",
                     "BYTES", "BUCKETS"],
                    [[t["name"], t["table"], t["copy"], t["rows"], t["dim"], t["dtype"],
                      t["step"], t["optimizer"], human_bytes(t["bytes"]), _buckets(t)]
                     for t in s["tables"]],
                    right={3, 4, 6, 8}, indent="  "))
            t = s["total"]
            print(f"  total: {t['variables']} variable(s), {t['tables']} table shard(s) of "
                  f"{t['table_rows']:,} rows, {human_bytes(t['bytes'])} (values "
                  f"{human_bytes(t['value_bytes'])} + slots {human_bytes(t['slot_bytes'])} + "
                  f"tables {human_bytes(t['table_bytes'])})\n")
        print(f"all: {grand['variables']} variable(s) and {grand['tables']} table shard(s) "
              f"({grand['table_rows']:,} rows) on {len(servers) - len(failed)} of "
              f"{len(servers)} parameter server(s), {human_bytes(grand['bytes'])}")
    for s in failed:
        print(f"coordinator: {s['error']}", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


# -- coordinator ps health --------------------------------------------------------------------
def _refusal(target: Target, exc: PSError) -> str:
    """The HEALTH cell of a task whose health check passed but whose calls
    fail: "UNAUTHENTICATED: wrong token", "UNAUTHENTICATED: no token", or the
    status code."""
    if exc.code == Code.UNAUTHENTICATED:
        return f"{exc.code.name}: {'wrong token' if target.token else 'no token'}"
    return exc.code.name


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
        # Health is public: a task also has to take this command's token (and
        # answer a real call) to count as healthy.
        try:
            info, shards = target.ask(role, addr)
            if role == "ps":
                entry["server_info"] = {
                    "protocol_version": info.protocol_version, "server_id": info.server_id,
                    "num_variables": info.num_variables, "total_bytes": info.total_bytes,
                    "max_message_bytes": info.max_message_bytes,
                    "num_table_shards": len(shards), "table_rows": sum(t.rows for t in shards),
                    "table_bytes": sum(t.bytes for t in shards)}
        except PSError as exc:
            entry["status"] = _refusal(target, exc)
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
                         si.get("num_variables", ""), si.get("num_table_shards", ""),
                         f"{si['table_rows']:,}" if si else "",
                         human_bytes(si["total_bytes"] + si["table_bytes"]) if si else ""])
        print(_table(["ROLE", "TASK", "ADDRESS", "HEALTH", "PROTOCOL", "SERVER ID", "VARIABLES",
                      "TABLE SHARDS", "TABLE ROWS", "BYTES"], rows, right={1, 4, 6, 7, 8, 9}))
        print(f"{len(entries) - len(bad)} of {len(entries)} task(s) healthy"
              + ("" if target.worker else f" (no workers in {target.source})"))
    for e in bad:
        why = e["error"] or f"{e['role']} {e['index']} at {e['address']}: {e['status']}"
        print(f"coordinator: {why}", file=sys.stderr)
    return EXIT_FAILURE if bad else EXIT_OK
