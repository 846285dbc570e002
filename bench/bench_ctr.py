"""The click-through-rate workload against TensorFlow, measured in the same run.

    python -m bench.bench_ctr [--quick] [--hosts] [--json out.json]

Both sides train examples/dlrm.py's model (the same initial dense weights)
on coordinator/ctr_data.py's batches, made once on each worker (worker i of
ours cycles batches i, i + 2, ...; each TensorFlow worker all of them, in
its own shuffled order),
2 parameter servers and 2 workers, plain SGD, async:

* ours: the 26 features' ids in one dynamic embedding table (rows made on
  first sight), the dense layers as variables; ``--tables per-feature``:
  a table per feature, of examples/ctr.py's widths (4, 8, 16), the
  narrower rows projected to 16 (TensorFlow's tables then take the same
  widths and projections);
* TensorFlow 2's ParameterServerStrategy + ClusterCoordinator: 26 fixed
  tables of ``id % buckets`` rows each (the usual workaround for unbounded
  ids; at most the feature's vocabulary), tf.function steps.

Reported: samples/s of each (warm-up steps first, then the same number of
timed steps), the ratio, and the AUC of each model on the same held-out
batches after the same steps (numpy forward of the weights, alike), with
the planted model's AUC as the ceiling. ``--hosts``: every task of both
sides on a test host of its own (bench/hosts.py; root).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import sys
import tempfile
import time

from bench.common import machine_info, print_table, write_json

BATCH, LR, BUCKETS, SEED = 512, 0.1, 100_000, 0


class OursCTR:
    """The CTR workload on one of our strategies: ``run(n)`` trains n steps
    (seconds), ``auc()`` measures the model on held-out batches. Also the
    (e) workload of bench/suite.py."""

    def __init__(self, strategy, coord, n_batches: int, prefix: str = "ctr",
                 tables: str = "shared", init_seed: int = SEED, capacity: int = 4_000_000):
        from coordinator import EmbeddingCollection, Initializer
        from examples import ctr
        from examples import dlrm as M
        self.variables = {n: strategy.create_variable(f"{prefix}/{n}", initial_value=v,
                                                      optimizer="sgd",
                                                      optimizer_params={"learning_rate": LR})
                          for n, v in ctr.dense_params(init_seed, tables).items()}
        # the example's capacities (4M rows; per feature, a share by vocabulary);
        # ``capacity=0``: unbounded (per feature too: nothing padded then); another
        # capacity bounds the shared table only
        config = dict(optimizer="sgd", optimizer_params={"learning_rate": LR},
                      initializer=Initializer(kind="random_uniform", minval=-0.05, maxval=0.05,
                                              seed=init_seed), capacity=capacity)
        if tables == "per-feature":   # examples/ctr.py --tables per-feature: widths 4, 8, 16
            self.table = EmbeddingCollection(strategy, f"{prefix}/emb", ctr.feature_configs(
                init_seed, LR, "sgd", min_count=1, **({} if capacity else {"capacity": 0})))
        else:
            self.table = strategy.create_embedding_table(f"{prefix}/emb", M.DIM, **config)
        self.coord = coord
        self.it = iter(coord.create_per_worker_dataset(functools.partial(ctr_dataset, n_batches)))
        self.step = ctr.make_train_step(self.table, self.variables)   # examples/ctr.py's step

    def run(self, n: int) -> float:
        t0 = time.perf_counter()
        self.coord.fetch([self.coord.schedule(self.step, args=(self.it,)) for _ in range(n)])
        return time.perf_counter() - t0

    def auc(self) -> float:
        from examples import ctr
        return ctr.evaluate(self.table, self.variables, SEED, 20, BATCH)["auc"]


def ctr_dataset(n_batches: int, ctx):
    """On each worker, once: its batches (worker i: i, i + 2, ...), then round and round."""
    from coordinator import ctr_data as D
    i = ctx.input_pipeline_id
    return itertools.cycle([D.batch(SEED, i + 2 * k, BATCH) for k in range(n_batches)])


def ours(steps: int, warmup: int, n_batches: int, placement=None,
         tables: str = "shared", init_seed: int = SEED) -> dict:
    from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
    with LocalCluster(num_ps=2, num_workers=2, placement=placement) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            w = OursCTR(strategy, coord, n_batches, tables=tables, init_seed=init_seed)
            w.run(warmup)
            seconds = w.run(steps)
        return {"samples_per_s": steps * BATCH / seconds, "auc": w.auc(),
                "rows": w.table.stats().rows}


def tensorflow(steps: int, warmup: int, n_batches: int, placement=None,
               tables: str = "shared", init_seed: int = SEED) -> dict:
    """TensorFlow's run; ``tables="per-feature"``: its 26 tables of ours'
    per-feature widths (examples/ctr.py's FEATURE_DIMS, projected alike)."""
    from bench.tf_reference import TFCluster
    from examples import ctr
    log = os.path.join(tempfile.gettempdir(), f"bench-ctr-tf-{os.getpid()}.log")
    with TFCluster(2, 2, log_path=log, placement=placement,
                   inter_op={"ps": 1, "worker": 2, "chief": 1}) as tf:
        tf.chief.call("setup_ctr", buckets=BUCKETS, batch=BATCH, lr=LR, seed=SEED,
                      n_batches=n_batches, workers=2, timeout=600, init_seed=init_seed,
                      dims=list(ctr.FEATURE_DIMS) if tables == "per-feature" else None)
        tf.chief.call("run", workload="ctr", steps=warmup, timeout=600)
        out = tf.chief.call("run", workload="ctr", steps=steps, timeout=1200)
        auc = tf.chief.call("ctr_auc", seed=SEED, batches=20, size=BATCH, timeout=600)["auc"]
        return {"samples_per_s": steps * BATCH / out["seconds"], "auc": auc,
                "version": tf.chief.hello.get("tensorflow")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--hosts", action="store_true",
                    help="every task on a test host of its own (root)")
    ap.add_argument("--tables", choices=("shared", "per-feature"), default="shared",
                    help="ours: the 26 features in one table, or a table per feature "
                         "(an EmbeddingCollection, examples/ctr.py --tables per-feature)")
    ap.add_argument("--init-seed", type=int, default=SEED,
                    help="the seed of both models' initial weights and rows (the data and "
                         "held-out batches stay those of seed 0)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    steps, warmup, n_batches = (150, 30, 60) if args.quick else (600, 60, 120)
    from bench.suite import BLAS_ENV
    os.environ.update(BLAS_ENV)
    from coordinator import ctr_data as D
    res = {"machine": machine_info(), "steps": steps, "batch": BATCH,
           "ceiling_auc": D.bayes_auc(SEED + 1, 20 * BATCH)}
    with contextlib.ExitStack() as stack:
        ours_at = tf_at = None
        if args.hosts:
            from bench.hosts import TestHosts
            hosts = stack.enter_context(TestHosts(9))
            ours_at = hosts.placement(ps=[0, 1], worker=[2, 3])
            tf_place = hosts.placement(ps=[4, 5], worker=[6, 7])
            tf_at = (lambda job, i: (hosts.addresses[8], hosts.run(8)) if job == "chief"
                     else tf_place(job, i))
        res["ours"] = ours(steps, warmup, n_batches, ours_at, args.tables, args.init_seed)
        res["tf"] = tensorflow(steps, warmup, n_batches, tf_at, args.tables, args.init_seed)
    o, t = res["ours"], res["tf"]
    where = "across hosts" if args.hosts else "same host"
    print_table(["CTR, DLRM, 2 ps + 2 workers, " + where, "samples/s", "AUC after "
                 f"{warmup + steps} steps of {BATCH}"], [
        ["ours (one dynamic table)" if args.tables == "shared" else
         "ours (26 per-feature tables)", f"{o['samples_per_s']:,.0f} "
         f"({o['samples_per_s'] / t['samples_per_s']:.2f}x TF)", f"{o['auc']:.4f}"],
        [f"TensorFlow {t.get('version', '')} (26 tables of id % {BUCKETS:,}"
         + (", our widths)" if args.tables == "per-feature" else ")"),
         f"{t['samples_per_s']:,.0f}", f"{t['auc']:.4f}"],
        ["the planted model (ceiling)", "", f"{res['ceiling_auc']:.4f}"]])
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
