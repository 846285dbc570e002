"""Throughput of synchronous training against asynchronous, measured in the same run.

    python -m bench.bench_sync [--quick] [--json out.json]

For 1, 2 and 4 workers, one ``LocalCluster(num_ps=2, num_workers=W)`` serves
two strategies at once, each with its own variables and its own
``ClusterCoordinator``: ``mode="async"`` and ``mode="sync"`` with
``num_replicas=W``. Two models:

* ``digits``: the MLP 64-64-10 of examples/nn.py on scikit-learn's digits
  (``make_train_step``: read, forward/backward in numpy, push), per-replica
  batch 32, Adam, variables placed as examples/digits.py does;
* ``dense 64 MiB``: one float32 variable of 16 Mi elements split over the 2
  parameter servers (``FixedShardsPartitioner(2)``), SGD. A step reads it,
  scales the copy it read into a gradient (one pass over memory) and pushes
  it: communication, not compute.

How it is timed: a *block* schedules a number of steps and ``join()``s. Both
modes do the same number C of closures per block, whatever W (async: C
steps; sync: C / W steps of W replica closures each), so every block takes a
similar time. Blocks alternate async / sync in ABBA order after an
untimed warm-up block of each, so a noisy spell hits both modes alike.
Rates are at the median block time (the JSON also has the best). CPU
seconds of every process (coordinator, parameter servers, workers; from
/proc) are summed over the timed blocks of each mode: the second table.

What counts as a step:

* async: one closure (one read, one push, one optimizer update);
* sync: one scheduled step = W replica closures whose gradients the
  parameter servers combine into one update.

So steps/s favours async by up to a factor W; the fair comparison is
examples/s = steps/s x per-replica batch x replicas per step (1 in async,
W in sync). The dense model has no data: its "batch" is 1 (examples/s there
is gradients pushed per second).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time

import numpy as np

from bench.common import (
    MiB,
    Stats,
    cpu_seconds,
    machine_busy,
    machine_info,
    print_table,
    write_json,
)
from coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    batches,
    push_gradients,
    read_variables,
)

MODES = ("async", "sync")
DIGITS_BATCH = 32
DIGITS_LR = 3e-3
DENSE_ELEMENTS = 16 * MiB          # float32: 64 MiB
DENSE_LR = 1e-3


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    closures_per_block: int     # C (a multiple of every W): C async steps, or C/W sync steps
    rounds: int                 # timed blocks per mode
    warmup_per_replica: int     # untimed first: this many closures per worker, per mode


@dataclasses.dataclass(frozen=True)
class Plan:
    workers: tuple[int, ...]
    digits: ModelPlan
    dense: ModelPlan


FULL = Plan(workers=(1, 2, 4), digits=ModelPlan(240, 6, 20), dense=ModelPlan(8, 6, 1))
QUICK = Plan(workers=(1, 2, 4), digits=ModelPlan(120, 3, 10), dense=ModelPlan(4, 3, 1))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- step functions (module level: workers import them by name) -----------------------
def dense_step(var) -> float:
    """Read the whole variable, scale the copy into a gradient, push it."""
    (value,) = read_variables([var])
    np.multiply(value, np.float32(1e-3), out=value)   # the copy read is ours to reuse
    push_gradients([(var, value)])
    return 0.0


# -- the two models, one instance per mode ------------------------------------------------
class DigitsModel:
    name = "digits MLP 64-64-10"
    batch = DIGITS_BATCH

    def __init__(self, strategy: ParameterServerStrategy, coord: ClusterCoordinator,
                 prefix: str, data):
        from examples.nn import MLP, make_train_step
        x_tr, y_tr = data
        self.model = MLP([64, 64, 10], loss="softmax_cross_entropy")
        # Linear scaling rule in sync mode (the global batch is W x 32), as a user would.
        self.model.create_variables(
            strategy, f"{prefix}/digits", optimizer="adam",
            optimizer_params={"learning_rate": strategy.scale_learning_rate(DIGITS_LR)})
        self.step = make_train_step(self.model)
        batch = self.batch

        def dataset_fn(ctx):   # every worker: its shard of the training set
            xs, ys = ctx.shard(x_tr, y_tr)
            return batches(xs, ys, batch_size=batch, seed=ctx.input_pipeline_id)

        self.it = iter(coord.create_per_worker_dataset(dataset_fn))
        self.coord = coord

    def schedule(self):
        return self.coord.schedule(self.step, args=(self.it,))


class DenseModel:
    name = "dense 64 MiB"
    batch = 1

    def __init__(self, strategy: ParameterServerStrategy, coord: ClusterCoordinator,
                 prefix: str, data=None):
        self.var = strategy.create_variable(
            f"{prefix}/dense", (DENSE_ELEMENTS,), "float32", initializer="ones",
            optimizer="sgd", optimizer_params={"learning_rate": DENSE_LR},
            partitioner=FixedShardsPartitioner(2))
        self.coord = coord

    def schedule(self):
        return self.coord.schedule(dense_step, args=(self.var,))


# -- measurement -----------------------------------------------------------------------------
def _ours() -> float:
    """CPU seconds of this process and of its children that have exited (the clusters)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CPUMeter:
    """CPU seconds used by the coordinator, the parameter servers and the workers."""

    def __init__(self, cluster: LocalCluster):
        self.pids = {"coordinator": [None], "ps": [t.pid for t in cluster.ps],
                     "workers": [t.pid for t in cluster.workers if t is not None]}

    def read(self) -> dict[str, float]:
        return {role: sum(cpu_seconds(p) for p in pids) for role, pids in self.pids.items()}


def _block(model, n: int, meter: CPUMeter) -> tuple[float, dict[str, float]]:
    """Schedule n steps and join; return (seconds, CPU seconds by role)."""
    gc.collect()
    gc.disable()
    try:
        cpu0 = meter.read()
        t0 = time.perf_counter()
        futures = [model.schedule() for _ in range(n)]
        model.coord.join()
        elapsed = time.perf_counter() - t0
        cpu1 = meter.read()
    finally:
        gc.enable()
    for f in futures:   # raises a step's error, if any
        f.fetch()
    return elapsed, {role: cpu1[role] - cpu0[role] for role in cpu0}


def measure(model_cls, workers: int, mp: ModelPlan, data) -> dict:
    """{mode: {"steps_per_block", "stats"}} for one model and worker count."""
    with LocalCluster(num_ps=2, num_workers=workers) as cluster, contextlib.ExitStack() as stack:
        models, steps = {}, {}
        for mode in MODES:
            kw = {"num_replicas": workers} if mode == "sync" else {}
            strategy = ParameterServerStrategy(
                cluster.spec, mode=mode,
                variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2),
                **kw)
            coord = stack.enter_context(ClusterCoordinator(strategy))
            models[mode] = model_cls(strategy, coord, mode, data)
            # Same closures per block in both modes: C async steps, C/W sync steps of W.
            steps[mode] = mp.closures_per_block // (1 if mode == "async" else workers)
        meter = CPUMeter(cluster)
        for mode in MODES:   # connections, datasets, first-call costs
            _block(models[mode], mp.warmup_per_replica * (workers if mode == "async" else 1),
                   meter)
        samples: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, dict[str, float]] = {m: {} for m in MODES}
        for r in range(mp.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):   # ABBA
                secs, used = _block(models[mode], steps[mode], meter)
                samples[mode].append(secs)
                for role, c in used.items():
                    cpu[mode][role] = cpu[mode].get(role, 0.0) + c
        if isinstance(models["sync"], DenseModel):
            metas = models["sync"].var.meta()
            assert all(m.dropped_gradients == 0 for m in metas), metas
    out = {}
    for mode in MODES:
        closures = mp.rounds * mp.closures_per_block
        wall = sum(samples[mode])
        out[mode] = {"steps_per_block": steps[mode], "stats": Stats.of(samples[mode]),
                     "cpu_ms_per_closure": {r: 1e3 * c / closures for r, c in cpu[mode].items()},
                     "cpu_busy_cores": sum(cpu[mode].values()) / wall}
    return out


def result_row(model_cls, workers: int, res: dict) -> dict:
    out = {"model": model_cls.name, "workers": workers, "batch_per_replica": model_cls.batch}
    for mode in MODES:
        st: Stats = res[mode]["stats"]
        n = res[mode]["steps_per_block"]
        replicas = workers if mode == "sync" else 1
        out[mode] = {
            "steps_per_block": n, "replicas_per_step": replicas,
            "block_seconds": st,
            "steps_per_s": n / st.p50, "steps_per_s_best": n / st.best,
            "examples_per_s": n * model_cls.batch * replicas / st.p50,
            "examples_per_s_best": n * model_cls.batch * replicas / st.best,
            "cpu_ms_per_closure": res[mode]["cpu_ms_per_closure"],
            "cpu_busy_cores": res[mode]["cpu_busy_cores"],
        }
    out["sync_over_async_steps"] = out["sync"]["steps_per_s"] / out["async"]["steps_per_s"]
    out["sync_over_async_examples"] = (out["sync"]["examples_per_s"]
                                       / out["async"]["examples_per_s"])
    return out


def _f(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def print_results(rows: list[dict]) -> None:
    table = [[r["model"], r["workers"], _f(r["async"]["steps_per_s"]), _f(r["sync"]["steps_per_s"]),
              f"{r['sync_over_async_steps']:.2f}", _f(r["async"]["examples_per_s"]),
              _f(r["sync"]["examples_per_s"]), f"{r['sync_over_async_examples']:.2f}"]
             for r in rows]
    print_table(["model", "workers", "async steps/s", "sync steps/s", "sync/async (steps)",
                 "async examples/s", "sync examples/s", "sync/async (examples)"], table,
                title="## sync vs async (same run, same cluster; rates at the median block)")
    print("""
steps/s counts global steps: async = closures completed per second (one update
each); sync = scheduled steps per second, each W replica closures combined into
one update. examples/s = steps/s x per-replica batch x replicas per step (1 in
async, W in sync) is the fair comparison. Per-replica batch: digits 32; the
dense model has no data, so its batch counts as 1 (examples/s = gradients/s).
2 parameter servers + W workers + this coordinator share the machine's
CPUs: with 4 workers (and already 2) a 2-core machine is oversubscribed.""".rstrip())


def print_cpu(rows: list[dict]) -> None:
    table = []
    for r in rows:
        for mode in MODES:
            c = r[mode]["cpu_ms_per_closure"]
            table.append([r["model"], r["workers"], mode, f"{c['coordinator']:.2f}",
                          f"{c['ps']:.2f}", f"{c['workers']:.2f}",
                          f"{sum(c.values()):.2f}", f"{r[mode]['cpu_busy_cores']:.2f}"])
    print_table(["model", "workers", "mode", "coordinator", "2 ps", "workers", "total",
                 "busy cores (these processes)"], table,
                title="## where the CPU goes: CPU ms per closure, by role (timed blocks)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_sync",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer blocks (about a minute)")
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    cpus = os.cpu_count() or 1
    if cpus < 2 + max(plan.workers) + 1:
        log(f"note: {cpus} CPUs for 2 parameter servers + up to {max(plan.workers)} workers + "
            "the coordinator: the larger clusters oversubscribe this machine")
    from examples.digits import load_data
    x_tr, y_tr, _, _ = load_data(0)
    busy0, ours0 = machine_busy(), _ours()
    t0 = time.perf_counter()
    rows = []
    for model_cls, mp in ((DigitsModel, plan.digits), (DenseModel, plan.dense)):
        for w in plan.workers:
            if mp.closures_per_block % w:
                raise ValueError(f"closures_per_block {mp.closures_per_block} is not a "
                                 f"multiple of {w} workers")
            log(f"{model_cls.name}, {w} worker(s): {mp.rounds} timed blocks per mode of "
                f"{mp.closures_per_block} closures")
            t1 = time.perf_counter()
            res = measure(model_cls, w, mp, (x_tr, y_tr))
            row = result_row(model_cls, w, res)
            row["seconds"] = time.perf_counter() - t1
            rows.append(row)
            log(f"  async {row['async']['steps_per_s']:.1f} steps/s, sync "
                f"{row['sync']['steps_per_s']:.1f} steps/s ({row['seconds']:.0f} s)")
    elapsed = time.perf_counter() - t0
    print_results(rows)
    print_cpu(rows)
    busy1, ours1 = machine_busy(), _ours()
    # Busy CPU time of the machine not spent by this benchmark (its tasks have exited).
    others = None if busy0 is None else max(0.0, (busy1 - busy0) - (ours1 - ours0)) / elapsed
    print(f"\n({'quick' if args.quick else 'full'} plan, {elapsed:.0f} s, {cpus} CPUs"
          + ("" if others is None else
             f"; other processes kept {others:.2f} cores busy on average meanwhile: they slow "
             "both modes alike, but add noise") + ")")
    if args.json:
        write_json(args.json, {
            "benchmark": "bench_sync", "machine": machine_info(),
            "plan": dataclasses.asdict(plan), "elapsed_s": elapsed,
            "oversubscribed": cpus < 2 + max(plan.workers) + 1,
            "other_processes_busy_cores": others,
            "notes": {"rates": "at the median block time; *_best at the fastest block",
                      "steps": "async: closures; sync: scheduled steps of W replica closures",
                      "examples": "steps x batch_per_replica x replicas_per_step",
                      "dense_batch": "the dense model has no data: batch 1 per replica"},
            "results": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    # Run as the module bench.bench_sync (not __main__) so workers import dense_step by name.
    from bench.bench_sync import main as _main
    sys.exit(_main())
