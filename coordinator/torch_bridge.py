"""Train a PyTorch ``nn.Module`` on the parameter servers (optional: needs torch).

    pip install torch --index-url https://download.pytorch.org/whl/cpu   # CPU build: no CUDA GBs
    pip install -e ".[torch]"

``TorchModelBridge`` creates one ``ShardedVariable`` per parameter of a
module (initial values taken from the module, float32) and moves values and
gradients between the servers and a module on a worker::

    bridge = TorchModelBridge(strategy, model, optimizer="adam",
                              optimizer_params={"learning_rate": 1e-3})

    def train_step(iterator):                       # runs on a worker
        x, y = next(iterator)
        with bridge.local_module() as m:            # this worker's own copy
            bridge.pull(m)                          # one read per parameter server
            loss = F.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            bridge.push(m)                          # one push per parameter server
        return loss.item()

What travels to the workers
---------------------------
The bridge holds variable handles, parameter names, and a *skeleton* of the
module: a copy whose parameters are on torch's "meta" device (shapes and
dtypes, no data), pickled once with cloudpickle when the bridge is made
(buffers such as BatchNorm statistics are kept by value). A step function
that captures the bridge therefore carries a few kilobytes, not the weights,
whatever the model's size. On a worker, ``local_module()`` unpickles the
skeleton the first time and gives it real (empty) parameters; ``pull`` then
fills them from the servers. Instead of a module you may pass a zero-argument
factory (``TorchModelBridge(strategy, make_model)``): it is called once on
the coordinator for the initial values and once per module copy on a worker,
and it is what travels (by reference if importable, else by value); use it
for modules that cannot be deep-copied.

Worker processes keep the modules made by ``local_module()`` between steps
(per bridge, in a small pool: one per closure running at once, so usually
one), so the skeleton is unpickled and the parameters allocated once, not
every step.

Embedding tables
----------------
The ``weight`` of every ``nn.Embedding`` and ``nn.EmbeddingBag`` is an
embedding table: it is sharded over the servers by the strategy's partitioner
and updated sparsely (lazy, row-wise: ``push_sparse``), as TensorFlow's
embedding variables are; everything else is dense (``push_gradients``).

* ``bridge.pull(m, embedding_ids={"emb": ids})`` gathers only the rows of
  ``unique(ids)`` from the servers and installs them as a small local table
  (``(len(unique), dim)``); it returns ``{"emb": local_ids}``, the ids
  remapped into that table, to feed to the module instead of ``ids``. The
  key is the embedding module's path (``"emb"``) or its parameter name
  (``"emb.weight"``); a tuple or list of id tensors (several features sharing
  one table) returns a tuple of remapped tensors. ``padding_idx`` is remapped
  too (or dropped for a step whose ids do not contain it).
* A table not named in ``embedding_ids`` is read whole, with the dense
  parameters (fine for small tables, and for evaluation).
* ``push`` sends a table's gradient as unique global row ids + row gradients:
  from a ``sparse=True`` table's sparse gradient (coalesced) or from a dense
  gradient (for a locally pulled table: every pulled row but the padding row;
  for a whole table: the rows whose gradient is not all zero).
* ``max_norm`` (in-place renormalization of rows) is refused: it would change
  the local copy only.
* A table whose weight is shared with a non-embedding module (tied weights)
  is treated as a dense parameter.

A dynamic table (int64 ids of any size, rows made on first sight) is a
``DynamicEmbeddingModule`` (coordinator/torch_tables.py) in the model: the
bridge finds it, ``pull(m, embedding_ids={path: ids})`` fetches its rows in
the dense parameters' read, and ``push`` sends its row gradients in the
dense push (one call per server each way).

Sync mode works unchanged: ``pull`` and ``push`` run on the step's thread and
carry its replica context (so they must not be moved to other threads). A
trainable parameter with no gradient in a step is pushed as zeros in sync
mode (its true share of the global-batch gradient; a variable waits for
every replica, so a replica that stayed silent would hold the step up) and
skipped otherwise; an embedding table with no rows touched is pushed empty.
Parameters with ``requires_grad=False`` are read but never pushed. Buffers
are not variables: each module copy keeps its own.

Nothing in the core packages imports this module or torch.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import pickle
import threading
import uuid
from typing import Any, Callable, Iterator, Mapping

import cloudpickle
import numpy as np

try:
    import torch
    from torch import nn
except ImportError as exc:   # pragma: no cover - exercised only without torch
    raise ImportError("coordinator.torch_bridge needs PyTorch (torch>=2.1; its CPU build is "
                      "enough): pip install torch --index-url "
                      "https://download.pytorch.org/whl/cpu && pip install 'pstrain[torch]' "
                      f"({exc})") from exc

from coordinator.replica import current_sync
from coordinator.step_calls import IndexedSlices, push_gradients, read_variables
from coordinator.torch_tables import DynamicEmbeddingModule
from coordinator.variables import ShardedVariable

__all__ = ["TorchModelBridge", "EMBEDDING_TYPES"]

#: Modules whose ``weight`` is an embedding table (sharded, sparse updates).
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)

#: Attribute (in a module's __dict__) holding what each bridge last pulled into it.
_PULLED_ATTR = "_pstrain_pulled"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter of the module and the variable that holds it."""
    name: str                    # as in module.named_parameters()
    variable: ShardedVariable
    table: bool                  # an embedding table (sparse updates)
    requires_grad: bool
    # Embedding tables: every (module path, padding_idx) using this weight.
    owners: tuple[tuple[str, int | None], ...] = ()


# -- worker-side module pools ------------------------------------------------------
class _Pool:
    def __init__(self):
        self.lock = threading.Lock()
        self.free: list[nn.Module] = []


_POOLS: "collections.OrderedDict[str, _Pool]" = collections.OrderedDict()
_POOLS_LOCK = threading.Lock()
#: Bridges whose module copies a process keeps (least recently used dropped).
_MAX_POOLS = 8


def _pool_for(uid: str) -> _Pool:
    with _POOLS_LOCK:
        pool = _POOLS.get(uid)
        if pool is None:
            pool = _POOLS[uid] = _Pool()
            while len(_POOLS) > _MAX_POOLS:
                _POOLS.popitem(last=False)
        else:
            _POOLS.move_to_end(uid)
        return pool


# -- helpers -------------------------------------------------------------------------
def _as_numpy_ids(ids) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        raise TypeError(f"embedding ids must be integers, got {a.dtype.name}")
    return a


def _install(p: nn.Parameter, value: np.ndarray) -> None:
    """Make ``value`` the parameter's data: no copy for a float32 CPU parameter."""
    t = torch.from_numpy(value)
    if p.dtype != t.dtype or p.device.type != "cpu":
        t = t.to(device=p.device, dtype=p.dtype)
    p.data = t
    p.grad = None


def _grad_numpy(g: torch.Tensor) -> np.ndarray:
    return g.detach().to(device="cpu", dtype=torch.float32).numpy()


def _owners(module: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """id(parameter) -> every (module path, submodule, attribute) holding it."""
    out: dict[int, list] = collections.defaultdict(list)
    for path, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                out[id(p)].append((path, mod, attr))
    return out


def _skeleton(module: nn.Module) -> nn.Module:
    """A deep copy whose parameters are on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    return copy.deepcopy(module, memo)


class TorchModelBridge:
    """The parameters of a torch module, as variables on the parameter servers.

    Args:
      strategy: the ParameterServerStrategy that creates the variables.
      module: an ``nn.Module`` (its skeleton, without parameter data, goes to
        the workers), or a zero-argument callable returning one (called once
        here for the initial values; it goes to the workers and is called
        there for each module copy).
      optimizer, optimizer_params: the servers' optimizer for dense
        parameters ("sgd", "momentum", "adagrad", "adam", "ftrl"; tf.keras names).
      embedding_optimizer, embedding_optimizer_params: the optimizer of the
        embedding tables (default: the same as the dense parameters).
      name_prefix: variables are named ``f"{name_prefix}/{parameter name}"``
        (default: the module's class name).
      partitioner, embedding_partitioner: how to shard dense parameters and
        tables: "default" (the strategy's ``variable_partitioner``), None
        (whole), or a partitioner.
      torch_threads: ``torch.set_num_threads`` applied in a process that
        builds a module copy (workers): several workers share a machine's
        cores, and small steps run fastest on one thread. None: leave it.

    The bridge is picklable (cloudpickle) and small: see the module docstring.
    """

    def __init__(self, strategy, module: nn.Module | Callable[[], nn.Module], *,
                 optimizer: str = "adam", optimizer_params: Mapping[str, float] | None = None,
                 embedding_optimizer: str | None = None,
                 embedding_optimizer_params: Mapping[str, float] | None = None,
                 name_prefix: str | None = None,
                 partitioner="default", embedding_partitioner="default",
                 torch_threads: int | None = 1):
        if isinstance(module, nn.Module):
            self._skeleton = cloudpickle.dumps(_skeleton(module))
            self._factory = False
        elif callable(module):
            self._skeleton = cloudpickle.dumps(module)
            self._factory = True
            module = module()
            if not isinstance(module, nn.Module):
                raise TypeError(f"the module factory returned {type(module).__name__}, "
                                "not a torch.nn.Module")
        else:
            raise TypeError(f"expected a torch.nn.Module or a factory of one, got "
                            f"{type(module).__name__}")
        self.uid = uuid.uuid4().hex
        self.name_prefix = name_prefix if name_prefix is not None else type(module).__name__
        self.torch_threads = torch_threads
        owners = _owners(module)
        specs: list[ParamSpec] = []
        created: list[ShardedVariable] = []
        try:
            for name, p in module.named_parameters():
                if not p.is_floating_point():
                    raise TypeError(f"parameter {name!r} has dtype {p.dtype}: only floating "
                                    "point parameters can be trained on the servers")
                where = owners[id(p)]
                table = bool(where) and all(isinstance(mod, EMBEDDING_TYPES) and attr == "weight"
                                            for _, mod, attr in where)
                if table and any(mod.max_norm is not None for _, mod, _ in where):
                    raise ValueError(f"embedding {where[0][0]!r} has max_norm: its in-place "
                                     "renormalization of rows cannot reach the servers; "
                                     "drop max_norm (or clip in the loss)")
                value = p.detach().to(device="cpu", dtype=torch.float32).numpy()
                var = strategy.create_variable(
                    f"{self.name_prefix}/{name}", initial_value=value, dtype="float32",
                    optimizer=(embedding_optimizer or optimizer) if table else optimizer,
                    optimizer_params=(embedding_optimizer_params if table and embedding_optimizer
                                      else optimizer_params),
                    partitioner=embedding_partitioner if table else partitioner)
                created.append(var)
                specs.append(ParamSpec(
                    name, var, table, p.requires_grad,
                    tuple((path, mod.padding_idx) for path, mod, _ in where) if table else ()))
        except BaseException:
            for var in created:   # all-or-nothing, as create_variable is
                with contextlib.suppress(Exception):
                    strategy.delete_variable(var)
            raise
        #: Module path -> its dynamic table (DynamicEmbeddingModule, coordinator/torch_tables.py).
        self.dynamic: dict[str, Any] = {
            path: mod.table for path, mod in module.named_modules()
            if isinstance(mod, DynamicEmbeddingModule)}
        if not specs and not self.dynamic:
            raise ValueError("the module has no parameters")
        self.params: tuple[ParamSpec, ...] = tuple(specs)
        self._table_keys: dict[str, str] = {}
        for s in specs:
            if s.table:
                self._table_keys[s.name] = s.name
                for path, _ in s.owners:
                    self._table_keys.setdefault(path, s.name)

    # -- description ---------------------------------------------------------------
    @property
    def variables(self) -> dict[str, ShardedVariable]:
        """Parameter name -> its ShardedVariable."""
        return {s.name: s.variable for s in self.params}

    @property
    def tables(self) -> tuple[str, ...]:
        """Names of the parameters that are embedding tables."""
        return tuple(s.name for s in self.params if s.table)

    def __repr__(self) -> str:
        return (f"TorchModelBridge({self.name_prefix!r}, {len(self.params)} parameters, "
                f"tables={list(self.tables)})")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The values on the servers now, keyed by parameter name (one read per
        server); ``module.load_state_dict(bridge.state_dict(), strict=False)``."""
        values = read_variables([s.variable for s in self.params])
        return {s.name: torch.from_numpy(v) for s, v in zip(self.params, values)}

    def delete_variables(self, strategy) -> None:
        """Delete this bridge's variables from the servers."""
        for s in self.params:
            strategy.delete_variable(s.variable)

    # -- worker-side module copies -------------------------------------------------
    def build_module(self) -> nn.Module:
        """A new module with this bridge's structure. Parameters hold nothing
        useful (embedding tables have 0 rows) until ``pull`` fills them."""
        if self.torch_threads and torch.get_num_threads() != self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        module = pickle.loads(self._skeleton)
        if self._factory:
            module = module()
            return module
        tables = {s.name for s in self.params if s.table}
        real: dict[int, nn.Parameter] = {}
        names = {id(p): n for n, p in module.named_parameters()}
        for mod in module.modules():
            for attr, p in list(mod._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                q = real.get(id(p))
                if q is None:
                    shape = tuple(p.shape)
                    if names.get(id(p)) in tables:
                        shape = (0,) + shape[1:]
                    q = real[id(p)] = nn.Parameter(torch.zeros(shape, dtype=p.dtype),
                                                   requires_grad=p.requires_grad)
                mod._parameters[attr] = q
        return module

    @contextlib.contextmanager
    def local_module(self) -> Iterator[nn.Module]:
        """A module copy of this process for the duration of a step.

        Copies are kept between steps in a per-process pool (one per step
        running at once), so a worker builds its module once, not per step.
        """
        pool = _pool_for(self.uid)
        with pool.lock:
            module = pool.free.pop() if pool.free else None
        if module is None:
            module = self.build_module()
        try:
            yield module
        finally:
            with pool.lock:
                pool.free.append(module)

    # -- pull ------------------------------------------------------------------------
    def _table_name(self, key: str) -> str:
        try:
            return self._table_keys[key]
        except KeyError:
            raise KeyError(f"{key!r} is not an embedding table of this module; tables (by "
                           f"module path or parameter name): {sorted(self._table_keys)}") from None

    def pull(self, module: nn.Module, embedding_ids: Mapping[str, Any] | None = None) -> dict:
        """Copy the servers' values into ``module``'s parameters; clear their grads.

        Dense parameters (and tables not named in ``embedding_ids``) are read
        in one call per parameter server (``read_variables``) and become the
        parameters' data without a copy (float32 on CPU). For each table in
        ``embedding_ids`` (key: module path or parameter name; value: an id
        tensor/array, or a tuple/list of them) only the rows of the unique
        ids are gathered, into a local table.

        Returns {key: ids remapped into the local table} (int64 tensors, same
        shapes; a tuple for a tuple of id tensors). Feed those to the module.
        A ``DynamicEmbeddingModule`` named in ``embedding_ids`` (by its path)
        gets the rows of its ids in the same read; its ids come back as given.
        """
        params = dict(module.named_parameters())
        wanted: dict[str, tuple[str, Any]] = {}   # table name -> (key, ids)
        lookups: dict[str, tuple] = {}   # dynamic tables: path -> (module, Lookup, ids flat)
        remapped: dict[str, Any] = {}
        for key, ids in (embedding_ids or {}).items():
            if key in self.dynamic:   # its rows come in the dense parameters' read
                mod = module.get_submodule(key)
                lookups[key] = (mod, *mod.lookup_item(ids))
                remapped[key] = ids   # a dynamic table's forward takes the ids themselves
                continue
            name = self._table_name(key)
            if name in wanted:
                raise ValueError(f"table {name!r} named twice in embedding_ids "
                                 f"({wanted[name][0]!r} and {key!r})")
            wanted[name] = (key, ids)
        whole = [s for s in self.params if s.name not in wanted]
        values = read_variables([s.variable for s in whole]
                                + [item for _, item, _ in lookups.values()])
        for s, value in zip(whole, values):
            _install(params[s.name], value)
            for path, pad in s.owners:                 # a whole table: global padding_idx
                module.get_submodule(path).padding_idx = pad
        for (mod, _, flat), rows in zip(lookups.values(), values[len(whole):]):
            mod.pulled(flat, rows)
        pulled: dict[str, np.ndarray] = {}
        by_name = {s.name: s for s in self.params}
        for name, (key, ids) in wanted.items():
            s = by_name[name]
            parts = list(ids) if isinstance(ids, (tuple, list)) else [ids]
            arrays = [_as_numpy_ids(a) for a in parts]
            flat = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int64, copy=False)
            unique, inverse = np.unique(flat, return_inverse=True)
            p = params[name]
            _install(p, s.variable.gather(unique))
            for path, pad in s.owners:
                local = None
                if pad is not None:
                    i = int(np.searchsorted(unique, pad))
                    local = i if i < unique.size and unique[i] == pad else None
                module.get_submodule(path).padding_idx = local
            inverse = inverse.reshape(-1)
            outs, start = [], 0
            for a in arrays:
                outs.append(torch.from_numpy(inverse[start:start + a.size].reshape(a.shape))
                            .to(p.device))
                start += a.size
            remapped[key] = tuple(outs) if isinstance(ids, (tuple, list)) else outs[0]
            pulled[name] = unique
        module.__dict__.setdefault(_PULLED_ATTR, {})[self.uid] = pulled
        return remapped

    # -- push ------------------------------------------------------------------------
    def push(self, module: nn.Module) -> None:
        """Send ``module``'s gradients: dense ones and the rows' of its
        ``DynamicEmbeddingModule``s in one call per parameter server
        (``push_gradients``), ``nn.Embedding`` tables' as unique row ids + row
        gradients (``push_sparse``). Call after ``loss.backward()``."""
        params = dict(module.named_parameters())
        pulled = module.__dict__.get(_PULLED_ATTR, {}).get(self.uid, {})
        sync = current_sync() is not None
        dense: list[tuple[ShardedVariable, np.ndarray]] = []
        sparse: list[tuple[ShardedVariable, np.ndarray, np.ndarray]] = []
        for s in self.params:
            if not s.requires_grad:
                continue
            g = params[s.name].grad
            if not s.table:
                if g is not None:
                    dense.append((s.variable, _grad_numpy(g)))
                elif sync:   # every variable hears from every replica of a sync step
                    dense.append((s.variable, np.zeros(s.variable.shape, np.float32)))
                continue
            sparse.append((s.variable, *self._table_grad(s, g, pulled.get(s.name))))
        rows: dict[str, list] = {}   # dynamic tables, in the same call: their rows' gradients
        for path in self.dynamic:
            for table, update in module.get_submodule(path).gradients(empty_too=sync):
                rows.setdefault(table.name, [table]).append(update)
        for table, *updates in rows.values():   # two modules over one table: one update
            dense.append((table, updates[0] if len(updates) == 1 else IndexedSlices(
                np.concatenate([u.values for u in updates]),
                np.concatenate([u.indices for u in updates]))))
        if dense:
            push_gradients(dense)
        for var, ids, rows in sparse:
            if ids.size or sync:   # sync: an empty push counts this replica
                var.push_sparse(ids, rows)

    @staticmethod
    def _table_grad(s: ParamSpec, g: torch.Tensor | None,
                    unique: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(global row ids, row gradients) of a table's gradient, padding rows left out."""
        if g is None:
            return np.zeros(0, np.int64), np.zeros((0,) + s.variable.shape[1:], np.float32)
        if g.is_sparse:
            g = g.coalesce()
            ids = g.indices()[0].cpu().numpy().astype(np.int64, copy=False)
            rows = _grad_numpy(g.values())
            if unique is not None:
                ids = unique[ids]
        elif unique is not None:   # a local table: every pulled row was looked up
            ids, rows = unique, _grad_numpy(g)
        else:                      # the whole table: the rows with a gradient
            rows = _grad_numpy(g)
            ids = np.flatnonzero(rows.reshape(rows.shape[0], -1).any(axis=1)).astype(np.int64)
            rows = rows[ids]
        pads = [pad for _, pad in s.owners if pad is not None]
        if pads and ids.size:
            keep = ~np.isin(ids, pads)
            if not keep.all():
                ids, rows = ids[keep], rows[keep]
        return ids, rows
