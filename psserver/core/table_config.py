"""A dynamic table's configuration, counters and limits (the table itself:
psserver/core/dynamic_table.py, which says what each setting does)."""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from psserver.contract import Initializer
from psserver.contract.optimizers import make_optimizer
from psserver.core.variable import check_initializer
from psserver.errors import InvalidArgument

EVICTION_POLICIES = ("lru", "lfu")
#: Bytes a row costs beyond its values and per-row slots: the upper figure of
#: the per-key overhead (index slots and bookkeeping: dynamic_table.py).
ROW_OVERHEAD = 104


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """How a dynamic table admits and evicts rows (psserver/core/dynamic_table.py).

    ``capacity`` 0: no limit; ``max_age_steps`` / ``max_age_seconds`` 0: no
    age limit; ``admission_capacity``: keys the admission counter remembers
    (0: 4 x capacity, or 1M without a capacity)."""
    dim: int
    dtype: str = "float32"
    initializer: Initializer = Initializer()
    min_count: int = 1
    probability: float = 1.0
    capacity: int = 0
    policy: str = "lru"
    max_age_steps: int = 0
    max_age_seconds: float = 0.0
    admission_capacity: int = 0
    seed: int = 0

    def check(self) -> "TableConfig":
        """This config, or InvalidArgument saying what to change."""
        def bad(what):
            raise InvalidArgument(f"dynamic table: {what}")
        if not isinstance(self.dim, int) or not 1 <= self.dim <= 1 << 16:
            bad(f"dim must be an integer from 1 to 65536, got {self.dim!r}")
        if self.dtype not in ("float32", "float64"):
            bad(f"dtype must be float32 or float64, got {self.dtype!r}")
        if not isinstance(self.min_count, int) or not 1 <= self.min_count <= 1 << 30:
            bad(f"min_count must be an integer >= 1 (1: admit on first sight), "
                f"got {self.min_count!r}")
        if not (isinstance(self.probability, (int, float)) and 0 < self.probability <= 1):
            bad(f"probability must be in (0, 1], got {self.probability!r}")
        for name in ("capacity", "max_age_steps", "admission_capacity"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 <= v < 1 << 40:
                bad(f"{name} must be an integer >= 0 (0: no limit), got {v!r}")
        if not (isinstance(self.max_age_seconds, (int, float))
                and math.isfinite(self.max_age_seconds) and self.max_age_seconds >= 0):
            bad(f"max_age_seconds must be a finite number >= 0 (0: no limit), "
                f"got {self.max_age_seconds!r}")
        if self.policy not in EVICTION_POLICIES:
            bad(f"policy must be one of {list(EVICTION_POLICIES)}, got {self.policy!r}")
        try:
            check_initializer(self.initializer)
        except InvalidArgument as exc:
            bad(str(exc))
        return self


def row_bytes(dim: int, dtype, row_slots: int) -> int:
    """Bytes a row of ``dim`` ``dtype`` values costs with ``row_slots``
    per-row optimizer slots and its bookkeeping (ROW_OVERHEAD): what
    admitting or importing one row may add to a shard."""
    return dim * np.dtype(dtype).itemsize * (1 + row_slots) + ROW_OVERHEAD


@dataclasses.dataclass
class TableStats:
    """A shard's counters (its rows: len(table))."""
    lookups: int = 0          # keys looked up
    hits: int = 0             # ... that had a row
    admitted: int = 0         # rows created
    not_admitted: int = 0     # look-ups answered with the default row
    evicted_capacity: int = 0
    evicted_age: int = 0
    updated: int = 0          # rows a gradient changed
    dropped: int = 0          # gradient rows for keys without a row, dropped

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


#: The most occurrences one look-up may say a key had.
MAX_COUNT = 1 << 31


def check_counts(keys: np.ndarray, counts) -> np.ndarray:
    """Look-up ``counts`` as int64: integers in [1, MAX_COUNT] of the keys'
    shape; InvalidArgument otherwise."""
    a = np.asarray(counts)
    if a.shape != keys.shape or a.dtype.kind not in "iu" or \
            (a.size and (a.min() < 1 or a.max() > MAX_COUNT)):
        raise InvalidArgument(f"look-up counts must be integers in [1, 2**31] of the keys' "
                              f"shape {list(keys.shape)}, got {a.dtype} {list(a.shape)}")
    return a.astype(np.int64, copy=False)


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """A table as its creator described it (tables.proto TableSpec): ``given``,
    its TableConfig fields exactly as sent (unchecked: 0 and "" ask for the
    defaults, which ``config`` fills in), and the rows' optimizer, so that a
    shard's spec reads back (TableInfo, its backup's copy, a checkpoint's
    metadata) as it was sent. ``config`` and ``make_optimizer`` check it
    (InvalidArgument)."""
    given: TableConfig
    optimizer: str = ""
    optimizer_params: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def config(self) -> TableConfig:
        """The TableConfig this spec asks for; InvalidArgument saying what is wrong."""
        given = self.given
        init = dataclasses.replace(given.initializer, kind=given.initializer.kind or "zeros")
        check_initializer(init)
        kind = init.kind
        dtype = given.dtype or "float32"
        if dtype in ("float32", "float64"):   # else TableConfig.check names the dtype
            largest = float(np.finfo(dtype).max)
            reach = {"constant": abs(init.value),
                     "random_uniform": max(abs(init.minval), abs(init.maxval)),
                     "random_normal": abs(init.mean) + 40 * init.stddev,
                     "truncated_normal": abs(init.mean) + 2 * init.stddev}.get(kind, 0.0)
            if not reach < largest:
                raise InvalidArgument(f"initializer {kind} would make values beyond {dtype}'s "
                                      "range (Inf); give smaller parameters")
        return dataclasses.replace(
            given, dtype=dtype, initializer=init, min_count=given.min_count or 1,
            probability=given.probability or 1.0, policy=given.policy or "lru").check()

    def with_capacity(self, capacity: int) -> "TableSpec":
        """This spec with another capacity (a shard's part of the table's)."""
        return dataclasses.replace(self, given=dataclasses.replace(self.given, capacity=capacity))

    def make_optimizer(self):
        """The optimizer of the table's rows; InvalidArgument for a bad one."""
        try:
            return make_optimizer(self.optimizer or "sgd", dict(self.optimizer_params))
        except ValueError as exc:
            raise InvalidArgument(f"table optimizer: {exc}") from None
