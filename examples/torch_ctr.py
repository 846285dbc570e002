"""Click-through rate in PyTorch on parameter servers: examples/ctr.py's
DLRM written as a ``torch.nn.Module`` whose 26 features' embeddings are a
dynamic table (``DynamicEmbeddingModule``, coordinator/torch_tables.py).

The same data (coordinator/ctr_data.py), table (admitted on a key's 2nd
look-up, at most 4M rows, Adagrad) and dense layers as examples/ctr.py,
starting from the same weights (its numpy model's Glorot draws), so both
reach the same AUC after the same steps; here autograd computes the
gradients. ``TorchModelBridge`` keeps the dense layers on the servers
(Adagrad there too); each worker step pulls them and the batch's rows in
one call per server, runs forward and backward, and pushes the dense and
row gradients in one more (asynchronous training). AUC on held-out batches
(look-ups without admission: ``module.eval()``) after each epoch::

    pip install torch --index-url https://download.pytorch.org/whl/cpu
    pip install -e ".[torch,examples]"
    python examples/torch_ctr.py
    python -m examples.torch_ctr --epochs 2 --steps-per-epoch 100 --num-workers 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):   # run as a script: make the repo importable (here and on workers)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from coordinator.local import import_torch

torch = import_torch("examples/torch_ctr.py", __name__ == "__main__")
import torch.nn.functional as F
from torch import nn

from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
from coordinator import ctr_data as D
from coordinator.fit import fit
from coordinator.local import description, plural, run_main
from coordinator.torch_bridge import TorchModelBridge
from coordinator.torch_tables import DynamicEmbeddingModule
from examples import ctr
from examples import dlrm as M

_P0, _P1 = np.triu_indices(M.NUM_SPARSE + 1, k=1)   # examples/dlrm.py's pairs, in its order
UPPER = torch.from_numpy(_P0 * (M.NUM_SPARSE + 1) + _P1)


class DLRM(nn.Module):
    """examples/dlrm.py's model: bottom MLP 13 -> 64 -> DIM, the 26 rows of
    ``table``, pairwise dots of the 27 vectors (upper triangle) and the
    bottom output, top MLP -> 1 logit. ``seed``: start from the numpy
    model's weights (M.init_params)."""

    def __init__(self, table, seed: int = 0):
        super().__init__()
        self.bottom = nn.ModuleList(nn.Linear(a, b) for a, b in zip(M.BOTTOM, M.BOTTOM[1:]))
        self.top = nn.ModuleList(nn.Linear(a, b) for a, b in zip(M.TOP, M.TOP[1:]))
        self.emb = DynamicEmbeddingModule(table)
        params = M.init_params(seed)
        with torch.no_grad():
            for part in ("bottom", "top"):
                for i, layer in enumerate(getattr(self, part)):
                    layer.weight.copy_(torch.from_numpy(params[f"{part}{i}/w"].T))
                    layer.bias.copy_(torch.from_numpy(params[f"{part}{i}/b"]))

    def forward(self, dense: torch.Tensor, ids) -> torch.Tensor:
        x = dense
        for layer in self.bottom:
            x = F.relu(layer(x))
        z = torch.cat([x[:, None, :], self.emb(ids)], 1)                 # (n, 27, DIM)
        dots = torch.bmm(z, z.transpose(1, 2)).flatten(1)[:, UPPER]       # (n, 351)
        y = torch.cat([dots, x], 1)
        y = F.relu(self.top[0](y))
        return self.top[1](y)[:, 0]


def make_train_step(bridge: TorchModelBridge):
    """The step run on the workers: pull (dense layers and the batch's rows,
    one call per server), forward and backward, push (one call per server)."""
    def train_step(iterator):
        b = next(iterator)
        with bridge.local_module() as m:
            bridge.pull(m, embedding_ids={"emb": b.sparse})
            loss = F.binary_cross_entropy_with_logits(
                m(torch.from_numpy(b.dense), b.sparse), torch.from_numpy(b.labels).float())
            loss.backward()
            bridge.push(m)
        return float(loss)
    return train_step


def evaluate(bridge: TorchModelBridge, seed: int, batches: int, size: int) -> dict:
    """AUC and loss on the held-out batches (stream seed + 1), nothing admitted."""
    m = bridge.build_module().eval()
    bridge.pull(m)
    labels, scores, losses = [], [], []
    with torch.no_grad():
        for i in range(batches):
            b = D.batch(seed + 1, i, size)
            logits = m(torch.from_numpy(b.dense), b.sparse)
            losses.append(float(F.binary_cross_entropy_with_logits(
                logits, torch.from_numpy(b.labels).float())))
            labels.append(b.labels)
            scores.append(logits.numpy())
    return {"auc": D.auc(np.concatenate(labels), np.concatenate(scores)),
            "loss": float(np.mean(losses))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps-per-epoch", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.1, help="Adagrad's learning rate")
    p.add_argument("--num-ps", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1)
    args = p.parse_args(argv)
    seed, size = args.seed, args.batch_size
    with LocalCluster(num_ps=args.num_ps, num_workers=args.num_workers) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        table = ctr.shared_table(strategy, seed, args.lr)
        bridge = TorchModelBridge(strategy, DLRM(table, seed), name_prefix="ctr",
                                  optimizer="adagrad", optimizer_params={"learning_rate": args.lr})
        print(f"torch_ctr: DLRM in PyTorch ({M.num_params()} dense parameters, embeddings of "
              f"{M.DIM} in a dynamic table), {args.num_ps} ps, "
              f"{plural(args.num_workers, 'worker')}, batch {size}", flush=True)

        def dataset_fn(ctx):   # on every worker: its own batches of the stream
            return D.shard(seed, ctx.input_pipeline_id, ctx.num_input_pipelines, size)

        marks = []
        with ClusterCoordinator(strategy) as coord:
            marks.append(time.perf_counter())
            history = fit(coord, make_train_step(bridge), dataset_fn, epochs=args.epochs,
                          steps_per_epoch=args.steps_per_epoch, verbose=args.verbose,
                          validation_fn=lambda epoch: (marks.append(time.perf_counter()),
                                                       evaluate(bridge, seed, args.eval_batches,
                                                                size))[1])
        stats = table.stats()
    rates = [args.steps_per_epoch * size / (b - a) for a, b in zip(marks, marks[1:])]
    aucs = history.history["val_auc"]
    for epoch, (auc, rate) in enumerate(zip(aucs, rates), 1):
        print(f"epoch {epoch}: AUC {auc:.4f}, {rate:,.0f} samples/s", flush=True)
    print(f"table: {stats.rows:,} rows; test AUC: {aucs[-1]:.4f}", flush=True)
    return {"auc": aucs[-1], "aucs": aucs, "rows": stats.rows,
            "samples_per_second": float(np.median(rates))}


if __name__ == "__main__":
    sys.exit(run_main(main))   # Ctrl-C: one line, the tasks stopped, exit status 130
