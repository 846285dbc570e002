"""`coordinator checkpoint save|restore|list` and `coordinator export`:
checkpoints and serving exports from outside the training program, through
coordinator/checkpoint.py's one implementation.
"""
from __future__ import annotations

import json
import os
import sys
import time
import types

from coordinator import checkpoint_layout as L
from coordinator.checkpoint_files import (
    CheckpointError,
    chain_of,
    find_checkpoints,
    read_manifest,
)
from coordinator.checkpoint_io import restore_checkpoint, write_checkpoint
from coordinator.cli_ops import (
    EXIT_OK,
    OperatorError,
    Target,
    _explain_error,
    _listing_or_fail,
    _print_json,
    _table,
    human_bytes,
    target_from_args,
)
from coordinator.cluster_spec import ClusterConfigError
from coordinator.shard_files import read_small
from psserver.client import PSClient
from psserver.errors import PSError


# -- coordinator checkpoint save / restore / list ------------------------------------------
def _step_of(path: str) -> int:
    return int(os.path.basename(path).split("-", 1)[1])


def _held(target, not_done: str, nothing: str):
    """(the servers' listing, the variables' layout, the dynamic tables), or
    OperatorError: ``not_done`` ("No checkpoint written") after a listing
    that does not fit together, ``nothing`` ("nothing to save") when empty."""
    listing = _listing_or_fail(target)
    try:
        layout = L.layout_from_listing(listing)
        tables = _tables(target)
    except CheckpointError as exc:
        raise OperatorError(f"{exc}\n{not_done}. Check that {target.source} lists "
                            "every parameter server.") from None
    if not layout and not tables:
        raise OperatorError(f"{nothing}: the parameter servers hold no variables")
    return listing, layout, tables


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
    listing, layout, tables = _held(target, "No checkpoint written", "nothing to save")
    directory = os.path.abspath(args.directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise OperatorError(f"cannot create checkpoint directory {directory}: {exc}") from None
    existing = find_checkpoints(directory)
    if args.step is not None:
        step = args.step
    else:
        step = max((m.version for metas in listing.values() for m in metas), default=0)
        if existing:
            step = max(step, _step_of(existing[-1]) + 1)
    ps_index = {addr: i for i, addr in enumerate(target.ps)}
    with _Clients(target) as clients:
        try:
            final, nbytes = write_checkpoint(directory, step, layout, clients.get,
                                               ps_index=ps_index, extra=extra, replace=False,
                                               tables=tables)
        except CheckpointError as exc:
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
        print(f"coordinator: saved {len(layout)} variable(s) ({nshards} shard(s)) and "
              f"{len(tables)} dynamic table(s), {human_bytes(nbytes)}, from "
              f"{len(by_ps | {a for t in tables for a in t.addresses})} parameter server(s) "
              f"as step {step}", file=sys.stderr)
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
    found = find_checkpoints(directory)
    if not found:
        raise OperatorError(f"no checkpoint found in {directory}: no ckpt-NNNNNNNN/ directory "
                            "with a manifest.json (unfinished ckpt-*.tmp-* saves do not count)")
    return found[-1]


def _tables(target) -> list:
    """The dynamic tables on the servers; a replicated one's primaries asked for."""
    from coordinator import ps_pool
    tables = L.tables_from_listing(_table_listing(target), target.ps)
    ps_pool.servers().refresh([(t, k) for t in tables for k in range(len(t.backups))])
    return tables


def _table_listing(target: Target) -> dict[str, list]:
    """{address: TableInfo list} of every parameter server (dynamic tables)."""
    out = {}
    with _Clients(target) as clients:
        for address in target.ps:
            try:
                out[address] = clients.get(address).list_tables()
            except PSError as exc:
                raise OperatorError(_explain_error(target, "ps", address, exc,
                                                   answered=True)) from None
    return out


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
        manifest = read_manifest(path)
    except CheckpointError as exc:
        raise OperatorError(str(exc)) from None
    listing = _listing_or_fail(target)
    try:
        layout = L.layout_from_listing(listing)
        tables = _tables(target)
        plan = L.restore_plan(layout, manifest, path)
    except CheckpointError as exc:
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
            restore_checkpoint(path, layout, clients.get, tables=tables)
            names = {t.name for t in tables}   # (their rows as the servers hold them now)
            table_rows = sum(i.rows for a in target.ps for i in clients.get(a).list_tables()
                             if i.name in names)
        except CheckpointError as exc:
            raise OperatorError(str(exc)) from None
        except PSError as exc:
            raise OperatorError(
                _explain_error(target, f"ps {ps_index.get(exc.address, '?')}", exc.address,
                               exc, answered=True)
                + f"\nThe restore of {path} stopped part-way: shards written before the "
                "failure hold the checkpoint, the others their own state. Fix the cause and "
                "restore again.") from None
    nvars = len({v.name for v, _, _ in plan})
    chain = [os.path.basename(p) for p, _ in chain_of(path)]
    if args.json:
        _print_json({"path": path, "step": manifest.get("step"), "extra": manifest.get("extra", {}),
                     "variables": nvars, "shards": len(plan), "tables": len(tables),
                     "table_rows": table_rows, "chain": chain})
    else:
        print(f"restored {path} (step {manifest.get('step')}"
              + (f"; base {chain[0]} + {len(chain) - 1} delta(s)" if len(chain) > 1 else "")
              + f"): {nvars} variable(s), {len(plan)} shard(s) and {len(tables)} dynamic "
              f"table(s) ({table_rows:,} rows) on {len(target.ps)} parameter server(s)")
    return EXIT_OK


def _ckpt_list(args) -> int:
    directory = os.path.abspath(args.directory)
    if not os.path.isdir(directory):   # (a mistyped path; an empty directory lists nothing)
        raise OperatorError(f"no checkpoint found: {directory} does not exist or is not a "
                            "directory")
    out = []
    for path in find_checkpoints(directory):
        try:
            m = json.loads(read_small(os.path.join(path, "manifest.json")))
            shards = [s for v in m["variables"].values() for s in v["shards"]]
            tables = [s for t in m.get("tables", {}).values() for s in t["shards"]]
            link = m.get("chain")
            out.append({"path": path, "step": m.get("step"), "time": m.get("time"),
                        "variables": len(m["variables"]), "shards": len(shards),
                        "tables": len(m.get("tables", {})), "table_shards": len(tables),
                        "table_rows": sum(int(s.get("rows", 0)) for s in tables),
                        "bytes": sum(s.get("bytes", 0) for s in shards + tables),
                        "kind": "delta" if link else "full",
                        "parent": link["parent"] if link else None,
                        "base": link["base"] if link else None,
                        "weights_only": bool(m.get("weights_only")),
                        "extra": m.get("extra", {})})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            out.append({"path": path, "error": f"unreadable manifest: {exc}"})
    if args.json:
        _print_json({"directory": directory, "checkpoints": out})
        return EXIT_OK
    if not out:
        print(f"no checkpoint in {directory}", file=sys.stderr)
        return EXIT_OK
    def kind(c):
        if "kind" not in c:
            return "?"
        what = ("export " if c["weights_only"] else "") + c["kind"]
        return what if c["kind"] == "full" else f"{what} of {c['parent']} (base {c['base']})"
    print(_table(["STEP", "SAVED", "KIND", "VARIABLES", "SHARDS", "TABLES", "TABLE ROWS", "BYTES",
                  "PATH"], [
        [c.get("step", "?"), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["time"]))
         if c.get("time") else "?", kind(c), c.get("variables", "?"), c.get("shards", "?"),
         c.get("tables", "?"), f"{c['table_rows']:,}" if "table_rows" in c else "?",
         human_bytes(c["bytes"]) if "bytes" in c else c.get("error"), c["path"]]
        for c in out], right={0, 3, 4, 5, 6, 7}))
    return EXIT_OK


# -- coordinator export -------------------------------------------------------------------
def _export(args) -> int:
    """Weights-only exports of the running servers' variables and tables
    (coordinator.serving.Exporter): one, or one every --every seconds."""
    from coordinator.serving import Exporter
    for flag, value, low in (("--every", args.every, 0.0), ("--count", args.count, 1),
                             ("--full-every", args.full_every, 1),
                             ("--max-to-keep", args.max_to_keep, 1)):
        if value is not None and not (value > low if flag == "--every" else value >= low):
            raise ClusterConfigError(f"{flag} must be {'>' if flag == '--every' else '>='} "
                                     f"{low}, got {value}")
    target = target_from_args(args)
    _, layout, tables = _held(target, "Nothing exported", "nothing to export")
    directory = os.path.abspath(args.directory)
    ps_index = {addr: i for i, addr in enumerate(target.ps)}
    model = types.SimpleNamespace(variables=layout, tables=tables, parameter_servers=target.ps)
    done = 0
    with _Clients(target) as clients:
        try:
            exporter = Exporter(model, directory, full_every=args.full_every,
                                max_to_keep=args.max_to_keep, client_for=clients.get)
        except OSError as exc:
            raise OperatorError(f"cannot create export directory {directory}: {exc}") from None
        try:
            while True:
                started = time.monotonic()
                try:
                    path = exporter.export()
                except CheckpointError as exc:
                    raise OperatorError(f"{exc}\nNothing exported.") from None
                except PSError as exc:
                    raise OperatorError(
                        _explain_error(target, f"ps {ps_index.get(exc.address, '?')}",
                                       exc.address, exc, answered=True)
                        + "\nThe parameter servers write the files themselves: DIR must be "
                        "on storage they see at the same path, under their --checkpoint-dir."
                        "\nNothing exported.") from None
                except OSError as exc:
                    raise OperatorError(f"cannot write under {directory}: {exc}") from None
                done += 1
                manifest = read_manifest(path)
                nbytes = sum(e.get("bytes", 0) for section in ("variables", "tables")
                             for info in manifest.get(section, {}).values()
                             for e in info["shards"])
                kind = "delta" if "chain" in manifest else "base"
                if args.json:
                    print(json.dumps({"path": path, "kind": kind, "bytes": nbytes}), flush=True)
                else:
                    print(f"{path}\t{kind}\t{human_bytes(nbytes)}", flush=True)
                if args.every is None or (args.count is not None and done >= args.count):
                    return EXIT_OK
                time.sleep(max(0.0, args.every - (time.monotonic() - started)))
        except KeyboardInterrupt:
            print(f"coordinator: stopped after {done} export(s)", file=sys.stderr)
            return 130
