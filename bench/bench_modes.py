"""The CTR workload in sync, hybrid and async modes, measured in the same run.

    python -m bench.bench_modes [--quick] [--json out.json]

One ``LocalCluster(num_ps=2, num_workers=2)`` serves three strategies at
once, each with its own copy of examples/ctr.py's model (``ctr.build``: the
same initial dense weights, a dynamic table with the same seeded rows,
Adagrad everywhere) and its own ``ClusterCoordinator``:

* ``sync``: a step is 2 replicas of a batch each, the dense gradients and
  the table's row gradients averaged and applied once per step;
* ``hybrid``: the same steps, the dense layers as in sync, the table as in
  async (each replica's row gradients applied on arrival);
* ``async`` (for reference): every closure's push applied on arrival.

Every closure, in every mode, trains examples/ctr.py's step
(``ctr.make_train_step``) on one batch of 512; the batches of the run are
made once on each worker before timing (async: worker i cycles batches i,
i + 2, ...; sync and hybrid: replica r of step s takes batch 2s + r), so the
three modes see the same data, the same number of closures and samples.

Timing as bench/suite.py: blocks of the same number of closures per mode
(sync and hybrid: half as many steps), alternating in ABC CBA order after an
untimed warm-up block of each, rates at the median block. After the blocks
each mode's model is scored on the same held-out batches (AUC, look-ups
without admission). Reported: samples/s and AUC of each, hybrid / sync.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time

from bench.common import machine_info, print_table, write_json

BATCH, LR, SEED, REPLICAS = 512, 0.1, 0, 2
MODES = ("sync", "hybrid", "async")
#: This run's batches, made once per worker process (dataset_fn) and shared
#: by the three modes' steps there.
_BATCHES: list = []


def batch_of(k: int):
    """Batch k of the run (cycled): sync and hybrid steps' replica slices."""
    return _BATCHES[k % len(_BATCHES)]


def dataset_fn(n: int, ctx):
    """On each worker, once: every batch of the run; the worker's async
    stream is batches i, i + W, ... of them, round and round."""
    from coordinator import ctr_data as D
    if len(_BATCHES) != n:
        _BATCHES[:] = [D.batch(SEED, k, BATCH) for k in range(n)]
    return itertools.cycle(_BATCHES[ctx.input_pipeline_id::ctx.num_input_pipelines])


def run(blocks: int, closures: int, n_batches: int) -> dict:
    from bench import bench_modes as here  # by reference on the workers (not __main__)
    from bench.suite import Variant, run_interleaved
    from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
    from examples import ctr
    out: dict = {}
    with LocalCluster(num_ps=2, num_workers=REPLICAS) as cluster, \
            contextlib.ExitStack() as stack:
        models, variants = {}, []
        for mode in MODES:
            strategy = ParameterServerStrategy(cluster.spec, mode=mode)
            variables, table = ctr.build(strategy, SEED, LR, prefix=mode)
            coord = stack.enter_context(ClusterCoordinator(strategy))
            it = iter(coord.create_per_worker_dataset(
                lambda ctx: here.dataset_fn(n_batches, ctx)))
            step = ctr.make_train_step(table, variables,
                                       None if mode == "async" else here.batch_of)
            per_schedule = strategy.num_replicas_in_sync

            def block(n, coord=coord, step=step, it=it, per=per_schedule) -> float:
                t0 = time.perf_counter()
                coord.fetch([coord.schedule(step, args=(it,)) for _ in range(n // per)])
                return time.perf_counter() - t0
            models[mode] = (variables, table)
            variants.append(Variant(mode, block, closures))
        run_interleaved(variants, blocks, 1.0, "ctr modes")
        for v in variants:
            variables, table = models[v.key]
            r = v.result()
            out[v.key] = {"samples_per_s": r["steps_per_s"] * BATCH,
                          "samples_per_s_best": r["steps_per_s_best"] * BATCH,
                          "blocks_s": r["blocks_s"],
                          "auc": ctr.evaluate(table, variables, SEED, 20, BATCH)["auc"],
                          "rows": table.stats().rows}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer blocks")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    blocks, closures, n_batches = (4, 40, 80) if args.quick else (8, 60, 240)
    from bench.suite import BLAS_ENV
    os.environ.update(BLAS_ENV)
    from coordinator import ctr_data as D
    res = {"machine": machine_info(), "blocks": blocks, "closures_per_block": closures,
           "batch": BATCH, "replicas": REPLICAS, "ceiling_auc": D.bayes_auc(SEED + 1, 20 * BATCH)}
    res.update(run(blocks, closures, n_batches))
    samples = (blocks + 1) * closures * BATCH   # the warm-up block trained too
    s, h = res["sync"], res["hybrid"]
    res["hybrid_over_sync"] = h["samples_per_s"] / s["samples_per_s"]
    print_table(["CTR, DLRM, 2 ps + 2 workers, same run", "samples/s (median block)",
                 f"held-out AUC after {samples:,} samples"], [
        ["sync (dense and table: one mean update per step)", f"{s['samples_per_s']:,.0f}",
         f"{s['auc']:.4f}"],
        ["hybrid (dense: sync; table: each push on arrival)", f"{h['samples_per_s']:,.0f}",
         f"{h['auc']:.4f}"],
        ["hybrid / sync", f"{res['hybrid_over_sync']:.2f}x",
         f"{h['auc'] - s['auc']:+.4f}"],
        ["async (reference)", f"{res['async']['samples_per_s']:,.0f}",
         f"{res['async']['auc']:.4f}"],
        ["the planted model (ceiling)", "", f"{res['ceiling_auc']:.4f}"]])
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
