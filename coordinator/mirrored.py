"""All-reduce mode (``ParameterServerStrategy(mode="allreduce")``):
variables mirrored on every worker, gradients averaged among the workers.

As MultiWorkerMirroredStrategy and Horovod train: each worker holds a copy
(a *replica*) of every dense variable and its optimizer slots; a scheduled
step runs as one closure per worker at once (a *gang*: replica r on the
r-th worker of the cluster spec), each on its own batch; the step's
``push_gradients`` averages the replicas' gradients by a ring all-reduce
among the step's workers (coordinator/collective.py: 2(n-1)/n of the
gradient bytes sent per worker, whatever n, no parameter server in the
path) and every worker applies the optimizer to the average itself. The
step functions are the ones the other modes run: ``read_variables`` of a
mirrored variable gives this worker's replica (a copy), ``push_gradients``
does the rest.

Why the optimizer runs on every worker (not sharded across them): the
replicas are then bit-identical by construction (the same average, the same
arithmetic: psserver/contract/optimizers.py, the servers' own), a worker's
state is whole (any replica is a checkpoint), and a step costs one
all-reduce rather than a reduce-scatter and an all-gather with the update
between. What it costs is the slots' memory on every worker (Adam: 2x the
model), which at the model sizes a CPU trainer holds is the cheaper side.

Safety: every replica counts the updates it applied (``version``), and a
step's all-reduce carries the versions of its variables (the collective's
``agree`` bytes, with the variables' names and the job's id), so replicas
that differ (a worker that restarted and made its replicas afresh, or one
that failed in a step the others completed) make the step fail on every
worker with InvalidArgument, and nothing is applied anywhere: a stale
replica is never averaged in. Non-finite averages are refused alike on
every worker (the same bits everywhere decide it).

A step run again (its closures failed as lost: a member gone, or every
reply of the step lost after its workers applied it) applies no push twice:
every replica remembers the last APPLIED_KEPT pushes it applied, by (step,
push of the step), copied with it when the replicas are made one, and a
push its replicas applied already is applied nowhere: the members agree on
that in the push's all-reduce (one element, the decision in ``agree``). Its
table rows on the parameter servers carry update keys derived from the
batch (exactly-once datasets) or else from the job, the step and the worker
(psworker/worker.py's seed, sources.batch_scope's fallback), so a server
drops what the same batch, or the same worker, sent in the step's first run.
And a step whose every reply was lost is not run again where a member left
says it completed that attempt, its pushes all through (``step_ended``,
``after_steps``: asked once no attempt runs there any more): its pushes
are in the replicas, its batches are settled as trained.

Replicas live in the worker process (``_REPLICAS``), by the strategy's job
id and the variable's name: a second job on the same workers has replicas
of its own.
"""
from __future__ import annotations

import collections
import hashlib
import threading
from typing import Mapping, Sequence

import numpy as np

from coordinator.replica import get_replica_context
from psserver.contract import Initializer
from psserver.contract import optimizers as optim
from psserver.contract.initializers import make_initial_value
from psserver.contract.tensor import all_finite
from psserver.errors import FailedPrecondition, InvalidArgument, PSError

#: Pushes a replica remembers having applied, by (step, push of the step): a
#: step run again within this many later pushes skips what it applied.
APPLIED_KEPT = 1024


class AllReduceFailed(RuntimeError):
    """A step's all-reduce did not complete (a member gone, or too slow):
    the coordinator re-forms the ring and runs the step again."""


class ReplicasDisagree(AllReduceFailed):
    """The members of a step's all-reduce found their replicas (or the
    variables they push) differ; nothing was applied. Re-forming makes the
    replicas one; the cause where it persists."""


class MirroredVariable:
    """A dense variable of all-reduce mode: a replica on every worker
    (``ParameterServerStrategy.create_variable`` makes it). It travels to
    the workers with the step function (pickled once per worker, its initial
    value with it); each worker makes its replica from that at first use."""

    def __init__(self, job: str, name: str, initial_value: np.ndarray, optimizer: str,
                 optimizer_params: Mapping[str, float] | None, allow_nonfinite: bool):
        optim.make_optimizer(optimizer, optimizer_params)   # ValueError now, not on a worker
        self.job, self.name = job, name
        self.initial_value = initial_value
        self.optimizer = optimizer
        self.optimizer_params = dict(optimizer_params or {})
        self.allow_nonfinite = allow_nonfinite

    def optimizer_config(self) -> dict[str, float]:
        """Every hyper-parameter of its optimizer, defaults included."""
        return optim.make_optimizer(self.optimizer, self.optimizer_params).config()

    @property
    def shape(self) -> tuple[int, ...]:
        return self.initial_value.shape

    @property
    def dtype(self) -> np.dtype:
        return self.initial_value.dtype

    def __repr__(self) -> str:
        return (f"MirroredVariable({self.name!r}, shape={self.shape}, dtype={self.dtype.name}, "
                f"optimizer={self.optimizer!r})")


#: The longest a step's all-reduce may take (step_timeout 0 means this).
MAX_STEP_SECONDS = 86400.0


def configure(strategy, spec, num_replicas, backup_workers) -> None:
    """ParameterServerStrategy's all-reduce mode settings, checked."""
    if num_replicas is not None or backup_workers:
        raise ValueError('mode="allreduce" runs a replica on every worker of the cluster '
                         "spec: num_replicas and backup_workers do not apply")
    if not 0 <= strategy.step_timeout <= MAX_STEP_SECONDS:
        raise ValueError(f'mode="allreduce": step_timeout is the seconds a step\'s all-reduce '
                         f"may take, from 0 (no limit: {MAX_STEP_SECONDS:.0f}) to "
                         f"{MAX_STEP_SECONDS:.0f}; got {strategy.step_timeout}")
    strategy.num_replicas = len(spec.worker)
    strategy.allreduce_steps = StepNumbers()   # steps numbered across coordinators


class StepNumbers:
    """All-reduce mode's step numbers (``next()``), on the strategy, so a
    second coordinator goes on numbering and batches chosen by step do not
    repeat; ``at_least(n)`` moves the next one up to ``n`` (a checkpoint
    restored into a new strategy: its replicas' update count), never down
    (the numbers name the steps' all-reduce groups)."""

    def __init__(self):
        self._next, self._lock = 0, threading.Lock()

    def __next__(self) -> int:
        with self._lock:
            self._next += 1
            return self._next - 1

    def at_least(self, n: int) -> None:
        with self._lock:
            self._next = max(self._next, int(n))


def create(job: str, name: str, shape, dtype, initial_value, initializer: Initializer | None,
           optimizer: str, optimizer_params, allow_nonfinite: bool) -> MirroredVariable:
    """A MirroredVariable from create_variable's arguments (``initializer``
    resolved: contract.initializers.resolve_initializer), its initial value made here as
    a server makes an unsharded variable's: the same bits."""
    if initial_value is not None:
        if initializer is not None:
            raise ValueError("give initial_value or initializer, not both")
        value = np.asarray(initial_value)
        value = value.astype(dtype or (value.dtype if value.dtype.kind == "f" else "float32"))
        if shape is not None and tuple(shape) != value.shape:
            raise ValueError(f"shape {tuple(shape)} does not match initial_value's "
                             f"{value.shape}")
        if not allow_nonfinite and not all_finite(value):
            raise ValueError(f"the initial value of {name!r} has NaN or Inf (or create it "
                             "with allow_nonfinite=True)")
    else:
        if shape is None:
            raise ValueError(f"create_variable({name!r}) needs a shape or an initial_value")
        value = make_initial_value(tuple(int(d) for d in shape), np.dtype(dtype or "float32"),
                                   initializer or Initializer(), allow_nonfinite)
    if value.dtype.kind != "f":
        raise ValueError(f"a mirrored variable is float16, float32 or float64, got {value.dtype}")
    return MirroredVariable(job, name, np.array(value, order="C"),   # (0-d stays 0-d)
                            optimizer, optimizer_params, allow_nonfinite)


class _Applied:
    """The (step, push) of the last APPLIED_KEPT pushes a replica applied:
    a set to ask, their order to forget the oldest."""

    def __init__(self, pairs=()):
        self._order: collections.deque = collections.deque()
        self._set: set = set()
        for p in pairs:
            self.add(p)

    def __contains__(self, pair) -> bool:
        return pair in self._set

    def __iter__(self):
        return iter(self._order)

    def add(self, pair: tuple) -> None:
        if pair not in self._set:
            self._order.append(pair)
            self._set.add(pair)
            if len(self._order) > APPLIED_KEPT:
                self._set.discard(self._order.popleft())


class _Replica:
    """This worker's copy of a mirrored variable: value, slots, updates applied."""

    def __init__(self, var: MirroredVariable):
        self.value = np.array(var.initial_value, copy=True, order="C")
        self.optimizer = optim.make_optimizer(var.optimizer, var.optimizer_params)
        self.slots = self.optimizer.create_slots(self.value)
        self.version = 0
        self.applied = _Applied()
        self.lock = threading.Lock()


_REPLICAS: dict[tuple[str, str], _Replica] = {}
_LOCK = threading.Lock()


def replica(var: MirroredVariable) -> _Replica:
    """This process's replica of ``var`` (made from its initial value at first use)."""
    key = (var.job, var.name)
    with _LOCK:
        r = _REPLICAS.get(key)
        if r is None:
            r = _REPLICAS[key] = _Replica(var)
        return r


def _state(variables: Sequence[MirroredVariable]) -> list[tuple[np.ndarray, int]]:
    """(value, version) of this worker's replica of each (copies)."""
    out = []
    for v in variables:
        r = replica(v)
        with r.lock:
            out.append((r.value.copy(), r.version))
    return out


def values(variables: Sequence[MirroredVariable]) -> dict[str, tuple[np.ndarray, int]]:
    """name -> (value, version) of this worker's replicas: what
    ClusterCoordinator.replica_values runs on a worker. A replica this
    worker does not have (it restarted, or ran no step of the job) is an
    error, never the initial value passed off as the model."""
    with _LOCK:
        missing = [v.name for v in variables if (v.job, v.name) not in _REPLICAS]
    if missing:
        raise FailedPrecondition(
            f"this worker has no replica of {missing}: it ran no step of this job since it "
            "started (a worker that restarted lost its replicas); read another worker's")
    return {v.name: s for v, s in zip(variables, _state(variables))}


def versions(variables: Sequence[MirroredVariable]) -> dict[str, int]:
    """name -> updates applied, of this worker's replicas (values' rules)."""
    return {n: k for n, (_, k) in values(variables).items()}


def whole_state(variables: Sequence[MirroredVariable],
                with_applied: bool = False) -> dict[str, tuple]:
    """name -> (value, slots, version) of this worker's replicas (copies):
    what a checkpoint holds; ``with_applied``: and the (step, push) of the
    pushes they applied, which ClusterCoordinator.sync_replicas and a
    re-forming copy from their source worker."""
    values(variables)   # (FailedPrecondition where a replica is missing)
    out = {}
    for v in variables:
        r = replica(v)
        with r.lock:
            out[v.name] = (r.value.copy(), {k: a.copy() for k, a in r.slots.items()},
                           r.version) + ((list(r.applied),) if with_applied else ())
    return out


def set_state(variables: Sequence[MirroredVariable], states: Mapping[str, tuple]) -> None:
    """Make this worker's replicas ``states`` (whole_state's; without the
    pushes applied, a checkpoint's, none), checked first: what
    ClusterCoordinator.sync_replicas runs on the other workers."""
    checked = []
    for v in variables:
        value, slots, version, *rest = states[v.name]
        applied = list(rest[0]) if rest else []
        value = np.asarray(value)
        fresh = optim.make_optimizer(v.optimizer, v.optimizer_params).create_slots(
            np.asarray(v.initial_value))
        if value.shape != v.shape or value.dtype != v.dtype or set(slots) != set(fresh) or any(
                np.shape(slots[k]) != np.shape(a) or np.asarray(slots[k]).dtype != a.dtype
                for k, a in fresh.items()) or not isinstance(version, int) or version < 0 \
                or len(rest) > 1 or not all(isinstance(a, (tuple, list)) and len(a) == 2 and all(
                    isinstance(x, int) and x >= 0 for x in a) for a in applied):
            raise InvalidArgument(f"the state given for {v.name!r} does not fit it")
        checked.append((v, np.array(value, order="C"),
                        {k: np.array(a, order="C") for k, a in slots.items()}, version,
                        _Applied(map(tuple, applied))))
    for v, value, slots, version, applied in checked:
        r = replica(v)
        with r.lock:
            r.value, r.slots, r.version, r.applied = value, slots, version, applied


def read_among(variables: Sequence, with_versions: bool, read_rest):
    """read_variables of items some of which are mirrored variables: theirs
    this worker's replicas (values as they are, version the updates
    applied), the others' by ``read_rest(items, with_versions=True)``."""
    spec = get_replica_context().collective
    if spec is None:
        raise RuntimeError(
            "read_variables of a mirrored variable runs in a step of all-reduce mode, on a "
            "worker; on the coordinator, read the trained values with "
            "ClusterCoordinator.replica_values")
    mine = [v for v in variables if isinstance(v, MirroredVariable)]
    state = dict(zip((v.name for v in mine), _state(mine)))
    _step_reads(spec).update((n, k) for n, (_, k) in state.items())
    rest = [v for v in variables if not isinstance(v, MirroredVariable)]
    values, versions = (iter(x) for x in (read_rest(rest, with_versions=True) if rest
                                          else ([], [])))
    out = [(state[v.name][0], [state[v.name][1]]) if isinstance(v, MirroredVariable)
           else (next(values), next(versions)) for v in variables]
    return ([o[0] for o in out], [o[1] for o in out]) if with_versions else [o[0] for o in out]


def split(pairs) -> tuple[list, list]:
    """push_gradients' pairs: (the mirrored variables', the others'). The
    mirrored ones' all-reduce (``push``) goes first, then the others to the
    parameter servers: a step whose ring fails sent them nothing, and runs
    again without applying its rows twice. In a step of an exactly-once
    batch (keys derived from the batch: calls.keys_from_batch) the servers'
    part goes first instead: a step
    counted done because a member completed its all-reduce then has every
    member's table rows applied too, and a step run again sends the same
    keys, which the servers drop."""
    mine, rest = [], []
    for v, g in pairs:
        (mine if isinstance(v, MirroredVariable) else rest).append((v, g))
    return mine, rest


def push(pairs: Sequence[tuple[MirroredVariable, object]]) -> None:
    """push_gradients' part for mirrored variables: the step's all-reduce of
    their gradients (fused), then the optimizer on every replica here."""
    try:
        _push(pairs)
    except BaseException:
        spec = get_replica_context().collective
        if spec is not None:
            _this_step(spec)
            _step.failed_push = True
        raise


def _push(pairs: Sequence[tuple[MirroredVariable, object]]) -> None:
    from coordinator.collective import CollectiveGroup
    spec = get_replica_context().collective
    if spec is None:
        raise RuntimeError(
            "push_gradients of a mirrored variable runs in a step of all-reduce mode "
            "(ClusterCoordinator.schedule), where the step's workers average it")
    names = [v.name for v, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"a variable is pushed twice in one call: {sorted(names)}")
    # Each push of a step is a group of its own (a step may push more than once).
    push = _next_push(spec)
    # The step run again and this push applied already: nothing is applied,
    # and the members agree on that first (one element all-reduced, the
    # decision in the agreement: a member that decided otherwise, its
    # replicas not those of the others, makes the step fail on all).
    reps = [replica(v) for v, _ in pairs]
    done = [(spec.step, push) in r.applied for r in reps]
    skip = all(done)
    group_name = f"{spec.group}/push-{push}"
    with CollectiveGroup(group_name, spec.members, spec.rank, timeout=spec.timeout) as group:
        try:
            if any(done) and not skip:
                raise ValueError(
                    f"push {push} of all-reduce step {spec.step} is run again with other "
                    f"variables than its first run applied ({sorted(names)}; some of them "
                    "had it applied): a step must push the same variables in the same "
                    "order on every run")
            grads = []
            for (v, g), r in zip(pairs, reps):
                g = np.asarray(g)
                if g.shape != v.shape:
                    raise ValueError(f"the gradient of {v.name!r} has shape {g.shape}; the "
                                     f"variable's is {v.shape}")
                if g.dtype.kind not in "fiu":
                    raise ValueError(f"the gradient of {v.name!r} is {g.dtype}, not numbers")
                grads.append(g.astype(v.dtype, copy=False))
                seen = _step_reads(spec).get(v.name)
                if seen is not None and seen != r.version:
                    raise ValueError(
                        f"{v.name!r} was read at update {seen} and is at {r.version} "
                        "now: another step ran on this worker meanwhile, so this gradient is "
                        "stale")
        except Exception as exc:   # the other workers are told, not left to time out
            group.abort(f"{type(exc).__name__}: {exc}")
            raise
        versions = [r.version for r in reps]
        agree = hashlib.blake2b(repr((spec.job, names, versions) + (("applied",) if skip else ()))
                                .encode(), digest_size=16).digest()
        try:
            mean = group.all_reduce_many([np.zeros(1, np.float32)] if skip else grads,
                                         average=not spec.sum, compression=spec.compression,
                                         agree=agree)
        except InvalidArgument as exc:   # (a member out of step: the ring is re-formed)
            from coordinator.gang import MAX_ATTEMPTS
            raise ReplicasDisagree(
                f"the workers of all-reduce step {spec.step} disagree: their replicas differ "
                "in the updates applied (a worker restarted, or failed in a step the others "
                "completed), or they push other variables. Nothing of this push was applied; the "
                "coordinator makes the replicas one (those of the worker that applied the "
                "most updates) and runs the step again, and fails the job if they still "
                f"disagree after {MAX_ATTEMPTS} attempts. ({exc})") from None
        except PSError as exc:   # (not a parameter server's failure: no recovery of one)
            raise AllReduceFailed(
                f"the all-reduce of step {spec.step} failed on worker "
                f"{spec.members[spec.rank]} (rank {spec.rank}): {type(exc).__name__}: {exc}. "
                "A worker of the step is gone, restarting or too slow (step_timeout), or "
                "another's step failed: the coordinator re-forms the ring from the workers "
                "that answer, makes their replicas one and runs the step again (or fails "
                "the job with that other worker's error)") from None
    if skip:
        return
    bad = [v.name for (v, _), g in zip(pairs, mean) if not v.allow_nonfinite
           and not all_finite(g)]
    if bad:   # (the same bits on every worker: refused on every one alike)
        raise InvalidArgument(f"the averaged gradient of {bad} has NaN or Inf; nothing was "
                              "applied on any worker")
    reads = _step_reads(spec)
    with _APPLY:   # (an attempt a re-forming gave up applies nothing from then on)
        if spec.group in _GIVEN_UP:
            raise AllReduceFailed(
                f"step {spec.step}'s attempt {spec.group} was given up by a re-forming of the "
                "ring while it ran (its call had been cut): nothing of this push was applied")
        for r, g, v in zip(reps, mean, (v for v, _ in pairs)):
            with r.lock:
                r.optimizer.apply_dense(r.value, r.slots, g)
                r.version += 1
                r.applied.add((spec.step, push))
                if v.name in reads:   # (a later push of this step builds on this one)
                    reads[v.name] = r.version


def step_failed(spec, reason: str) -> None:
    """The step function raised on this worker before its first push: the
    group of that push is formed and aborted, so the other workers'
    all-reduce fails at once rather than after step_timeout (where they
    formed it within collective.ABORT_SECONDS of this). A step that raises
    between two pushes of its own leaves the others to their timeout."""
    from coordinator.collective import CollectiveGroup
    _this_step(spec)
    if _step.failed_push or _step.pushes:   # (a push failed: its group was told; a step
        return                              # that pushed: no other push is waited on)
    name = f"{spec.group}/push-{_next_push(spec)}"
    try:
        with CollectiveGroup(name, spec.members, spec.rank, timeout=spec.timeout) as group:
            group.abort(reason)
    except Exception:   # (the step's own error is what the coordinator hears)
        pass


def step_started(spec) -> None:
    """An attempt of an all-reduce step starts on this worker (psworker,
    before the step function): a re-forming waits for it (``after_steps``)."""
    with _ENDED:
        _RUNNING[spec.group] = _RUNNING.get(spec.group, 0) + 1


def pushed_through(spec) -> bool:
    """Whether this thread's pushes of ``spec``'s attempt (one at least) all
    went through: what psworker asks as the step function returns (before
    anything else of the step's, an abort's group included, is counted)."""
    return getattr(_step, "group", None) == (spec.group, spec.rank) \
        and _step.pushes > 0 and not _step.failed_push


def step_ended(spec, completed: bool) -> None:
    """The attempt ended here (psworker, whatever its outcome). ``completed``:
    its function returned with its pushes through (``pushed_through``):
    they are in this worker's replicas, all-reduced among every member,
    and, where its batches are exactly-once, every member's table rows were
    applied before them. A step that pushed nothing (a read-only one) or
    caught a failed push is not completed: another member may not have run
    it at all."""
    with _ENDED:
        left = _RUNNING.get(spec.group, 0) - 1
        if left > 0:
            _RUNNING[spec.group] = left
        else:
            _RUNNING.pop(spec.group, None)
        if completed:
            _remember(_COMPLETED, spec.group)
        _ENDED.notify_all()


def _remember(kept: dict, group: str) -> None:
    """``group`` into ``kept`` (insertion-ordered: past STEPS_KEPT the oldest go)."""
    if group not in kept:
        kept[group] = None
        if len(kept) > STEPS_KEPT:
            del kept[next(iter(kept))]


def after_steps(variables: Sequence[MirroredVariable], prefix: str, groups: Sequence[str],
                wait: float) -> tuple[int, list[str], list[str]]:
    """What a re-forming asks each worker (coordinator/gang.py), once no
    attempt of a step of ``prefix`` (one coordinator's) runs here, waiting
    up to ``wait`` s (an attempt whose call was cut on the way runs on until
    its function ends, and may still push); those still running then are
    given up (their pushes apply nothing from now on: AllReduceFailed), so
    what this answers stays true: (the updates its replicas applied, -1
    where it has none; those of ``groups`` it completed; the attempts given
    up)."""
    def running() -> list[str]:   # (those given up already are not waited for again)
        return sorted(g for g in _RUNNING if g.startswith(prefix) and g not in _GIVEN_UP)
    with _ENDED:
        _ENDED.wait_for(lambda: not running(), wait)
    with _APPLY, _ENDED:   # those still running apply nothing from now on: what is read
        left = running()   # below stays
        for g in left:
            _remember(_GIVEN_UP, g)
        done = [g for g in groups if isinstance(g, str) and g in _COMPLETED]
    try:
        count = sum(versions(variables).values())
    except FailedPrecondition:   # (no replicas: restarted, or never ran a step)
        count = -1
    return count, done, left


#: Step attempts (their groups: job, coordinator, epoch, step) this worker
#: completed, the last STEPS_KEPT, oldest first; those running, and how many
#: closures of each (their end is signalled on _ENDED, over _LOCK).
STEPS_KEPT = 1024
_COMPLETED: dict[str, None] = {}
_RUNNING: dict[str, int] = {}
_ENDED = threading.Condition(_LOCK)
#: Attempts a re-forming gave up while they ran here (the last STEPS_KEPT),
#: and the lock under which a push checks that and applies.
_GIVEN_UP: dict[str, None] = {}
_APPLY = threading.Lock()

_step = threading.local()   # this thread's step: its pushes so far, the versions it read


def _this_step(spec) -> None:
    if getattr(_step, "group", None) != (spec.group, spec.rank):
        _step.group, _step.pushes, _step.reads = (spec.group, spec.rank), 0, {}
        _step.failed_push = False


def _next_push(spec) -> int:
    """0, 1, ... for the pushes of one step on this thread."""
    _this_step(spec)
    _step.pushes += 1
    return _step.pushes - 1


def _step_reads(spec) -> dict[str, int]:
    """name -> the version this step read (and pushed on), on this thread."""
    _this_step(spec)
    return _step.reads
