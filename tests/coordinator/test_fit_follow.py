"""fit's all-reduce epochs over a sharded dataset (coordinator/fit.py
``_steps_left``): pure logic on a real ShardedDataset's dispatch, with a
stand-in coordinator (join, replicas_in_sync)."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.fit import _steps_left
from coordinator.sharded import ShardedDataset, ShardedSource


class _Coordinator:
    def __init__(self, members: int):
        self.members, self.joins = members, 0

    def join(self):
        self.joins += 1

    def replicas_in_sync(self) -> int:
        return self.members


def test_steps_left_cover_the_batches_left_and_a_round_that_trains_none_is_an_error():
    ds = ShardedDataset("d", ShardedSource.from_arrays(np.arange(40), shard_sizes=[40]), 4,
                        "exactly_once", False)   # 10 batches
    coord = _Coordinator(3)
    assert _steps_left(coord, ds, 0) == 4 and coord.joins == 1   # 10 over 3, up
    taken = [ds.take("w0") for _ in range(7)]
    for b in taken[:6]:
        ds.ack(b)   # (the 7th is held: its closure never ended)
    coord.members = 2
    assert _steps_left(coord, ds, 0, left_before=10) == 2   # 4 left over 2
    with pytest.raises(RuntimeError, match="4 batches of data epoch 0 stay unacknowledged"):
        _steps_left(coord, ds, 0, left_before=4)   # a round that trained none of them
    for b in [taken[6]] + [ds.take("w0") for _ in range(3)]:
        ds.ack(b)
    assert ds.unacknowledged(0) == 0 and _steps_left(coord, ds, 0, left_before=4) == 0
    assert ds.unacknowledged(1) == 10   # (an epoch not begun: all of it)
