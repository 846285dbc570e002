"""The hand-framed bulk service on a real server: generated clients get the
same answers, and what protobuf refuses the bulk decoder refuses."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
from psserver.client import PSClient
from tests.contract.test_wire import _protobuf_view


@pytest.mark.timeout(60)
def test_bulk_service_serves_generated_clients_and_matches_the_plain_path(ps):
    g = np.arange(12, dtype=np.float32).reshape(4, 3)
    with PSClient(ps.address) as bulk, grpc.insecure_channel(ps.address) as ch:
        plain = ps_pb2_grpc.ParameterServerStub(ch)   # the generated messages, parsed by protobuf
        bulk.create_variable("w", initial_value=np.zeros((4, 3), np.float32),
                             optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        assert bulk.push("w", g) == 1
        assert list(plain.Push(ps_pb2.PushRequest(updates=[ps_pb2.DenseUpdate(
            name="w", tensor=ps_pb2.Tensor(dtype="float32", shape=[4, 3], data=g.tobytes()))]),
            timeout=10).versions) == [2]
        a, va = bulk.read("w", with_version=True)
        got = plain.Read(ps_pb2.ReadRequest(names=["w"]), timeout=10).values[0]
        np.testing.assert_array_equal(a, -2 * g)
        np.testing.assert_array_equal(a, np.frombuffer(got.value.data, np.float32).reshape(4, 3))
        assert va == got.version == 2
    with grpc.insecure_channel(ps.address) as ch:   # any generated client may use it
        stub = ps_pb2_grpc.ParameterServerBulkStub(ch)
        reply = stub.Read(ps_pb2.ReadRequest(names=["w"]), timeout=10)
        assert reply.values[0].version == 2 and len(reply.values[0].value.data) == 48
        push = ps_pb2.PushRequest(updates=[ps_pb2.DenseUpdate(
            name="w", tensor=ps_pb2.Tensor(dtype="float32", shape=[4, 3], data=g.tobytes()))])
        assert list(stub.Push(push, timeout=10).versions) == [3]
        with pytest.raises(grpc.RpcError) as info:   # validated like the plain Push
            stub.Push(ps_pb2.PushRequest(updates=[ps_pb2.DenseUpdate(
                name="w", tensor=ps_pb2.Tensor(dtype="float32", shape=[4, 3], data=b"x"))]),
                timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("raw", [
    b"\x02\x00",                          # field number 0
    b"\xfd\xff\xff\xff\x0f\x00\x00\x00",  # fixed32 field past the end
    b"\x09\x00\x00",                      # fixed64 past the end
    b"\x0a\x02\x0a\xff",                  # an update's name not UTF-8
    b"\x0b\x14",                          # a group ending with another number
    b"\x12\x02\x08",                      # a SyncInfo cut short
])
def test_inputs_protobuf_refuses_are_refused_by_the_bulk_push(ps, raw):
    assert _protobuf_view(raw) is None
    with grpc.insecure_channel(ps.address) as ch:
        push = ch.unary_unary("/pstrain.v1.ParameterServerBulk/Push")
        with pytest.raises(grpc.RpcError) as info:
            push(raw, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
