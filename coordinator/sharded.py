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
  last 8,192 updates of each shard (psserver/core/replication.py
  APPLIED_IDS_KEPT), so a re-run must reach it before that many later
  updates of that shard (a dead worker is noticed within seconds, its
  batch re-run at once); a parameter server that restarts without
  replication is refilled from the latest checkpoint, which carries its
  variables' keys, but the updates after that checkpoint are lost on its
  shards (neither applied nor re-applied): exactly-once holds across a
  parameter-server failure with ``replication=True`` (shard copies carry
  the keys), not without. Dynamic tables' keys are not in checkpoints.
  Calls made with a PSClient directly carry no such keys.

All-reduce mode: each closure of a step (one per member worker) takes a
batch, so a step trains one batch per worker. A step that fails where no
member completed it gives its batches back and runs again with the
members left; one that some member completed (every member's gradient is
in its all-reduce) acknowledges them all. In such a step
``push_gradients`` sends the tables' rows to the servers before the
all-reduce, so in a completed step every member's rows are applied, and
those of a failed attempt (keyed by batch) are not applied again by the
re-run (coordinator/gang.py, mirrored.split). The mirrored variables'
update is the all-reduce's alone: it is applied once per completed step.
This holds for a step that pushes once, its rows in the same
``push_gradients`` call as its mirrored gradients (or in calls before
it): rows pushed after the all-reduce are lost with a member that dies
in between, and a step that all-reduces twice and fails in the second is
run again with the batches the re-run takes (its first push, applied
already, is not applied again; docs/training-modes.md). ``fit`` follows
the members: an epoch of it runs steps until every batch of its data
epoch was trained, however many members each step had (its last step may
take the first batches of the next epoch: a step takes one per member).

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
from typing import Callable, Sequence

from coordinator import metrics as _metrics
from coordinator.sources import Batch, ShardedSource, _bound_iterator
from protos.pstrain.v1 import worker_pb2

VISITATIONS = ("exactly_once", "at_least_once")


# -- the coordinator's side -----------------------------------------------------------------
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

    def unacknowledged(self, epoch: int) -> int:
        with self._cond:
            if epoch > self._epoch:
                return self.batches_per_epoch
            return self._unacked.get(epoch, 0)

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

    def unacknowledged(self, epoch: int) -> int:
        """Batches of ``epoch`` not acknowledged yet (0: that epoch ended)."""
        return self._dispatch.unacknowledged(epoch)

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
