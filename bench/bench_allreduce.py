"""Our ring all-reduce among workers against torch.distributed's gloo, measured in the same run.

    python -m bench.bench_allreduce [--hosts] [--mib 64] [--members 2 4] [--rounds 3] [--json F]
    python -m bench.bench_allreduce --algorithms [--hosts] [--mib 0.004 0.25 2.5] [--members 4]

Ours: ``coordinator.collective.CollectiveGroup.all_reduce`` of a float32
array, run on n psworker processes of a LocalCluster (plaintext, as gloo's
TCP is; the token checked as always), each member timing its own calls in
its step function. gloo: n processes of ``torch.distributed`` (init over
TCP), ``dist.all_reduce`` of a tensor of the same bytes. Each side does a
warm-up call and then ``--reps`` timed ones per block; an all-reduce
takes as long as its slowest member; blocks alternate ours, gloo, ours...
(``--rounds`` each) and the ratio is gloo's median time over ours (above
1: ours is faster). ``--hosts``: each member of either side on a test host
of its own (bench/hosts.py; root), so the chunks cross veth links as
between machines. Also reported: the bus bandwidth, 2(n-1)/n of the bytes
over the time (the figure NCCL's and Horovod's benchmarks give).

``--algorithms``: ours only, the ring against the direct all-reduce
(coordinator/collective.py's ``choose_algorithm``) for each ``--mib``
size, blocks alternating ring, direct, ring...; the ratio is the ring's
median time over the direct one's (above 1: direct is faster).
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from bench.common import machine_info, print_table, write_json

MiB = 1 << 20


# -- ours: a step function on each worker ------------------------------------------------
def timed_all_reduce(addresses: list, rank: int, name: str, nbytes: int, reps: int,
                     algorithm: str | None = None) -> list:
    """On a worker: one warm-up all-reduce, then ``reps`` timed ones (seconds each)."""
    from coordinator.collective import CollectiveGroup
    x = np.full(nbytes // 4, rank + 1, np.float32)
    out = []
    with CollectiveGroup(name, addresses, rank, timeout=300) as group:
        group.all_reduce(x, algorithm=algorithm)
        for _ in range(reps):
            t0 = time.perf_counter()
            y = group.all_reduce(x, algorithm=algorithm)
            out.append(time.perf_counter() - t0)
    n = len(addresses)
    if y[0] != n * (n + 1) / 2:
        raise AssertionError(f"wrong sum {y[0]}")
    return out


def _on_workers(cluster, fn, *args) -> list:
    from coordinator import serialization
    from protos.pstrain.v1 import worker_pb2
    from psserver.link import methods
    from psserver.link.channel import TaskChannel
    addresses = [w.address for w in cluster.workers]

    def run(rank: int):
        with TaskChannel(addresses[rank], role="worker", token=cluster.token,
                         tls=cluster.tls or False) as ch:
            reply = ch.call(methods.RUN_CLOSURE, worker_pb2.ClosureRequest(
                fn=serialization.encode_function(fn),
                args=serialization.dumps(((addresses, rank, *args), {}))), 600)
        if reply.HasField("error"):
            raise RuntimeError(f"{reply.error.type}: {reply.error.message}")
        return serialization.loads(reply.result, trusted=True)
    with futures.ThreadPoolExecutor(len(addresses)) as pool:
        return list(pool.map(run, range(len(addresses))))


class Ours:
    def __init__(self, stack, n: int, placement):
        from coordinator import LocalCluster
        self.cluster = stack.enter_context(LocalCluster(num_ps=1, num_workers=n, tls=False,
                                                        placement=placement))
        self.blocks = 0

    def block(self, nbytes: int, reps: int, algorithm: str | None = None) -> list[float]:
        self.blocks += 1
        per_member = _on_workers(self.cluster, timed_all_reduce, f"bench-{self.blocks}",
                                 nbytes, reps, algorithm)
        return [max(ts) for ts in zip(*per_member)]


# -- gloo: n processes of torch.distributed ----------------------------------------------
def gloo_member(rank: int, n: int, host: str, port: int, nbytes: int, reps: int,
                my_address: str) -> None:
    """One gloo process: prints its timed all-reduces as JSON."""
    os.environ["GLOO_SOCKET_IFNAME"] = _ifname(my_address)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=n)
    x = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
    times = []
    for i in range(reps + 1):
        y = x.clone()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        if i:
            times.append(time.perf_counter() - t0)
    if float(y[0]) != n * (n + 1) / 2:
        raise AssertionError(f"wrong sum {float(y[0])}")
    dist.destroy_process_group()
    print(json.dumps(times), flush=True)


def _ifname(address: str) -> str:
    """The interface that holds ``address`` (gloo binds to an interface by name)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts[3].split("/")[0] == address:
            return parts[1].split("@")[0]
    return "lo"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Gloo:
    def __init__(self, n: int, hosts=None):
        self.n, self.hosts = n, hosts

    def block(self, nbytes: int, reps: int) -> list[float]:
        where = [(self.hosts.addresses[i], self.hosts.run(i)) if self.hosts else
                 ("127.0.0.1", []) for i in range(self.n)]
        host = where[0][0]
        port = 29500 + os.getpid() % 1000 if self.hosts else _free_port(host)
        procs = [subprocess.Popen(
            [*prefix, sys.executable, "-m", "bench.bench_allreduce", "--gloo-member",
             json.dumps([r, self.n, host, port, nbytes, reps, addr])],
            stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(
                os.path.abspath(__file__))))
            for r, (addr, prefix) in enumerate(where)]
        try:
            outs = [p.communicate(timeout=600)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a gloo member failed: {[p.returncode for p in procs]}")
        per_member = [json.loads(o.strip().splitlines()[-1]) for o in outs]
        return [max(ts) for ts in zip(*per_member)]


def _ours_on(stack, n: int, on_hosts: bool):
    """(Ours on n workers, the test hosts or None): with ``on_hosts`` each
    worker on a test host of its own (one more for the server), in ``stack``."""
    hosts = None
    if on_hosts:
        from bench.hosts import TestHosts
        hosts = stack.enter_context(TestHosts(n + 1))
    return Ours(stack, n, None if hosts is None else hosts.placement([n], range(n))), hosts


def algorithms(args) -> int:
    """--algorithms: the ring against the direct all-reduce, by size (see the module)."""
    sizes = args.mib or [0.004, 0.25, 2.5]
    res = {"machine": machine_info(), "hosts": args.hosts, "members": {}}
    rows = []
    for n in args.members:
        with contextlib.ExitStack() as stack:
            ours, _ = _ours_on(stack, n, args.hosts)
            for mib in sizes:
                nbytes = max(4, int(mib * MiB) // 4 * 4)
                times: dict[str, list] = {"ring": [], "direct": []}
                for _ in range(args.rounds):
                    for algorithm in times:
                        times[algorithm] += ours.block(nbytes, args.reps, algorithm)
                med = {k: statistics.median(v) for k, v in times.items()}
                res["members"].setdefault(n, {})[nbytes] = {"seconds": times, "median": med}
                rows.append([n, f"{nbytes:,}", f"{med['ring'] * 1e3:.2f}",
                             f"{med['direct'] * 1e3:.2f}", f"{med['ring'] / med['direct']:.2f}"])
    print_table(["members", "bytes", "ring ms", "direct ms", "ring / direct"], rows,
                title=f"All-reduce, ring against direct "
                      f"({'test hosts' if args.hosts else 'one host'}"
                      f"; medians of {args.rounds} x {args.reps} calls, each the slowest member's)")
    if args.json:
        write_json(args.json, res)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", action="store_true", help="each member on a test host (root)")
    ap.add_argument("--mib", type=float, nargs="+", default=None,
                    help="MiB all-reduced per call (default 64; with --algorithms 0.004 0.25 "
                         "2.5)")
    ap.add_argument("--algorithms", action="store_true",
                    help="ours only: the ring against the direct all-reduce, by size")
    ap.add_argument("--members", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3, help="blocks of each side")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per block")
    ap.add_argument("--json", default=None)
    ap.add_argument("--gloo-member", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gloo_member:
        gloo_member(*json.loads(args.gloo_member))
        return 0
    if args.algorithms:
        return algorithms(args)
    if args.mib and len(args.mib) > 1:
        ap.error("--mib takes one size against gloo (several only with --algorithms)")
    nbytes = int((args.mib or [64.0])[0] * MiB) // 4 * 4
    res = {"machine": machine_info(), "bytes": nbytes, "hosts": args.hosts, "members": {}}
    rows = []
    for n in args.members:
        with contextlib.ExitStack() as stack:
            ours, hosts = _ours_on(stack, n, args.hosts)
            gloo = Gloo(n, hosts)
            times = {"ours": [], "gloo": []}
            for _ in range(args.rounds):
                times["ours"] += ours.block(nbytes, args.reps)
                times["gloo"] += gloo.block(nbytes, args.reps)
        med = {k: statistics.median(v) for k, v in times.items()}
        bus = {k: 2 * (n - 1) / n * nbytes / v / 1e9 for k, v in med.items()}
        res["members"][n] = {"seconds": times, "median": med, "bus_GBps": bus,
                             "gloo_over_ours": med["gloo"] / med["ours"]}
        rows.append([n, f"{med['ours'] * 1e3:.1f}", f"{med['gloo'] * 1e3:.1f}",
                     f"{bus['ours']:.2f}", f"{bus['gloo']:.2f}",
                     f"{med['gloo'] / med['ours']:.2f}"])
    print_table(["members", "ours ms", "gloo ms", "ours bus GB/s", "gloo bus GB/s",
                 "speed ours/gloo"], rows,
                title=f"All-reduce of {nbytes / MiB:.0f} MiB float32 "
                      f"({'test hosts' if args.hosts else 'one host'}; medians of "
                      f"{args.rounds} x {args.reps} calls, each the slowest member's)")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
