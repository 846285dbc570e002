"""Criteo files on a real cluster: each example trained exactly once per
epoch through a sharded dataset, and examples/ctr.py --data."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
from coordinator import ctr_data as D
from coordinator.criteo import CriteoSource, write_criteo

pytestmark = pytest.mark.timeout(180)


def _index_of(batch) -> list[int]:   # the examples' own numbers (their first integer)
    return np.expm1(batch.dense[:, 0]).round().astype(int).tolist()


def _seen(it) -> list[int]:
    return _index_of(next(it))


def test_every_example_of_the_files_once_per_epoch(tmp_path):
    files = []
    for k, (n, gz) in enumerate([(230, True), (101, False), (57, True)]):
        path = tmp_path / f"day_{k}"
        text = "".join("\t".join(["1", str(1000 * k + i)] + [""] * 12 + ["a1"] * 26) + "\n"
                       for i in range(n))
        if gz:
            with gzip.open(path, "wt") as f:
                f.write(text)
        else:
            path.write_text(text)
        files.append(str(path))
    want = sorted(1000 * k + i for k, n in enumerate([230, 101, 57]) for i in range(n))
    source = CriteoSource(files, rows_per_shard=64)
    with LocalCluster(num_ps=1, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            ds = coord.create_sharded_dataset(source, batch_size=16)
            for epoch in range(2):
                it = iter(ds)
                got = coord.fetch([coord.schedule(_seen, args=(it,))
                                   for _ in range(ds.batches_per_epoch)])
                seen = sorted(i for batch in got for i in batch)
                assert seen == want, (epoch, len(seen), len(want))


def test_the_ctr_example_trains_from_criteo_files(tmp_path, capsys):
    from examples import ctr
    for k in range(3):   # two to train on, the last held out
        write_criteo(str(tmp_path / f"day_{k}.gz"), (D.batch(0, 10 * k + i, 256)
                                                    for i in range(6)), missing=0.05)
    out = ctr.main(["--data", str(tmp_path), "--epochs", "2", "--batch-size", "256",
                    "--eval-batches", "4", "--verbose", "2"])
    said = capsys.readouterr().out
    assert "epoch 2/2  steps 24/24" in said, said        # 2 files x 6 batches, per epoch
    assert "planted model" not in said and 0.0 < out["auc"] < 1.0
    (tmp_path / "one").mkdir()
    write_criteo(str(tmp_path / "one" / "day"), [D.batch(0, 0, 8)])
    with pytest.raises(SystemExit, match="two or more Criteo files"):
        ctr.main(["--data", str(tmp_path / "one"), "--epochs", "1"])


def test_parquet_files_once_per_epoch_and_criteo_columns(tmp_path):
    """ParquetSource: a shard per row group; through a sharded dataset each
    row once per epoch; Criteo's columns convert to the CTR model's batches
    (nulls as missing), the same as the same examples read as text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from coordinator.criteo import COLUMNS, from_columns, parse
    from coordinator.parquet import ParquetSource
    lines = []
    for i in range(150):
        ints = [str(i), "" if i % 7 == 0 else str(i % 5 - 1)] + [""] * 11
        cats = ["" if i % 3 == 0 else f"{i * 7919:08x}"] * 26
        lines.append("\t".join([str(i % 2), *ints, *cats]) + "\n")
    rows = [ln.rstrip("\n").split("\t") for ln in lines]
    cols = {"label": pa.array([int(r[0]) for r in rows])}
    for j in range(13):
        cols[f"I{j + 1}"] = pa.array([int(r[1 + j]) if r[1 + j] else None for r in rows],
                                     pa.int64())
    for j in range(26):
        cols[f"C{j + 1}"] = pa.array([r[14 + j] or None for r in rows], pa.string())
    table = pa.table({c: cols[c] for c in COLUMNS})
    pq.write_table(table.slice(0, 100), tmp_path / "a.parquet", row_group_size=40)
    pq.write_table(table.slice(100), tmp_path / "b.parquet", row_group_size=40)
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    source = ParquetSource(paths, convert=from_columns)
    assert source.shard_sizes == (40, 40, 20, 40, 10)
    got = source.read(3, 5, 10)                       # rows 105..114
    want = parse(lines[105:115])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="has no column 'nope'"):
        ParquetSource(paths, columns=["nope"])
    with pytest.raises(ValueError, match="cannot read Parquet file"):
        ParquetSource([str(tmp_path)])
    plain = ParquetSource(paths, columns=["I1"])
    with LocalCluster(num_ps=1, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            ds = coord.create_sharded_dataset(plain, batch_size=16)
            it = iter(ds)
            got = coord.fetch([coord.schedule(_first_ints, args=(it,))
                               for _ in range(ds.batches_per_epoch)])
    assert sorted(i for batch in got for i in batch) == list(range(150))


def _first_ints(it) -> list[int]:
    return [int(v) for v in next(it)["I1"]]
