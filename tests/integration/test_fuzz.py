"""Fuzzing a real parameter server: random and mutated requests on every path in.

Seeded and bounded: a few seconds per path in CI. A longer run on demand::

    PSTRAIN_FUZZ_SECONDS=300 PSTRAIN_FUZZ_SEED=7 python -m pytest tests/integration/test_fuzz.py

Each request is a valid one of its method (serialized), mutated (bytes
flipped, inserted, deleted, cut short, fields spliced in) or replaced by
random bytes, sent over gRPC (every method of ParameterServer,
ParameterServerBulk and SharedMemory), over the data port (every method id
of psserver/link/methods.py, and some that do not exist) and over the same-host
socket. After each call: the answer is never INTERNAL (or UNKNOWN); a refused
call changed nothing (every variable's name, version and value as before);
the server still serves. At the end its memory has not grown without bound.

The fuzzer holds the cluster's token: this is about robustness, not
authentication (tests/integration/test_security.py and test_replication.py check that
calls without it are refused). Worker closures are not fuzzed: a valid
mutation of a RunClosure request names functions, which is running code.
"""
from __future__ import annotations

import os
import random
import time

import grpc
import numpy as np
import pytest
from test_hardening import rss_mib

from protos.pstrain.v1 import ps_pb2, tables_pb2
from psserver.client import PSClient
from psserver.contract import call_metadata, routing
from psserver.errors import PSError
from psserver.link import methods
from psserver.link import tensor_proto as TP
from psserver.link.grpc_common import grpc_code
from psserver.link.transport import SocketTransport

SECONDS = float(os.environ.get("PSTRAIN_FUZZ_SECONDS", "4"))
SEED = int(os.environ.get("PSTRAIN_FUZZ_SEED", "20261123"))
TOKEN = "fuzz-token"
pytestmark = pytest.mark.timeout(max(120, int(SECONDS * 6) + 60))

BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
MEMORY = 64 << 20   # the variables' bytes a fuzzed server may hold


def _t(a: np.ndarray) -> ps_pb2.Tensor:
    m = ps_pb2.Tensor()
    TP.fill(m, a)
    return m


def templates(tmp: str) -> dict[str, list]:
    """Valid requests of every method, by "Service/Method"."""
    w = np.ones((8, 4), np.float32)
    ids = np.array([1, 3], np.int64)
    # a step's calls to one server as one: rows looked up in a read, row-wise
    # gradients in a push (ReadRequest.gathers, PushRequest.sparse)
    lookup = ps_pb2.ReadRequest(names=["w"], gathers=[ps_pb2.RowLookup(name="t", ids=_t(ids))])
    mixed = ps_pb2.PushRequest(
        updates=[ps_pb2.DenseUpdate(name="w", tensor=_t(w), update_id=6)],
        sparse=[ps_pb2.SparseUpdate(name="t", ids=_t(ids), values=_t(np.ones((2, 4), np.float32)),
                                    update_id=8)])
    return {
        "ParameterServer/GetServerInfo": [ps_pb2.ServerInfoRequest()],
        "ParameterServer/CreateVariable": [
            ps_pb2.CreateVariableRequest(name="fz", dtype="float32", shape=[4, 2],
                                         initializer=ps_pb2.Initializer(kind="random_normal")),
            ps_pb2.CreateVariableRequest(name="w", dtype="float32", shape=[8, 4],
                                         initial_value=_t(w), overwrite=True,
                                         optimizer=ps_pb2.OptimizerSpec(name="adam"))],
        "ParameterServer/DeleteVariable": [ps_pb2.VariableRef(name="fz")],
        "ParameterServer/GetMeta": [ps_pb2.VariableRef(name="w")],
        "ParameterServer/ListVariables": [ps_pb2.ListRequest()],
        "ParameterServer/Read": [ps_pb2.ReadRequest(names=["w", "t"]), lookup],
        "ParameterServer/Push": [ps_pb2.PushRequest(updates=[
            ps_pb2.DenseUpdate(name="w", tensor=_t(w), update_id=5)],
            sync=ps_pb2.SyncInfo(step=0, replica=0, num_replicas=2, required=1)), mixed],
        "ParameterServer/Assign": [ps_pb2.AssignRequest(updates=[
            ps_pb2.DenseUpdate(name="w", tensor=_t(w))])],
        "ParameterServer/Gather": [ps_pb2.GatherRequest(name="t", ids=_t(ids))],
        "ParameterServer/PushSparse": [ps_pb2.PushSparseRequest(
            name="t", ids=_t(ids), values=_t(np.ones((2, 4), np.float32)), update_id=9)],
        "ParameterServer/AbandonStep": [ps_pb2.AbandonRequest(step=3, replica=1)],
        "ParameterServer/Save": [
            ps_pb2.SaveRequest(directory=tmp, names=["w"]),
            ps_pb2.SaveRequest(directory=tmp, names=["w"], save_id=7, stream="s"),
            ps_pb2.SaveRequest(directory=tmp, names=["w", "t"], save_id=8, since=7, stream="s",
                               incarnation="0" * 32, weights_only=True)],
        "ParameterServer/CommitSave": [ps_pb2.CommitSaveRequest(save_id=7, stream="s",
                                                                incarnation="0" * 32)],
        "ParameterServer/Replicate": [ps_pb2.ReplicateRequest(records=[ps_pb2.ReplicaRecord(
            name="w", epoch=0, version=1, tensor=_t(w))])],
        "ParameterServer/Reconfigure": [ps_pb2.ReconfigureRequest(changes=[
            ps_pb2.ReplicaChange(name="w", epoch=1, action=ps_pb2.ReplicaChange.DROP_BACKUP)],
            timeout=1.0)],
        "ParameterServerBulk/Read": [ps_pb2.ReadRequest(names=["w"]), lookup],
        "ParameterServerBulk/Push": [ps_pb2.PushRequest(updates=[
            ps_pb2.DenseUpdate(name="w", tensor=_t(w), update_id=7)]), mixed],
        "SharedMemory/Attach": [ps_pb2.ShmAttachRequest(name="pstrain-" + "0" * 32,
                                                        nbytes=4096, pid=1, fd=3)],
        "SharedMemory/Detach": [ps_pb2.ShmDetachRequest(segment=1)],
        "SharedMemory/Share": [ps_pb2.ShmShareRequest(names=["w"])],
        "SharedMemory/Read": [ps_pb2.ShmReadRequest(segment=1, names=["w"])],
        "SharedMemory/Push": [ps_pb2.ShmPushRequest(segment=1, updates=[ps_pb2.ShmTensor(
            name="w", dtype="float32", shape=[8, 4])])],
        "DynamicTables/Create": [
            tables_pb2.CreateTableRequest(name="fzt", spec=tables_pb2.TableSpec(
                dim=4, min_count=2, capacity=8, max_age_steps=3,
                initializer=ps_pb2.Initializer(kind="random_uniform"),
                optimizer=ps_pb2.OptimizerSpec(name="adagrad"))),
            tables_pb2.CreateTableRequest(name="d", spec=tables_pb2.TableSpec(dim=4),
                                          exist_ok=True)],
        "DynamicTables/Lookup": [tables_pb2.LookupRequest(name="d", keys=_t(ids)),
                                 tables_pb2.LookupRequest(name="d", keys=_t(ids), no_admit=True),
                                 tables_pb2.LookupRequest(name="d", keys=_t(ids),
                                                          sync=ps_pb2.SyncRead(step=0))],
        "DynamicTables/Update": [tables_pb2.TableUpdateRequest(
            name="d", keys=_t(ids), grads=_t(np.ones((2, 4), np.float32))),
            tables_pb2.TableUpdateRequest(   # a sync step of one replica
                name="d", keys=_t(ids), grads=_t(np.ones((2, 4), np.float32)),
                sync=ps_pb2.SyncInfo(step=0, replica=0, num_replicas=2, required=1)),
            tables_pb2.TableUpdateRequest(   # finite float64, beyond float32 (issue 33)
                name="d", keys=_t(ids), grads=_t(np.full((2, 4), 1e300))),
            tables_pb2.TableUpdateRequest(   # a sync step that never completes
                name="d", keys=_t(np.arange(4096, dtype=np.int64)),
                grads=_t(np.ones((4096, 4), np.float32)),
                sync=ps_pb2.SyncInfo(step=1, replica=0, num_replicas=1000, required=1000))],
        "DynamicTables/Info": [tables_pb2.TableRef(name="d")],
        "DynamicTables/List": [tables_pb2.ListTablesRequest()],
        "DynamicTables/Delete": [tables_pb2.TableRef(name="fzt")],
        "DynamicTables/Save": [
            tables_pb2.SaveTableRequest(name="d", directory=tmp),
            tables_pb2.SaveTableRequest(name="d", directory=tmp, save_id=9, since=7,
                                        stream="s", incarnation="0" * 32)],
        "DynamicTables/Import": [tables_pb2.ImportTableRequest(
            name="d", keys=_t(ids), values=_t(np.ones((2, 4), np.float32)),
            age_steps=_t(np.zeros(2, np.int64)), age_seconds=_t(np.zeros(2)),
            freq=_t(np.ones(2, np.int64)), step=3),
            tables_pb2.ImportTableRequest(   # a restore giving the shard its capacity
                name="d", reset=True, capacity=3, keys=_t(ids),
                values=_t(np.ones((2, 4), np.float32)), age_steps=_t(np.zeros(2, np.int64)),
                age_seconds=_t(np.zeros(2)), freq=_t(np.ones(2, np.int64)), step=3)],
    }


_SPLICE = [b"\x00", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0a\x7f",
           b"\x12\x04\x0a\x02\xc3\x28", b"\x0b", b"\x0c", b"\x0d\x00", b"\x1a\x08float64",
           b"\x10\x80\x80\x80\x80\x80\x80\x80\x80\x40", b"\xfa\xff\xff\xff\x0f\x00"]


_INTS = [0, 1, -1, 2, 7, 2**31 - 1, -2**31, 2**62, -2**63, 2**63 - 1]
_FLOATS = [0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), -float("inf")]
_TEXTS = ["", "w", "t", "fz", "../x", "w/part_0", "_backup/w", "x" * 300, "é\u2028",
          "float16", "int64", "bool", "pstrain-" + "f" * 32]


def _perturb(rng: random.Random, msg) -> None:
    """Change a few fields of a message (recursively) to edge values."""
    from google.protobuf.descriptor import FieldDescriptor as F
    fields = msg.DESCRIPTOR.fields
    if not fields:
        return
    for _ in range(rng.randrange(1, 3)):
        f = rng.choice(fields)
        repeated = f.is_repeated
        if f.type == F.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                continue
            target = getattr(msg, f.name)
            if repeated:
                if len(target) and rng.random() < 0.7:
                    _perturb(rng, target[rng.randrange(len(target))])
                elif rng.random() < 0.5 and len(target):
                    del target[rng.randrange(len(target))]
                else:
                    target.add()
            elif rng.random() < 0.2:
                msg.ClearField(f.name)
            else:
                _perturb(rng, target)
            continue
        if f.type == F.TYPE_STRING:
            value = rng.choice(_TEXTS)
        elif f.type == F.TYPE_BYTES:
            value = rng.randbytes(rng.choice([0, 1, 7, 16, 128]))
        elif f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
            value = rng.choice(_FLOATS)
        elif f.type == F.TYPE_BOOL:
            value = rng.random() < 0.5
        elif f.type == F.TYPE_ENUM:
            value = rng.choice([0, 1, 2, 3, 9])
        else:
            lo, hi = {F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
                      F.TYPE_UINT64: (0, 2**64 - 1)}.get(f.type, (-2**63, 2**63 - 1))
            value = min(hi, max(lo, rng.choice(_INTS)))
        try:
            if repeated:
                getattr(msg, f.name)[:] = [value] * rng.randrange(0, 4)
            else:
                setattr(msg, f.name, value)
        except (TypeError, ValueError):
            pass


def mutate(rng: random.Random, raw: bytes, cls=None) -> bytes:
    """A mutant of a serialized request: field values changed (when its
    class is given), or bytes changed, or random bytes."""
    r = rng.random()
    if cls is not None and r < 0.45:
        msg = cls.FromString(raw)
        _perturb(rng, msg)
        return msg.SerializeToString()
    if r < 0.55:
        return rng.randbytes(rng.randrange(0, 64))
    b = bytearray(raw)
    for _ in range(1 if r < 0.85 else rng.randrange(2, 5)):
        op = rng.randrange(5)
        pos = rng.randrange(0, len(b) + 1)
        if op == 0 and b:
            b[min(pos, len(b) - 1)] = rng.randrange(256)
        elif op == 1:
            b[pos:pos] = rng.choice(_SPLICE)
        elif op == 2 and b:
            del b[pos:pos + rng.randrange(1, 8)]
        elif op == 3:
            del b[pos:]
        else:
            b += b[pos:pos + rng.randrange(1, 16)]
    return bytes(b)


class Target:
    """A real token-protected psserver with a dense variable w and a table t."""

    def __init__(self, start_ps, tmp: str):
        # --max-memory-bytes: a fuzzed create may ask for anything; what the
        # server holds is bounded, so what it keeps beyond that can be seen.
        self.ps = start_ps("--checkpoint-dir", tmp, "--max-memory-bytes", str(MEMORY),
                           env={"PSTRAIN_AUTH_TOKEN": TOKEN})
        self.good = PSClient(self.ps.address, token=TOKEN, shared_memory=False,
                             data_port=False, timeout=30)
        self.ensure()

    def ensure(self) -> None:
        names = {m.name for m in self.good.list_variables()}
        if "w" not in names:
            self.good.create_variable("w", initial_value=np.zeros((8, 4), np.float32),
                                      optimizer="adam")
        if "t" not in names:
            self.good.create_variable("t", initial_value=np.zeros((16, 4), np.float32))
        self.good.create_table("d", 4, exist_ok=True)

    def state(self):
        metas = sorted((m.name, m.version, m.role, m.epoch) for m in self.good.list_variables())
        values = [self.good.read(n).tobytes() for n, *_ in metas]
        tables = [(t.name, t.SerializeToString(deterministic=True))
                  for t in self.good.list_tables()]
        rows = [self.good.lookup(n, np.arange(-2, 8), admit=False).tobytes() for n, _ in tables]
        return metas, values, tables, rows


def check(target: Target, before, refused: bool, code, what: str):
    assert code not in BAD, f"{what}: {code}"
    after = target.state()   # also: the server still serves
    for raw in after[3]:   # no request makes a table row that is not finite
        assert np.isfinite(np.frombuffer(raw, np.float32)).all(), f"{what} wrote Inf/NaN rows"
    if refused:
        assert after == before, f"{what} was refused ({code}) but changed the state"
    target.ensure()
    return target.state()


def test_fuzz_grpc(start_ps, tmp_path):
    target = Target(start_ps, str(tmp_path))
    rng = random.Random(SEED)
    templ = templates(str(tmp_path))
    reqs = {k: [r.SerializeToString() for r in v] for k, v in templ.items()}
    classes = {k: type(v[0]) for k, v in templ.items()}
    md = call_metadata(TOKEN)
    state = target.state()
    warm, n = None, 0
    with grpc.insecure_channel(target.ps.address) as ch:
        calls = {k: ch.unary_unary(f"/pstrain.v1.{k}") for k in reqs}
        upload = ch.stream_unary("/pstrain.v1.ParameterServer/Upload")
        stream = ch.unary_stream("/pstrain.v1.ParameterServer/ReadStream")
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            kind = rng.randrange(len(reqs) + 2)
            try:
                if kind < len(reqs):
                    method = sorted(reqs)[kind]
                    raw = mutate(rng, rng.choice(reqs[method]), classes[method])
                    calls[method](raw, metadata=md, timeout=10)
                elif kind == len(reqs):
                    method = "ParameterServer/Upload"
                    first = ps_pb2.UploadFrame(push=ps_pb2.PushRequest(updates=[
                        ps_pb2.DenseUpdate(name="w", tensor=ps_pb2.Tensor(
                            dtype="float32", shape=[8, 4]))])).SerializeToString()
                    frames = [mutate(rng, first, ps_pb2.UploadFrame)] + [
                        mutate(rng, ps_pb2.UploadFrame(chunk=bytes(64)).SerializeToString())
                        for _ in range(rng.randrange(0, 3))]
                    upload(iter(frames), metadata=md, timeout=10)
                else:
                    method = "ParameterServer/ReadStream"
                    list(stream(mutate(rng, ps_pb2.ReadRequest(names=["w"]).SerializeToString()),
                                metadata=md, timeout=10))
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            state = check(target, state, code != grpc.StatusCode.OK, code, method)
            n += 1
            if warm is None and n == 50:
                warm = rss_mib(target.ps.pid)
    assert n > 50
    assert rss_mib(target.ps.pid) - warm < 64 + 2 * MEMORY / 2**20, "memory grew under fuzzing"
    target.good.close()


@pytest.mark.parametrize("path", ["data", "local"])
def test_fuzz_sockets(start_ps, tmp_path, path):
    target = Target(start_ps, str(tmp_path))
    rng = random.Random(SEED + (path == "local"))
    templ = templates(str(tmp_path))
    by_id = {methods.GATHER.id: templ["ParameterServer/Gather"],
             methods.PUSH_SPARSE.id: templ["ParameterServer/PushSparse"],
             methods.BULK_READ.id: templ["ParameterServerBulk/Read"],
             methods.BULK_PUSH.id: templ["ParameterServerBulk/Push"],
             methods.REPLICATE.id: templ["ParameterServer/Replicate"],
             methods.SHM_READ.id: templ["SharedMemory/Read"], methods.SHM_PUSH.id: templ["SharedMemory/Push"],
             methods.TABLE_LOOKUP.id: templ["DynamicTables/Lookup"],
             methods.TABLE_UPDATE.id: templ["DynamicTables/Update"],
             methods.RUN_CLOSURE.id: [ps_pb2.ListRequest()], 99: [ps_pb2.ListRequest()]}
    unknown = methods.Method(99, methods.PS, "Nothing", None, None, "nothing")
    if path == "data":
        port = target.good.server_info().host.data_port
        make = lambda: SocketTransport(routing.TCP, target.ps.address, TOKEN,   # noqa: E731
                                       tcp=("127.0.0.1", port))
    else:
        with PSClient(target.ps.address, token=TOKEN) as c:   # learns the socket's name
            c.read("w")
            c.push("w", np.zeros((8, 4), np.float32))
            name = c.channel.socket.name if c.channel.socket is not None else None
        if name is None:
            pytest.skip("no same-host socket here")
        make = lambda: SocketTransport(routing.UNIX, target.ps.address, TOKEN,   # noqa: E731
                                       name=name)
    client = make()
    state, n, warm = target.state(), 0, None
    end = time.monotonic() + SECONDS
    try:
        while time.monotonic() < end:
            method = rng.choice(sorted(by_id))
            template = rng.choice(by_id[method])
            raw = mutate(rng, template.SerializeToString(), type(template))
            try:
                client.call(methods.BY_ID.get(method, unknown), raw, 10)
                code = grpc.StatusCode.OK
            except PSError as exc:
                code = grpc_code(exc.code)   # as the gRPC path reports it
                if code == grpc.StatusCode.UNAVAILABLE:   # the server dropped the connection
                    client.close()
                    client = make()
            state = check(target, state, code != grpc.StatusCode.OK, code, f"{path} {method}")
            n += 1
            if warm is None and n == 50:
                warm = rss_mib(target.ps.pid)
    finally:
        client.close()
    assert n > 50
    assert rss_mib(target.ps.pid) - warm < 64 + 2 * MEMORY / 2**20, "memory grew under fuzzing"
    target.good.close()


def _damage(rng: random.Random, root: str, outside: str) -> str:
    """Damage one file of the checkpoints under ``root`` at random; what was done."""
    import json
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    path = rng.choice(files)
    kind = rng.choice(["flip", "cut", "link", "fifo", "manifest"] if path.endswith(".json")
                      else ["flip", "flip", "cut", "link", "fifo"])
    os.chmod(path, 0o644)
    if kind == "flip":
        data = bytearray(open(path, "rb").read())
        if data:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        open(path, "wb").write(bytes(data))
    elif kind == "cut":
        os.truncate(path, rng.randrange(max(1, os.path.getsize(path))))
    elif kind in ("link", "fifo"):   # the same bytes outside, or a FIFO no one writes
        copy = os.path.join(outside, f"{rng.random()}")
        os.rename(path, copy)
        os.symlink(copy, path) if kind == "link" else os.mkfifo(path)
    else:   # a field of the manifest changed, dropped, or given another type
        m = json.load(open(path))
        node, key = m, None
        for _ in range(rng.randrange(1, 6)):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = rng.choice(keys)
            inner = node[key]
            if not isinstance(inner, (dict, list)) or not inner or rng.random() < 0.3:
                break
            node, key = inner, None
        if key is not None:
            value = rng.choice([None, -1, 0, 2**63, 1e300, "x", "../../etc", [], {}, True,
                                [[0, 4096, 1]], [[0, 2048, 0], [2048, 4096, 0]]])
            if isinstance(node, dict) and rng.random() < 0.3:
                del node[key]
            else:
                node[key] = value
        open(path, "w").write(json.dumps(m))
    return f"{kind} {os.path.relpath(path, root)}"


def test_fuzz_checkpoint_files(tmp_path):
    """Checkpoints (variables, a dynamic table, a base and a delta) and a
    serving export, damaged at random (issue 33: flipped bits, files cut
    short, a file swapped for a link to the same bytes outside or for a FIFO,
    manifest fields changed, dropped or retyped, bucket maps included): a
    restore either refuses it (CheckpointError, and the servers hold what they
    held) or restores exactly the values saved; a Snapshot either refuses it
    (SnapshotError) or serves exactly the values of an export (the last, or
    the one before when the last one's manifest is unreadable: unfinished).
    Never another error, a hang, or a wrong value."""
    import shutil

    from coordinator import (
        CheckpointManager,
        IndexedSlices,
        LocalCluster,
        ParameterServerStrategy,
        push_gradients,
    )
    from coordinator.checkpoint_files import CheckpointError
    from coordinator.serving import Snapshot, SnapshotError
    rng = random.Random(SEED + 7)
    outside = tmp_path / "outside"
    outside.mkdir()
    keys = np.arange(-5, 60, dtype=np.int64)
    with LocalCluster(num_ps=2, num_workers=0, checkpoint_dirs=[str(tmp_path)]) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        w = strategy.create_variable("w", initial_value=np.ones((6, 3), np.float32),
                                     optimizer="adam")
        t = strategy.create_embedding_table("t", 4, optimizer="adagrad", seed=3,
                                            initializer="random_normal", capacity=50)

        def step(k):
            t.lookup(keys[k % 7:])
            push_gradients([(w, np.full((6, 3), 0.1 * k, np.float32)),
                            (t, IndexedSlices(np.full((20, 4), 0.01 * k, np.float32),
                                              keys[:20]))])

        def values():
            return w.read().tobytes(), t.lookup(keys, admit=False).tobytes()
        manager = CheckpointManager(strategy, str(tmp_path / "ckpt"), incremental=True)
        exporter = CheckpointManager(strategy, str(tmp_path / "export"), incremental=True,
                                     weights_only=True)
        def served(snap):
            return snap.lookup("t", keys).tobytes(), snap.read("w").tobytes()
        step(1)
        manager.save(1), exporter.save(1)
        exported = [values()[::-1]]
        step(2)
        saved = manager.save(2)
        exporter.save(2)
        expected = values()
        exported.append(expected[::-1])
        assert served(Snapshot(str(tmp_path / "export"))) == exported[-1]
        step(3)
        end, n, refused = time.monotonic() + SECONDS, 0, 0
        while time.monotonic() < end or n < 20:
            case = tmp_path / f"case{n}"
            shutil.copytree(tmp_path / "ckpt", case / "ckpt", symlinks=True)
            shutil.copytree(tmp_path / "export", case / "export", symlinks=True)
            what = _damage(rng, str(case), str(outside))
            before = values()
            try:
                CheckpointManager(strategy, str(case / "ckpt")).restore(
                    str(case / "ckpt" / os.path.basename(saved)))
                assert values() == expected, f"{what}: restored, but not the values saved"
                step(4)   # the next case starts from other values
            except CheckpointError:
                refused += 1
                assert values() == before, f"{what}: refused, but the servers changed"
            try:   # (the last export whole, or the one before it: one whose
                got = served(Snapshot(str(case / "export")))   # manifest is gone is unfinished)
                assert got in exported, f"{what}: served, but not the values exported"
            except SnapshotError:
                pass
            shutil.rmtree(case)
            n += 1
    assert refused > 0 and n >= 20
