"""Per-worker datasets, as ``ClusterCoordinator.create_per_worker_dataset``.

``dataset_fn`` runs on every worker (on each restart too) and returns any
iterable: a generator, a list, ``batches(x, y, ...)``, a tf.data dataset.
``iter(per_worker_dataset)`` gives a ``PerWorkerIterator``: a handle that,
passed as an argument to a scheduled function, arrives on whichever worker
runs it as that worker's own iterator over its own copy of the data.
"""
from __future__ import annotations

import contextvars
import dataclasses
import inspect
import itertools
import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np


@dataclasses.dataclass(frozen=True)
class InputContext:
    """Passed to a ``dataset_fn`` that takes one argument, as tf.distribute does."""
    num_input_pipelines: int = 1   # number of workers
    input_pipeline_id: int = 0     # this worker's index

    def shard(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        """Every num_input_pipelines-th example, starting at input_pipeline_id."""
        return tuple(a[self.input_pipeline_id::self.num_input_pipelines] for a in arrays)


#: The InputContext of the dataset_fn running now (on a worker), for batches' default seed.
_current: contextvars.ContextVar[InputContext | None] = contextvars.ContextVar(
    "pstrain_input_context", default=None)


def call_dataset_fn(fn: Callable, ctx: InputContext) -> Iterable:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    token = _current.set(ctx)
    try:
        return fn(ctx) if len(params) >= 1 else fn()
    finally:
        _current.reset(token)


def batches(*arrays: np.ndarray, batch_size: int, shuffle: bool = True,
            seed: int | None = None, repeat: bool = True,
            drop_remainder: bool = True) -> Iterator[tuple[np.ndarray, ...]]:
    """Batches of aligned arrays, reshuffled each epoch; forever if repeat.

    ``seed``: the shuffle's. None (default): each worker its own order, as
    TensorFlow's unseeded shuffle, yet reproducible: seed 0 with the
    worker's index mixed in (in a dataset_fn on a worker; elsewhere seed 0).
    A seed given is used as it is (every worker the same order: add
    ``ctx.input_pipeline_id`` for orders of their own)."""
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError("all arrays must have the same length")
    if batch_size < 1 or (drop_remainder and batch_size > n):
        raise ValueError(f"batch_size {batch_size} does not fit {n} examples")
    ctx = _current.get()
    if seed is None:
        seed = [0, ctx.input_pipeline_id] if ctx is not None else 0
    return _batches(arrays, n, batch_size, shuffle, np.random.default_rng(seed), repeat,
                    drop_remainder)


def _batches(arrays, n: int, batch_size: int, shuffle: bool, rng, repeat: bool,
             drop_remainder: bool) -> Iterator[tuple[np.ndarray, ...]]:
    for _ in itertools.count() if repeat else range(1):
        order = rng.permutation(n) if shuffle else np.arange(n)
        stop = n - n % batch_size if drop_remainder else n
        for i in range(0, stop, batch_size):
            idx = order[i:i + batch_size]
            yield tuple(a[idx] for a in arrays)


# -- coordinator side ---------------------------------------------------------
class PerWorkerDataset:
    """A dataset created on every worker. ``iter()`` it to get an iterator handle."""

    def __init__(self, dataset_id: str, fn: Callable):
        self.dataset_id, self.fn = dataset_id, fn
        self._count = itertools.count()

    def __iter__(self) -> "PerWorkerIterator":
        return PerWorkerIterator(self.dataset_id, f"{self.dataset_id}/it{next(self._count)}")


@dataclasses.dataclass(frozen=True)
class PerWorkerIterator:
    """Stands for each worker's own iterator over a per-worker dataset."""
    dataset_id: str
    iterator_id: str

    def __reduce__(self):
        # Unpickled on a worker, this becomes that worker's live iterator.
        return _local_iterator, (self.dataset_id, self.iterator_id)

    def __next__(self):
        raise TypeError("a PerWorkerIterator is consumed inside a scheduled function "
                        "on a worker, not on the coordinator")


# -- worker side -----------------------------------------------------------------
class _WorkerData:
    """The datasets and iterators of this worker process."""

    def __init__(self):
        self.lock = threading.Lock()
        self.datasets: dict[str, Iterable] = {}
        self.iterators: dict[str, Iterator] = {}


_worker_data = _WorkerData()


def register_dataset(dataset_id: str, dataset: Iterable) -> None:
    with _worker_data.lock:
        _worker_data.datasets[dataset_id] = dataset
        for it_id in [k for k in _worker_data.iterators if k.startswith(dataset_id + "/")]:
            del _worker_data.iterators[it_id]


def get_dataset(dataset_id: str) -> Any:
    """The dataset (or sharded source) registered as ``dataset_id``, or None."""
    with _worker_data.lock:
        return _worker_data.datasets.get(dataset_id)


def dataset_ids() -> list[str]:
    with _worker_data.lock:
        return list(_worker_data.datasets)


class _LockedIterator:
    """An iterator safe to share between closures running at once."""

    def __init__(self, it: Iterator):
        self._it, self._lock = it, threading.Lock()

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        with self._lock:
            return next(self._it)


def _local_iterator(dataset_id: str, iterator_id: str) -> Iterator:
    with _worker_data.lock:
        it = _worker_data.iterators.get(iterator_id)
        if it is None:
            try:
                ds = _worker_data.datasets[dataset_id]
            except KeyError:
                raise LookupError(
                    f"dataset {dataset_id!r} was not created on this worker; create it with "
                    "ClusterCoordinator.create_per_worker_dataset") from None
            it = _worker_data.iterators[iterator_id] = _LockedIterator(iter(ds))
        return it
