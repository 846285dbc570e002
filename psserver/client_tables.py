"""PSClient's calls on dynamic embedding tables (protos/pstrain/v1/tables.proto):
one server's shard of each table. Look-ups and updates take the same
transports as gathers and sparse pushes (shared-memory host's Unix socket,
the data port between hosts, else gRPC); the others are gRPC calls.
(coordinator.DynamicEmbedding spreads a table's keys over servers.)"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from protos.pstrain.v1 import ps_pb2, tables_pb2
from psserver import methods
from psserver import tensor as T
from psserver.client_util import Handle, _set_sync, _set_sync_read
from psserver.contract import MESSAGE_OVERHEAD, Initializer, SyncSpec


def table_spec(dim: int, *, dtype: str = "float32",
               initializer: Initializer | str | None = None, optimizer: str = "sgd",
               optimizer_params: Mapping[str, float] | None = None, min_count: int = 1,
               probability: float = 1.0, capacity: int = 0, policy: str = "lru",
               max_age_steps: int = 0, max_age_seconds: float = 0.0,
               admission_capacity: int = 0, seed: int = 0) -> tables_pb2.TableSpec:
    """A TableSpec (see psserver/dynamic_table.py for what each field does)."""
    if isinstance(initializer, str):
        initializer = Initializer(kind=initializer)
    init = initializer or Initializer()
    return tables_pb2.TableSpec(
        dim=dim, dtype=dtype,
        initializer=ps_pb2.Initializer(kind=init.kind, value=init.value, mean=init.mean,
                                       stddev=init.stddev, minval=init.minval,
                                       maxval=init.maxval, seed=init.seed),
        optimizer=ps_pb2.OptimizerSpec(name=optimizer, params=dict(optimizer_params or {})),
        min_count=min_count, probability=probability, capacity=capacity, policy=policy,
        max_age_steps=max_age_steps, max_age_seconds=max_age_seconds,
        admission_capacity=admission_capacity, seed=seed)


class TableCalls:
    """Mixed into PSClient (it brings _call and _invoke: psserver/channel.py)."""

    def create_table(self, name: str, dim: int, *, exist_ok: bool = False,
                     **spec) -> tables_pb2.TableInfo:
        """Create this server's shard of dynamic table ``name`` with rows of
        ``dim`` (keyword arguments: psserver.client_tables.table_spec)."""
        return self._call(methods.TABLE_CREATE, tables_pb2.CreateTableRequest(
            name=name, spec=table_spec(dim, **spec), exist_ok=exist_ok))

    def create_table_from_spec(self, name: str, spec: tables_pb2.TableSpec, *,
                               exist_ok: bool = False) -> tables_pb2.TableInfo:
        return self._call(methods.TABLE_CREATE, tables_pb2.CreateTableRequest(
            name=name, spec=spec, exist_ok=exist_ok))

    def lookup_async(self, name: str, keys, *, admit: bool = True, counts=None,
                     sync_step: int | None = None) -> Handle:
        """Rows of int64 ``keys`` (any shape; result keys.shape + (dim,));
        zeros for keys without a row. ``admit=False`` (evaluation, serving):
        nothing is counted, created or evicted. ``counts``: how often each
        key occurs in the caller's batch (it sends unique keys).
        ``sync_step`` (sync mode): first wait while an earlier step's
        updates are being gathered on the shard."""
        req = tables_pb2.LookupRequest(name=name, no_admit=not admit)
        T.fill(req.keys, _keys(keys))
        if counts is not None:
            T.fill(req.counts, np.asarray(counts))
        _set_sync_read(req, sync_step)
        return self._invoke(False, methods.TABLE_LOOKUP, req, lambda r: T.decode(r.rows))

    def lookup(self, name: str, keys, *, admit: bool = True, counts=None,
               sync_step: int | None = None) -> np.ndarray:
        return self.lookup_async(name, keys, admit=admit, counts=counts,
                                 sync_step=sync_step).result()

    def update_table_async(self, name: str, keys, grads, *, update_id: int = 0,
                           sync: SyncSpec | None = None) -> Handle:
        """Apply row gradients (duplicate keys summed) with the table's
        optimizer; ``result()``: (rows updated, gradient rows dropped).
        ``update_id`` (non-zero): the update applies once however often it
        is sent (a resend answers (0, 0)). ``sync`` (sync mode): this
        replica's share of a step, gathered and applied with the others'
        once the step is complete; the counts are the step's if this update
        completed it, else (0, 0)."""
        req = tables_pb2.TableUpdateRequest(name=name, update_id=update_id)
        T.fill(req.keys, _keys(keys).reshape(-1))
        T.fill(req.grads, np.asarray(grads))
        _set_sync(req, sync)
        return self._invoke(False, methods.TABLE_UPDATE, req, lambda r: (r.updated, r.dropped))

    def update_table(self, name: str, keys, grads, *, update_id: int = 0,
                     sync: SyncSpec | None = None) -> tuple[int, int]:
        return self.update_table_async(name, keys, grads, update_id=update_id,
                                       sync=sync).result()

    def table_info(self, name: str) -> tables_pb2.TableInfo:
        return self._call(methods.TABLE_INFO, tables_pb2.TableRef(name=name))

    def list_tables(self) -> list[tables_pb2.TableInfo]:
        return list(self._call(methods.TABLE_LIST, tables_pb2.ListTablesRequest()).tables)

    def delete_table(self, name: str) -> bool:
        return self._call(methods.TABLE_DELETE, tables_pb2.TableRef(name=name)).deleted

    def save_table(self, name: str, directory: str, **incremental) -> tables_pb2.SaveTableReply:
        """Write this server's shard of ``name`` to a file in ``directory``
        (under its --checkpoint-dir; psserver/tables.py). ``incremental``:
        save_id, since, incarnation, stream, weights_only (tables.proto)."""
        return self._call(methods.TABLE_SAVE, tables_pb2.SaveTableRequest(
            name=name, directory=directory, **incremental))

    def import_table(self, name: str, state: Mapping[str, np.ndarray], step: int, *,
                     reset: bool = True, replica: Mapping | None = None,
                     timeout: float | None = None) -> int:
        """Put rows (psserver.dynamic_table.DynamicTable.export's arrays) into
        this server's shard of ``name``, emptied first with ``reset``; sent in
        pieces that fit a message. Returns the rows the shard holds.
        ``replica`` (a primary's server copying its state to its backup:
        spec, epoch, version, applied_ids): make or replace the copy as a
        backup (tables.proto ReplicaCopy)."""
        keys = np.asarray(state["keys"], np.int64)
        per_row = sum(a.nbytes // max(1, keys.size) for a in state.values()
                      if np.ndim(a) and keys.size)
        per_call = max(1, (self.max_message_bytes - MESSAGE_OVERHEAD) // max(1, per_row))
        rows = 0
        for i, lo in enumerate(range(0, max(1, keys.size), per_call)):
            hi = lo + per_call
            req = tables_pb2.ImportTableRequest(name=name, reset=reset and i == 0, step=step)
            if replica is not None:
                req.replica.CopyFrom(tables_pb2.ReplicaCopy(
                    complete=hi >= keys.size, **replica))
            for field in ("keys", "values", "age_steps", "age_seconds", "freq"):
                T.fill(getattr(req, field), np.ascontiguousarray(state[field][lo:hi]))
            for key, a in state.items():
                if key.startswith("slot/"):
                    a = np.asarray(a)
                    T.fill(req.slots.add(name=key[5:]).tensor,   # (0-d stays 0-d: Adam's count)
                           a if a.ndim == 0 else np.ascontiguousarray(a[lo:hi]))
            rows = self._call(methods.TABLE_IMPORT, req, timeout).rows
        return rows


def _keys(keys) -> np.ndarray:
    """Keys as sent: int64 (narrower integers widened); other dtypes are sent
    as they are and the server says what is wrong."""
    a = np.asarray(keys)
    return a.astype(np.int64) if a.dtype.kind in "iu" and a.dtype.itemsize < 8 else a
