"""Criteo's click logs as a ShardedSource: train the CTR model on real files.

The format of Criteo's display-advertising data sets (the Kaggle challenge,
the 1TB logs): a line per example, tab-separated, 40 fields: the label (0
or 1), 13 integer features (counts, possibly negative; empty when missing)
and 26 categorical ones (hexadecimal hashes; empty when missing). A file is
plain text or gzip (told by its first two bytes, not its name).

``CriteoSource(paths, rows_per_shard=None)`` counts each file's lines once,
where it is made (the coordinator: it must see the files at the paths the
workers see them), and cuts each file into shards of ``rows_per_shard``
lines (default: a shard per file). A worker's ``read(shard, start, count)``
gives a ``coordinator.ctr_data.Batch`` as the generated data's: dense
``log1p(max(count, 0))`` (missing: 0), each categorical value hashed with
its feature (``ctr_data.ids_of``; a missing value is one id of its own per
feature), labels as float32. It keeps one open reader per shard and goes
on where the last read of that shard stopped (a streamed pass reads each
line once); a read anywhere else opens the file again and skips to it. A
line that is not 40 fields of this kind is a ValueError naming its file
and line. Through ``ClusterCoordinator.create_sharded_dataset`` each
example is trained exactly once per epoch, as with any ShardedSource
(coordinator/sharded.py). ``examples/ctr.py --data DIR`` trains from such
files; ``write_criteo`` writes the generated data in this format (tests,
trying it out).
"""
from __future__ import annotations

import gzip
import io
import itertools
import os
from typing import Iterable, Sequence

import numpy as np

from coordinator import ctr_data as D
from coordinator.sources import ShardedSource

FIELDS = 1 + D.NUM_DENSE + D.NUM_SPARSE
_MISSING = np.uint64(0)   # a missing categorical value's rank (values are hash + 1)


def _open_binary(path: str):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def _open(path: str) -> io.TextIOBase:
    return io.TextIOWrapper(_open_binary(path), encoding="ascii", newline="\n")


def count_lines(path: str) -> int:
    """Examples in a file (its lines; a last line without a newline counts)."""
    n, last = 0, b"\n"
    with _open_binary(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


class CriteoSource(ShardedSource):
    """See the module. ``paths``: the files, in order; ``rows_per_shard``:
    lines per shard (None: a shard per file)."""

    def __init__(self, paths: Sequence[str], rows_per_shard: int | None = None):
        if isinstance(paths, (str, bytes)) or not paths:
            raise ValueError("paths must be a list of one or more Criteo files")
        if rows_per_shard is not None and (not isinstance(rows_per_shard, int)
                                           or rows_per_shard < 1):
            raise ValueError(f"rows_per_shard must be an int >= 1 or None, got "
                             f"{rows_per_shard!r}")
        self.paths = [os.path.abspath(p) for p in paths]
        pieces = []   # (file index, first line, lines)
        for i, path in enumerate(self.paths):
            try:
                n = count_lines(path)
            except (OSError, EOFError, UnicodeError) as exc:
                raise ValueError(f"cannot read Criteo file {path}: {exc}") from None
            step = rows_per_shard or max(n, 1)
            pieces += [(i, lo, min(step, n - lo)) for lo in range(0, n, step)]
        if not pieces:
            raise ValueError(f"the Criteo files {self.paths} hold no examples")
        super().__init__([n for *_, n in pieces])
        self.pieces = tuple(pieces)

    def read(self, shard: int, start: int, count: int) -> D.Batch:
        file, first, _ = self.pieces[shard]
        readers = self.__dict__.setdefault("_w_readers", {})   # shard -> (file object, next line)
        f, at = readers.get(shard, (None, -1))
        if f is None or at != start:
            if f is not None:
                f.close()
            f = _open(self.paths[file])
            for _ in itertools.islice(f, first + start):
                pass
        lines = list(itertools.islice(f, count))
        readers[shard] = (f, start + len(lines))
        if len(lines) != count:
            raise ValueError(f"{self.paths[file]} ended at line {first + start + len(lines)}, "
                             f"before the {count} examples asked for (it changed since it "
                             "was counted?)")
        return parse(lines, self.paths[file], first + start + 1)


def parse(lines: Sequence[str], path: str = "<lines>", first_line: int = 1) -> D.Batch:
    """Criteo lines -> Batch (see the module); ValueError naming the bad line."""
    n = len(lines)
    labels = np.empty(n, np.float32)
    counts = np.zeros((n, D.NUM_DENSE), np.float64)
    ranks = np.zeros((n, D.NUM_SPARSE), np.uint64)
    for r, line in enumerate(lines):
        fields = line.rstrip("\r\n").split("\t")
        try:
            if len(fields) != FIELDS:
                raise ValueError(f"{len(fields)} tab-separated fields, not {FIELDS}")
            if fields[0] not in ("0", "1"):
                raise ValueError(f"label {fields[0]!r}, not 0 or 1")
            labels[r] = fields[0] == "1"
            for j, v in enumerate(fields[1:1 + D.NUM_DENSE]):
                if v:
                    counts[r, j] = max(int(v), 0)
            for j, v in enumerate(fields[1 + D.NUM_DENSE:]):
                if v:
                    ranks[r, j] = (int(v, 16) & 0x7FFF_FFFF_FFFF_FFFF) + 1
        except ValueError as exc:
            raise ValueError(f"{path} line {first_line + r} is not a Criteo example: "
                             f"{exc}") from None
    return D.Batch(np.log1p(counts).astype(np.float32), D.ids_of(ranks), labels)


#: Criteo's columns by name, as a Parquet copy of the data has them.
COLUMNS = ["label", *(f"I{j + 1}" for j in range(D.NUM_DENSE)),
           *(f"C{j + 1}" for j in range(D.NUM_SPARSE))]


def from_columns(columns: dict) -> D.Batch:
    """A Batch from Criteo's columns ({name: array}, as ParquetSource reads
    them): ``label`` 0/1, ``I1``..``I13`` numbers (NaN or negative: 0),
    ``C1``..``C26`` hexadecimal strings (None or empty: missing) or integers."""
    missing = [c for c in COLUMNS if c not in columns]
    if missing:
        raise ValueError(f"Criteo columns missing: {missing[:3]}{'...' if len(missing) > 3 else ''}")
    labels = np.asarray(columns["label"], np.float64)
    if not np.isin(labels, (0, 1)).all():
        raise ValueError("Criteo labels must be 0 or 1")
    counts = np.stack([np.asarray(columns[f"I{j + 1}"], np.float64)
                       for j in range(D.NUM_DENSE)], axis=1)
    counts = np.where(np.isnan(counts) | (counts < 0), 0.0, counts)
    ranks = np.zeros((labels.size, D.NUM_SPARSE), np.uint64)
    for j in range(D.NUM_SPARSE):
        col = np.asarray(columns[f"C{j + 1}"])
        if col.dtype.kind in "iu":
            ranks[:, j] = (col.astype(np.int64).view(np.uint64) & np.uint64(0x7FFF_FFFF_FFFF_FFFF)) \
                + np.uint64(1)
        else:
            ranks[:, j] = [(int(v, 16) & 0x7FFF_FFFF_FFFF_FFFF) + 1 if v else 0 for v in col]
    return D.Batch(np.log1p(counts).astype(np.float32), D.ids_of(ranks),
                   labels.astype(np.float32))


def write_criteo(path: str, batches: Iterable[D.Batch], *, compress: bool | None = None,
                 missing: float = 0.0, seed: int = 0) -> int:
    """Write ``batches`` (generated: coordinator.ctr_data.batch) in Criteo's
    format (gzip when ``compress``, default: a path ending in .gz); a
    fraction ``missing`` of the fields left empty. Their categorical values
    are the generated ids' low 32 bits in hexadecimal (so the ids a
    CriteoSource reads are hashes of those, not the generated ids).
    Returns the examples written."""
    compress = path.endswith(".gz") if compress is None else compress
    rng = np.random.default_rng(seed)
    n = 0
    with (gzip.open(path, "wt", encoding="ascii") if compress
          else open(path, "w", encoding="ascii")) as f:
        for b in batches:
            counts = np.expm1(b.dense.astype(np.float64)).round().astype(np.int64)
            cats = (b.sparse.view(np.uint64) & np.uint64(0xFFFF_FFFF))
            for i in range(len(b.labels)):
                gone = rng.random(D.NUM_DENSE + D.NUM_SPARSE) < missing
                dense = ["" if gone[j] else str(c) for j, c in enumerate(counts[i])]
                sparse = ["" if gone[D.NUM_DENSE + j] else f"{int(c):08x}"
                          for j, c in enumerate(cats[i])]
                f.write("\t".join([str(int(b.labels[i])), *dense, *sparse]) + "\n")
            n += len(b.labels)
    return n
