"""The coordinator against real clusters: closures, futures, errors, sharding, membership."""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading

import grpc
import numpy as np
import pytest

from coordinator import (
    ClosureCancelled,
    ClusterCoordinator,
    FixedShardsPartitioner,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    RemoteValueStatus,
    StepFunctionError,
    WorkerCallError,
    serialization,
)
from coordinator.cluster_spec import ClusterSpec
from protos.pstrain.v1 import worker_pb2, worker_pb2_grpc
from psserver.errors import Code, PSError, Unavailable
from psserver.process import start_task
from psserver.tls import make_channel

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster():
    with LocalCluster(num_ps=2, num_workers=2) as c:
        yield c


@pytest.fixture
def strategy(cluster):
    return ParameterServerStrategy(cluster.spec)


@pytest.fixture
def coord(strategy):
    with ClusterCoordinator(strategy) as c:
        yield c


def worker_pid():
    return os.getpid()


def add(a, b):
    return a + b


def fail_with(message):
    raise ValueError(message)


# -- schedule / fetch / join ---------------------------------------------------------
def test_schedule_returns_remote_values_with_results(coord):
    rvs = [coord.schedule(add, args=(i, 10)) for i in range(20)]
    coord.join()
    assert coord.done()
    assert [rv.fetch() for rv in rvs] == [i + 10 for i in range(20)]
    assert all(rv.status is RemoteValueStatus.READY for rv in rvs)
    assert coord.fetch({"a": rvs[0], "b": [rvs[1], rvs[2]]}) == {"a": 10, "b": [11, 12]}


def test_closures_run_on_worker_processes(cluster, coord):
    pids = set(coord.fetch([coord.schedule(worker_pid) for _ in range(40)]))
    worker_pids = {w.pid for w in cluster.workers}
    assert pids <= worker_pids and os.getpid() not in pids


def test_function_from_main_is_sent_by_value(coord):
    offset = 7
    fn = lambda x: x * 2 + offset   # noqa: E731  (a lambda cannot be imported)
    assert serialization.encode_function(fn).WhichOneof("kind") == "pickled"
    assert serialization.encode_function(add).qualified_name == f"{__name__}:add"
    assert coord.schedule(fn, args=(5,)).fetch() == 17


def test_a_function_sent_by_value_is_unpickled_once_per_worker(cluster, coord):
    """README: a worker keeps a function sent by value for the closures that
    send it again, so state its closure captures lives on there (as a
    function TensorFlow traced once per worker); the arguments are new each
    time. Each worker counts the closures it ran with its one copy."""
    seen = []

    def step(x):
        seen.append(x)   # this worker's copy of the list
        return os.getpid(), len(seen), x
    out = coord.fetch([coord.schedule(step, args=(i,)) for i in range(20)])
    by_worker: dict[int, list] = {}
    for pid, n, x in out:
        by_worker.setdefault(pid, []).append(n)
    assert sorted(x for _, _, x in out) == list(range(20)) and not seen
    for counts in by_worker.values():   # 1, 2, 3, ... on each worker: one copy each
        assert sorted(counts) == list(range(1, len(counts) + 1))


def test_error_surfaces_at_fetch_and_join_with_worker_traceback(coord):
    rv = coord.schedule(fail_with, args=("the step broke",))
    with pytest.raises(StepFunctionError) as info:
        coord.join()
    err = info.value
    assert err.type_name == "ValueError" and err.message == "the step broke"
    assert "Traceback (most recent call last)" in err.remote_traceback
    assert "fail_with" in str(err) and "the step broke" in str(err)
    with pytest.raises(StepFunctionError, match="the step broke"):
        rv.fetch()
    assert rv.status is RemoteValueStatus.FAILED
    # join raised the error once; the coordinator keeps working afterwards.
    assert coord.schedule(add, args=(1, 2)).fetch() == 3
    coord.join()


def fail_when_released(fifo_path):
    """Block until the test opens the FIFO for writing, then fail."""
    with open(fifo_path) as f:
        f.read()
    raise ValueError("first")


def test_queued_closures_are_cancelled_after_an_error(tmp_path):
    fifo = str(tmp_path / "release")
    os.mkfifo(fifo)
    # One worker: the closures behind the failing one stay queued until it fails.
    with LocalCluster(num_ps=1, num_workers=1) as one:
        strategy = ParameterServerStrategy(one.spec)
        with ClusterCoordinator(strategy) as coord:
            failing = coord.schedule(fail_when_released, args=(fifo,))
            later = [coord.schedule(add, args=(i, i)) for i in range(20)]
            with open(fifo, "w") as f:   # opens once the worker has started the closure
                f.write("go")
            with pytest.raises(StepFunctionError, match="first"):
                coord.join()
            assert failing.status is RemoteValueStatus.FAILED
            assert all(rv.status is RemoteValueStatus.CANCELLED for rv in later)
            with pytest.raises(ClosureCancelled):
                later[0].fetch()


def test_unimportable_step_function_names_the_module(coord, monkeypatch):
    ref = worker_pb2.FunctionRef(qualified_name="no_such_module_xyz:step")
    encode = serialization.encode_function   # pretend `add` lives in a module the workers lack
    monkeypatch.setattr(serialization, "encode_function",
                        lambda fn, *a, **kw: ref if fn is add else encode(fn, *a, **kw))
    rv = coord.schedule(add, args=(1, 2))
    with pytest.raises(WorkerCallError, match="no_such_module_xyz"):
        coord.join()
    with pytest.raises(WorkerCallError, match="'no_such_module_xyz' is not importable"):
        rv.fetch()


_ONLY_HERE = """
def helper(x):
    return x + 1


def step(x):
    return helper(x)


def make_step():
    def step(x):
        return helper(x)
    return step
"""


def test_a_module_the_worker_lacks_is_named_with_what_to_do(tmp_path, monkeypatch):
    with LocalCluster(num_ps=1, num_workers=1) as one, \
            ClusterCoordinator(ParameterServerStrategy(one.spec)) as coord:
        (tmp_path / "pstrain_only_here.py").write_text(_ONLY_HERE)
        monkeypatch.syspath_prepend(str(tmp_path))   # after the worker started: not on its path
        import pstrain_only_here as mod
        try:
            worker = one.workers[0].address
            for fn in (mod.step, mod.make_step()):   # sent by reference, then by value
                rv = coord.schedule(fn, args=(1,))
                with pytest.raises(WorkerCallError) as err:
                    coord.join()
                assert (f"module 'pstrain_only_here' is not importable on worker {worker} "
                        in str(err.value))
                assert "install the package there or add its directory to PYTHONPATH" in str(
                    err.value)
                with pytest.raises(WorkerCallError, match="is not importable on worker"):
                    rv.fetch()
        finally:
            sys.modules.pop("pstrain_only_here", None)


def test_closure_arguments_that_cannot_be_pickled_fail_at_schedule(coord):
    import threading
    with pytest.raises(TypeError, match="cannot send the arguments"):
        coord.schedule(add, args=(threading.Lock(), 1))


# -- per-worker datasets ------------------------------------------------------------------
def test_per_worker_dataset_gives_each_worker_its_shard(coord):
    def dataset_fn(ctx):
        return iter(range(ctx.input_pipeline_id, 10_000, ctx.num_input_pipelines))

    def take(it):
        return next(it), os.getpid()

    it = iter(coord.create_per_worker_dataset(dataset_fn))
    got = coord.fetch([coord.schedule(take, args=(it,)) for _ in range(60)])
    by_pid: dict[int, list[int]] = {}
    for value, pid in got:
        by_pid.setdefault(pid, []).append(value)
    values = [v for v, _ in got]
    assert len(set(values)) == len(values), "an element was produced twice"
    for vals in by_pid.values():   # each worker walks its own shard in order
        assert len({v % 2 for v in vals}) == 1 and vals == sorted(vals)


def test_batches_without_a_seed_shuffle_each_worker_its_own_reproducible_order(coord):
    """Issue 32: every worker got the same order by default (seed 0); now,
    as an unseeded tf.data shuffle, each worker its own, reproducible (the
    same order again for the same worker index), and a seed given is kept."""
    from coordinator import batches

    def dataset_fn(ctx):   # the same 64 examples on each worker
        return batches(np.arange(64), batch_size=64)

    def seeded(ctx):
        return batches(np.arange(64), batch_size=64, seed=3)

    def take(it):
        return next(it)[0].tolist(), os.getpid()

    for fn in (dataset_fn, dataset_fn, seeded):
        it = iter(coord.create_per_worker_dataset(fn))
        got = {}
        for order, pid in coord.fetch([coord.schedule(take, args=(it,)) for _ in range(8)]):
            got.setdefault(pid, order)   # each worker's first epoch
        assert len(got) == 2, got
        orders = sorted(got.values())
        if fn is seeded:
            assert orders[0] == orders[1] == np.random.default_rng(3).permutation(64).tolist()
        else:
            assert orders[0] != orders[1] and orders == sorted(
                np.random.default_rng([0, i]).permutation(64).tolist() for i in (0, 1))
    assert list(batches(np.arange(8), batch_size=8, repeat=False))[0][0].tolist() == \
        np.random.default_rng(0).permutation(8).tolist()   # in-process: seed 0, as before


# -- several closures per worker ------------------------------------------------------------
#: In each worker process (this module is imported there by name): two
#: closures meet here only if they run at the same time.
_PAIR = threading.Barrier(2)


def meet_in_pairs(timeout=30.0):
    _PAIR.wait(timeout=timeout)   # BrokenBarrierError: no second closure ran alongside
    return os.getpid()


def meet_then_crash_once(marker_path):
    """Both closures of a worker in flight, then the first to get here kills
    the worker (both are cut: the other one waits to be); re-runs on the
    surviving worker return its pid."""
    _PAIR.wait(timeout=30)
    mine = f"{marker_path}.{os.getpid()}.{threading.get_ident()}"
    with open(mine, "w") as f:
        f.write(str(os.getpid()))
    try:
        os.link(mine, marker_path)   # atomic: the marker appears with its pid written
    except FileExistsError:
        with open(marker_path) as f:
            if int(f.read()) == os.getpid():   # the other slot here is crashing the process
                threading.Event().wait(60)
        return os.getpid()
    os._exit(1)


def counted_dataset(marker_path):
    """A generator dataset whose creation is written down, one line per process."""
    def dataset_fn():
        with open(marker_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return (i for i in range(1_000_000))   # a generator: not safe unlocked
    return dataset_fn


def take(it):
    return os.getpid(), next(it)


def test_two_closures_per_worker_run_at_once_on_it(tmp_path):
    marker = tmp_path / "created"
    with LocalCluster(num_ps=1, num_workers=1) as cluster:
        with ClusterCoordinator(ParameterServerStrategy(cluster.spec),
                                closures_per_worker=2) as coord:
            it = iter(coord.create_per_worker_dataset(counted_dataset(str(marker))))
            rvs = [coord.schedule(meet_in_pairs) for _ in range(8)]
            taken = coord.fetch([coord.schedule(take, args=(it,)) for _ in range(40)])
            assert set(coord.fetch(rvs)) == {cluster.workers[0].pid}
            assert coord.num_workers == 1 and coord.workers_alive() == 1
            threads = [w._thread for ws in coord.cluster.membership.extra.values() for w in ws] + \
                [w._thread for w in coord.cluster.membership.workers.values()]
            assert len(threads) == 2
        assert not any(t.is_alive() for t in threads)   # both slots stopped at shutdown
        pid = cluster.workers[0].pid
    assert sorted(v for _, v in taken) == list(range(40))   # each element once
    assert marker.read_text().split() == [str(pid)]         # the dataset made once


def test_one_closure_per_worker_runs_them_one_at_a_time():
    """The default, as TensorFlow: the pair never meets, the barrier breaks."""
    with LocalCluster(num_ps=1, num_workers=1) as cluster, \
            ClusterCoordinator(ParameterServerStrategy(cluster.spec)) as coord:
        rvs = [coord.schedule(meet_in_pairs, args=(2.0,)) for _ in range(2)]
        with pytest.raises(StepFunctionError, match="BrokenBarrierError"):
            coord.fetch(rvs)


def test_both_closures_in_flight_on_a_dying_worker_are_run_again(cluster, tmp_path):
    strategy = ParameterServerStrategy(cluster.spec)
    with ClusterCoordinator(strategy, closures_per_worker=2) as coord:
        rvs = [coord.schedule(meet_then_crash_once, args=(str(tmp_path / "crashed"),))
               for _ in range(4)]
        pids = [rv.fetch(timeout=90) for rv in rvs]
        coord.join()
    # Every closure ended on one worker; the other crashed. Its sockets close
    # while it exits, so the re-runs may finish before it is reaped: wait.
    (survivor,) = set(pids)
    (crashed,) = [w for w in cluster.workers if w.pid != survivor]
    assert crashed.proc.wait(timeout=30) == 1
    assert [w.alive() for w in cluster.workers if w.pid == survivor] == [True]


def test_a_restarted_worker_gets_its_datasets_once_with_two_slots(cluster, tmp_path):
    marker = tmp_path / "created"
    with ClusterCoordinator(ParameterServerStrategy(cluster.spec),
                            closures_per_worker=2) as coord:
        it = iter(coord.create_per_worker_dataset(counted_dataset(str(marker))))
        coord.fetch([coord.schedule(take, args=(it,)) for _ in range(10)])
        cluster.restart_worker(0)
        new_pid = cluster.workers[0].pid
        cluster.kill_worker(1)   # from now on only the restarted worker runs closures
        got = coord.fetch([coord.schedule(take, args=(it,)) for _ in range(6)])
    assert {pid for pid, _ in got} == {new_pid}
    assert sorted(v for _, v in got) == list(range(6))   # made afresh, once, not reset
    assert marker.read_text().split().count(str(new_pid)) == 1


class _Mode:
    def __init__(self, mode):
        self.mode = mode


@pytest.mark.parametrize("bad", [0, 4, -1, 1.5, True, "2", None])
def test_closures_per_worker_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="closures_per_worker must be an int from 1 to 3"):
        ClusterCoordinator(_Mode("async"), closures_per_worker=bad)


@pytest.mark.parametrize("mode", ["sync", "hybrid", "bounded"])
def test_several_closures_per_worker_need_async_mode(mode):
    with pytest.raises(ValueError, match="needs the strategy's async mode"):
        ClusterCoordinator(_Mode(mode), closures_per_worker=np.int64(2))


# -- sharded variables ----------------------------------------------------------------------
def test_sharded_gather_and_sparse_push_route_every_id(cluster):
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(3))
    table0 = np.arange(10 * 4, dtype=np.float64).reshape(10, 4)   # 10 rows over 3 shards: 4,3,3
    table = strategy.create_variable("table", initial_value=table0, optimizer="sgd",
                                     optimizer_params={"learning_rate": 1.0})
    assert [s.rows for s in table.shards] == [4, 3, 3]
    assert len({s.address for s in table.shards}) == 2   # round-robin over both servers
    ids = np.array([[9, 0, 4], [3, 7, 3]])               # every shard, out of order, repeated
    np.testing.assert_array_equal(table.gather(ids), table0[ids])
    grad = np.ones((6, 4))
    table.push_sparse(ids.ravel(), grad)
    expected = table0.copy()
    np.subtract.at(expected, ids.ravel(), grad)           # duplicates summed
    np.testing.assert_array_equal(table.read(), expected)
    np.testing.assert_array_equal(table.gather([3]), expected[[3]])


def test_each_distinct_id_crosses_the_wire_once_and_sums_as_the_server_would(cluster,
                                                                          monkeypatch):
    """gather / read_variables(lookup) ask for each distinct id once;
    push_sparse / push_gradients(IndexedSlices) send each distinct id once,
    its rows summed here as the server sums duplicates (the same bits)."""
    from coordinator import IndexedSlices, push_gradients, read_variables
    from coordinator.ps_pool import client_for
    from psserver.client import PSClient
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
    rng = np.random.default_rng(0)
    table0 = rng.standard_normal((50, 8)).astype(np.float32)
    kw = dict(initial_value=table0, optimizer="adagrad", optimizer_params={"learning_rate": 0.3})
    ours, ref = strategy.create_variable("ours", **kw), strategy.create_variable("ref", **kw)
    sent = []   # (call, ids) of every gather and sparse push, whichever call carries it
    # (every data call of PSClient is one of these: a gather is a read that
    # looks rows up, and each blocking form is its async form's result)
    ids_of = {"push_sparse_async": lambda a: [a[1]],
              "read_all_async": lambda a: [ids for _, ids in a[1]],
              "push_dense_and_sparse_async": lambda a: [u[1] for u in a[1]]}
    for name, which in ids_of.items():
        def spy(self, *a, _real=getattr(PSClient, name), _m=name, _which=which, **k):
            sent.extend((_m, np.asarray(i).reshape(-1).copy()) for i in _which(a))
            return _real(self, *a, **k)
        monkeypatch.setattr(PSClient, name, spy)
    ids = rng.integers(0, 50, (6, 30))          # many repeats, both shards
    np.testing.assert_array_equal(ours.gather(ids), table0[ids])
    (rows,) = read_variables([ours.lookup(ids)])
    np.testing.assert_array_equal(rows, table0[ids])
    grads = rng.standard_normal((ids.size, 8)).astype(np.float32)
    ours.push_sparse(ids.ravel(), grads)
    push_gradients([(ours, IndexedSlices(grads, ids.ravel()))])
    for method, got in sent:
        assert np.all(np.diff(got) > 0), (method, got)   # sorted, each id once
    pushes = ("push_sparse", "push_dense_and_sparse", "push_sparse_async",
              "push_dense_and_sparse_async")
    assert sum(got.size for m, got in sent if m in pushes) == 2 * np.unique(ids).size
    assert sum(got.size for m, got in sent if m not in pushes) == 2 * np.unique(ids).size
    # The reference: each shard sent every duplicate, summed on its server.
    for _ in range(2):
        for s in ref.shards:
            mine = (ids.ravel() >= s.offset) & (ids.ravel() < s.offset + s.rows)
            client_for(s.address).push_sparse(s.name, ids.ravel()[mine] - s.offset, grads[mine])
    np.testing.assert_array_equal(ours.read(), ref.read())


def test_min_size_partitioner_shards_a_large_table(cluster):
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2))
    small = strategy.create_variable("small", shape=(10, 10), initializer="ones")
    big = strategy.create_variable("big", shape=(100_000, 8), initializer="random_normal", seed=3)
    assert small.num_shards == 1 and big.num_shards == 2
    assert [s.rows for s in big.shards] == [50_000, 50_000]
    value = big.read()
    assert value.shape == (100_000, 8) and value.dtype == np.float32
    assert 0.9 < value.std() < 1.1
    np.testing.assert_array_equal(big.gather([0, 49_999, 50_000, 99_999]),
                                  value[[0, 49_999, 50_000, 99_999]])


def test_failed_shard_creation_leaves_nothing_behind(cluster):
    from psserver.client import PSClient
    from psserver.errors import AlreadyExists
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
    # Occupy the name the second shard would take, so creating it fails.
    second_ps = cluster.spec.ps[1]
    with PSClient(second_ps, token=cluster.token, tls=cluster.tls) as c:
        c.create_variable("v/part_1", (2,))
        with pytest.raises(AlreadyExists):
            strategy.create_variable("v", shape=(4,))
        names = {m.name for m in c.list_variables()}
    with PSClient(cluster.spec.ps[0], token=cluster.token, tls=cluster.tls) as c0:
        assert "v/part_0" not in {m.name for m in c0.list_variables()}
    assert names == {"v/part_1"}


# -- membership -----------------------------------------------------------------------------------
def test_worker_started_after_training_began_takes_closures(cluster, coord):
    first = set(coord.fetch([coord.schedule(worker_pid) for _ in range(10)]))
    index = cluster.add_worker()
    new_pid = cluster.workers[index].pid
    assert new_pid not in first
    # With the original workers gone, only the late one can run the closures.
    cluster.kill_worker(0)
    cluster.kill_worker(1)
    pids = coord.fetch([coord.schedule(worker_pid) for _ in range(10)])
    assert set(pids) == {new_pid}
    assert coord.num_workers == 1


def crash_first_time(marker_path):
    """Crash the worker process on the first attempt; succeed on the re-run."""
    try:
        fd = os.open(marker_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return os.getpid()
    os.close(fd)
    os._exit(1)   # the worker dies in the middle of the step


def test_closure_requeued_when_its_worker_dies(cluster, coord, tmp_path):
    rv = coord.schedule(crash_first_time, args=(str(tmp_path / "attempted"),))
    pid = rv.fetch(timeout=60)
    coord.join()
    assert pid in {w.pid for w in cluster.workers}
    # The other worker crashed on the first attempt (its sockets close while
    # it exits, so the re-run may finish before it is reaped: wait).
    (crashed,) = [w for w in cluster.workers if w.pid != pid]
    assert crashed.proc.wait(timeout=30) == 1


def test_restarted_worker_rejoins_with_its_datasets(cluster, coord):
    def dataset_fn():
        return iter(range(1_000_000))

    def take(it):
        return os.getpid(), next(it)

    it = iter(coord.create_per_worker_dataset(dataset_fn))
    coord.fetch([coord.schedule(take, args=(it,)) for _ in range(10)])
    old_pid = cluster.workers[0].pid
    cluster.restart_worker(0)
    new_pid = cluster.workers[0].pid
    assert new_pid != old_pid
    cluster.kill_worker(1)   # from now on only the restarted worker can run closures
    got = coord.fetch([coord.schedule(take, args=(it,)) for _ in range(5)])
    assert {pid for pid, _ in got} == {new_pid}
    # Its dataset was created afresh on the new process: it starts from the beginning.
    assert sorted(v for _, v in got) == [0, 1, 2, 3, 4]


# -- tasks that do not answer ----------------------------------------------------------------------
def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.timeout(30)   # a call's own deadline is 60 s: the old bare DeadlineExceeded
def test_a_parameter_server_that_does_not_answer_is_named_soon():
    dead = free_address()   # nothing listens there
    strategy = ParameterServerStrategy(ClusterSpec(ps=[dead]))   # the default connect_timeout
    with pytest.raises(Unavailable) as err:
        strategy.create_variable("w", shape=(3,))
    message = str(err.value)
    assert f"ps 0 at {dead} does not answer" in message
    assert "check that its psserver is running there" in message
    assert "host and port in the cluster spec" in message and "firewall" in message
    assert "PSTRAIN_CONNECT_SECONDS" in message
    assert strategy.variables == []


class _Seen(logging.Handler):
    """Sets ``event`` when a record containing ``text`` is logged."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.event = text, threading.Event()

    def emit(self, record):
        if self.text in record.getMessage():
            self.event.set()


@pytest.mark.timeout(60)
def test_a_worker_that_does_not_answer_is_named_and_still_waited_for(ps, caplog):
    dead = free_address()
    strategy = ParameterServerStrategy(ClusterSpec(ps=[ps.address], worker=[dead]),
                                       token="t0ken", connect_timeout=1)
    silent, back = _Seen(f"worker 0 at {dead} does not answer"), _Seen("answers now")
    caplog.set_level(logging.WARNING, logger="coordinator")
    log = logging.getLogger()   # the root: whatever logger below "coordinator" warns
    for h in (silent, back):
        log.addHandler(h)
    try:
        with ClusterCoordinator(strategy) as coord:
            rv = coord.schedule(add, args=(1, 2))
            assert silent.event.wait(30), caplog.text
            assert "check that its psworker is running there" in caplog.text
            assert "still waiting for it" in caplog.text
            assert rv.status is RemoteValueStatus.PENDING
            # It starts late, on the address in the spec: the closure runs there.
            here = os.path.dirname(os.path.abspath(__file__))   # `add` is this module's
            late = start_task("psworker", ["--port", dead.rsplit(":", 1)[1]],
                              env={"PSTRAIN_AUTH_TOKEN": "t0ken",
                                   "PYTHONPATH": os.pathsep.join(
                                       [os.path.dirname(os.path.dirname(here)), here])})
            try:
                assert rv.fetch(timeout=30) == 3
                assert back.event.wait(5), caplog.text
            finally:
                late.kill()
    finally:
        for h in (silent, back):
            log.removeHandler(h)


# -- worker security ------------------------------------------------------------------------------
def _worker_stub(address, tls=None):
    return worker_pb2_grpc.WorkerStub(make_channel(address, [], tls))


def test_worker_without_token_runs_no_function_for_anyone(tmp_path):
    """The probe's attack: `os:system` by name, arguments of plain data, over
    gRPC and over the worker's data port with an empty-token hello. A
    tokenless worker refuses both (and functions by value, and datasets);
    nothing runs."""
    from psserver.contract import routing
    from psserver.link import methods
    from psserver.link.transport import SocketTransport

    marker = tmp_path / "pwned"
    w = start_task("psworker", ["--port", "0"], env={"PSTRAIN_AUTH_TOKEN": ""})
    try:
        stub = _worker_stub(w.address)
        attack = worker_pb2.ClosureRequest(
            fn=worker_pb2.FunctionRef(qualified_name="os:system"),
            args=serialization.dumps(((f"touch {marker}",), {})))
        by_value = worker_pb2.ClosureRequest(
            fn=serialization.encode_function(lambda: open(marker, "w")),
            args=serialization.dumps(((), {})))
        dataset = worker_pb2.CreateDatasetRequest(
            dataset_id="d", fn=worker_pb2.FunctionRef(qualified_name="os:system"))
        for call, req in ((stub.RunClosure, attack), (stub.RunClosure, by_value),
                          (stub.CreateDataset, dataset)):
            with pytest.raises(grpc.RpcError) as info:
                call(req, timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "PSTRAIN_AUTH_TOKEN" in info.value.details()
            assert "--insecure-no-auth" in info.value.details()
        info = stub.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=10)
        data = SocketTransport(routing.TCP, w.address, None, tcp=("127.0.0.1", info.host.data_port))
        try:
            with pytest.raises(PSError) as caught:
                data.call(methods.RUN_CLOSURE, attack.SerializeToString(), 10)
            assert caught.value.code == Code.PERMISSION_DENIED
        finally:
            data.close()
        # it says what it does (issue 35 item 2: it said anyone could run code)
        assert "no PSTRAIN_AUTH_TOKEN: this worker runs no closures" in w.output()
        assert "run any code" not in w.output()
    finally:
        w.kill()
    assert not marker.exists()


def test_worker_started_insecure_runs_closures_and_says_so():
    w = start_task("psworker", ["--port", "0", "--insecure-no-auth"],
                   env={"PSTRAIN_AUTH_TOKEN": ""})
    try:
        reply = _worker_stub(w.address).RunClosure(worker_pb2.ClosureRequest(
            fn=worker_pb2.FunctionRef(qualified_name="operator:add"),
            args=serialization.dumps(((2, 3), {}))), timeout=10)
        assert serialization.loads(reply.result, trusted=True) == 5
        assert "SECURITY: no PSTRAIN_AUTH_TOKEN" in w.output()
        assert "run any code" in w.output()
    finally:
        w.kill()


@pytest.mark.parametrize("role", ["psserver", "psworker"])
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_tokenless_task_refuses_to_listen_beyond_loopback(role, host):
    """Exit 2 with what to do; --insecure-no-auth starts it (and warns)."""
    import subprocess
    import sys

    from psserver.process import child_env

    env = {**child_env(), "PSTRAIN_AUTH_TOKEN": ""}
    r = subprocess.run([sys.executable, "-m", role, "--host", host, "--port", "0"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "PSTRAIN_AUTH_TOKEN" in r.stderr and "--insecure-no-auth" in r.stderr
    t = start_task(role, ["--host", host, "--port", "0", "--insecure-no-auth"],
                   env={"PSTRAIN_AUTH_TOKEN": ""}, timeout=30)
    try:
        assert "SECURITY: no PSTRAIN_AUTH_TOKEN" in t.output()
        assert "anyone who can reach it" in t.output()
    finally:
        t.kill()


def test_worker_with_token_refuses_calls_without_it(cluster):
    stub = _worker_stub(cluster.spec.worker[0], cluster.tls)
    req = worker_pb2.ClosureRequest(fn=worker_pb2.FunctionRef(qualified_name="operator:add"),
                                    args=serialization.dumps(((1, 1), {})))
    for md in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as info:
            stub.RunClosure(req, metadata=md, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = stub.RunClosure(req, metadata=(("authorization", f"Bearer {cluster.token}"),), timeout=10)
    assert serialization.loads(reply.result, trusted=True) == 2


@pytest.mark.timeout(90)
def test_two_clusters_in_one_process_each_keep_their_token_and_tls():
    """Two LocalClusters (each its own token and certificates) driven from one
    program: the second strategy used to replace the process's connection
    pool's credentials, so the first cluster's reads, pushes and its
    coordinator's watch failed the TLS handshake (bench.bench_replication
    runs two clusters so). Each cluster's servers keep their own."""
    from coordinator import push_gradients, read_variables
    with LocalCluster(num_ps=1, num_workers=1) as a, LocalCluster(num_ps=1, num_workers=1) as b:
        assert a.token != b.token
        sa = ParameterServerStrategy(a.spec)
        wa = sa.create_variable("w", initial_value=np.ones(4, np.float32), optimizer="sgd",
                                optimizer_params={"learning_rate": 1.0})
        sb = ParameterServerStrategy(b.spec)
        wb = sb.create_variable("w", initial_value=np.full(4, 2.0, np.float32), optimizer="sgd",
                                optimizer_params={"learning_rate": 1.0})
        # cluster a, after b's strategy was made: directly, and through its workers
        np.testing.assert_array_equal(wa.read(), np.ones(4, np.float32))

        def step(v):
            push_gradients([(v, np.full(4, 0.5, np.float32))])
            return read_variables([v])[0]
        for strategy, v, start in ((sa, wa, 1.0), (sb, wb, 2.0)):
            with ClusterCoordinator(strategy) as coord:
                got = coord.fetch([coord.schedule(step, args=(v,)) for _ in range(4)])
                coord.join()
            np.testing.assert_array_equal(v.read(), np.full(4, start - 2.0, np.float32))
            assert float(got[-1][0]) == start - 2.0
