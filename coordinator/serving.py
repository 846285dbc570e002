"""A serving copy that follows training: the model's weights, without
optimizer state, written as a base and deltas (``Exporter``, or
``coordinator export DIR``), and read into memory by another process that
answers look-ups and dense reads without talking to the parameter servers
(``Snapshot``).

    # beside training (the coordinator); the directory must lie under the
    # parameter servers' --checkpoint-dir (LocalCluster: the current or the
    # temporary directory):
    with Exporter(strategy, "exports/ctr", every_seconds=5):
        fit(...)

    # in the serving process:
    snap = Snapshot("exports/ctr", follow=True)     # base + deltas, then follows
    rows = snap.lookup("user_id", keys)             # unknown keys: zero rows
    w = snap.read("dense/kernel")

The export directory has CheckpointManager's layout (coordinator/checkpoint.py
and checkpoint_files.py), marked ``weights_only``: each parameter server
writes the values of its shards (a delta: the rows changed since the export
before, a table's changed keys and evicted keys) and the manifest is renamed
into place when complete, so a reader never sees half an export. A reader
composes base + deltas exactly as a restore does.

Freshness: an update acknowledged before an export starts is in that export;
a following Snapshot sees an export within ``poll_seconds`` of its rename.
So an update is served at most ``every_seconds`` + the export's duration +
``poll_seconds`` (+ the time to read the delta) after it was acknowledged
(``python -m bench.bench_serving`` measures it).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import types
from typing import Any, Callable, Mapping

import numpy as np

from coordinator.checkpoint_files import (
    CheckpointError,
    advance_shard,
    advance_table_shard,
    chain_of,
    find_checkpoints,
    load_table_shards,
    load_variable,
    same_table,
)
from psserver.contract.keys import BucketMap, legacy_shard_of

log = logging.getLogger("coordinator.serving")


class SnapshotError(Exception):
    """An export cannot be loaded (none there, damaged, incomplete, a broken
    chain); a Snapshot that raises it keeps serving what it had."""


class Exporter:
    """Write ``strategy``'s weights (no optimizer state) to ``directory`` as
    a base and deltas (CheckpointManager with ``incremental=True,
    weights_only=True``): every ``every_seconds`` on a thread of its own
    (``start()`` / ``stop()``, or ``with``), or when ``export()`` is called.

    Exports are numbered 1, 2, ... (after the last one in the directory);
    ``max_to_keep`` newest survive with what their chains need, a base at
    least every ``full_every`` exports. ``start()`` writes the first export
    itself and raises if it fails; one that fails later (a parameter server
    unreachable, recovering) is logged and counted in ``errors``, and the
    next one takes its changes again. ``directory`` must lie under every
    parameter server's --checkpoint-dir (LocalCluster's ``checkpoint_dirs``,
    by default the current and the temporary directory), seen at the same
    path.
    """

    def __init__(self, strategy, directory: str, *, every_seconds: float | None = None,
                 full_every: int = 20, max_to_keep: int = 3,
                 client_for: Callable | None = None):
        from coordinator.checkpoint import CheckpointManager
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0, got {every_seconds!r}")
        self.every_seconds = every_seconds
        self.manager = CheckpointManager(strategy, directory, max_to_keep=max_to_keep,
                                         incremental=True, full_every=full_every,
                                         weights_only=True, client_for=client_for)
        self.directory = self.manager.directory
        latest = self.manager.latest()
        self._next = 1 if latest is None else int(os.path.basename(latest)[5:]) + 1
        self.errors = 0
        self.last: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def export(self, extra: dict | None = None) -> str:
        """Write one export now; its path. Raises what the save raises
        (PSError, CheckpointError); nothing is listed then."""
        with self._lock:
            path = self.manager.save(self._next, extra)
            self._next += 1
            self.last = path
            return path

    def start(self) -> "Exporter":
        """Export now, then every ``every_seconds`` on a daemon thread. The
        first export is written here and raises what it raises (a directory
        outside the servers' --checkpoint-dir: PermissionDenied; PSError,
        CheckpointError), with no thread started; later ones that fail are
        logged and counted (``errors``), and the next one takes their changes."""
        if self.every_seconds is None:
            raise ValueError("start() needs every_seconds")
        if self._thread is None:
            self.export()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="pstrain-exporter",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, final: bool = True) -> None:
        """Stop the thread (after the export it may be writing); with
        ``final``, write one last export so the copy has every update."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if final:
            self.export()

    def _run(self) -> None:
        started = time.monotonic()   # (start() wrote the first export)
        while not self._stop.wait(max(0.0, self.every_seconds - (time.monotonic() - started))):
            started = time.monotonic()
            try:
                self.export()
            except Exception as exc:   # noqa: BLE001 -- the next export takes it again
                self.errors += 1
                log.warning("export to %s failed (%s: %s); the next one takes its changes",
                            self.directory, type(exc).__name__, exc)

    def __enter__(self) -> "Exporter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(final=exc[0] is None)


@dataclasses.dataclass(frozen=True)
class _State:
    """One export in memory (never changed: a refresh makes a new one)."""
    path: str
    manifest: dict
    chain: tuple                                     # (path, manifest), base first
    values: Mapping[str, np.ndarray]                 # variable -> its whole value
    tables: Mapping[str, tuple]                      # table -> ((keys, values) per shard, dim)
    table_shards: Mapping[str, list]                 # table -> advance_table_shard's per shard


class Snapshot:
    """The model of an export directory in memory (see the module): the
    latest export, composed from its base and deltas.

    ``refresh()`` applies the exports written since (the next deltas of
    the chain it holds, or a newer chain from its base) and returns True if
    it changed anything. With ``follow=True`` a daemon thread calls it every
    ``poll_seconds`` (``close()`` stops it); its errors are logged and kept
    in ``last_error``. Atomic for readers: a refresh builds new arrays and
    swaps them in at once, so a look-up sees one export whole, never part
    of a delta. A damaged, incomplete or unreadable export raises
    SnapshotError (in ``refresh``; logged when following) and the previous
    state stays served. Raises SnapshotError at construction when the
    directory holds no loadable export.
    """

    def __init__(self, directory: str, *, follow: bool = False, poll_seconds: float = 0.25):
        if not poll_seconds > 0:
            raise ValueError(f"poll_seconds must be > 0, got {poll_seconds!r}")
        self.directory = os.path.abspath(directory)
        self.poll_seconds = poll_seconds
        self.last_error: Exception | None = None
        self._state: _State | None = None
        self._refreshing = threading.Lock()
        self._changed = threading.Condition()
        self.generation = 0            # refreshes that changed the state
        self._stop = threading.Event()
        self._thread = None
        self.refresh()
        if follow:
            self._thread = threading.Thread(target=self._follow, name="pstrain-snapshot",
                                            daemon=True)
            self._thread.start()

    # -- what it serves ---------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The export served now."""
        return self._state.path

    @property
    def step(self) -> int:
        return self._state.manifest["step"]

    @property
    def extra(self) -> dict:
        return self._state.manifest.get("extra", {})

    @property
    def variables(self) -> list[str]:
        return sorted(self._state.values)

    @property
    def tables(self) -> list[str]:
        return sorted(self._state.tables)

    def read(self, name: str) -> np.ndarray:
        """Variable ``name``'s whole value (read-only; it stays as it was
        when later exports arrive). KeyError if the export has no such variable."""
        values = self._state.values
        if name not in values:
            raise KeyError(f"no variable {name!r} in the export {self._state.path} (it has "
                           f"{sorted(values)})")
        return values[name]

    def lookup(self, name: str, keys) -> np.ndarray:
        """Rows of ``keys`` (any shape; the result has a trailing dim): of a
        dynamic table, the key's row, zeros for a key it has no row for (as
        the parameter servers answer for keys not admitted); of a variable (a
        fixed table), row ``keys[i]`` (IndexError out of range). KeyError for
        an unknown name; ValueError for keys that are not integers."""
        state = self._state
        return lookup_rows(state.values, state.tables, name, keys, f"the export {state.path}")

    def wait(self, generation: int, timeout: float | None = None) -> int:
        """Block until a refresh past ``generation`` (or ``timeout``); the
        generation then."""
        with self._changed:
            self._changed.wait_for(lambda: self.generation > generation, timeout)
            return self.generation

    # -- following ------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Load what was exported since (see the class). Returns True if the
        state changed. Raises SnapshotError, the state kept."""
        with self._refreshing:
            found = find_checkpoints(self.directory)
            if not found:
                if self._state is None:
                    raise SnapshotError(f"no export in {self.directory} (no ckpt-NNNNNNNN/ "
                                        "with a manifest.json)")
                return False
            latest = found[-1]
            old = self._state
            try:
                chain = chain_of(latest)
                if old is not None and chain[-1][1].get("save_id") == \
                        old.manifest.get("save_id") and latest == old.path:
                    return False
                new = self._advance(old, chain)
            except Exception as exc:   # noqa: BLE001 -- whatever the files hold: refused
                what = str(exc) if isinstance(exc, CheckpointError) else \
                    f"{type(exc).__name__}: {exc} (a malformed manifest?)"
                raise SnapshotError(f"cannot load export {latest}: {what}; still serving "
                                    f"{old.path if old else 'nothing'}") from None
            with self._changed:
                self._state = new
                self.generation += 1
                self._changed.notify_all()
            return True

    def _advance(self, old: _State | None, chain: list) -> _State:
        """The state at the chain's last export: from ``old`` if the chain
        goes through it (only the exports after it are read), else from the
        chain's base."""
        start = 0
        if old is not None:
            at = [i for i, (p, m) in enumerate(chain)
                  if p == old.path and m.get("save_id") == old.manifest.get("save_id")]
            start = at[0] + 1 if at else 0
        path, manifest = chain[-1]
        if old is not None and start and (
                set(manifest["variables"]) != set(old.values)
                or set(manifest.get("tables", {})) != set(old.table_shards)
                or not all(same_table(info, old.manifest["tables"][name])
                           for name, info in manifest.get("tables", {}).items())):
            start = 0   # other variables or tables, or tables laid out anew: composed anew
        if start == 0:   # a new chain: composed from its base, as a restore composes it
            values = {name: load_variable(_spec(name, info), chain)["value"]
                      for name, info in manifest["variables"].items()}
            for value in values.values():
                value.setflags(write=False)
            table_shards = {name: load_table_shards(_table_spec(name, info), chain)
                            for name, info in manifest.get("tables", {}).items()}
        else:   # the exports after ours: only what they changed is read and copied
            values = {name: _advance_value(old.values[name], _spec(name, info), chain[start:])
                      for name, info in manifest["variables"].items()}
            table_shards = {}
            for name, info in manifest.get("tables", {}).items():
                t = _table_spec(name, info)
                shards = list(old.table_shards[name])
                for p, m in chain[start:]:
                    for i, e in enumerate(m["tables"][name]["shards"]):
                        shards[i] = advance_table_shard(shards[i], p, e, t, _weights(m))
                table_shards[name] = shards
        tables = {}
        for name, shards in table_shards.items():
            for state, _, _ in shards:
                for a in (state["keys"], state["values"]):
                    a.setflags(write=False)
            tables[name] = _served(shards, manifest["tables"][name], path, name)
        return _State(path, manifest, tuple(chain), values, tables, table_shards)

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.refresh()
                self.last_error = None
            except SnapshotError as exc:
                if str(exc) != str(self.last_error):
                    log.warning("%s", exc)
                self.last_error = exc

    def close(self) -> None:
        """Stop following (the state stays readable)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def lookup_rows(values: Mapping[str, np.ndarray], tables: Mapping[str, tuple], name: str,
                keys, where: str) -> np.ndarray:
    """Snapshot.lookup over ``values`` (variable -> value) and ``tables``
    (table -> ((sorted keys, rows) per shard, dim, keys -> their shard)) read
    from ``where``."""
    from psserver.contract.keys import check_keys
    try:
        keys = check_keys(keys)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    if name in tables:
        shards, dim, route = tables[name]
        flat = keys.reshape(-1)
        out = np.zeros((flat.size, dim), shards[0][1].dtype if shards else np.float32)
        which = route(flat)
        for i, (skeys, svalues) in enumerate(shards):
            sel = np.flatnonzero(which == i)
            if not sel.size or not skeys.size:
                continue
            pos = np.minimum(np.searchsorted(skeys, flat[sel]), skeys.size - 1)
            hit = skeys[pos] == flat[sel]
            out[sel[hit]] = svalues[pos[hit]]
        return out.reshape(keys.shape + (dim,))
    if name in values:
        value = values[name]
        if value.ndim == 0:
            raise ValueError(f"variable {name!r} is a scalar: it has no rows")
        if keys.size and (keys.min() < 0 or keys.max() >= value.shape[0]):
            raise IndexError(f"row ids of {name!r} must be in [0, {value.shape[0]})")
        return value[keys]
    raise KeyError(f"no table or variable {name!r} in {where}")


def table_rows(chain: list, name: str, info: dict) -> tuple[list, int]:
    """A table of the chain's last checkpoint or export as lookup_rows takes
    it: ((sorted keys, rows) per shard, dim, keys -> their shard)."""
    return _served(load_table_shards(_table_spec(name, info), chain), info, chain[-1][0], name)


def _served(shards: list, info: dict, path: str, name: str) -> tuple[list, int, Callable]:
    """load_table_shards' shards as lookup_rows takes a table."""
    return ([(s["keys"], s["values"]) for s, _, _ in shards], int(info["dim"]),
            table_router(path, name, info))


def table_router(path: str, name: str, info: Mapping[str, Any]) -> Callable:
    """keys -> the index of the shard file holding each, for table ``name`` of
    checkpoint ``path``: its "buckets" runs (psserver.contract.keys), or
    ``hash % shards`` before buckets. CheckpointError for a map that does not fit."""
    n = len(info.get("shards") or ())
    if "buckets" not in info:
        return lambda keys: legacy_shard_of(keys, n)
    try:
        return BucketMap.from_ranges(info["buckets"], n).shard_of
    except ValueError as exc:
        raise CheckpointError(f"the manifest of {path} gives table {name!r} a bucket map that "
                              f"does not fit its {n} shard(s) ({exc}); it is damaged") from None


def _weights(manifest: dict) -> bool:
    return bool(manifest.get("weights_only"))


def _spec(name: str, info: dict):
    """What the loaders need of a variable, from its manifest entry."""
    return types.SimpleNamespace(name=name, shape=tuple(info["shape"]), dtype=info["dtype"],
                                 optimizer=info["optimizer"])


def _table_spec(name: str, info: dict):
    """What the loaders need of a table (its rows, whatever its optimizer)."""
    return types.SimpleNamespace(name=name, dim=int(info["dim"]), dtype=info["dtype"],
                                 optimizer=None)


def _advance_value(value: np.ndarray, v, later: list) -> np.ndarray:
    """A variable's whole value after the exports ``later`` (copied once if
    any shard changed; read-only)."""
    out = None
    for p, m in later:
        for e in m["variables"][v.name]["shards"]:
            if e.get("kind", "full") == "unchanged":
                continue
            if out is None:
                out = value.copy()
            part = out[e["offset"]:e["offset"] + e["rows"]] if v.shape else out
            tensors, _ = advance_shard({"value": part}, None, p, e, v, _weights(m))
            if tensors["value"] is not part:   # a full shard: copied in
                part[...] = tensors["value"]
    if out is None:
        return value
    out.setflags(write=False)
    return out
