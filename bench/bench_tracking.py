"""What change tracking (incremental checkpoints, psserver/core/tracking.py)
costs on the push path.

    python -m bench.bench_tracking [--quick] [--json out.json] [--before PATH]

1. **In process** (a VariableStore and a DynamicTable, no network: the
   smallest thing the tracking could slow down). A sparse push of the CTR
   workload's size (2,539 distinct rows of a 200,000 x 16 float32 Adagrad
   variable), and a dynamic table's update and look-up of as many keys in a
   200,000-row shard, each timed with tracking off (no save point yet) and
   on (after an incremental save), and, for the variable, with the two
   other ways of noting rows that were considered: a Python set of row ids
   and a list of the pushes' id arrays. Variants alternate call by call
   (bench.common.time_interleaved); p50 of the per-call times.
2. **Through a parameter server** (LocalCluster, 1 ps, the route it
   plans): the same sparse push from this process to three like
   variables, two never saved incrementally (no tracker; their difference
   is the measurement's noise) and one saved once at the start (tracked),
   one call of each per round, in rotating order.
3. **Before / after** (``--before PATH``: a checkout of the code before
   tracking, e.g. ``git archive 8484d06 | tar -x -C PATH``): part 1's
   sparse push with tracking off, run alternately in child processes on
   that tree and on this one (3 each): what the one added check costs when
   no incremental save was ever made.

Ratios are against the "off" variant of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROWS, DIM, IDS = 200_000, 16, 2_539


def _ids(rng) -> np.ndarray:
    return np.sort(rng.choice(ROWS, IDS, replace=False)).astype(np.int64)


def in_process(reps: int) -> dict:
    from bench.common import time_interleaved
    from psserver.contract.optimizers import make_optimizer
    from psserver.core.dynamic_table import DynamicTable
    from psserver.core.store import VariableStore
    from psserver.core.table_config import TableConfig

    rng = np.random.default_rng(0)
    grads = rng.normal(size=(IDS, DIM)).astype(np.float32)
    ids = [_ids(rng) for _ in range(16)]
    tmp = tempfile.mkdtemp(prefix="pstrain-bench-tracking-")
    stores = {}
    for variant in ("off", "mask", "set", "list"):
        s = VariableStore()
        s.create("emb", "float32", (ROWS, DIM), optimizer="adagrad")
        if variant != "off":
            # a tracker: a bool per row
            s.saver.save(tmp, (), s.saver.begin_save(1, 0, "", "bench"))
            var = s.registry.variable("emb")
            if variant == "set":
                var.tracker = _SetTracker()
            elif variant == "list":
                var.tracker = _ListTracker()
        stores[variant] = s
    counter = iter(range(1 << 30))

    def push(store):
        return lambda: store.push(sparse=[("emb", ids[next(counter) % 16], grads, 0)])[0]
    push_stats = time_interleaved({k: push(s) for k, s in stores.items()}, reps)

    tables = {}
    keys = [np.sort(rng.choice(10 * ROWS, IDS, replace=False)) for _ in range(16)]
    for variant in ("off", "on"):
        t = DynamicTable(TableConfig(dim=DIM), make_optimizer("adagrad", {}),
                         initial_rows_hint=ROWS)
        t.lookup(rng.choice(10 * ROWS, ROWS, replace=False))
        for k in keys:
            t.lookup(k)
        if variant == "on":
            t.take_changes(1, "bench", 0)
        tables[variant] = t
    c2 = iter(range(1 << 30))

    def update(t):
        return lambda: t.apply_gradients(keys[next(c2) % 16], grads)

    def lookup(t):
        return lambda: t.lookup(keys[next(c2) % 16])
    update_stats = time_interleaved({k: update(t) for k, t in tables.items()}, reps)
    lookup_stats = time_interleaved({k: lookup(t) for k, t in tables.items()}, reps)
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    return {"sparse_push": {k: v.p50 for k, v in push_stats.items()},
            "table_update": {k: v.p50 for k, v in update_stats.items()},
            "table_lookup": {k: v.p50 for k, v in lookup_stats.items()}}


class _SetTracker:
    """The alternative: row ids in a Python set."""
    def __init__(self):
        self.rows: set = set()

    def mark_rows(self, ids):
        self.rows.update(ids.tolist())

    def mark_all(self):
        pass


class _ListTracker:
    """The alternative: the pushes' id arrays in a list (unbounded)."""
    def __init__(self):
        self.parts: list = []

    def mark_rows(self, ids):
        self.parts.append(ids)

    def mark_all(self):
        pass


def through_server(reps: int) -> dict:
    """Sparse pushes to three like variables on one server: two never
    saved incrementally ("off", and "off_again": the noise between two
    identical variants), one tracked ("on": an incremental save taken once
    at the start); one call of each per round, the order rotating."""
    from coordinator import LocalCluster, ParameterServerStrategy
    from psserver.client import PSClient

    rng = np.random.default_rng(1)
    grads = rng.normal(size=(IDS, DIM)).astype(np.float32)
    ids = [_ids(rng) for _ in range(16)]
    tmp = tempfile.mkdtemp(prefix="pstrain-bench-tracking-")
    names = ("off", "off_again", "on")
    samples = {n: [] for n in names}
    with LocalCluster(num_ps=1, num_workers=0, checkpoint_dirs=(tmp,)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        with PSClient(cluster.spec.ps[0], token=cluster.token, tls=strategy.tls) as c:
            for name in names:
                c.create_variable(name, (ROWS, DIM), "float32", optimizer="adagrad")
            c.save_incremental(tmp, ["on"], save_id=1, stream="bench")
            for r in range(reps + 20):
                for name in names[r % 3:] + names[:r % 3]:
                    t0 = time.perf_counter()
                    c.push_sparse(name, ids[r % 16], grads)
                    if r >= 20:   # (warm-up rounds)
                        samples[name].append(time.perf_counter() - t0)
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    return {k: float(np.median(v)) for k, v in samples.items()}


#: Part 3's child: a sparse push's p50 (tracking off) with the psserver of
#: the tree it runs in (PYTHONPATH), printed as JSON.
_CHILD = """
import json, sys, time
import numpy as np
from psserver.core.store import VariableStore
ROWS, DIM, IDS, reps = 200_000, 16, 2_539, int(sys.argv[1])
rng = np.random.default_rng(0)
grads = rng.normal(size=(IDS, DIM)).astype(np.float32)
ids = [np.sort(rng.choice(ROWS, IDS, replace=False)).astype(np.int64) for _ in range(16)]
s = VariableStore()
s.create("emb", "float32", (ROWS, DIM), optimizer="adagrad")
# a tree before the store's one push entry has push_sparse
push_sparse = getattr(s, "push_sparse", None) or (lambda *a: s.push(sparse=[(*a, 0)]))
for i in range(20):
    push_sparse("emb", ids[i % 16], grads)
samples = []
for i in range(reps):
    t0 = time.perf_counter()
    push_sparse("emb", ids[i % 16], grads)
    samples.append(time.perf_counter() - t0)
print(json.dumps(float(np.median(samples))))
"""


def before_after(before: str, runs: int, reps: int) -> dict:
    """Part 1's sparse push, tracking off, in child processes on two trees."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {"before": [], "after": []}
    for _ in range(runs):
        for which, tree in (("before", before), ("after", here)):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            r = subprocess.run([sys.executable, "-c", _CHILD, str(reps)], env=env,
                               capture_output=True, text=True, check=True, cwd=tree)
            out[which].append(json.loads(r.stdout.strip().splitlines()[-1]))
    return {k: float(np.median(v)) for k, v in out.items()} | {"runs": out}


def main(argv=None) -> int:
    from bench.common import fmt_seconds, machine_info, print_table, write_json
    p = argparse.ArgumentParser(prog="python -m bench.bench_tracking",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--before", metavar="PATH", help="a checkout of the code before tracking")
    args = p.parse_args(argv)
    reps = 300 if args.quick else 1500
    result = {"in_process": in_process(reps)}
    rows = []
    for op, stats in result["in_process"].items():
        for variant, t in stats.items():
            rows.append([op, variant, fmt_seconds(t), f"{t / stats['off']:.3f}"])
    print_table(["operation", "tracking", "p50", "x off"], rows,
                title=f"## in process: {IDS} rows of a {ROWS} x {DIM} float32 Adagrad "
                      "variable / table shard")
    result["server"] = through_server(reps)
    s = result["server"]
    print_table(["tracking", "p50 push_sparse", "x off"],
                [[k, fmt_seconds(v), f"{v / s['off']:.3f}"] for k, v in s.items()],
                title="## through a parameter server (LocalCluster, 1 ps), calls alternating "
                      "in rotating order")
    if args.before:
        result["before_after"] = ba = before_after(args.before, 3, reps)
        print_table(["tree", "p50 push_sparse (no tracker)", "x before"],
                    [[k, fmt_seconds(ba[k]), f"{ba[k] / ba['before']:.3f}"]
                     for k in ("before", "after")],
                    title="## before / after, in process, child processes alternating")
    if args.json:
        write_json(args.json, {"benchmark": "bench_tracking", "machine": machine_info(),
                               **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
