"""Dynamic embedding tables over the parameter servers: ``DynamicEmbedding``.

A table keyed by any int64 (hashes of feature strings), its keys spread
over every parameter server by a hash of the key (psserver.contract.keys:
a bucket of its hash, and each bucket's shard), each server holding its
shard (psserver/core/table_store.py: admission, eviction, the optimizer's
slots).
``ParameterServerStrategy.create_embedding_table`` makes one.

Like a ShardedVariable, a ``DynamicEmbedding`` is a small picklable
description that travels inside step closures to the workers and works the
same there: ``lookup(keys)`` returns dense rows (zeros for keys without a
row: not admitted yet, or evicted), and ``push_gradient(keys, grads)``
applies row gradients (duplicates summed) with the table's optimizer, both
one call per server, all at once. A step reads and pushes a table with its
variables in the same call to each server: ``read_variables([Lookup(table,
keys), w])`` and ``push_gradients([(table, IndexedSlices(rows, keys)),
(w, g)])`` (coordinator/step_calls.py).

Every call is resent after a lost connection or a failover, as a
variable's (coordinator/ps_pool.py): an update with its update key, so it
applies once; a look-up is made again (it may count its keys twice for
admission). With ``replication=True`` each shard has a backup on the next
parameter server (table name ``_backup/<name>`` there), which follows
every change its primary makes; calls go to whichever copy is primary now
(coordinator.routes). Admission counters of keys not admitted yet, and
look-up statistics, are the primary's alone (after a failover such a key
counts again from zero).

Modes (coordinator.replica): in a sync step, look-ups wait for the
previous step on each shard, and every shard gets this replica's update
(an empty one counts), gathered with the other replicas' and applied once
(their sum, or mean: the strategy's aggregation) when the step is complete
(psserver/serve/tables.py); with replication both copies get it. In async,
bounded and hybrid modes look-ups never wait and updates apply on arrival.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from coordinator import layouts
from coordinator.ps_pool import client_for, servers
from coordinator.step_calls import IndexedSlices, Lookup, _Push, _Read
from psserver.contract import (
    BACKUP_PREFIX,
    ROLE_PRIMARY,
    SET_BACKUP,
    TABLE_PREFIX,
    Peer,
)
from psserver.contract.keys import BucketMap, split_capacity
from psserver.errors import AlreadyExists, PSError
from psserver.link.pending import Pending


@dataclasses.dataclass(frozen=True)
class TableShard:
    """One copy of a table shard: the server, and its replication name
    (TABLE_PREFIX + its table name there), as coordinator.routes and
    coordinator.recovery take a variable's Shard."""
    address: str
    name: str

    @property
    def table(self) -> str:
        return self.name[len(TABLE_PREFIX):]


@dataclasses.dataclass(frozen=True)
class TableStats:
    """A table's counters summed over its shards (protos tables.proto TableInfo)."""
    rows: int
    lookups: int
    hits: int
    admitted: int
    not_admitted: int
    evicted_capacity: int
    evicted_age: int
    updated: int
    dropped: int
    bytes: int
    late: int = 0   # sync mode: updates dropped whole (their step was applied, their
                    # replica abandoned, or the replica's second)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclasses.dataclass(frozen=True)
class DynamicEmbedding:
    """Table ``name`` with rows of ``dim`` values of ``dtype``, sharded over
    ``addresses``: key k lives on addresses[buckets.shard_of(k)]
    (psserver.contract.keys: a bucket of its hash, each bucket a shard's;
    ``BucketMap.even`` unless given). ``capacity``: the whole table's (0:
    none), each shard holding its part (create_embedding_table)."""

    name: str
    dim: int
    dtype: str
    addresses: tuple[str, ...]
    optimizer: str = "sgd"
    replicated: bool = False
    capacity: int = 0
    buckets: BucketMap | None = None
    # Which layout ``addresses`` and ``buckets`` are (coordinator/layouts.py:
    # adding a server moves buckets, and a description learns the new layout
    # in place), and the table's identity in every copy of its description.
    layout_epoch: int = 0
    table_id: str = ""
    origin_shards: int = 0   # shards when created (0: as many as addresses)

    def __hash__(self) -> int:   # (not of the layout: a description learns a new one in place)
        return hash((self.name, self.table_id))

    def __post_init__(self):
        if self.buckets is None:
            object.__setattr__(self, "buckets", BucketMap.even(len(self.addresses)))
        elif self.buckets.num_shards != len(self.addresses):
            raise ValueError(f"table {self.name!r}: a bucket map of {self.buckets.num_shards} "
                             f"shard(s) for {len(self.addresses)} address(es)")

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def shards(self) -> tuple[TableShard, ...]:
        """Each shard's copy that was created primary."""
        return tuple(TableShard(a, TABLE_PREFIX + self.name) for a in self.addresses)

    @property
    def backups(self) -> tuple[TableShard, ...]:
        """With replication, each shard's other copy, on the next server."""
        if not self.replicated:
            return ()
        n = len(self.addresses)
        return tuple(TableShard(self.addresses[(i + 1) % n],
                                TABLE_PREFIX + BACKUP_PREFIX + self.name) for i in range(n))

    def primaries(self) -> list[TableShard]:
        """Each shard's copy that takes calls now (the created one, unless a
        failover moved it: coordinator.routes)."""
        if not self.replicated:
            return list(self.shards)
        return servers().routes.primaries(self)

    #: read_variables and push_gradients tell a table from a variable by this.
    is_table = True

    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        """The shard of each int64 key."""
        return self.buckets.shard_of(keys)

    @property
    def row_bytes(self) -> int:
        return self.dim * np.dtype(self.dtype).itemsize

    def lookup(self, keys, *, admit: bool = True) -> np.ndarray:
        """Rows of ``keys`` (int64, any shape): shape keys.shape + (dim,).
        ``admit=False`` (evaluation): no key is counted, admitted or evicted.
        Each distinct key is sent once, with how often it occurs (admission
        and the statistics count every occurrence)."""
        return self.lookup_async(keys, admit=admit).result()

    def lookup_async(self, keys, *, admit: bool = True) -> Pending:
        """lookup, sent now; ``result()`` waits for the rows (a step reads
        its dense variables meanwhile), resending a call that met a lost or
        failed-over server."""
        read = _Read([Lookup(self, keys, admit)])
        return servers().start(read.plan).then(lambda got: read.finish(got)[0])

    def push_gradient(self, keys, grads) -> tuple[int, int]:
        """Apply row gradients ``grads[i]`` of ``keys[i]`` (duplicates summed
        here, each distinct key sent once); (rows updated, distinct keys
        whose gradient was dropped: they have no row). In a sync step the
        rows are updated once the step is complete: the counts are those of
        the steps this update completed on some shard (else 0)."""
        return self.push_gradient_async(keys, grads).result()

    def push_gradient_async(self, keys, grads, *, unique=None) -> Pending:
        """push_gradient, sent now; ``result()`` waits for the servers (a step
        pushes its dense gradients meanwhile), resending a call that met a
        lost or failed-over server. Keys this thread last looked up in this
        table are not sorted again (``unique``: ignored, from older callers)."""
        push = _Push([(self, IndexedSlices(np.asarray(grads), keys))])
        pool = servers()
        return pool.start(lambda: push.plan(pool.routes)).then(_Push.table_counts)

    def stats(self) -> TableStats:
        """Counters summed over the shards (rows, admissions, evictions, hits...),
        of the copies that are primary now."""
        pool = servers()
        infos = [pool.client(c.address).table_info(c.table) for c in self.primaries()]
        return TableStats(**{f.name: sum(getattr(i, f.name) for i in infos)
                             for f in dataclasses.fields(TableStats)})

    def __len__(self) -> int:
        return self.stats().rows


def make_shards(table: DynamicEmbedding, creations: list, parts: list, note_server) -> None:
    """Each server's shard of ``table`` made, or adopted where it exists with
    the same spec (its capacity aside: parts a restore moved between the
    shards are the table's as long as they sum to ``table.capacity``;
    AlreadyExists otherwise). ``creations``: (address, create_table's
    keywords) per shard; ``parts``: the capacities asked; ``note_server``
    is told each address (watched from then on). With replication each
    primary copies itself to its backup. All or nothing: a call that fails
    deletes the shards (and backups) it made."""
    made = []   # indices of the shards this call made
    held = []   # each shard's capacity as its server has it
    infos = []   # (their layouts: servers were added or drained, coordinator/elastic.py)
    try:
        for i, (addr, kw) in enumerate(creations):
            try:
                info = client_for(addr).create_table(table.name, table.dim, **kw)
                made.append(i)
            except AlreadyExists:   # adopted (same spec), or an error saying it differs;
                # its own admission seed kept (``seed * n + i`` of the n it was made over)
                kw["seed"] = int(client_for(addr).table_info(table.name).spec.seed)
                info = client_for(addr).create_table(table.name, table.dim,
                                                     exist_ok=True, **kw)
            held.append(info.spec.capacity)
            infos.append(info)
            note_server(addr)   # watched: a restart or a loss is noticed
        newest = layouts.newest(infos)
        if newest is not None:   # (a coordinator made again: the table as the moves left it)
            held = _held_by(table, newest, creations, held, note_server)
        elif 0 < len(made) < len(creations) and _made_over_fewer(table, creations, made, held):
            held, parts = _as_made(table, creations, made, held)
        if not (held == parts or (0 not in held and sum(held) == table.capacity)
                or not (table.capacity or any(held))):   # (0: no limit, on every shard)
            raise AlreadyExists(
                f"dynamic table {table.name!r} exists with capacity "
                f"{0 if 0 in held else sum(held)} over its servers, not {table.capacity}; "
                "delete it first, or create it with the capacity it has")
        if newest is not None:
            layouts.learn(table, newest)
        if table.replicated:   # each primary copies itself to its backup on the next server
            for c, b in zip(table.shards, table.backups):
                meta = client_for(c.address).get_meta(c.name)
                if meta.role == ROLE_PRIMARY and meta.epoch == 0 and meta.backup is None:
                    client_for(c.address).reconfigure(
                        [(c.name, SET_BACKUP, 0, Peer(b.address, b.name))])
            # adopted: it may have failed over
            servers().refresh([(table, k) for k in range(table.num_shards)])
    except BaseException:   # each made shard, and its backup if one was copied yet
        for i in made:
            for copy in (table.shards[i], *table.backups[i:i + 1]):
                try:
                    client_for(copy.address).delete_table(copy.table)
                except PSError:
                    pass
        raise


def _held_by(table: DynamicEmbedding, layout, creations: list, held: list,
             note_server) -> list:
    """The capacities of the shards ``layout`` names (a table servers were
    added to or drained from: coordinator/elastic.py), in its order: those
    of ``creations`` (``held``: each one's), and those of servers only the
    layout names (the cluster spec was not changed with the moves), whose
    creation is added to ``creations`` (recovery recreates them as the
    others) and which ``note_server`` is told (watched)."""
    have = {a: h for (a, _), h in zip(creations, held)}
    for address in layout.addresses:
        if address not in have:
            note_server(address)   # (one of the job's servers from now on)
            spec = client_for(address).table_info(table.name).spec
            have[address] = spec.capacity
            creations.append((address, dict(creations[-1][1], capacity=spec.capacity,
                                            seed=int(spec.seed))))
    return [have[a] for a in layout.addresses]


def _made_over_fewer(table: DynamicEmbedding, creations: list, made: list,
                     held: list) -> bool:
    """Whether a table no move changed, found on some of the spec's servers
    and just made on the others (``made``), was made over those it was found
    on: the cluster spec grew since (not: one of its servers lost its shard).
    Only where the shards found say so: their capacities sum to the table's
    (each holds its part of a table made over them), or their admission
    seeds are ``seed * k + i`` of k servers with a seed other than 0. Else
    (the default seed and no capacity: nothing tells) the table is taken
    over every server, as always (a lost shard refilled by a checkpoint
    restore; a spec that grew serves wrong rows: make the coordinator with
    the spec the table was made over, then add the others)."""
    found = [i for i in range(len(creations)) if i not in made]
    if table.capacity:
        parts = [held[i] for i in found]
        return 0 not in parts and sum(parts) == table.capacity
    base, k = int(creations[0][1]["initializer"].seed), len(found)
    return base != 0 and sorted(int(creations[i][1]["seed"]) for i in found) == \
        [base * k + i for i in range(k)]


def _as_made(table: DynamicEmbedding, creations: list, made: list, held: list
             ) -> tuple[list, list]:
    """A table no move changed, made over fewer servers than the spec lists
    now (_made_over_fewer), adopted over those, in the order it was made over
    them (each shard's admission seed is ``seed * k + i``: sorted by it), not
    over the spec's servers as they are now (keys would be looked for on
    shards that never held them). The shards this call made on the others
    are deleted (adding a server is add_parameter_server's, or the
    follower's: coordinator/ps_follow.py). Returns (held, parts) of the
    shards kept; ``creations`` and ``made`` are brought to them."""
    keep = sorted((i for i in range(len(creations)) if i not in made),
                  key=lambda i: creations[i][1]["seed"])
    for i in list(made):
        try:
            client_for(creations[i][0]).delete_table(table.name)
        except PSError:   # (an empty shard left behind: refuses nothing, holds nothing)
            pass
        made.remove(i)
    table.__dict__.update(addresses=tuple(creations[i][0] for i in keep),
                          buckets=BucketMap.even(len(keep)), origin_shards=len(keep))
    held = [held[i] for i in keep]
    creations[:] = [creations[i] for i in keep]
    return held, split_capacity(table.capacity, table.buckets.counts())
