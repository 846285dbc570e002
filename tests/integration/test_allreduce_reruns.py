"""All-reduce mode: a step whose every closure fails as lost after every
worker applied its push (every reply lost), or the first of its two, is
run again after the re-forming, and that run applies nothing twice: not the mirrored
variables (each replica remembers the pushes it applied, by step and push)
nor the table rows on the parameter servers (a step's update keys are
derived from the job, the step and the replica). Real psworker and
psserver processes."""
from __future__ import annotations

import os

import numpy as np
import pytest

from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
from coordinator.step_calls import push_gradients, read_variables

pytestmark = pytest.mark.timeout(180)


def lost_after_push(w, table, marks: str, pushes: int = 1, fail_after: int = 1):
    """A step (run on the workers): ``pushes`` pushes of w (replica r + 1
    each) and of the table's rows (ones); on its first run only, after
    ``fail_after`` of them, the closure fails as a lost member would
    (mirrored.AllReduceFailed): every reply of the step lost, after every
    worker applied what it pushed so far."""
    def step():
        from coordinator import get_replica_context
        from coordinator.mirrored import AllReduceFailed
        from coordinator.step_calls import IndexedSlices, Lookup
        ctx = get_replica_context()
        r = ctx.replica_id_in_sync_group
        keys = np.arange(4, dtype=np.int64) + 100 * r
        flag = os.path.join(marks, f"{ctx.step}-{r}")
        for i in range(pushes):
            if i == fail_after and not os.path.exists(flag):
                open(flag, "w").close()
                raise AllReduceFailed("lost: the reply of this closure never arrives")
            wv, rows = read_variables([w, Lookup(table, keys)])
            push_gradients([(w, np.full(wv.shape, r + 1.0, np.float32)),
                            (table, IndexedSlices(np.ones_like(rows), keys))])
        if fail_after == pushes and not os.path.exists(flag):
            open(flag, "w").close()
            raise AllReduceFailed("lost: the reply of this closure never arrives")
    return step


@pytest.mark.parametrize("pushes,fail_after", [(1, 1), (2, 2), (2, 1)],
                         ids=["lost-after-its-push", "lost-after-both", "lost-between"])
def test_a_step_whose_replies_were_all_lost_after_it_applied_is_applied_once(
        tmp_path, pushes, fail_after):
    """Each member of each step fails once as lost, after its pushes (one or
    both of two) were applied everywhere; the step runs again and every push
    is applied once: w by the mean of 1 and 2 a push, each row by 1."""
    with LocalCluster(num_ps=1, num_workers=2) as c:
        strategy = ParameterServerStrategy(c.spec, mode="allreduce", step_timeout=20)
        w = strategy.create_variable("w", shape=(3,), optimizer="sgd",
                                     optimizer_params={"learning_rate": 0.5})
        table = strategy.create_embedding_table("t", 2, optimizer="sgd",
                                                optimizer_params={"learning_rate": 0.25})
        steps = 2
        with ClusterCoordinator(strategy) as coord:
            for _ in range(steps):
                coord.schedule(lost_after_push(w, table, str(tmp_path), pushes, fail_after))
            coord.join(timeout=120)
            got = [coord.replica_values(worker=i, with_versions=True) for i in range(2)]
        rows = table.lookup(np.array([0, 3, 100, 103], np.int64), admit=False)
    assert sorted(os.listdir(tmp_path)) == ["0-0", "0-1", "1-0", "1-1"]   # each failed once
    applied = steps * pushes
    assert got[0][1] == got[1][1] == {"w": applied}
    np.testing.assert_array_equal(got[0][0]["w"], np.full(3, -0.5 * 1.5 * applied, np.float32))
    np.testing.assert_array_equal(got[1][0]["w"], got[0][0]["w"])
    np.testing.assert_allclose(rows, np.full((4, 2), -0.25 * applied, np.float32))


def first_member_dies_before_its_push(w, table):
    """A step (run on the workers): each member reads row 7 and a row of its
    own process, and pushes 1 to each and to w; on the step's first run
    (3 members) the member of rank 0 dies before its push."""
    def step():
        from coordinator import get_replica_context
        from coordinator.step_calls import IndexedSlices, Lookup
        ctx = get_replica_context()
        keys = np.array([7, os.getpid()], np.int64)
        wv, rows = read_variables([w, Lookup(table, keys)])
        if ctx.num_replicas_in_sync == 3 and ctx.replica_id_in_sync_group == 0:
            os._exit(3)
        push_gradients([(w, np.ones_like(wv)), (table, IndexedSlices(np.ones_like(rows), keys))])
        return os.getpid()
    return step


def test_a_member_lost_mid_step_shifts_the_ranks_and_no_row_is_applied_twice_or_dropped():
    """The first member dies inside a step; the two others' ring fails and
    the step runs again on them as ranks 0 and 1 (they were 1 and 2). Their
    table rows go out after the all-reduce, keyed by (job, step, worker):
    row 7 gets one update from each survivor, each survivor's row one."""
    with LocalCluster(num_ps=2, num_workers=3) as c:
        strategy = ParameterServerStrategy(c.spec, mode="allreduce", step_timeout=5)
        w = strategy.create_variable("w", shape=(2,), optimizer="sgd",
                                     optimizer_params={"learning_rate": 1.0})
        table = strategy.create_embedding_table("t", 1, initializer="zeros", optimizer="sgd",
                                                optimizer_params={"learning_rate": 1.0})
        with ClusterCoordinator(strategy) as coord:
            step = coord.schedule(first_member_dies_before_its_push(w, table))
            coord.join(timeout=120)
            pids = [v.fetch() for v in step.replicas if isinstance(v.fetch(), int)]
            got = coord.replica_values(worker=1, with_versions=True)
        rows = table.lookup(np.array([7, *pids], np.int64), admit=False)
    assert len(pids) == 2 and got[1] == {"w": 1}
    np.testing.assert_array_equal(got[0]["w"], [-1.0, -1.0])   # the mean of the two
    np.testing.assert_array_equal(rows[:, 0], [-2.0, -1.0, -1.0])
