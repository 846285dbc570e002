"""TensorFlow's MultiWorkerMirroredStrategy on bench.suite's MLP: the reference of all-reduce mode.

    python -m bench.tf_mwms --workers 4 [--hosts] [--steps 30] [--rounds 3]

``n`` processes, one ``tf.distribute.MultiWorkerMirroredStrategy`` worker
each (TF_CONFIG, plain gRPC), collectives by ``CommunicationImplementation.
RING`` on CPU: the MLP 784-512-512-10 (ReLU, softmax cross-entropy) of
bench.suite's (a), batch 128 per replica from the same generated data
(``bench.suite.mlp_data``, worker i's stream), plain SGD: each replica's
gradients averaged by ``ReplicaContext.all_reduce(MEAN)`` (one batched
all-reduce), then ``assign_sub``. Threads as bench/tf_reference.py's (one
intra-op thread, two inter-op: a collective needs one while the step
waits). Every worker runs a warm-up block and then ``--rounds`` timed
blocks of ``--steps`` global steps; worker 0 reports steps/s per block.
``--hosts``: each worker on a test host of its own (bench/hosts.py; root).
``bench.bench_allreduce_training --tf`` runs this beside ours.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

#: The port each worker listens on, on a test host of its own (one host: free ports).
HOST_PORT = 24680
RESULT = "@@"


def worker_main(args: argparse.Namespace) -> int:
    """One MWMS worker: build, warm up, time blocks; worker 0 prints the rates."""
    workers = json.loads(args.cluster)
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                          "task": {"type": "worker", "index": args.index}})
    from bench.tf_reference import _import_tf
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", "2")
    tf = _import_tf()
    import numpy as np

    from bench.suite import MLP_BATCH, MLP_EXAMPLES, MLP_SIZES, SEED, mlp_data
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    sizes, lr = list(MLP_SIZES), 0.01
    with strategy.scope():
        params = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            rng = np.random.default_rng(SEED + 1000 * i)
            limit = np.sqrt(6.0 / (a + b))
            params.append(tf.Variable(rng.uniform(-limit, limit, (a, b)).astype(np.float32)))
            params.append(tf.Variable(np.zeros(b, np.float32)))

    def dataset_fn(ctx):
        x, y = mlp_data(MLP_EXAMPLES, SEED, ctx.input_pipeline_id)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(
            MLP_BATCH, drop_remainder=True).cache().repeat()
    it = iter(strategy.distribute_datasets_from_function(dataset_fn))

    @tf.function
    def train_step(iterator):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                h = x
                for i in range(0, len(params), 2):
                    h = tf.matmul(h, params[i]) + params[i + 1]
                    if i + 2 < len(params):
                        h = tf.nn.relu(h)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
            grads = tape.gradient(loss, params)
            grads = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.MEAN, grads)
            for p, g in zip(params, grads):
                p.assign_sub(lr * g)
            return loss
        return strategy.run(step_fn, args=next(iterator))

    rates = []
    for block in range(args.rounds + 1):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = train_step(it)
        float(strategy.reduce(tf.distribute.ReduceOp.MEAN, loss, axis=None))   # (waits)
        if block:   # (the first: warm-up, tracing)
            rates.append(args.steps / (time.perf_counter() - t0))
    if args.index == 0:
        print(RESULT + json.dumps({"steps_per_s": rates}), flush=True)
    return 0


def run(n: int, steps: int, rounds: int, hosts=None, log_path: str | None = None,
        timeout: float = 600.0) -> list[float]:
    """Start n MWMS workers (on 127.0.0.1, or host i of ``hosts``: bench/hosts.py's
    TestHosts), wait for them; worker 0's steps/s per timed block."""
    from bench.tf_reference import free_ports, tf_env
    if hosts is None:
        addresses = [f"127.0.0.1:{p}" for p in free_ports(n)]
        prefixes = [[] for _ in range(n)]
    else:
        addresses = [f"{hosts.addresses[i]}:{HOST_PORT}" for i in range(n)]
        prefixes = [hosts.run(i) for i in range(n)]
    env = {**os.environ, **tf_env(1, 2), "PYTHONPATH": os.pathsep.join(
        p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path or os.devnull, "ab"))
        procs = []
        for i in range(n):
            cmd = [*prefixes[i], sys.executable, "-m", "bench.tf_mwms", "worker",
                   "--index", str(i), "--cluster", json.dumps(addresses),
                   "--steps", str(steps), "--rounds", str(rounds)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if i == 0
                                          else log, stderr=log))
        try:
            out, _ = procs[0].communicate(timeout=timeout)
            for p in procs[1:]:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.startswith(RESULT)]
        if procs[0].returncode != 0 or not lines:
            raise RuntimeError(f"the MultiWorkerMirroredStrategy workers failed (exit "
                               f"{procs[0].returncode}); see {log_path or 'their stderr'}")
        return json.loads(lines[-1][len(RESULT):])["steps_per_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--cluster", required=True)
    for p in (ap, w):
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--hosts", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        return worker_main(args)
    with contextlib.ExitStack() as stack:
        hosts = None
        if args.hosts:
            from bench.hosts import TestHosts
            hosts = stack.enter_context(TestHosts(args.workers))
        rates = run(args.workers, args.steps, args.rounds, hosts, log_path="/dev/stderr")
    print(json.dumps({"workers": args.workers, "hosts": args.hosts, "steps_per_s": rates}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
