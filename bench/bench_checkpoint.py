"""Checkpoint throughput against plain numpy, and recovery time after a parameter-server kill.

    python -m bench.bench_checkpoint [--quick] [--json out.json] [--dir PATH]

Two parts, both on real ``LocalCluster`` processes (mutual TLS, as by default):

1. **Save / restore throughput.** A model of 4 float32 variables (1 GiB in
   all; 256 MiB with ``--quick``), each split over the 2 parameter servers
   (``FixedShardsPartitioner(2)``), once with optimizer ``"sgd"`` (no slots)
   and once with ``"adam"`` (value + m + v: 3x the bytes; a scalar step
   count per shard too). Ours: ``CheckpointManager.save`` (each parameter
   server writes its shards as safetensors, the coordinator writes the
   manifest) and ``CheckpointManager.restore`` (the coordinator reads every
   shard file, reassembles each variable and sends it back to the servers
   with ``create_variable(..., overwrite=True)``). Reference: the same
   tensors (loaded from our first checkpoint, so the same shapes and bytes,
   one array per tensor) written with ``np.save`` and read with ``np.load``,
   one after another in this process, to the same disk. Bytes counted: the
   value and slot tensors (``nbytes``), the same for both sides.
   Repetitions alternate ours and the reference (ABBA: ours first in even
   rounds, the reference first in odd ones) after an untimed warm-up of
   each (for adam only the first save, which gives the reference its
   arrays: the sgd run warmed the code up). Rates are at the median time
   (the JSON also has the best and every sample). The page cache is not dropped: a restore may read what the save
   just wrote from memory, and a save may return before the data reaches
   the disk, on both sides alike. Neither side fsyncs its tensor files (ours
   fsyncs only the manifest and the directory).

2. **Recovery after a parameter-server kill.** ``LocalCluster(num_ps=2,
   num_workers=2)`` trains a small model (a 512x256 matrix and a 256 bias,
   Adam, both split over the 2 servers) in async mode through a
   ``ClusterCoordinator`` with a ``CheckpointManager``. Steps are scheduled
   continuously (4 in flight). A checkpoint is saved, training runs 1 s,
   then ``cluster.kill_ps(1)`` (SIGKILL; the LocalCluster supervisor starts
   a fresh, empty server on the same port, and the coordinator restores its
   shards from the checkpoint). Times from the kill (``time.monotonic()``)
   to: the coordinator pausing (recovery began: a step or the
   coordinator's own check noticed the server), the new server listening (``cluster.restarts`` went up), the
   restore's start and its duration (``CheckpointManager.restore`` timed by
   a subclass), the recovery done (``coord.cluster.recovery.recoveries`` went up),
   the first step completing after that (a re-run of a step the kill
   interrupted), and the first step *scheduled after the kill* completing.
   Step completions are the worker's ``time.time()`` at the end of the step
   (same machine); the other milestones are polled every millisecond.
   Repeated 3 times on the same cluster (a new checkpoint before each kill;
   1 with ``--quick``); the median is reported. If training has not resumed
   ``--recovery-timeout`` seconds (20; 10 with ``--quick``) after a kill, the milestones
   reached are reported, the workers are killed and no further kill is
   made. ``--task-env KEY=VALUE`` passes environment variables to that
   cluster's tasks (e.g. ``PSTRAIN_RETRY_SECONDS``).

3. **Incremental checkpoints** (``--incremental``, or ``--only-incremental``):
   ``LocalCluster(num_ps=2)`` holds a fixed embedding table (a variable of
   ``inc_rows`` x ``inc_dim`` float32, Adagrad, split over both servers)
   and a dynamic table of as many keys and dim (Adagrad). Each round
   changes 1% of the rows of each (row-wise pushes to 1% of the fixed
   table's rows; look-ups and row gradients of 1% of the dynamic table's
   keys), then saves a delta (``CheckpointManager(incremental=True)``) and a
   full checkpoint (another manager, its own directory), in alternating
   order (ABBA). Sizes: the bytes of each table's files in the manifests
   (delta / full, per table, and the checkpoint's total); times: ``save()``.
   Then restore: the 10th delta (base + 10 deltas composed) against the
   full checkpoint of the same moment, alternating, 2 rounds each.

The checkpoint directory (default: a fresh temporary directory under /tmp;
with ``--dir``, a fresh subdirectory of it) is deleted at the end.
MB/s are decimal (1e6 bytes/s); sizes (MiB, GiB) binary.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from bench.common import (
    MiB,
    Stats,
    fmt_bytes,
    fmt_rate,
    fmt_seconds,
    machine_info,
    print_table,
    write_json,
)
from coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    LocalCluster,
    ParameterServerStrategy,
    push_gradients,
    read_variables,
)
from coordinator.checkpoint import CheckpointManager

GiB = 1 << 30
NUM_VARIABLES = 4
ROW_ELEMENTS = 1024            # each variable is (rows, 1024) float32
IN_FLIGHT = 4                  # recovery: steps kept scheduled at once
STEADY_S = 1.0                 # recovery: training time between the save and the kill
SMALL_SHAPE = (512, 256)       # recovery model: w (512, 256) and b (256,)


@dataclasses.dataclass(frozen=True)
class Plan:
    model_bytes: int        # value bytes of the throughput model (4 variables)
    sgd_reps: int           # timed rounds per variant, optimizer "sgd"
    adam_reps: int          # timed rounds per variant, optimizer "adam" (0: skipped)
    recovery_reps: int      # kills
    recovery_timeout_s: float   # training must resume within this after a kill
    inc_rows: int = 200_000     # incremental part: rows (keys) of each table
    inc_dim: int = 64
    inc_deltas: int = 10        # deltas after the base (save rounds)


FULL = Plan(model_bytes=1 * GiB, sgd_reps=3, adam_reps=2, recovery_reps=3,
            recovery_timeout_s=20.0)
QUICK = Plan(model_bytes=256 * MiB, sgd_reps=2, adam_reps=1, recovery_reps=1,
             recovery_timeout_s=10.0, inc_rows=50_000, inc_dim=32, inc_deltas=10)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- part 1: save / restore throughput ------------------------------------------------
def _reference_arrays(ckpt_path: str) -> list[tuple[str, np.ndarray]]:
    """Every tensor of a checkpoint (values and slots), as (file stem, array)."""
    from safetensors import safe_open

    out = []
    for root, _, files in os.walk(ckpt_path):
        for f in sorted(files):
            if f.endswith(".safetensors"):
                stem = f"{os.path.basename(root)}_{f[:-len('.safetensors')]}"
                with safe_open(os.path.join(root, f), framework="np") as st:
                    for key in st.keys():
                        out.append((f"{stem}_{key.replace('/', '_')}", st.get_tensor(key)))
    return out


def measure_throughput(optimizer: str, plan: Plan, reps: int, workdir: str,
                       warmup: bool = True) -> dict:
    """Save/restore rates of ours and numpy's for one optimizer; returns a record.

    The first save (untimed) gives the reference its arrays; with ``warmup``
    the other three variants also run once untimed first."""
    rows = plan.model_bytes // NUM_VARIABLES // 4 // ROW_ELEMENTS
    shape = (rows, ROW_ELEMENTS)
    ours_dir = os.path.join(workdir, f"ours-{optimizer}")
    ref_dir = os.path.join(workdir, f"numpy-{optimizer}")
    os.makedirs(ref_dir)
    log(f"{optimizer}: starting 2 parameter servers, creating {NUM_VARIABLES} x {shape} float32 "
        f"({fmt_bytes(plan.model_bytes)} of values)")
    with LocalCluster(num_ps=2, num_workers=0, checkpoint_dirs=(workdir,)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        for i in range(NUM_VARIABLES):
            strategy.create_variable(f"w{i}", shape, "float32", initializer="random_uniform",
                                     seed=i, optimizer=optimizer)
        ckpt = CheckpointManager(strategy, ours_dir, max_to_keep=1)
        step = iter(range(1, 1 << 30))

        t0 = time.perf_counter()
        first = ckpt.save(next(step))                       # warm-up save
        warm_save = time.perf_counter() - t0
        arrays = _reference_arrays(first)
        nbytes = sum(a.nbytes for _, a in arrays)
        slot_names = sorted({k.rsplit("_slot_", 1)[1] for k, _ in arrays if "_slot_" in k})
        log(f"{optimizer}: {len(arrays)} tensors, {fmt_bytes(nbytes)} per checkpoint "
            f"(slots: {', '.join(slot_names) or 'none'}); warm-up save {fmt_seconds(warm_save)}")

        def ours_save():
            ckpt.save(next(step))

        def ours_restore():
            ckpt.restore()

        def ref_save():
            for name, a in arrays:
                np.save(os.path.join(ref_dir, name + ".npy"), a)

        def ref_restore():
            for name, _ in arrays:
                np.load(os.path.join(ref_dir, name + ".npy"))

        fns = {"ours_save": ours_save, "ref_save": ref_save,
               "ours_restore": ours_restore, "ref_restore": ref_restore}
        if warmup:   # the first save above was ours_save's
            for key in ("ref_save", "ours_restore", "ref_restore"):
                fns[key]()
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(reps):
            # ABBA: ours first in even rounds, the reference first in odd ones.
            order = (["ours_save", "ref_save", "ours_restore", "ref_restore"] if r % 2 == 0 else
                     ["ref_save", "ours_save", "ref_restore", "ours_restore"])
            for key in order:
                t0 = time.perf_counter()
                fns[key]()
                samples[key].append(time.perf_counter() - t0)
            log(f"{optimizer}: round {r + 1}/{reps}: " + ", ".join(
                f"{k} {fmt_rate(nbytes / samples[k][-1])}" for k in fns))
        arrays.clear()   # free the reference copies before the next cluster
    shutil.rmtree(ours_dir, ignore_errors=True)
    shutil.rmtree(ref_dir, ignore_errors=True)
    stats = {k: Stats.of(v) for k, v in samples.items()}
    return {"optimizer": optimizer, "shape": list(shape), "variables": NUM_VARIABLES,
            "shards_per_variable": 2, "bytes": nbytes, "slots": slot_names, "reps": reps,
            "warmup_save_s": warm_save, "warmup": warmup,
            "samples_s": samples,
            "stats": {k: {**st.to_dict(), "median_MBps": nbytes / st.p50 / 1e6,
                          "best_MBps": nbytes / st.best / 1e6} for k, st in stats.items()}}


# -- part 3: incremental checkpoints ------------------------------------------------------
def _table_bytes(path: str) -> dict[str, int]:
    """Bytes of each table's files in a checkpoint: {"fixed", "dynamic", "total"}."""
    import json as _json
    m = _json.load(open(os.path.join(path, "manifest.json")))
    fixed = sum(e.get("bytes", 0) for e in m["variables"]["fixed"]["shards"])
    dynamic = sum(e.get("bytes", 0) for e in m["tables"]["dynamic"]["shards"])
    return {"fixed": fixed, "dynamic": dynamic, "total": fixed + dynamic}


def measure_incremental(plan: Plan, workdir: str) -> dict:
    """Delta against full checkpoints when 1% of each table's rows changed."""
    from coordinator.step_calls import IndexedSlices
    n, dim = plan.inc_rows, plan.inc_dim
    changed = max(1, n // 100)
    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 40, n, replace=False).astype(np.int64)
    log(f"incremental: 2 parameter servers; a fixed table {n} x {dim} and a dynamic table of "
        f"{n} keys, float32 Adagrad; {changed} rows (1%) of each change per round")
    samples: dict[str, list] = {"delta_save": [], "full_save": [], "delta_bytes": [],
                                "full_bytes": [], "delta_restore": [], "full_restore": []}
    with LocalCluster(num_ps=2, num_workers=0, checkpoint_dirs=(workdir,)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        fixed = strategy.create_variable("fixed", (n, dim), "float32",
                                         initializer="random_normal", optimizer="adagrad")
        table = strategy.create_embedding_table("dynamic", dim, initializer="random_normal",
                                                optimizer="adagrad")
        for lo in range(0, n, 50_000):
            table.lookup(keys[lo:lo + 50_000])
        inc = CheckpointManager(strategy, os.path.join(workdir, "inc"), incremental=True,
                                full_every=plan.inc_deltas + 5, max_to_keep=plan.inc_deltas + 1)
        full = CheckpointManager(strategy, os.path.join(workdir, "full"), max_to_keep=1)
        t0 = time.perf_counter()
        inc.save(0)
        log(f"incremental: base {fmt_bytes(_table_bytes(inc.latest())['total'])} in "
            f"{fmt_seconds(time.perf_counter() - t0)}")

        def change():
            ids = np.sort(rng.choice(n, changed, replace=False))
            push_gradients([(fixed, IndexedSlices(
                rng.normal(size=(changed, dim)).astype(np.float32), ids))])
            k = np.sort(rng.choice(keys, changed, replace=False))
            table.lookup(k)
            table.push_gradient(k, rng.normal(size=(changed, dim)).astype(np.float32))

        for r in range(1, plan.inc_deltas + 1):
            change()
            order = ("delta", "full") if r % 2 else ("full", "delta")
            for kind in order:
                t0 = time.perf_counter()
                path = inc.save(r) if kind == "delta" else full.save(r)
                samples[f"{kind}_save"].append(time.perf_counter() - t0)
                samples[f"{kind}_bytes"].append(_table_bytes(path))
            d, f = samples["delta_bytes"][-1], samples["full_bytes"][-1]
            log(f"incremental: round {r}: delta {fmt_bytes(d['total'])} "
                f"({d['total'] / f['total']:.2%} of full) in "
                f"{fmt_seconds(samples['delta_save'][-1])}, full {fmt_bytes(f['total'])} in "
                f"{fmt_seconds(samples['full_save'][-1])}")
        delta_path, full_path = inc.latest(), full.latest()
        for r in range(2):
            order = ("delta", "full") if r % 2 == 0 else ("full", "delta")
            for kind in order:
                t0 = time.perf_counter()
                (inc if kind == "delta" else full).restore(delta_path if kind == "delta"
                                                           else full_path)
                samples[f"{kind}_restore"].append(time.perf_counter() - t0)
    shutil.rmtree(os.path.join(workdir, "inc"), ignore_errors=True)
    shutil.rmtree(os.path.join(workdir, "full"), ignore_errors=True)
    med = statistics.median
    ratio = {part: med(d[part] / f[part] for d, f in zip(samples["delta_bytes"],
                                                          samples["full_bytes"]))
             for part in ("fixed", "dynamic", "total")}
    return {"rows": n, "dim": dim, "changed_rows": changed, "deltas": plan.inc_deltas,
            "samples": samples, "size_ratio_median": ratio,
            "median": {k: med(v) for k, v in samples.items() if not k.endswith("bytes")},
            "delta_bytes_median": {p: med(d[p] for d in samples["delta_bytes"])
                                   for p in ("fixed", "dynamic", "total")},
            "full_bytes_median": {p: med(d[p] for d in samples["full_bytes"])
                                  for p in ("fixed", "dynamic", "total")}}


def report_incremental(res: dict) -> None:
    db, fb, ratio, med = (res["delta_bytes_median"], res["full_bytes_median"],
                          res["size_ratio_median"], res["median"])
    rows = [[f"{label}: 1% of rows changed", fmt_bytes(int(db[p])), fmt_bytes(int(fb[p])),
             f"{ratio[p]:.2%}"] for p, label in (("fixed", "fixed table (variable)"),
                                                 ("dynamic", "dynamic table"),
                                                 ("total", "the checkpoint"))]
    rows.append(["save time", fmt_seconds(med["delta_save"]), fmt_seconds(med["full_save"]),
                 f"{med['delta_save'] / med['full_save']:.2%}"])
    rows.append([f"restore (base + {res['deltas']} deltas / full)",
                 fmt_seconds(med["delta_restore"]), fmt_seconds(med["full_restore"]),
                 f"{med['delta_restore'] / med['full_restore']:.2f}x"])
    print_table(["", "delta", "full", "delta / full"], rows,
                title=f"## incremental checkpoints: {res['rows']} x {res['dim']} float32 "
                      f"Adagrad fixed table + dynamic table of {res['rows']} keys, 2 ps; "
                      f"medians of {res['deltas']} rounds ({res['changed_rows']} rows of each "
                      "changed per round)")


# -- part 2: recovery after a parameter-server kill --------------------------------------
def train_step(w, b, seed: int) -> float:
    """One async step of a least-squares model on random data; returns the
    worker's time.time() at its end."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, SMALL_SHAPE[0]), dtype=np.float32)
    wv, bv = read_variables([w, b])
    err = x @ wv + bv                                   # target 0
    push_gradients([(w, x.T @ err / len(x)), (b, err.mean(axis=0))])
    return time.time()


class TimedCheckpointManager(CheckpointManager):
    """Records when each restore started and ended (monotonic)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.restores: list[tuple[float, float, str | None]] = []

    def restore(self, path=None, *, address=None):
        t0 = time.monotonic()
        try:
            return super().restore(path, address=address)
        finally:
            self.restores.append((t0, time.monotonic(), address))


class _Driver:
    """Keeps IN_FLIGHT steps scheduled; records (scheduled at, completed at) per step."""

    def __init__(self, coord: ClusterCoordinator, w, b):
        self.coord, self.w, self.b = coord, w, b
        self.done: list[tuple[float, float]] = []   # (t_sched, t_end) monotonic
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._seed = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-driver")
        # wall clock -> monotonic (same machine: the workers' time.time() is comparable)
        self._offset = time.time() - time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop scheduling (steps still in flight are left to coord.join())."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        outstanding: list = []
        try:
            while not self._stop.is_set():
                while len(outstanding) < IN_FLIGHT:
                    self._seed += 1
                    t = time.monotonic()
                    outstanding.append((t, self.coord.schedule(
                        train_step, args=(self.w, self.b, self._seed))))
                for item in [o for o in outstanding if o[1].done()]:
                    outstanding.remove(item)
                    t_end = item[1].fetch() - self._offset
                    with self._lock:
                        self.done.append((item[0], t_end))
                time.sleep(0.001)
        except BaseException as exc:   # reported by the caller
            self.error = exc

    def snapshot(self) -> list[tuple[float, float]]:
        with self._lock:
            return list(self.done)


def _one_kill(cluster: LocalCluster, coord: ClusterCoordinator, ckpt: "TimedCheckpointManager",
              w, b, timeout: float) -> dict:
    """Train, kill ps 1, time the milestones. A record with "timed_out" True if
    training did not resume within ``timeout`` seconds (the cluster is then unusable)."""
    restarts0, recoveries0 = cluster.restarts, coord.cluster.recovery.recoveries
    n_restores0 = len(ckpt.restores)
    driver = _Driver(coord, w, b)
    driver.start()
    time.sleep(STEADY_S)
    before = driver.snapshot()
    t_kill = time.monotonic()
    cluster.kill_ps(1)
    seen: dict[str, float | None] = {"paused": None, "restarted": None, "recovered": None,
                                     "first_new_step": None}
    deadline = t_kill + timeout
    while time.monotonic() < deadline and None in seen.values() and driver.error is None:
        now = time.monotonic()
        if seen["paused"] is None and coord.cluster.paused:
            seen["paused"] = now
        if seen["restarted"] is None and cluster.restarts > restarts0:
            seen["restarted"] = now
        if seen["recovered"] is None and coord.cluster.recovery.recoveries > recoveries0:
            seen["recovered"] = now
        done = driver.snapshot()
        if seen["first_new_step"] is None and any(s > t_kill for s, _ in done):
            seen["first_new_step"] = now
        time.sleep(0.001)
    driver.stop()
    if driver.error is not None:
        raise RuntimeError(f"a step failed during the recovery run: {driver.error!r}") \
            from driver.error
    done = driver.snapshot()
    restores = ckpt.restores[n_restores0:]
    steady = [e - s for s, e in before if s > t_kill - STEADY_S / 2]
    rel = {k: (v - t_kill if v is not None else None) for k, v in seen.items()}
    # Step completions: the worker's own clock, more exact than the polling above.
    first_any = (None if seen["recovered"] is None else
                 min((e for _, e in done if e > seen["recovered"]), default=None))
    first_new = min((e for s, e in done if s > t_kill), default=None)
    return {
        "timed_out": None in seen.values(),
        "timeout_s": timeout,
        "detected_s": rel["paused"],
        "restarted_s": rel["restarted"],
        "restore_start_s": restores[0][0] - t_kill if restores else None,
        "restore_s": sum(e - s for s, e, _ in restores) if restores else None,
        "restores": len(restores),
        "recovered_s": rel["recovered"],
        "first_step_s": first_any - t_kill if first_any is not None else None,
        "first_new_step_s": first_new - t_kill if first_new is not None else None,
        "steady_step_latency_s": statistics.median(steady) if steady else None,
        "steady_steps_per_sec": len([1 for _, e in before if e > t_kill - STEADY_S / 2])
        / (STEADY_S / 2),
    }


def measure_recovery(plan: Plan, workdir: str, timeout: float,
                     task_env: dict[str, str] | None = None) -> dict:
    ckpt_dir = os.path.join(workdir, "recovery")
    reps = []
    log("recovery: starting LocalCluster(num_ps=2, num_workers=2)"
        + (f" with task env {task_env}" if task_env else ""))
    t_start = time.perf_counter()
    with LocalCluster(num_ps=2, num_workers=2, env=task_env,
                      checkpoint_dirs=(workdir,)) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = strategy.create_variable("w", SMALL_SHAPE, "float32", initializer="glorot_uniform",
                                     optimizer="adam", optimizer_params={"learning_rate": 1e-3})
        b = strategy.create_variable("b", SMALL_SHAPE[1:], "float32", initializer="zeros",
                                     optimizer="adam", optimizer_params={"learning_rate": 1e-3})
        ckpt = TimedCheckpointManager(strategy, ckpt_dir, max_to_keep=1)
        log(f"recovery: cluster up in {time.perf_counter() - t_start:.1f} s")
        coord = ClusterCoordinator(strategy, checkpoint_manager=ckpt)
        try:
            coord.fetch([coord.schedule(train_step, args=(w, b, 1_000_000 + i))
                         for i in range(20)])
            for k in range(plan.recovery_reps):
                coord.join()
                ckpt.save(step=1000 * (k + 1))
                rec = _one_kill(cluster, coord, ckpt, w, b, timeout)
                reps.append(rec)
                log(f"recovery {k + 1}/{plan.recovery_reps}: " + ", ".join(
                    f"{key} {'-' if v is None else fmt_seconds(v)}" for key, v in rec.items()
                    if key.endswith("_s") and key != "timeout_s"))
                if rec["timed_out"]:
                    log(f"recovery {k + 1}: training did not resume within {timeout:.0f} s "
                        "after the kill; stopping the workers and skipping further kills")
                    for task in cluster.workers:   # SIGKILL: their steps would hang on
                        if task is not None:
                            task.kill()
                    break
                coord.join()
        finally:
            coord.shutdown()
        total_restarts = cluster.restarts
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    ok = [r for r in reps if not r["timed_out"]]
    return {"reps": reps, "cluster_restarts": total_restarts, "task_env": task_env or {},
            "median": {key: statistics.median(r[key] for r in ok) for key in ok[0]
                       if isinstance(ok[0][key], float) and all(r[key] is not None for r in ok)}
            if ok else {}}


# -- report -----------------------------------------------------------------------------
def report_throughput(results: list[dict]) -> list[dict]:
    rows, summary = [], []
    for res in results:
        st, n = res["stats"], res["bytes"]
        what = f"{res['optimizer']}, {fmt_bytes(n)}"
        for op, ref_op in (("save", "np.save"), ("restore", "np.load")):
            ours, ref = st[f"ours_{op}"]["median_MBps"], st[f"ref_{op}"]["median_MBps"]
            summary.append({"workload": f"{op} {what}", "optimizer": res["optimizer"],
                            "op": op, "bytes": n, "ours_MBps": ours, "reference": ref_op,
                            "reference_MBps": ref, "ratio": ours / ref,
                            "ours_best_MBps": st[f"ours_{op}"]["best_MBps"],
                            "reference_best_MBps": st[f"ref_{op}"]["best_MBps"]})
            rows.append([f"checkpoint {op} ({what}), median of {res['reps']}",
                         f"{fmt_rate(ours * 1e6)} ({fmt_seconds(st[f'ours_{op}']['p50'])})",
                         f"{ref_op}: {fmt_rate(ref * 1e6)} ({fmt_seconds(st[f'ref_{op}']['p50'])})",
                         f"{ours / ref:.2f}"])
    print_table(["workload", "ours", "reference", "ratio"], rows,
                title="## checkpoint throughput vs numpy (same run, same disk; "
                      "ratio = ours / reference, higher is better)")
    return summary


def report_recovery(rec: dict) -> None:
    labels = [("detected_s", "coordinator paused (recovery began)"),
              ("restarted_s", "new ps listening (LocalCluster supervisor restart)"),
              ("restore_start_s", "restore began"),
              ("restore_s", "restore duration (shards of ps 1)"),
              ("recovered_s", "recovery done (shards restored)"),
              ("first_step_s", "first step completed after the recovery (a re-run)"),
              ("first_new_step_s", "first step scheduled after the kill completed")]
    reps = rec["reps"]
    ok = [r for r in reps if not r["timed_out"]]

    def cell(v, r):
        return fmt_seconds(v) if v is not None else f"not within {r['timeout_s']:.0f} s"
    rows = []
    for key, label in labels:
        vals = [r[key] for r in ok if r[key] is not None]
        med = fmt_seconds(statistics.median(vals)) if vals and len(vals) == len(ok) else "-"
        rows.append([label, med, ", ".join(cell(r[key], r) for r in reps)])
    steady = [r["steady_step_latency_s"] for r in reps if r["steady_step_latency_s"]]
    if steady:
        rows.append(["(steady-state step latency before the kill)",
                     fmt_seconds(statistics.median(steady)), ", ".join(map(fmt_seconds, steady))])
    env = f"; task env {rec['task_env']}" if rec.get("task_env") else ""
    print_table(["time from kill_ps(1) to", f"median of {len(ok)} recovered",
                 f"each run ({len(reps)})"], rows,
                title="## recovery after a parameter-server kill (LocalCluster 2 ps + 2 workers, "
                      f"async, Adam, 4 steps in flight{env})")
    if len(ok) < len(reps):
        print(f"\n{len(reps) - len(ok)} of {len(reps)} kills: training did not resume within "
              f"{reps[-1]['timeout_s']:.0f} s (see the milestones that were reached).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_checkpoint",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="256 MiB model, fewer rounds, one kill (under a minute)")
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    p.add_argument("--dir", metavar="PATH",
                   help="where to write checkpoints (a fresh subdirectory, deleted at the end; "
                        "default: under /tmp)")
    p.add_argument("--no-adam", action="store_true", help="skip the adam throughput run")
    p.add_argument("--no-throughput", action="store_true",
                   help="only the recovery part")
    p.add_argument("--recovery-timeout", type=float, metavar="S",
                   help=f"seconds training may take to resume after a kill (default "
                        f"{FULL.recovery_timeout_s:.0f}; {QUICK.recovery_timeout_s:.0f} with --quick)")
    p.add_argument("--task-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the recovery cluster's tasks (repeatable)")
    p.add_argument("--incremental", action="store_true",
                   help="also part 3: incremental checkpoints (delta vs full size and time)")
    p.add_argument("--only-incremental", action="store_true", help="only part 3")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.no_adam:
        plan = dataclasses.replace(plan, adam_reps=0)
    if args.recovery_timeout is not None:
        plan = dataclasses.replace(plan, recovery_timeout_s=args.recovery_timeout)
    task_env = dict(kv.split("=", 1) for kv in args.task_env)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="pstrain-bench-ckpt-", dir=args.dir or "/tmp")
    t0 = time.perf_counter()
    try:
        log(f"checkpoints under {workdir}")
        throughput, recovery, incremental = [], None, None
        if args.incremental or args.only_incremental:
            incremental = measure_incremental(plan, workdir)
        if not args.no_throughput and not args.only_incremental:
            throughput.append(measure_throughput("sgd", plan, plan.sgd_reps, workdir))
            if plan.adam_reps:
                # No warm-up round: the sgd run warmed every code path up.
                throughput.append(measure_throughput("adam", plan, plan.adam_reps, workdir,
                                                     warmup=False))
        if not args.only_incremental:
            recovery = measure_recovery(plan, workdir, plan.recovery_timeout_s,
                                        task_env or None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = report_throughput(throughput) if throughput else []
    if throughput:
        print("\nReads may come from the page cache (not dropped), for ours and numpy alike; "
              "neither side fsyncs its tensor files.")
    if recovery is not None:
        report_recovery(recovery)
    if incremental is not None:
        report_incremental(incremental)
    elapsed = time.perf_counter() - t0
    print(f"\n({'quick' if args.quick else 'full'} plan, {elapsed:.0f} s)")
    if args.json:
        write_json(args.json, {"benchmark": "bench_checkpoint", "machine": machine_info(),
                               "plan": dataclasses.asdict(plan), "elapsed_s": elapsed,
                               "directory": workdir, "summary": summary,
                               "throughput": throughput, "recovery": recovery,
                               "incremental": incremental})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
