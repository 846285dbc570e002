"""The contract below both sides of the wire (psserver/contract/, psserver/errors.py): the
parameter-server logic runs without grpc or protobuf, and every transport
turns a status into the same typed error."""
import subprocess
import sys
import textwrap

import grpc
import pytest

from psserver import errors as E
from psserver.link.grpc_common import grpc_code
from psserver.link.transport import from_rpc_error
from tests.contract.test_layers import BLOCK_GRPC_AND_PROTOBUF


@pytest.mark.timeout(60)
def test_store_runs_without_grpc_or_protobuf():
    code = BLOCK_GRPC_AND_PROTOBUF + textwrap.dedent("""
        import numpy as np
        from psserver.contract import optimizers
        from psserver.core import sync
        from psserver.core.store import VariableStore
        from psserver.contract import Initializer, SyncSpec
        s = VariableStore()
        s.create("w", "float32", [4], initializer=Initializer("ones"), optimizer="adam")
        s.push([("w", np.full(4, 0.5, np.float32))])
        SyncSpec(step=0, replica=0, num_replicas=1, required=1).validate()
        version, value = s.snapshot("w")
        assert version >= 1 and value.shape == (4,) and (value < 1).all(), (version, value)
        from psserver.core.dynamic_table import DynamicTable
        from psserver.core.table_config import TableConfig
        t = DynamicTable(TableConfig(dim=2), optimizers.make_optimizer("sgd", {}))
        assert t.lookup(np.array([5, 6])).shape == (2, 2) and len(t) == 2
        import tempfile   # incremental saves: tracking, deltas, commits
        d = tempfile.mkdtemp()
        s.saver.save(d, (), s.saver.begin_save(1, 0, "", "s"))
        s.saver.commit_save(1, "s", s.saver.incarnation)
        s.push(sparse=[("w", np.array([2]), np.ones(1, np.float32), 0)])
        (saved,) = s.saver.save(d, (), s.saver.begin_save(2, 1, s.saver.incarnation, "s"))
        assert (saved.kind, saved.rows) == (1, 1), saved
        assert t.take_changes(1, "s", 0) is None and t.tracker is not None
        from psserver.core.table_store import TableSpec, TableStore   # a table beside the variables
        from psserver.core.table_config import TableConfig
        tables = TableStore.beside(s)
        tables.create("e", TableSpec(TableConfig(dim=3)))
        assert tables.lookup("e", np.array([1, 2])).shape == (2, 3)
        assert {c.name for c in s.registry.copies()} == {"w", "~table~e"}
        # (every module of contract and core is imported so in test_layers.py)
        for mod in ("grpc", "google.protobuf", "protos"):
            assert mod not in sys.modules, mod
        print("ok", version)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


@pytest.mark.timeout(60)
def test_the_block_does_block():
    """The finder (test_layers.BLOCK_GRPC_AND_PROTOBUF) would catch a store that imports grpc."""
    code = BLOCK_GRPC_AND_PROTOBUF + "import psserver.link.grpc_common"
    out = subprocess.run([sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode != 0 and "blocked: grpc" in out.stderr


@pytest.mark.parametrize("code", list(E.Code))
def test_one_mapping_for_every_code(code):
    """A code means the same error whichever way it came: its number on a
    socket, or a gRPC status."""
    via_socket = E.error_for(int(code), "msg", "ps0:1")
    assert via_socket.code == code and via_socket.address == "ps0:1"
    assert str(via_socket) == "msg [ps0:1]"

    class Failed(grpc.RpcError):
        def code(self):
            return grpc_code(code)

        def details(self):
            return "msg"
    via_grpc = from_rpc_error(Failed(), "ps0:1")
    assert type(via_grpc) is type(via_socket) and via_grpc.code == code
    assert grpc_code(code).name == code.name


def test_classes_by_code():
    assert isinstance(E.error_for(E.Code.NOT_FOUND, "x"), KeyError)
    assert isinstance(E.error_for(E.Code.INVALID_ARGUMENT, "x"), ValueError)
    assert isinstance(E.error_for(E.Code.CANCELLED, "x"), E.Unavailable)
    assert isinstance(E.error_for(E.Code.UNIMPLEMENTED, "x"), E.Unimplemented)
    assert type(E.error_for(E.Code.DATA_LOSS, "x")) is E.PSError
    assert E.error_for(200, "x").code == E.Code.UNKNOWN


def test_handler_errors_as_the_caller_sees_them():
    assert E.as_error(E.NotFound("w")).code == E.Code.NOT_FOUND
    assert E.as_error(MemoryError()).code == E.Code.RESOURCE_EXHAUSTED
    err = E.as_error(ZeroDivisionError("boom"))
    assert err.code == E.Code.INTERNAL and "ZeroDivisionError: boom" in str(err)
