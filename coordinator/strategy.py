"""ParameterServerStrategy: where variables live and how they are split.

As in TensorFlow, the strategy owns variable creation: each variable is split
along axis 0 by the ``variable_partitioner`` and its shards are placed on the
parameter servers round-robin, in creation order. Training itself is driven
by a ``ClusterCoordinator`` built on the strategy.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from coordinator import elastic, ps_pool, step_calls, variable_moves
from coordinator import variables as V
from coordinator.cluster_spec import (
    ClusterConfigError,
    ClusterSpec,
    TFConfigClusterResolver,
)
from coordinator.diagnose import CONNECT_SECONDS
from coordinator.embedding import DynamicEmbedding, make_shards
from coordinator.partitioners import Partitioner, num_shards_of, shard_row_offsets
from psserver.contract import (
    BACKUP_PREFIX,  # backup shards: "_backup/<shard name>"
    TOKEN_ENV,
    Initializer,
    Peer,
    SyncSpec,
)
from psserver.contract.initializers import one_seed, resolve_initializer
from psserver.contract.keys import BucketMap, split_capacity
from psserver.errors import AlreadyExists, DeadlineExceeded, PSError, Unavailable
from psserver.tls import TLSConfig

MODES = ("async", "sync", "hybrid", "bounded", "allreduce")
#: The modes whose scheduled steps run as num_replicas closures of one step.
SYNC_MODES = ("sync", "hybrid")

#: Initializers computed from the full (unsharded) shape, then sent to each shard
#: as a server-side kind. Others ("zeros", "random_normal", ...) are the servers'.
_FAN_INITIALIZERS = ("glorot_uniform", "he_normal")


def _as_resolver(cluster: Any):
    if cluster is None:
        return TFConfigClusterResolver()
    if hasattr(cluster, "cluster_spec"):
        return cluster
    if isinstance(cluster, Mapping):
        return ClusterSpec.from_dict(cluster.get("cluster", cluster))
    raise ClusterConfigError(
        f"cannot describe a cluster with {type(cluster).__name__}: pass a ClusterSpec, "
        "a LocalCluster's .spec, a cluster dict, or nothing to read TF_CONFIG")


class ParameterServerStrategy:
    """Variables sharded over parameter servers; steps run by workers.

    Args:
      cluster_resolver: a ``ClusterSpec`` (e.g. ``LocalCluster.spec``), any
        object with ``cluster_spec()``, a TF_CONFIG-style dict, or None to read
        TF_CONFIG / TF_CONFIG_FILE from the environment.
      variable_partitioner: a callable ``(shape, dtype) -> [num_shards, 1, ...]``
        such as ``MinSizePartitioner``; None keeps every variable whole.
      token: the cluster's auth token; defaults to the spec's (LocalCluster
        makes one) or ``$PSTRAIN_AUTH_TOKEN``.
      tls: a psserver.tls.TLSConfig; defaults to the spec's (LocalCluster
        makes one) or ``$PSTRAIN_TLS_*``; None of those: plaintext.
      mode: how workers' gradients meet the parameters:

        * ``"async"`` (default): each push is applied as it arrives
          (ParameterServerStrategy's behaviour).
        * ``"sync"``: synchronous data parallelism (MirroredStrategy,
          MultiWorkerMirroredStrategy; with one parameter server,
          CentralStorageStrategy). Each scheduled step runs as
          ``num_replicas`` closures, one per replica; every variable waits
          for the step's gradients, combines them (``aggregation``) and
          applies its optimizer once; reads of the next step wait for that.
          Dynamic embedding tables too: each shard sums (or averages) the
          step's row gradients and applies them once; look-ups of the next
          step wait for that.
        * ``"hybrid"``: dense variables as in ``"sync"`` (num_replicas
          closures per step, one combined update per step, backup_workers,
          step_timeout, dead replicas abandoned); embedding tables as in
          ``"async"`` (Persia's and TFRA's half-sync training): row-wise
          gradients (``IndexedSlices``, ``push_sparse``, and every dynamic
          table's) are applied on arrival, each replica's push on its own
          with its update key (the optimizer runs once per push), and
          table look-ups never wait for the step. A variable is dense or a
          table by its gradients (a worker refuses the other kind for it:
          ValueError; what is not caught, and abandoned replicas' row
          gradients: docs/training-modes.md "Hybrid mode, precisely").
        * ``"bounded"``: asynchronous, but no worker starts a step more than
          ``staleness`` steps ahead of the slowest live worker (stale
          synchronous parallel). 0 runs the workers in lock-step; a large
          value is plain async.
        * ``"allreduce"``: synchronous data parallelism without servers in
          the path (MultiWorkerMirroredStrategy, Horovod): every variable
          is mirrored on every worker (coordinator/mirrored.py), each
          scheduled step runs on all the workers of the cluster spec at
          once (replica r on worker r), and its push averages the
          replicas' gradients by a ring all-reduce among them
          (``aggregation``; ``gradient_compression="fp16"`` halves its
          bytes), each worker then applying the optimizer itself. The
          cluster needs no parameter servers. ``step_timeout``: seconds a
          step's all-reduce may take. Read the trained values with
          ``ClusterCoordinator.replica_values``. Embedding tables stay
          on the parameter servers, their row-wise gradients applied on
          arrival as in ``"hybrid"``. Elastic (coordinator/gang.py): a
          worker lost, joining or restarted re-forms the ring (lost:
          the step runs again). Sharded datasets: a batch a worker.
      num_replicas: sync and hybrid modes: replicas per step (default: the
        number of workers in the cluster spec now). Replicas are slices of
        the global batch, not processes: any worker may run any replica.
      backup_workers: sync and hybrid modes: a step completes once
        ``num_replicas - backup_workers`` replicas pushed; later gradients
        of that step are dropped and counted
        (``VariableMeta.dropped_gradients``, ``TableStats.late``).
      aggregation: sync and hybrid modes: ``"mean"`` (default) averages the
        replicas' gradients, right for per-replica mean losses; ``"sum"``
        adds them, right for losses already scaled by the global batch size
        as ``tf.nn.compute_average_loss`` does.
      step_timeout: sync and hybrid modes: seconds after a step's first
        gradient after which the step is applied with the gradients that
        arrived (a replica that hangs). A replica whose worker dies is
        abandoned at once. 0: wait for every replica.
      staleness: bounded mode: the bound s (required).
      replication: keep a backup of every shard on the next parameter server
        (chain replication, psserver/core/replication.py): a push goes to the
        shard's primary, which applies it, forwards exactly what it applied to
        the backup, and acknowledges once the backup has it (bit-identical
        copies), so losing one parameter server loses no acknowledged update:
        the backups take over at once (coordinator/recovery.py). Twice the
        memory, one more hop per push; two or more parameter servers.
      reuse_existing: a coordinator that restarts while its parameter
        servers keep running: ``create_variable`` adopts a variable of the
        same name, shape, dtype and optimizer that is already there, with its
        trained value, instead of raising AlreadyExists.
      gradient_compression: None (default: gradients sent as they are),
        ``"fp16"``, ``"bf16"`` (emulated: precision only, no bytes saved) or
        ``coordinator.compression.TopK(ratio)`` (top-k rows with error
        feedback); see coordinator.compression. Asynchronous modes only.
        The strategy does not reach the workers, so step functions pass
        ``compression=strategy.gradient_compression_spec`` to
        ``push_gradients`` (it is small and picklable).
      read_compression: None (default: values read as they are) or
        ``"fp16"``: float values read rounded to float16 and sent as float16
        between hosts (half the bytes of float32; the arrays a step gets are
        float32). Any mode. Step functions pass
        ``compression=strategy.read_compression_spec`` to ``read_variables``.
      connect_timeout: seconds each parameter server has to answer the
        strategy's first call (at the first ``create_variable``); one that
        does not raises ``psserver.errors.Unavailable`` naming it ("ps 0 at
        HOST:PORT does not answer ...") and what to check, instead of
        waiting out a call's 60 s deadline. A ClusterCoordinator on this
        strategy warns, after as long, of a worker that does not answer
        (and keeps waiting for it). Default ``$PSTRAIN_CONNECT_SECONDS``,
        else 10.

    Raises:
      ClusterConfigError: the cluster has no parameter servers.
      ValueError: bad mode options.
    """

    def __init__(self, cluster_resolver: Any = None,
                 variable_partitioner: Partitioner | None = None, *,
                 token: str | None = None, mode: str = "async",
                 num_replicas: int | None = None, backup_workers: int = 0,
                 aggregation: str = "mean", step_timeout: float = 30.0,
                 staleness: int | None = None, tls: TLSConfig | None = None,
                 reuse_existing: bool = False, replication: bool = False,
                 gradient_compression: Any = None, read_compression: str | None = None,
                 connect_timeout: float | None = None):
        self.cluster_resolver = _as_resolver(cluster_resolver)
        spec = self.cluster_resolver.cluster_spec()
        if not spec.ps and mode != "allreduce":
            raise ClusterConfigError("the cluster has no parameter servers (\"ps\" is empty)")
        self._ps = tuple(spec.ps)
        self.variable_partitioner = variable_partitioner
        self.token = token or spec.token or os.environ.get(TOKEN_ENV) or None
        self.tls = tls or getattr(spec, "tls", None) or TLSConfig.from_env()
        ps_pool.configure(self.token, self.tls, self._ps)
        self.connect_timeout = float(CONNECT_SECONDS if connect_timeout is None
                                     else connect_timeout)
        if not self.connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0 seconds, got {connect_timeout}")
        self._answered = False   # every parameter server answered once (_check_servers)
        self._lock = threading.Lock()
        self._next_ps = 0      # round-robin placement counter, as TF's
        self._variables: dict[str, V.ShardedVariable] = {}
        self._tables: dict[str, DynamicEmbedding] = {}
        self._table_creation: dict[str, tuple[int, list]] = {}   # name -> (dim, [(addr, kw)])
        # How each shard was created, to create it again on a parameter server
        # that restarted empty when no checkpoint holds it.
        self._creation: dict[str, dict] = {}
        # server_id of each parameter server when we created shards there: a
        # different one later means the process restarted and lost them.
        self.server_ids: dict[str, str] = {}
        self.reuse_existing = reuse_existing
        if replication and len(self._ps) < 2:
            raise ValueError("replication needs at least two parameter servers")
        self.replication = replication
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        if aggregation not in ("mean", "sum"):
            raise ValueError(f'aggregation must be "mean" or "sum", got {aggregation!r}')
        self.aggregation = aggregation
        if not step_timeout >= 0:
            raise ValueError(f"step_timeout must be >= 0, got {step_timeout}")
        self.step_timeout = float(step_timeout)
        self.num_replicas = 1
        self.backup_workers = 0
        #: Whose mirrored variables a worker's replicas are (all-reduce mode).
        self.job = os.urandom(8).hex()
        self._mirrored: dict[str, Any] = {}
        if mode == "allreduce":   # (its arguments checked there)
            from coordinator.mirrored import configure
            configure(self, spec, num_replicas, backup_workers)
        elif mode in SYNC_MODES:
            n = num_replicas if num_replicas is not None else max(1, len(spec.worker))
            if n < 1:
                raise ValueError(f"num_replicas must be >= 1, got {n}")
            if not 0 <= backup_workers < n:
                raise ValueError(f"backup_workers must be in [0, num_replicas={n}), "
                                 f"got {backup_workers}")
            self.num_replicas, self.backup_workers = n, backup_workers
        elif num_replicas is not None or backup_workers:
            raise ValueError('num_replicas and backup_workers apply to mode="sync" or '
                             '"hybrid" only')
        self.staleness = None
        if mode == "bounded":
            if staleness is None or staleness < 0:
                raise ValueError('mode="bounded" needs staleness=s with s >= 0')
            self.staleness = int(staleness)
        elif staleness is not None:
            raise ValueError('staleness applies to mode="bounded" only')
        from coordinator.compression import FP16
        from coordinator.compression import resolve as _resolve_compression
        #: What step functions pass to push_gradients(..., compression=...).
        self.gradient_compression_spec = _resolve_compression(gradient_compression)
        if mode == "allreduce" and not isinstance(self.gradient_compression_spec, (FP16,
                                                                                   type(None))):
            raise ValueError('mode="allreduce" takes gradient_compression None or "fp16" (the '
                             "dtype its all-reduce sends)")
        if self.gradient_compression_spec is not None and mode in SYNC_MODES:
            raise ValueError('gradient_compression applies to mode="async" or "bounded", '
                             f'not "{mode}"')
        step_calls.read_value_dtype(read_compression)   # ValueError now, not on a worker
        #: What step functions pass to read_variables(..., compression=...).
        self.read_compression_spec = "fp16" if read_compression is not None else None

    @property
    def cluster_spec(self) -> ClusterSpec:
        return self.cluster_resolver.cluster_spec()

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas whose gradients make one update: num_replicas in sync and
        hybrid modes (dense variables), else 1."""
        return self.num_replicas if self.mode in SYNC_MODES + ("allreduce",) else 1

    def scale_learning_rate(self, learning_rate: float) -> float:
        """The linear scaling rule (Goyal et al., 2017): a global batch k times
        larger (k replicas of one per-replica batch) takes a learning rate k times
        larger: ``learning_rate * num_replicas_in_sync``; warm up for large k."""
        return learning_rate * self.num_replicas_in_sync

    def sync_steps_done(self) -> int:
        """The highest ``sync_steps`` of any shard of this strategy's variables
        and tables: a restarted coordinator (``reuse_existing``) numbers its
        steps from here (a lower step is late everywhere, its updates dropped)."""
        pool = ps_pool.servers()
        done = [m.sync_steps for v in self.variables for m in v.meta()]
        done += [pool.client(c.address).table_info(c.table).sync_steps
                 for t in self.tables for c in t.primaries()]
        return max(done, default=0)

    def sync_spec(self, step: int, replica: int) -> SyncSpec:
        """What the parameter servers need to know of replica ``replica`` of ``step``."""
        return SyncSpec(step, replica, self.num_replicas,
                        self.num_replicas - self.backup_workers,
                        self.aggregation == "sum", self.step_timeout, self.mode == "hybrid")

    def abandon(self, step: int, replica: int) -> None:
        """Tell every parameter server that a replica will not push for a step.
        With replication, a server that cannot be reached is skipped (its
        shards are failed over to copies that were told)."""
        for addr in self._ps:
            try:
                ps_pool.client_for(addr).abandon_step(step, replica)
            except (Unavailable, DeadlineExceeded):
                if not self.replication:
                    raise

    num_ps = property(lambda self: len(self._ps))

    @property
    def variables(self) -> list[V.ShardedVariable]:
        return list(self._variables.values())

    @property
    def mirrored_variables(self) -> list:
        """All-reduce mode's variables (coordinator.mirrored.MirroredVariable)."""
        return list(self._mirrored.values())

    def _place(self, n: int) -> list[str]:
        with self._lock:
            out = [self._ps[(self._next_ps + i) % len(self._ps)] for i in range(n)]
            self._next_ps += n
        return out

    def create_variable(self, name: str, shape: Sequence[int] | None = None,
                        dtype: str | np.dtype | None = None, *,
                        initial_value=None,
                        initializer: Initializer | str | None = None,
                        seed: int = 0,
                        optimizer: str = "sgd",
                        optimizer_params: Mapping[str, float] | None = None,
                        partitioner: Partitioner | None | str = "default",
                        allow_nonfinite: bool = False) -> V.ShardedVariable:
        """Create a variable, sharded by the partitioner, with its optimizer.

        Give ``initial_value`` (an array; shape and dtype default to its own)
        or ``initializer``: a server-side kind ("zeros", "ones",
        "random_normal", "truncated_normal", "random_uniform"), a shape-aware
        kind ("glorot_uniform", "he_normal"), or an ``Initializer``. Random
        kinds use ``seed + shard index`` on each shard (``seed`` and an
        Initializer's own seed are one: give either; both, different, is a
        ValueError).

        ``optimizer`` is "sgd", "momentum", "adagrad", "adam" or "ftrl", with
        tf.keras.optimizers' hyper-parameter names and defaults.

        Creation is all-or-nothing: if one shard cannot be created, the shards
        already made are deleted and the error is raised.

        Raises: ValueError (bad arguments), psserver.errors.PSError (from the
        servers: AlreadyExists, InvalidArgument, ResourceExhausted, ...;
        Unavailable, on the first call, naming a parameter server that does
        not answer within ``connect_timeout``).
        """
        if name in self._variables or name in self._mirrored:
            raise ValueError(f"a variable named {name!r} was already created by this strategy")
        if self.mode == "allreduce":   # a replica on every worker: no server holds it
            from coordinator import mirrored
            self._mirrored[name] = var = mirrored.create(
                self.job, name, shape, dtype, initial_value,
                None if initializer is None else resolve_initializer(
                    initializer, shape or np.shape(initial_value), seed),
                optimizer, optimizer_params, allow_nonfinite)
            return var
        self._check_servers()
        value = None
        if initial_value is not None:
            if initializer is not None:
                raise ValueError("give initial_value or initializer, not both")
            value = np.asarray(initial_value)
            dtype = dtype or (value.dtype if value.dtype.kind == "f" else "float32")
            value = value.astype(dtype, copy=False)
            if shape is not None and tuple(shape) != value.shape:
                raise ValueError(f"shape {tuple(shape)} does not match initial_value's {value.shape}")
            shape = value.shape
        if shape is None:
            raise ValueError(f"create_variable({name!r}) needs a shape or an initial_value")
        shape = tuple(int(d) for d in shape)
        dtype = np.dtype(dtype or "float32").name
        part = self.variable_partitioner if partitioner == "default" else partitioner
        n = 1
        if part is not None and shape and shape[0] > 0:
            n = num_shards_of(part(shape, dtype))
        offsets = shard_row_offsets(shape[0], n) if shape else [0, 0]
        n = len(offsets) - 1
        addrs = variable_moves.places(self, name, n, self._place(n))
        init = None if value is not None else resolve_initializer(initializer, shape, seed)
        shards, backups = [], []
        try:
            for i, addr in enumerate(addrs):
                lo, hi = offsets[i], offsets[i + 1]
                sname = name if n == 1 else f"{name}/part_{i}"
                sshape = (hi - lo,) + shape[1:] if shape else ()
                kw: dict[str, Any] = {}
                if value is not None:
                    kw["initial_value"] = value[lo:hi] if shape else value
                elif init.kind in ("random_normal", "truncated_normal", "random_uniform"):
                    kw["initializer"] = dataclasses.replace(init, seed=init.seed + i)
                else:
                    kw["initializer"] = init
                create = dict(name=sname, shape=sshape, dtype=dtype, optimizer=optimizer,
                              optimizer_params=optimizer_params,
                              allow_nonfinite=allow_nonfinite, **kw)
                backup = None
                if self.replication:   # its backup on the next server, made by the primary
                    baddr = variable_moves.backup_place(self, sname, addr)
                    backup = V.Shard(baddr, f"{BACKUP_PREFIX}{sname}", lo, hi - lo)
                    self._note_server(baddr)
                shard = V.Shard(addr, sname, lo, hi - lo)
                try:
                    ps_pool.client_for(addr).create_variable(
                        **create, exist_ok=self.reuse_existing,
                        backup=None if backup is None else Peer(backup.address, backup.name))
                except AlreadyExists:
                    raise   # the name is someone else's: not ours to delete
                except BaseException:   # it may have been made (and its backup) before failing
                    shards.append(shard)
                    backups += [backup] if backup is not None else []
                    raise
                shards.append(shard)
                backups += [backup] if backup is not None else []
                self._note_server(addr)
                self._creation[sname] = create
        except BaseException:
            for s in shards + backups:   # all-or-nothing
                try:
                    ps_pool.client_for(s.address).delete_variable(s.name)
                except PSError:
                    pass
            raise
        var = V.ShardedVariable(name, shape, dtype, tuple(shards), optimizer, tuple(backups))
        if backups and self.reuse_existing:   # adopted: a failover may have moved primaries
            ps_pool.servers().refresh([(var, k) for k in range(len(backups))])
        self._variables[name] = var
        return var

    @property
    def tables(self) -> list[DynamicEmbedding]:
        """The dynamic embedding tables this strategy created."""
        return list(self._tables.values())

    def create_embedding_table(self, name: str, dim: int, *, dtype: str = "float32",
                               initializer: Initializer | str | None = None,
                               optimizer: str = "sgd",
                               optimizer_params: Mapping[str, float] | None = None,
                               min_count: int = 1, probability: float = 1.0,
                               capacity: int = 0, policy: str = "lru",
                               max_age_steps: int = 0, max_age_seconds: float = 0.0,
                               seed: int = 0) -> DynamicEmbedding:
        """A dynamic embedding table keyed by any int64, its keys spread over
        every parameter server by hash (coordinator/embedding.py,
        psserver/core/dynamic_table.py). A key gets a row on its ``min_count``-th
        look-up, then with ``probability`` per look-up; until then it reads as
        zeros and its gradients are dropped. ``capacity`` (0: none) bounds
        the rows of the whole table: each server holds its share of the key
        buckets (psserver.contract.keys) and that share of the capacity
        (docs/embedding-tables.md), evicting by ``policy`` ("lru" or "lfu").
        Rows not updated for ``max_age_steps`` updates of their shard or
        ``max_age_seconds`` are evicted too. New rows come from
        ``initializer`` as a function of (``seed``, key) alone; ``seed`` also
        draws admission by ``probability`` (one seed with an Initializer's:
        give either; both, different: ValueError).

        Made again with the same arguments (a coordinator that restarts), the
        existing table is used; a call that fails leaves no shard it made.
        With ``replication=True`` each shard has a backup on the next server
        (coordinator/embedding.py). Without it, a server that restarts gets
        its shards made again and filled from the coordinator's latest
        checkpoint (ClusterCoordinator(checkpoint_manager=...)), as its
        variables' shards are."""
        if name in self._tables:
            raise ValueError(f"embedding table {name!r} was created already by this strategy")
        if not self._ps:
            raise ValueError("embedding tables live on parameter servers, and this cluster has "
                             "none: add \"ps\" tasks to it (all-reduce mode keeps tables there)")
        if name.startswith(BACKUP_PREFIX):
            raise ValueError(f"table names starting {BACKUP_PREFIX!r} are the backup "
                             "copies replication makes; choose another name")
        self._check_servers()
        n = len(self._ps)
        if 0 < capacity < n:   # each server holds at least one row (a part of 0: no limit)
            raise ValueError(f"capacity {capacity} is below the {n} parameter servers the "
                             f"table spreads over; give at least {n} (or 0: no limit)")
        buckets = BucketMap.even(n)
        parts = split_capacity(capacity, buckets.counts())
        if initializer is None or isinstance(initializer, str):
            initializer = Initializer(kind=initializer or "zeros", seed=seed)
        initializer = one_seed(initializer, seed)
        seed = initializer.seed   # one seed: the rows' and admission's
        creations = [(addr, dict(
            dtype=dtype, initializer=initializer, optimizer=optimizer,
            optimizer_params=optimizer_params, min_count=min_count, probability=probability,
            capacity=parts[i], policy=policy, max_age_steps=max_age_steps,
            max_age_seconds=max_age_seconds,
            seed=seed * n + i))   # each shard its own admission draws; rows: the same
            for i, addr in enumerate(self._ps)]
        table = DynamicEmbedding(name, dim, dtype, tuple(self._ps), optimizer,
                                 replicated=self.replication, capacity=capacity,
                                 buckets=buckets, table_id=os.urandom(8).hex(), origin_shards=n)
        make_shards(table, creations, parts, self._note_server)
        self._table_creation[name] = (dim, creations)
        self._tables[name] = table
        return table

    def _check_servers(self) -> None:
        """Once: every parameter server answers (ps_pool.check_answer)."""
        if not self._answered:
            ps_pool.check_answer(self._ps, self.connect_timeout, self.tls)
            self._answered = True

    def _note_server(self, addr: str) -> None:   # (watched from now on: coordinator.recovery)
        if addr not in self._ps:   # (added, or one a table's layout names: reached as the others)
            self._ps += (addr,)
            ps_pool.servers().give([addr], self.token, self.tls)
        if addr not in self.server_ids:
            self.server_ids[addr] = ps_pool.client_for(addr).server_info().server_id

    def shards_on(self, addr: str) -> list[tuple[V.ShardedVariable, V.Shard]]:
        """(variable, shard) for every shard and backup shard on addr."""
        return [(v, s) for v in self._variables.values() for s in v.shards + v.backups
                if s.address == addr]

    def recreate_shards(self, addr: str) -> None:
        """Create again, as first created, the shards on ``addr`` (none in a checkpoint)."""
        for _, s in self.shards_on(addr):
            ps_pool.client_for(addr).create_variable(**self._creation[s.name], exist_ok=True)

    def tables_on(self, addr: str) -> list[str]:
        """The dynamic tables with a shard on ``addr``."""
        return [name for name, (_, made) in self._table_creation.items() if addr in dict(made)]

    def recreate_tables(self, addr: str) -> None:
        """Create again, empty, the table shards on ``addr`` (a restore fills them)."""
        for name in self.tables_on(addr):
            dim, creations = self._table_creation[name]
            for a, kw in creations:   # (its capacity part: as the buckets are spread now)
                if a == addr:
                    ps_pool.client_for(addr).create_table(
                        name, dim, exist_ok=True, **elastic.creation_now(self._tables[name], a, kw))
            if self._tables[name].layout_epoch:   # (its place in a layout moves made)
                elastic.serve_layout(self._tables[name])

    def delete_variable(self, var: V.ShardedVariable) -> None:
        """Delete every copy of ``var``'s shards where the routes say (ps_pool.delete_copies)."""
        ps_pool.delete_copies(var, lambda s: ps_pool.client_for(s.address).delete_variable(s.name))
        self._variables.pop(var.name, None)

    def delete_embedding_table(self, table: DynamicEmbedding) -> None:
        """Delete every copy of a dynamic table's shards, as delete_variable."""
        ps_pool.delete_copies(table, lambda s: ps_pool.client_for(s.address).delete_table(s.table))
        self._tables.pop(table.name, None)
        self._table_creation.pop(table.name, None)

    parameter_servers = property(lambda self: self._ps, doc="Its servers (added ones too).")

    def remove_parameter_server(self, address: str) -> list:   # (ClusterCoordinator's)
        elastic.check_remove(self, address)
        with elastic.LAYOUT_LOCK:   # (variable shards move whole: coordinator/variable_moves.py)
            moves = variable_moves.drain_variables(self, address) + [
                elastic.drain_table(t, address, self.server_ids)
                for t in list(self._tables.values()) if address in t.addresses]
            self._ps = tuple(a for a in self._ps if a != address)
            self.server_ids.pop(address, None)   # (not watched: it may stop)
            for name, (dim, creations) in self._table_creation.items():
                self._table_creation[name] = (dim, [c for c in creations if c[0] != address])
        return moves

    def creation_at(self, table, address: str) -> tuple[dict, bool]:
        """create_table's keywords for ``table``'s shard on ``address``, and
        whether it was made there (an add that failed part way); else the
        last shard's with the next seed."""
        made = dict(self._table_creation[table.name][1]).get(address)
        last = self._table_creation[table.name][1][-1][1]
        return (made, True) if made else (dict(last, seed=last["seed"] + 1), False)

    def add_parameter_server(self, address: str) -> list:   # (ClusterCoordinator's: elastic.py)
        elastic.check_add(self, address, probe=self.connect_timeout)
        with elastic.LAYOUT_LOCK:
            added, moves = address not in self._ps, []   # (not added: a failed add resumed)
            try:
                self._note_server(address)   # (one of its servers from now on)
                for table in [t for t in self._tables.values() if elastic.lacks_share(t, address)]:
                    kw, made = self.creation_at(table, address)
                    try:
                        moves.append(elastic.move_table(table, address, kw, self.server_ids))
                    finally:   # (one that failed part-way has a shard there too)
                        if address in table.addresses and not made:
                            dim, creations = self._table_creation[table.name]
                            self._table_creation[table.name] = (dim, creations + [(address, kw)])
            except BaseException:
                if added and not any(address in t.addresses for t in self._tables.values()):
                    self._ps = tuple(a for a in self._ps if a != address)   # (as it was)
                    self.server_ids.pop(address, None)
                raise
        return moves
