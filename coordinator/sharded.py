"""Sharded datasets: the coordinator hands out batches, the workers read them.

    source = ShardedSource.from_arrays(x, y, shard_sizes=[1000, 3000, 5000])
    ds = coord.create_sharded_dataset(source, batch_size=64)   # exactly once, by default
    it = iter(ds)

    def step(it):                  # runs on a worker
        x, y = next(it)            # the batch bound to this closure, read on the worker
        ...
        push_gradients(...)

    for _ in range(ds.batches_per_epoch):          # one epoch (fit does this for you)
        coord.schedule(step, args=(it,))
    coord.join()

A ``ShardedSource`` has ``num_shards`` shards of known sizes (examples) and
``read(shard, start, count)``, which runs on the worker. The source travels
to each worker once (as a per-worker dataset's ``dataset_fn`` does): an
array source carries its arrays (one gRPC message, up to 64 MiB pickled),
a generator source its function. An epoch is a fixed set of batches:
shard s is cut into batches of ``batch_size`` examples from its start (its
last one shorter, unless ``drop_remainder``).

Dispatch (the coordinator owns every shard's position). A batch
(epoch, shard, start, count) is bound to a closure when a worker's thread
*takes* the closure from the queue, not when it is scheduled, so a faster
worker takes more batches. Each worker reads a range of batches of one
shard in order (locality: a generator source goes on where it was); when
its range is done it takes the unclaimed range with the most examples
left, and when none is left it takes part of the range of the worker with
the most left, in proportion to the two workers' measured speeds (at least
one batch; half while speeds are unknown). So uneven shards and slow
workers do not stall the end of an epoch. A closure whose worker died or
restarted goes back to the queue with its batch (ClusterCoordinator's
re-queue), and runs on another worker; a closure that fails otherwise,
or is cancelled, gives its batch back, and the next closure taken gets it.
A batch is acknowledged when its closure's result comes back; an epoch
ends when every one of its batches is acknowledged (``epochs_completed``,
``wait_epoch``). The dataset repeats: a closure taken when every batch of
the epoch was handed out gets a batch of the next epoch.

Visitation, per epoch:

* ``"at_least_once"``: a batch whose closure did not come back is trained
  again on another worker; whatever its first run pushed stays applied, so
  its update may be applied twice. ``stats().reruns`` counts the batches
  handed out again (an upper bound on the batches trained twice: a first
  run may have died before pushing anything).
* ``"exactly_once"`` (default): as at-least-once, and every push made
  inside the step (``push_gradients``, ``ShardedVariable.push_sparse``,
  ``DynamicEmbedding.push_gradient[_async]``) carries an update key derived
  from (dataset, epoch, shard, start, the label of the variable or table
  shard, how many keys the step asked for that label before) instead of a
  random one (coordinator.calls.update_key_scope). A parameter server that
  applied a key drops a later update with the same key. So each batch's
  update of each variable shard and table shard is applied **at most
  once**, and once its epoch has ended, **exactly once**. When a worker died
  after some of a step's pushes landed, the re-run's pushes to those shards
  are dropped and the others are applied from the re-run's own gradients
  (computed from the parameters as they are then, not as the first run
  read them). Bounds of the guarantee: the step must make the same pushes
  in the same order per variable on every run (deterministic given its
  batch), from the thread that runs it; a server remembers the keys of the
  last 8,192 updates of each shard (psserver/replication.py
  APPLIED_IDS_KEPT), so a re-run must reach it before that many later
  updates of that shard (a dead worker is noticed within seconds, its
  batch re-run at once); a parameter server that restarts without
  replication is refilled from the latest checkpoint, which carries its
  variables' keys, but the updates after that checkpoint are lost on its
  shards (neither applied nor re-applied): exactly-once holds across a
  parameter-server failure with ``replication=True`` (shard copies carry
  the keys), not without. Dynamic tables' keys are not in checkpoints.
  Calls made with a PSClient directly carry no such keys.

Sync and hybrid modes have neither: a replica whose worker dies is
abandoned, not re-run, and its gradients are keyed by (step, replica);
``create_sharded_dataset`` refuses them (use per-worker datasets there).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from coordinator import calls, datasets
from coordinator import metrics as _metrics
from protos.pstrain.v1 import worker_pb2
from psserver.contract import FailedPrecondition, InvalidArgument

VISITATIONS = ("exactly_once", "at_least_once")


# -- sources (user-facing; read on the workers) ------------------------------------------
class ShardedSource:
    """Shards of examples that a worker reads by range. Subclass it with
    ``shard_sizes`` and ``read``, or use ``from_arrays`` / ``from_generator``.

    ``read(shard, start, count)`` runs on a worker and returns the batch of
    examples [start, start + count) of that shard (any value: it is not
    pickled, the step gets it as it is); ``sharded.current_batch()`` there
    tells it the epoch too.
    """

    def __init__(self, shard_sizes: Sequence[int]):
        sizes = tuple(int(n) for n in shard_sizes)
        if not sizes or any(n < 0 for n in sizes) or not sum(sizes):
            raise ValueError(f"shard_sizes must be one or more sizes >= 0 with at least one "
                             f"example in all, got {list(shard_sizes)!r}")
        if any(n != s for n, s in zip(sizes, shard_sizes)):
            raise ValueError(f"shard_sizes must be integers, got {list(shard_sizes)!r}")
        self.shard_sizes = sizes

    @property
    def num_shards(self) -> int:
        return len(self.shard_sizes)

    def read(self, shard: int, start: int, count: int) -> Any:
        raise NotImplementedError("a ShardedSource subclass reads its examples in read()")

    # worker-side caches stay on the worker
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_w_")}

    @staticmethod
    def from_arrays(*arrays: np.ndarray, shard_sizes: Sequence[int] | None = None,
                    num_shards: int | None = None, shuffle: bool = True,
                    seed: int = 0) -> "ArraySource":
        """Aligned arrays cut into consecutive shards: ``shard_sizes`` (uneven
        index ranges), or ``num_shards`` as even as they come. A batch is a
        tuple of arrays (one array for one array). ``shuffle``: each epoch
        reads each shard in its own order, a function of (seed, epoch, shard)
        alone, so every worker reads the same examples for a batch."""
        return ArraySource(arrays, shard_sizes, num_shards, shuffle, seed)

    @staticmethod
    def from_generator(fn: Callable[[int], Iterable], shard_sizes: Sequence[int]) -> "GeneratorSource":
        """``fn(shard)`` yields shard ``shard``'s examples in order (a tuple of
        arrays or numbers, a dict of them, or one array each), at least
        ``shard_sizes[shard]`` of them. A batch stacks ``count`` examples."""
        return GeneratorSource(fn, shard_sizes)


def _is_int(v) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


class ArraySource(ShardedSource):
    """ShardedSource.from_arrays."""

    def __init__(self, arrays, shard_sizes, num_shards, shuffle: bool, seed: int):
        if not arrays:
            raise ValueError("from_arrays needs at least one array")
        arrays = tuple(np.asarray(a) for a in arrays)
        n = len(arrays[0])
        if any(a.ndim == 0 or len(a) != n for a in arrays):
            raise ValueError(f"arrays must be aligned along axis 0, got lengths "
                             f"{[len(a) if a.ndim else None for a in arrays]}")
        if (shard_sizes is None) == (num_shards is None):
            raise ValueError("give shard_sizes or num_shards (one of them)")
        # Checked here, not when a worker reads (np.random.default_rng
        # refuses a negative seed there, on every read).
        if not _is_int(seed) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if not isinstance(shuffle, (bool, np.bool_)):
            raise ValueError(f"shuffle must be True or False, got {shuffle!r}")
        if shard_sizes is None:
            if not _is_int(num_shards) or not 1 <= num_shards <= n:
                raise ValueError(f"num_shards must be an integer in [1, {n}], got {num_shards!r}")
            shard_sizes = [n // num_shards + (i < n % num_shards) for i in range(num_shards)]
        super().__init__(shard_sizes)
        if sum(self.shard_sizes) != n:
            raise ValueError(f"shard_sizes sum to {sum(self.shard_sizes)}, but the arrays hold "
                             f"{n} examples")
        self.arrays, self.shuffle, self.seed = arrays, bool(shuffle), int(seed)
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.shard_sizes[:-1]))

    def _order(self, shard: int) -> np.ndarray:
        epoch = current_batch_epoch()
        cache = self.__dict__.setdefault("_w_orders", {})
        hit = cache.get(shard)
        if hit is None or hit[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch, shard])
            hit = cache[shard] = (epoch, rng.permutation(self.shard_sizes[shard]))
        return hit[1]

    def read(self, shard: int, start: int, count: int):
        lo = self.offsets[shard]
        if self.shuffle:
            idx = self._order(shard)[start:start + count] + lo
            out = tuple(a[idx] for a in self.arrays)
        else:
            out = tuple(a[lo + start:lo + start + count] for a in self.arrays)
        return out[0] if len(out) == 1 else out


class GeneratorSource(ShardedSource):
    """ShardedSource.from_generator. The worker keeps one open generator per
    shard and its position: a batch that starts where the generator is goes
    on from there; one further on skips the examples between (read and
    dropped); one before it makes the generator again and skips to it. The
    cost of a skip is producing the skipped examples: dispatch keeps a
    worker on consecutive batches of a shard, so skips happen when a worker
    takes over part of another's range (once per take-over) and when a
    batch is re-run elsewhere."""

    def __init__(self, fn: Callable[[int], Iterable], shard_sizes: Sequence[int]):
        if not callable(fn):
            raise TypeError(f"from_generator needs a function fn(shard), got {type(fn).__name__}")
        super().__init__(shard_sizes)
        self.fn = fn

    def read(self, shard: int, start: int, count: int):
        state = self.__dict__.setdefault("_w_open", {})
        it, pos = state.get(shard, (None, 0))
        if it is None or pos > start:
            it, pos = iter(self.fn(shard)), 0
            self.__dict__["_w_restarts"] = self.__dict__.get("_w_restarts", 0) + 1
        out = []
        try:
            for _ in range(start - pos):
                next(it)
            self.__dict__["_w_skipped"] = self.__dict__.get("_w_skipped", 0) + start - pos
            for _ in range(count):
                out.append(next(it))
        except StopIteration:
            state.pop(shard, None)
            raise ValueError(f"the generator of shard {shard} ended before example "
                             f"{start + len(out)}; its shard_sizes entry says "
                             f"{self.shard_sizes[shard]}: make them agree") from None
        state[shard] = (it, start + count)
        return _stack(out)

    @property
    def skipped(self) -> int:
        """On a worker: examples produced and dropped to reach a batch's start."""
        return self.__dict__.get("_w_skipped", 0)


def _stack(examples: list):
    first = examples[0]
    if isinstance(first, dict):
        return {k: np.stack([e[k] for e in examples]) for k in first}
    if isinstance(first, tuple):
        return tuple(np.stack(col) for col in zip(*examples))
    return np.stack(examples)


# -- the coordinator's side -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Batch:
    """Examples [start, start + count) of shard ``shard`` in epoch ``epoch``."""
    epoch: int
    shard: int
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class DataStats:
    """A sharded dataset's counters (``ShardedDataset.stats()``).

    ``epoch``: the epoch batches are handed out of now; ``epochs_completed``:
    epochs every batch of which was acknowledged (the first that is not);
    ``reruns``: batches handed out again because their closure did not come
    back (its worker died or restarted, a parameter server was recovered,
    the closure failed or was cancelled); ``positions``: per shard, the
    examples acknowledged from its start without a gap, in the oldest epoch
    not completed."""
    epoch: int
    epochs_completed: int
    batches_per_epoch: int
    dispatched: int
    acknowledged: int
    reruns: int
    in_flight: int
    positions: tuple[int, ...]


class _Dispatch:
    """Which batch each closure gets; decided under one lock (see the module
    docstring). Workers are named by address."""

    #: weight of the newest batch time in a worker's running mean
    _EMA = 0.3

    def __init__(self, sizes: Sequence[int], batch_size: int, drop_remainder: bool,
                 clock: Callable[[], float] = time.monotonic):
        self.sizes, self.bs, self._clock = tuple(sizes), batch_size, clock
        self.nb = [n // batch_size if drop_remainder else -(-n // batch_size) for n in sizes]
        self.batches_per_epoch = sum(self.nb)
        if not self.batches_per_epoch:
            raise ValueError(f"no shard holds a whole batch of {batch_size} examples (sizes "
                             f"{list(sizes)}, drop_remainder=True): lower batch_size")
        self._cond = threading.Condition()
        self._epoch = -1
        self._free: list[list[int]] = []            # [shard, lo, hi) batch ranges unclaimed
        self._readers: dict[str, list[int]] = {}     # worker -> [shard, lo, hi) it reads
        self._redo: collections.deque[Batch] = collections.deque()
        self._inflight: dict[Batch, tuple[str, float]] = {}
        self._unacked: dict[int, int] = {}           # epoch -> batches not acknowledged
        self._acked: dict[int, list[set[int]]] = {}  # epoch -> per shard, batch indices
        self._seconds: dict[str, float] = {}         # worker -> mean seconds per batch
        self.dispatched = self.acknowledged = self.reruns = 0
        self.rerun_batches: collections.deque[Batch] = collections.deque(maxlen=1024)
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._epoch += 1
        self._free = [[s, 0, n] for s, n in enumerate(self.nb) if n]
        self._readers.clear()
        self._unacked[self._epoch] = self.batches_per_epoch
        self._acked[self._epoch] = [set() for _ in self.nb]

    def _examples(self, r: list[int]) -> int:
        s, lo, hi = r
        return max(0, min(hi * self.bs, self.sizes[s]) - lo * self.bs)

    def _batch(self, shard: int, i: int) -> Batch:
        start = i * self.bs
        return Batch(self._epoch, shard, start, min(self.bs, self.sizes[shard] - start))

    def _share(self, worker: str, victim: str, left: int) -> int:
        """Batches of ``left`` a worker takes over from ``victim``: in
        proportion to their speeds (half while either is unmeasured), >= 1."""
        a, b = self._seconds.get(worker), self._seconds.get(victim)
        share = left / 2 if a is None or b is None else left * b / (a + b)
        return max(1, min(left, int(round(share))))

    def take(self, worker: str) -> Batch:
        with self._cond:
            if self._redo:
                mine = self._readers.get(worker, [None])[0]
                pick = next((b for b in self._redo if b.shard == mine), self._redo[0])
                self._redo.remove(pick)
                self.reruns += 1
                self.rerun_batches.append(pick)
                _metrics.data_batches("rerun")
                return self._issue(pick, worker)
            while True:
                r = self._readers.get(worker)
                if r is not None and r[1] < r[2]:
                    r[1] += 1
                    return self._issue(self._batch(r[0], r[1] - 1), worker)
                if self._free:
                    best = max(self._free, key=self._examples)
                    self._free.remove(best)
                    self._readers[worker] = best
                    continue
                others = [(w, r) for w, r in self._readers.items() if w != worker and r[1] < r[2]]
                if others:
                    victim, r = max(others, key=lambda wr: self._examples(wr[1]))
                    cut = r[2] - self._share(worker, victim, r[2] - r[1])
                    self._readers[worker] = [r[0], cut, r[2]]
                    r[2] = cut
                    continue
                self._start_epoch()

    def _issue(self, batch: Batch, worker: str) -> Batch:
        self._inflight[batch] = (worker, self._clock())
        self.dispatched += 1
        _metrics.data_batches("dispatched")
        return batch

    def again(self, batch: Batch, worker: str) -> None:
        """A closure holding ``batch`` was taken again (re-queued after its
        worker failed): a re-run."""
        with self._cond:
            self.reruns += 1
            self.rerun_batches.append(batch)
            self._inflight[batch] = (worker, self._clock())
        _metrics.data_batches("rerun")

    def ack(self, batch: Batch) -> None:
        with self._cond:
            held = self._inflight.pop(batch, None)
            if held is None or batch.epoch not in self._unacked:
                return
            worker, since = held
            took = self._clock() - since
            mean = self._seconds.get(worker)
            self._seconds[worker] = took if mean is None else mean + self._EMA * (took - mean)
            self.acknowledged += 1
            self._acked[batch.epoch][batch.shard].add(batch.start // self.bs)
            self._unacked[batch.epoch] -= 1
            if not self._unacked[batch.epoch]:
                del self._unacked[batch.epoch]
                del self._acked[batch.epoch]
            self._cond.notify_all()
        _metrics.data_batches("acknowledged")

    def release(self, batch: Batch) -> None:
        """``batch``'s closure ended without a result: hand it out again."""
        with self._cond:
            if self._inflight.pop(batch, None) is not None:
                self._redo.append(batch)

    def completed(self) -> int:
        with self._cond:
            return min(self._unacked, default=self._epoch + 1)

    def wait_epoch(self, epoch: int, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: min(self._unacked, default=self._epoch + 1) > epoch, timeout)

    def stats(self) -> DataStats:
        with self._cond:
            oldest = min(self._unacked, default=None)
            positions = []
            for s, n in enumerate(self.nb):
                done = self._acked[oldest][s] if oldest is not None else set(range(n))
                k = 0
                while k in done:
                    k += 1
                positions.append(min(k * self.bs, self.sizes[s]))
            return DataStats(self._epoch, min(self._unacked, default=self._epoch + 1),
                             self.batches_per_epoch, self.dispatched, self.acknowledged,
                             self.reruns, len(self._inflight), tuple(positions))


class ShardedDataset:
    """What ``ClusterCoordinator.create_sharded_dataset`` returns: ``iter()``
    it for the handle a step takes as an argument (``next(it)`` there is the
    closure's batch). ``batches_per_epoch``; ``stats()``; ``epochs_completed``;
    ``wait_epoch(epoch)``. See the module docstring for dispatch and visitation."""

    def __init__(self, dataset_id: str, source: ShardedSource, batch_size: int,
                 visitation: str, drop_remainder: bool):
        self.dataset_id, self.source = dataset_id, source
        self.batch_size, self.visitation = batch_size, visitation
        self.exactly_once = visitation == "exactly_once"
        self._dispatch = _Dispatch(source.shard_sizes, batch_size, drop_remainder)

    @property
    def batches_per_epoch(self) -> int:
        return self._dispatch.batches_per_epoch

    @property
    def epochs_completed(self) -> int:
        """Epochs every batch of which was acknowledged (in order)."""
        return self._dispatch.completed()

    def wait_epoch(self, epoch: int, timeout: float | None = None) -> bool:
        """Block until every batch of ``epoch`` was acknowledged; False on timeout."""
        return self._dispatch.wait_epoch(epoch, timeout)

    def stats(self) -> DataStats:
        return self._dispatch.stats()

    @property
    def rerun_batches(self) -> list[Batch]:
        """The batches handed out again (the latest 1,024)."""
        with self._dispatch._cond:
            return list(self._dispatch.rerun_batches)

    # the closures' side (coordinator.closures.Closure)
    def take(self, worker: str) -> Batch:
        return self._dispatch.take(worker)

    def again(self, batch: Batch, worker: str) -> None:
        self._dispatch.again(batch, worker)

    def ack(self, batch: Batch) -> None:
        self._dispatch.ack(batch)

    def release(self, batch: Batch) -> None:
        self._dispatch.release(batch)

    def assignment(self, batch: Batch) -> worker_pb2.BatchAssignment:
        return worker_pb2.BatchAssignment(
            dataset_id=self.dataset_id, epoch=batch.epoch, shard=batch.shard,
            start=batch.start, count=batch.count, exactly_once=self.exactly_once)

    def __iter__(self) -> "ShardedIterator":
        return ShardedIterator(self)

    def __reduce__(self):
        raise TypeError("a ShardedDataset stays on the coordinator: pass iter(dataset) to "
                        "schedule() instead")


_collecting = threading.local()


@contextlib.contextmanager
def collect_datasets():
    """While pickling a closure's arguments: the sharded datasets whose
    iterators they hold ({dataset_id: ShardedDataset}, filled by pickling)."""
    found: dict[str, ShardedDataset] = {}
    previous = getattr(_collecting, "found", None)
    _collecting.found = found
    try:
        yield found
    finally:
        _collecting.found = previous


class ShardedIterator:
    """Stands for the batch bound to the closure it is an argument of: on the
    worker ``next(it)`` returns that batch (once per step)."""

    def __init__(self, dataset: ShardedDataset):
        self.dataset = dataset
        self.dataset_id = dataset.dataset_id

    def __reduce__(self):
        found = getattr(_collecting, "found", None)
        if found is not None:
            found[self.dataset_id] = self.dataset
        return _bound_iterator, (self.dataset_id,)

    def __next__(self):
        raise TypeError("a sharded dataset's iterator is consumed inside a scheduled "
                        "function on a worker, not on the coordinator")

    def __iter__(self):
        return self


def source_of(source: ShardedSource) -> ShardedSource:
    """The dataset_fn a sharded dataset's CreateDataset runs on a worker."""
    return source


# -- the worker's side ----------------------------------------------------------------------
_step = threading.local()
_locks: dict[str, threading.Lock] = {}
_locks_lock = threading.Lock()


def check_assignments(assignments: Sequence[worker_pb2.BatchAssignment]) -> None:
    """Refuse a closure's batches unless each names a sharded dataset created
    here, once, and examples its shard holds (InvalidArgument,
    FailedPrecondition); nothing has run yet."""
    seen = set()
    for a in assignments:
        if a.dataset_id in seen:
            raise InvalidArgument(f"dataset {a.dataset_id!r} has two batches in one closure; "
                                  "a closure reads one batch per sharded dataset")
        seen.add(a.dataset_id)
        source = datasets.get_dataset(a.dataset_id)
        if source is None:
            raise FailedPrecondition(f"sharded dataset {a.dataset_id!r} was not created on "
                                     "this worker; create it with "
                                     "ClusterCoordinator.create_sharded_dataset")
        if not isinstance(source, ShardedSource):
            raise InvalidArgument(f"dataset {a.dataset_id!r} on this worker is a per-worker "
                                  "dataset, not a sharded one: it takes no batches")
        if a.shard >= source.num_shards:
            raise InvalidArgument(f"batch of dataset {a.dataset_id!r}: shard {a.shard} does "
                                  f"not exist (the source has {source.num_shards})")
        size = source.shard_sizes[a.shard]
        if a.count < 1 or a.start + a.count > size:
            raise InvalidArgument(f"batch of dataset {a.dataset_id!r}: examples "
                                  f"[{a.start}, {a.start + a.count}) are not in shard "
                                  f"{a.shard} of {size} examples (count must be >= 1)")


@contextlib.contextmanager
def batch_scope(assignments: Sequence[worker_pb2.BatchAssignment]):
    """Run the body (a closure on a worker) with its batches bound: next()
    on their iterators reads them, and with an exactly-once batch its pushes
    carry update keys derived from the batches (calls.update_key_scope;
    without one, random keys)."""
    bound = {a.dataset_id: Batch(a.epoch, a.shard, a.start, a.count) for a in assignments}
    once = sorted(a.dataset_id for a in assignments if a.exactly_once)
    seed = "|".join(f"{d}/{bound[d].epoch}/{bound[d].shard}/{bound[d].start}"
                    for d in once).encode() or None
    previous = getattr(_step, "bound", None)
    _step.bound = (bound, set())
    try:
        with calls.update_key_scope(seed):
            yield
    finally:
        _step.bound = previous


def current_batch(dataset_id: str | None = None) -> Batch | None:
    """On a worker, inside a step: the batch bound to it (of ``dataset_id``;
    else the one being read, within a source's read(), or the step's first);
    None outside a step with one."""
    bound = getattr(_step, "bound", None)
    if not bound:
        return None
    if dataset_id is None:
        reading = getattr(_step, "reading", None)
        return reading if reading is not None else next(iter(bound[0].values()), None)
    return bound[0].get(dataset_id)


def current_batch_epoch() -> int:
    b = current_batch()
    return b.epoch if b is not None else 0


class _BatchIterator:
    """A sharded dataset's iterator on a worker."""

    def __init__(self, dataset_id: str):
        self.dataset_id = dataset_id

    def __iter__(self):
        return self

    def __next__(self):
        bound = getattr(_step, "bound", None)
        if bound is None or self.dataset_id not in bound[0]:
            raise LookupError(f"no batch of sharded dataset {self.dataset_id!r} is bound to "
                              "this call: pass iter(dataset) as an argument of schedule() "
                              "(not captured by the function) and call next() inside the step")
        batches, taken = bound
        if self.dataset_id in taken:
            raise RuntimeError(f"next() was called twice in one step on sharded dataset "
                               f"{self.dataset_id!r}: a step gets one batch (make "
                               "batch_size larger to train on more per step)")
        taken.add(self.dataset_id)
        b = batches[self.dataset_id]
        source = datasets.get_dataset(self.dataset_id)
        with _lock_of(self.dataset_id):
            _step.reading = b
            try:
                return source.read(b.shard, b.start, b.count)
            finally:
                _step.reading = None


def _lock_of(dataset_id: str) -> threading.Lock:
    with _locks_lock:
        lock = _locks.get(dataset_id)
        if lock is None:
            lock = _locks[dataset_id] = threading.Lock()
        return lock


def _bound_iterator(dataset_id: str) -> _BatchIterator:
    return _BatchIterator(dataset_id)
