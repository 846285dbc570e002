"""An embedding-bag classifier: a sharded embedding table with sparse updates.

Each example is a bag of token ids; the model looks up their rows in a
20,000 x 16 embedding table, averages them, and a logistic head says whether
the bag holds more "positive" than "negative" tokens (two hidden random
subsets of the vocabulary). The table (1.28 MB) is split over two parameter
servers by ``MinSizePartitioner``; workers fetch only the rows they need
(``table.gather``) and push row gradients back (``table.push_sparse``, with
Adagrad, the usual choice for embeddings). The small head uses Adam.

The default run (600 steps of 64 bags, under 2 epochs) reaches about 0.87
held-out accuracy (chance, always answering the majority class: ~0.58); the
tests require >= 0.80. Rare tokens are seen too seldom to learn, which caps
accuracy below 1::

    python examples/embedding_bag.py
    python -m examples.embedding_bag --steps 1000 --num-workers 4
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
    IndexedSlices,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    batches,
    push_gradients,
    read_variables,
)
from coordinator.local import description, run_main
from examples.nn import dense, dense_backward, sigmoid_cross_entropy


def make_data(n: int, vocab: int = 20_000, bag: int = 20, seed: int = 0, split: int = 0,
              zipf: float = 1.0):
    """(ids (n, bag) int64, labels (n,) float32, token_sign (vocab,)) from a fixed seed.

    Token frequencies follow a Zipf-like law over a shuffled vocabulary. A
    hidden quarter of the vocabulary is positive (+1), another quarter
    negative (-1); the label is 1 when a bag's positive tokens outnumber its
    negative ones. Bags with a tie are dropped, so labels are unambiguous.
    The hidden token signs depend on ``seed`` only; the bags on ``seed`` and
    ``split`` (use 0 for training, 1 for held-out data).
    """
    rng = np.random.default_rng(seed)
    sign = rng.permutation(np.repeat([1, -1, 0, 0], vocab // 4 + 1)[:vocab])
    freq = 1.0 / np.arange(1, vocab + 1) ** zipf
    prob = rng.permutation(freq / freq.sum())
    rng = np.random.default_rng([seed, split])
    ids = rng.choice(vocab, size=(2 * n, bag), p=prob)
    score = sign[ids].sum(axis=1)
    keep = np.nonzero(score != 0)[0][:n]
    return ids[keep].astype(np.int64), (score[keep] > 0).astype(np.float32), sign


def forward(table_rows, w, b):
    """table_rows (batch, bag, dim) -> pooled (batch, dim), logits (batch, 1)."""
    pooled = table_rows.mean(axis=1)
    return pooled, dense(pooled, w, b)


def loss_and_grads(rows, w, b, labels):
    """(mean loss, d rows, d w, d b) for bags of rows (batch, bag, dim)."""
    pooled, logits = forward(rows, w, b)
    loss, dlogits = sigmoid_cross_entropy(logits, labels[:, None])
    dpooled, dw, db = dense_backward(dlogits, pooled, w)
    # d(mean over the bag)/d(row) = 1/bag for every position of the bag.
    drows = np.repeat(dpooled[:, None, :] / rows.shape[1], rows.shape[1], axis=1)
    return loss, drows, dw, db


def make_train_step(table, w_var, b_var):
    """A step: gather the bag rows, mean-pool, logistic loss, push sparse + dense grads."""

    def train_step(iterator):
        ids, labels = next(iterator)
        # One call per parameter server for the rows needed (batch, bag, dim) and the head.
        rows, w, b = read_variables([table.lookup(ids), w_var, b_var])
        loss, drows, dw, db = loss_and_grads(rows, w, b, labels)
        # And one for the row-wise gradient (duplicate ids summed) with the head's.
        push_gradients([(table, IndexedSlices(drows.reshape(-1, drows.shape[-1]), ids.ravel())),
                        (w_var, dw), (b_var, db)])
        return loss

    return train_step


def evaluate(table, w_var, b_var, ids, labels) -> tuple[float, float]:
    """(loss, accuracy) of the current model on (ids, labels), on the coordinator."""
    w, b = read_variables([w_var, b_var])
    _, logits = forward(table.gather(ids), w, b)
    loss, _ = sigmoid_cross_entropy(logits, labels[:, None])
    return loss, float(np.mean((logits[:, 0] > 0) == (labels > 0.5)))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--bag", type=int, default=20)
    p.add_argument("--train-examples", type=int, default=20_000)
    p.add_argument("--test-examples", type=int, default=2_000)
    p.add_argument("--num-ps", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.3, help="Adagrad learning rate of the table")
    # Row gradients are small (mean over a bag of 20, mean over a batch of 64):
    # Keras' default initial accumulator (0.1) would shrink the first steps
    # of every row ~100x, so start it lower.
    p.add_argument("--init-accumulator", type=float, default=1e-3,
                   help="Adagrad initial_accumulator_value of the table")
    p.add_argument("--head-lr", type=float, default=1e-2, help="Adam learning rate of the head")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    ids_tr, y_tr, _ = make_data(args.train_examples, args.vocab, args.bag, args.seed, split=0)
    ids_te, y_te, _ = make_data(args.test_examples, args.vocab, args.bag, args.seed, split=1)
    print(f"embedding bag: vocab {args.vocab} x dim {args.dim}, bags of {args.bag}, "
          f"{len(ids_tr)} train / {len(ids_te)} test bags ({y_te.mean():.0%} positive)", flush=True)

    with LocalCluster(num_ps=args.num_ps, num_workers=args.num_workers) as cluster:
        strategy = ParameterServerStrategy(
            cluster.spec, variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10,
                                                                  max_shards=args.num_ps))
        rng = np.random.default_rng(args.seed)
        init = rng.uniform(-0.05, 0.05, (args.vocab, args.dim)).astype(np.float32)  # as Keras' Embedding
        table = strategy.create_variable(
            "embedding/table", initial_value=init, optimizer="adagrad",
            optimizer_params={"learning_rate": args.lr,
                              "initial_accumulator_value": args.init_accumulator})
        head = dict(optimizer="adam", optimizer_params={"learning_rate": args.head_lr})
        w_var = strategy.create_variable("head/kernel", (args.dim, 1), initializer="glorot_uniform",
                                         seed=args.seed, **head)
        b_var = strategy.create_variable("head/bias", (1,), initializer="zeros", **head)
        layout = ", ".join(f"rows {s.offset}:{s.offset + s.rows} on {s.address}" for s in table.shards)
        print(f"table {table.shape} {table.nbytes / 1e6:.2f} MB in {table.num_shards} shards: {layout}",
              flush=True)

        train_step = make_train_step(table, w_var, b_var)
        batch_size, seed = args.batch_size, args.seed

        def dataset_fn(ctx):   # runs on every worker: its shard of the training bags
            ids, labels = ctx.shard(ids_tr, y_tr)
            return batches(ids, labels, batch_size=batch_size, seed=seed + ctx.input_pipeline_id)

        loss0, acc0 = evaluate(table, w_var, b_var, ids_te, y_te)
        print(f"step     0/{args.steps}  test loss {loss0:.4f}  test_acc {acc0:.4f}", flush=True)
        with ClusterCoordinator(strategy) as coord:
            it = iter(coord.create_per_worker_dataset(dataset_fn))
            losses: list[float] = []
            every = max(1, args.steps // 6)
            t0 = time.perf_counter()
            for start in range(0, args.steps, every):
                n = min(every, args.steps - start)
                results = [coord.schedule(train_step, args=(it,)) for _ in range(n)]
                coord.join()
                losses += coord.fetch(results)
                loss, acc = evaluate(table, w_var, b_var, ids_te, y_te)
                print(f"step {len(losses):5d}/{args.steps}  loss {np.mean(losses[-n:]):.4f}  "
                      f"test loss {loss:.4f}  test_acc {acc:.4f}  "
                      f"steps/s {len(losses) / (time.perf_counter() - t0):.1f}", flush=True)
            elapsed = time.perf_counter() - t0
        test_loss, test_acc = evaluate(table, w_var, b_var, ids_te, y_te)
        _, train_acc = evaluate(table, w_var, b_var, ids_tr, y_tr)
        shards = [(s.address, s.offset, s.rows) for s in table.shards]
    print(f"held-out accuracy: {test_acc:.4f} (train {train_acc:.4f}, chance {max(y_te.mean(), 1 - y_te.mean()):.4f})",
          flush=True)
    return {"test_accuracy": test_acc, "train_accuracy": train_acc, "test_loss": test_loss,
            "losses": losses, "steps": len(losses), "num_shards": len(shards), "shards": shards,
            "seconds": elapsed}


if __name__ == "__main__":
    sys.exit(run_main(main))   # Ctrl-C: one line, the tasks stopped, exit status 130
