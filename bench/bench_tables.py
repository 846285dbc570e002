"""Dynamic embedding tables against fixed ones, measured in the same run.

    python -m bench.bench_tables [--quick] [--json out.json]

* look-ups: 4,096 existing keys from a 1,000,000-row dynamic table (dim 64,
  float32) against a gather of 4,096 rows from a fixed 1,000,000 x 64
  variable on the same psserver process, through PSClient, over the
  same-host path and over the data port (as from another host), timed
  round-robin (bench.common.time_interleaved);
* inserts: look-ups of 4,096 keys never seen (each admitted: a row made),
  keys per second, against the same look-up of existing keys;
* memory: one shard (psserver.core.dynamic_table.DynamicTable, in this process)
  of 10,000,000 rows of dim 16 under Adagrad: bytes of every array it holds
  per row against dim x 4 x (1 + slots), and this process's resident size
  growth per row (pages touched);
* evictions: a look-up of 256 new keys that evicts (by capacity, LRU and
  LFU; by age, steps and seconds; or that forgets keys of a full admission
  counter) on one shard in this process holding 10,000,000 rows or counted
  keys (1,000,000 with --quick) against the same on one holding 10,000
  (psserver/core/eviction.py: the cost must not grow with the shard).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench.common import (
    machine_info,
    print_table,
    running_psserver,
    time_interleaved,
    write_json,
)

ROWS, DIM, KEYS = 1_000_000, 64, 4096
KEY_OVERHEAD = 104   # per-key bytes beyond the row and its slots (psserver/core/dynamic_table.py)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def lookups(rounds: int) -> dict:
    from psserver.client import PSClient
    out: dict = {}
    with running_psserver() as (task, ps):
        ps.create_variable("fixed", (ROWS, DIM), "float32", initializer="random_normal")
        ps.create_table("dyn", DIM, initializer="random_normal")
        rng = np.random.default_rng(0)
        keys = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, ROWS,
                            dtype=np.int64)
        t0 = time.perf_counter()
        for part in np.array_split(keys, ROWS // 50_000):   # made by look-ups: admitted
            ps.lookup("dyn", part)
        fill_s = time.perf_counter() - t0
        assert ps.table_info("dyn").rows == ROWS
        fresh = iter(rng.integers(1, 1 << 60, (10_000, KEYS), dtype=np.int64) * 2 + 1)
        for route, kw in (("same host", {}), ("data port", {"shared_memory": False})):
            with PSClient(task.address, **kw) as c:   # 127.0.0.1: no token
                ids = [rng.integers(0, ROWS, KEYS) for _ in range(8)]
                it = iter(range(1 << 30))
                st = time_interleaved({
                    "fixed gather": lambda: c.gather("fixed", ids[next(it) % 8]),
                    "dynamic lookup": lambda: c.lookup("dyn", keys[ids[next(it) % 8]]),
                    "dynamic insert": lambda: c.lookup("dyn", next(fresh)),
                }, rounds, warmup=3)
            out[route] = {k: {"best_ms": s.best * 1e3, "p50_ms": s.p50 * 1e3} for k, s in st.items()}
            out[route]["ratio_best"] = st["fixed gather"].best / st["dynamic lookup"].best
            out[route]["ratio_p50"] = st["fixed gather"].p50 / st["dynamic lookup"].p50
            out[route]["insert_keys_per_s"] = KEYS / st["dynamic insert"].p50
        out["fill_keys_per_s"] = ROWS / fill_s
    return out


def memory(rows: int) -> dict:
    from psserver.contract.optimizers import make_optimizer
    from psserver.core.dynamic_table import DynamicTable
    from psserver.core.table_config import TableConfig
    dim = 16
    before = _rss()
    t = DynamicTable(TableConfig(dim=dim), make_optimizer("adagrad", {}), initial_rows_hint=1024)
    keys = np.random.default_rng(1).integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max,
                                             rows, dtype=np.int64)
    t0 = time.perf_counter()
    for part in np.array_split(keys, max(1, rows // 100_000)):
        t.lookup(part)
    seconds = time.perf_counter() - t0
    ideal = dim * 4 * 2   # the row and its one slot
    return {"rows": len(t), "dim": dim, "ideal_bytes_per_row": ideal,
            "held_bytes_per_row": t.nbytes / len(t),
            "rss_bytes_per_row": (_rss() - before) / len(t),
            "overhead_bytes_per_key": t.nbytes / len(t) - ideal * t.value.shape[0] / len(t),
            "inserts_per_s_in_process": rows / seconds}


EVICT_BATCH = 256
EVICT_MODES = {"capacity, LRU": dict(policy="lru"), "capacity, LFU": dict(policy="lfu"),
               "age, steps": dict(max_age_steps=1), "age, seconds": dict(max_age_seconds=60.0),
               "admission counter full (min_count 2)": dict(min_count=2)}


def evictions(sizes: tuple[int, int], rounds: int) -> dict:
    """Per mode and shard size: the median seconds of a look-up of
    EVICT_BATCH new keys that evicts (every timed one does: asserted)."""
    from psserver.contract.optimizers import make_optimizer
    from psserver.core.dynamic_table import DynamicTable
    from psserver.core.table_config import TableConfig
    out: dict = {}
    for mode, kw in EVICT_MODES.items():
        for size in sizes:
            now = [0.0]
            counter = "min_count" in kw   # the admission counter at its limit, not the rows
            t = DynamicTable(TableConfig(dim=16, capacity=size if "policy" in kw else 0,
                                         admission_capacity=size if counter else 0, **kw),
                             make_optimizer("sgd", {}), clock=lambda: now[0],
                             initial_rows_hint=1024 if counter else size)
            fresh = iter(range(1 << 62))

            def held():
                return t.pending.size if counter else len(t)

            def fill():
                while held() < size:
                    t.lookup(np.fromiter(fresh, np.int64, min(100_000, size - held())))
            fill()
            times = []
            for _ in range(rounds):
                if "policy" not in kw:   # every row past its age (a small shard: refilled)
                    if len(t) < size // 2:
                        fill()
                    now[0] += 120.0
                    t.apply_gradients(np.zeros(0, np.int64), np.zeros((0, 16), np.float32))
                keys = np.fromiter(fresh, np.int64, EVICT_BATCH)
                before = t.stats.evicted_age + t.stats.evicted_capacity
                assert not counter or t.pending.size == size   # 256 keys to forget
                t0 = time.perf_counter()
                t.lookup(keys)
                times.append(time.perf_counter() - t0)
                assert counter or t.stats.evicted_age + t.stats.evicted_capacity > before, mode
            out.setdefault(mode, {})[size] = float(np.median(times))
            t = None   # (its memory back before the next shard is made)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 1M rows for memory")
    ap.add_argument("--json", default=None, help="write every number here")
    args = ap.parse_args(argv)
    sizes = (10_000, 1_000_000 if args.quick else 10_000_000)
    res = {"machine": machine_info(), "lookups": lookups(10 if args.quick else 40),
           "memory": memory(1_000_000 if args.quick else 10_000_000),
           "evictions": evictions(sizes, 15 if args.quick else 40)}
    rows = []
    for route in ("same host", "data port"):
        r = res["lookups"][route]
        rows.append([f"4,096-key look-up, {route}", f"{r['dynamic lookup']['p50_ms']:.2f} ms",
                     f"fixed gather {r['fixed gather']['p50_ms']:.2f} ms",
                     f"{r['ratio_p50']:.2f} (best {r['ratio_best']:.2f})", ">= 0.5"])
        rows.append([f"4,096 new keys (inserts), {route}",
                     f"{r['insert_keys_per_s'] / 1e3:.0f} k keys/s",
                     f"look-up of existing {r['dynamic lookup']['p50_ms']:.2f} ms", "", ""])
    m = res["memory"]
    allowed = 1.5 * m["ideal_bytes_per_row"] + KEY_OVERHEAD
    rows.append([f"memory per row, {m['rows']:,} rows, dim {m['dim']}, adagrad",
                 f"{m['held_bytes_per_row']:.0f} B held, {m['rss_bytes_per_row']:.0f} B RSS",
                 f"row + slot {m['ideal_bytes_per_row']} B; allowed 1.5 x that + "
                 f"{KEY_OVERHEAD} B = {allowed:.0f} B",
                 f"{m['held_bytes_per_row'] / allowed:.2f} (RSS "
                 f"{m['rss_bytes_per_row'] / allowed:.2f})", "<= 1"])
    for mode, by in res["evictions"].items():
        small, large = by[sizes[0]], by[sizes[1]]
        rows.append([f"look-up of {EVICT_BATCH} new keys that evicts, {mode}, "
                     f"{sizes[1]:,} rows", f"{large * 1e3:.2f} ms",
                     f"the same at {sizes[0]:,} rows {small * 1e3:.2f} ms",
                     f"{large / small:.2f}", "<= 2"])
    print_table(["workload", "ours", "reference (same run)", "ratio", "target"], rows)
    print(f"fill of 1M keys by look-ups over RPC: {res['lookups']['fill_keys_per_s'] / 1e3:.0f} "
          f"k keys/s; in process: {m['inserts_per_s_in_process'] / 1e3:.0f} k keys/s")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
