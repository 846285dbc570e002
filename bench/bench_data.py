"""Epoch time with a slow worker and uneven shards: a sharded dataset against
today's per-worker datasets, measured in the same run.

    python -m bench.bench_data [--quick] [--json out.json]

One ``LocalCluster(num_ps=1, num_workers=3)``; worker 0 is ``--slow`` (3)
times slower than the others: each step sleeps ``--step-ms`` (20) ms per
batch on a fast worker and 3x that on the slow one, standing for compute
on machines of their own (on this 2-core machine real compute would make
the three workers contend for the cores instead), then reads a 16-float
linear model, computes its gradient on the batch and pushes it. The data:
3 shards of 1:3:5 examples (200, 600, 1000; batch 20: 90 batches an epoch).

Variants, one epoch each, in rotating order per round (``--rounds``):

* ``sharded``: ``create_sharded_dataset`` (exactly once), one closure per
  batch; batches bound when a worker takes a closure.
* ``fixed, slow on 1000`` / ``fixed, slow on 200``: per-worker datasets,
  worker i reading its own shard once (the slow worker on the largest /
  smallest); closures are scheduled until every worker has said its shard
  is done (a closure on a worker that is done returns at once): each example
  once, the epoch as long as the most loaded worker.
* ``repeat, 90 steps``: per-worker datasets that repeat forever, 90
  closures (TensorFlow's usual ``steps_per_epoch``): as fast as the sharded
  one, but it does not visit the data: the "coverage" column says which
  share of the examples an epoch saw, "max" how often the most seen one.

An epoch's time includes making its dataset on the workers. Figures: the
median of the rounds, [lowest-highest]; ratios against ``sharded`` of the
same round.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

import numpy as np

from bench.common import machine_info, print_table, write_json
from coordinator import (
    ClusterCoordinator,
    LocalCluster,
    ParameterServerStrategy,
    ShardedSource,
    push_gradients,
    read_variables,
)

SIZES = (200, 600, 1000)
BATCH = 20
DIM = 16


# -- the steps (imported on the workers by name) -------------------------------------------------
def _train(ids: np.ndarray, w, seconds: dict, base: float) -> np.ndarray:
    time.sleep(seconds.get(os.getpid(), base) * len(ids) / BATCH)
    x = np.sin(np.outer(ids, np.arange(1, DIM + 1)) * 1e-3).astype(np.float32)
    y = x.sum(1, keepdims=True)
    (wv,) = read_variables([w])
    push_gradients([(w, x.T @ (x @ wv - y) / len(ids))])
    return ids


def sharded_step(it, w, seconds, base):
    return _train(next(it), w, seconds, base)


def fixed_step(it, w, seconds, base):
    ids = next(it, None)
    return os.getpid(), None if ids is None else _train(ids, w, seconds, base)


def repeat_step(it, w, seconds, base):
    return _train(next(it), w, seconds, base)


def shard_batches(ctx, shard_of_worker, repeat):
    """Worker i's own shard (shard_of_worker[i]) in batches, once or forever."""
    s = shard_of_worker[ctx.input_pipeline_id]
    lo = sum(SIZES[:s])
    ids = np.arange(lo, lo + SIZES[s])
    while True:
        for i in range(0, len(ids), BATCH):
            yield ids[i:i + BATCH]
        if not repeat:
            return


# -- the variants ---------------------------------------------------------------------------------
def run_sharded(coord, args):
    ds = coord.create_sharded_dataset(ShardedSource.from_arrays(
        np.arange(sum(SIZES)), shard_sizes=SIZES), BATCH)
    it = iter(ds)
    rvs = [coord.schedule(sharded_step, args=(it, *args)) for _ in range(ds.batches_per_epoch)]
    coord.join()
    return coord.fetch(rvs)


def run_fixed(coord, args, shard_of_worker):
    ds = coord.create_per_worker_dataset(
        functools.partial(shard_batches, shard_of_worker=shard_of_worker, repeat=False))
    it = iter(ds)
    done, seen, pending = set(), [], collections.deque()
    while len(done) < coord.num_workers:
        while len(pending) < 2 * coord.num_workers:
            pending.append(coord.schedule(fixed_step, args=(it, *args)))
        pid, ids = pending.popleft().fetch()
        (done.add(pid) if ids is None else seen.append(ids))
    coord.join()
    seen += [ids for pid, ids in coord.fetch(list(pending)) if ids is not None]
    return seen


def run_repeat(coord, args, shard_of_worker):
    ds = coord.create_per_worker_dataset(
        functools.partial(shard_batches, shard_of_worker=shard_of_worker, repeat=True))
    it = iter(ds)
    steps = sum(-(-n // BATCH) for n in SIZES)
    rvs = [coord.schedule(repeat_step, args=(it, *args)) for _ in range(steps)]
    coord.join()
    return coord.fetch(rvs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=20.0, help="a fast worker's ms per batch")
    p.add_argument("--slow", type=float, default=3.0, help="how much slower worker 0 is")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    base = args.step_ms / 1e3
    n = sum(SIZES)
    variants = {
        "sharded (late binding, exactly once)": lambda c, a: run_sharded(c, a),
        "fixed shards, slow worker on 1000": lambda c, a: run_fixed(c, a, (2, 1, 0)),
        "fixed shards, slow worker on 200": lambda c, a: run_fixed(c, a, (0, 1, 2)),
        "repeat, 90 steps (slow on 1000)": lambda c, a: run_repeat(c, a, (2, 1, 0)),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    coverage: dict[str, list[tuple[float, int]]] = {k: [] for k in variants}
    with LocalCluster(num_ps=1, num_workers=3) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        w = strategy.create_variable("w", initial_value=np.zeros((DIM, 1), np.float32),
                                     optimizer="sgd", optimizer_params={"learning_rate": 0.1})
        step_args = (w, {cluster.workers[0].pid: base * args.slow}, base)
        with ClusterCoordinator(strategy) as coord:
            run_sharded(coord, step_args)   # warm-up: connections, imports on the workers
            names = list(variants)
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    t0 = time.perf_counter()
                    seen = variants[name](coord, step_args)
                    times[name].append(time.perf_counter() - t0)
                    counts = collections.Counter(np.concatenate(seen).tolist())
                    coverage[name].append((len(counts) / n, max(counts.values())))
                print(f"round {r + 1}/{rounds}: "
                      + ", ".join(f"{v[-1]:.2f}" for v in times.values()) + " s",
                      file=sys.stderr, flush=True)
    ref = times[names[0]]
    rows = []
    for name in names:
        t = times[name]
        ratio = [a / b for a, b in zip(t, ref)]
        cov = min(c for c, _ in coverage[name])
        most = max(m for _, m in coverage[name])
        rows.append([name, f"{np.median(t):.2f} [{min(t):.2f}-{max(t):.2f}]",
                     f"{np.median(ratio):.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]",
                     f"{cov:.0%}", most])
    print_table(["one epoch, 3 workers (one 3x slower), shards 200/600/1000, batch 20",
                 "seconds", "x sharded (same round)", "coverage", "max"], rows,
                title=f"bench_data: {rounds} round(s), fast worker {args.step_ms:g} ms per batch, "
                      f"slow {args.step_ms * args.slow:g} ms")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "times": times, "coverage": coverage,
                               "step_ms": args.step_ms, "slow": args.slow, "sizes": SIZES,
                               "batch": BATCH})
    return 0


if __name__ == "__main__":
    sys.exit(main())
