"""The benchmark suite: ours against references measured in the same run, one command.

    python -m bench.suite [--quick] [--json PATH] [--no-tf] [--tls]

Workloads (2 parameter servers + 2 workers + this process as the chief, every
task its own process on 127.0.0.1):

* (a) ``mlp``: a dense MLP 784-512-512-10 (ReLU, softmax cross-entropy),
  per-worker batch 128, SGD; synthetic data made in ``dataset_fn`` from a
  fixed seed; variables sharded by ``MinSizePartitioner(256 KiB,
  max_shards=2)`` (both kernels in two shards, so both parameter servers
  carry the load). Ours: ``examples.nn.make_train_step`` (read_variables,
  numpy forward/backward, push_gradients), asynchronous and
  ``ParameterServerStrategy(mode="sync")``, and ``mode="allreduce"``
  (the variables mirrored on both workers, gradients averaged by the ring
  between them: row "all-reduce mode", against our sync mode). A step is
  one closure of batch 128 in every mode (sync and all-reduce: one
  scheduled global step is 2 replica closures, so 2 steps; the JSON also
  has global steps/s).
* (b) ``emb``: a 1,000,000 x 64 float32 table sharded by the same
  partitioner (two shards of 128 MB, one per server), 128 bags x 20 ids per
  step drawn uniformly or Zipf (a = 1.1 over a fixed random permutation of
  the rows), mean-pooled, a 64 -> 1 logistic head, sparse SGD. Ours:
  ``examples.embedding_bag.make_train_step`` (ShardedVariable.gather, read
  the head, push_sparse, push the head). steps/s and rows/s (ids looked up
  per second; the same number of rows is pushed back).
* (a) and (b) ours again with ``ClusterCoordinator(closures_per_worker=2)``
  (rows "2 closures/worker"): each worker runs two closures at once, on the
  same variables, strategy and cluster. TensorFlow's coordinator runs one
  per worker, which the plain rows match; the staleness differs (about 3
  other steps run alongside each, against 1).
* (c) ``raw``: read and push (SGD) of a 64 MiB float32 variable on one
  parameter server, in GB/s.
* (e) ``ctr``: click-through rate (issue 17's workload, bench/bench_ctr.py):
  examples/dlrm.py's DLRM on coordinator/ctr_data.py's Criteo-shaped
  batches of 512, plain SGD 0.1, async. Ours: the 26 features' ids in one
  dynamic embedding table (examples/ctr.py's step); TensorFlow's: 26 fixed
  tables of ``id % 100,000`` rows (the usual workaround). Samples/s, and the
  held-out AUC of each model after the run (the same held-out batches). A
  second variant of ours has a table per feature (an EmbeddingCollection of
  26, examples/ctr.py --tables per-feature: widths 4, 8 and 16 by
  vocabulary, the narrower rows projected to 16; capacities as the
  example's, so one padded group table), against TensorFlow's model of the
  same widths and projections, and against the shared table (4M rows at
  most, as the example's).
* (d) ``digits``, with ``--hosts`` only: every test host's link shaped to
  1 Gbit/s (tbf; plus 0.5 ms each way where the kernel has netem), an MLP
  64-1024-1024-10 (4.5 MB of float32 weights, about 3 ms of numpy per
  step: bytes dominate) on scikit-learn's digits, batch 32, SGD 0.1, async.
  Ours as it is and with fp16 both ways (``read_compression="fp16"`` and
  ``gradient_compression="fp16"``: half the bytes each way), each also
  with ``closures_per_worker=2`` (a step's push going up a link while
  another's read comes down), against
  TensorFlow's (float32: it has no compression), the same steps each;
  steps/s and test accuracy after training.
* (f) ``allreduce``, with ``--hosts`` only, after the rest (each in a
  process of its own, on test hosts of its own): bench/bench_allreduce.py,
  a 64 MiB float32 all-reduce among 2 and among 4 workers against
  torch.distributed's gloo on the same hosts (bus GB/s: 2(n-1)/n of the
  bytes over the slowest member's time); and
  bench/bench_allreduce_training.py, (a)'s MLP synchronous with 4 workers:
  all-reduce mode against our parameter-server sync mode, and (with
  TensorFlow) against MultiWorkerMirroredStrategy (RING, bench/tf_mwms.py).

References, measured in the same run:

* (c): raw loopback TCP (``bench.common.TCPReference``), interleaved call by
  call with ours.
* (a), (b): TensorFlow's ParameterServerStrategy + ClusterCoordinator on the
  same shapes, partitioner and process count (``bench.tf_reference``);
  skipped with a message when tensorflow is not installed
  (``pip install -e ".[bench]"``).
* (a) ceiling: the same forward+backward in this process with numpy and one
  BLAS thread, no communication, times the workers the cores can run at once
  (min(cores, workers) = 2 here).
* (a) wire ceiling (``bench/wire_ceiling.py``): the same step with the same
  bytes between the same places (our shards' layout; across hosts, our
  servers' and workers' hosts), moved by bare sockets: two servers that
  are a flat array each (SGD on arrival), two workers bound to the same
  CPUs receiving straight into the parameters and sending from the
  gradients, no framing, checks, versions, closures or coordinator. What
  any parameter server could reach here; the no-communication ceiling
  leaves out the kernel's TCP work, which on this machine shares the cores
  with the steps. Same host, ours moves tensors through shared memory and
  the wire ceiling through loopback TCP.

Cores: worker i of ours and of TensorFlow is bound to CPU i (round robin over
this process's CPUs: ``LocalCluster(pin_workers=True)``, ``psworker --cpus``);
parameter servers and chiefs are not bound.

Threads: every process of ours and of TensorFlow runs with
OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = MKL_NUM_THREADS = 1. TensorFlow's
processes also get intra-op 1 everywhere and inter-op 1 on the parameter
servers and the chief, 2 on the workers (with 1 a worker deadlocks on its
first step), each set three ways: TF_NUM_INTRAOP_THREADS /
TF_NUM_INTEROP_THREADS, ``tf.config.threading.set_intra_op_parallelism_threads``
/ ``set_inter_op_parallelism_threads``, and the servers'
``ConfigProto(intra_op_parallelism_threads, inter_op_parallelism_threads)``.

Timing: a *block* schedules a fixed number of steps and joins. Blocks of
every variant of a workload are taken in turn (the order reversed every
other round), after an untimed warm-up block of each, so a noisy spell of
this shared machine hits ours and the reference alike. Rates are at the
median block; the JSON also has the best and every block. CPU seconds of
every process (from /proc) are summed over the timed blocks: CPU ms per
step by role.

Memory: each of our parameter servers' resident memory (VmRSS) when the
suite ends, above its own VmRSS as an empty process (measured right after it
started), against the bytes of the variables, slots and table rows it holds
(the sum of ``nbytes + slot_nbytes`` of its variables and the ``bytes`` of
its dynamic-table shards: rows, slots and index, as TableInfo reports them).

Transport: all processes share this host, so ours moves tensors through
shared memory and makes its hot calls (reads, pushes, lookups, closures)
over local sockets (psserver/contract/shm.py, psserver/ipc.py); the rest is
plaintext gRPC like TensorFlow's (``--tls``: LocalCluster's default mutual
TLS). ``--task-env PSTRAIN_SHM=0``: as between hosts (the hot calls over the
tasks' data ports, TCP); add ``--task-env PSTRAIN_DATA=0`` and run with
``PSTRAIN_DATA=0`` for gRPC alone.
"""
from __future__ import annotations

import os

# One BLAS thread in this process (the ceiling is measured here) and, through
# the environment, in every task it starts. Set before numpy is imported.
BLAS_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
os.environ.update(BLAS_ENV)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from bench.common import cpu_seconds, machine_busy  # noqa: E402

#: Partitioner of every sharded variable, ours and TensorFlow's.
SHARD_MIN_BYTES = 256 << 10
SHARD_MAX = 2
NUM_PS = 2
NUM_WORKERS = 2
SEED = 0

MLP_SIZES = (784, 512, 512, 10)
MLP_BATCH = 128
MLP_LR = 0.01
MLP_EXAMPLES = 16 * MLP_BATCH        # per worker, repeated

EMB_ROWS = 1_000_000
EMB_DIM = 64
EMB_BATCH = 128
EMB_BAG = 20
EMB_LR = 0.5                         # sparse SGD of the table (mean-pooled: small gradients)
EMB_HEAD_LR = 0.05
EMB_BATCHES = 32                     # per worker, repeated
ZIPF_A = 1.1
EMB_DISTS = ("uniform", "zipf")
EMB_IDS = EMB_BATCH * EMB_BAG        # ids per step

RAW_BYTES = 64 << 20

#: (d), across hosts only: every link shaped to SHAPED_RATE (and SHAPED_DELAY
#: where the kernel has netem), an MLP on scikit-learn's digits wide enough
#: that bytes dominate (4.5 MB of float32 weights, 3 ms of numpy per step).
SHAPED_RATE = "1gbit"
SHAPED_DELAY = "0.5ms"
DIGITS_SIZES = (64, 1024, 1024, 10)
DIGITS_BATCH = 32
DIGITS_LR = 0.1

#: Bind worker i to CPU i (LocalCluster(pin_workers=True); TensorFlow's the same way).
PIN_WORKERS = True

#: TensorFlow's thread pools per process. inter_op 1 on the workers deadlocks
#: the first step (a worker's function waits on its remote reads with its only
#: inter-op thread), so the workers get 2: the least that runs.
TF_INTRA_OP = 1
TF_INTER_OP = {"ps": 1, "worker": 2, "chief": 1}

#: key -> (comparison, bound) on the ratio: the targets of issues 15 and 17,
#: on one host (TARGETS) and across test hosts (TARGETS_HOSTS, --hosts).
TARGETS = {
    "raw_read": (">=", 0.70), "raw_push": (">=", 0.70),
    "mlp_async_vs_tf": (">=", 2.0), "mlp_async2_vs_tf": (">=", 2.0),
    "mlp_sync_vs_tf_async": (">=", 1.0),
    "mlp_async_vs_ceiling": (">=", 0.55),
    "emb_uniform_vs_tf": (">=", 2.8), "emb_zipf_vs_tf": (">=", 2.8),
    "emb_uniform2_vs_tf": (">=", 2.8), "emb_zipf2_vs_tf": (">=", 2.8),
    "ctr_vs_tf": (">=", 3.0), "ctr_features_vs_tf": (">=", 3.0),
    "ctr_features_vs_shared": (">=", 0.9),
    "ps_memory": ("<=", 1.5),
}
TARGETS_HOSTS = {**TARGETS, "mlp_sync_vs_tf_async": (">=", 1.5),
                 "emb_uniform_vs_tf": (">=", 2.5), "emb_zipf_vs_tf": (">=", 2.5),
                 "emb_uniform2_vs_tf": (">=", 2.5), "emb_zipf2_vs_tf": (">=", 2.5),
                 "ctr_vs_tf": (">=", 2.0), "shaped_fp16_vs_tf": (">=", 1.8),
                 "shaped_fp16_2_vs_tf": (">=", 1.8),
                 "allreduce_2_vs_gloo": (">=", 0.9), "allreduce_4_vs_gloo": (">=", 0.9),
                 "mlp_allreduce4_vs_sync": (">=", 1.3),
                 "mlp_allreduce4_vs_tf_mwms": (">=", 2.0)}

#: (e): bench/bench_ctr.py's settings (batch 512, SGD 0.1, 26 TF tables of
#: id % 100,000), each worker cycling CTR_BATCHES batches made once.
CTR_BATCHES = 60


# -- data (numpy only: the TensorFlow chief imports these too) ----------------------
def mlp_data(n: int, seed: int, worker: int,
             sizes: Sequence[int] = MLP_SIZES) -> tuple[np.ndarray, np.ndarray]:
    """(x (n, sizes[0]) float32, labels (n,) int64 below sizes[-1]) from a fixed seed."""
    rng = np.random.default_rng([seed, worker])
    x = rng.standard_normal((n, sizes[0]), dtype=np.float32)
    y = rng.integers(0, sizes[-1], n, dtype=np.int64)
    return x, y


def emb_data(dist: str, n_batches: int, batch: int, bag: int, rows: int, seed: int,
             worker: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n_batches * batch, bag) int64, labels (n_batches * batch,) float32).

    "uniform": ids uniform over the rows. "zipf": row of rank k drawn with
    probability proportional to k**-ZIPF_A, ranks mapped to rows by a fixed
    random permutation (hot rows spread over the shards, as hashed ids are).
    """
    n = n_batches * batch
    rng = np.random.default_rng([seed, worker, EMB_DISTS.index(dist)])
    if dist == "uniform":
        ids = rng.integers(0, rows, (n, bag), dtype=np.int64)
    elif dist == "zipf":
        p = np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF_A
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        ranks = np.minimum(np.searchsorted(cdf, rng.random((n, bag))), rows - 1)
        perm = np.random.default_rng([seed, 12345]).permutation(rows)
        ids = perm[ranks].astype(np.int64)
    else:
        raise ValueError(f"unknown id distribution {dist!r}")
    labels = rng.integers(0, 2, n).astype(np.float32)
    return ids, labels


def digits_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits, standardized (examples.digits.load_data(SEED))."""
    from examples.digits import load_data
    return load_data(SEED)


def digits_accuracy(params: list[np.ndarray]) -> float:
    """Test accuracy of the DIGITS_SIZES MLP with ``params`` (kernel, bias, ...)."""
    _, _, x, y = digits_data()
    h = x
    for i in range(0, len(params), 2):
        h = h @ params[i] + params[i + 1]
        if i + 2 < len(params):
            h = np.maximum(h, 0)
    return float(np.mean(h.argmax(axis=1) == y))


# -- our per-worker datasets (module level: workers import them by name) --------------
def mlp_dataset(ctx):
    from coordinator import batches
    x, y = mlp_data(MLP_EXAMPLES, SEED, ctx.input_pipeline_id)
    return batches(x, y, batch_size=MLP_BATCH, shuffle=False)


def emb_dataset(dist: str, ctx):
    from coordinator import batches
    ids, labels = emb_data(dist, EMB_BATCHES, EMB_BATCH, EMB_BAG, EMB_ROWS, SEED,
                           ctx.input_pipeline_id)
    return batches(ids, labels, batch_size=EMB_BATCH, shuffle=False)


def digits_dataset(ctx):
    from coordinator import batches
    x, y, _, _ = digits_data()
    return batches(x, y, batch_size=DIGITS_BATCH, seed=SEED + ctx.input_pipeline_id)


def emb_dataset_uniform(ctx):
    return emb_dataset("uniform", ctx)


def emb_dataset_zipf(ctx):
    return emb_dataset("zipf", ctx)


# -- the plan ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    raw_rounds: int          # 64 MiB read/push rounds (each: ours + TCP, interleaved)
    mlp_steps: int           # steps per (a) block
    emb_steps: int           # steps per (b) block
    digits_steps: int        # steps per (d) block (across hosts only)
    ctr_steps: int           # steps per (e) block
    rounds: int              # timed blocks per variant
    warmup_blocks: float     # untimed warm-up, in blocks per variant


FULL = Plan(raw_rounds=12, mlp_steps=200, emb_steps=300, digits_steps=100, ctr_steps=150,
            rounds=6, warmup_blocks=0.5)
QUICK = Plan(raw_rounds=4, mlp_steps=80, emb_steps=120, digits_steps=60, ctr_steps=80,
             rounds=2, warmup_blocks=0.5)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- /proc -----------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def bind_process(pid: int, cpu: int) -> None:
    """Bind every thread of a running process to one CPU (threads it starts
    later inherit it), as ``psworker --cpus`` does from the start."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):   # a thread that just ended
            os.sched_setaffinity(int(tid), {cpu})


def thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return -1


class CPUMeter:
    """CPU seconds by role of a set of processes."""

    def __init__(self, pids: dict[str, list[int | None]]):
        self.pids = pids

    def read(self) -> dict[str, float]:
        return {role: sum(cpu_seconds(p) for p in ps) for role, ps in self.pids.items()}


# -- timing blocks ---------------------------------------------------------------------
@dataclasses.dataclass
class Variant:
    """One thing timed in blocks: run(n) does n steps and returns seconds."""
    key: str
    run: Callable[[int], float]
    steps: int                       # steps per block
    meter: CPUMeter | None = None
    seconds: list[float] = dataclasses.field(default_factory=list)
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    others: float = 0.0              # CPU seconds of other processes during the blocks

    def block(self, timed: bool = True, steps: int | None = None) -> float:
        n = steps or self.steps
        meter = self.meter or CPUMeter({"chief": [None]})
        c0, m0, w0 = meter.read(), machine_busy(), time.perf_counter()
        secs = self.run(n)
        c1, m1 = meter.read(), machine_busy()
        if timed:
            self.seconds.append(secs)
            ours = 0.0
            for role, c in c1.items():
                ours += c - c0[role]
                if self.meter:
                    self.cpu[role] = self.cpu.get(role, 0.0) + c - c0[role]
            self.others += max(0.0, (m1 - m0) - ours) * secs / (time.perf_counter() - w0)
        return secs

    def result(self) -> dict:
        a = np.asarray(self.seconds)
        med, best = float(np.median(a)), float(a.min())
        out = {"steps_per_block": self.steps, "blocks_s": self.seconds,
               "steps_per_s": self.steps / med, "steps_per_s_best": self.steps / best}
        if self.cpu:
            total = len(self.seconds) * self.steps
            out["cpu_ms_per_step"] = {r: 1e3 * c / total for r, c in self.cpu.items()}
            out["busy_cores"] = sum(self.cpu.values()) / float(a.sum())
        out["other_processes_busy_cores"] = self.others / float(a.sum())
        return out


def run_interleaved(variants: list[Variant], rounds: int, warmup_blocks: float,
                    what: str) -> None:
    for v in variants:
        log(f"{what}: warm-up {v.key}")
        v.block(timed=False, steps=max(4, int(v.steps * warmup_blocks)))
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            secs = v.block()
            log(f"{what} round {r + 1}/{rounds}: {v.key} {v.steps / secs:.1f} steps/s")


def _gc_paused(fn: Callable[[], object]) -> float:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


# -- (c) raw 64 MiB ---------------------------------------------------------------------
def measure_raw(plan: Plan, where: tuple[str, list[str]] | None = None) -> dict:
    """64 MiB read and push against raw TCP to the same place: this machine's
    loopback, or ``where`` (address, prefix: a test host, bench/hosts.py)."""
    from bench.common import TCPReference, running_psserver, time_interleaved
    log(f"(c) 64 MiB read/push vs raw TCP: {plan.raw_rounds} rounds")
    host, prefix = where or ("127.0.0.1", [])
    with TCPReference(host, prefix) as tcp, \
            running_psserver(host=host, prefix=prefix) as (_, ps):
        n = RAW_BYTES // 4
        ps.create_variable("raw", (n,), "float32", initializer="zeros", optimizer="sgd")
        g = np.full(n, 1e-3, np.float32)
        st = time_interleaved({
            "ours_read": lambda: ps.read("raw"), "tcp_download": lambda: tcp.download(RAW_BYTES),
            "ours_push": lambda: ps.push("raw", g), "tcp_upload": lambda: tcp.upload(RAW_BYTES),
        }, plan.raw_rounds, warmup=2)
    out = {k: {"best_GBps": RAW_BYTES / s.best / 1e9, "median_GBps": RAW_BYTES / s.p50 / 1e9,
               "p50_ms": s.p50 * 1e3, "n": s.n} for k, s in st.items()}
    return out


# -- (a) ceiling -------------------------------------------------------------------------
def make_ceiling():
    """run(n): n forward+backward passes of the MLP here, numpy, one BLAS thread."""
    from examples.nn import MLP
    model = MLP(list(MLP_SIZES))
    params = model.init_params(SEED, dtype="float32")
    x, y = mlp_data(MLP_EXAMPLES, SEED, 0)
    xb = [x[i:i + MLP_BATCH] for i in range(0, len(x), MLP_BATCH)]
    yb = [y[i:i + MLP_BATCH] for i in range(0, len(y), MLP_BATCH)]

    def run(n: int) -> float:
        def go():
            for i in range(n):
                model.loss_and_grads(params, xb[i % len(xb)], yb[i % len(yb)])
        return _gc_paused(go)
    return run


def blas_threads() -> list[dict]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    return [{"api": i.get("internal_api"), "num_threads": i.get("num_threads")}
            for i in threadpool_info()]


# -- ours ---------------------------------------------------------------------------------
class Ours:
    """Our cluster, strategies, variables and step functions for (a) and (b)."""

    def __init__(self, tls: bool, token: str | None = None, env: dict[str, str] | None = None,
                 placement=None):
        from coordinator import (
            ClusterCoordinator,
            LocalCluster,
            MinSizePartitioner,
            ParameterServerStrategy,
        )
        self.stack = contextlib.ExitStack()
        try:
            self.cluster = self.stack.enter_context(
                LocalCluster(num_ps=NUM_PS, num_workers=NUM_WORKERS, tls=tls, token=token,
                             env=env, pin_workers=PIN_WORKERS, placement=placement))
            time.sleep(0.5)
            self.ps_baseline = {t.task_pid: rss_bytes(t.task_pid) for t in self.cluster.ps}
            part = MinSizePartitioner(min_shard_bytes=SHARD_MIN_BYTES, max_shards=SHARD_MAX)
            self.strategy = {m: ParameterServerStrategy(self.cluster.spec, variable_partitioner=part,
                                                        mode=m)
                             for m in ("async", "sync", "allreduce")}
            self.coord = {m: self.stack.enter_context(ClusterCoordinator(s))
                          for m, s in self.strategy.items()}
            # Two closures at once per worker (async only; TensorFlow runs one).
            self.coord["async2"] = self.stack.enter_context(
                ClusterCoordinator(self.strategy["async"], closures_per_worker=2))
        except BaseException:
            self.stack.close()
            raise
        self.meter = CPUMeter({"chief": [None], "ps": [t.task_pid for t in self.cluster.ps],
                               "workers": [t.task_pid for t in self.cluster.workers]})

    def close(self) -> None:
        self.stack.close()

    def setup_mlp(self) -> None:
        from examples.nn import MLP, make_train_step
        self.mlp = {}
        for mode, strategy in self.strategy.items():
            model = MLP(list(MLP_SIZES))
            model.create_variables(strategy, f"{mode}/mlp", optimizer="sgd",
                                   optimizer_params={"learning_rate": MLP_LR}, seed=SEED)
            coord = self.coord[mode]
            it = iter(coord.create_per_worker_dataset(mlp_dataset))
            self.mlp[mode] = (make_train_step(model), it, model, coord)
        step, _, model, _ = self.mlp["async"]   # the same model, two closures per worker
        coord = self.coord["async2"]
        self.mlp["async2"] = (step, iter(coord.create_per_worker_dataset(mlp_dataset)), model,
                              coord)

    def setup_emb(self) -> None:
        from examples.embedding_bag import make_train_step
        from psserver.contract import Initializer
        s = self.strategy["async"]
        self.table = s.create_variable(
            "emb/table", (EMB_ROWS, EMB_DIM), "float32",
            initializer=Initializer("random_uniform", minval=-0.05, maxval=0.05, seed=SEED),
            optimizer="sgd", optimizer_params={"learning_rate": EMB_LR})
        head = dict(optimizer="sgd", optimizer_params={"learning_rate": EMB_HEAD_LR})
        w = s.create_variable("emb/head/kernel", (EMB_DIM, 1), initializer="glorot_uniform",
                              seed=SEED + 1, **head)
        b = s.create_variable("emb/head/bias", (1,), initializer="zeros", **head)
        step = make_train_step(self.table, w, b)
        fns = {"uniform": emb_dataset_uniform, "zipf": emb_dataset_zipf}
        self.emb = {(d, mode): (step, iter(self.coord[mode].create_per_worker_dataset(fns[d])))
                    for d in EMB_DISTS for mode in ("async", "async2")}

    def setup_digits(self) -> None:
        """(d): the digits MLP twice, sent as it is and with fp16 both ways
        (weights read as float16, gradients pushed as float16)."""
        from examples.nn import MLP, make_train_step
        s = self.strategy["async"]
        for key, fp16 in (("fp32", None), ("fp16", "fp16"), ("fp32_2", None),
                          ("fp16_2", "fp16")):
            coord = self.coord["async2" if key.endswith("_2") else "async"]
            model = MLP(list(DIGITS_SIZES))
            model.create_variables(s, f"digits_{key}", optimizer="sgd",
                                   optimizer_params={"learning_rate": DIGITS_LR}, seed=SEED)
            step = make_train_step(model, compression=fp16, read_compression=fp16)
            self.mlp[f"digits_{key}"] = (step, iter(coord.create_per_worker_dataset(
                digits_dataset)), model, coord)

    def setup_ctr(self) -> None:
        from bench.bench_ctr import OursCTR
        self.ctr = OursCTR(self.strategy["async"], self.coord["async"], CTR_BATCHES)
        self.ctr_features = OursCTR(self.strategy["async"], self.coord["async"], CTR_BATCHES,
                                    prefix="ctrf", tables="per-feature")

    def run_ctr(self, n: int) -> float:
        return _gc_paused(lambda: self.ctr.run(n))

    def run_ctr_features(self, n: int) -> float:
        return _gc_paused(lambda: self.ctr_features.run(n))

    def digits_accuracy(self, key: str) -> float:
        from coordinator import read_variables
        return digits_accuracy(read_variables(self.mlp[f"digits_{key}"][2].variables))

    def run_mlp(self, mode: str, n: int) -> float:
        step, it, _, coord = self.mlp[mode]
        per = coord.strategy.num_replicas_in_sync   # sync: a scheduled step is 2 closures
        holder = []

        def go():
            holder.extend(coord.schedule(step, args=(it,)) for _ in range(n // per))
            coord.join()
        secs = _gc_paused(go)
        holder[-1].fetch()
        return secs

    def run_emb(self, dist: str, n: int, mode: str = "async") -> float:
        step, it = self.emb[dist, mode]
        coord = self.coord[mode]
        holder = []

        def go():
            holder.extend(coord.schedule(step, args=(it,)) for _ in range(n))
            coord.join()
        secs = _gc_paused(go)
        holder[-1].fetch()
        return secs

    def memory(self) -> list[dict]:
        from coordinator.ps_pool import client_for
        out = []
        for t in self.cluster.ps:
            metas = client_for(t.address).list_variables()
            tables = client_for(t.address).list_tables()   # (e)'s dynamic table shards
            held = sum(m.nbytes + m.slot_nbytes for m in metas) + sum(i.bytes for i in tables)
            rss = rss_bytes(t.task_pid)
            base = self.ps_baseline[t.task_pid]
            out.append({"address": t.address, "variables": len(metas), "tables": len(tables),
                        "held_bytes": held,
                        "rss_bytes": rss, "baseline_rss_bytes": base,
                        "ratio": (rss - base) / held if held else float("nan")})
        return out


# -- TensorFlow -----------------------------------------------------------------------------
def tf_missing_reason() -> str | None:
    if importlib.util.find_spec("tensorflow") is None:
        return ('tensorflow is not installed: TensorFlow rows skipped '
                '(install the reference with: pip install -e ".[bench]")')
    return None


class TF:
    def __init__(self, log_path: str, placement=None):
        from bench.tf_reference import TFCluster
        self.cluster = TFCluster(NUM_PS, NUM_WORKERS, log_path=log_path,
                                 intra_op=TF_INTRA_OP, inter_op=TF_INTER_OP, placement=placement)
        self.chief = self.cluster.chief
        if PIN_WORKERS:   # as ours: worker i on CPU i (of this process's), round robin
            cpus = sorted(os.sched_getaffinity(0))
            for i, pid in enumerate(self.cluster.pids()["workers"]):
                bind_process(pid, cpus[i % len(cpus)])
        self.meter = CPUMeter(self.cluster.pids())
        self.ps_baseline = {p: rss_bytes(p) for p in self.cluster.pids()["ps"]}

    def setup(self) -> None:
        self.chief.call("setup_mlp", sizes=list(MLP_SIZES), batch=MLP_BATCH, lr=MLP_LR,
                        examples=MLP_EXAMPLES, seed=SEED)
        self.chief.call("setup_emb", rows=EMB_ROWS, dim=EMB_DIM, batch=EMB_BATCH, bag=EMB_BAG,
                        lr=EMB_LR, head_lr=EMB_HEAD_LR, n_batches=EMB_BATCHES, seed=SEED,
                        dists=list(EMB_DISTS))

    def setup_ctr(self) -> None:
        """Its CTR model twice: ``ctr`` (widths of 16, against our shared
        table) and ``ctr_features`` (our per-feature tables' widths)."""
        from bench import bench_ctr as C
        from examples.ctr import FEATURE_DIMS
        for workload, dims in (("ctr", None), ("ctr_features", list(FEATURE_DIMS))):
            self.chief.call("setup_ctr", buckets=C.BUCKETS, batch=C.BATCH, lr=C.LR,
                            seed=C.SEED, n_batches=CTR_BATCHES, workers=NUM_WORKERS,
                            dims=dims, workload=workload, timeout=600)

    def ctr_auc(self, workload: str = "ctr") -> float:
        from bench import bench_ctr as C
        return self.chief.call("ctr_auc", seed=C.SEED, batches=20, size=C.BATCH,
                               workload=workload, timeout=600)["auc"]

    def setup_digits(self) -> None:
        self.chief.call("setup_mlp", sizes=list(DIGITS_SIZES), batch=DIGITS_BATCH, lr=DIGITS_LR,
                        examples=0, seed=SEED, workload="digits")

    def digits_accuracy(self) -> float:
        return self.chief.call("accuracy", workload="digits")["accuracy"]

    def run(self, workload: str, n: int) -> float:
        return self.chief.call("run", workload=workload, steps=n)["seconds"]

    def memory(self) -> list[dict]:
        by_dev = self.chief.call("placement")["bytes_by_device"]
        out = []
        for i, pid in enumerate(self.cluster.pids()["ps"]):
            held = by_dev.get(f"/job:ps/replica:0/task:{i}", 0)
            rss, base = rss_bytes(pid), self.ps_baseline[pid]
            out.append({"task": f"ps:{i}", "held_bytes": held, "rss_bytes": rss,
                        "baseline_rss_bytes": base,
                        "ratio": (rss - base) / held if held else float("nan")})
        return out

    def threads(self) -> dict[str, list[int]]:
        return {r: [thread_count(p) for p in ps] for r, ps in self.cluster.pids().items()}

    def close(self) -> None:
        self.cluster.close()


# -- report -------------------------------------------------------------------------------------
def _row(key: str, workload: str, ours: float | None, ref_name: str, ref: float | None,
         unit: str, note: str = "", targets: dict = TARGETS) -> dict:
    ratio = ours / ref if ours is not None and ref else None
    target = targets.get(key)
    met = None
    if target and ratio is not None:
        op, bound = target
        met = ratio >= bound if op == ">=" else ratio <= bound
    return {"key": key, "workload": workload, "ours": ours, "reference_name": ref_name,
            "reference": ref, "unit": unit, "ratio": ratio, "note": note,
            "target": f"{target[0]} {target[1]}" if target else None, "met": met}


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "skipped"
    if unit == "GB/s":
        return f"{v:.2f} GB/s"
    if unit == "MB":
        return f"{v / 1e6:.1f} MB"
    return f"{v:,.1f} {unit}" if v < 100 else f"{v:,.0f} {unit}"


def build_rows(res: dict) -> list[dict]:
    raw = res["raw"]
    a, b, tf = res.get("mlp", {}), res.get("emb", {}), res.get("tf_skipped")
    tfname = "TF PS strategy async" if not tf else "TF (skipped)"

    row = functools.partial(_row, targets=TARGETS_HOSTS if res.get("hosts") else TARGETS)

    def sps(d: dict, k: str) -> float | None:
        return d[k]["steps_per_s"] if k in d else None

    rows = [
        row("raw_read", "(c) 64 MiB read", raw["ours_read"]["best_GBps"], "raw TCP download",
             raw["tcp_download"]["best_GBps"], "GB/s", "best of rounds"),
        row("raw_push", "(c) 64 MiB push (SGD)", raw["ours_push"]["best_GBps"], "raw TCP upload",
             raw["tcp_upload"]["best_GBps"], "GB/s", "best of rounds"),
        row("mlp_async_vs_tf", "(a) MLP async", sps(a, "ours_async"), tfname,
             sps(a, "tf_async"), "steps/s"),
        row("mlp_async2_vs_tf", "(a) MLP async, 2 closures/worker", sps(a, "ours_async2"),
             tfname, sps(a, "tf_async"), "steps/s", "ClusterCoordinator(closures_per_worker=2)"),
        row("mlp_sync_vs_tf_async", "(a) MLP sync (2 replicas)", sps(a, "ours_sync"), tfname,
             sps(a, "tf_async"), "steps/s", "a step = one replica closure of batch 128"),
        row("mlp_allreduce_vs_sync", "(a) MLP all-reduce mode (2 replicas)",
            sps(a, "ours_allreduce"), "ours, PS sync mode", sps(a, "ours_sync"), "steps/s",
            "mirrored variables, ring all-reduce among the workers (coordinator/mirrored.py)"),
        row("mlp_async_vs_ceiling", "(a) MLP async", sps(a, "ours_async"),
             "ceiling: numpy fwd+bwd x 2", a["ceiling"]["steps_per_s"] if "ceiling" in a else None,
             "steps/s"),
        row("mlp_async_vs_wire", "(a) MLP async", sps(a, "ours_async"),
             "wire ceiling: the step over bare TCP", sps(a, "wire_ceiling"), "steps/s",
             "bench/wire_ceiling.py: the same bytes, no framing or checks"),
        row("wire_vs_ceiling", "(a) wire ceiling (bare TCP)", sps(a, "wire_ceiling"),
             "ceiling: numpy fwd+bwd x 2", a["ceiling"]["steps_per_s"] if "ceiling" in a else None,
             "steps/s", "what any implementation could reach here"),
    ]
    for d in EMB_DISTS:
        for two in ("", "2"):
            k = f"ours_{d}{two}"
            note = ""
            if k in b:
                note = f"ours {b[k]['steps_per_s'] * EMB_IDS / 1e3:,.0f} k rows/s"
                if f"tf_{d}" in b:
                    note += f", TF {b[f'tf_{d}']['steps_per_s'] * EMB_IDS / 1e3:,.0f} k rows/s"
            rows.append(row(f"emb_{d}{two}_vs_tf", f"(b) embedding {d} async"
                            + (", 2 closures/worker" if two else ""), sps(b, k), tfname,
                            sps(b, f"tf_{d}"), "steps/s", note))
    e = res.get("ctr")
    if e:
        per = e["batch"]
        note = "held-out AUC " + ", ".join(
            f"{k.replace('_ctr', '')} {v['auc']:.4f}" for k, v in e.items()
            if isinstance(v, dict) and "auc" in v) + f" (planted model {e['ceiling_auc']:.4f})"
        rows.append(row("ctr_vs_tf", "(e) CTR, DLRM, one dynamic table",
                        None if "ours_ctr" not in e else sps(e, "ours_ctr") * per,
                        "TF, 26 tables of id % 100,000",
                        None if "tf_ctr" not in e else sps(e, "tf_ctr") * per, "samples/s", note))
        feats = None if "ours_ctr_features" not in e else sps(e, "ours_ctr_features") * per
        rows.append(row("ctr_features_vs_tf", "(e) CTR, DLRM, 26 per-feature tables "
                        "(EmbeddingCollection, widths 4/8/16)", feats,
                        "TF, 26 tables of id % 100,000, same widths",
                        None if "tf_ctr_features" not in e else
                        sps(e, "tf_ctr_features") * per, "samples/s"))
        rows.append(row("ctr_features_vs_shared", "(e) CTR, 26 per-feature tables", feats,
                        "ours, one shared table",
                        None if "ours_ctr" not in e else sps(e, "ours_ctr") * per, "samples/s"))
    d = res.get("shaped")
    if d:
        link = d["link"]["rate"] + (f", {d['link']['delay']}" if d["link"]["delay"] else "")
        acc = "; test accuracy " + ", ".join(
            f"{k.replace('ours_', 'ours ')} {v['test_accuracy']:.3f}"
            for k, v in d.items() if "test_accuracy" in v)
        rows.append(row("shaped_fp16_vs_tf", f"(d) digits MLP, {link} links, fp16",
                         sps(d, "ours_fp16"), tfname, sps(d, "tf"), "steps/s",
                         f"ours float32 {sps(d, 'ours_fp32'):.1f} steps/s{acc}"))
        if "ours_fp16_2" in d:
            rows.append(row("shaped_fp16_2_vs_tf", "(d) the same, 2 closures/worker",
                             sps(d, "ours_fp16_2"), tfname, sps(d, "tf"), "steps/s",
                             f"ours float32 {sps(d, 'ours_fp32_2'):.1f} steps/s"))
    rows += allreduce_rows(res.get("allreduce"), row)
    mem = res.get("memory")
    if mem:
        worst = max(mem["ours"], key=lambda m: m["ratio"])
        rows.append(row("ps_memory", "PS RSS above empty baseline (worst ps)",
                         worst["rss_bytes"] - worst["baseline_rss_bytes"],
                         "bytes of variables, slots, tables held", worst["held_bytes"], "MB"))
    return rows


def allreduce_rows(f: dict | None, row) -> list[dict]:
    """(f)'s rows (``row``: _row with the targets) from run_allreduce's results."""
    if not f:
        return []
    rows = []
    ring = f.get("ring") or {}
    for n in (2, 4):
        m = ring.get("members", {}).get(str(n))
        rows.append(row(f"allreduce_{n}_vs_gloo", f"(f) 64 MiB all-reduce, {n} workers",
                        None if m is None else m["bus_GBps"]["ours"], "torch.distributed gloo",
                        None if m is None else m["bus_GBps"]["gloo"], "GB/s",
                        f.get("ring_skipped", "bus bandwidth, medians")))
    t = f.get("training") or {}
    med = t.get("median", {})
    rows.append(row("mlp_allreduce4_vs_sync", "(f) MLP all-reduce mode, 4 workers",
                    med.get("allreduce"), "ours, PS sync mode", med.get("sync"),
                    "steps/s", "global steps (4 replicas of batch 128)"))
    rows.append(row("mlp_allreduce4_vs_tf_mwms", "(f) MLP all-reduce mode, 4 workers",
                    med.get("allreduce"), "TF MultiWorkerMirrored (RING)", med.get("tf_mwms"),
                    "steps/s", "bench/tf_mwms.py"))
    return rows


def print_rows(rows: list[dict]) -> None:
    from bench.common import print_table
    table = []
    for r in rows:
        verdict = "" if r["target"] is None else (
            f"{r['target']}: " + ("n/a" if r["met"] is None else "met" if r["met"] else "NOT met"))
        table.append([r["workload"], _fmt(r["ours"], r["unit"]),
                      f"{r['reference_name']}: {_fmt(r['reference'], r['unit'])}",
                      "-" if r["ratio"] is None else f"{r['ratio']:.2f}", verdict, r["note"]])
    print_table(["workload", "ours", "reference (same run)", "ratio", "target", "note"], table,
                title="## bench.suite: ours vs references (ratio = ours / reference)")


def print_details(res: dict) -> None:
    from bench.common import print_table
    rows = []
    for wl, block in (("(a) mlp", res.get("mlp", {})), ("(b) emb", res.get("emb", {})),
                      ("(e) ctr", res.get("ctr", {})), ("(d) digits", res.get("shaped", {}))):
        for k, v in block.items():
            if not isinstance(v, dict) or "steps_per_s" not in v:
                continue
            c = v.get("cpu_ms_per_step")
            rows.append([wl, k, f"{v['steps_per_s']:.1f}", f"{v['steps_per_s_best']:.1f}",
                         "" if not c else "  ".join(f"{r} {ms:.2f}" for r, ms in c.items()),
                         "" if not c else f"{sum(c.values()):.2f}",
                         "" if "busy_cores" not in v else f"{v['busy_cores']:.2f}",
                         "" if "other_processes_busy_cores" not in v
                         else f"{v['other_processes_busy_cores']:.2f}"])
    print_table(["workload", "variant", "steps/s (median)", "steps/s (best)",
                 "CPU ms per step by role", "CPU ms/step", "busy cores",
                 "other processes' busy cores"], rows,
                title="## details (timed blocks)")
    mem = res.get("memory", {})
    mrows = []
    for side in ("ours", "tf"):
        for m in mem.get(side, []):
            mrows.append([side, m.get("address") or m.get("task"), f"{m['held_bytes'] / 1e6:.1f} MB",
                          f"{m['baseline_rss_bytes'] / 1e6:.1f} MB", f"{m['rss_bytes'] / 1e6:.1f} MB",
                          f"{m['ratio']:.2f}"])
    if mrows:
        print_table(["side", "parameter server", "variables + slots", "RSS empty", "RSS at end",
                     "(RSS - empty) / held"], mrows, title="## parameter-server memory")


# -- main -------------------------------------------------------------------------------------
def run_suite(plan: Plan, *, use_tf: bool, tls: bool, tf_log: str,
              task_env: dict[str, str] | None = None, hosts=None) -> dict:
    """``hosts``: a bench/hosts.py TestHosts of 9 (or None: every task on
    127.0.0.1): ours on 0-3, TensorFlow's on 4-8, this process (our
    coordinator) on the switch."""
    res: dict = {"threads": {"env": BLAS_ENV, "suite_blas": blas_threads()},
                 "hosts": hosts is not None}
    res["raw"] = measure_raw(plan, None if hosts is None else (hosts.addresses[0], hosts.run(0)))
    ours_at = tf_at = None
    if hosts is not None:
        ours_at = hosts.placement(ps=[0, 1], worker=[2, 3])
        tf_place = hosts.placement(ps=[4, 5], worker=[6, 7])
        tf_at = lambda job, i: (hosts.addresses[8], hosts.run(8)) if job == "chief" \
            else tf_place(job, i)

    reason = None if use_tf else "--no-tf given: TensorFlow rows skipped"
    reason = reason or tf_missing_reason()
    tf = None
    with contextlib.ExitStack() as stack:
        log(f"starting our cluster ({NUM_PS} ps + {NUM_WORKERS} workers"
            f"{', mutual TLS' if tls else ', plaintext'})")
        ours = Ours(tls, env=task_env, placement=ours_at)
        stack.callback(ours.close)
        if reason is None:
            log("starting the TensorFlow cluster (2 ps + 2 workers + chief)")
            try:
                tf = TF(tf_log, placement=tf_at)
                stack.callback(tf.close)
                res["tensorflow"] = tf.chief.hello.get("tensorflow")
                log("TensorFlow: creating variables and datasets")
                tf.setup()
            except Exception as exc:
                reason = f"the TensorFlow reference failed to start: {exc}"
                if tf is not None:
                    tf.close()
                tf = None
        if reason:
            log(reason)
            res["tf_skipped"] = reason
        log("ours: creating variables and datasets")
        ours.setup_mlp()
        ours.setup_emb()

        ceiling_run = make_ceiling()
        cores = min(os.cpu_count() or 1, NUM_WORKERS)
        variants = [Variant("ours_async", functools.partial(ours.run_mlp, "async"), plan.mlp_steps,
                            ours.meter),
                    Variant("ours_async2", functools.partial(ours.run_mlp, "async2"),
                            plan.mlp_steps, ours.meter),
                    Variant("ours_sync", functools.partial(ours.run_mlp, "sync"), plan.mlp_steps,
                            ours.meter),
                    Variant("ours_allreduce", functools.partial(ours.run_mlp, "allreduce"),
                            plan.mlp_steps, ours.meter)]
        if tf:
            variants.append(Variant("tf_async", functools.partial(tf.run, "mlp"), plan.mlp_steps,
                                    tf.meter))
        ceiling = Variant("ceiling_1proc", ceiling_run, plan.mlp_steps // 2)
        variants.append(ceiling)
        wire = stack.enter_context(wire_ceiling(ours, ours_at))
        variants.append(Variant("wire_ceiling", wire.run, plan.mlp_steps,
                                CPUMeter({"ps": wire.pids["ps"], "workers": wire.pids["workers"]})))
        run_interleaved(variants, plan.rounds, plan.warmup_blocks, "(a) mlp")
        res["mlp"] = {v.key: v.result() for v in variants}
        c = res["mlp"]["ceiling_1proc"]
        res["mlp"]["ceiling"] = {"steps_per_s": c["steps_per_s"] * cores,
                                 "steps_per_s_best": c["steps_per_s_best"] * cores,
                                 "processes": cores}
        for k in ("ours_sync", "ours_allreduce"):
            res["mlp"][k]["global_steps_per_s"] = res["mlp"][k]["steps_per_s"] / NUM_WORKERS

        variants = []
        for d in EMB_DISTS:
            variants.append(Variant(f"ours_{d}", functools.partial(ours.run_emb, d), plan.emb_steps,
                                    ours.meter))
            variants.append(Variant(f"ours_{d}2", functools.partial(ours.run_emb, d, mode="async2"),
                                    plan.emb_steps, ours.meter))
            if tf:
                variants.append(Variant(f"tf_{d}", functools.partial(tf.run, f"emb_{d}"),
                                        plan.emb_steps, tf.meter))
        run_interleaved(variants, plan.rounds, plan.warmup_blocks, "(b) emb")
        res["emb"] = {v.key: {**v.result(), "rows_per_s": v.result()["steps_per_s"] * EMB_IDS}
                      for v in variants}

        res["ctr"] = run_ctr(plan, ours, tf)

        res["memory"] = {"ours": ours.memory()}
        res["threads"]["ours_tasks"] = {
            "ps": [thread_count(t.task_pid) for t in ours.cluster.ps],
            "workers": [thread_count(t.task_pid) for t in ours.cluster.workers]}
        if tf:
            res["memory"]["tf"] = tf.memory()
            res["threads"]["tf_tasks"] = tf.threads()
        if hosts is not None:
            res["shaped"] = run_shaped(plan, hosts, ours, tf)
    return res


def run_allreduce(plan: Plan, use_tf: bool) -> dict:
    """(f), across hosts: bench_allreduce (vs gloo) and bench_allreduce_training
    (4 workers; with TensorFlow, its MultiWorkerMirroredStrategy), each a
    process of its own (they make test hosts of their own), their JSON."""
    import json
    import subprocess
    import tempfile
    out: dict = {}
    rounds = str(max(2, plan.rounds))
    with tempfile.TemporaryDirectory() as d:
        runs = {"training": ["bench.bench_allreduce_training", "--hosts", "--workers", "4",
                             "--rounds", rounds, *(["--tf"] if use_tf else [])]}
        if importlib.util.find_spec("torch") is None:
            out["ring_skipped"] = "torch is not installed: no gloo reference"
        else:
            runs["ring"] = ["bench.bench_allreduce", "--hosts", "--members", "2", "4",
                            "--rounds", rounds]
        for key, cmd in runs.items():
            log(f"(f) {key}: python -m {' '.join(cmd)}")
            path = os.path.join(d, f"{key}.json")
            subprocess.run([sys.executable, "-m", *cmd, "--json", path], check=True,
                           stdout=subprocess.DEVNULL)
            with open(path) as fh:
                out[key] = json.load(fh)
    return out


def wire_ceiling(ours: "Ours", placement=None):
    """(a)'s step over bare TCP (bench/wire_ceiling.py): the same bytes
    between the same places as our async MLP (its shards on the servers
    that hold ours; ``placement``: where ours run, as LocalCluster takes
    it, None: this machine), workers bound to the same CPUs; a context
    manager."""
    from bench.wire_ceiling import layout_of, running
    model = ours.mlp["async"][2]
    shards = layout_of(model.variables, [t.address for t in ours.cluster.ps])
    where = placement or (lambda role, i: ("127.0.0.1", []))
    cpus = sorted(os.sched_getaffinity(0)) if PIN_WORKERS else None
    return running(MLP_SIZES, shards, MLP_LR, [where("ps", i) for i in range(NUM_PS)],
                   [where("worker", i) for i in range(NUM_WORKERS)], cpus)


def run_ctr(plan: Plan, ours: "Ours", tf: "TF | None") -> dict:
    """(e): the CTR workload, ours and TensorFlow's in interleaved blocks;
    samples/s, and each model's held-out AUC after its blocks."""
    from bench import bench_ctr as C
    from coordinator import ctr_data as D
    log("(e) ctr: creating variables, tables and datasets")
    ours.setup_ctr()
    out = _race(plan, [Variant("ours_ctr", ours.run_ctr, plan.ctr_steps, ours.meter),
                       Variant("ours_ctr_features", ours.run_ctr_features, plan.ctr_steps,
                               ours.meter)],
                tf, "tf_ctr", "ctr", "(e) ctr", tf_also={"tf_ctr_features": "ctr_features"})
    out["ours_ctr"]["auc"] = ours.ctr.auc()
    out["ours_ctr_features"]["auc"] = ours.ctr_features.auc()
    if tf:
        out["tf_ctr"]["auc"] = tf.ctr_auc()
        out["tf_ctr_features"]["auc"] = tf.ctr_auc("ctr_features")
    out.update(batch=C.BATCH, ceiling_auc=D.bayes_auc(C.SEED + 1, 20 * C.BATCH),
               steps_trained=_steps_trained(plan, plan.ctr_steps))
    return out


def _race(plan: Plan, ours: list[Variant], tf: "TF | None", tf_key: str, workload: str,
          what: str, tf_also: dict[str, str] | None = None) -> dict:
    """Our variants and, where TensorFlow runs, its ``workload`` (made by
    ``tf.setup_<workload>()``) as ``tf_key`` (and the other workloads that
    setup made, ``tf_also``: key -> workload), in interleaved blocks:
    {key: Variant.result()}."""
    variants = list(ours)
    if tf:
        getattr(tf, f"setup_{workload}")()
        for key, name in {tf_key: workload, **(tf_also or {})}.items():
            variants.append(Variant(key, functools.partial(tf.run, name), ours[0].steps,
                                    tf.meter))
    run_interleaved(variants, plan.rounds, plan.warmup_blocks, what)
    return {v.key: v.result() for v in variants}


def _steps_trained(plan: Plan, steps: int) -> int:
    """Steps each variant trained: the warm-up block, then every timed block."""
    return max(4, int(steps * plan.warmup_blocks)) + plan.rounds * steps


def run_shaped(plan: Plan, hosts, ours: "Ours", tf: "TF | None") -> dict:
    """(d): every test host's link shaped, the digits MLP trained by ours
    (float32, and fp16 both ways) and TensorFlow's (float32: it has no
    compression) for the same number of steps; steps/s and test accuracy."""
    from bench.hosts import netem_available
    delay = SHAPED_DELAY if netem_available() else None
    for i in range(len(hosts.addresses)):
        hosts.shape(i, rate=SHAPED_RATE, delay=delay)
    log(f"(d): every link shaped to {SHAPED_RATE}"
        + (f", {delay} each way" if delay else " (no delay: this kernel has no netem)"))
    ours.setup_digits()
    keys = ("fp32", "fp16", "fp32_2", "fp16_2")   # _2: closures_per_worker=2
    out = _race(plan, [Variant(f"ours_{k}", functools.partial(ours.run_mlp, f"digits_{k}"),
                               plan.digits_steps, ours.meter) for k in keys],
                tf, "tf", "digits", "(d) digits, shaped links")
    steps = _steps_trained(plan, plan.digits_steps)
    for k in keys:
        out[f"ours_{k}"]["test_accuracy"] = ours.digits_accuracy(k)
    if tf:
        out["tf"]["test_accuracy"] = tf.digits_accuracy()
    out["link"] = {"rate": SHAPED_RATE, "delay": delay, "steps_trained": steps,
                   "batch": DIGITS_BATCH, "sizes": list(DIGITS_SIZES)}
    return out


def _transport(task_env: dict[str, str], on_hosts: bool = False) -> str:
    if on_hosts:
        return (" + data ports (TCP); every task on a test host of its own (network, mount, "
                "IPC and PID namespaces)")
    if task_env.get("PSTRAIN_SHM") != "0":
        return " + same-host shared memory and local sockets"
    if task_env.get("PSTRAIN_DATA") == "0" and os.environ.get("PSTRAIN_DATA") == "0":
        return " only"
    return " + data ports (TCP), as between hosts"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter blocks (under 2 minutes)")
    p.add_argument("--json", metavar="PATH",
                   help="where to write every number (default bench/results/suite[-quick].json)")
    p.add_argument("--no-tf", action="store_true", help="skip the TensorFlow reference")
    p.add_argument("--task-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for our parameter servers and workers "
                        "(repeatable; for A/B runs of a setting)")
    p.add_argument("--hosts", action="store_true",
                   help="every task, ours and TensorFlow's, on a test host of its own "
                        "(network namespaces with a private /dev/shm, bench/hosts.py; root)")
    p.add_argument("--tls", action="store_true",
                   help="run our cluster with mutual TLS (LocalCluster's default); "
                        "default plaintext, as TensorFlow's gRPC here")
    args = p.parse_args(argv)
    from bench.common import machine_info, write_json
    plan = QUICK if args.quick else FULL
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = os.path.join(root, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    path = args.json or os.path.join(
        out_dir, f"suite{'-hosts' if args.hosts else ''}{'-quick' if args.quick else ''}.json")
    t0 = time.perf_counter()
    task_env = dict(kv.split("=", 1) for kv in args.task_env)
    with contextlib.ExitStack() as stack:
        test_hosts = None
        if args.hosts:
            from bench import hosts
            ok, why = hosts.available()
            if not ok:
                p.error(f"--hosts: {why}")
            test_hosts = stack.enter_context(hosts.TestHosts(9))
        res = run_suite(plan, use_tf=not args.no_tf, tls=args.tls,
                        tf_log=os.path.join(out_dir, "tf_chief.log"), task_env=task_env,
                        hosts=test_hosts)
    if args.hosts:   # (f): after the suite's test hosts are gone (they make their own)
        res["allreduce"] = run_allreduce(plan, use_tf=not args.no_tf and not res.get(
            "tf_skipped"))
    elapsed = time.perf_counter() - t0
    rows = build_rows(res)
    print_rows(rows)
    print_details(res)
    if res.get("tf_skipped"):
        print(f"\nNOTE: {res['tf_skipped']}")
    print(f"\n({'quick' if args.quick else 'full'} plan, {elapsed:.0f} s, {os.cpu_count()} CPUs; "
          f"threads: {', '.join(f'{k}={v}' for k, v in BLAS_ENV.items())} in every process; "
          f"{'workers bound to one CPU each; ' if PIN_WORKERS else ''}"
          f"TensorFlow intra_op {TF_INTRA_OP}, inter_op "
          f"{', '.join(f'{k} {v}' for k, v in TF_INTER_OP.items())}; ours "
          f"{'mutual TLS' if args.tls else 'plaintext'} gRPC"
          f"{_transport(task_env, args.hosts)}"
          + (f"; our tasks' extra env: {task_env}" if task_env else "") + ")")
    write_json(path, {"benchmark": "suite", "machine": machine_info(), "plan": dataclasses.asdict(plan),
                      "elapsed_s": elapsed, "tls": args.tls, "task_env": task_env,
                      "hosts": args.hosts,
                      "tf_threads": {"intra_op": TF_INTRA_OP, "inter_op": TF_INTER_OP},
                      "summary": rows, **res})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    # Run as the module bench.suite (not __main__) so workers import its functions by name.
    from bench.suite import main as _main
    sys.exit(_main())
