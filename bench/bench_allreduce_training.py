"""Synchronous training by all-reduce against our parameter-server sync mode, in the same run.

    python -m bench.bench_allreduce_training [--workers 4] [--hosts] [--tf] [--rounds 3] [--json F]

The workload is bench/suite.py's (a): the MLP 784-512-512-10 (670k float32
parameters, 2.7 MB), batch 128 per replica, plain SGD, each worker its own
synthetic stream. Both sides run on one cluster of 2 parameter servers and
``--workers`` workers (the cluster's token and TLS, as a job runs):

* ``ParameterServerStrategy(mode="sync")``: every replica pushes its whole
  gradient to the servers (the kernels sharded over both, as in (a)), which
  average and apply once per step; the next step's reads wait for it.
* ``ParameterServerStrategy(mode="allreduce")``: the variables mirrored on
  every worker, the gradients averaged by the ring among the workers
  (coordinator/mirrored.py), no server in the path.

One scheduled step is one global step of ``--workers`` replicas in both.
Blocks of ``--steps`` global steps alternate sync, all-reduce, sync... after
one warm-up block each; reported: global steps/s (medians of ``--rounds``
blocks) and their ratio (above 1: all-reduce is faster). ``--hosts``: the
servers on two test hosts and each worker on one of its own (bench/hosts.py;
root), the chief in this process. ``--fp16``: the all-reduce sends float16
(``gradient_compression="fp16"``). ``--tf``: then TensorFlow's
MultiWorkerMirroredStrategy (RING collectives, CPU) on the same shapes,
data and hosts (bench/tf_mwms.py: ``--workers`` processes, the workers'
hosts), its blocks timed by its worker 0 while our cluster idles.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

from bench.common import machine_info, print_table, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--hosts", action="store_true", help="each task on a test host (root)")
    ap.add_argument("--rounds", type=int, default=3, help="timed blocks of each side")
    ap.add_argument("--steps", type=int, default=30, help="global steps a block")
    ap.add_argument("--fp16", action="store_true", help="the all-reduce sends float16")
    ap.add_argument("--tf", action="store_true",
                    help="also TensorFlow's MultiWorkerMirroredStrategy (bench/tf_mwms.py)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from bench.suite import MLP_SIZES, mlp_dataset
    from coordinator import (
        ClusterCoordinator,
        LocalCluster,
        MinSizePartitioner,
        ParameterServerStrategy,
    )
    from examples.nn import MLP, make_train_step
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    n = args.workers
    with contextlib.ExitStack() as stack:
        placement = None
        if args.hosts:
            from bench.hosts import TestHosts
            hosts = stack.enter_context(TestHosts(2 + n))
            placement = hosts.placement([0, 1], range(2, 2 + n))
        cluster = stack.enter_context(LocalCluster(num_ps=2, num_workers=n, env=env,
                                                   placement=placement))
        part = MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
        sides = {}
        for mode in ("sync", "allreduce"):
            strategy = ParameterServerStrategy(
                cluster.spec, variable_partitioner=part, mode=mode,
                gradient_compression="fp16" if args.fp16 and mode == "allreduce" else None)
            model = MLP(list(MLP_SIZES))
            model.create_variables(strategy, f"{mode}/mlp", optimizer="sgd",
                                   optimizer_params={"learning_rate": 0.01})
            coord = stack.enter_context(ClusterCoordinator(strategy))
            it = iter(coord.create_per_worker_dataset(mlp_dataset))
            sides[mode] = (coord, make_train_step(model), it)
        times: dict[str, list[float]] = {k: [] for k in sides}
        for block in range(args.rounds + 1):
            for mode, (coord, step, it) in sides.items():
                t0 = time.perf_counter()
                coord.fetch([coord.schedule(step, args=(it,)) for _ in range(args.steps)])
                if block:   # (the first: warm-up)
                    times[mode].append(args.steps / (time.perf_counter() - t0))
        if args.tf:   # (its workers on our workers' hosts; ours idle meanwhile)
            from bench import tf_mwms
            times["tf_mwms"] = tf_mwms.run(
                n, args.steps, args.rounds, None if not args.hosts else _Shifted(hosts, 2),
                log_path="/dev/stderr")
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["allreduce"] / med["sync"]
    head = ["workers", "PS sync steps/s", "all-reduce steps/s", "all-reduce / sync"]
    row = [n, f"{med['sync']:.1f}", f"{med['allreduce']:.1f}", f"{ratio:.2f}"]
    if args.tf:
        head += ["TF MWMS steps/s", "all-reduce / TF MWMS"]
        row += [f"{med['tf_mwms']:.1f}", f"{med['allreduce'] / med['tf_mwms']:.2f}"]
    print_table(head, [row],
                title=f"MLP 784-512-512-10, batch 128 per replica, synchronous "
                      f"({'test hosts' if args.hosts else 'one host'}"
                      f"{', all-reduce in fp16' if args.fp16 else ''}; medians of "
                      f"{args.rounds} blocks of {args.steps} global steps)")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "workers": n, "hosts": args.hosts,
                               "fp16": args.fp16, "steps_per_s": times, "median": med,
                               "allreduce_over_sync": ratio,
                               "allreduce_over_tf_mwms": med["allreduce"] / med["tf_mwms"]
                               if args.tf else None})
    return 0


class _Shifted:
    """Test hosts from the k-th on (the workers' hosts), as bench/tf_mwms.py takes them."""

    def __init__(self, hosts, k: int):
        self.addresses, self._hosts, self._k = hosts.addresses[k:], hosts, k

    def run(self, i: int) -> list[str]:
        return self._hosts.run(self._k + i)


if __name__ == "__main__":
    sys.exit(main())
