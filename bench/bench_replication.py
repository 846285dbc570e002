"""What replication costs: training steps/s with ``replication=True`` against
the same job without it, measured in the same run (rounds alternate between
the two clusters, so a noisy machine slows both alike).

    python -m bench.bench_replication                 # MLP-sized pushes, 2 ps, 2 workers
    python -m bench.bench_replication --rounds 5 --steps 200 --json out.json

Each step reads every variable and pushes a dense gradient for each (the
shapes of bench/suite.py's MLP workload: 64x256, 256x256, 256x10 plus biases,
float32, Adam), so every push of a replicated job makes one more hop: the
primary forwards it to its backup and answers once the backup has it. The
last line checks that every backup is bit-identical to its primary.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.common import machine_info, print_table, write_json
from coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    LocalCluster,
    ParameterServerStrategy,
    push_gradients,
    read_variables,
)
from psserver.client import PSClient

SHAPES = {"w0": (64, 256), "b0": (256,), "w1": (256, 256), "b1": (256,),
          "w2": (256, 10), "b2": (10,)}


def make_job(cluster, replication: bool):
    strategy = ParameterServerStrategy(cluster.spec, replication=replication,
                                       variable_partitioner=FixedShardsPartitioner(2))
    variables = [strategy.create_variable(n, shape=s, initializer="random_normal",
                                          optimizer="adam") for n, s in SHAPES.items()]
    grads = [np.random.default_rng(i).normal(size=s).astype(np.float32) * 1e-3
             for i, s in enumerate(SHAPES.values())]

    def step():
        read_variables(variables)
        push_gradients(zip(variables, grads))
    return strategy, variables, step


def copies_identical(cluster, variables) -> bool:
    for v in variables:
        for s, b in zip(v.shards, v.backups):
            with PSClient(s.address, token=cluster.token, tls=cluster.tls) as cp, \
                    PSClient(b.address, token=cluster.token, tls=cluster.tls) as cb:
                if cp.read(s.name).tobytes() != cb.read(b.name).tobytes():
                    return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150, help="steps per round and job")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with LocalCluster(num_ps=2, num_workers=args.workers) as plain, \
            LocalCluster(num_ps=2, num_workers=args.workers) as replicated:
        jobs = {"off": make_job(plain, False), "on": make_job(replicated, True)}
        coords = {k: ClusterCoordinator(j[0]) for k, j in jobs.items()}
        try:
            for k, c in coords.items():   # warm-up: connections, shared memory, threads
                c.fetch([c.schedule(jobs[k][2]) for _ in range(20)])
            for _ in range(args.rounds):
                for k, c in coords.items():
                    start = time.perf_counter()
                    c.fetch([c.schedule(jobs[k][2]) for _ in range(args.steps)])
                    rates[k].append(args.steps / (time.perf_counter() - start))
            identical = copies_identical(replicated, jobs["on"][1])
        finally:
            for c in coords.values():
                c.shutdown()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print_table(["job", "steps/s (median of rounds)", "rounds"],
                [["replication=False", f"{off:.1f}", " ".join(f"{r:.0f}" for r in rates["off"])],
                 ["replication=True", f"{on:.1f}", " ".join(f"{r:.0f}" for r in rates["on"])],
                 ["ratio on/off", f"{on / off:.2f}", ""]],
                title=f"Replication cost ({args.workers} workers, 2 ps, MLP-sized pushes)")
    print(f"\nevery backup bit-identical to its primary: {identical}")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "rates": rates,
                               "ratio": on / off, "identical": identical})
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
