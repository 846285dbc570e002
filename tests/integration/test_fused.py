"""A step's calls to one server as one: read_variables with Lookup items and
push_gradients with IndexedSlices gradients (PSClient.read_and_gather /
push_dense_and_sparse), against real clusters, on both transports: shared
memory on this host, the data port as across hosts (PSTRAIN_SHM=0
everywhere), and gRPC alone (PSTRAIN_DATA=0 too).
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from coordinator import (
    FixedShardsPartitioner,
    IndexedSlices,
    LocalCluster,
    ParameterServerStrategy,
    key_order,
    ps_pool,
    push_gradients,
    read_variables,
)
from coordinator import variables as V
from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
from psserver.client import PSClient
from psserver.contract import routing, shm, wire
from psserver.errors import InvalidArgument

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["shm", "data", "grpc"])
def transport(request, monkeypatch):
    if request.param == "shm" and not shm.available():
        pytest.skip("no sealed memfds on this system")
    ps_pool.close_clients()   # clients read the switches when made
    if request.param != "shm":
        monkeypatch.setenv(shm.ENV, "0")   # this process and the tasks it starts
    if request.param == "grpc":
        monkeypatch.setenv(routing.DATA_ENV, "0")
    yield request.param
    ps_pool.close_clients()


@pytest.fixture
def cluster(transport):
    with LocalCluster(num_ps=2, num_workers=0) as c:
        yield c


def test_lookup_and_indexed_slices_match_gather_and_push_sparse(cluster, transport):
    strategy = ParameterServerStrategy(cluster.spec,
                                       variable_partitioner=FixedShardsPartitioner(3))
    rng = np.random.default_rng(0)
    table0 = rng.standard_normal((10, 4))
    head0 = rng.standard_normal((4, 1))
    kw = dict(optimizer="sgd", optimizer_params={"learning_rate": 0.5})
    fused = strategy.create_variable("fused", initial_value=table0, **kw)
    apart = strategy.create_variable("apart", initial_value=table0, **kw)
    head = strategy.create_variable("head", initial_value=head0, partitioner=None, **kw)
    head2 = strategy.create_variable("head2", initial_value=head0, partitioner=None, **kw)

    ids = np.array([[9, 0, 4], [3, 7, 3]])   # every shard, out of order, repeated
    (rows, w), versions = read_variables([fused.lookup(ids), head], with_versions=True)
    np.testing.assert_array_equal(rows, table0[ids])
    np.testing.assert_array_equal(w, head0)
    assert versions == [[0, 0, 0], [0]]
    # A server with dense reads and none of the lookup's rows (head or head2 is on
    # the server without shard 0): its call has an empty list of gathers.
    rows, w, w2 = read_variables([fused.lookup(np.array([1, 0])), head, head2])
    np.testing.assert_array_equal(rows, table0[[1, 0]])
    np.testing.assert_array_equal(w2, head0)
    empty = read_variables([fused.lookup(np.zeros((0, 3), np.int64))])[0]
    assert empty.shape == (0, 3, 4)

    for step in range(3):
        g = rng.standard_normal((6, 4))
        dw = rng.standard_normal((4, 1))
        push_gradients([(fused, IndexedSlices(g, ids.ravel())), (head, dw)])
        apart.push_sparse(ids.ravel(), g)
        push_gradients([(head2, dw)])
        rows, w = read_variables([fused.lookup(ids), head])
        np.testing.assert_allclose(rows, apart.gather(ids), rtol=1e-12)
        np.testing.assert_allclose(w, head2.read(), rtol=1e-12)
    np.testing.assert_allclose(fused.read(), apart.read(), rtol=1e-12)
    assert [m.version for m in fused.meta()] == [3, 3, 3]
    # the transport under test is the one used
    for a in cluster.spec.ps:
        c = ps_pool.client_for(a)
        sock = c.channel.socket
        assert (sock.kind if sock is not None else "grpc") == \
            {"shm": "unix", "data": "tcp", "grpc": "grpc"}[transport]


def test_fused_calls_check_their_input(cluster):
    strategy = ParameterServerStrategy(cluster.spec)
    table = strategy.create_variable("t", initial_value=np.zeros((5, 2)))
    head = strategy.create_variable("h", initial_value=np.zeros(3))
    with pytest.raises(ValueError, match="out of range"):
        read_variables([table.lookup([0, 5]), head])
    with pytest.raises(ValueError, match="shape"):
        push_gradients([(table, IndexedSlices(np.ones((2, 3)), [0, 1]))])
    assert [m.version for m in table.meta()] == [0]
    # a dynamic table's rows: by Lookup; its lookup() (rows at once) or itself is refused here
    emb = strategy.create_embedding_table("e", dim=2)
    for item, says in ((emb.lookup([1, 2], admit=False), "numpy array.*Lookup\\(table, keys\\)"),
                       (emb, "'e' is read by key: pass Lookup"), ("h", "got str")):
        with pytest.raises(TypeError, match=says):
            read_variables([item, head])
    assert emb.stats().lookups == 0 and [m.version for m in head.meta()] == [0]


# -- the PSClient calls, against one real server ------------------------------------
@pytest.fixture(params=["shm", "data", "grpc"])
def one(ps, request):
    """A client over shared memory, the data port (as from another host) or
    gRPC alone: on each, a step's calls to one server are one call."""
    kw = {"shm": {}, "data": {"shared_memory": False},
          "grpc": {"shared_memory": False, "data_port": False}}[request.param]
    with PSClient(ps.address, **kw) as c:
        c.transport = request.param
        c.create_variable("a", initial_value=np.zeros(1000, np.float32),
                          optimizer_params={"learning_rate": 1.0})
        c.create_variable("t", initial_value=np.zeros((100, 8), np.float32),
                          optimizer_params={"learning_rate": 1.0})
        yield ps, c


def test_fused_push_is_all_or_nothing_and_idempotent(one, monkeypatch):
    ps, c = one
    c.read_many(["a"])   # attaches a segment: the fused calls go through it
    sent = []   # the calls made (but shared memory's), by method
    real_send = c.channel.send
    monkeypatch.setattr(c.channel, "send", lambda method, *a, **k: (
        sent.append(method.path), real_send(method, *a, **k))[1])

    def calls(fn):
        """fn(), checking it made one call (ParameterServerBulk's) where not
        through shared memory."""
        sent.clear()
        out = fn()
        if c.transport != "shm" or not shm.available():
            assert len(sent) == 1 and sent[0].startswith("/pstrain.v1.ParameterServerBulk/")
        else:
            assert len(sent) == 1 and sent[0].startswith("/pstrain.v1.SharedMemory/")
        return out
    good_sparse = ("t", np.array([1, 1, 7]), np.ones((3, 8), np.float32), 11)
    bad_sparse = ("t", np.array([1, 100]), np.ones((2, 8), np.float32), 12)
    with pytest.raises(InvalidArgument, match="out of range"):
        calls(lambda: c.push_dense_and_sparse([("a", np.ones(1000, np.float32), 13)],
                                              [bad_sparse]))
    assert [m.version for m in c.list_variables()] == [0, 0]
    assert not c.read("a").any() and not c.read("t").any()

    for _ in range(2):   # resent with the same keys: applied once
        assert calls(lambda: c.push_dense_and_sparse([("a", np.ones(1000, np.float32), 14)],
                                                     [good_sparse])) == [1, 1]
    sock = c.channel.socket
    assert (sock.kind if sock is not None else "grpc") == \
        {"shm": "unix" if shm.available() else "tcp", "data": "tcp", "grpc": "grpc"}[c.transport]
    np.testing.assert_array_equal(c.read("a"), -np.ones(1000))
    t = c.read("t")
    np.testing.assert_array_equal(t[1], -2 * np.ones(8))   # duplicates summed
    np.testing.assert_array_equal(t[7], -np.ones(8))
    assert np.count_nonzero(t) == 16

    snaps, gathered = calls(lambda: c.read_and_gather(
        ["a"], [("t", np.array([[7, 1], [0, 7]])), ("t", np.zeros(0, np.int64))]))
    assert snaps[0].version == 1
    rows, version = gathered[0]
    assert rows.shape == (2, 2, 8) and version == 1
    np.testing.assert_array_equal(rows, t[[[7, 1], [0, 7]]])
    assert gathered[1][0].shape == (0, 8)
    if c.transport == "shm":
        return
    # Values and rows over one reply's limit: the separate calls (the server
    # refuses the one call where the client could not tell; nothing is read twice).
    monkeypatch.setattr(c, "limits", routing.Limits(6000, 6000, 6000))
    for row_bytes in (32, 0):   # known, or (as if) unknown: the server says
        monkeypatch.setattr(c, "_row_bytes", lambda name, b=row_bytes: b)
        sent.clear()
        snaps, gathered = c.read_and_gather(["a"], [("t", np.arange(100))])
        np.testing.assert_array_equal(gathered[0][0], t)
        np.testing.assert_array_equal(snaps[0].value, -np.ones(1000))
        assert [p.rsplit("/", 1)[1] for p in sent] == ["Read", "Read", "Gather"][
            (row_bytes > 0):]


@pytest.mark.skipif(not shm.available(), reason="no sealed memfds on this system")
def test_malformed_fused_shared_memory_calls_change_nothing(one):
    ps, c = one
    seg = shm.Segment(1 << 20)
    try:
        with grpc.insecure_channel(ps.address) as ch:
            stub = ps_pb2_grpc.SharedMemoryStub(ch)
            sid = stub.Attach(ps_pb2.ShmAttachRequest(name=seg.name, nbytes=seg.nbytes,
                                                      pid=seg.pid, fd=seg.fd)).segment
            seg.unlink()
            seg.array[:16] = np.array([1, 2], np.int64).view(np.uint8)
            seg.array[64:64 + 64] = np.ones(16, np.float32).view(np.uint8)
            ids = ps_pb2.ShmTensor(dtype="int64", shape=[2], offset=0)
            rows = ps_pb2.ShmTensor(dtype="float32", shape=[2, 8], offset=64)

            def code(call, req):
                with pytest.raises(grpc.RpcError) as info:
                    call(req, timeout=10)
                return info.value.code()
            bad_pushes = [
                ps_pb2.ShmPushRequest(segment=sid, sparse=[   # sparse in a sync push
                    ps_pb2.ShmSparse(name="t", ids=ids, rows=rows)],
                    sync=ps_pb2.SyncInfo(step=0, replica=0, num_replicas=1, required=1)),
                ps_pb2.ShmPushRequest(segment=sid, sparse=[   # float ids
                    ps_pb2.ShmSparse(name="t", ids=rows, rows=rows)]),
                ps_pb2.ShmPushRequest(segment=sid, sparse=[   # rows past the end
                    ps_pb2.ShmSparse(name="t", ids=ids, rows=ps_pb2.ShmTensor(
                        dtype="float32", shape=[2, 8], offset=seg.nbytes - 8))]),
                ps_pb2.ShmPushRequest(segment=sid, sparse=[   # rows of the wrong width
                    ps_pb2.ShmSparse(name="t", ids=ids, rows=ps_pb2.ShmTensor(
                        dtype="float32", shape=[2, 4], offset=64))]),
                ps_pb2.ShmPushRequest(segment=sid, updates=[   # a good dense one, then a bad sparse
                    ps_pb2.ShmTensor(name="a", dtype="float32", shape=[1000], offset=4096)],
                    sparse=[ps_pb2.ShmSparse(name="nope", ids=ids, rows=rows)]),
            ]
            codes = [code(stub.Push, r) for r in bad_pushes]
            assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
            assert codes[-1] == grpc.StatusCode.NOT_FOUND
            bad_reads = [
                ps_pb2.ShmReadRequest(segment=sid, gathers=[ps_pb2.ShmGather(name="t", ids=rows)]),
                ps_pb2.ShmReadRequest(segment=sid, gathers=[ps_pb2.ShmGather(
                    name="t", ids=ps_pb2.ShmTensor(dtype="int64", shape=[2], offset=-8))]),
                ps_pb2.ShmReadRequest(segment=sid, names=["a"], out_offset=seg.nbytes + 1),
            ]
            assert {code(stub.Read, r) for r in bad_reads} == {grpc.StatusCode.INVALID_ARGUMENT}
            stub.Detach(ps_pb2.ShmDetachRequest(segment=sid))
    finally:
        seg.close()
    assert [m.version for m in c.list_variables()] == [0, 0]
    assert not c.read("a").any() and not c.read("t").any()


def _tensor(a) -> ps_pb2.Tensor:
    a = np.asarray(a)
    return ps_pb2.Tensor(dtype=a.dtype.name, shape=a.shape, data=a.tobytes())


def test_lookups_in_reads_and_row_gradients_in_pushes_on_every_grpc_path(ps):
    """ReadRequest.gathers and PushRequest.sparse from any generated client:
    ParameterServer's Read, Push and Upload and ParameterServerBulk's Read and
    Push take them; bad ones are refused with nothing applied."""
    with PSClient(ps.address) as c:
        c.create_variable("a", initial_value=np.zeros(4, np.float32),
                          optimizer_params={"learning_rate": 1.0})
        c.create_variable("t", initial_value=np.arange(24, dtype=np.float32).reshape(6, 4),
                          optimizer_params={"learning_rate": 1.0})
    ids = _tensor(np.array([[5, 0], [5, 5]]))
    good_sparse = ps_pb2.SparseUpdate(name="t", ids=_tensor(np.array([2, 2], np.int32)),
                                      values=_tensor(np.ones((2, 4), np.float32)))
    dense = ps_pb2.DenseUpdate(name="a", tensor=_tensor(np.ones(4, np.float32)))
    with grpc.insecure_channel(ps.address) as ch:
        stubs = [ps_pb2_grpc.ParameterServerStub(ch), ps_pb2_grpc.ParameterServerBulkStub(ch)]

        def code(call, req):
            with pytest.raises(grpc.RpcError) as info:
                call(req, timeout=10)
            return info.value.code()

        def state():
            with PSClient(ps.address) as c:
                return [(m.version, c.read(m.name).tobytes()) for m in c.list_variables()]
        for stub in stubs:
            reply = stub.Read(ps_pb2.ReadRequest(names=["a"], gathers=[
                ps_pb2.RowLookup(name="t", ids=ids),
                ps_pb2.RowLookup(name="t", ids=_tensor(np.zeros(0, np.int64)))]), timeout=10)
            assert [v.name for v in reply.values] == ["a"] and len(reply.gathered) == 2
            rows = reply.gathered[0].rows
            assert list(rows.shape) == [2, 2, 4]
            np.testing.assert_array_equal(np.frombuffer(rows.data, np.float32).reshape(2, 2, 4),
                                          np.arange(24).reshape(6, 4)[[[5, 0], [5, 5]]])
            assert list(reply.gathered[1].rows.shape) == [0, 4]   # no ids: no rows
        before = state()
        sync = ps_pb2.SyncInfo(step=0, replica=0, num_replicas=1, required=1)
        for stub in stubs:
            for req, want in [
                (ps_pb2.PushRequest(updates=[dense], sparse=[good_sparse], sync=sync),
                 grpc.StatusCode.INVALID_ARGUMENT),   # row-wise ones are async only
                (ps_pb2.PushRequest(updates=[dense], sparse=[ps_pb2.SparseUpdate(
                    name="t", ids=_tensor(np.array([1.0])),   # float ids
                    values=_tensor(np.ones((1, 4), np.float32)))]),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (ps_pb2.PushRequest(updates=[dense], sparse=[ps_pb2.SparseUpdate(
                    name="t", ids=_tensor(np.array([6])),   # out of range
                    values=_tensor(np.ones((1, 4), np.float32)))]),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (ps_pb2.PushRequest(updates=[dense], sparse=[ps_pb2.SparseUpdate(
                    name="t", ids=_tensor(np.array([1])),   # rows of the wrong width
                    values=_tensor(np.ones((1, 3), np.float32)))]),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (ps_pb2.PushRequest(updates=[dense], sparse=[ps_pb2.SparseUpdate(
                    name="nope", ids=_tensor(np.array([1])),
                    values=_tensor(np.ones((1, 4), np.float32)))]), grpc.StatusCode.NOT_FOUND),
                (ps_pb2.PushRequest(updates=[dense], sparse=[ps_pb2.SparseUpdate(
                    name="t", ids=_tensor(np.array([1])),   # its own sync (as PushSparseRequest)
                    values=_tensor(np.ones((1, 4), np.float32)), sync=sync)]),
                 grpc.StatusCode.INVALID_ARGUMENT),
            ]:
                assert code(stub.Push, req) == want
            for req, want in [
                (ps_pb2.ReadRequest(gathers=[ps_pb2.RowLookup(name="t", ids=_tensor(
                    np.array([0.5])))]), grpc.StatusCode.INVALID_ARGUMENT),
                (ps_pb2.ReadRequest(gathers=[ps_pb2.RowLookup(name="t", ids=_tensor(
                    np.array([9])))]), grpc.StatusCode.INVALID_ARGUMENT),
                (ps_pb2.ReadRequest(names=["a"], gathers=[ps_pb2.RowLookup(name="nope", ids=ids)]),
                 grpc.StatusCode.NOT_FOUND),
                (ps_pb2.ReadRequest(gathers=[ps_pb2.RowLookup(name="t")]),   # no ids
                 grpc.StatusCode.INVALID_ARGUMENT),
                (ps_pb2.ReadRequest(names=["a"], max_bytes=64, gathers=[ps_pb2.RowLookup(
                    name="t", ids=ids)]), grpc.StatusCode.RESOURCE_EXHAUSTED),
            ]:
                assert code(stub.Read, req) == want
        assert code(lambda r, timeout: next(stubs[0].ReadStream(r, timeout=timeout)),
                    ps_pb2.ReadRequest(names=["a"], gathers=[ps_pb2.RowLookup(
                        name="t", ids=ids)])) == grpc.StatusCode.INVALID_ARGUMENT
        assert state() == before   # nothing refused changed anything
        # Taken on each path: dense first, then row-wise (duplicates summed).
        for i, stub in enumerate(stubs):
            assert list(stub.Push(ps_pb2.PushRequest(updates=[dense], sparse=[good_sparse]),
                                  timeout=10).versions) == [i + 1, i + 1]
        up = stubs[0].Upload(iter([ps_pb2.UploadFrame(push=ps_pb2.PushRequest(
            updates=[dense], sparse=[good_sparse]))]), timeout=10)
        assert list(up.updated.versions) == [3, 3]
    with PSClient(ps.address) as c:
        np.testing.assert_array_equal(c.read("a"), -3 * np.ones(4))
        np.testing.assert_array_equal(c.read("t")[2], np.arange(8, 12) - 6.0)


def test_a_lookup_too_large_for_its_reply_is_refused_before_any_row_is_copied(monkeypatch):
    """ReadRequest.gathers and Gather: the rows' size is known from the ids'
    count, so a request for more than the reply may carry is refused before
    a row is copied (2 M ids of 4 KB rows would be 8 GB)."""
    from psserver.core.store import VariableStore
    from psserver.errors import ResourceExhausted
    from psserver.serve.servicer import ParameterServerServicer
    store = VariableStore()
    store.create("t", "float32", (16, 1024))
    servicer = ParameterServerServicer(store, max_message_bytes=1 << 20)
    copied = []
    real = store.gather
    monkeypatch.setattr(store, "gather", lambda *a, **k: (copied.append(1), real(*a, **k))[1])
    ids = _tensor(np.zeros(2_000_000, np.int64))
    for call, req in [
        (servicer.bulk_read, ps_pb2.ReadRequest(gathers=[ps_pb2.RowLookup(name="t", ids=ids)])),
        (servicer.Read, ps_pb2.ReadRequest(gathers=[ps_pb2.RowLookup(name="t", ids=ids)])),
        (servicer.Gather, ps_pb2.GatherRequest(name="t", ids=ids)),
    ]:
        with pytest.raises(ResourceExhausted, match="8192000000 bytes"):
            call(req, None)
    assert copied == []
    # within the limit: looked up
    small = ps_pb2.ReadRequest(gathers=[ps_pb2.RowLookup(name="t", ids=_tensor(np.arange(3)))])
    assert len(servicer.Read(small, None).gathered) == 1 and copied == [1]


def test_a_pushs_sort_reuses_the_lookups_only_for_the_same_ids(monkeypatch):
    """distinct() is np.unique's (ids, inverse); the sort order it keeps for
    the table it looked up serves a row-wise push of exactly those ids only
    (a copy of them is kept: the caller changing its array in between, or
    another table, makes the push sort afresh)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (8, 5))
    uniq, inverse = key_order.distinct(ids)
    want_u, want_i = np.unique(ids.reshape(-1), return_inverse=True)
    np.testing.assert_array_equal(uniq, want_u)
    np.testing.assert_array_equal(inverse, want_i.reshape(-1))
    assert key_order.distinct(np.zeros(0, np.int64))[0].size == 0

    class Table:   # stands for a ShardedVariable: only its identity matters here
        pass
    table, other = Table(), Table()
    flat = ids.reshape(-1)
    key_order.distinct(ids, table)
    order = key_order.known_order(table, flat.copy())
    np.testing.assert_array_equal(order, np.argsort(flat, kind="stable"))
    assert key_order.known_order(other, flat) is None
    ids[0, 0] += 1   # the caller's array changed after the look-up
    assert key_order.known_order(table, ids.reshape(-1)) is None


def _answering(monkeypatch, c: PSClient, reply) -> None:
    """c's calls answered with ``reply`` (a message, or bytes framed by hand
    taken by the call's receiver), as a server that sends it would."""
    from psserver.link.transport import FakeTransport
    fake = FakeTransport(lambda method, request: reply)
    monkeypatch.setattr(c.channel, "send", lambda method, request, timeout=None, **kw:
                        fake.send(method, request, timeout, **kw))


def test_one_call_replies_that_do_not_fit_the_request_are_refused(ps, monkeypatch):
    """Over the data port: a read reply without the looked-up rows asked for
    (what a server from before ReadRequest.gathers would send), a push reply
    with another number of versions than updates, and rows of another count
    are InvalidArgument, never another error, and never a silent second
    call (a server of this protocol version answers them all)."""
    with PSClient(ps.address, shared_memory=False) as c:
        c.create_variable("a", initial_value=np.zeros(4, np.float32),
                          optimizer_params={"learning_rate": 1.0})
        table = np.arange(40, dtype=np.float32).reshape(10, 4)
        c.create_variable("t", initial_value=table, optimizer_params={"learning_rate": 1.0})
        snaps, rows = c.read_and_gather(["a"], [("t", [3, 1])])   # (the real server's answer)
        np.testing.assert_array_equal(rows[0][0], table[[3, 1]])
        _answering(monkeypatch, c, wire.encode_read_reply([("a", 1, np.zeros(4, np.float32))]))
        with pytest.raises(InvalidArgument, match="0 looked-up rows for 1"):
            c.read_and_gather(["a"], [("t", [3, 1])])
        for versions in ([5], [5, 5, 5]):
            _answering(monkeypatch, c, ps_pb2.UpdateReply(versions=versions))
            with pytest.raises(InvalidArgument,
                               match=f"{len(versions)} versions for 1 dense and 1 row-wise"):
                c.push_dense_and_sparse([("a", np.ones(4, np.float32), 23)],
                                        [("t", np.array([2]), np.ones((1, 4), np.float32), 24)])
        for bad in (np.zeros((1, 4), np.float32), np.zeros((), np.float32)):
            _answering(monkeypatch, c, wire.encode_read_reply([], gathered=[(1, bad)]))
            with pytest.raises(InvalidArgument, match="rows of 't' are not 2 rows"):
                c.read_and_gather([], [("t", [3, 1])], rows_out=[np.empty((2, 4), np.float32)])
    with PSClient(ps.address, shared_memory=False) as c:   # nothing was applied meanwhile
        np.testing.assert_array_equal(c.read("t"), table)


def test_rows_of_another_dtype_from_a_server_are_refused_not_cast(cluster, monkeypatch):
    """read_variables with a Lookup: rows a server sends in another dtype or
    row shape than the table's are InvalidArgument (they used to be cast)."""
    strategy = ParameterServerStrategy(cluster.spec)
    table = strategy.create_variable("t", initial_value=np.zeros((6, 4), np.float32))
    real = PSClient.read_all_async

    def int_rows(self, *a, **k):
        return real(self, *a, **k).then(lambda got: type(got)(
            got.values, [(r.astype(np.int64), v) for r, v in got.rows], got.tables))
    monkeypatch.setattr(PSClient, "read_all_async", int_rows)
    with pytest.raises(InvalidArgument, match="sent rows of 't.*as int64"):
        read_variables([table.lookup(np.array([1, 2]))])


def test_a_row_wise_push_after_its_look_up_does_not_sort_the_ids_again(cluster, monkeypatch):
    strategy = ParameterServerStrategy(cluster.spec,
                                       variable_partitioner=FixedShardsPartitioner(2))
    table = strategy.create_variable("t", initial_value=np.zeros((20, 4)),
                                     optimizer="sgd", optimizer_params={"learning_rate": 1.0})
    orders = []
    real = V.sum_duplicates
    monkeypatch.setattr(V, "sum_duplicates", lambda ids, rows, order=None: (
        orders.append(order), real(ids, rows, order))[1])
    ids = np.array([[5, 1, 5], [19, 0, 1]])
    read_variables([table.lookup(ids)])
    push_gradients([(table, IndexedSlices(np.ones((6, 4)), ids.ravel()))])
    push_gradients([(table, IndexedSlices(np.ones((2, 4)), np.array([5, 1])))])   # other ids
    assert orders[0] is not None and orders[1] is None
    np.testing.assert_array_equal(orders[0], np.argsort(ids.ravel(), kind="stable"))
    np.testing.assert_array_equal(table.read()[[5, 1, 19, 0]],
                                  -np.array([[3] * 4, [3] * 4, [1] * 4, [1] * 4]))
