"""Benchmark of one parameter-server process against references measured in the same run.

    python -m bench.bench_ps [--quick] [--json out.json] [--no-sweep]

Every server is a child process on 127.0.0.1 and every client lives in this
process, as a worker's would:

* references: a raw loopback TCP server (``bench.common.TCPReference``) and a
  bare gRPC bytes server with the parameter server's message-size options
  (``bench.common.GrpcReference``);
* ours: a real ``psserver`` process with default settings, reached with
  ``PSClient``: read and push (SGD) of dense float32 variables of 1 KiB,
  1 MiB and 64 MiB, and a gather of 2,560 uniformly random rows of 64
  float32 from a 1,000,000-row table;
* sweeps that inform the defaults: the 64 MiB read and push by stream frame
  size (``--chunk-bytes``) and unary, and 1 / 4 / 16 MiB by unary vs streamed
  (the client's ``stream_threshold_bytes``). Each setting has its own
  psserver; client and server are configured alike.

Each group of workloads is timed round-robin (``time_interleaved``: one call
of each variant per round, after warm-up calls), so the noise of a shared
machine hits ours and the references alike. Throughput is reported at the
best time (the JSON also has it at the median), latency at p50 / p99. MB/s
and GB/s are decimal; sizes (KiB, MiB) binary.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from typing import Callable

import numpy as np

from bench.common import (
    GrpcReference,
    KiB,
    MiB,
    PSConfig,
    Stats,
    TCPReference,
    fmt_bytes,
    fmt_count_rate,
    fmt_rate,
    fmt_seconds,
    machine_info,
    print_table,
    running_psserver,
    running_psservers,
    time_interleaved,
    transfer_record,
    write_json,
)
from psserver.contract import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    MESSAGE_OVERHEAD,
)

DENSE_SIZES = {"1 KiB": 1 * KiB, "1 MiB": 1 * MiB, "64 MiB": 64 * MiB}
GATHER_TABLE_ROWS = 1_000_000
GATHER_DIM = 64
GATHER_IDS = 2_560
GATHER_BYTES = GATHER_IDS * GATHER_DIM * 4
BIG = 64 * MiB

#: Targets checked: summary key -> (comparison, bound) on the ratio ours / reference.
TARGETS = {"read_64MiB_vs_tcp": (">=", 0.70), "read_1KiB_p50_vs_grpc": ("<=", 1.3)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Rounds per workload group (each after warm-up calls)."""
    small: int     # 1 KiB calls (enough for a p99)
    medium: int    # 1 MiB calls
    large: int     # 64 MiB transfers
    gather: int
    sweep: int                          # rounds of the 64 MiB frame-size sweep
    frame_sizes: tuple[int, ...]        # its stream frame sizes (plus unary)
    threshold_rounds: int               # rounds of the unary-vs-stream sweep
    threshold_sizes: tuple[int, ...]    # its tensor sizes
    threshold_frames: tuple[int, ...]   # its streamed settings (frame = max_message)


FULL = Plan(small=3000, medium=200, large=20, gather=500,
            sweep=12, frame_sizes=(256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB),
            threshold_rounds=30, threshold_sizes=(1 * MiB, 4 * MiB, 16 * MiB),
            threshold_frames=(256 * KiB, 1 * MiB))
QUICK = Plan(small=400, medium=40, large=5, gather=80,
             sweep=3, frame_sizes=(1 * MiB, 4 * MiB, 16 * MiB),
             threshold_rounds=6, threshold_sizes=(1 * MiB, 16 * MiB), threshold_frames=(1 * MiB,))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def create_dense(client, nbytes: int, name: str) -> np.ndarray:
    """A float32 SGD variable of nbytes (zeros); returns a gradient for it."""
    n = nbytes // 4
    client.create_variable(name, (n,), "float32", initializer="zeros", optimizer="sgd")
    return np.full(n, 1e-3, np.float32)


# -- ours against the references -------------------------------------------------------
def measure_main(plan: Plan) -> dict[str, dict[str, Stats]]:
    """{group: {variant: Stats}}: the default psserver and the references, per size."""
    from psserver.client import PSClient
    res: dict[str, dict[str, Stats]] = {}
    with TCPReference() as tcp, GrpcReference() as ref, running_psserver() as (task, ps), \
            PSClient(task.address, shared_memory=False, timeout=300) as across, \
            PSClient(task.address, shared_memory=False, data_port=False, timeout=300) as remote:
        names = {label: f"dense_{n}" for label, n in DENSE_SIZES.items()}
        grads = {label: create_dense(ps, DENSE_SIZES[label], name) for label, name in names.items()}

        def ours(label: str) -> dict[str, Callable[[], object]]:
            """Our client on this host (shared memory, local socket), one as on
            another host (the data port), and one that keeps to gRPC."""
            name, g = names[label], grads[label]
            return {"ours_read": lambda: ps.read(name), "ours_push": lambda: ps.push(name, g),
                    "data_path_read": lambda: across.read(name),
                    "data_path_push": lambda: across.push(name, g),
                    "grpc_path_read": lambda: remote.read(name),
                    "grpc_path_push": lambda: remote.push(name, g)}

        log(f"1 KiB latency: {plan.small} rounds")
        p1k = bytes(KiB)
        res["1 KiB"] = time_interleaved({
            **ours("1 KiB"),
            "grpc_echo": lambda: ref.echo(p1k),
            "grpc_fetch": lambda: ref.fetch(KiB),
            "tcp_echo": lambda: tcp.echo(KiB),
        }, plan.small, warmup=50)

        log(f"1 MiB: {plan.medium} rounds")
        p1m = bytes(MiB)
        res["1 MiB"] = time_interleaved({
            **ours("1 MiB"),
            "grpc_fetch_unary": lambda: ref.fetch(MiB),
            "grpc_fetch_stream": lambda: ref.fetch_stream(MiB),
            "grpc_echo": lambda: ref.echo(p1m),
            "grpc_sink_unary": lambda: ref.sink(p1m),
            "tcp_download": lambda: tcp.download(MiB),
            "tcp_upload": lambda: tcp.upload(MiB),
        }, plan.medium, warmup=5)

        log(f"64 MiB: {plan.large} rounds")
        p64 = bytes(BIG)
        res["64 MiB"] = time_interleaved({
            **ours("64 MiB"),
            "tcp_download": lambda: tcp.download(BIG),
            "tcp_upload": lambda: tcp.upload(BIG),
            "grpc_fetch_unary": lambda: ref.fetch(BIG),
            "grpc_fetch_stream": lambda: ref.fetch_stream(BIG),
            "grpc_sink_unary": lambda: ref.sink(p64),
            "grpc_upload_stream": lambda: ref.upload(p64),
        }, plan.large, warmup=2)

        log(f"gather: creating a {GATHER_TABLE_ROWS:,} x {GATHER_DIM} random_normal table")
        ps.create_variable("emb", (GATHER_TABLE_ROWS, GATHER_DIM), "float32",
                           initializer="random_normal")
        rng = np.random.default_rng(0)
        id_sets = [rng.integers(0, GATHER_TABLE_ROWS, GATHER_IDS, dtype=np.int64)
                   for _ in range(256)]
        ids = itertools.cycle(id_sets)
        log(f"gather: {plan.gather} rounds")
        res["gather"] = time_interleaved({
            "ours_gather": lambda: ps.gather("emb", next(ids)),
            "data_path_gather": lambda: across.gather("emb", next(ids)),
            "grpc_path_gather": lambda: remote.gather("emb", next(ids)),
            "grpc_fetch_unary": lambda: ref.fetch(GATHER_BYTES),
        }, plan.gather, warmup=10)
    return res


# -- sweeps --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setting:
    """A labelled psserver configuration (the client is configured alike)."""
    label: str
    config: PSConfig

    def streams(self, nbytes: int) -> bool:
        """Whether PSClient moves a tensor of nbytes in frames with this setting."""
        return nbytes > min(self.config.stream_threshold_bytes,
                            self.config.max_message_bytes - MESSAGE_OVERHEAD)


def frame_settings(plan: Plan) -> list[Setting]:
    out = [Setting(f"stream, {fmt_bytes(c)} frames", PSConfig(chunk_bytes=c, shared_memory=False,
                                                                data_port=False))
           for c in plan.frame_sizes]
    # Room for 64 MiB plus the message overhead: one unary call.
    out.append(Setting("unary (max_message 128 MiB)", PSConfig(
        max_message_bytes=128 * MiB, stream_threshold_bytes=128 * MiB, shared_memory=False,
        data_port=False)))
    return out


def threshold_settings(plan: Plan) -> list[Setting]:
    """Unary (up to the 64 MiB message limit) against streaming everything."""
    return [Setting("unary (stream threshold 64 MiB)",
                    PSConfig(stream_threshold_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                             shared_memory=False, data_port=False))] + [
        Setting(f"stream, {fmt_bytes(c)} frames (stream threshold 0)",
                PSConfig(chunk_bytes=c, stream_threshold_bytes=0, shared_memory=False,
                         data_port=False))
        for c in plan.threshold_frames]


def run_sweep(settings: list[Setting], sizes: tuple[int, ...],
              rounds: int) -> dict[tuple[int, str], dict[str, Stats]]:
    """{(size, label): {"read", "push", "grpc_read", "grpc_push": Stats}}.

    All servers run at once and all calls are interleaved, so the settings
    are compared under the same conditions. "grpc_*" is the bare gRPC
    reference moving the same bytes with the same framing (unary or frames
    of the setting's chunk size).
    """
    fns: dict[str, Callable[[], object]] = {}
    where: dict[str, tuple[tuple[int, str], str]] = {}

    def add(size: int, label: str, what: str, fn: Callable[[], object]) -> None:
        key = f"{size}|{label}|{what}"
        fns[key], where[key] = fn, ((size, label), what)

    with GrpcReference(max_message_bytes=128 * MiB) as ref, \
            running_psservers([s.config for s in settings]) as servers:
        payloads = {size: bytes(size) for size in sizes}
        for s, (_, ps) in zip(settings, servers):
            chunk = s.config.chunk_bytes
            for size in sizes:
                name, p = f"v{size}", payloads[size]
                g = create_dense(ps, size, name)
                add(size, s.label, "read", lambda ps=ps, name=name: ps.read(name))
                add(size, s.label, "push", lambda ps=ps, name=name, g=g: ps.push(name, g))
                if s.streams(size):
                    add(size, s.label, "grpc_read", lambda n=size, c=chunk: ref.fetch_stream(n, c))
                    add(size, s.label, "grpc_push", lambda p=p, c=chunk: ref.upload(p, c))
                else:
                    add(size, s.label, "grpc_read", lambda n=size: ref.fetch(n))
                    add(size, s.label, "grpc_push", lambda p=p: ref.sink(p))
        stats = time_interleaved(fns, rounds, warmup=1)
    out: dict[tuple[int, str], dict[str, Stats]] = {}
    for key, st in stats.items():
        (size, label), what = where[key]
        out.setdefault((size, label), {})[what] = st
    return out


def measure_sweeps(plan: Plan) -> dict[str, dict]:
    log(f"sweep: 64 MiB by frame size, {plan.sweep} rounds")
    frames = run_sweep(frame_settings(plan), (BIG,), plan.sweep)
    log(f"sweep: unary vs streamed at {', '.join(map(fmt_bytes, plan.threshold_sizes))}, "
        f"{plan.threshold_rounds} rounds")
    threshold = run_sweep(threshold_settings(plan), plan.threshold_sizes, plan.threshold_rounds)
    return {"frames": frames, "threshold": threshold}


# -- report ---------------------------------------------------------------------------------
def _row(key: str, workload: str, ours: float, ref_name: str, ref: float, unit: str) -> dict:
    """A comparison row; ratio = ours / reference (rates: higher is better; times: lower)."""
    ratio = ours / ref
    target = TARGETS.get(key)
    met = None
    if target:
        op, bound = target
        met = ratio >= bound if op == ">=" else ratio <= bound
    return {"key": key, "workload": workload, "ours": ours, "reference_name": ref_name,
            "reference": ref, "unit": unit, "ratio": ratio,
            "target": f"{target[0]} {target[1]}" if target else None, "met": met}


def comparisons(main: dict[str, dict[str, Stats]]) -> tuple[list[dict], list[dict]]:
    """(required rows, informational rows) of the comparison table."""
    k1, m1, m64, g = main["1 KiB"], main["1 MiB"], main["64 MiB"], main["gather"]

    def bps(st: Stats, n: int) -> float:
        return st.rate(n)

    def best_of(*variants: tuple[str, str]) -> tuple[str, Stats]:
        return max(((how, m64[v]) for how, v in variants), key=lambda hv: bps(hv[1], BIG))

    read_ref = best_of(("unary", "grpc_fetch_unary"), ("stream", "grpc_fetch_stream"))
    push_ref = best_of(("unary", "grpc_sink_unary"), ("stream", "grpc_upload_stream"))
    required = [
        _row("read_64MiB_vs_tcp", "64 MiB read, MB/s (best)", bps(m64["ours_read"], BIG),
             "raw TCP 64 MiB download", bps(m64["tcp_download"], BIG), "B/s"),
        _row("push_64MiB_vs_tcp", "64 MiB push SGD, MB/s (best)", bps(m64["ours_push"], BIG),
             "raw TCP 64 MiB upload", bps(m64["tcp_upload"], BIG), "B/s"),
        _row("read_1MiB_vs_grpc", "1 MiB read, MB/s (best)", bps(m1["ours_read"], MiB),
             "bare gRPC unary 1 MiB response", bps(m1["grpc_fetch_unary"], MiB), "B/s"),
        _row("read_1KiB_p50_vs_grpc", "1 KiB read, p50", k1["ours_read"].p50,
             "bare gRPC unary 1 KiB echo p50", k1["grpc_echo"].p50, "s"),
    ]
    info = [
        _row("read_64MiB_vs_grpc", "64 MiB read, MB/s (best)", bps(m64["ours_read"], BIG),
             f"bare gRPC 64 MiB response ({read_ref[0]}, the faster)", bps(read_ref[1], BIG), "B/s"),
        _row("push_64MiB_vs_grpc", "64 MiB push SGD, MB/s (best)", bps(m64["ours_push"], BIG),
             f"bare gRPC 64 MiB request ({push_ref[0]}, the faster)", bps(push_ref[1], BIG), "B/s"),
        _row("push_1MiB_vs_grpc", "1 MiB push SGD, MB/s (best)", bps(m1["ours_push"], MiB),
             "bare gRPC unary 1 MiB request", bps(m1["grpc_sink_unary"], MiB), "B/s"),
        _row("push_1KiB_p50_vs_grpc", "1 KiB push, p50", k1["ours_push"].p50,
             "bare gRPC unary 1 KiB echo p50", k1["grpc_echo"].p50, "s"),
        _row("read_1KiB_p99_vs_grpc", "1 KiB read, p99", k1["ours_read"].p99,
             "bare gRPC unary 1 KiB echo p99", k1["grpc_echo"].p99, "s"),
        _row("gather_p50_vs_grpc", f"gather {GATHER_IDS} x {GATHER_DIM}, p50",
             g["ours_gather"].p50, f"bare gRPC unary {fmt_bytes(GATHER_BYTES)} response p50",
             g["grpc_fetch_unary"].p50, "s"),
    ]
    # As from another host: over the data port (PSClient(shared_memory=False); tensors
    # above the 4 MiB stream threshold still take gRPC's streams there), and over gRPC
    # only (PSClient(shared_memory=False, data_port=False)).
    for key, label, sizes in (("data", "data port", ((m1, MiB, "1MiB"),)),
                              ("grpc", "over gRPC", ((m1, MiB, "1MiB"), (m64, BIG, "64MiB")))):
        for st, n, size in sizes:
            info += [
                _row(f"{key}_read_{size}_vs_tcp", f"{label}: {fmt_bytes(n)} read, MB/s (best)",
                     bps(st[f"{key}_path_read"], n), f"raw TCP {fmt_bytes(n)} download",
                     bps(st["tcp_download"], n), "B/s"),
                _row(f"{key}_push_{size}_vs_tcp", f"{label}: {fmt_bytes(n)} push SGD, MB/s (best)",
                     bps(st[f"{key}_path_push"], n), f"raw TCP {fmt_bytes(n)} upload",
                     bps(st["tcp_upload"], n), "B/s")]
        info += [
            _row(f"{key}_read_1KiB_p50_vs_grpc", f"{label}: 1 KiB read, p50",
                 k1[f"{key}_path_read"].p50, "bare gRPC unary 1 KiB echo p50",
                 k1["grpc_echo"].p50, "s"),
            _row(f"{key}_gather_p50_vs_grpc", f"{label}: gather {GATHER_IDS} x {GATHER_DIM}, p50",
                 g[f"{key}_path_gather"].p50,
                 f"bare gRPC unary {fmt_bytes(GATHER_BYTES)} response p50",
                 g["grpc_fetch_unary"].p50, "s")]
    return required, info


def _fmt_value(v: float, unit: str) -> str:
    return fmt_rate(v) if unit == "B/s" else fmt_seconds(v)


def print_comparisons(rows: list[dict], title: str) -> None:
    table = []
    for r in rows:
        verdict = "" if r["target"] is None else f"{r['target']}: {'met' if r['met'] else 'NOT met'}"
        table.append([r["workload"], _fmt_value(r["ours"], r["unit"]),
                      f"{r['reference_name']}: {_fmt_value(r['reference'], r['unit'])}",
                      f"{r['ratio']:.2f}", verdict])
    print_table(["workload", "ours", "reference", "ratio", "target"], table, title=title)


def report_main(main: dict[str, dict[str, Stats]]) -> dict:
    required, info = comparisons(main)
    print_comparisons(required, "## psserver vs references (same run; ratio = ours / reference)")
    print_comparisons(info, "## more comparisons (no target)")
    sizes = {**DENSE_SIZES, "gather": GATHER_BYTES}
    rows, data = [], {}
    for group, stats in main.items():
        n = sizes[group]
        for variant, st in stats.items():
            rec, note = transfer_record(n, st), ""
            if variant == "ours_gather":
                rec.update(rows=GATHER_IDS, rows_per_s_best=GATHER_IDS / st.best,
                           rows_per_s_p50=GATHER_IDS / st.p50)
                note = (f"{fmt_count_rate(GATHER_IDS / st.best)} best, "
                        f"{fmt_count_rate(GATHER_IDS / st.p50)} at p50")
            data.setdefault(group, {})[variant] = rec
            rows.append([group, variant, fmt_seconds(st.best), fmt_seconds(st.p50),
                         fmt_seconds(st.p99), fmt_rate(st.rate(n)), fmt_rate(st.rate(n, "p50")), note])
    print_table(["size", "variant", "best", "p50", "p99", "MB/s best", "MB/s p50", ""], rows,
                title="## all measurements (MB/s count the payload once; echo carries it both ways)")
    return {"main": data, "summary": required, "more": info}


def report_sweeps(sweeps: dict[str, dict]) -> dict:
    out: dict = {}
    for kind, title in (("frames", "## sweep: 64 MiB by stream frame size vs unary"),
                        ("threshold", "## sweep: unary vs streamed, by size")):
        res = sweeps[kind]
        rows, data = [], []
        for (size, label), st in sorted(res.items(), key=lambda kv: kv[0][0]):
            rows.append([fmt_bytes(size), label,
                         fmt_rate(st["read"].rate(size)), fmt_rate(st["read"].rate(size, "p50")),
                         fmt_rate(st["grpc_read"].rate(size)),
                         fmt_rate(st["push"].rate(size)), fmt_rate(st["push"].rate(size, "p50")),
                         fmt_rate(st["grpc_push"].rate(size))])
            data.append({"bytes": size, "setting": label,
                         **{what: transfer_record(size, s) for what, s in st.items()}})
        print_table(["size", "setting (client and server alike)", "read best", "read p50",
                     "bare gRPC, same framing", "push best", "push p50", "bare gRPC, same framing"],
                    rows, title=title)
        fastest: dict[str, dict[str, str]] = {}
        for size in sorted({s for s, _ in res}):
            labels = [lb for s, lb in res if s == size]
            fastest[fmt_bytes(size)] = {
                what: max(labels, key=lambda lb: res[(size, lb)][what].rate(size, "p50"))
                for what in ("read", "push")}
            fastest[fmt_bytes(size)]["read+push"] = min(
                labels, key=lambda lb: res[(size, lb)]["read"].p50 + res[(size, lb)]["push"].p50)
        print()
        for size, f in fastest.items():
            print(f"fastest at {size} (p50): read: {f['read']}; push: {f['push']}; "
                  f"read+push: {f['read+push']}")
        out[f"sweep_{kind}"] = {"results": data, "fastest_p50": fastest}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_ps",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (well under a minute)")
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    p.add_argument("--no-sweep", action="store_true", help="skip the framing sweeps")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    main_res = measure_main(plan)
    sweeps = None if args.no_sweep else measure_sweeps(plan)
    out = report_main(main_res)
    if sweeps:
        out.update(report_sweeps(sweeps))
    elapsed = time.perf_counter() - t0
    print(f"\n({'quick' if args.quick else 'full'} plan, {elapsed:.0f} s)")
    if args.json:
        write_json(args.json, {
            "benchmark": "bench_ps", "machine": machine_info(), "plan": dataclasses.asdict(plan),
            "elapsed_s": elapsed, "defaults": {"max_message_bytes": DEFAULT_MAX_MESSAGE_BYTES,
                                               "chunk_bytes": DEFAULT_CHUNK_BYTES}, **out})
        print(f"wrote {args.json}")
    return 0   # targets are reported, not enforced: timings on a shared machine vary


if __name__ == "__main__":
    sys.exit(main())
