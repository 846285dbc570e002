"""The ``coordinator`` command (also ``python -m coordinator``): deployment and operator tools.

    coordinator run [--wait-ready S] [--worker-dns HOST:PORT] [--ps-dns HOST:PORT]
                    SCRIPT [ARGS...]
        Run a training script as the chief of the cluster in TF_CONFIG /
        TF_CONFIG_FILE, once every parameter server and worker answers the
        gRPC health check.
    coordinator health [--timeout S] HOST:PORT
        Exit 0 when the task at HOST:PORT reports SERVING (compose health checks).
    coordinator task --type {ps,worker} [--index N] [-- TASK ARGS...]
        Start this pod's psserver / psworker: the index is the StatefulSet
        ordinal of the hostname (ps-1 -> 1), the port that entry's port.
    coordinator evaluate CKPT_DIR --fn MODULE:FUNCTION --logdir DIR [--metrics-port N]
        Follow a checkpoint directory beside training: evaluate each new
        checkpoint once, write TensorBoard events, serve Prometheus metrics
        (coordinator/evaluation.py). Needs no cluster.

Operator tools, on the cluster in TF_CONFIG / TF_CONFIG_FILE or
``--ps HOST:PORT,...`` (token: $PSTRAIN_AUTH_TOKEN or --token; TLS: $PSTRAIN_TLS_*):

    coordinator ps list [--json]
        Every variable on every parameter server: its logical variable and
        shard, dtype, shape, version, optimizer, bytes; per-server totals.
    coordinator ps health [--json]
        gRPC health of every ps and worker; server_info of each ps. A task
        that serves but refuses this command's token shows
        "UNAUTHENTICATED: wrong token" and is not counted healthy.
    coordinator checkpoint save DIR [--step N] [--extra JSON] [--json]
        Have the parameter servers write a checkpoint under DIR, in
        CheckpointManager's format; prints its path.
    coordinator checkpoint restore DIR [--path ckpt-N] [--json]
        Put a checkpoint (default: the latest) back into the running
        servers, shard by shard; the layout must be the same.
    coordinator checkpoint list DIR [--json]
        The complete checkpoints in DIR (full, or a delta of its parent).
    coordinator export DIR [--every S] [--count N] [--full-every N] [--json]
        Write the model's weights (no optimizer state) under DIR as a
        serving export: a base, then deltas (coordinator.serving.Snapshot
        reads them); once, or every S seconds.

Exit status: run: 2 for a bad cluster description, 3 when tasks do not come
up. Operator tools: 0 ok, 1 failure (a task unreachable or refusing, no
checkpoint, a layout mismatch), 2 usage or configuration (bad arguments, no
or malformed cluster description, unreadable TLS files).

By command group: this module (run, health, task; the parser),
coordinator/cli_ops.py (the target, errors a person can act on, ps list and
health), coordinator/cli_checkpoint.py (checkpoint save, restore, list; export).
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import runpy
import shutil
import socket
import sys
import tempfile
from typing import Mapping

from coordinator import evaluation, ps_follow
from coordinator.checkpoint_files import CheckpointError
from coordinator.cli_checkpoint import _ckpt_list, _ckpt_restore, _ckpt_save, _export
from coordinator.cli_ops import (
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_NOT_READY,
    NotReady,
    OperatorError,
    _explain_error,
    _health_check,
    _ps_health,
    _ps_list,
    check_health,  # noqa: F401 -- cli.check_health, for callers of this module
    explain_health,
    target_from_args,
    wait_ready,
)
from coordinator.cluster_spec import (
    TF_CONFIG_ENV,
    TF_CONFIG_FILE_ENV,
    ClusterConfigError,
    Refreshing,
    TFConfigClusterResolver,
    parse_tf_config,
)
from psserver.contract import TOKEN_ENV, join_host_port
from psserver.errors import Code, PSError

_MODULES = {"ps": "psserver", "worker": "psworker"}
_PLURAL = {"ps": "parameter servers", "worker": "workers"}


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


class SpecDiscovery(Refreshing):
    """Keeps a TF_CONFIG file whose workers (and parameter servers) are the
    configured ones plus the addresses a DNS name resolves to now
    (``targets``: role -> "HOST:PORT"); the coordinator re-reads the file,
    so workers that come and go (``--scale worker=N``) join and leave the
    job, and parameter servers found later are added to it (``--ps-dns``:
    ClusterCoordinator's elastic_servers, coordinator/ps_follow.py)."""

    def __init__(self, targets: Mapping[str, str], environ: Mapping[str, str],
                 interval: float = 2.0):
        self.targets = {}
        for role, target in targets.items():
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise ClusterConfigError(f"--{role}-dns wants HOST:PORT, got {target!r}")
            self.targets[role] = (host.strip("[]"), int(port))
        self._environ = dict(environ)
        TFConfigClusterResolver(environ=self._environ)   # missing or malformed: say so now
        self.path = os.path.join(tempfile.mkdtemp(prefix="pstrain-"), "tf_config.json")
        self._text = None
        self._last: dict[str, list[str]] = {}   # role -> its name's last addresses
        self.start(interval, "SpecDiscovery")

    def refresh(self) -> None:
        try:
            cfg = json.loads(_config_text(self._environ))
            cluster = cfg["cluster"]
            listed = {role: list(cluster.get(role, [])) for role in self.targets}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return   # a file being rewritten: keep the last good one
        for role, (host, port) in self.targets.items():
            # a name that resolves to nothing (a DNS hiccup, the service between
            # replicas): the last answer stands (a job is not emptied by a blip)
            found = resolve_workers(host, port) or self._last.get(role, [])
            self._last[role] = found
            cluster[role] = listed[role] + [a for a in found if a not in listed[role]]
        text = json.dumps(cfg)
        if text != self._text:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
            self._text = text
            for role in self.targets:
                print(f"coordinator: {_PLURAL[role]} now {cluster[role]}", file=sys.stderr,
                      flush=True)

    def stop(self) -> None:
        super().stop()
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
            targets = {role: t for role, t in (("worker", args.worker_dns),
                                               ("ps", args.ps_dns)) if t}
            if targets:
                discovery = SpecDiscovery(targets, os.environ)
                os.environ[TF_CONFIG_FILE_ENV] = discovery.path
            if args.ps_dns:   # the script's ClusterCoordinator adds the servers found later
                os.environ.setdefault(ps_follow.ELASTIC_ENV, "1")
            resolver = TFConfigClusterResolver()
            spec, task = resolver.cluster_spec(), resolver.task()
            if not spec.ps:
                raise ClusterConfigError(
                    'the cluster has no parameter servers: add "ps" addresses to TF_CONFIG'
                    + (f" (--ps-dns {args.ps_dns} resolves to nothing yet)" if args.ps_dns
                       else ", or pass --ps-dns SERVICE:PORT"))
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
                refused = _token_refusals(spec)   # health is public: ask a call too
                if refused:
                    print("\n".join(f"coordinator: {r}" for r in refused), file=sys.stderr)
                    return EXIT_CONFIG
        except ClusterConfigError as exc:
            print(f"coordinator: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        except NotReady as exc:
            print(f"coordinator: {exc}", file=sys.stderr)
            return EXIT_NOT_READY
        script = os.path.abspath(args.script)
        sys.argv = [args.script, *args.script_args]
        sys.path.insert(0, os.path.dirname(script))
        try:
            runpy.run_path(script, run_name="__main__")   # its SystemExit / errors propagate
        except PSError as exc:   # the token or TLS: what to do, in one line, not a traceback
            if exc.code not in (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
                raise
            print(f"coordinator: {args.script} stopped: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        return 0
    finally:
        if discovery is not None:
            discovery.stop()


def _token_refusals(spec) -> list[str]:
    """Each task of ``spec`` that refuses a call with this process's token and
    TLS (what `ps health` says of it), as ps health asks: GetServerInfo,
    GetWorkerInfo. A wrong or missing token was seen only by the program,
    in a long traceback (issue 35 item 1)."""
    import dataclasses
    import types
    target = dataclasses.replace(target_from_args(types.SimpleNamespace(
        token=None, ps=None, worker=None, timeout=10.0)), token_flag=None)   # (run has none)
    out = []
    for role, addrs in (("ps", spec.ps), ("worker", spec.worker)):
        for i, addr in enumerate(addrs):
            try:
                target.ask(role, addr)
            except PSError as exc:
                if exc.code in (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
                    out.append(_explain_error(target, f"{role} {i}", addr, exc))
    return out


def _health(args) -> int:
    ok, detail, code = _health_check(args.address, args.timeout, args.service)
    if not ok:   # a task it cannot reach: why, and what to check (as ps health says it)
        detail = explain_health("the task", args.address, detail, code, "the command line",
                                args.timeout)
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


_OPERATOR_COMMANDS = {("ps", "list"): _ps_list, ("ps", "health"): _ps_health,
                      ("checkpoint", "save"): _ckpt_save,
                      ("checkpoint", "restore"): _ckpt_restore,
                      ("checkpoint", "list"): _ckpt_list, ("export", None): _export}


def _operator(args) -> int:
    try:
        return _OPERATOR_COMMANDS[(args.command, args.action)](args)
    except ClusterConfigError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OperatorError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return exc.code
    except CheckpointError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return EXIT_FAILURE


#: `coordinator --help`'s text: plain, as a terminal shows it (the module
#: docstring is reST for the documentation).
_DESCRIPTION = ("Deployment and operator tools of a pstrain cluster: run a training script "
                "as its chief, check a task's health, start a pod's task, inspect the "
                "parameter servers and workers, save, restore and list checkpoints, export "
                "the weights for serving, evaluate checkpoints beside training.")
_EPILOG = (f"The cluster: TF_CONFIG (TensorFlow's JSON) or TF_CONFIG_FILE (a file holding "
           f"it); operator tools also take --ps / --worker. Auth token: ${TOKEN_ENV}, the "
           "cluster's shared secret (or --token). TLS: $PSTRAIN_TLS_CERT, $PSTRAIN_TLS_KEY, "
           "$PSTRAIN_TLS_CA. Exit status: run: 2 for a bad cluster description, 3 when tasks "
           "do not come up; operator tools: 0 ok, 1 failure, 2 usage or configuration. "
           "Each command's options: coordinator COMMAND --help.")


def _chosen(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` chose, deepest first (coordinator ps list)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coordinator", description=_DESCRIPTION, epilog=_EPILOG)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="one of these (coordinator COMMAND --help tells more):")

    r = sub.add_parser("run", help="run a training script as the chief of the TF_CONFIG cluster")
    r.add_argument("--wait-ready", type=float, default=120.0, metavar="SECONDS",
                   help="wait up to this long for every ps and worker to pass the health "
                        "check (default 120; 0: do not wait)")
    r.add_argument("--worker-dns", metavar="HOST:PORT",
                   help="also use as workers every address HOST resolves to, looked up again "
                        "every 2s (docker compose --scale, a headless Service)")
    r.add_argument("--ps-dns", metavar="HOST:PORT",
                   help="also use as parameter servers every address HOST resolves to, "
                        "looked up again every 2s; the script's ClusterCoordinator adds "
                        "those found later to the running job and drains those that go "
                        f"while they answer (sets {ps_follow.ELASTIC_ENV}=1)")
    r.add_argument("script", help="the training script, run as __main__")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")

    h = sub.add_parser("health", help="exit 0 if the task at HOST:PORT is SERVING")
    h.add_argument("address", metavar="HOST:PORT", help="the task (psserver or psworker)")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    h.add_argument("--service", default="", help='health service name (default "": the server)')

    t = sub.add_parser("task", help="start this pod's psserver/psworker from the cluster spec")
    t.add_argument("--type", required=True, choices=sorted(_MODULES),
                   help="the task to start: ps (psserver) or worker (psworker)")
    t.add_argument("--index", type=int, help="task index (default: the hostname's ordinal)")
    t.add_argument("--hostname", help=argparse.SUPPRESS)
    t.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    t.add_argument("task_args", nargs=argparse.REMAINDER,
                   help="after --: more arguments for psserver/psworker")

    # Operator tools: the cluster's address, token and TLS; output format.
    cluster = argparse.ArgumentParser(add_help=False)
    cluster.add_argument("--ps", metavar="HOST:PORT,...",
                         help="parameter servers, in order (default: the cluster in TF_CONFIG / "
                              "TF_CONFIG_FILE, which is then not read)")
    cluster.add_argument("--token", help=f"auth token (default ${TOKEN_ENV}; prefer the "
                                         "variable: arguments are visible to other users)")
    cluster.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                         help="deadline of each call (default 10; saves get at least 600)")
    # Only `ps health` looks at workers: --worker is offered there alone.
    workers = argparse.ArgumentParser(add_help=False)
    workers.add_argument("--worker", metavar="HOST:PORT,...",
                         help="workers, in order (default: the cluster's in TF_CONFIG / "
                              "TF_CONFIG_FILE; none with --ps alone)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    epilog = ("TLS: $PSTRAIN_TLS_CERT, $PSTRAIN_TLS_KEY, $PSTRAIN_TLS_CA. Exit status: 0 ok, "
              "1 failure, 2 usage or configuration.")

    ps = sub.add_parser("ps", help="inspect the parameter servers and workers",
                        description="Inspect the cluster's parameter servers and workers.",
                        epilog=epilog)
    ps_sub = ps.add_subparsers(dest="action", required=True, metavar="ACTION",
                               help="what to show")
    ps_sub.add_parser("list", parents=[cluster, as_json], epilog=epilog,
                      help="every variable on every parameter server",
                      description="Every variable on every parameter server: its logical "
                                  "variable and shard (x/part_3 is shard 3 of x), rows, dtype, "
                                  "shape, version, optimizer, bytes of value + slots; "
                                  "per-server totals.")
    ps_sub.add_parser("health", parents=[cluster, workers, as_json], epilog=epilog,
                      help="gRPC health of every ps and worker, server info of each ps",
                      description="The gRPC health status of every parameter server and "
                                  "worker, and each parameter server's server_info (protocol, "
                                  "server id, variables, bytes). A task that serves but "
                                  "refuses this command's calls shows why (UNAUTHENTICATED: "
                                  "wrong token) and is not healthy. Exit 1 unless all serve "
                                  "and answer.")

    ck = sub.add_parser("checkpoint", help="save, restore, list checkpoints of the variables",
                        description="Checkpoints of the variables on the parameter servers, in "
                                    "CheckpointManager's format.", epilog=epilog)
    ck_sub = ck.add_subparsers(dest="action", required=True, metavar="ACTION",
                               help="what to do")
    sv = ck_sub.add_parser("save", parents=[cluster, as_json], epilog=epilog,
                           help="have the parameter servers write a checkpoint under DIR",
                           description="Have every parameter server write its shards into a "
                                       "new DIR/ckpt-NNNNNNNN (atomically: a tmp directory "
                                       "renamed when complete), with the manifest "
                                       "CheckpointManager writes and restores. DIR must be on "
                                       "storage the parameter servers see at the same path. "
                                       "Prints the checkpoint's path.")
    sv.add_argument("directory", metavar="DIR",
                    help="the checkpoint directory (CheckpointManager's), seen at this path "
                         "by the parameter servers")
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
    rs.add_argument("directory", metavar="DIR", help="the checkpoint directory")
    rs.add_argument("--path", help="the checkpoint: a ckpt-NNNNNNNN under DIR or a path "
                                   "(default: DIR's latest)")
    ls = ck_sub.add_parser("list", parents=[as_json], help="the checkpoints in DIR")
    ls.add_argument("directory", metavar="DIR", help="the checkpoint directory")

    ex = sub.add_parser("export", parents=[cluster, as_json], epilog=epilog,
                        help="write the weights (no optimizer state) for serving, as deltas",
                        description="Have the parameter servers write the values of every "
                                    "variable and dynamic table under DIR (a base, then deltas "
                                    "of what changed since the export before), which "
                                    "coordinator.serving.Snapshot loads and follows in a "
                                    "process that does not talk to the servers. DIR must be on "
                                    "storage the parameter servers see at the same path, under "
                                    "their --checkpoint-dir. Prints each export's path, kind "
                                    "and bytes.")
    ex.set_defaults(action=None)
    ex.add_argument("directory", metavar="DIR", help="the export directory")
    ex.add_argument("--every", type=float, metavar="SECONDS",
                    help="export again every SECONDS until interrupted (default: once)")
    ex.add_argument("--count", type=int, metavar="N", help="with --every: stop after N exports")
    ex.add_argument("--full-every", type=int, default=20, metavar="N",
                    help="a base at least every N exports (default 20)")
    ex.add_argument("--max-to-keep", type=int, default=3, metavar="N",
                    help="newest exports kept, with what their chains need (default 3)")

    ev = sub.add_parser("evaluate", help="evaluate each new checkpoint of a directory, beside "
                                         "training (TensorBoard, Prometheus)",
                        description="Follow CKPT_DIR and evaluate each new complete checkpoint "
                                    "once (the newest first: older new ones are skipped) with "
                                    "FUNCTION, reading the variables from its files. Training "
                                    "never waits for it. Exit status: 0 done (--once, "
                                    "--until-step), 1 FUNCTION cannot be loaded, 2 usage.")
    evaluation.add_arguments(ev)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # said by the command's own parser: its usage, not the top-level one
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "run":
        return _run(args)
    if args.command in ("ps", "checkpoint", "export"):
        return _operator(args)
    if args.command == "evaluate":
        return evaluation.main(args)
    try:
        return _health(args) if args.command == "health" else _task(args)
    except ClusterConfigError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
