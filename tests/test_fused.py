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

from coordinator import (FixedShardsPartitioner, IndexedSlices, LocalCluster,
                         ParameterServerStrategy, push_gradients, read_variables)
from coordinator import variables as V
from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
from psserver import ipc, shm
from psserver.client import PSClient
from psserver.errors import InvalidArgument

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["shm", "data", "grpc"])
def transport(request, monkeypatch):
    if request.param == "shm" and not shm.available():
        pytest.skip("no sealed memfds on this system")
    V.close_clients()   # clients read the switches when made
    if request.param != "shm":
        monkeypatch.setenv(shm.ENV, "0")   # this process and the tasks it starts
    if request.param == "grpc":
        monkeypatch.setenv(ipc.DATA_ENV, "0")
    yield request.param
    V.close_clients()


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
        c = V.client_for(a)
        assert (c._ipc is not None, c._data is not None) == \
            {"shm": (True, False), "data": (False, True), "grpc": (False, False)}[transport]


def test_fused_calls_check_their_input(cluster):
    strategy = ParameterServerStrategy(cluster.spec)
    table = strategy.create_variable("t", initial_value=np.zeros((5, 2)))
    head = strategy.create_variable("h", initial_value=np.zeros(3))
    with pytest.raises(ValueError, match="out of range"):
        read_variables([table.lookup([0, 5]), head])
    with pytest.raises(ValueError, match="shape"):
        push_gradients([(table, IndexedSlices(np.ones((2, 3)), [0, 1]))])
    assert [m.version for m in table.meta()] == [0]


# -- the PSClient calls, against one real server ------------------------------------
@pytest.fixture
def one(ps):
    with PSClient(ps.address) as c:
        c.create_variable("a", initial_value=np.zeros(1000, np.float32),
                          optimizer_params={"learning_rate": 1.0})
        c.create_variable("t", initial_value=np.zeros((100, 8), np.float32),
                          optimizer_params={"learning_rate": 1.0})
        yield ps, c


def test_fused_push_is_all_or_nothing_and_idempotent(one):
    ps, c = one
    c.read_many(["a"])   # attaches a segment: the fused calls go through it
    good_sparse = ("t", np.array([1, 1, 7]), np.ones((3, 8), np.float32), 11)
    bad_sparse = ("t", np.array([1, 100]), np.ones((2, 8), np.float32), 12)
    with pytest.raises(InvalidArgument, match="out of range"):
        c.push_dense_and_sparse([("a", np.ones(1000, np.float32), 13)], [bad_sparse])
    assert [m.version for m in c.list_variables()] == [0, 0]
    assert not c.read("a").any() and not c.read("t").any()

    for _ in range(2):   # resent with the same keys: applied once
        assert c.push_dense_and_sparse([("a", np.ones(1000, np.float32), 14)],
                                       [good_sparse]) == [1, 1]
    assert c.local == shm.available()
    np.testing.assert_array_equal(c.read("a"), -np.ones(1000))
    t = c.read("t")
    np.testing.assert_array_equal(t[1], -2 * np.ones(8))   # duplicates summed
    np.testing.assert_array_equal(t[7], -np.ones(8))
    assert np.count_nonzero(t) == 16

    snaps, gathered = c.read_and_gather(["a"], [("t", np.array([[7, 1], [0, 7]]))])
    assert snaps[0].version == 1
    rows, version = gathered[0]
    assert rows.shape == (2, 2, 8) and version == 1
    np.testing.assert_array_equal(rows, t[[[7, 1], [0, 7]]])


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
