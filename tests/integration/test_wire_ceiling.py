"""bench/wire_ceiling.py, the suite's bare-socket reference for (a): its
servers and workers are real processes, its reads land in the workers'
parameters and its pushes are applied (the loss falls as the MLP learns),
and every step moves the bytes of the shards the layout names."""
import numpy as np
import pytest

from bench.wire_ceiling import layout_of, running

pytestmark = pytest.mark.timeout(60)

SIZES = (784, 64, 10)
LOCAL = ("127.0.0.1", [])


def test_the_bare_step_learns_with_its_shards_split_over_two_servers():
    # kernel 0 split by rows over both servers, as a partitioner would
    shards = [[[0, 0, 400], [1, 0, 1]], [[0, 400, 384], [2, 0, 64], [3, 0, 1]]]
    with running(SIZES, shards, 0.1, [LOCAL, LOCAL], [LOCAL, LOCAL]) as wc:
        losses = []
        for _ in range(6):
            assert wc.run(40) > 0
            losses.append(np.mean(wc.losses))
    # the labels are random, so it memorizes: slowly, but every block lower
    assert losses[-1] < losses[0] - 0.05, losses


def test_a_server_that_holds_nothing_updates_nothing():
    # one server holds every parameter; the other is asked for no bytes
    shards = [[[0, 0, 784], [1, 0, 1], [2, 0, 64], [3, 0, 1]], []]
    with running(SIZES, shards, 0.1, [LOCAL, LOCAL], [LOCAL]) as wc:
        first = wc.run(30) and wc.losses[0]
        for _ in range(4):
            wc.run(30)
        assert wc.losses[0] < first


def test_layout_of_names_each_servers_shards_in_order():
    class Shard:
        def __init__(self, address, offset, rows):
            self.address, self.offset, self.rows = address, offset, rows

    class Var:
        def __init__(self, *shards):
            self.shards = shards

    variables = [Var(Shard("a", 0, 5), Shard("b", 5, 4)), Var(Shard("b", 0, 1)),
                 Var(Shard("a", 0, 3))]
    assert layout_of(variables, ["a", "b"]) == [[[0, 0, 5], [2, 0, 3]], [[0, 5, 4], [1, 0, 1]]]
