"""Read latency by route, across test hosts (network namespaces, bench/hosts.py).

    sudo python -m bench.bench_route [--reads 300]

A parameter server runs on test host 0 (its own network namespace on this
machine); clients in this process read a 1.37 MB float32 variable (the
MLP benchmark's shard size) over each route and report p50 / p99:

* ``shares memory, not the network``: a default client here. It shares the
  kernel, the pid namespace and /dev/shm with the server but not its
  network, as pods on one node or ``--ipc=host`` containers do. The route
  planner (psserver/contract/routing.py) sends it to the data port. (Before the
  planner, this client attached shared memory and then made every read over
  gRPC around the segment: 7.5 ms p50 against 0.54 ms with shared memory
  off, measured when issue 14 was filed.)
* ``as from another host`` (the reference, measured in the same run,
  interleaved): a client with same-host paths off (``shared_memory=False``),
  which plans as a client on another machine does: the data port.
* ``same host and namespace`` (for scale): a server on this host and
  network namespace, shared memory and the Unix socket.

Reports the ratio of the first to the reference (issue 14 asks <= 1.5).
"""
from __future__ import annotations

import argparse
import sys

from bench import hosts
from bench.common import print_table, time_interleaved
from psserver.client import PSClient
from psserver.process import start_task

TOKEN = "bench-route-token"
SHAPE = (1000, 343)   # 1.37 MB of float32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reads", type=int, default=300)
    args = p.parse_args(argv)
    ok, why = hosts.available()
    if not ok:
        print(f"bench_route: {why}", file=sys.stderr)
        return 2
    env = {"PSTRAIN_AUTH_TOKEN": TOKEN}
    with hosts.TestHosts(1, private=False) as h:
        remote = start_task("psserver", ["--host", h.addresses[0], "--port", "0"], env=env,
                            prefix=h.run(0))
        local = start_task("psserver", ["--port", "0"], env=env)
        try:
            clients = {
                "shares memory, not the network": PSClient(remote.address, token=TOKEN),
                "as from another host": PSClient(remote.address, token=TOKEN,
                                                 shared_memory=False),
                "same host and namespace": PSClient(local.address, token=TOKEN),
            }
            for c in {c.address: c for c in clients.values()}.values():
                c.create_variable("w", SHAPE, initializer="ones")
            for c in clients.values():
                c.read("w")   # plans the route, learns the size
            stats = time_interleaved({name: (lambda c=c: c.read("w")) for name, c in clients.items()},
                                     args.reads)
            ref = stats["as from another host"].p50
            rows = [[name, c.route.socket or "grpc", "yes" if c.route.shm else "no",
                     f"{stats[name].p50 * 1e3:.2f}", f"{stats[name].p99 * 1e3:.2f}",
                     f"{stats[name].p50 / ref:.2f}"] for name, c in clients.items()]
            print_table(["client", "route", "shm", "p50 ms", "p99 ms", "p50 / another host"],
                        rows)
            for c in clients.values():
                c.close()
        finally:
            remote.kill()
            local.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
