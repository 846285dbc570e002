"""Dynamic embedding tables through the strategy and the coordinator
(coordinator/embedding.py): keys spread over real parameter servers by
hash, looked up and trained by step closures on real workers."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from coordinator import (
    CheckpointManager,
    ClusterCoordinator,
    DynamicEmbedding,
    LocalCluster,
    ParameterServerStrategy,
)
from coordinator.checkpoint_files import CheckpointError
from psserver.client import PSClient
from psserver.errors import AlreadyExists

pytestmark = pytest.mark.timeout(180)
I64 = np.iinfo(np.int64)


def _target(keys: np.ndarray) -> np.ndarray:
    """The row each key should learn: a function of the key."""
    return np.repeat(((keys % 7) - 3).astype(np.float32)[:, None], 4, axis=1)


def _train_step(table: DynamicEmbedding, keys: np.ndarray):
    def step(seed):
        rng = np.random.default_rng(seed)
        batch = keys[rng.integers(0, keys.size, 64)]
        rows = table.lookup(batch)
        table.push_gradient(batch, rows - _target(batch))   # d/drow of 0.5 |row - target|^2
        return float(np.mean((rows - _target(batch)) ** 2))
    return step


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_ps=2, num_workers=2) as c:
        yield c


def test_workers_train_a_table_whose_keys_spread_over_every_server(cluster):
    strategy = ParameterServerStrategy(cluster.spec)
    table = strategy.create_embedding_table("emb", 4, optimizer="sgd",
                                            optimizer_params={"learning_rate": 0.5})
    assert pickle.loads(pickle.dumps(table)) == table
    keys = np.random.default_rng(0).integers(I64.min, I64.max, 200, dtype=np.int64)
    with ClusterCoordinator(strategy) as coord:
        step = _train_step(table, keys)
        losses = coord.fetch([coord.schedule(step, args=(i,)) for i in range(120)])
    # rows start at zeros: the loss before training (a closure's own first
    # loss depends on how many steps the other worker ran before it)
    initial = float(np.mean(_target(keys) ** 2))
    assert initial > 1.0 and np.mean(losses[-10:]) < 0.05 * initial, losses
    learnt = table.lookup(keys, admit=False)
    np.testing.assert_allclose(learnt, _target(keys), atol=0.05)
    stats = table.stats()
    assert stats.rows == 200 and stats.admitted == 200 and stats.dropped == 0
    assert stats.lookups == 120 * 64 and stats.updated > 0
    per_server = []
    for address in cluster.spec.ps:
        with PSClient(address, token=cluster.spec.token, tls=strategy.tls) as c:
            per_server.append(c.table_info("emb").rows)
    assert sum(per_server) == 200 and min(per_server) > 60, per_server   # both hold a share


def test_admission_and_capacity_hold_over_the_shards(cluster):
    strategy = ParameterServerStrategy(cluster.spec)
    table = strategy.create_embedding_table("capped", 2, initializer="ones", min_count=2,
                                            capacity=100)
    keys = np.arange(300, dtype=np.int64) * 1_000_003
    np.testing.assert_array_equal(table.lookup(keys), np.zeros((300, 2)))   # once: not yet
    assert table.stats().rows == 0 and table.stats().not_admitted == 300
    rows = table.lookup(keys[:80])                                          # twice: admitted
    np.testing.assert_array_equal(rows, np.ones((80, 2)))
    table.lookup(keys[80:])
    stats = table.stats()
    assert stats.rows <= 100 and stats.evicted_capacity == stats.admitted - stats.rows > 0
    updated, dropped = table.push_gradient(keys, np.ones((300, 2), np.float32))
    assert (updated, dropped) == (stats.rows, 300 - stats.rows)


def test_made_again_with_the_same_arguments_the_table_is_reused(cluster):
    first = ParameterServerStrategy(cluster.spec).create_embedding_table("again", 3,
                                                                         initializer="ones")
    first.lookup([5, 6])
    again = ParameterServerStrategy(cluster.spec).create_embedding_table("again", 3,
                                                                         initializer="ones")
    assert again.stats().rows == 2
    with pytest.raises(Exception, match="exists"):
        ParameterServerStrategy(cluster.spec).create_embedding_table("again", 5)


def test_a_table_and_a_variable_have_one_seed_whichever_way_it_is_given(cluster):
    """``seed=`` and an Initializer's own seed are one seed (issue 32): given
    either way the rows (and the shards' spec: admission draws too) are the
    same; two different ones are refused, not one silently ignored."""
    from coordinator import Initializer
    strategy = ParameterServerStrategy(cluster.spec)
    a = strategy.create_embedding_table("seed-a", 3, initializer="random_normal", seed=7,
                                        probability=0.5)
    b = strategy.create_embedding_table("seed-b", 3, probability=0.5,
                                        initializer=Initializer("random_normal", seed=7))
    keys = np.arange(200, dtype=np.int64)
    for t in (a, b):
        for _ in range(8):
            t.lookup(keys)
    np.testing.assert_array_equal(a.lookup(keys, admit=False), b.lookup(keys, admit=False))
    assert a.lookup(keys, admit=False).any()
    from coordinator.ps_pool import client_for
    specs = [client_for(cluster.spec.ps[0]).table_info(n).spec for n in ("seed-a", "seed-b")]
    assert specs[0].seed == specs[1].seed and specs[0].initializer.seed == 7
    for make in (lambda: strategy.create_embedding_table(
                     "seed-c", 3, initializer=Initializer("random_normal", seed=7), seed=8),
                 lambda: strategy.create_variable(
                     "seed-v", (4, 2), initializer=Initializer("random_normal", seed=1), seed=2)):
        with pytest.raises(ValueError, match="two seeds"):
            make()
    v = strategy.create_variable("seed-w", (4, 2), seed=3,
                                 initializer=Initializer("random_normal"))
    w = strategy.create_variable("seed-x", (4, 2), initializer=Initializer("random_normal", seed=3))
    np.testing.assert_array_equal(v.read(), w.read())


def test_bad_keys_and_gradients_are_refused_before_any_call(cluster):
    table = ParameterServerStrategy(cluster.spec).create_embedding_table("strict", 3)
    with pytest.raises(ValueError, match="int64"):
        table.lookup(np.array([1.5]))
    with pytest.raises(ValueError, match="int64"):
        table.lookup(np.array([1], np.uint64))
    with pytest.raises(ValueError, match="shape"):
        table.push_gradient([1, 2], np.ones((2, 4), np.float32))
    assert table.stats().lookups == 0


def _saved_table(path: str, table) -> dict:
    from coordinator.checkpoint_files import chain_of, load_table
    state, _ = load_table(table, chain_of(path))
    return state


@pytest.mark.timeout(240)
def test_a_checkpoint_of_two_servers_restores_into_three_bit_for_bit(tmp_path):
    """Keys, rows, Adagrad's slot, look-up counts and ages saved atomically
    with the variables, restored resharded by key into 3 servers: the same
    arrays (ages in seconds aside: they grow), every server holding a share,
    and training goes on from there."""
    ckpt_dir = str(tmp_path / "ckpt")
    keys = np.random.default_rng(3).integers(I64.min, I64.max, 500, dtype=np.int64)
    spec = dict(optimizer="adagrad", optimizer_params={"learning_rate": 0.3},
                initializer="random_normal", seed=9, min_count=1)
    with LocalCluster(num_ps=2, num_workers=1) as two:
        strategy = ParameterServerStrategy(two.spec)
        table = strategy.create_embedding_table("emb", 4, **spec)
        strategy.create_variable("w", initial_value=np.arange(6, dtype=np.float32))
        with ClusterCoordinator(strategy) as coord:
            first = coord.fetch([coord.schedule(_train_step(table, keys), args=(i,))
                                 for i in range(30)])
        saved_path = CheckpointManager(strategy, ckpt_dir).save(step=30)
        before = table.lookup(keys, admit=False)
        rows_before = table.stats().rows
    saved = _saved_table(saved_path, table)
    assert saved["keys"].size == rows_before > 0
    with LocalCluster(num_ps=3, num_workers=1) as three:
        strategy = ParameterServerStrategy(three.spec)
        table3 = strategy.create_embedding_table("emb", 4, **spec)
        w3 = strategy.create_variable("w", initial_value=np.zeros(6, np.float32))
        assert CheckpointManager(strategy, ckpt_dir).restore()["step"] == 30
        np.testing.assert_array_equal(w3.read(), np.arange(6))   # the variables as well
        np.testing.assert_array_equal(table3.lookup(keys, admit=False), before)
        shares = []
        for address in three.spec.ps:
            with PSClient(address, token=three.spec.token, tls=strategy.tls) as c:
                shares.append(c.table_info("emb").rows)
        assert sum(shares) == rows_before and min(shares) > 0, shares
        again = _saved_table(CheckpointManager(strategy, ckpt_dir).save(step=31), table3)
        for name, want in saved.items():
            if name == "age_seconds":
                assert (again[name] >= want).all()
            else:
                np.testing.assert_array_equal(again[name], want, err_msg=name)
        with ClusterCoordinator(strategy) as coord:   # training goes on
            losses = coord.fetch([coord.schedule(_train_step(table3, keys), args=(i,))
                                  for i in range(30, 40)])
        assert np.mean(losses) < 0.8 * np.mean(first[:10]), (first, losses)   # not from scratch


def test_a_table_missing_from_a_checkpoint_is_refused_with_nothing_changed(cluster, tmp_path):
    strategy = ParameterServerStrategy(cluster.spec)
    old = strategy.create_embedding_table("kept", 2, initializer="ones")
    old.lookup([1, 2, 3])
    path = CheckpointManager(strategy, str(tmp_path)).save(step=1)
    later = ParameterServerStrategy(cluster.spec)
    later.create_embedding_table("kept", 2, initializer="ones").lookup([4])
    later.create_embedding_table("new", 2)
    with pytest.raises(CheckpointError, match="'new' is not in checkpoint"):
        CheckpointManager(later, str(tmp_path)).restore(path)
    assert old.stats().rows == 4   # 1, 2, 3 and 4: nothing restored


def test_a_restarted_server_gets_its_table_shard_back_from_the_latest_checkpoint(tmp_path):
    """Without replication: a server restarted empty gets its shard of the
    table made again and filled from the coordinator's latest checkpoint;
    the other server's shard is untouched, and training goes on."""
    keys = np.arange(64, dtype=np.int64)
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        t = strategy.create_embedding_table("count", 2, optimizer="sgd",
                                            optimizer_params={"learning_rate": 1.0})
        ckpt = CheckpointManager(strategy, str(tmp_path / "ckpt"))

        def step():
            t.lookup(keys)
            t.push_gradient(keys, -np.ones((keys.size, 2), np.float32))
        with ClusterCoordinator(strategy, checkpoint_manager=ckpt, ps_check_interval=0.2) as coord:
            coord.fetch([coord.schedule(step) for _ in range(10)])
            coord.join()
            ckpt.save(step=10)
            cluster.kill_ps(0)   # restarted, empty
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)
            restored = t.lookup(keys, admit=False)
            coord.fetch([coord.schedule(step) for _ in range(5)])
            coord.join()
            after = t.lookup(keys, admit=False)
    np.testing.assert_array_equal(restored, np.full((64, 2), 10, np.float32))
    np.testing.assert_array_equal(after, np.full((64, 2), 15, np.float32))


def test_a_table_that_cannot_be_made_everywhere_is_made_nowhere(cluster):
    """create_embedding_table is all or nothing: a server holding a table of
    that name with another spec refuses, and the shards this call made on
    the other servers are deleted again."""
    with PSClient(cluster.spec.ps[1], token=cluster.token, tls=cluster.tls) as c:
        c.create_table("clash", 8)
    strategy = ParameterServerStrategy(cluster.spec)
    with pytest.raises(AlreadyExists, match="another spec"):
        strategy.create_embedding_table("clash", 4)
    with PSClient(cluster.spec.ps[0], token=cluster.token, tls=cluster.tls) as c0, \
            PSClient(cluster.spec.ps[1], token=cluster.token, tls=cluster.tls) as c1:
        assert "clash" not in [i.name for i in c0.list_tables()]
        assert [i.spec.dim for i in c1.list_tables() if i.name == "clash"] == [8]   # untouched
        c1.delete_table("clash")
    assert strategy.tables == []
    with pytest.raises(ValueError, match="_backup/"):   # replication's own copies' names
        strategy.create_embedding_table("_backup/x", 4)


def test_sum_rows_sums_each_keys_gradient_rows():
    """The worker sums a batch's duplicate keys' gradient rows before sending."""
    from psserver.contract.rows import sum_rows
    rng = np.random.default_rng(2)
    inverse = rng.integers(0, 7, 50)
    rows = rng.normal(size=(50, 3)).astype(np.float32)
    want = np.zeros((7, 3))
    np.add.at(want, inverse, rows.astype(np.float64))
    got = sum_rows(inverse, rows, 7)
    assert got.dtype == np.float32 and got.shape == (7, 3)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="floating"):
        sum_rows(inverse, rows.astype(np.int32), 7)


def test_a_push_reuses_its_look_ups_distinct_keys_only_when_they_are_its_own(cluster,
                                                                             monkeypatch):
    """A gradient push of the keys this thread last looked up in the table
    skips sorting them again; of other keys, it sorts its own, and every
    key gets its own gradient."""
    strategy = ParameterServerStrategy(cluster.spec)
    t = strategy.create_embedding_table("reuse", 2, optimizer="sgd",
                                        optimizer_params={"learning_rate": 1.0})
    a, b = np.array([5, 3, 5, 9], np.int64), np.array([3, 3, 7, 7], np.int64)
    t.lookup_async(a).result()
    t.lookup(b)   # this thread's last look-up of t
    from coordinator import key_order
    sorts = []
    real = key_order._unique   # (a push's sort of its keys: key_order.shard_order)
    monkeypatch.setattr(key_order, "_unique", lambda *x, **k: (sorts.append(1), real(*x, **k))[1])
    minus_one = -np.ones((4, 2), np.float32)
    assert t.push_gradient_async(b, minus_one).result() == (2, 0) and sorts == []
    assert t.push_gradient_async(a, minus_one).result() == (3, 0) and sorts == [1]
    rows = t.lookup(np.array([3, 5, 7, 9], np.int64), admit=False)
    np.testing.assert_array_equal(rows[:, 0], [3, 2, 2, 1])


class _LosesReplies:
    """A transport that passes every call on to a real one, but loses the
    reply of the first ``n`` calls of ``method`` (after the task ran them):
    they fail with Unavailable, as a connection cut under a call does.
    ``sent``: the requests of ``method``, as bytes."""

    def __init__(self, inner, method, n: int = 1):
        self.inner, self.kind, self.method, self.n = inner, inner.kind, method, n
        self.sent: list[bytes] = []

    def send(self, method, request, timeout, **kw):
        from psserver.contract import wire
        from psserver.errors import Unavailable
        from psserver.link.pending import Pending
        if method is not self.method:
            return self.inner.send(method, request, timeout, **kw)
        self.sent.append(bytes(wire.joined(request)))
        post, recover = kw.pop("post", None), kw.pop("recover", None)
        sent = self.inner.send(method, request, timeout, **kw)
        lose = len(self.sent) <= self.n

        def fetch():
            reply = sent.result()   # the task ran it
            if lose:
                raise Unavailable("the reply was lost on the way [test]")
            return reply
        return Pending(fetch, None, post, recover)

    def close(self):
        self.inner.close()


def test_a_table_update_whose_reply_is_lost_is_resent_with_its_key_and_applied_once(start_ps):
    """A table update the server applied but whose reply never came back (a
    connection cut under it) is resent by the caller, the same request with
    the same update key (coordinator/ps_pool.py, as a variable's push), and
    the server applies it once: the row moves by one gradient, not two."""
    from coordinator import ClusterSpec, ps_pool
    from psserver.client import PSClient
    from psserver.contract import routing
    from psserver.link import methods
    from psserver.link.channel import TaskChannel
    from psserver.link.transport import SocketTransport
    ps = start_ps()
    strategy = ParameterServerStrategy(ClusterSpec(ps=[ps.address], worker=[]))
    t = strategy.create_embedding_table("once", 2, optimizer="sgd",
                                        optimizer_params={"learning_rate": 1.0})
    keys = np.array([3, 9, 3], np.int64)
    t.lookup(keys)   # made (admitted on the first look-up)
    with PSClient(ps.address) as c:
        info = c.server_info()
    real = SocketTransport(routing.UNIX, ps.address, None, name=info.host.ipc_socket,
                           identity=f"{info.protocol_version}:{info.server_id}")
    lossy = _LosesReplies(real, methods.BULK_PUSH)
    pool = ps_pool.servers()
    pool.use(ps.address, PSClient(ps.address, channel=TaskChannel(
        ps.address, transports={"unix": lossy})))
    try:
        t.push_gradient(keys, -np.ones((3, 2), np.float32))   # key 3 twice: +2, key 9: +1
        assert len(lossy.sent) == 2 and lossy.sent[0] == lossy.sent[1]   # resent as it was
        rows = t.lookup(np.array([3, 9], np.int64), admit=False)
        np.testing.assert_array_equal(rows, [[2, 2], [1, 1]])   # applied once
    finally:
        ps_pool.close_clients()
