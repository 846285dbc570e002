"""Gradient compression on the digits MLP: accuracy, speed and bytes per step.

Trains examples/digits.py's MLP (64 -> 64 -> 10) on one LocalCluster (2 ps,
2 workers by default), once per compression setting, with the same seeds and
data order: none, fp16, bf16 (emulated: no bytes saved), top-k 0.1, top-k
0.01. Prints a table of test accuracy, final loss, steps/s and the gradient
payload bytes each step pushes (values and sparse ids, per
``coordinator.compression.wire_nbytes``; framing not counted)::

    python -m bench.bench_compression            # Adam, 10 x 50 steps
    python -m bench.bench_compression --quick    # 4 x 50 steps
    python -m bench.bench_compression --optimizer sgd --lr 0.05
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
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
from coordinator.compression import TopK, wire_nbytes
from coordinator.fit import fit
from examples.digits import load_data
from examples.nn import MLP, make_train_step

SETTINGS = {"none": None, "fp16": "fp16", "bf16": "bf16",
            "topk(0.1)": TopK(0.1), "topk(0.01)": TopK(0.01)}



def train_digits(spec, compression, *, read_compression=None, name: str = "digits",
                 epochs: int = 4,
                 steps_per_epoch: int = 50, batch_size: int = 32, optimizer: str = "adam",
                 lr: float = 3e-3, seed: int = 0, data=None) -> dict:
    """Train the digits MLP on the cluster ``spec`` with ``compression``.

    Variables are named ``name/...`` (use a new name per run on one cluster:
    top-k residuals on the workers are kept per variable name)."""
    x_tr, y_tr, x_te, y_te = data if data is not None else load_data(seed)
    strategy = ParameterServerStrategy(
        spec, variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10,
                                                      max_shards=spec.cluster_spec().num_ps),
        gradient_compression=compression, read_compression=read_compression)
    model = MLP([64, 64, 10], loss="softmax_cross_entropy")
    model.create_variables(strategy, name, optimizer=optimizer,
                           optimizer_params={"learning_rate": lr}, seed=seed)
    step = make_train_step(model, compression=strategy.gradient_compression_spec,
                           read_compression=strategy.read_compression_spec)

    def dataset_fn(ctx):
        xs, ys = ctx.shard(x_tr, y_tr)
        return batches(xs, ys, batch_size=batch_size, seed=seed + ctx.input_pipeline_id)

    try:
        with ClusterCoordinator(strategy) as coord:
            t0 = time.perf_counter()
            history = fit(coord, step, dataset_fn, epochs=epochs,
                          steps_per_epoch=steps_per_epoch, verbose=0)
            elapsed = time.perf_counter() - t0
        params = read_variables(model.variables)
    finally:
        for v in strategy.variables:
            strategy.delete_variable(v)
    losses = [float(x) for x in history.step_history.get("loss", [])]
    acc = float(np.mean(model.predict(params, x_te).argmax(axis=1) == y_te))
    tail = max(1, len(losses) // 10)
    return {"test_accuracy": acc, "losses": losses,
            "first_loss": float(np.mean(losses[:tail])), "last_loss": float(np.mean(losses[-tail:])),
            "steps": len(losses), "steps_per_second": len(losses) / elapsed,
            "bytes_per_step": wire_nbytes(model.variables, strategy.gradient_compression_spec)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 epochs instead of 10")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--steps-per-epoch", type=int, default=50)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-ps", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated, from {list(SETTINGS)}")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    epochs = args.epochs or (4 if args.quick else 10)
    data = load_data(args.seed)
    rows = []
    with LocalCluster(num_ps=args.num_ps, num_workers=args.num_workers) as cluster:
        for i, label in enumerate(args.settings.split(",")):
            r = train_digits(cluster.spec, SETTINGS[label], name=f"bench{i}", epochs=epochs,
                             steps_per_epoch=args.steps_per_epoch, optimizer=args.optimizer,
                             lr=args.lr, seed=args.seed, data=data)
            r["setting"] = label
            rows.append(r)
            print(f"  {label}: done", file=sys.stderr, flush=True)
    base = rows[0]["bytes_per_step"]
    print(f"digits MLP 64-64-10, {args.optimizer} lr={args.lr}, {args.num_ps} ps, "
          f"{args.num_workers} workers, {epochs}x{args.steps_per_epoch} steps, seed {args.seed}")
    print(f"{'setting':<12}{'test acc':>9}{'loss first->last':>20}{'steps/s':>9}"
          f"{'bytes/step':>12}{'vs first':>9}")
    for r in rows:
        print(f"{r['setting']:<12}{r['test_accuracy']:>9.4f}"
              f"{r['first_loss']:>10.3f}->{r['last_loss']:<8.3f}{r['steps_per_second']:>9.1f}"
              f"{r['bytes_per_step']:>12d}{r['bytes_per_step'] / base:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "losses"} for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
