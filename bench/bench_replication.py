"""What replication costs: training steps/s with ``replication=True`` against
the same job without it, and the CPU each role spends per step, measured in
one run in interleaved blocks (a cluster without replication, then one with
it, then again...: one cluster at a time, so a noisy machine slows both
alike and neither competes with the other's idle threads).

    python -m bench.bench_replication                     # MLP shapes, same host
    python -m bench.bench_replication --workload ctr      # bench.suite (e)'s DLRM and table
    python -m bench.bench_replication --hosts             # tasks on test hosts (root)
    python -m bench.bench_replication --rounds 5 --steps 200 --json out.json

``mlp``: each step reads every variable and pushes a dense gradient for
each (bench/suite.py's MLP shapes: 64x256, 256x256, 256x10 plus biases,
float32, Adam). ``ctr``: examples/ctr.py's step (its DLRM, one shared
dynamic table, Adagrad, batches of 512). Either way every push of a
replicated job makes one more hop: the primary forwards it to its backup
and answers once the backup has it. The last line checks that every backup
is bit-identical to its primary (variables' values; tables' rows counted).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np

from bench.common import cpu_seconds, machine_info, print_table, write_json
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
CTR_BATCH = 512


def mlp_job(cluster, replication: bool):
    """(strategy, variables, tables, step(k))."""
    strategy = ParameterServerStrategy(cluster.spec, replication=replication,
                                       variable_partitioner=FixedShardsPartitioner(2))
    variables = [strategy.create_variable(n, shape=s, initializer="random_normal",
                                          optimizer="adam") for n, s in SHAPES.items()]
    grads = [np.random.default_rng(i).normal(size=s).astype(np.float32) * 1e-3
             for i, s in enumerate(SHAPES.values())]

    def step(k):
        read_variables(variables)
        push_gradients(zip(variables, grads))
    return strategy, variables, [], step


def ctr_job(cluster, replication: bool):
    """examples/ctr.py's model and step (batch k of the generated stream)."""
    from coordinator import ctr_data as D
    from examples import ctr
    from examples import dlrm as M
    strategy = ParameterServerStrategy(cluster.spec, replication=replication)
    variables, table = ctr.build(strategy, seed=0, lr=0.05)
    names = list(variables)

    def step(k):
        b = D.batch(0, k, CTR_BATCH)
        look = ctr.lookup_item(table, b.sparse)
        rows, *values = read_variables([look, *(variables[n] for n in names)])
        _, grads, row_grads = M.loss_and_grads(dict(zip(names, values)), b.dense,
                                               ctr.as_rows(rows), b.labels)
        push_gradients([*ctr.row_gradients(look, row_grads),
                        *((variables[n], grads[n]) for n in names)])
    return strategy, list(variables.values()), [table], step


def copies_identical(cluster, variables, tables) -> bool:
    with contextlib.ExitStack() as stack:
        clients = {}

        def client(address):
            if address not in clients:
                clients[address] = stack.enter_context(
                    PSClient(address, token=cluster.token, tls=cluster.tls))
            return clients[address]
        for v in variables:
            for s, b in zip(v.shards, v.backups):
                if client(s.address).read(s.name).tobytes() != \
                        client(b.address).read(b.name).tobytes():
                    return False
        for t in tables:
            for s, b in zip(t.shards, t.backups):
                if client(s.address).table_info(s.table).rows != \
                        client(b.address).table_info(b.table).rows:
                    return False
    return True


def block(job: str, replication: bool, args, placement, check: bool) -> dict:
    """One cluster up, warmed, ``args.steps`` steps timed, CPU by role; down."""
    make = mlp_job if args.workload == "mlp" else ctr_job
    with LocalCluster(num_ps=2, num_workers=args.workers, placement=placement) as cluster:
        strategy, variables, tables, step = make(cluster, replication)
        pids = {"ps": [t.task_pid for t in cluster.ps],
                "workers": [t.task_pid for t in cluster.workers], "chief": [None]}
        with ClusterCoordinator(strategy) as coord:
            coord.fetch([coord.schedule(step, args=(k,)) for k in range(20)])   # warm-up
            cpu0 = {r: sum(cpu_seconds(p) for p in ps) for r, ps in pids.items()}
            start = time.perf_counter()
            coord.fetch([coord.schedule(step, args=(20 + k,)) for k in range(args.steps)])
            seconds = time.perf_counter() - start
            cpu = {r: (sum(cpu_seconds(p) for p in ps) - cpu0[r]) / args.steps * 1e3
                   for r, ps in pids.items()}
        identical = copies_identical(cluster, variables, tables) if check else None
    return {"rate": args.steps / seconds, "cpu_ms": cpu, "identical": identical}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("mlp", "ctr"), default="mlp")
    p.add_argument("--rounds", type=int, default=3, help="blocks of each job, interleaved")
    p.add_argument("--steps", type=int, default=150, help="steps per block")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--hosts", action="store_true",
                   help="each task on a test host of its own (bench/hosts.py; root)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with contextlib.ExitStack() as stack:
        placement = None
        if args.hosts:
            from bench import hosts
            ok, why = hosts.available()
            if not ok:
                raise SystemExit(f"--hosts: {why}")
            test_hosts = stack.enter_context(hosts.TestHosts(2 + args.workers))
            placement = test_hosts.placement(ps=[0, 1], worker=list(range(2, 2 + args.workers)))
        for r in range(args.rounds):
            for job in ("off", "on"):
                runs[job].append(block(job, job == "on", args, placement,
                                       check=job == "on" and r == args.rounds - 1))
    rates = {k: [x["rate"] for x in v] for k, v in runs.items()}
    cpu = {k: {role: statistics.median(x["cpu_ms"][role] for x in v)
               for role in ("ps", "workers", "chief")} for k, v in runs.items()}
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    identical = runs["on"][-1]["identical"]
    rows = [[f"replication={k == 'on'}", f"{statistics.median(rates[k]):.1f}",
             " ".join(f"{x:.0f}" for x in rates[k]),
             *(f"{cpu[k][role]:.2f}" for role in ("ps", "workers", "chief"))]
            for k in ("off", "on")]
    rows.append(["ratio on/off", f"{on / off:.2f}", "",
                 *(f"{cpu['on'][r] / cpu['off'][r]:.2f}" for r in ("ps", "workers", "chief"))])
    where = "test hosts" if args.hosts else "one host"
    print_table(["job", "steps/s (median)", "blocks", "ps CPU ms/step", "workers CPU ms/step",
                 "chief CPU ms/step"], rows,
                title=f"Replication cost ({args.workload}, {args.workers} workers, 2 ps, {where}; "
                      f"medians of {args.rounds} interleaved blocks of {args.steps} steps)")
    print(f"\nevery backup identical to its primary: {identical}")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "workload": args.workload,
                               "hosts": args.hosts, "runs": runs, "ratio": on / off,
                               "cpu_ms": cpu, "identical": identical})
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
