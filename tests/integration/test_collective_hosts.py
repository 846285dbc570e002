"""The ring (and the direct) all-reduce across test hosts (bench/hosts.py): each worker on a
host of its own, the chunks over the data port with mutual TLS and the
token, and the bytes each member's socket sent to the next member read from
the kernel (``ss``: tcp_info's bytes_acked, the payload the next host
took, counted once however often TCP sent it)."""
from __future__ import annotations

import host_gate
import numpy as np
import pytest
from test_collective import _data, _on_all, member_direct_on_host, member_on_host

from bench import hosts
from coordinator import LocalCluster

pytestmark = host_gate.marks(240)

SIZE = 3_000_001   # float32: 12 MB, chunks of several pieces for n = 2
# (member_on_host lives in test_collective: the workers import the module of
# the function they run, and this one makes test hosts at import.)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_across_hosts_each_member_sends_2_n_minus_1_over_n_at_its_socket(n):
    with hosts.TestHosts(n + 1) as h, \
            LocalCluster(1, n, placement=h.placement(ps=[n], worker=range(n))) as cluster:
        assert cluster.tls is not None and all(w.address.startswith("198.18.")
                                               for w in cluster.workers)
        got = _on_all(cluster, member_on_host, SIZE)
    want = sum(_data(7, r, SIZE, "float32", True) for r in range(n))
    payload = 4 * SIZE * 2 * (n - 1) / n
    for rank, (out, framed, sent) in enumerate(got):
        np.testing.assert_array_equal(out, want)
        # the chunks, each piece's few bytes of framing, TLS's records and
        # handshake, and the next worker's WorkerInfo call (the route's plan)
        assert payload <= framed <= sent <= payload * 1.01 + (64 << 10), (rank, framed, sent)


@pytest.mark.parametrize("n", [3, 4])
def test_across_hosts_the_direct_all_reduce_sends_2_n_minus_1_over_n_over_all_its_links(n):
    """The direct variant: the same bytes a member as the ring's, to every
    other member's host (its chunks, then its sum), summed the same on each."""
    size = 200_003   # 0.8 MB: what choose_algorithm gives the direct one
    with hosts.TestHosts(n + 1) as h, \
            LocalCluster(1, n, placement=h.placement(ps=[n], worker=range(n))) as cluster:
        got = _on_all(cluster, member_direct_on_host, size)
    want = sum(_data(7, r, size, "float32", True) for r in range(n))
    payload = 4 * size * 2 * (n - 1) / n
    for rank, (out, framed, sent) in enumerate(got):
        np.testing.assert_array_equal(out, want)
        assert out.tobytes() == got[0][0].tobytes()
        # as above, with a probe and the route's plan to each member
        assert payload <= framed <= sent <= payload * 1.01 + (n - 1) * (64 << 10), \
            (rank, framed, sent)
