"""(a)'s step with nothing of ours in the way: what these hosts allow.

The no-communication ceiling (bench/suite.py) leaves out the bytes a
distributed step must move: 2.7 MB of the MLP's weights read and 2.7 MB of
gradients pushed each step, through the kernel's TCP on the same CPUs the
steps compute on. This reference moves exactly those bytes, between the
same places, with nothing else:

* two bare parameter servers, each a flat float32 array (the MLP's shards
  that our cluster placed on it, in the same order): a read is one byte
  asking and the array's bytes sent back; a push is one byte and the
  gradient's bytes, applied with SGD on arrival (the same two numpy calls
  as psserver/optimizers.SGD) and answered with one byte;
* two bare workers, each bound to one CPU as ours are, looping: ask every
  server for its array and receive each straight into the slices of the
  model's parameters (one ``recvmsg_into`` per server), the same numpy
  forward and backward as ours (examples/nn.MLP), send each server its
  gradient slices from the arrays themselves (``sendmsg``), wait for each
  acknowledgement.

No framing, names, versions, checks, retries, update keys, closures or
coordinator, and reads are sent from the live array (no copy under a lock,
so a read may see a push half applied): the kernel's copies and the step's
own numpy. It is not a
parameter server anyone should run; it is how fast one could go here.
The chief times a block: every worker runs its share of the steps at once.

    python -m bench.wire_ceiling server --host H --layout JSON --index I [--lr LR]
    python -m bench.wire_ceiling worker --host H --servers A:P,B:P --layout JSON --index I

(``layout``: {"sizes": the MLP's sizes, "shards": per server, the [parameter
index, first row, rows] it holds}; each listens on a free port and prints it.)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Iterator, Sequence

import numpy as np

from bench.common import _split_address, child_task
from psserver.link.frames import (
    send_parts as _send_parts,  # buffers out with sendmsg, as ours
)

#: One-byte requests.
_READ, _PUSH, _ACK = b"r", b"p", b"k"


def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view, in order, from sock (all at once where the kernel allows)."""
    views = [v for v in views if v.nbytes]
    while views:
        n = sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise ConnectionError("peer closed")
        while n:
            if n >= views[0].nbytes:
                n -= views.pop(0).nbytes
            else:
                views[0], n = views[0][n:], 0


def _listen(host: str, role: str) -> socket.socket:
    srv = socket.create_server((host, 0))
    print(f"{role} listening on {host}:{srv.getsockname()[1]}", flush=True)
    return srv


# -- the bare parameter server ---------------------------------------------------------
def _initial(layout: dict) -> list[np.ndarray]:
    """The MLP's parameters as our examples make them (Glorot kernels, zero biases)."""
    from bench import suite
    from examples.nn import MLP
    return MLP(layout["sizes"]).init_params(suite.SEED, dtype="float32")


def serve(host: str, layout: dict, index: int, lr: float) -> None:
    """Server ``index`` of ``layout``: its shards' initial values, one flat array."""
    params = _initial(layout)
    held = [params[p][r0:r0 + n].reshape(-1) for p, r0, n in layout["shards"][index]]
    w = np.concatenate(held) if held else np.zeros(0, np.float32)
    wv = memoryview(w).cast("B")
    lock = threading.Lock()   # one push applied at a time, as a variable's lock does
    srv = _listen(host, "wireserver")

    def session(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        g, scratch = np.empty_like(w), np.empty_like(w)
        gv, op = memoryview(g).cast("B"), bytearray(1)
        with conn:
            while True:
                try:
                    _recv_views(conn, [memoryview(op)])
                except ConnectionError:
                    return
                if op == _READ:
                    conn.sendall(wv)
                elif op == _PUSH:
                    _recv_views(conn, [gv])
                    with lock:
                        np.multiply(g, np.float32(lr), out=scratch)
                        np.subtract(w, scratch, out=w)
                    conn.sendall(_ACK)
                else:
                    return

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=session, args=(conn,), daemon=True).start()


# -- the bare worker -------------------------------------------------------------------
def work(host: str, servers: Sequence[str], layout: dict, index: int) -> None:
    """``layout``: {"sizes": the MLP's sizes, "shards": per server, the
    [parameter index, first row, rows] it holds, in order}."""
    from bench import suite
    from examples.nn import MLP
    model = MLP(layout["sizes"])
    params = _initial(layout)   # overwritten by every read

    def slices(arrays: list[np.ndarray], server: int) -> list[memoryview]:
        return [memoryview(arrays[p][r0:r0 + n]).cast("B") for p, r0, n in layout["shards"][server]]

    socks = []
    for address in servers:
        s = socket.create_connection(_split_address(address))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(s)
    param_views = [slices(params, i) for i in range(len(socks))]
    x, y = suite.mlp_data(suite.MLP_EXAMPLES, suite.SEED, index, layout["sizes"])
    batches = [(x[i:i + suite.MLP_BATCH], y[i:i + suite.MLP_BATCH])
               for i in range(0, len(x), suite.MLP_BATCH)]
    ack = bytearray(1)
    step_no = 0

    def step() -> float:
        nonlocal step_no
        xb, yb = batches[step_no % len(batches)]
        step_no += 1
        for s in socks:
            s.sendall(_READ)
        for s, views in zip(socks, param_views):
            _recv_views(s, views)
        loss, grads = model.loss_and_grads(params, xb, yb)
        for i, s in enumerate(socks):
            _send_parts(s, [_PUSH, *slices(grads, i)])
        for s in socks:
            _recv_views(s, [memoryview(ack)])
        return loss

    ctl = _listen(host, "wireworker")
    conn, _ = ctl.accept()
    with conn, conn.makefile("rw") as f:
        for line in f:   # "N": run N steps, answer the seconds they took and their mean loss
            t0, total, n = time.perf_counter(), 0.0, int(line)
            for _ in range(n):
                total += step()
            f.write(f"{time.perf_counter() - t0} {total / max(n, 1)}\n")
            f.flush()


# -- the chief's side -----------------------------------------------------------------
def layout_of(variables, ps_addresses: Sequence[str]) -> list[list[list[int]]]:
    """Per parameter server (in ``ps_addresses``' order), the [parameter
    index, first row, rows] of the shards our cluster placed there."""
    out: list[list[list[int]]] = [[] for _ in ps_addresses]
    for i, v in enumerate(variables):
        for s in v.shards:
            out[list(ps_addresses).index(s.address)].append([i, s.offset, s.rows])
    return out


class WireCeiling:
    """Running bare workers (``running`` makes them): ``run(n)``: n steps
    shared by the workers, all at once; ``pids``: the processes by role."""

    def __init__(self, ctl: list, pids: dict[str, list[int]]):
        self._ctl, self.pids = ctl, pids
        self.losses: list[float] = []

    def run(self, n: int) -> float:
        """n steps, shared by the workers; the wall seconds (scaled to n
        where n does not divide evenly). ``losses``: each worker's mean loss
        over its share."""
        share = max(1, n // len(self._ctl))
        t0 = time.perf_counter()
        for f in self._ctl:
            f.write(f"{share}\n")
            f.flush()
        self.losses = []
        for f in self._ctl:
            line = f.readline()
            if not line:
                raise RuntimeError("a bare worker of the wire ceiling exited")
            self.losses.append(float(line.split()[1]))
        return (time.perf_counter() - t0) * n / (share * len(self._ctl))


@contextlib.contextmanager
def running(sizes: Sequence[int], shards: list[list[list[int]]], lr: float,
            servers_at: Sequence[tuple[str, list[str]]],
            workers_at: Sequence[tuple[str, list[str]]],
            cpus: Sequence[int] | None = None) -> Iterator[WireCeiling]:
    """The bare servers and workers as child processes, stopped on exit (also
    on errors): ``shards`` as layout_of gives them; ``servers_at`` /
    ``workers_at``: (host, command prefix) of each (bench/hosts.py;
    ("127.0.0.1", []) on this machine); ``cpus``: the CPU each worker is
    bound to (None: not bound)."""
    layout = json.dumps({"sizes": list(sizes), "shards": shards})
    pids: dict[str, list[int]] = {"ps": [], "workers": []}
    ctl = []
    with contextlib.ExitStack() as stack:
        addresses = []
        for i, (host, prefix) in enumerate(servers_at):
            task = stack.enter_context(child_task(
                "bench.wire_ceiling", ["server", "--host", host, "--layout", layout,
                                       "--index", str(i), "--lr", str(lr)], prefix=prefix))
            addresses.append(task.address)
            pids["ps"].append(task.task_pid)
        for i, (host, prefix) in enumerate(workers_at):
            pin = [] if cpus is None else ["taskset", "-c", str(cpus[i % len(cpus)])]
            task = stack.enter_context(child_task(
                "bench.wire_ceiling", ["worker", "--host", host, "--servers",
                                       ",".join(addresses), "--layout", layout,
                                       "--index", str(i)], prefix=[*prefix, *pin]))
            pids["workers"].append(task.task_pid)
            conn = stack.enter_context(socket.create_connection(_split_address(task.address)))
            ctl.append(stack.enter_context(conn.makefile("rw")))
        yield WireCeiling(ctl, pids)


def _exit_with_parent() -> None:
    """End this process when the program that started it is gone (as our
    tasks do: psserver/serve/task.py), so a killed run leaves nothing behind."""
    from psserver.serve.task import _exit_with_parent as watch
    gone = threading.Event()
    watch(gone)
    threading.Thread(target=lambda: (gone.wait(), os._exit(0)), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wire_ceiling", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--layout", required=True)
    s.add_argument("--index", type=int, default=0)
    s.add_argument("--lr", type=float, default=0.01)
    w = sub.add_parser("worker")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--servers", required=True)
    w.add_argument("--layout", required=True)
    w.add_argument("--index", type=int, default=0)
    args = p.parse_args(argv)
    _exit_with_parent()
    if args.role == "server":
        serve(args.host, json.loads(args.layout), args.index, args.lr)
    else:
        work(args.host, args.servers.split(","), json.loads(args.layout), args.index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
