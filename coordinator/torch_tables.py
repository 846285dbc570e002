"""A dynamic embedding table as a PyTorch module (optional: needs torch).

``DynamicEmbeddingModule(table)`` is an ``nn.Module`` over a dynamic table
(``strategy.create_embedding_table``: int64 ids of any size, rows made on
first sight, evicted by capacity or age), usable in an ordinary model::

    table = strategy.create_embedding_table("user", 16, optimizer="adagrad", min_count=2)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = DynamicEmbeddingModule(table)            # rows per id
            self.items = DynamicEmbeddingModule(items, mode="sum")   # pooled, as nn.EmbeddingBag
            self.top = nn.Linear(32, 1)

        def forward(self, user_ids, item_ids, offsets):
            return self.top(torch.cat([self.user(user_ids), self.items(item_ids, offsets)], 1))

``forward(ids)`` gives the rows of ``ids`` (any shape: ids.shape + (dim,)),
or with ``mode="sum"`` / ``"mean"`` each bag's rows pooled: ids (B, n) are
B bags of n, or ids 1-D with ``offsets`` (B,) where each bag starts, and
``per_sample_weights`` (``"sum"`` only), as ``nn.EmbeddingBag`` takes them.
Each distinct id's row is fetched once (every occurrence counted, for
admission and LFU, as ``table.lookup`` counts them), as a tensor that takes
gradients; ``gradients()`` after ``loss.backward()`` gives ``[(table,
IndexedSlices(row gradients, ids))]`` for ``push_gradients``, and forgets
the step's rows.

With ``TorchModelBridge`` (coordinator/torch_bridge.py) the module is found
in the model: ``bridge.pull(m, embedding_ids={"user": ids})`` fetches the
rows of ``ids`` in the same call to each server as the dense parameters
(``read_variables``), and ``bridge.push(m)`` sends the rows' gradients in
the same call as the dense gradients; forward then looks up nothing. A
forward given ids that were not pulled fetches their rows itself (one more
call). Pulled rows serve forwards until the push, the next pull or a
change of mode, as the bridge's pulled dense parameters do. In ``eval()``
mode look-ups admit, count and evict nothing (zeros for ids without a row)
and nothing is kept for a push.

Nothing in the core packages imports this module or torch.
"""
from __future__ import annotations

from typing import Any

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:   # pragma: no cover - exercised only without torch
    raise ImportError("coordinator.torch_tables needs PyTorch (torch>=2.1; its CPU build is "
                      "enough): pip install torch --index-url "
                      "https://download.pytorch.org/whl/cpu && pip install 'pstrain[torch]' "
                      f"({exc})") from exc

from coordinator.embedding import DynamicEmbedding
from coordinator.step_calls import IndexedSlices, Lookup
from psserver.contract.keys import check_keys

__all__ = ["DynamicEmbeddingModule"]

MODES = (None, "sum", "mean")


def as_keys(ids) -> np.ndarray:
    """Ids (a tensor or array of integers) as int64 numpy; TypeError otherwise."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    try:
        return check_keys(ids)
    except ValueError as exc:
        raise TypeError(str(exc)) from None


class DynamicEmbeddingModule(nn.Module):
    """See the module. ``table``: a DynamicEmbedding; ``mode``: None (a row
    per id), "sum" or "mean" (pooled bags)."""

    def __init__(self, table: DynamicEmbedding, mode: str | None = None):
        super().__init__()
        if not isinstance(table, DynamicEmbedding):
            raise TypeError(f"DynamicEmbeddingModule takes a dynamic table "
                            f"(strategy.create_embedding_table), got {type(table).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        self.table, self.mode = table, mode
        self.embedding_dim = table.dim
        self._reset()

    def _reset(self) -> None:
        self._looked: list[tuple[np.ndarray, torch.Tensor]] = []   # this step's (ids, rows)
        self._pulled: tuple | None = None   # (sorted distinct ids, rows, training) of a pull

    def __getstate__(self) -> dict:   # a copy (the bridge's skeleton) carries no step's rows
        state = self.__dict__.copy()
        state["_looked"], state["_pulled"] = [], None
        return state

    def extra_repr(self) -> str:
        return f"{self.table.name!r}, dim={self.table.dim}, mode={self.mode!r}"

    # -- what the bridge calls -----------------------------------------------------
    def lookup_item(self, ids) -> tuple[Lookup, np.ndarray]:
        """(read_variables' item for ``ids``, those ids flat). Every
        occurrence is counted (admission, LFU), each distinct id sent once."""
        flat = as_keys(ids).reshape(-1)
        return Lookup(self.table, flat, self.training), flat

    def pulled(self, flat: np.ndarray, rows: np.ndarray) -> None:
        """The rows (one per id of ``flat``) fetched for this step (in this
        mode: a pull made in eval() does not serve a training forward, whose
        look-up must count and admit)."""
        distinct, first = np.unique(flat, return_index=True)
        self._looked, self._pulled = [], (distinct, rows[first], self.training)

    def train(self, mode: bool = True):
        if mode != self.training:
            self._pulled = None
        return super().train(mode)

    def gradients(self, empty_too: bool = False) -> list[tuple[DynamicEmbedding, IndexedSlices]]:
        """[(table, IndexedSlices(row gradients, ids))] of the rows fetched
        since the last call that took a gradient (none if none did, unless
        ``empty_too``: an empty one, as a sync step's replica must send);
        the step's rows are forgotten."""
        ids, grads = [], []
        for keys, rows in self._looked:
            if rows.grad is not None:
                ids.append(keys)
                grads.append(rows.grad.detach().to(dtype=torch.float32).cpu().numpy())
        self._reset()
        if not ids:
            if not empty_too:
                return []
            ids, grads = [np.zeros(0, np.int64)], [np.zeros((0, self.table.dim), np.float32)]
        return [(self.table, IndexedSlices(np.concatenate(grads), np.concatenate(ids)))]

    # -- forward -------------------------------------------------------------------
    def _rows(self, flat: np.ndarray, distinct: np.ndarray, first: np.ndarray) -> np.ndarray:
        """Rows of the sorted ``distinct`` ids of ``flat`` (``first``: where
        each occurs first there): pulled, or looked up now (every occurrence
        counted, as a pull counts them)."""
        if self._pulled is not None and self._pulled[2] == self.training:
            have, rows, _ = self._pulled
            at = np.minimum(np.searchsorted(have, distinct), max(0, have.size - 1))
            if have.size and (have[at] == distinct).all():
                return rows[at]
        return self.table.lookup(flat, admit=self.training)[first]

    def forward(self, ids, offsets=None, per_sample_weights=None) -> torch.Tensor:
        keys = as_keys(ids)
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise ValueError("offsets and per_sample_weights are for pooled look-ups: "
                             "DynamicEmbeddingModule(table, mode='sum' or 'mean')")
        if self.mode is not None and not (keys.ndim == 2 and offsets is None
                                          or keys.ndim == 1 and offsets is not None):
            raise ValueError("a pooled look-up takes ids (bags, n) without offsets, or ids "
                             f"1-D with offsets; got ids of shape {keys.shape} "
                             f"{'with' if offsets is not None else 'without'} offsets")
        flat = keys.reshape(-1)
        distinct, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
        rows = torch.from_numpy(np.ascontiguousarray(self._rows(flat, distinct, first),
                                                     np.float32))
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._looked.append((distinct, rows))
        index = torch.from_numpy(inverse.reshape(keys.shape).astype(np.int64, copy=False))
        if self.mode is None:
            return F.embedding(index, rows)
        return F.embedding_bag(index, rows, _tensor(offsets), mode=self.mode,
                               per_sample_weights=per_sample_weights)


def _tensor(a: Any) -> torch.Tensor | None:
    if a is None or isinstance(a, torch.Tensor):
        return a
    return torch.as_tensor(np.asarray(a, np.int64))
