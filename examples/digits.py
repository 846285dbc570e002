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
tf_config`` in docker-compose.yml and deploy/. It deletes the variables it
made on the parameter servers when it ends, so it can run again against the
same servers.

Training runs through ``coordinator.fit.fit``: a progress bar on a terminal
(periodic lines on stderr otherwise), one line per epoch, validation on the
test split after each epoch (``val_loss``, ``val_accuracy``). With a local
cluster it writes the loss curve into a directory of its own per run,
``runs/digits/<YYYYmmdd-HHMMSS>-<pid>/loss.png`` (when it started, its
process), so runs side by side keep their own, and prints where (``--plot
PATH`` elsewhere, ``--no-plot`` for none); with ``--cluster tf_config`` it
writes nothing to disk unless given ``--plot PATH`` (e.g. on the
/checkpoints volume: the image's working directory is read-only to its user).
``--checkpoint-dir DIR`` saves a checkpoint after every epoch and, when DIR
already holds one, resumes from it (the epochs done are not trained again).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time

if __package__ in (None, ""):   # run as a script: make the repo importable (here and on workers)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from coordinator import (
    CheckpointCallback,
    CheckpointManager,
    ClusterCoordinator,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    TFConfigClusterResolver,
    batches,
    read_variables,
)
from coordinator.fit import fit
from coordinator.local import description, plural, run_main
from coordinator.plots import try_plot_history
from examples.nn import LOSSES, MLP, make_train_step

#: Where runs with a local cluster keep their files: a directory per run under it.
RUNS_DIR = os.path.join("runs", "digits")


def default_plot_path(root: str = RUNS_DIR, started: float | None = None) -> str:
    """``<root>/<YYYYmmdd-HHMMSS>-<pid>/loss.png``: this run's loss curve, in a
    directory of its own named by when the run started (``started``, a
    ``time.time()``; default now) and this process, which this creates
    (exclusively: a name already taken, e.g. a second run in the same second
    of one process, gets ``-2``, ``-3``...), so two runs never write the
    same file."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}-{os.getpid()}"
    for n in itertools.count(1):
        run_dir = os.path.join(root, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.makedirs(run_dir)
        except FileExistsError:
            continue
        return os.path.join(run_dir, "loss.png")


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
    p = argparse.ArgumentParser(description=description(__doc__))
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
    p.add_argument("--plot", metavar="PATH", default=None,
                   help=f"write the loss curve PNG there (default with a local cluster: "
                        f"a new {os.path.join(RUNS_DIR, 'YYYYmmdd-HHMMSS-PID', 'loss.png')} "
                        "per run; with tf_config: none)")
    p.add_argument("--no-plot", action="store_true", help="write no loss curve")
    p.add_argument("--replication", action="store_true",
                   help="keep a second copy of every shard on another parameter server "
                        "(2 or more): losing one loses no update and training goes on "
                        "(the compose and Kubernetes jobs run this way)")
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="save a checkpoint there after every epoch (the 3 latest kept) and, "
                        "when DIR already holds one, resume from it; every parameter server "
                        "must see DIR at this path under its --checkpoint-dir (a local "
                        "cluster's servers take the current and the temporary directory)")
    p.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                   help="1: progress bar (terminal) or periodic lines, and epoch lines; "
                        "2: epoch lines only; 0: quiet")
    args = p.parse_args(argv)
    plot_default = not args.no_plot and not args.plot and args.cluster == "local"
    started = time.time()
    plot_path = None if args.no_plot else args.plot

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
              f"{spec.num_ps} ps, {plural(spec.num_workers, 'worker')}, {total} steps", flush=True)
        strategy = ParameterServerStrategy(
            resolver, variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10,
                                                              max_shards=spec.num_ps),
            replication=args.replication)
        if args.cluster == "tf_config":   # leave the shared servers as we found them
            stack.callback(lambda: [strategy.delete_variable(v) for v in strategy.variables])
        model.create_variables(strategy, "digits", optimizer="adam",
                               optimizer_params={"learning_rate": args.lr}, seed=args.seed)
        train_step = make_train_step(model)
        batch_size, seed = args.batch_size, args.seed
        callbacks, initial_epoch = [], 0
        if args.checkpoint_dir:
            manager = CheckpointManager(strategy, args.checkpoint_dir, max_to_keep=3)
            state = manager.restore_or_initialize()
            if state is not None:
                initial_epoch = min(int(state["extra"].get("epoch", 0)), args.epochs)
                print(f"resumed from {manager.latest()} (epoch {initial_epoch} of "
                      f"{args.epochs} done)", flush=True)
            callbacks.append(CheckpointCallback(manager))

        def dataset_fn(ctx):   # runs on every worker: its shard of the training set
            xs, ys = ctx.shard(x_tr, y_tr)
            return batches(xs, ys, batch_size=batch_size, seed=seed + ctx.input_pipeline_id)

        def validate(epoch):   # on the coordinator, after each epoch's join()
            logits = model.predict(read_variables(model.variables), x_te)
            return {"loss": LOSSES[model.loss](logits, y_te)[0],
                    "accuracy": float(np.mean(logits.argmax(axis=1) == y_te))}

        with ClusterCoordinator(strategy) as coord:
            t0 = time.perf_counter()
            history = fit(coord, train_step, dataset_fn, epochs=args.epochs,
                          steps_per_epoch=args.steps_per_epoch, validation_fn=validate,
                          verbose=args.verbose, callbacks=callbacks,
                          initial_epoch=initial_epoch)
            elapsed = time.perf_counter() - t0
        params = read_variables(model.variables)
    losses = list(history.step_history.get("loss", []))
    plot = None
    if plot_default:   # picked now: a run that ends early leaves no empty directory
        plot_path = default_plot_path(started=started)
    if plot_path:
        plot, message = try_plot_history(history, plot_path,
                                         title=f"digits: MLP {model.sizes}, {spec.num_ps} ps, "
                                               f"{plural(spec.num_workers, 'worker')}")
        print(message, flush=True)
        if plot is None and plot_default:   # nothing written (no matplotlib): no empty run dir
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(plot_path))
    test_acc = accuracy(model, params, x_te, y_te)
    train_acc = accuracy(model, params, x_tr, y_tr)
    if args.checkpoint_dir:
        print(f"checkpoints in {os.path.abspath(args.checkpoint_dir)}", flush=True)
    print(f"test accuracy: {test_acc:.4f}", flush=True)
    return {"test_accuracy": test_acc, "train_accuracy": train_acc, "losses": losses,
            "steps": len(losses), "seconds": elapsed, "steps_per_second": len(losses) / elapsed,
            "history": history.history, "plot": plot}


if __name__ == "__main__":
    sys.exit(run_main(main))   # Ctrl-C: one line, the tasks stopped, exit status 130
