"""The DynamicTables service on a real parameter-server process: the same
calls over gRPC, the data port and the same-host socket; admission and
updates as psserver/core/dynamic_table.py says; bad input refused with the table
unchanged; the token required. (The data structure's own rules, off-by-one
included: tests/core/test_dynamic_table.py.)"""
from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from protos.pstrain.v1 import tables_pb2
from psserver.client import PSClient
from psserver.contract import TOKEN_ENV, Initializer
from psserver.errors import Code, PSError, Unauthenticated

pytestmark = pytest.mark.timeout(120)

ROUTES = {
    "grpc": dict(shared_memory=False, data_port=False),
    "data port": dict(shared_memory=False),
    "same host": dict(),
}


def _info(c: PSClient, name: str) -> dict:
    info = c.table_info(name)
    return {f.name: getattr(info, f.name) for f in tables_pb2.TableInfo.DESCRIPTOR.fields
            if f.name not in ("spec", "bytes")}


@pytest.mark.parametrize("route", list(ROUTES))
def test_look_up_admit_and_update_over_each_transport(start_ps, route):
    ps = start_ps(env={TOKEN_ENV: "t"})
    with PSClient(ps.address, token="t", **ROUTES[route]) as c:
        info = c.create_table("emb", 4, initializer="ones", optimizer="sgd",
                              optimizer_params={"learning_rate": 0.5}, min_count=2)
        assert info.rows == 0 and info.spec.dim == 4
        keys = np.array([[7, -(1 << 62)], [7, 12]], np.int64)
        rows = c.lookup("emb", keys)             # 7 twice: admitted; the others once: not
        assert rows.shape == (2, 2, 4) and rows.dtype == np.float32
        np.testing.assert_array_equal(rows[:, :, 0], [[1, 0], [1, 0]])
        assert c.update_table("emb", [7, 12, 7], np.ones((3, 4), np.float32)) == (1, 1)
        np.testing.assert_array_equal(c.lookup("emb", [7, 12], admit=False),
                                      [[0, 0, 0, 0], [0, 0, 0, 0]])   # 1 - 0.5 * 2
        got = _info(c, "emb")
        assert (got["rows"], got["step"], got["admitted"], got["not_admitted"],
                got["updated"], got["dropped"], got["lookups"], got["hits"]) == \
            (1, 1, 1, 2, 1, 1, 4, 0)   # 7 was made by that look-up: not a hit
        if route != "grpc":   # the hot calls took the socket
            assert c.channel.socket is not None
        else:
            assert c.channel.socket is None
        assert [t.name for t in c.list_tables()] == ["emb"]
        assert c.delete_table("emb") and not c.delete_table("emb")


def test_create_is_idempotent_only_with_the_same_spec(ps):
    """The same spec adopts; a shard's capacity is its part of the table's,
    which a restore may have moved: an exist_ok create keeps the shard's (the
    coordinator checks the parts' sum); any other difference is refused."""
    with PSClient(ps.address) as c:
        c.create_table("t", 8, capacity=100)
        assert c.create_table("t", 8, capacity=100, exist_ok=True).spec.capacity == 100
        assert c.create_table("t", 8, capacity=5, exist_ok=True).spec.capacity == 100
        for kw in ({"exist_ok": False, "capacity": 100}, {"exist_ok": True, "policy": "lfu"}):
            with pytest.raises(PSError) as e:
                c.create_table("t", 8, **kw)
            assert e.value.code == Code.ALREADY_EXISTS


@pytest.mark.parametrize("route", ["grpc", "data port"])
def test_bad_calls_are_refused_and_change_nothing(start_ps, route):
    ps = start_ps()
    with PSClient(ps.address, **ROUTES[route]) as c:
        c.create_table("t", 4, initializer="ones")
        c.lookup("t", [1, 2, 3])
        c.update_table("t", [1], np.ones((1, 4), np.float32))
        before = _info(c, "t")
        values = c.lookup("t", [1, 2, 3], admit=False)
        bad = [
            (lambda: c.lookup("t", np.array([1.5, 2.0])), Code.INVALID_ARGUMENT, "dtype"),
            (lambda: c.lookup("nope", [1]), Code.NOT_FOUND, "create it first"),
            (lambda: c.update_table("t", [1, 2], np.ones((1, 4), np.float32)),
             Code.INVALID_ARGUMENT, "shape"),
            (lambda: c.update_table("t", [1], np.ones((1, 5), np.float32)),
             Code.INVALID_ARGUMENT, "shape"),
            (lambda: c.update_table("t", [1], np.full((1, 4), np.inf, np.float32)),
             Code.INVALID_ARGUMENT, "NaN or Inf"),
            (lambda: c.update_table("t", [1], np.ones((1, 4), np.int32)),
             Code.INVALID_ARGUMENT, "dtype"),
        ]
        for call, code, words in bad:
            with pytest.raises(PSError, match=words) as e:
                call()
            assert e.value.code == code, e.value
        assert _info(c, "t") == before
        np.testing.assert_array_equal(c.lookup("t", [1, 2, 3], admit=False), values)


@pytest.mark.parametrize("route", ["grpc", "data port"])
def test_old_rows_and_out_of_range_gradients_on_a_real_server(start_ps, route):
    """Issue 32 items 1, 4 and 9 through a server: a look-up that does not
    admit evicts nothing and reads a row past its age as absent; a gradient
    for such a row is dropped; a float64 gradient beyond the float32
    table's range is refused whole (it wrote -Inf rows before)."""
    ps = start_ps()
    with PSClient(ps.address, **ROUTES[route]) as c:
        c.create_table("t", 4, initializer="ones", optimizer="sgd",
                       optimizer_params={"learning_rate": 1.0}, max_age_steps=2)
        c.lookup("t", [1, 2])
        for _ in range(2):   # step 2: 2 was made at step 0
            assert c.update_table("t", [1], np.full((1, 4), 0.25, np.float32)) == (1, 0)
        np.testing.assert_array_equal(c.lookup("t", [1, 2], admit=False)[:, 0], [0.5, 0])
        assert _info(c, "t")["rows"] == 2 and _info(c, "t")["evicted_age"] == 0
        assert c.update_table("t", [2], np.ones((1, 4), np.float32)) == (0, 1)
        before = _info(c, "t")
        with pytest.raises(PSError, match="float32's range") as e:
            c.update_table("t", [1, 2], np.array([[1e300] * 4, [1.0] * 4]))
        assert e.value.code == Code.INVALID_ARGUMENT
        assert _info(c, "t") == before
        np.testing.assert_array_equal(c.lookup("t", [1], admit=False), [[0.5] * 4])
        c.lookup("t", [3])   # admits: evicts 2
        assert _info(c, "t")["rows"] == 2 and _info(c, "t")["evicted_age"] == 1


@pytest.mark.parametrize("spec,words", [
    ({"dim": 0}, "dim"), ({"dim": -1}, "dim"), ({"dtype": "int64"}, "dtype"),
    ({"optimizer": "nonesuch"}, "optimizer"), ({"min_count": -1}, "min_count"),
    ({"probability": 2.0}, "probability"), ({"policy": "fifo"}, "policy"),
    ({"capacity": -5}, "capacity"), ({"max_age_seconds": float("inf")}, "max_age_seconds"),
    ({"initializer": "nonesuch"}, "initializer"), ({"name": "bad name!"}, "name"),
    ({"initializer": Initializer(kind="constant", value=1e300)}, "range"),
    ({"initializer": Initializer(kind="random_normal", stddev=1e37)}, "range"),
])
def test_bad_table_specs_are_refused_and_nothing_is_created(client, spec, words):
    kw = {"dim": 4, **spec}
    name = kw.pop("name", "t")
    dim = kw.pop("dim")
    with pytest.raises(PSError, match=words) as e:
        client.create_table(name, dim, **kw)
    assert e.value.code == Code.INVALID_ARGUMENT, e.value
    assert client.list_tables() == []


def test_malformed_requests_get_invalid_argument_not_internal(ps):
    """Bytes that are no LookupRequest / a Tensor that lies about its size."""
    with PSClient(ps.address, shared_memory=False, data_port=False) as c:
        c.create_table("t", 4)
        one = np.ones(4, np.float32).tobytes()
        for method, payload in [
            ("Lookup", b"\x0a\xff\xff\xff"),
            ("Update", b"\x12\x05\x0a\x03"),
            ("Lookup", tables_pb2.LookupRequest(   # 3 keys in 8 bytes
                name="t", keys={"dtype": "int64", "shape": [3], "data": b"\x01" * 8})),
            ("Update", tables_pb2.TableUpdateRequest(   # keys of shape [1, 1]
                name="t", keys={"dtype": "int64", "shape": [1, 1], "data": b"\x01" * 8},
                grads={"dtype": "float32", "shape": [1, 4], "data": one})),
            ("Lookup", tables_pb2.LookupRequest(   # a shape of 2**62 keys
                name="t", keys={"dtype": "int64", "shape": [1 << 31, 1 << 31], "data": b""})),
            *[("Import", tables_pb2.ImportTableRequest(   # a capacity: negative, too large,
                name="t", reset=reset, capacity=cap,      # or on a later piece
                keys={"dtype": "int64", "shape": [0], "data": b""},
                values={"dtype": "float32", "shape": [0, 4], "data": b""}))
              for reset, cap in ((True, -1), (True, 1 << 62), (False, 5))],
        ]:
            raw = c.channel.grpc.channel.unary_unary(f"/pstrain.v1.DynamicTables/{method}",
                                             request_serializer=None,
                                             response_deserializer=None)
            if not isinstance(payload, bytes):
                payload = payload.SerializeToString()
            with pytest.raises(grpc.RpcError) as e:
                raw(payload, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        info = c.table_info("t")
        assert (info.lookups, info.step, info.rows, info.spec.capacity) == (0, 0, 0, 0)


def test_every_table_call_needs_the_token(start_ps):
    ps = start_ps(env={TOKEN_ENV: "right"})
    with PSClient(ps.address, token="right") as owner:
        owner.create_table("t", 4)
    with PSClient(ps.address, token="wrong", shared_memory=False) as c:
        for call in (lambda: c.create_table("u", 4), lambda: c.lookup("t", [1]),
                     lambda: c.update_table("t", [1], np.ones((1, 4), np.float32)),
                     lambda: c.table_info("t"), lambda: c.list_tables(),
                     lambda: c.delete_table("t")):
            with pytest.raises(Unauthenticated):
                call()
    with PSClient(ps.address, token="right") as owner:
        assert [t.name for t in owner.list_tables()] == ["t"]
        assert owner.table_info("t").lookups == 0


def test_tables_count_against_the_servers_memory_limit(start_ps):
    """--max-memory-bytes bounds variables and tables together: a look-up
    that could grow a table past it is refused before anything changes, and
    a variable's create counts the tables' bytes."""
    ps = start_ps("--max-memory-bytes", str(8 << 20))
    with PSClient(ps.address) as c:
        c.create_table("t", 256)   # a row: 1 KiB + 104 bytes of bookkeeping
        c.lookup("t", np.arange(2000))   # ~2.2 MB: room
        info = c.table_info("t")
        with pytest.raises(PSError, match="max-memory-bytes") as e:
            c.lookup("t", np.arange(10_000, 20_000))   # ~11 MB more: no room
        assert e.value.code == Code.RESOURCE_EXHAUSTED
        assert c.table_info("t") == info
        held = info.bytes
        with pytest.raises(PSError, match="max-memory-bytes"):
            c.create_variable("v", (((8 << 20) - held) // 4 + 1024,), "float32")
        c.create_variable("small", (1000,), "float32")


def test_save_writes_only_under_the_checkpoint_dir_and_import_is_checked_whole(start_ps,
                                                                             tmp_path):
    ps = start_ps("--checkpoint-dir", str(tmp_path))
    with PSClient(ps.address) as c:
        c.create_table("t", 2, initializer="ones", optimizer="adagrad")
        c.lookup("t", [1, 2, 3])
        reply = c.save_table("t", str(tmp_path))
        assert (tmp_path / reply.file).is_file() and reply.rows == 3
        for where in ("/tmp/../etc", str(tmp_path / ".." / "elsewhere")):
            with pytest.raises(PSError) as e:
                c.save_table("t", where)
            assert e.value.code == Code.PERMISSION_DENIED
        before = _info(c, "t")
        rows = c.lookup("t", [1, 2, 3], admit=False)
        good = {"keys": np.array([7, 8]), "values": np.ones((2, 2), np.float32),
                "age_steps": np.zeros(2, np.int64), "age_seconds": np.zeros(2),
                "freq": np.ones(2, np.int64), "slot/accumulator": np.ones((2, 2), np.float32)}
        for bad, words in [({**good, "keys": np.array([7, 7])}, "unique"),
                           ({**good, "values": np.full((2, 2), np.nan, np.float32)}, "NaN"),
                           ({k: v for k, v in good.items() if k != "slot/accumulator"},
                            "missing"),
                           ({**good, "keys": np.array([1, 9])}, "holds already")]:
            with pytest.raises(PSError, match=words) as e:
                c.import_table("t", bad, 0, reset=False)
            assert e.value.code == Code.INVALID_ARGUMENT
        assert _info(c, "t") == before
        np.testing.assert_array_equal(c.lookup("t", [1, 2, 3], admit=False), rows)
        assert c.import_table("t", good, 0, reset=True) == 2   # reset: only 7 and 8
        np.testing.assert_array_equal(c.lookup("t", [1, 7], admit=False), [[0, 0], [1, 1]])


def test_table_counters_are_on_the_metrics_page(start_ps):
    import re
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    ps = start_ps("--metrics-port", "0")
    with PSClient(ps.address) as c:
        c.create_table("t", 2, capacity=3, min_count=2)
        c.lookup("t", [1, 1, 2, 2, 3, 3])   # 3 admitted
        c.lookup("t", [4, 4, 5])             # 4 admitted (1 evicted: capacity), 5 not yet
        assert c.update_table("t", [1, 2, 5], np.ones((3, 2), np.float32)) == (1, 2)
        info = c.table_info("t")
    address = next(m.group(1) for line in list(ps.log_lines)
                   if (m := re.match(r"^psserver metrics on (\S+)$", line.strip())))
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples
           if s.name.startswith("pstrain_ps_table_")}
    t = (("table", "t"),)
    assert got[("pstrain_ps_table_rows", t)] == info.rows == 3
    assert got[("pstrain_ps_table_lookups_total", t)] == info.lookups == 9
    assert got[("pstrain_ps_table_admitted_total", t)] == 4
    assert got[("pstrain_ps_table_not_admitted_total", t)] == 1
    assert got[("pstrain_ps_table_evicted_total", (("reason", "capacity"),) + t)] == 1
    assert got[("pstrain_ps_table_dropped_total", t)] == info.dropped == 2
    assert got[("pstrain_ps_table_bytes", t)] == info.bytes > 0


def test_a_read_of_a_table_shards_replication_name_is_not_found(ps):
    """A table shard's replication name ("~table~t") is no variable: a read
    of it is NotFound over every path, never an internal error."""
    from psserver.contract import TABLE_PREFIX
    with PSClient(ps.address) as c, PSClient(ps.address, shared_memory=False) as remote, \
            PSClient(ps.address, shared_memory=False, data_port=False) as plain:
        c.create_table("t", 4)
        for client in (c, remote, plain):
            with pytest.raises(PSError) as e:
                client.read(TABLE_PREFIX + "t")
            assert e.value.code == Code.NOT_FOUND, e.value


@pytest.mark.parametrize("spec", [
    dict(),
    dict(dtype="float64", initializer=Initializer("random_normal", mean=0.5, stddev=0.1, seed=7),
         optimizer="adam", optimizer_params={"beta_1": 0.8, "learning_rate": 0.01},
         min_count=3, probability=0.25, capacity=100, policy="lfu", max_age_steps=9,
         max_age_seconds=1.5, admission_capacity=400, seed=11),
])
def test_a_spec_reads_back_as_it_was_sent(spec):
    """The servicer turns a TableSpec into the store's plain spec and back
    field for field: TableInfo, the backup's copy and the checkpoint
    metadata (protobuf JSON of TableSpec, as files written before hold)
    carry the spec as the client sent it (in process)."""
    from google.protobuf import json_format

    from psserver.client import table_spec
    from psserver.serve.tables import spec_json, spec_message, spec_of
    sent = table_spec(4, **spec)
    assert spec_message(spec_of(sent)) == sent
    # (as JSON objects: protobuf does not promise the order of a map's entries)
    assert json.loads(spec_json(spec_of(sent))) == \
        json.loads(json_format.MessageToJson(sent, indent=None))
    assert spec_of(sent) == spec_of(tables_pb2.TableSpec.FromString(sent.SerializeToString()))


# -- look-ups and updates riding the bulk calls (ReadRequest.table_lookups, ...) -----------
@pytest.mark.parametrize("route", list(ROUTES))
def test_many_tables_and_pooled_bags_in_one_read_and_one_push(start_ps, route):
    """A read with a variable, two tables' look-ups (one of them as bags,
    weighted) and a push with a dense gradient and both tables' gradients
    (bags spread over their keys): one call each way, the same numbers as
    the per-table calls give, on every transport."""
    from psserver.client.results import TableGradient, TableLookup
    ps = start_ps()
    with PSClient(ps.address, **ROUTES[route]) as c:
        c.create_variable("w", initial_value=np.zeros(3, np.float32))
        for name in ("a", "b"):
            c.create_table(name, 2, initializer=Initializer("constant", value=1.0),
                           optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        c.lookup("a", [1, 2, 3])   # made (min_count 1)
        c.lookup("b", [5, 6])
        keys = np.array([5, 6, 5, 6, 6], np.int64)   # bags {5, 6}, {}, {5, 6, 6}
        offsets = np.array([0, 2, 2, 5], np.int64)
        weights = np.array([1, 2, 0.5, 1, 1], np.float32)
        c.update_table("a", [2], np.full((1, 2), -1.0, np.float32))   # a[2] = 2
        got = c.read_all_async(["w"], (), [
            TableLookup("a", np.array([[2, 9], [1, 2]], np.int64)),
            TableLookup("b", keys, offsets=offsets, weights=weights)]).result()
        np.testing.assert_array_equal(got.values[0].value, np.zeros(3))
        np.testing.assert_array_equal(got.tables[0][..., 0], [[2, 1], [1, 2]])   # 9: made now
        np.testing.assert_array_equal(got.tables[1], [[3, 3], [0, 0], [2.5, 2.5]])
        versions, tables = c.push_all_async(
            [("w", np.ones(3, np.float32), 1)], (),
            [TableGradient("a", np.array([1, 9], np.int64), np.ones((2, 2), np.float32), 2),
             TableGradient("b", keys, np.array([[1, 1], [9, 9], [2, 2]], np.float32), 3,
                           offsets=offsets, weights=weights)]).result()
        assert versions == [1] and [t[:2] for t in tables] == [(2, 0), (2, 0)]
        np.testing.assert_array_equal(c.lookup("a", [1], admit=False), [[0, 0]])
        # b[5] -= 1*1 + 0.5*2 = 2; b[6] -= 2*1 + 1*2 + 1*2 = 6
        np.testing.assert_array_equal(c.lookup("b", [5, 6], admit=False), [[-1, -1], [-5, -5]])


def test_table_parts_of_the_bulk_calls_are_checked_whole_and_change_nothing(start_ps):
    """Bad dynamic-table look-ups or updates in a read or push (an unknown
    table, keys or gradients of the wrong kind, bags that do not add up,
    counts and bags together) are refused with nothing done: not the other
    look-ups of the read (which count and admit), not the push's dense
    update, not the table. The plain services refuse table parts they do
    not serve."""
    from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
    from psserver.client.results import TableGradient, TableLookup
    from psserver.errors import InvalidArgument, NotFound
    ps = start_ps()
    keys = np.array([1, 2, 3], np.int64)
    ok = TableLookup("t", keys)
    with PSClient(ps.address, shared_memory=False) as c:
        c.create_variable("w", initial_value=np.zeros(2, np.float32))
        c.create_table("t", 2, optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        before = _info(c, "t")
        bad_reads = {
            NotFound: [ok, TableLookup("nope", keys)],
            InvalidArgument: [
                [ok, TableLookup("t", np.array([1.5]))],
                [ok, TableLookup("t", keys, counts=np.array([1, 0, 1]))],
                [ok, TableLookup("t", keys, offsets=np.array([0, 5]))],
                [ok, TableLookup("t", keys, offsets=np.array([0, 2, 1, 3]))],
                [ok, TableLookup("t", keys, weights=np.ones(3, np.float32))],
                [ok, TableLookup("t", keys, counts=np.ones(3, np.int64),
                                 offsets=np.array([0, 3]))],
                [ok, TableLookup("t", keys, offsets=np.array([0, 3]),
                                 weights=np.array([1, np.nan, 1], np.float32))]],
        }
        for error, cases in bad_reads.items():
            for tables in ([cases] if error is NotFound else cases):
                with pytest.raises(error):
                    c.read_all_async(["w"], (), tables).result()
                assert _info(c, "t") == before, tables
        dense = [("w", np.ones(2, np.float32), 7)]
        good = TableGradient("t", keys, np.ones((3, 2), np.float32), 8)
        for bad in (TableGradient("nope", keys, np.ones((3, 2), np.float32), 9),
                    TableGradient("t", keys, np.ones((3, 3), np.float32), 9),
                    TableGradient("t", keys, np.full((3, 2), np.inf, np.float32), 9),
                    TableGradient("t", keys.reshape(3, 1), np.ones((3, 2), np.float32), 9),
                    TableGradient("t", keys, np.ones((1, 2), np.float32), 9,
                                  offsets=np.array([0, 2])),
                    TableGradient("t", keys, np.ones((2, 2), np.float32), 9,
                                  offsets=np.array([0, 2, 3])),   # 3 keys, 2 bags: grads fit
                    TableGradient("t", keys, np.ones((3, 2), np.float32), 9,
                                  weights=np.ones(3, np.float32))):
            if bad.offsets is not None and bad.grads.shape[0] == 2:   # (a good one: skip)
                continue
            with pytest.raises((InvalidArgument, NotFound)):
                c.push_all_async(dense, (), [good, bad]).result()
            assert c.get_meta("w").version == 0 and _info(c, "t") == before, bad
    with grpc.insecure_channel(ps.address) as ch:   # the plain services do not serve them
        plain = ps_pb2_grpc.ParameterServerStub(ch)
        req = ps_pb2.ReadRequest(names=["w"], table_lookups=[ps_pb2.TableLookup(name="t")])
        for call in (plain.Read, lambda r, timeout: list(plain.ReadStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as info:
                call(req, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            plain.Push(ps_pb2.PushRequest(table_updates=[ps_pb2.TableGradient(name="t")]),
                       timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with PSClient(ps.address) as c:
        assert _info(c, "t") == before and c.get_meta("w").version == 0
