"""coordinator.torch_tables: a dynamic table as a torch module, alone and on
the bridge, against real parameter servers (skipped without torch, as
tests/integration/test_torch_bridge.py is; CI requires it)."""
from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("PSTRAIN_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (the 'torch' extra)")
import cloudpickle  # noqa: E402
from torch import nn  # noqa: E402

from coordinator import ClusterSpec, ParameterServerStrategy, push_gradients  # noqa: E402
from coordinator.embedding import DynamicEmbedding  # noqa: E402
from coordinator.ps_pool import client_for  # noqa: E402
from coordinator.replica import replica_scope  # noqa: E402
from coordinator.torch_bridge import TorchModelBridge  # noqa: E402
from coordinator.torch_tables import DynamicEmbeddingModule  # noqa: E402

pytestmark = pytest.mark.timeout(60)
SGD1 = {"optimizer": "sgd", "optimizer_params": {"learning_rate": 1.0}}


@pytest.fixture
def strategy(start_ps):
    servers = [start_ps(), start_ps()]
    return ParameterServerStrategy(ClusterSpec(ps=[s.address for s in servers]))


def make_table(strategy, name="t", dim=4):
    return strategy.create_embedding_table(name, dim, initializer="random_normal", seed=1,
                                           **SGD1)


IDS = np.array([[5, 9, 5], [2**62, -7, 9]], np.int64)   # repeats, huge and negative ids


def test_rows_per_id_and_their_gradients_reach_the_table(strategy):
    t = make_table(strategy)
    m = DynamicEmbeddingModule(t)
    before = t.lookup(IDS, admit=False)
    assert not before.any()   # not admitted yet: zeros
    out = m(torch.from_numpy(IDS))
    assert out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out.detach().numpy(), t.lookup(IDS, admit=False))
    weights = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    (out * weights).sum().backward()
    start = t.lookup(IDS, admit=False)
    push_gradients(m.gradients())
    assert m.gradients() == []   # the step's rows were forgotten
    # SGD at 1: each id's row less the sum of its weights (id 5 twice, id 9 twice)
    want = {5: weights[0, 0] + weights[0, 2], 9: weights[0, 1] + weights[1, 2],
            2**62: weights[1, 0], -7: weights[1, 1]}
    got = t.lookup(np.array(list(want)), admit=False)
    for i, (k, w) in enumerate(want.items()):
        j = tuple(np.argwhere(IDS == k)[0])
        np.testing.assert_allclose(got[i], start[j] - w.numpy(), rtol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pooled_bags_match_the_rows_pooled_by_hand(strategy, mode):
    t = make_table(strategy)
    ids = np.array([3, 4, 4, 8, 1, 2], np.int64)
    offsets = np.array([0, 3, 4])   # bags [3 4 4] [8] [1 2]
    t.lookup(ids)   # admitted
    rows = t.lookup(ids, admit=False)
    m = DynamicEmbeddingModule(t, mode=mode)
    pool = np.sum if mode == "sum" else np.mean
    want = np.stack([pool(rows[a:b], 0) for a, b in zip(offsets, [3, 4, 6])])
    np.testing.assert_allclose(m(torch.from_numpy(ids), torch.from_numpy(offsets))
                               .detach().numpy(), want, rtol=1e-6)
    bags = np.array([[3, 4], [8, 8]], np.int64)   # 2-D: fixed-size bags, no offsets
    np.testing.assert_allclose(m(bags).detach().numpy(),
                               pool(t.lookup(bags, admit=False), 1), rtol=1e-6)
    if mode == "sum":
        w = torch.tensor([1.0, 2, 3, 4, 5, 6])
        got = m(torch.from_numpy(ids), torch.from_numpy(offsets), per_sample_weights=w)
        np.testing.assert_allclose(got[0].detach().numpy(),
                                   rows[0] + 2 * rows[1] + 3 * rows[2], rtol=1e-6)


def test_bad_calls_say_what_to_pass(strategy):
    t = make_table(strategy)
    with pytest.raises(ValueError, match="mode"):
        DynamicEmbeddingModule(t, mode="max")
    with pytest.raises(TypeError, match="dynamic table"):
        DynamicEmbeddingModule(nn.Embedding(3, 2))
    m = DynamicEmbeddingModule(t)
    with pytest.raises(TypeError, match="int64"):
        m(torch.tensor([1.5]))
    with pytest.raises(ValueError, match="pooled"):
        m(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValueError, match="offsets"):
        DynamicEmbeddingModule(t, mode="sum")(torch.tensor([1, 2]))
    assert t.stats().lookups == 0   # refused before anything was sent


def test_eval_mode_admits_nothing_and_keeps_nothing(strategy):
    t = make_table(strategy)
    m = DynamicEmbeddingModule(t).eval()
    assert not m(torch.tensor([11, 12])).detach().numpy().any()
    assert (t.stats().lookups, len(t)) == (0, 0)
    assert m.gradients() == []


class CTRish(nn.Module):
    def __init__(self, users: DynamicEmbedding, items: DynamicEmbedding):
        super().__init__()
        self.user = DynamicEmbeddingModule(users)
        self.items = DynamicEmbeddingModule(items, mode="mean")
        self.head = nn.Linear(4 + 3, 1)

    def forward(self, user_ids, item_bags):
        return self.head(torch.cat([self.user(user_ids), self.items(item_bags)], 1)).sum()


def test_on_the_bridge_rows_ride_the_dense_read_and_push(strategy, monkeypatch):
    """bridge.pull fetches the tables' rows with the dense parameters and
    forward looks up nothing; bridge.push sends their gradients with the
    dense ones (the tables' own calls would fail here); the values are those
    of the same step in torch alone."""
    users, items = make_table(strategy, "users", 4), make_table(strategy, "items", 3)
    users.lookup(np.arange(10)), items.lookup(np.arange(10))   # admitted
    torch.manual_seed(0)
    bridge = TorchModelBridge(strategy, CTRish(users, items), **SGD1)
    assert set(bridge.dynamic) == {"user", "items"}
    user_ids, bags = np.array([1, 2, 1]), np.array([[3, 4], [5, 5], [3, 9]])
    head0 = bridge.state_dict()
    u0, i0 = users.lookup(np.arange(10), admit=False), items.lookup(np.arange(10), admit=False)

    def refuse(*a, **k):
        raise AssertionError("a table's own call: should have ridden the bulk call")
    for name in ("lookup", "lookup_async", "push_gradient", "push_gradient_async"):
        monkeypatch.setattr(DynamicEmbedding, name, refuse)
    with bridge.local_module() as m:
        got = bridge.pull(m, embedding_ids={"user": user_ids, "items": bags})
        assert got["user"] is user_ids
        m(torch.from_numpy(user_ids), torch.from_numpy(bags)).backward()
        bridge.push(m)
    monkeypatch.undo()
    # The same step in torch alone, SGD at 1.
    ref_u = torch.tensor(u0, requires_grad=True)
    ref_i = torch.tensor(i0, requires_grad=True)
    head = nn.Linear(7, 1)
    head.load_state_dict({"weight": head0["head.weight"], "bias": head0["head.bias"]})
    x = torch.cat([ref_u[torch.from_numpy(user_ids)],
                   ref_i[torch.from_numpy(bags)].mean(1)], 1)
    head(x).sum().backward()
    np.testing.assert_allclose(users.lookup(np.arange(10), admit=False),
                               (ref_u - ref_u.grad).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(items.lookup(np.arange(10), admit=False),
                               (ref_i - ref_i.grad).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bridge.state_dict()["head.weight"].numpy(),
                               (head.weight - head.weight.grad).detach().numpy(), rtol=1e-5)


def test_a_sync_replica_that_touched_no_row_still_counts(start_ps):
    """In a sync step every replica's update reaches every shard of a table
    (an empty one counting), else the next step's look-ups would wait."""
    ps = [start_ps(), start_ps()]
    strategy = ParameterServerStrategy(ClusterSpec(ps=[p.address for p in ps]), mode="sync",
                                       num_replicas=1, step_timeout=0)
    users, items = make_table(strategy, "users", 4), make_table(strategy, "items", 3)
    bridge = TorchModelBridge(strategy, CTRish(users, items), name_prefix="sync", **SGD1)
    m = bridge.build_module()
    with replica_scope(strategy.sync_spec(0, 0)):
        bridge.pull(m)
        bridge.push(m)   # no forward: no rows touched
    for t in (users, items):
        assert [client_for(c.address).table_info(c.table).sync_steps
                for c in t.primaries()] == [1, 1]


def test_a_module_pickled_mid_step_carries_no_rows(strategy):
    t = make_table(strategy)
    m = DynamicEmbeddingModule(t)
    m(torch.tensor([1, 2])).sum().backward()
    copy = cloudpickle.loads(cloudpickle.dumps(m))
    assert copy.gradients() == [] and len(m.gradients()) == 1


def test_every_occurrence_counts_for_admission_pulled_or_not(strategy):
    """A key twice in one batch is looked up twice (as table.lookup counts
    it): with min_count=2 it is admitted, by a forward alone or by a pull."""
    t = strategy.create_embedding_table("t", 2, min_count=2, **SGD1)
    DynamicEmbeddingModule(t)(torch.tensor([[7, 7], [8, 9]]))
    assert len(t) == 1 and t.lookup([7, 8], admit=False)[1].sum() == 0
    bridge = TorchModelBridge(strategy, CTRish(t, make_table(strategy, "i", 3)), **SGD1)
    with bridge.local_module() as m:
        bridge.pull(m, embedding_ids={"user": np.array([5, 5, 6])})
    assert len(t) == 2


@pytest.mark.timeout(300)
def test_the_pytorch_ctr_example_reaches_the_numpy_models_auc():
    """examples/torch_ctr.py (autograd, the bridge, DynamicEmbeddingModule)
    against examples/ctr.py (numpy) after the same steps: the median AUC of
    3 seeds within 0.005 (issue 32)."""
    from examples import ctr, torch_ctr
    common = ["--epochs", "2", "--steps-per-epoch", "60", "--batch-size", "256",
              "--num-workers", "1", "--eval-batches", "10", "--verbose", "0"]
    ours, numpy_model = [], []
    for seed in ("0", "1", "2"):
        ours.append(torch_ctr.main(common + ["--seed", seed])["auc"])
        numpy_model.append(ctr.main(common + ["--seed", seed])["auc"])
    assert min(ours) > 0.55   # learnt something (0.5: chance)
    assert abs(np.median(ours) - np.median(numpy_model)) <= 0.005, (ours, numpy_model)


def test_rows_pulled_in_eval_mode_do_not_serve_a_training_forward(strategy):
    """A training forward's look-up counts and admits: rows an eval() pull
    fetched (nothing admitted) are not reused for it."""
    t = strategy.create_embedding_table("t", 2, **SGD1)
    bridge = TorchModelBridge(strategy, CTRish(t, make_table(strategy, "i", 3)), **SGD1)
    m = bridge.build_module().eval()
    bridge.pull(m, embedding_ids={"user": np.array([7])})
    assert len(t) == 0
    m.train()
    m.user(torch.tensor([7]))
    assert len(t) == 1
