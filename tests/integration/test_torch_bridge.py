"""coordinator.torch_bridge: a torch module's parameters on the parameter servers.

Skipped where torch is not installed: the bridge is the optional ``torch``
extra, ``pip install -e ".[torch]"``. .ci/run installs it and sets
PSTRAIN_REQUIRE_TORCH=1, so there a missing torch fails the suite.
The unit tests run pull/push in this process against real parameter
servers; the last one trains examples/torch_digits.py on a LocalCluster.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

if os.environ.get("PSTRAIN_REQUIRE_TORCH") == "1":   # CI promises these tests: no skipping
    import torch
else:
    torch = pytest.importorskip(
        "torch", reason="PyTorch is not installed; the torch bridge is the optional 'torch' "
                        "extra (pip install -e '.[torch]'); PSTRAIN_REQUIRE_TORCH=1 makes this "
                        "an error")
import cloudpickle  # noqa: E402
from torch import nn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:          # `pytest` (not `python -m pytest`) from anywhere
    sys.path.insert(0, ROOT)

from coordinator import ClusterSpec, FixedShardsPartitioner, ParameterServerStrategy  # noqa: E402
from coordinator.replica import replica_scope  # noqa: E402
from coordinator.torch_bridge import TorchModelBridge  # noqa: E402

SGD1 = {"optimizer": "sgd", "optimizer_params": {"learning_rate": 1.0}}


@pytest.fixture
def strategy(start_ps):
    """Two real parameter servers; tables split in two shards (one per server)."""
    servers = [start_ps(), start_ps()]
    return ParameterServerStrategy(ClusterSpec(ps=[s.address for s in servers]),
                                   variable_partitioner=FixedShardsPartitioner(2))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class WithTables(nn.Module):
    """A sparse-gradient table with a padding row, a dense-gradient bag table, a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 4, sparse=True, padding_idx=0)
        self.bag = nn.EmbeddingBag(40, 3, mode="sum")
        self.head = nn.Linear(7, 1)

    def forward(self, ids, bag_ids):
        return self.head(torch.cat([self.emb(ids).mean(1), self.bag(bag_ids)], 1)).sum()


def server_values(bridge) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in bridge.state_dict().items()}


def test_core_does_not_import_torch():
    code = ("import sys, coordinator, coordinator.cli, psserver.serve.server, psworker.worker; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_dense_round_trip_sgd(strategy):
    torch.manual_seed(0)
    model = Tiny()
    bridge = TorchModelBridge(strategy, model, name_prefix="tiny", **SGD1)
    assert set(bridge.variables) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert bridge.tables == ()
    before = server_values(bridge)
    for name, p in model.named_parameters():       # initial values come from the module
        np.testing.assert_array_equal(before[name], p.detach().numpy())

    with bridge.local_module() as m:
        assert m is not model
        bridge.pull(m)
        for name, p in m.named_parameters():
            np.testing.assert_array_equal(p.detach().numpy(), before[name])
            assert p.dtype == torch.float32 and p.grad is None
        x = torch.randn(5, 3)
        m(x).pow(2).sum().backward()
        grads = {n: p.grad.numpy().copy() for n, p in m.named_parameters()}
        bridge.push(m)
    after = server_values(bridge)
    for name in before:                             # SGD, lr 1: value - grad
        np.testing.assert_allclose(after[name], before[name] - grads[name], rtol=1e-6, atol=1e-6)

    with bridge.local_module() as again:            # the pool hands the same copy back
        assert again is m
        bridge.pull(again)                          # and pull clears the old gradients
        assert all(p.grad is None for p in again.parameters())


def test_bridge_travels_without_the_weights(strategy):
    model = nn.Sequential(nn.Linear(500, 500), nn.ReLU(), nn.Linear(500, 10))   # ~1 MB of weights
    bridge = TorchModelBridge(strategy, model, name_prefix="big", **SGD1)
    blob = cloudpickle.dumps(bridge)
    assert len(blob) < 20_000, len(blob)
    copy = pickle.loads(blob)                       # as a worker gets it
    m = copy.build_module()
    assert [p.shape for p in m.parameters()] == [p.shape for p in model.parameters()]
    copy.pull(m)
    x = torch.randn(2, 500)
    torch.testing.assert_close(m(x), model(x))


def test_factory_module(strategy):
    torch.manual_seed(1)
    bridge = TorchModelBridge(strategy, Tiny, name_prefix="factory", **SGD1)
    m = pickle.loads(cloudpickle.dumps(bridge)).build_module()
    bridge.pull(m)
    for name, p in m.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), bridge.state_dict()[name].numpy())


def reference_sgd_step(model_values, ids, bag_ids):
    """The same step in plain torch on the whole tables: the expected new values."""
    ref = WithTables()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in model_values.items()})
    ref(torch.as_tensor(ids), torch.as_tensor(bag_ids)).backward()
    with torch.no_grad():
        for p in ref.parameters():
            g = p.grad.to_dense() if p.grad.is_sparse else p.grad
            p -= g
    return {n: p.detach().numpy() for n, p in ref.named_parameters()}


def test_embeddings_pulled_by_rows_and_pushed_sparsely(strategy):
    torch.manual_seed(2)
    bridge = TorchModelBridge(strategy, WithTables(), name_prefix="tables", **SGD1)
    assert set(bridge.tables) == {"emb.weight", "bag.weight"}
    assert bridge.variables["emb.weight"].num_shards == 2      # through the partitioner
    before = server_values(bridge)
    ids = np.array([[0, 7, 7], [45, 3, 0]])                    # 0 is the padding row
    bag_ids = np.array([[39, 2], [2, 21]])
    expected = reference_sgd_step(before, ids, bag_ids)

    with bridge.local_module() as m:
        assert m.emb.weight.shape == (0, 4)                     # no table allocated up front
        local = bridge.pull(m, embedding_ids={"emb": ids, "bag.weight": bag_ids})
        assert m.emb.weight.shape == (4, 4) and m.bag.weight.shape == (3, 3)
        np.testing.assert_array_equal(local["emb"].numpy(), [[0, 2, 2], [3, 1, 0]])
        assert m.emb.padding_idx == 0
        np.testing.assert_array_equal(m.emb.weight.detach().numpy(), before["emb.weight"][[0, 3, 7, 45]])
        m(local["emb"], local["bag.weight"]).backward()
        assert m.emb.weight.grad.is_sparse and not m.bag.weight.grad.is_sparse
        bridge.push(m)
    after = server_values(bridge)
    for name in before:
        np.testing.assert_allclose(after[name], expected[name], rtol=1e-5, atol=1e-6)
    untouched_emb = np.setdiff1d(np.arange(50), [3, 7, 45])   # padding row 0 never changes
    np.testing.assert_array_equal(after["emb.weight"][untouched_emb], before["emb.weight"][untouched_emb])
    untouched_bag = np.setdiff1d(np.arange(40), [2, 21, 39])
    np.testing.assert_array_equal(after["bag.weight"][untouched_bag], before["bag.weight"][untouched_bag])
    assert not np.array_equal(after["emb.weight"][[3, 7, 45]], before["emb.weight"][[3, 7, 45]])


def test_padding_row_absent_from_a_step(strategy):
    """Row 0 is the padding row globally; a step without id 0 must not treat
    local row 0 (another id) as padding."""
    torch.manual_seed(3)
    bridge = TorchModelBridge(strategy, WithTables(), name_prefix="pad", **SGD1)
    before = server_values(bridge)
    ids, bag_ids = np.array([[5, 9, 9]]), np.array([[1, 1]])
    expected = reference_sgd_step(before, ids, bag_ids)
    with bridge.local_module() as m:
        local = bridge.pull(m, embedding_ids={"emb": ids, "bag": bag_ids})
        assert m.emb.padding_idx is None
        m(local["emb"], local["bag"]).backward()
        bridge.push(m)
    after = server_values(bridge)
    np.testing.assert_allclose(after["emb.weight"], expected["emb.weight"], rtol=1e-5, atol=1e-6)
    assert not np.array_equal(after["emb.weight"][5], before["emb.weight"][5])


def test_whole_tables_sparse_and_dense_gradients(strategy):
    """Tables not named in embedding_ids are read whole; their gradients still
    go out as touched rows only."""
    torch.manual_seed(4)
    bridge = TorchModelBridge(strategy, WithTables(), name_prefix="whole", **SGD1)
    before = server_values(bridge)
    ids, bag_ids = np.array([[0, 11, 12]]), np.array([[30, 31]])
    expected = reference_sgd_step(before, ids, bag_ids)
    with bridge.local_module() as m:
        assert bridge.pull(m) == {}
        assert m.emb.weight.shape == (50, 4)
        m(torch.as_tensor(ids), torch.as_tensor(bag_ids)).backward()
        bridge.push(m)
    after = server_values(bridge)
    for name in before:
        np.testing.assert_allclose(after[name], expected[name], rtol=1e-5, atol=1e-6)
    # Only the shards holding touched rows were pushed to (rows 0-24 | 25-49, 0-19 | 20-39).
    assert bridge.variables["emb.weight"].versions() == [1, 0]
    assert bridge.variables["bag.weight"].versions() == [0, 1]


def test_tuple_of_id_tensors_and_errors(strategy):
    bridge = TorchModelBridge(strategy, WithTables(), name_prefix="tuple", **SGD1)
    with bridge.local_module() as m:
        a, b = bridge.pull(m, embedding_ids={"emb": (torch.tensor([8, 4]), torch.tensor([[4, 20]]))})["emb"]
        np.testing.assert_array_equal(a.numpy(), [1, 0])
        np.testing.assert_array_equal(b.numpy(), [[0, 2]])
        with pytest.raises(KeyError, match="not an embedding table"):
            bridge.pull(m, embedding_ids={"head": [1]})
        with pytest.raises(TypeError, match="integers"):
            bridge.pull(m, embedding_ids={"emb": np.array([1.5])})


def test_tied_table_is_dense_and_max_norm_is_refused(strategy):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 3)
            self.out = nn.Linear(3, 6, bias=False)
            self.out.weight = self.emb.weight       # the output layer reuses the table

    bridge = TorchModelBridge(strategy, Tied(), name_prefix="tied", **SGD1)
    assert bridge.tables == () and list(bridge.variables) == ["emb.weight"]
    m = bridge.build_module()
    assert m.out.weight is m.emb.weight             # the tie survives the skeleton
    bridge.pull(m)
    assert m.emb.weight.shape == (6, 3)
    with pytest.raises(ValueError, match="max_norm"):
        TorchModelBridge(strategy, nn.Embedding(4, 2, max_norm=1.0), name_prefix="norm")


@pytest.mark.timeout(60)
def test_sync_mode_pushes_zeros_for_missing_gradients(start_ps):
    """In sync mode every variable must hear from every replica, or the next
    step's reads wait: an unused parameter is pushed as zeros."""
    ps = start_ps()
    strategy = ParameterServerStrategy(ClusterSpec(ps=[ps.address]), mode="sync",
                                       num_replicas=1, step_timeout=0)

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(2, 1), nn.Linear(2, 1)
            self.emb = nn.Embedding(5, 2)

        def forward(self, x):
            return self.used(x).sum()

    bridge = TorchModelBridge(strategy, Unused(), name_prefix="sync", **SGD1)
    before = server_values(bridge)
    m = bridge.build_module()
    for step in range(2):
        with replica_scope(strategy.sync_spec(step, 0)):
            bridge.pull(m, embedding_ids={"emb": [1]})
            m(torch.ones(1, 2)).backward()
            bridge.push(m)
    after = server_values(bridge)
    np.testing.assert_array_equal(after["unused.weight"], before["unused.weight"])
    assert not np.array_equal(after["used.weight"], before["used.weight"])
    assert bridge.variables["unused.weight"].versions() == [2]


@pytest.mark.timeout(120)
def test_torch_digits_example_converges():
    from examples import torch_digits
    out = torch_digits.main(["--epochs", "6"])
    assert out["test_accuracy"] >= 0.90, out["test_accuracy"]
    assert out["steps"] == 300
