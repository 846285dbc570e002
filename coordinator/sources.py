"""What a sharded dataset reads, and how a worker reads it: ``ShardedSource``,
and the batch bound to the closure running on this worker
(``batch_scope``, ``current_batch``). coordinator/sharded.py hands the
batches out.

A source has ``num_shards`` shards of known sizes (examples) and
``read(shard, start, count)``, which runs on the worker. It travels to each
worker once, as a per-worker dataset's ``dataset_fn`` does: an array source
carries its arrays (one gRPC message, up to 64 MiB pickled), a generator
source its function.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from coordinator import calls, datasets
from protos.pstrain.v1 import worker_pb2
from psserver.errors import FailedPrecondition, InvalidArgument


@dataclasses.dataclass(frozen=True)
class Batch:
    """Examples [start, start + count) of shard ``shard`` in epoch ``epoch``."""
    epoch: int
    shard: int
    start: int
    count: int


class ShardedSource:
    """Shards of examples that a worker reads by range. Subclass it with
    ``shard_sizes`` and ``read``, or use ``from_arrays`` / ``from_generator``.

    ``read(shard, start, count)`` runs on a worker and returns the batch of
    examples [start, start + count) of that shard (any value: it is not
    pickled, the step gets it as it is); ``sources.current_batch()`` there
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
def batch_scope(assignments: Sequence[worker_pb2.BatchAssignment],
                fallback: bytes | None = None):
    """Run the body (a closure on a worker) with its batches bound: next()
    on their iterators reads them, and with an exactly-once batch its pushes
    carry update keys derived from the batches (calls.update_key_scope;
    without one, from ``fallback``: an all-reduce step's replica; else
    random keys)."""
    bound = {a.dataset_id: Batch(a.epoch, a.shard, a.start, a.count) for a in assignments}
    once = sorted(a.dataset_id for a in assignments if a.exactly_once)
    seed = "|".join(f"{d}/{bound[d].epoch}/{bound[d].shard}/{bound[d].start}"
                    for d in once).encode()
    previous = getattr(_step, "bound", None)
    _step.bound = (bound, set())
    try:
        with calls.update_key_scope(seed or fallback, from_batch=bool(seed)):
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
