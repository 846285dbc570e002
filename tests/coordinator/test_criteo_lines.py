"""Criteo files read as a ShardedSource (coordinator/criteo.py): parsing,
counting, shards, streamed and random reads; no processes."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from coordinator import ctr_data as D
from coordinator.criteo import CriteoSource, count_lines, parse, write_criteo


def line(label: int, ints=(), cats=()) -> str:
    ints = list(ints) + [""] * (13 - len(ints))
    cats = list(cats) + [""] * (26 - len(cats))
    return "\t".join([str(label), *map(str, ints), *cats]) + "\n"


def test_a_line_becomes_the_generated_datas_arrays():
    b = parse([line(1, [3, -2, ""], ["68fd1e64", "", "ffffffff"]), line(0)])
    assert b.labels.dtype == np.float32 and list(b.labels) == [1.0, 0.0]
    np.testing.assert_allclose(b.dense[0, :3], np.log1p([3, 0, 0]).astype(np.float32))
    assert (b.dense[1] == 0).all() and b.dense.shape == (2, 13)
    ranks = np.zeros((2, 26), np.uint64)
    ranks[0, 0], ranks[0, 2] = 0x68FD1E64 + 1, 0xFFFFFFFF + 1   # a missing value: rank 0
    np.testing.assert_array_equal(b.sparse, D.ids_of(ranks))
    assert b.sparse[0, 1] == b.sparse[1, 1] and b.sparse[0, 1] != b.sparse[0, 3]   # per feature


@pytest.mark.parametrize("bad, why", [
    ("1\t2\n", "2 tab-separated fields, not 40"),
    (line(2), "label '2'"),
    (line(1, ["x"]), "invalid literal"),
    (line(1, [], ["zz"]), "invalid literal"),
])
def test_a_bad_line_is_named(bad, why):
    with pytest.raises(ValueError, match=rf"f.tsv line 7 is not a Criteo example: .*{why}"):
        parse([line(0), bad], "f.tsv", 6)


def test_files_plain_or_gzip_by_their_bytes_counted_and_cut_into_shards(tmp_path):
    text = "".join(line(i % 2, [i]) for i in range(10))
    (tmp_path / "a").write_text(text[:-1])                  # no newline at the end
    with gzip.open(tmp_path / "b.txt", "wt") as f:          # gzip, whatever its name
        f.write(text)
    assert count_lines(str(tmp_path / "a")) == 10 == count_lines(str(tmp_path / "b.txt"))
    s = CriteoSource([str(tmp_path / "a"), str(tmp_path / "b.txt")], rows_per_shard=4)
    assert s.shard_sizes == (4, 4, 2, 4, 4, 2)
    first = lambda b: np.expm1(b.dense[:, 0]).round().astype(int).tolist()
    assert first(s.read(4, 0, 2)) == [4, 5]                 # b's second shard
    assert first(s.read(4, 2, 2)) == [6, 7]                 # streamed on
    assert first(s.read(1, 1, 3)) == [5, 6, 7]              # elsewhere: opened again
    assert first(s.read(4, 1, 1)) == [5]                    # back: opened again
    with pytest.raises(ValueError, match="before the 3 examples"):
        s.read(2, 0, 3)
    with pytest.raises(ValueError, match="rows_per_shard"):
        CriteoSource([str(tmp_path / "a")], rows_per_shard=0)
    with pytest.raises(ValueError, match="cannot read Criteo file"):
        CriteoSource([str(tmp_path / "missing")])


def test_written_generated_data_reads_back(tmp_path):
    path = str(tmp_path / "day.gz")
    assert write_criteo(path, [D.batch(0, 0, 64)], missing=0.1) == 64
    b = CriteoSource([path]).read(0, 0, 64)
    want = D.batch(0, 0, 64)
    np.testing.assert_array_equal(b.labels, want.labels)
    kept = b.dense != 0
    np.testing.assert_allclose(b.dense[kept], want.dense[kept], rtol=1e-6)
    assert 0.05 < (b.dense == 0).mean() - (want.dense == 0).mean() < 0.2   # some left empty
