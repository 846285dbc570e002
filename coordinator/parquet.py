"""Parquet files as a ShardedSource (pyarrow, the ``parquet`` extra:
``pip install -e ".[parquet]"``).

``ParquetSource(paths, columns=None, convert=None)``: a shard per row group
of each file, in order (the files' metadata is read once, where the source
is made: the coordinator must see the files at the paths the workers see
them). A worker's ``read(shard, start, count)`` returns rows [start, start +
count) of that row group as {column: numpy array} (``columns``: only
these), or ``convert`` of that dict (e.g. ``coordinator.criteo.from_columns``
for Criteo's columns, which gives examples/ctr.py's batches). A worker
keeps the row group it read last, so consecutive batches of one shard read
it once. Nulls: a numeric column with nulls comes as float with NaN for
them; a string column's are ``None``. Through ``create_sharded_dataset`` each row is trained exactly
once per epoch, as with any ShardedSource.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np

from coordinator.sources import ShardedSource


def _pq():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError('ParquetSource needs pyarrow: pip install -e ".[parquet]"') from None
    return pq


class ParquetSource(ShardedSource):
    """See the module."""

    def __init__(self, paths: Sequence[str], columns: Sequence[str] | None = None,
                 convert: Callable[[dict], Any] | None = None):
        if isinstance(paths, (str, bytes)) or not paths:
            raise ValueError("paths must be a list of one or more Parquet files")
        pq = _pq()
        self.paths = [os.path.abspath(p) for p in paths]
        self.columns = None if columns is None else list(columns)
        self.convert = convert
        groups = []   # (file index, row group)
        sizes = []
        for i, path in enumerate(self.paths):
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as exc:   # pyarrow's errors: not a file, not Parquet
                raise ValueError(f"cannot read Parquet file {path}: {exc}") from None
            if self.columns is not None:
                have = set(meta.schema.names)
                missing = [c for c in self.columns if c not in have]
                if missing:
                    raise ValueError(f"{path} has no column {missing[0]!r}; it has "
                                     f"{sorted(have)}")
            for g in range(meta.num_row_groups):
                groups.append((i, g))
                sizes.append(meta.row_group(g).num_rows)
        super().__init__(sizes)
        self.groups = tuple(groups)

    def read(self, shard: int, start: int, count: int) -> Any:
        cache = self.__dict__.setdefault("_w_group", {})
        table = cache.get(shard)
        if table is None:
            file, group = self.groups[shard]
            table = _pq().ParquetFile(self.paths[file]).read_row_group(group, columns=self.columns)
            cache.clear()   # one row group kept
            cache[shard] = table
        rows = table.slice(start, count)
        out = {name: _numpy(rows.column(name)) for name in rows.column_names}
        return self.convert(out) if self.convert is not None else out


def _numpy(column) -> np.ndarray:
    import pyarrow as pa
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return np.asarray(column.to_pylist(), dtype=object)
    return column.to_numpy()
