"""Regression with an MLP on parameter servers: the tf.distribute "hello world".

Dense(64, relu) -> Dense(64, relu) -> Dense(1) on 1,000 synthetic examples,
mean squared error, Adam. Two parameter servers hold the variables; two
workers run the steps asynchronously::

    python examples/regression.py --steps 300
    python -m examples.regression --num-workers 4
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):   # run as a script: make the repo importable (here and on workers)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from coordinator import (
    ClusterCoordinator,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    batches,
    read_variables,
)
from coordinator.local import description, plural, run_main
from examples.nn import MLP, make_train_step


def make_data(n: int = 1000, features: int = 10, seed: int = 0):
    """y = x @ w + 0.5 sin(2 x0) + 0.3 x1 x2 + noise, as float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    w = rng.standard_normal(features) / np.sqrt(features)
    y = x @ w + 0.5 * np.sin(2 * x[:, 0]) + 0.3 * x[:, 1] * x[:, 2]
    y += 0.05 * rng.standard_normal(n)
    return x, y.astype(np.float32)[:, None]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-ps", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    x, y = make_data(seed=args.seed)
    model = MLP([x.shape[1], 64, 64, 1], loss="mse")

    with LocalCluster(num_ps=args.num_ps, num_workers=args.num_workers) as cluster:
        strategy = ParameterServerStrategy(
            cluster.spec, variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10,
                                                                  max_shards=args.num_ps))
        model.create_variables(strategy, "regression", optimizer="adam",
                               optimizer_params={"learning_rate": args.lr}, seed=args.seed)
        train_step = make_train_step(model)

        def full_loss() -> float:   # on the coordinator, over the whole data set
            return model.loss_and_grads(read_variables(model.variables), x, y)[0]

        initial_loss = full_loss()
        print(f"regression: {len(x)} examples, {args.num_ps} ps, "
              f"{plural(args.num_workers, 'worker')}, "
              f"initial loss {initial_loss:.4f}", flush=True)

        with ClusterCoordinator(strategy) as coord:
            batch_size, seed = args.batch_size, args.seed

            def dataset_fn(ctx):    # runs on each worker: its shard of the data
                xs, ys = ctx.shard(x, y)
                return batches(xs, ys, batch_size=batch_size, seed=seed + ctx.input_pipeline_id)

            it = iter(coord.create_per_worker_dataset(dataset_fn))
            t0 = time.perf_counter()
            every = max(1, args.steps // 5)
            losses: list[float] = []
            for start in range(0, args.steps, every):
                n = min(every, args.steps - start)
                results = [coord.schedule(train_step, args=(it,)) for _ in range(n)]
                coord.join()
                losses += coord.fetch(results)
                print(f"step {start + n:5d}/{args.steps}  batch loss {np.mean(losses[-n:]):.4f}  "
                      f"full loss {full_loss():.4f}  steps/s {len(losses) / (time.perf_counter() - t0):.1f}",
                      flush=True)
        final_loss = full_loss()
    print(f"final loss: {final_loss:.4f} (initial {initial_loss:.4f})", flush=True)
    return {"initial_loss": initial_loss, "final_loss": final_loss, "losses": losses,
            "steps": len(losses)}


if __name__ == "__main__":
    sys.exit(run_main(main))   # Ctrl-C: one line, the tasks stopped, exit status 130
