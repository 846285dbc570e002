"""Handwritten digits with a PyTorch CNN, trained on parameter servers.

The same data and split as examples/digits.py (scikit-learn's 8x8 digits,
standardized on the training split), but the model is a ``torch.nn.Module``::

    Conv2d(1, 16, 3) -> ReLU -> MaxPool2d(2) -> Flatten -> Linear(144, 64) -> ReLU -> Linear(64, 10)

bound to the parameter servers by ``coordinator.torch_bridge.TorchModelBridge``
(one variable per parameter, Adam on the servers). Each worker step takes a
batch of its shard of the training set, pulls the parameters into its own
copy of the module, runs forward and backward with autograd, and pushes the
gradients. Test accuracy is measured on the coordinator after each epoch.
Needs the ``torch`` and ``examples`` extras, with PyTorch's CPU build
installed first (PyPI's default Linux build brings GB of CUDA libraries)::

    pip install torch --index-url https://download.pytorch.org/whl/cpu
    pip install -e ".[torch,examples]"
    python examples/torch_digits.py
    python -m examples.torch_digits --epochs 10 --num-workers 4

``--cluster tf_config`` trains on the running cluster that TF_CONFIG /
TF_CONFIG_FILE describe (as examples/digits.py does), and deletes the
variables it made when it ends.
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

from coordinator.local import import_torch

torch = import_torch("examples/torch_digits.py", __name__ == "__main__")
import torch.nn.functional as F
from torch import nn

from coordinator import (
    ClusterCoordinator,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    TFConfigClusterResolver,
    batches,
)
from coordinator.local import description, plural, run_main
from coordinator.torch_bridge import TorchModelBridge
from examples.digits import load_data


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),                 # (batch, 64) -> (batch, 1, 8, 8)
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),   # -> (batch, 16, 3, 3)
        nn.Flatten(),
        nn.Linear(16 * 3 * 3, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def make_train_step(bridge: TorchModelBridge):
    """A step for ``schedule(step, args=(iterator,))``: it captures only the
    bridge (variable handles and the module's weightless skeleton)."""

    def train_step(iterator):
        x, y = next(iterator)
        with bridge.local_module() as model:       # this worker's copy (built once)
            bridge.pull(model)                      # one read per parameter server
            loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            bridge.push(model)                      # one push per parameter server
        return loss.item()

    return train_step


@torch.no_grad()
def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    return float((model(torch.from_numpy(x)).argmax(dim=1).numpy() == y).mean())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("--epochs", type=int, default=8)
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
    torch.manual_seed(args.seed)
    model = make_model()                            # the coordinator's copy (initial values, eval)
    n_params = sum(q.numel() for q in model.parameters())
    total = args.epochs * args.steps_per_epoch

    with contextlib.ExitStack() as stack:
        if args.cluster == "local":
            cluster = stack.enter_context(LocalCluster(num_ps=args.num_ps,
                                                       num_workers=args.num_workers))
            resolver = cluster.spec
        else:
            resolver = TFConfigClusterResolver()
        spec = resolver.cluster_spec()
        print(f"torch digits: {len(x_tr)} train / {len(x_te)} test images, CNN with "
              f"{n_params} parameters, {spec.num_ps} ps, {plural(spec.num_workers, 'worker')}, "
              f"{total} steps", flush=True)
        strategy = ParameterServerStrategy(
            resolver, variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10,
                                                              max_shards=spec.num_ps))
        bridge = TorchModelBridge(strategy, model, optimizer="adam",
                                  optimizer_params={"learning_rate": args.lr},
                                  name_prefix="torch_digits")
        if args.cluster == "tf_config":   # leave the shared servers as we found them
            stack.callback(bridge.delete_variables, strategy)
        train_step = make_train_step(bridge)
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
                bridge.pull(model)
                acc = accuracy(model, x_te, y_te)
                rate = len(losses) / (time.perf_counter() - t0)
                print(f"epoch {epoch}/{args.epochs}  steps {len(losses)}/{total}  "
                      f"loss {np.mean(losses[-args.steps_per_epoch:]):.4f}  test_acc {acc:.4f}  "
                      f"steps/s {rate:.1f}  workers {coord.workers_alive()}", flush=True)
            elapsed = time.perf_counter() - t0
        bridge.pull(model)
    test_acc = accuracy(model, x_te, y_te)
    train_acc = accuracy(model, x_tr, y_tr)
    print(f"test accuracy: {test_acc:.4f}", flush=True)
    return {"test_accuracy": test_acc, "train_accuracy": train_acc, "losses": losses,
            "steps": len(losses), "seconds": elapsed, "steps_per_second": len(losses) / elapsed}


if __name__ == "__main__":
    sys.exit(run_main(main))   # Ctrl-C: one line, the tasks stopped, exit status 130
