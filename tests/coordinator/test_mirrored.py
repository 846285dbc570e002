"""coordinator/mirrored.py's parts that need no cluster: a worker's replicas
made, copied whole and set from another's (sync_replicas), refusing a
state that does not fit and changing nothing then. Training between real
workers: tests/integration/test_allreduce.py."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import mirrored
from coordinator.replica import CollectiveSpec, replica_scope
from psserver.errors import FailedPrecondition, InvalidArgument


def _var(name: str, optimizer: str = "adam") -> mirrored.MirroredVariable:
    return mirrored.create(f"job-{name}", name, None, None, np.arange(6, dtype=np.float32)
                           .reshape(3, 2), None, optimizer, {"learning_rate": 0.1}, False)


def test_a_replica_is_copied_whole_and_set_elsewhere():
    v = _var("copy")
    with pytest.raises(FailedPrecondition, match="no replica"):
        mirrored.whole_state([v])   # (none made here yet: never the initial value)
    r = mirrored.replica(v)
    r.value += 1
    r.slots["m"] += 2
    r.version = 7
    state = mirrored.whole_state([v])
    r.value += 100   # a copy, not the replica itself
    assert state[v.name][2] == 7 and state[v.name][0][0, 0] == 1.0
    mirrored.set_state([v], state)
    got = mirrored.whole_state([v])[v.name]
    assert got[0].tobytes() == state[v.name][0].tobytes() and got[2] == 7
    assert got[1]["m"].tobytes() == state[v.name][1]["m"].tobytes()


def test_the_pushes_a_replica_applied_go_with_it_only_when_asked():
    """whole_state(with_applied=True) carries the (step, push) pairs the
    replica applied (a re-forming's copy: a step run again skips them); a
    state without them (a checkpoint's) clears them; the oldest are
    forgotten past APPLIED_KEPT; malformed ones are refused, nothing set."""
    v = _var("applied")
    r = mirrored.replica(v)
    for step in range(mirrored.APPLIED_KEPT + 2):
        r.applied.add((step, 0))
    r.applied.add((5, 0))   # (again: kept once)
    assert (0, 0) not in r.applied and (1, 0) not in r.applied and (2, 0) in r.applied
    assert len(mirrored.whole_state([v])[v.name]) == 3
    state = mirrored.whole_state([v], with_applied=True)
    assert len(state[v.name][3]) == mirrored.APPLIED_KEPT
    for bad in ([(1, 2, 3)], [(-1, 0)], [(1.5, 0)], "x"):
        with pytest.raises(InvalidArgument, match="does not fit"):
            mirrored.set_state([v], {v.name: state[v.name][:3] + (bad,)})
        assert (2, 0) in r.applied   # unchanged
    r.applied = mirrored._Applied()
    mirrored.set_state([v], state)
    assert (2, 0) in mirrored.replica(v).applied and (1, 0) not in mirrored.replica(v).applied
    mirrored.set_state([v], {v.name: state[v.name][:3]})   # a checkpoint's: none
    assert list(mirrored.replica(v).applied) == []


def test_a_worker_tells_which_step_attempts_it_completed_once_none_runs(monkeypatch):
    """An attempt counts as completed on a worker where its function
    returned with its pushes (one at least) all through: not one that
    pushed nothing, one whose push failed (caught by the step), or one that
    raised. after_steps answers once no attempt of the coordinator's
    prefix runs there (up to its wait: then it names those running), with
    the replicas' updates (-1: none); past STEPS_KEPT the oldest go."""
    import threading
    monkeypatch.setattr(mirrored, "_COMPLETED", {})
    monkeypatch.setattr(mirrored, "_RUNNING", {})
    monkeypatch.setattr(mirrored, "STEPS_KEPT", 3)

    def spec(step, epoch=0, job="job"):
        return CollectiveSpec(f"{job}/n/e{epoch}/step-{step}", ("a:1", "b:2"), 0, step, 5.0,
                              False, None, job)

    def attempt(sp, pushes=1, failed=False, returned=True):
        mirrored.step_started(sp)
        mirrored._this_step(sp)
        mirrored._step.pushes, mirrored._step.failed_push = pushes, failed
        mirrored.step_ended(sp, returned and mirrored.pushed_through(sp))   # (as psworker)
    for step in range(4):
        attempt(spec(step))
    attempt(spec(3))   # (again: once)
    attempt(spec(4), pushes=0)
    attempt(spec(5), failed=True)
    attempt(spec(6), returned=False)
    asked = [spec(s).group for s in range(7)] + [spec(3, epoch=1).group, 7, None]
    assert mirrored.after_steps([], "job/n/", asked, 1.0) == (
        0, [spec(s).group for s in (1, 2, 3)], [])
    v = _var("after-steps")
    mirrored.replica(v).version = 5
    late = spec(9)
    mirrored.step_started(late)   # ends while waited for: completed
    mirrored.step_started(spec(1, job="other"))   # another coordinator's: not waited for
    done = threading.Timer(0.2, lambda: (mirrored._this_step(late),
                                         setattr(mirrored._step, "pushes", 1),
                                         mirrored.step_ended(late, True)))
    done.start()
    assert mirrored.after_steps([v], "job/n/", [late.group], 30.0) == (5, [late.group], [])
    done.join()
    stuck = spec(10)   # still running after the wait: given up, named; then neither
    mirrored.step_started(stuck)   # waited for again nor named again
    assert mirrored.after_steps([v], "job/n/", [stuck.group], 0.05) == (5, [], [stuck.group])
    assert mirrored.after_steps([v], "job/n/", [], 30.0)[2] == []   # (at once)


def test_a_step_that_pushed_nothing_is_not_completed_even_where_its_reply_fails(monkeypatch):
    """psworker decides "completed" as the step function returns: a
    read-only step whose result cannot be pickled (the reply an error) is
    not counted, though telling the others of the failure forms (and
    aborts) a push's group on the way (review 15: it was counted)."""
    import threading

    import coordinator.collective as collective
    from coordinator import serialization
    from protos.pstrain.v1 import worker_pb2
    from psworker.worker import WorkerServicer

    class Group:   # (the abort's group, without a network)
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def abort(self, reason):
            pass
    monkeypatch.setattr(collective, "CollectiveGroup", Group)
    monkeypatch.setattr(mirrored, "_COMPLETED", {})

    def read_only():
        return threading.Lock()   # (returned, pushed nothing; cannot be pickled)
    group = "job/nonce/e0/step-0"
    reply = WorkerServicer(trusted=True).RunClosure(worker_pb2.ClosureRequest(
        closure_id="c1", fn=serialization.encode_function(read_only, by_value=True),
        args=serialization.dumps(((), {})),
        collective=worker_pb2.CollectiveInfo(group=group, members=["a:1", "b:2"], rank=0,
                                             step=0, timeout=5.0, job="job")), None)
    assert reply.WhichOneof("outcome") == "error" and reply.error.type == "TypeError"
    assert mirrored.after_steps([], "job/nonce/", [group], 0.1) == (0, [], [])


@pytest.mark.parametrize("bad", ["shape", "dtype", "slot missing", "slot shape", "version"])
def test_a_state_that_does_not_fit_is_refused_and_changes_nothing(bad):
    v, w = _var(f"bad-{bad}"), _var(f"other-{bad}", "sgd")
    mirrored.replica(v), mirrored.replica(w)
    before = {**mirrored.whole_state([v]), **mirrored.whole_state([w])}
    value, slots, version = before[v.name]
    if bad == "shape":
        value = value[:2]
    elif bad == "dtype":
        value = value.astype(np.float64)
    elif bad == "slot missing":
        slots = {k: a for k, a in slots.items() if k != "v"}
    elif bad == "slot shape":
        slots = {**slots, "m": slots["m"][:1]}
    else:
        version = -1
    good_w = (before[w.name][0] + 5, before[w.name][1], 3)
    with pytest.raises(InvalidArgument, match="does not fit"):
        mirrored.set_state([w, v], {w.name: good_w, v.name: (value, slots, version)})
    after = {**mirrored.whole_state([v]), **mirrored.whole_state([w])}
    for name in (v.name, w.name):   # neither changed: checked before anything is set
        assert after[name][0].tobytes() == before[name][0].tobytes()
        assert after[name][2] == before[name][2]


def test_reads_and_pushes_belong_to_steps():
    v = _var("outside")
    with pytest.raises(RuntimeError, match="replica_values"):
        mirrored.read_among([v], False, None)
    with pytest.raises(RuntimeError, match="all-reduce mode"):
        mirrored.push([(v, np.zeros((3, 2), np.float32))])
    spec = CollectiveSpec("g", ("a:1",), 0, 0, 10.0, job=v.job)
    with replica_scope(None, spec):   # a group of one: its own mean
        (before,) = mirrored.read_among([v], False, None)
        mirrored.push([(v, np.ones((3, 2), np.float32))])
        (after,) = mirrored.read_among([v], False, None)
    assert not np.array_equal(before, after) and mirrored.replica(v).version == 1
