"""Freshness of the serving copy: from an update's acknowledgement to its
being served by a Snapshot that follows the exports.

    python -m bench.bench_serving [--quick] [--periods 1,2] [--json out.json]

A LocalCluster (2 parameter servers) holds a dynamic table (100,000 keys of
dim 32, Adagrad), a fixed table (20,000 x 32, Adagrad) and a one-value
variable ``clock``. While a load thread trains (look-ups and row gradients
of 1,000 table keys and row-wise pushes to 200 fixed-table rows, about 20
times a second), a marker thread assigns ``clock`` := k every 0.2-0.4 s
(random) and notes when the assignment was acknowledged. An ``Exporter``
writes an export every P seconds. A ``Snapshot(follow=True,
poll_seconds=0.1)`` runs in a child process of its own (it reads files
only); each time it applies an export it prints the time and the ``clock``
it serves. Freshness of marker k: the first time the child serves a clock
>= k minus k's acknowledgement (CLOCK_MONOTONIC, shared by the processes of
one machine). Expected: at most P (the wait for the next export) + the
export's duration + the poll interval + the time to read the delta.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

CHILD = """
import json, sys, time
from coordinator.serving import Snapshot
snap = Snapshot(sys.argv[1], follow=True, poll_seconds=float(sys.argv[2]))
g = -1
while True:
    g = snap.wait(g, 1.0)
    print(json.dumps([time.monotonic(), float(snap.read("clock")[0])]), flush=True)
"""


def run_period(period: float, seconds: float, workdir: str, poll: float) -> dict:
    from coordinator import LocalCluster, ParameterServerStrategy, push_gradients
    from coordinator.serving import Exporter
    from coordinator.step_calls import IndexedSlices

    export_dir = os.path.join(workdir, f"export-{period}")
    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 40, 100_000, replace=False).astype(np.int64)
    with LocalCluster(num_ps=2, num_workers=0, checkpoint_dirs=(workdir,)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        table = strategy.create_embedding_table("emb", 32, initializer="random_normal",
                                                optimizer="adagrad")
        fixed = strategy.create_variable("fixed", (20_000, 32), "float32",
                                         initializer="random_normal", optimizer="adagrad")
        clock = strategy.create_variable("clock", initial_value=np.zeros(1, np.float32))
        table.lookup(keys)
        exporter = Exporter(strategy, export_dir, every_seconds=period, full_every=50)
        durations = []
        real_export = exporter.export

        def timed_export(*a, **k):
            t0 = time.monotonic()
            try:
                return real_export(*a, **k)
            finally:
                durations.append(time.monotonic() - t0)
        exporter.export = timed_export
        exporter.export()
        child = subprocess.Popen([sys.executable, "-c", CHILD, export_dir, str(poll)],
                                 stdout=subprocess.PIPE, text=True)
        served: list[tuple[float, float]] = []
        reader = threading.Thread(target=lambda: served.extend(
            tuple(json.loads(line)) for line in child.stdout), daemon=True)
        reader.start()
        stop = threading.Event()
        acked: dict[int, float] = {}

        def load():
            r = np.random.default_rng(1)
            while not stop.is_set():
                k = np.sort(r.choice(keys, 1_000, replace=False))
                table.lookup(k)
                table.push_gradient(k, r.normal(size=(k.size, 32)).astype(np.float32))
                ids = np.sort(r.choice(20_000, 200, replace=False))
                push_gradients([(fixed, IndexedSlices(
                    r.normal(size=(ids.size, 32)).astype(np.float32), ids))])
                stop.wait(0.05)

        def markers():
            r = np.random.default_rng(2)
            k = 0
            while not stop.wait(r.uniform(0.2, 0.4)):
                k += 1
                clock.assign(np.full(1, k, np.float32))
                acked[k] = time.monotonic()
        threads = [threading.Thread(target=f, daemon=True) for f in (load, markers)]
        exporter.start()
        for t in threads:
            t.start()
        time.sleep(seconds)   # (the measurement's duration, not a synchronisation)
        stop.set()
        for t in threads:
            t.join()
        exporter.stop()       # a last export: every marker is served
        last = max(acked)
        deadline = time.monotonic() + 30
        while (not served or served[-1][1] < last) and time.monotonic() < deadline:
            time.sleep(0.05)
        child.kill()
        child.wait()
        reader.join()
        errors = exporter.errors
    shutil.rmtree(export_dir, ignore_errors=True)
    latencies = []
    for k, t_ack in sorted(acked.items()):
        seen = [t for t, value in served if value >= k]
        if seen:
            latencies.append(min(seen) - t_ack)
    lat = np.array(latencies)
    return {"period_s": period, "poll_s": poll, "markers": len(acked),
            "served": int(lat.size), "export_errors": errors,
            "median_s": float(np.median(lat)), "p90_s": float(np.percentile(lat, 90)),
            "max_s": float(lat.max()), "within_p_plus_1s": float((lat <= period + 1).mean()),
            "export_median_s": float(np.median(durations)),
            "export_max_s": float(np.max(durations)), "latencies_s": latencies}


def main(argv=None) -> int:
    from bench.common import fmt_seconds, machine_info, print_table, write_json
    p = argparse.ArgumentParser(prog="python -m bench.bench_serving",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one period (1 s), 8 s")
    p.add_argument("--periods", default="1,2", help="export periods in seconds (default 1,2)")
    p.add_argument("--seconds", type=float, help="training time per period (default 30; "
                                                 "quick: 8)")
    p.add_argument("--poll", type=float, default=0.1, help="the Snapshot's poll interval")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    periods = [1.0] if args.quick else [float(x) for x in args.periods.split(",")]
    seconds = args.seconds or (8.0 if args.quick else 30.0)
    workdir = tempfile.mkdtemp(prefix="pstrain-bench-serving-")
    try:
        results = [run_period(pd, seconds, workdir, args.poll) for pd in periods]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(["export period P", "markers served", "median", "p90", "max",
                 "within P + 1 s", "export duration (median / max)"],
                [[f"{r['period_s']:g} s", f"{r['served']}/{r['markers']}",
                  fmt_seconds(r["median_s"]), fmt_seconds(r["p90_s"]), fmt_seconds(r["max_s"]),
                  f"{r['within_p_plus_1s']:.0%}",
                  f"{fmt_seconds(r['export_median_s'])} / {fmt_seconds(r['export_max_s'])}"]
                 for r in results],
                title=f"## serving freshness: update acknowledged -> served by a following "
                      f"Snapshot (child process, poll {args.poll:g} s), while training")
    if args.json:
        write_json(args.json, {"benchmark": "bench_serving", "machine": machine_info(),
                               "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
