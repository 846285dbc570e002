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
