"""Handwritten digits on parameter servers: the project's main example.

scikit-learn's 8x8 digits (1,797 images, shipped with the package), features
standardized on the training split, an MLP 64 -> 64 (relu) -> 10 (softmax)
trained with Adam by asynchronous workers, each reading its own shard of the
training set. Test accuracy is measured on the coordinator after each epoch::

    python examples/digits.py
    python -m examples.digits --epochs 20 --num-workers 4

By default (``--cluster local``) it starts its own LocalCluster. With
``--cluster tf_config`` it trains on the running cluster that TF_CONFIG /
TF_CONFIG_FILE describe instead (``--num-ps``/``--num-workers`` are then
ignored), as the chief: ``coordinator run examples/digits.py --cluster
tf_config`` in docker-compose.yml and deploy/. It writes nothing to disk, and
deletes the variables it made on the parameter servers when it ends, so it
can run again against the same servers.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

if __package__ in (None, ""):   # run as a script: make the repo importable (here and on workers)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from coordinator import (ClusterCoordinator, LocalCluster, MinSizePartitioner,
                         ParameterServerStrategy, TFConfigClusterResolver, batches,
                         read_variables)
from examples.nn import MLP, make_train_step


def load_data(seed: int = 0, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test): float32 features standardized on train."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                              stratify=y)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
    std[std == 0] = 1.0                       # a few border pixels are always 0
    f32 = lambda a: ((a - mean) / std).astype(np.float32)
    return f32(x_tr), y_tr.astype(np.int64), f32(x_te), y_te.astype(np.int64)


def accuracy(model: MLP, params, x, y) -> float:
    return float(np.mean(model.predict(params, x).argmax(axis=1) == y))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--steps-per-epoch", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-ps", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster", choices=("local", "tf_config"), default="local",
                   help="local: start a LocalCluster (default); tf_config: use the running "
                        "cluster in TF_CONFIG / TF_CONFIG_FILE")
    args = p.parse_args(argv)

    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    model = MLP([64, 64, 10], loss="softmax_cross_entropy")
    total = args.epochs * args.steps_per_epoch

    with contextlib.ExitStack() as stack:
        if args.cluster == "local":
            cluster = stack.enter_context(LocalCluster(num_ps=args.num_ps,
                                                       num_workers=args.num_workers))
            resolver = cluster.spec
        else:
            resolver = TFConfigClusterResolver()
        spec = resolver.cluster_spec()
        print(f"digits: {len(x_tr)} train / {len(x_te)} test images, MLP {model.sizes}, "
              f"{spec.num_ps} ps, {spec.num_workers} workers, {total} steps", flush=True)
        strategy = ParameterServerStrategy(
            resolver, variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10,
                                                              max_shards=spec.num_ps))
        if args.cluster == "tf_config":   # leave the shared servers as we found them
            stack.callback(lambda: [strategy.delete_variable(v) for v in strategy.variables])
        model.create_variables(strategy, "digits", optimizer="adam",
                               optimizer_params={"learning_rate": args.lr}, seed=args.seed)
        train_step = make_train_step(model)
        batch_size, seed = args.batch_size, args.seed

        def dataset_fn(ctx):   # runs on every worker: its shard of the training set
            xs, ys = ctx.shard(x_tr, y_tr)
            return batches(xs, ys, batch_size=batch_size, seed=seed + ctx.input_pipeline_id)

        with ClusterCoordinator(strategy) as coord:
            it = iter(coord.create_per_worker_dataset(dataset_fn))
            losses: list[float] = []
            t0 = time.perf_counter()
            for epoch in range(1, args.epochs + 1):
                results = [coord.schedule(train_step, args=(it,))
                           for _ in range(args.steps_per_epoch)]
                coord.join()
                losses += coord.fetch(results)
                acc = accuracy(model, read_variables(model.variables), x_te, y_te)
                rate = len(losses) / (time.perf_counter() - t0)
                print(f"epoch {epoch}/{args.epochs}  steps {len(losses)}/{total}  "
                      f"loss {np.mean(losses[-args.steps_per_epoch:]):.4f}  test_acc {acc:.4f}  "
                      f"steps/s {rate:.1f}  workers {coord.workers_alive()}", flush=True)
            elapsed = time.perf_counter() - t0
        params = read_variables(model.variables)
    test_acc = accuracy(model, params, x_te, y_te)
    train_acc = accuracy(model, params, x_tr, y_tr)
    print(f"test accuracy: {test_acc:.4f}", flush=True)
    return {"test_accuracy": test_acc, "train_accuracy": train_acc, "losses": losses,
            "steps": len(losses), "seconds": elapsed, "steps_per_second": len(losses) / elapsed}


if __name__ == "__main__":
    main()
