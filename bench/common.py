"""Shared pieces of the benchmarks under ``bench/``.

* Timing: :func:`time_calls` and :func:`time_interleaved` (round-robin over
  several variants, so a noisy machine slows them all alike) give
  :class:`Stats` (best, p50, p99...) of ``time.perf_counter`` samples.
* Reference servers, each a child process started like a real task
  (``psserver.process.start_task``, so BLAS threads are 1 there too):

  - :class:`TCPReference`: a plain socket server; large ``sendall`` /
    ``recv_into`` with preallocated buffers. The ceiling any RPC stack on
    this machine can reach.
  - :class:`GrpcReference`: a bare gRPC server with a generic handler and
    identity serializers (request and response are raw ``bytes``), with the
    parameter server's message-size options. What gRPC itself costs, with no
    protobuf, no numpy and no service logic.

* :func:`running_psserver` / :func:`running_psservers`: real parameter-server
  processes (:class:`PSConfig`) and their clients.
* Output: :func:`print_table` (a Markdown table), :func:`write_json`,
  :func:`machine_info` and the ``fmt_*`` helpers.

The reference servers are this module's command line (used by the classes;
no need to run them by hand)::

    python -m bench.common tcp-server --port 0
    python -m bench.common grpc-server --port 0 --max-message-bytes N
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import socket
import struct
import sys
import threading
import time
from concurrent import futures
from typing import Callable, Iterator, Mapping, Sequence

import grpc
import numpy as np

from psserver.contract import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_STREAM_THRESHOLD_BYTES,
)
from psserver.link.grpc_common import grpc_options
from psserver.process import TaskProcess, start_task

KiB = 1 << 10
MiB = 1 << 20


# -- formatting ----------------------------------------------------------------
def fmt_bytes(n: int) -> str:
    """1024 -> '1 KiB', 64 << 20 -> '64 MiB'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def fmt_rate(bytes_per_s: float) -> str:
    """Decimal units: '812 MB/s', '3.41 GB/s'."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.0f} MB/s" if bytes_per_s >= 1e7 else f"{bytes_per_s / 1e6:.2f} MB/s"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


def fmt_count_rate(per_s: float, unit: str = "rows") -> str:
    if per_s >= 1e6:
        return f"{per_s / 1e6:.2f} M {unit}/s"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.0f} k {unit}/s"
    return f"{per_s:.0f} {unit}/s"


# -- timing --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stats:
    """Summary of timing samples, in seconds."""
    n: int
    best: float
    p50: float
    p99: float
    mean: float
    worst: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Stats":
        a = np.asarray(samples, dtype=np.float64)
        if a.size == 0:
            raise ValueError("no samples")
        return cls(int(a.size), float(a.min()), float(np.percentile(a, 50)),
                   float(np.percentile(a, 99)), float(a.mean()), float(a.max()))

    def rate(self, amount: float, at: str = "best") -> float:
        """amount per second at the ``best`` (default) or ``p50`` time."""
        return amount / getattr(self, at)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@contextlib.contextmanager
def _gc_paused(pause: bool = True) -> Iterator[None]:
    """No garbage collection pauses inside the timed region (as timeit does)."""
    was = gc.isenabled()
    if pause:
        gc.collect()
        gc.disable()
    try:
        yield
    finally:
        if pause and was:
            gc.enable()


def time_calls(fn: Callable[[], object], reps: int, *, warmup: int = 3,
               pause_gc: bool = True) -> Stats:
    """Call ``fn()`` ``warmup`` times untimed, then ``reps`` times timed."""
    for _ in range(warmup):
        fn()
    samples = []
    with _gc_paused(pause_gc):
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return Stats.of(samples)


def time_interleaved(fns: Mapping[str, Callable[[], object]], reps: int, *,
                     warmup: int = 2, pause_gc: bool = True) -> dict[str, Stats]:
    """Like :func:`time_calls` for several variants, one call of each per round.

    On a noisy machine a slow spell then hurts every variant alike, so their
    comparison stays fair.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    with _gc_paused(pause_gc):
        for _ in range(reps):
            for key, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                samples[key].append(time.perf_counter() - t0)
    return {k: Stats.of(v) for k, v in samples.items()}


def latency_record(stats: Stats) -> dict:
    """JSON-ready latency numbers, in milliseconds."""
    return {"n": stats.n, "best_ms": stats.best * 1e3, "p50_ms": stats.p50 * 1e3,
            "p99_ms": stats.p99 * 1e3, "mean_ms": stats.mean * 1e3}


def transfer_record(nbytes: int, stats: Stats) -> dict:
    """JSON-ready numbers of a transfer benchmark (MB/s are 1e6 bytes/s)."""
    return {"bytes": nbytes, "best_MBps": stats.rate(nbytes) / 1e6,
            "median_MBps": stats.rate(nbytes, "p50") / 1e6, **latency_record(stats)}


# -- child processes -------------------------------------------------------------
@contextlib.contextmanager
def child_task(module: str, args: Sequence[str], *, env: dict[str, str] | None = None,
               prefix: Sequence[str] = ()) -> Iterator[TaskProcess]:
    """A task process (``python -m module args``; ``prefix``: on a test host,
    bench/hosts.py) killed on exit, also on errors."""
    task = start_task(module, list(args), env=env, prefix=prefix)
    try:
        yield task
    finally:
        task.terminate(timeout=5)


def _split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


@dataclasses.dataclass(frozen=True)
class PSConfig:
    """Settings of one parameter-server process; its client uses the same."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    extra_args: tuple[str, ...] = ()
    #: client side only: tensors above this move in frames
    stream_threshold_bytes: int = DEFAULT_STREAM_THRESHOLD_BYTES
    #: client side only: False: no shared memory (as a client on another host)
    shared_memory: bool = True
    #: client side only: False keeps such a client to gRPC (no data port)
    data_port: bool = True

    def args(self) -> list[str]:
        return ["--port", "0", "--max-message-bytes", str(self.max_message_bytes),
                "--chunk-bytes", str(self.chunk_bytes), "--log-level", "WARNING",
                *self.extra_args]


@contextlib.contextmanager
def running_psservers(configs: Sequence[PSConfig], *, client_timeout: float = 300.0,
                      host: str = "127.0.0.1", prefix: Sequence[str] = ()):
    """Yield [(task, PSClient)], one fresh psserver process per config
    (bound to ``host``; ``prefix``: run on a test host, with a token).

    The processes start in parallel; all are killed on exit, also when one
    fails to start.
    """
    import secrets

    from psserver.client import PSClient
    from psserver.contract import TOKEN_ENV
    token = secrets.token_hex(8) if prefix or host != "127.0.0.1" else None
    env = {TOKEN_ENV: token} if token else None
    with contextlib.ExitStack() as stack:
        with futures.ThreadPoolExecutor(max(1, len(configs))) as pool:
            started = [pool.submit(start_task, "psserver", ["--host", host, *c.args()], env=env,
                                   prefix=prefix) for c in configs]
        tasks, error = [], None
        for f in started:
            try:
                task = f.result()
            except Exception as exc:   # keep going: the others must be killed too
                error = error or exc
                continue
            stack.callback(task.terminate, 5)
            tasks.append(task)
        if error is not None:
            raise error
        out = []
        for task, c in zip(tasks, configs):
            client = PSClient(task.address, max_message_bytes=c.max_message_bytes,
                              stream_threshold_bytes=c.stream_threshold_bytes,
                              chunk_bytes=c.chunk_bytes, timeout=client_timeout,
                              shared_memory=c.shared_memory, data_port=c.data_port,
                              token=token)
            stack.callback(client.close)
            client.wait_ready(30)
            out.append((task, client))
        yield out


@contextlib.contextmanager
def running_psserver(config: PSConfig = PSConfig(), **kw):
    """Yield (task, PSClient) for one fresh parameter-server process."""
    with running_psservers([config], **kw) as [pair]:
        yield pair


# -- raw TCP reference -------------------------------------------------------------
# Request header: op (1 byte) and payload size. Ops:
#   D  download: the server sends n bytes
#   U  upload:   the client sends n bytes, the server answers one byte
#   E  echo:     the client sends n bytes, the server sends them back
_TCP_HEADER = struct.Struct("!cQ")


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on EOF before the first byte."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return True


def _tcp_session(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(_TCP_HEADER.size)
    buf = bytearray(0)
    with conn:
        while _recv_exact(conn, memoryview(header)):
            op, n = _TCP_HEADER.unpack(header)
            if len(buf) < n:
                buf = bytearray(n)
            view = memoryview(buf)[:n]
            if op == b"D":
                conn.sendall(view)
            elif op == b"U":
                _recv_exact(conn, view)
                conn.sendall(b"k")
            elif op == b"E":
                _recv_exact(conn, view)
                conn.sendall(view)
            else:
                return


def _tcp_server_main(args: argparse.Namespace) -> None:
    srv = socket.create_server((args.host, args.port))
    port = srv.getsockname()[1]
    print(f"tcpref listening on {args.host}:{port}", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_tcp_session, args=(conn,), daemon=True).start()


class TCPReference:
    """Client of a plain-socket server in a child process (use as a context manager).

    ``download(n)`` / ``upload(n)`` move n bytes one way (plus a 9-byte
    request, and a 1-byte answer for uploads); ``echo(n)`` is a round trip.
    """

    def __init__(self, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> None:
        self._host, self._prefix = host, prefix   # where the server runs (bench/hosts.py)
        self._stack = contextlib.ExitStack()
        self._sock: socket.socket | None = None
        self._buf = bytearray(0)

    def __enter__(self) -> "TCPReference":
        try:
            task = self._stack.enter_context(child_task(
                "bench.common", ["tcp-server", "--host", self._host, "--port", "0"],
                prefix=self._prefix))
            self._sock = socket.create_connection(_split_address(task.address))
            self._stack.callback(self._sock.close)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _view(self, n: int) -> memoryview:
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return memoryview(self._buf)[:n]

    def download(self, n: int) -> None:
        view = self._view(n)
        self._sock.sendall(_TCP_HEADER.pack(b"D", n))
        _recv_exact(self._sock, view)

    def upload(self, n: int) -> None:
        view = self._view(n)
        self._sock.sendall(_TCP_HEADER.pack(b"U", n))
        self._sock.sendall(view)
        _recv_exact(self._sock, memoryview(bytearray(1)))

    def echo(self, n: int) -> None:
        view = self._view(n)
        self._sock.sendall(_TCP_HEADER.pack(b"E", n))
        self._sock.sendall(view)
        _recv_exact(self._sock, view)


# -- bare gRPC reference ---------------------------------------------------------------
GRPC_SERVICE = "bench.Echo"
_SIZE = struct.Struct("!QQ")   # (n bytes, chunk bytes) of Fetch / FetchStream requests


def _grpc_handlers(max_chunk: int) -> grpc.GenericRpcHandler:
    """Echo, Fetch, FetchStream, Sink, Upload over raw bytes (no serializers)."""
    payloads: dict[int, bytes] = {}   # preallocated replies: no copy per call

    def payload(n: int) -> bytes:
        if n not in payloads:
            payloads[n] = bytes(n)
        return payloads[n]

    def echo(request: bytes, context) -> bytes:
        return request

    def fetch(request: bytes, context) -> bytes:
        n, _ = _SIZE.unpack(request)
        return payload(n)

    def fetch_stream(request: bytes, context) -> Iterator[bytes]:
        n, chunk = _SIZE.unpack(request)
        chunk = min(chunk or max_chunk, n) or 1
        full = payload(chunk)
        for _ in range(n // chunk):
            yield full
        if n % chunk:
            yield payload(n % chunk)

    def sink(request: bytes, context) -> bytes:
        return _SIZE.pack(len(request), 0)

    def upload(request_iterator, context) -> bytes:
        return _SIZE.pack(sum(len(c) for c in request_iterator), 0)

    return grpc.method_handlers_generic_handler(GRPC_SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Fetch": grpc.unary_unary_rpc_method_handler(fetch),
        "FetchStream": grpc.unary_stream_rpc_method_handler(fetch_stream),
        "Sink": grpc.unary_unary_rpc_method_handler(sink),
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
    })


def _grpc_server_main(args: argparse.Namespace) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.threads),
                         options=grpc_options(args.max_message_bytes))
    server.add_generic_rpc_handlers((_grpc_handlers(args.chunk_bytes),))
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(f"grpcref listening on {args.host}:{port}", flush=True)
    server.wait_for_termination()


class GrpcReference:
    """Client of a bare gRPC bytes server in a child process (context manager).

    Server and channel use ``psserver.link.grpc_common.grpc_options(max_message_bytes)``,
    the parameter server's own options.
    """

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.max_message_bytes, self.chunk_bytes = max_message_bytes, chunk_bytes
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "GrpcReference":
        try:
            task = self._stack.enter_context(child_task("bench.common", [
                "grpc-server", "--port", "0", "--max-message-bytes", str(self.max_message_bytes),
                "--chunk-bytes", str(self.chunk_bytes)]))
            channel = grpc.insecure_channel(task.address,
                                            options=grpc_options(self.max_message_bytes))
            self._stack.callback(channel.close)
            grpc.channel_ready_future(channel).result(timeout=30)
        except BaseException:
            self._stack.close()
            raise
        path = f"/{GRPC_SERVICE}/"
        self._echo = channel.unary_unary(path + "Echo")
        self._fetch = channel.unary_unary(path + "Fetch")
        self._fetch_stream = channel.unary_stream(path + "FetchStream")
        self._sink = channel.unary_unary(path + "Sink")
        self._upload = channel.stream_unary(path + "Upload")
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def echo(self, payload: bytes) -> bytes:
        """Unary round trip carrying ``payload`` both ways."""
        return self._echo(payload)

    def fetch(self, n: int) -> bytes:
        """Unary call: tiny request, n-byte response (what a read does)."""
        return self._fetch(_SIZE.pack(n, 0))

    def fetch_stream(self, n: int, chunk_bytes: int | None = None) -> int:
        """Server streaming: n bytes in chunk-sized messages; returns bytes seen."""
        return sum(len(c) for c in self._fetch_stream(_SIZE.pack(n, chunk_bytes or self.chunk_bytes)))

    def sink(self, payload: bytes) -> None:
        """Unary call: ``payload`` up, a tiny answer back (what a push does)."""
        self._sink(payload)

    def upload(self, payload: bytes, chunk_bytes: int | None = None) -> None:
        """Client streaming: ``payload`` up in chunk-sized messages."""
        step = chunk_bytes or self.chunk_bytes
        view = memoryview(payload)
        self._upload(bytes(view[i:i + step]) for i in range(0, len(view), step))


# -- output -----------------------------------------------------------------------------
# -- /proc: CPU accounting ---------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float:
    """user + system CPU seconds of a process (all threads); None: this one; NaN if gone."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK   # utime, stime
    except (OSError, IndexError, ValueError):
        return float("nan")


def machine_busy() -> float | None:
    """CPU seconds the whole machine has been busy since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / _TICK


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *,
                title: str | None = None, file=None) -> None:
    """A Markdown table (pastes into reports as it is), columns padded to fit."""
    file = file or sys.stdout
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    if title:
        print(f"\n{title}\n", file=file)
    print(line(cells[0]), file=file)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=file)
    for r in cells[1:]:
        print(line(r), file=file)
    file.flush()


def _jsonable(obj):
    if isinstance(obj, Stats):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def write_json(path: str, obj) -> None:
    """Write ``obj`` (dicts, lists, Stats, numpy scalars) atomically, indented."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)


def machine_info() -> dict:
    import google.protobuf
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "grpcio": grpc.__version__, "numpy": np.__version__,
            "protobuf": google.protobuf.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


# -- command line (the reference servers) -----------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.common",
                                description="Reference servers used by the benchmarks.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("tcp-server", "grpc-server"):
        s = sub.add_parser(name)
        s.add_argument("--host", default="127.0.0.1")
        s.add_argument("--port", type=int, default=0)
        if name == "grpc-server":
            s.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
            s.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
            s.add_argument("--threads", type=int, default=16)
    args = p.parse_args(argv)
    try:
        (_tcp_server_main if args.cmd == "tcp-server" else _grpc_server_main)(args)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
