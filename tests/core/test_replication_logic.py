"""Replication's pure logic, without processes: the store's records and
fencing (psserver/core/replication.py), the coordinator's planners
(coordinator/recovery.py) and routing rule (coordinator/routes.py)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from coordinator import recovery, routes
from coordinator.variables import Shard
from psserver.contract import (
    DEMOTE,
    DROP_BACKUP,
    PROMOTE,
    ROLE_BACKUP,
    ROLE_PRIMARY,
    SET_BACKUP,
    Peer,
    SyncSpec,
)
from psserver.core import replication as R
from psserver.core.store import VariableStore
from psserver.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    NotPrimary,
    Unavailable,
)


class LoopbackForwarding(R.Forwarding):
    """Hands records to another in-process store at once (on wake), as the
    forwarder would over the network; ``hold`` keeps them queued instead."""

    def __init__(self, stores: dict[str, VariableStore]):
        self.stores, self.hold = stores, False

    def waker(self, replicator, var, peer):
        def wake():
            if not self.hold:
                self.flush(replicator, var)
        return wake

    def flush(self, replicator, var):
        link = var.link
        if link is None or link.fenced:
            return
        peer = self.stores[link.peer.address]
        if link.needs_state:
            link.state_taken(var.version)
            try:
                peer.create(link.peer.name, var.value.dtype.name, var.value.shape,
                            initial_value=var.value.copy(), optimizer=var.optimizer.name,
                            optimizer_params=var.optimizer.config(),
                            slots={k: v.copy() for k, v in var.slots.items()},
                            version=var.version, sync_steps=var.sync_steps,
                            role=ROLE_BACKUP, epoch=var.epoch, overwrite=True)
                replicator.acknowledged(var, link, link.generation, var.version, R.OK)
            except NotPrimary:
                replicator.acknowledged(var, link, link.generation, var.version, R.FENCED)
            return
        for name, version, status in peer.replicator.replicate(link.records()):
            replicator.acknowledged(var, link, link.generation, version, status)


@pytest.fixture
def pair():
    """Two stores "a" and "b"; w on a is a primary with its backup _w on b."""
    stores = {"a": VariableStore(), "b": VariableStore()}
    fwd = LoopbackForwarding(stores)
    for s in stores.values():
        s.replicator.forwarding = fwd
    stores["a"].create("w", "float32", (4, 2), optimizer="adam",
                       backup=Peer("b", "_w"))
    return stores["a"], stores["b"], fwd


def grad(seed):
    return np.random.default_rng(seed).normal(size=(4, 2)).astype(np.float32)


def test_backup_follows_every_update_exactly(pair):
    a, b, _ = pair
    a.push([("w", grad(1), 11)])
    a.push(sparse=[("w", np.array([3, 0, 3]), grad(2)[:3], 12)])
    a.assign([("w", grad(3))])
    a.push([("w", grad(4), 11)])   # a resend: acknowledged, not applied again
    assert a.meta("w").version == b.meta("_w").version == 3
    assert a.snapshot("w")[1].tobytes() == b.snapshot("_w")[1].tobytes()
    assert b.meta("_w").role == ROLE_BACKUP and a.meta("w").backup == Peer("b", "_w")


def test_backup_refuses_client_updates_and_changes_nothing(pair):
    a, b, _ = pair
    before = b.snapshot("_w")
    for call in (lambda: b.push([("_w", grad(1), 5)]),
                 lambda: b.push(sparse=[("_w", np.array([0]), grad(1)[:1], 6)])[0],
                 lambda: b.assign([("_w", grad(1))])):
        with pytest.raises(NotPrimary, match="backup copy"):
            call()
    after = b.snapshot("_w")
    assert after[0] == before[0] and after[1].tobytes() == before[1].tobytes()


def test_records_apply_in_order_skip_duplicates_and_ask_for_state_on_a_gap(pair):
    a, b, fwd = pair
    fwd.hold = True
    var = a.registry.variable("w")
    with var.lock:   # apply two updates on the primary without waiting for acks
        for i in (1, 2):
            with var.writing():
                var.optimizer.apply_dense(var.value, var.slots, grad(i))
                var.version += 1
            var.record(R.DENSE, grad(i))
    first, second = list(var.link.pending)
    assert b.replicator.replicate([second]) == [("_w", 0, R.NEEDS_STATE)]   # gap: nothing applied
    assert b.meta("_w").version == 0
    # the duplicate skipped
    assert b.replicator.replicate([first, first, second]) == [("_w", 2, R.OK)]
    assert b.replicator.replicate([first]) == [("_w", 2, R.OK)]
    assert b.replicator.replicate([dataclasses.replace(first, name="missing")]) == \
        [("missing", -1, R.NEEDS_STATE)]


def test_malformed_records_are_refused_and_change_nothing(pair):
    a, b, _ = pair
    rec = R.Record("_w", 0, 1, 0, 0, R.DENSE, grad(1))
    bad = [dataclasses.replace(rec, tensor=np.ones((3, 2), np.float32)),
           dataclasses.replace(rec, tensor=np.ones((4, 2), np.int64)),
           dataclasses.replace(rec, tensor=np.full((4, 2), np.nan, np.float32)),
           dataclasses.replace(rec, kind=7),
           dataclasses.replace(rec, version=0),
           dataclasses.replace(rec, kind=R.SPARSE, ids=np.array([9]), tensor=grad(1)[:1]),
           dataclasses.replace(rec, kind=R.SPARSE, ids=np.array([[0]]), tensor=grad(1)[:1])]
    for r in bad:
        with pytest.raises(InvalidArgument):
            b.replicator.replicate([rec, r])   # the good one before it is not applied either
    assert b.meta("_w").version == 0


def test_promoted_backup_fences_its_old_primary(pair):
    a, b, fwd = pair
    a.push([("w", grad(1), 1)])
    b.replicator.promote("_w", epoch=1)
    assert b.meta("_w").role == ROLE_PRIMARY
    b.push([("_w", grad(2), 2)])   # the new primary takes updates (alone: no backup yet)
    with pytest.raises(NotPrimary, match="superseded"):
        a.push([("w", grad(3), 3)])   # applied on the stale copy, refused by the new one
    assert a.meta("w").role == ROLE_BACKUP   # and the stale copy stops taking updates
    with pytest.raises(NotPrimary):
        a.push([("w", grad(4), 4)])
    with pytest.raises(NotPrimary, match="stale"):
        b.replicator.promote("_w", epoch=0)   # an older epoch changes nothing
    # Rebuild: the new primary copies its state over the stale copy, then forwards.
    b.replicator.set_backup("_w", Peer("a", "w"), epoch=2)
    b.push([("_w", grad(5), 5)])
    assert a.meta("w").version == b.meta("_w").version == 3
    assert a.snapshot("w")[1].tobytes() == b.snapshot("_w")[1].tobytes()
    b.push([("_w", grad(5), 1)])   # a key applied before the failover: not applied again
    assert b.meta("_w").version == 3


def test_planned_hand_over_waits_for_the_backup(pair):
    a, b, fwd = pair
    fwd.hold = True
    var = a.registry.variable("w")
    with var.lock:
        with var.writing():
            var.version += 1
        var.record(R.DENSE, grad(1))
    with pytest.raises(DeadlineExceeded):
        a.replicator.demote("w", 1, deadline=_soon())   # its backup has not acknowledged version 1
    assert a.meta("w").role == ROLE_PRIMARY   # still primary, takes updates again
    fwd.hold = False
    with var.lock:   # as the forwarder: acknowledgements are taken under the lock
        fwd.flush(a.replicator, var)
    a.replicator.demote("w", 1, deadline=_soon())
    b.replicator.promote("_w", 1, Peer("a", "w"))
    assert (a.meta("w").role, b.meta("_w").role) == (ROLE_BACKUP, ROLE_PRIMARY)
    assert a.meta("w").version == b.meta("_w").version == 1


def test_dropped_backup_acknowledges_waiting_updates(pair):
    a, b, fwd = pair
    fwd.hold = True
    with pytest.raises(DeadlineExceeded, match="Resend"):
        a.push([("w", grad(1), 1)], deadline=_soon())
    a.replicator.drop_backup("w", 1)
    assert a.push([("w", grad(1), 1)], deadline=_soon()) == [1]   # applied once, now acked


def test_store_without_forwarding_cannot_be_a_replicated_primary():
    s = VariableStore()
    with pytest.raises(FailedPrecondition, match="cannot replicate"):
        s.create("w", "float32", (2,), backup=Peer("b", "_w"))


def test_sync_backup_gathers_but_applies_only_its_primarys_step(pair):
    a, b, _ = pair
    spec = [SyncSpec(0, r, 2, 2) for r in range(2)]
    b.steps.push([("_w", grad(1))], spec[0])   # the client's copy of each push
    b.steps.push([("_w", grad(2))], spec[1])
    assert b.meta("_w").version == 0          # complete, but a backup does not apply it
    a.steps.push([("w", grad(2))], spec[1])    # the primary, in another order
    a.steps.push([("w", grad(1))], spec[0])
    assert a.meta("w").version == b.meta("_w").version == 1
    assert a.meta("w").sync_steps == b.meta("_w").sync_steps == 1
    assert a.snapshot("w")[1].tobytes() == b.snapshot("_w")[1].tobytes()


def test_promoted_backup_completes_the_step_it_gathered(pair):
    a, b, _ = pair
    spec = [SyncSpec(0, r, 2, 2) for r in range(2)]
    a.steps.push([("w", grad(1))], spec[0])
    for r in range(2):
        b.steps.push([("_w", grad(r + 1))], spec[r])
    # The primary dies before replica 1's push reaches it: the backup has the whole step.
    b.replicator.promote("_w", epoch=1)
    assert b.meta("_w").version == 1 and b.meta("_w").sync_steps == 1


def _soon():
    import time
    return time.monotonic() + 0.2


# -- the coordinator's planners ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Meta:
    role: int
    epoch: int = 0
    backup: Peer | None = None


A0, B0 = Shard("a", "w/part_0", 0, 2), Shard("b", "_backup/w/part_0", 0, 2)
B1, A1 = Shard("b", "w/part_1", 2, 2), Shard("a", "_backup/w/part_1", 2, 2)
P, K = ROLE_PRIMARY, ROLE_BACKUP


def copies(c0, o0, c1, o1):
    return [recovery.Copies(A0, B0, c0, o0), recovery.Copies(B1, A1, c1, o1)]


def test_plan_failover_promotes_what_the_lost_server_led_and_drops_what_it_backed():
    pairs = copies(None, Meta(K, 3), Meta(P, 5, Peer("a", A1.name)), None)
    assert recovery.plan_failover(pairs, "a") == [
        recovery.Change("b", B0.name, PROMOTE, 4),
        recovery.Change("b", B1.name, DROP_BACKUP, 6)]
    # Already failed over: nothing more to do; both copies gone: nothing possible.
    assert recovery.plan_failover(copies(None, Meta(P, 4), Meta(P, 6), None), "a") == []
    assert recovery.plan_failover(copies(None, None, None, None), "a") == []


def test_plan_rebuild_gives_every_lone_primary_a_backup_on_the_returned_server():
    pairs = copies(None, Meta(P, 4), Meta(P, 6), Meta(P, 2))   # a returned, stale copies
    assert recovery.plan_rebuild(pairs, "a") == [
        recovery.Change("b", B0.name, SET_BACKUP, 5, Peer("a", A0.name)),
        recovery.Change("b", B1.name, SET_BACKUP, 7, Peer("a", A1.name))]
    # A primary that never moved off the returned server keeps it.
    assert recovery.plan_rebuild(copies(Meta(P, 0, Peer("b", B0.name)), Meta(K, 0), None,
                                        None), "a") == []


def test_plan_failback_hands_the_role_back_in_two_ordered_steps():
    pairs = copies(Meta(K, 5), Meta(P, 5, Peer("a", A0.name)),
                   Meta(P, 0, Peer("a", A1.name)), Meta(K, 0))
    assert recovery.plan_failback(pairs) == [
        (recovery.Change("b", B0.name, DEMOTE, 6),
         recovery.Change("a", A0.name, PROMOTE, 6, Peer("b", B0.name)))]
    # Not while the created copy is not the other's backup yet.
    assert recovery.plan_failback(copies(None, Meta(P, 4), None, None)) == []


@pytest.mark.parametrize("created,other,want", [
    (Meta(P, 0, Peer("b", "x")), Meta(K, 0), routes.Route(False, False)),
    (None, Meta(P, 1), routes.Route(True, True)),
    (Meta(K, 2), Meta(P, 2, Peer("a", "x")), routes.Route(True, False)),
    (Meta(P, 1), Meta(P, 2), routes.Route(True, True)),     # a stale primary loses
    (Meta(P, 3), Meta(P, 2), routes.Route(False, True)),
    (Meta(K, 1), Meta(K, 1), None),                          # a hand-over in progress
    (None, None, None),
])
def test_routes_decide(created, other, want):
    assert routes.decide(created, other) == want


def test_a_reconfigure_with_one_bad_change_changes_nothing(pair):
    """(The fuzzer's find: the first change was applied before the second
    failed.) Every change is checked before any is made."""
    a, b, _ = pair
    before = a.meta("w")
    for bad in [("nope", DROP_BACKUP, 5, None), ("w", 9, 5, None),
                ("w", SET_BACKUP, 5, None), ("w", DROP_BACKUP, 2**62, None)]:
        with pytest.raises((NotFound, InvalidArgument)):
            a.replicator.reconfigure_all([("w", DROP_BACKUP, 5, None), bad])
        assert a.meta("w") == before
    with pytest.raises(NotPrimary):   # a stale epoch, second
        b.replicator.reconfigure_all([("_w", PROMOTE, 3, None), ("_w", DEMOTE, 0, None)])
    assert b.meta("_w").role == ROLE_BACKUP and b.meta("_w").epoch == 0


def test_a_backup_tracks_the_rows_its_primarys_records_change(pair):
    """Issue 33 item 12(f): a backup that did not mark a row-wise record's
    rows would write deltas without them once saves came from it (harmless
    today only because saves come from primaries). It marks exactly those
    rows, and a dense record the whole variable."""
    from psserver.core.tracking import VariableTracker
    a, b, _ = pair
    backup = b.registry.variable("_w")
    backup.tracker = VariableTracker(backup.value.shape)
    backup.tracker.take(1, "s", 0)                       # a save point on the backup
    a.push(sparse=[("w", np.array([3, 0, 3]), grad(2)[:3], 12)])
    changes = backup.tracker.take(2, "s", 1)
    assert not changes.whole and np.flatnonzero(changes.rows).tolist() == [0, 3]
    a.push([("w", grad(1), 13)])
    changes = backup.tracker.take(3, "s", 2)
    assert changes.whole or changes.rows.all()


class _PeerStoreClient:
    """What psserver.serve.forwarder's senders call on a peer, straight on
    an in-process store; counts the Replicate calls and their records."""

    def __init__(self, store: VariableStore):
        self.store, self.calls = store, []

    def replicate(self, records, timeout=None):
        self.calls.append(len(records))
        return self.store.replicator.replicate(list(records))

    def create_variable(self, name, timeout=None, **state):
        self.store.create(name, **state)

    def close(self):
        pass


def test_an_updates_records_go_to_its_backup_in_one_call_sent_by_the_waiting_call():
    """A push of three variables, each with its backup on one peer: one
    Replicate call carries the three records, sent by the push itself (it
    waits for the acknowledgement anyway); the sender's thread is not woken
    for them."""
    from psserver.serve import forwarder as F
    stores = {"a": VariableStore(), "b": VariableStore()}
    client = _PeerStoreClient(stores["b"])
    fwd = F.Forwarder()
    fwd._client = lambda address: client
    stores["a"].replicator.forwarding = fwd
    try:
        for n in ("x", "y", "z"):
            stores["a"].create(n, "float32", (4, 2), optimizer="adam", backup=Peer("b", "_" + n))
        sender = fwd._senders["b"]
        _parked(sender)   # (the backups' state copies woke it: it waits again now)
        woken = []
        real_notify = sender._work.notify
        sender._work.notify = lambda *a: (woken.append(1), real_notify(*a))
        client.calls.clear()
        for i in range(5):
            stores["a"].push([(n, grad(10 * i + k), 100 * i + k + 1)
                              for k, n in enumerate(("x", "y", "z"))])
        assert client.calls == [3] * 5 and woken == []
        for n in ("x", "y", "z"):
            va, vb = stores["a"].snapshot(n), stores["b"].snapshot("_" + n)
            assert va[0] == vb[0] == 5 and va[1].tobytes() == vb[1].tobytes()
        # A push that fails after applying x (y was demoted between the
        # push's checks and its apply) wakes the sender's thread, which
        # brings x's backup up to date by itself.
        y = stores["a"].registry.variable("y")
        checks = []

        def demoted_at_apply():
            checks.append(1)
            if len(checks) > 1:
                raise NotPrimary("y was demoted meanwhile")
        y.check_primary = demoted_at_apply
        with pytest.raises(NotPrimary, match="demoted"):
            stores["a"].push([("x", grad(7), 901), ("y", grad(8), 902)])
        assert woken
        x, bx = stores["a"].registry.variable("x"), stores["b"].registry.variable("_x")
        with bx.lock:
            assert bx.cond.wait_for(lambda: bx.version == 6, timeout=30)
        assert stores["a"].snapshot("x")[1].tobytes() == stores["b"].snapshot("_x")[1].tobytes()
        assert x.version == 6
    finally:
        fwd.stop()


def _parked(sender) -> None:
    """Wait until a forwarder's sender thread waits for work (nothing noted):
    from then on only a notify wakes it."""
    end = time.monotonic() + 30
    while True:
        with sender._work:
            if sender._work._waiters and not sender._dirty:
                return
        assert time.monotonic() < end, "the sender's thread did not go idle"
        time.sleep(0.001)


class _AwayClient(_PeerStoreClient):
    """A peer that takes state copies but then stops answering records."""

    def replicate(self, records, timeout=None):
        raise Unavailable("peer away")


def test_a_backup_on_another_server_gets_its_records_when_the_wait_for_the_first_fails():
    """x's backup is on b, y's on c. b stops answering: the push times out
    waiting for x's, but y's record was sent to c all the same (every
    backup server's sender is told before any wait)."""
    from psserver.serve import forwarder as F
    stores = {k: VariableStore() for k in "abc"}
    clients = {"b": _PeerStoreClient(stores["b"]), "c": _PeerStoreClient(stores["c"])}
    fwd = F.Forwarder()
    fwd._client = lambda address: clients[address]
    stores["a"].replicator.forwarding = fwd
    try:
        stores["a"].create("x", "float32", (4, 2), optimizer="sgd", backup=Peer("b", "_x"))
        stores["a"].create("y", "float32", (4, 2), optimizer="sgd", backup=Peer("c", "_y"))
        for k in "bc":
            _parked(fwd._senders[k])
        clients["b"].__class__ = _AwayClient
        with pytest.raises(DeadlineExceeded):
            stores["a"].push([("x", grad(1), 1), ("y", grad(2), 2)],
                             deadline=time.monotonic() + 1.0)
        by = stores["c"].registry.variable("_y")
        with by.lock:
            assert by.cond.wait_for(lambda: by.version == 1, timeout=30)
        assert stores["c"].snapshot("_y")[1].tobytes() == stores["a"].snapshot("y")[1].tobytes()
    finally:
        fwd.stop()
