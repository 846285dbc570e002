"""PSTRAIN_PROFILE: the calls a task serves, profiled into files (psserver/profiling.py)."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
from coordinator.step_calls import push_gradients, read_variables
from psserver import profiling
from psserver.process import start_task

pytestmark = pytest.mark.timeout(120)


def profiled_step(var):
    """A step the worker runs: a read and a push (SGD, lr 1: adds 1)."""
    (value,) = read_variables([var])
    push_gradients([(var, -np.ones_like(value))])
    return float(value[0])


def test_tasks_write_their_calls_profiles_and_the_summary_merges_them(tmp_path):
    out = tmp_path / "prof"
    with LocalCluster(num_ps=1, num_workers=1, env={profiling.ENV: str(out)}) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        var = strategy.create_variable("v", initial_value=np.zeros(8, np.float32),
                                       optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        with ClusterCoordinator(strategy) as coord:
            got = coord.fetch([coord.schedule(profiled_step, args=(var,)) for _ in range(20)])
        assert sorted(got) == [float(i) for i in range(20)]
    # Written when the tasks stopped (SIGTERM), one file per serving thread.
    names = sorted(os.listdir(out))
    assert any(n.startswith("psserver-") for n in names), names
    assert any(n.startswith("psworker-") for n in names), names
    worker = profiling.summary(str(out), role="psworker", sort="cumulative", top=200)
    assert "profiled_step" in worker and "RunClosure" in worker
    assert "psserver-" not in worker.splitlines()[0]   # one role's files only
    server = profiling.summary(str(out), role="psserver", top=200)
    assert "push" in server
    assert profiling.main([str(out), "--top", "5"]) == 0


def test_summary_of_a_directory_without_profiles_says_what_to_do(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="PSTRAIN_PROFILE"):
        profiling.summary(str(tmp_path))
    assert profiling.main([str(tmp_path)]) == 1
    assert "was the task started with PSTRAIN_PROFILE" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["psserver", "psworker"])
def test_a_profile_directory_the_task_cannot_make_stops_it_with_the_reason(tmp_path, role):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match="PSTRAIN_PROFILE=.*cannot make that directory"):
        start_task(role, ["--port", "0"], env={profiling.ENV: str(blocker / "prof")},
                   timeout=30)


def test_profiles_are_per_thread_and_written_every_so_many_calls(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "EVERY", 3)
    p = profiling.CallProfiles(str(tmp_path), "psserver")

    def work(n):
        return sum(range(n))

    def nested(n):   # a profiled call inside a profiled call is part of it
        return p.run(work, n) + 1

    assert [p.run(work, 10) for _ in range(2)] == [45, 45]
    assert os.listdir(tmp_path) == []          # not yet: every 3 calls
    assert p.run(nested, 10) == 46
    (first,) = os.listdir(tmp_path)
    assert first.startswith(f"psserver-{os.getpid()}-") and first.endswith(".prof")
    t = threading.Thread(target=p.run, args=(work, 5), name="other thread")
    t.start()
    t.join()
    p.write_all()
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and any("other_thread" in f for f in files), files
    text = profiling.summary(str(tmp_path), role="psserver", top=50)
    assert "work" in text and "nested" in text


def test_the_cpu_clock_counts_work_and_not_waits(tmp_path):
    import pstats
    import time

    def wait():
        time.sleep(0.3)

    def work():
        t = time.thread_time() + 0.05
        while time.thread_time() < t:
            pass

    for cpu in (False, True):
        out = tmp_path / str(cpu)
        out.mkdir()
        p = profiling.CallProfiles(str(out), "psserver", cpu=cpu)
        p.run(wait)
        p.run(work)
        p.write_all()
        stats = pstats.Stats(*[str(f) for f in out.iterdir()]).stats
        took = {fn[2]: st[3] for fn, st in stats.items() if fn[2] in ("wait", "work")}
        if cpu:   # the sleep costs no CPU; the loop its 50 ms
            assert took["wait"] < 0.02 and took["work"] >= 0.045, took
        else:     # wall time: the sleep counts
            assert took["wait"] >= 0.29, took


def test_an_unknown_profile_clock_stops_the_task_with_the_reason(tmp_path):
    with pytest.raises(RuntimeError, match="PSTRAIN_PROFILE_CLOCK='gpu'.*use cpu"):
        start_task("psserver", ["--port", "0"],
                   env={profiling.ENV: str(tmp_path), profiling.CLOCK_ENV: "gpu"}, timeout=30)
