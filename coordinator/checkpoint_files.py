"""Reading checkpoints, with no parameter server involved: manifests, shard
files checked against what their manifest promises (their sizes and
checksums first: coordinator/shard_files.py), and chains of
incremental checkpoints composed into exactly the state a full checkpoint
would hold (what coordinator/checkpoint.py restores, serving.py serves).

A chain: a *base* (a full checkpoint that names a ``save_id``) and *deltas*,
each naming its parent (``manifest["chain"]``: ``parent``, the parent's
directory name beside it, and ``parent_id``, its save id: a parent replaced
since breaks the chain, and is refused). In a delta each shard entry has a
``kind``: ``full`` (its whole state, as in a base), ``delta`` (a variable's
``rows`` and only those rows of the value and per-row slots, the scalar
slots and update keys whole; a dynamic table's rows of the keys that
changed and the ``evicted`` keys), or ``unchanged`` (no file). A shard's
state at a delta is the last ``full`` entry of its history with every later
delta applied in order.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np

from coordinator.shard_files import (
    CheckpointError,
    check_checksums,
    load_shard,
    read_small,
)

#: 1: full checkpoints; 2: chains (delta, unchanged shards); 3: any with tables,
#: keyed by bucket (serving.table_router: an older reader would look in the wrong shard).
FORMAT_VERSION, CHAIN_VERSION = 3, 2
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
MAX_CHAIN = 10_000   # the longest chain followed (a loop of parents is refused before that)


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint ``path``, checked to be one this version reads."""
    try:
        manifest = json.loads(read_small(os.path.join(path, "manifest.json")))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the manifest of {path}: {exc}") from None
    saved = manifest.get("variables") if isinstance(manifest, dict) else None
    if not isinstance(saved, dict) or "step" not in manifest:
        raise CheckpointError(f"the manifest of {path} lacks its variables or step; "
                              "nothing was restored")
    version = manifest.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"the manifest of {path} has format_version {version!r}, not a "
                              "version number; it is damaged and nothing was restored")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {version}; this "
                              f"version of pstrain reads up to {FORMAT_VERSION}")
    for section in ("variables", "tables"):
        infos = manifest.get(section, {})
        bad = [name for name, info in infos.items() if not isinstance(info, dict)] \
            if isinstance(infos, dict) else [section]
        if bad:
            raise CheckpointError(f"the manifest of {path} has malformed {section} entries "
                                  f"({', '.join(map(repr, bad))}); nothing was restored")
    check_checksums(path, manifest)   # (each file's is checked as it is read: load_shard)
    return manifest


@contextlib.contextmanager
def _malformed(path: str, what: str):
    """Whatever a manifest or file that is not as written makes the readers
    raise (TypeError, AttributeError, KeyError, ValueError, IndexError)
    becomes a CheckpointError naming the checkpoint and ``what``."""
    try:
        yield
    except (TypeError, AttributeError, KeyError, ValueError, IndexError) as exc:
        raise CheckpointError(f"checkpoint {path}: {what} is malformed ({type(exc).__name__}: "
                              f"{exc}); it is damaged and nothing was restored (restore an "
                              "older one: coordinator checkpoint list)") from None


def _shard_entries(path: str, what: str, info: dict) -> list[dict]:
    """The shard entries of a manifest's ``info`` (a variable's or table's):
    a list of objects, each with a known kind, a file name (a string, but
    for an unchanged shard), integers where it has rows, offset, version
    (in [0, 2**62)), bytes, delta_rows or step. CheckpointError otherwise."""
    entries = info.get("shards")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CheckpointError(f"the manifest of {path} lists the shards of {what} as "
                              f"{type(entries).__name__}, not a list of objects; nothing was "
                              "restored")
    for i, e in enumerate(entries):
        ints = [k for k in ("rows", "offset", "version", "bytes", "delta_rows", "step")
                if k in e and (isinstance(e[k], bool) or not isinstance(e[k], int))]
        kind = e.get("kind", "full")
        if ints or kind not in ("full", "delta", "unchanged") or \
                (kind != "unchanged" and not isinstance(e.get("file"), str)) or \
                not 0 <= e.get("version", 0) < 1 << 62:
            raise CheckpointError(f"the manifest of {path} has a malformed shard {i} of {what} "
                                  f"(kind {kind!r}, file {e.get('file')!r}, version "
                                  f"{e.get('version')!r}, non-integer {ints}); nothing was "
                                  "restored")
    return entries


def find_checkpoints(directory: str) -> list[str]:
    """Complete checkpoints (ckpt-N/ with a manifest) in directory, oldest
    first, as CheckpointManager.checkpoints() sees them; [] when the
    directory does not exist."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        m = _CKPT_RE.match(name)
        path = os.path.join(directory, name)
        if m and os.path.isfile(os.path.join(path, "manifest.json")):
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def chain_of(path: str, manifest: dict | None = None) -> list[tuple[str, dict]]:
    """(path, manifest) of every checkpoint the one at ``path`` needs, its
    base first and itself last ([itself] for a full one). Raises
    CheckpointError naming the missing, replaced or unreadable link."""
    out = [(path, manifest if manifest is not None else read_manifest(path))]
    seen = {os.path.basename(path)}
    while "chain" in out[0][1]:
        child, m = out[0]
        link = m["chain"]
        parent = link.get("parent") if isinstance(link, dict) else None
        if not isinstance(parent, str) or not _CKPT_RE.match(parent) or \
                not isinstance(link.get("parent_id"), int):
            raise CheckpointError(f"the manifest of {child} names no valid parent checkpoint; "
                                  "it cannot be restored (restore a full one: coordinator "
                                  "checkpoint list)")
        if parent in seen or len(out) >= MAX_CHAIN:
            raise CheckpointError(f"the chain of {path} loops at {parent}")
        seen.add(parent)
        parent_path = os.path.join(os.path.dirname(child), parent)
        if not os.path.isfile(os.path.join(parent_path, "manifest.json")):
            raise CheckpointError(
                f"{child} holds only the changes since {parent}, which is missing: the chain "
                f"of {path} is broken and it cannot be restored (restore a checkpoint whose "
                "chain is whole: coordinator checkpoint list)")
        pm = read_manifest(parent_path)
        if pm.get("save_id") != link["parent_id"] or \
                bool(pm.get("weights_only")) != bool(m.get("weights_only")):
            raise CheckpointError(
                f"{child} holds the changes since save {link['parent_id']}, but {parent_path} "
                f"is another save ({pm.get('save_id')}; it was replaced since): the chain of "
                f"{path} is broken and it cannot be restored")
        out.insert(0, (parent_path, pm))
    return out


def _shard_history(chain, section: str, name: str, i: int, same) -> list[tuple[str, dict]]:
    """(checkpoint, entry) of shard ``i`` of ``name`` in every checkpoint of
    the chain, from its last full entry on; each checked with ``same``
    (entry of the last checkpoint, entry here) to be the same shard."""
    last_path, last = chain[-1]
    history = []
    for path, m in chain:
        info = m.get(section, {}).get(name)
        try:
            entry = info["shards"][i]
        except (TypeError, KeyError, IndexError):
            entry = None
        if entry is None or not same(last[section][name], info, i):
            raise CheckpointError(
                f"{name!r} in {path} is not the one in {last_path} (another layout, or "
                f"missing), though {last_path} is a delta of it; the chain cannot be restored")
        history.append((path, entry))
    full = [j for j, (_, e) in enumerate(history) if e.get("kind", "full") == "full"]
    if not full:
        raise CheckpointError(f"no checkpoint of the chain of {last_path} holds shard {i} of "
                              f"{name!r} whole; it cannot be restored")
    return history[full[-1]:]


def _same_variable_shard(a: dict, b: dict, i: int) -> bool:
    keys = ("shape", "dtype", "optimizer")
    cut = ("name", "offset", "rows")
    return all(a.get(k) == b.get(k) for k in keys) and \
        len(a["shards"]) == len(b["shards"]) and \
        all(a["shards"][i].get(k) == b["shards"][i].get(k) for k in cut)


def same_table(a: dict, b: dict, i: int = 0) -> bool:
    """Two manifests' entries of a table laid out alike: one's delta builds on the other."""
    return a.get("dim") == b.get("dim") and a.get("dtype") == b.get("dtype") and \
        len(a["shards"]) == len(b["shards"]) and a.get("buckets") == b.get("buckets")


def load_variable(v, chain: list[tuple[str, dict]]) -> dict:
    """The whole state of variable ``v`` (anything with name, shape, dtype,
    optimizer) at the last checkpoint of ``chain`` (chain_of's), checked:
    value, slots, optimizer parameters, versions, and per saved shard its
    version, update keys and scalar slots (``same_cut``). A weights-only
    chain (a serving export) gives the value alone."""
    path, manifest = chain[-1]
    with _malformed(path, f"variable {v.name!r}"):
        return _load_variable(v, chain)


def _load_variable(v, chain: list[tuple[str, dict]]) -> dict:
    path, manifest = chain[-1]
    info = manifest["variables"].get(v.name)
    if info is None:
        raise CheckpointError(f"variable {v.name!r} is not in checkpoint {path}")
    try:
        same = (tuple(info["shape"]), info["dtype"], info["optimizer"]) == (
            tuple(v.shape), v.dtype, v.optimizer)
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"the manifest of {path} is incomplete: {v.name!r} lacks "
                              f"{exc}; nothing was restored") from None
    entries = _shard_entries(path, f"variable {v.name!r}", info)
    if not same:
        raise CheckpointError(
            f"variable {v.name!r} is {v.dtype} {list(v.shape)} {v.optimizer} here but "
            f"{info['dtype']} {info['shape']} {info['optimizer']} in {path}")
    if not entries:
        raise CheckpointError(f"the manifest of {path} lists no shard of {v.name!r}")
    if v.shape:   # the shards must cover the rows in order, each once
        covered = 0
        for e in entries:
            if e.get("offset") != covered or not isinstance(e.get("rows"), int):
                break
            covered += e["rows"]
        if covered != v.shape[0] or e.get("offset") is None:
            raise CheckpointError(f"the shards of {v.name!r} in {path} do not cover its "
                                  f"{v.shape[0]} rows in order; nothing was restored")
    weights_only = bool(manifest.get("weights_only"))
    loaded = [_compose_shard(v, _shard_history(chain, "variables", v.name, i,
                                               _same_variable_shard), weights_only)
              for i in range(len(entries))]
    parts = [tensors for tensors, _ in loaded]
    meta = loaded[0][1]
    slots = {}
    for key in parts[0]:
        if key.startswith("slot/"):
            arrays = [p[key] for p in parts]
            slots[key[5:]] = (np.max(arrays).astype(arrays[0].dtype).reshape(())
                              if arrays[0].ndim == 0 else _join(arrays, v.shape))
    # A shard restored into the same place keeps its version, idempotency keys
    # and scalar slots (same_cut).
    return {"value": _join([p["value"] for p in parts], v.shape), "slots": slots,
            "optimizer_params": json.loads(meta.get("optimizer_params", "{}")),
            "allow_nonfinite": json.loads(meta.get("allow_nonfinite", "false")),
            "version": max(int(e["version"]) for e in entries),
            "same_cut": {(e["name"], e["offset"], e["rows"]):
                         (int(e["version"]), p.get("applied_ids", ()),
                          {k[5:]: a for k, a in p.items() if k.startswith("slot/") and a.ndim == 0})
                         for e, p in zip(entries, parts)}}


def _compose_shard(v, history: list[tuple[str, dict]], weights_only: bool):
    """(tensors, metadata) of one shard: its last full file, and every later
    delta applied in order."""
    tensors = meta = None
    for path, entry in history:
        tensors, meta = advance_shard(tensors, meta, path, entry, v, weights_only)
    return tensors, meta


def advance_shard(tensors: dict | None, meta: dict | None, path: str, entry: Mapping[str, Any],
                  v, weights_only: bool) -> tuple[dict[str, np.ndarray], dict]:
    """A variable shard's (tensors, metadata) at checkpoint ``path``, from
    those at the checkpoint before (None: none) and its ``entry`` there:
    the file of a full entry; a delta's rows applied (in place) to the
    tensors; an unchanged entry's as they were."""
    kind = entry.get("kind", "full")
    if kind == "full":
        return load_checked_shard(path, entry, v.dtype, v.shape, v.optimizer, weights_only)
    if tensors is None or kind not in ("delta", "unchanged"):
        raise CheckpointError(f"the manifest of {path} gives shard {entry.get('name')!r} the "
                              f"kind {kind!r}, which cannot follow what came before; it "
                              "cannot be restored")
    if kind == "unchanged":
        return tensors, meta
    delta, meta = load_checked_delta(path, entry, v.dtype, v.shape, v.optimizer, weights_only)
    rows = delta["rows"]
    shape = tensors["value"].shape
    for k, a in delta.items():
        if k == "rows":
            continue
        if k == "value" or (k in tensors and k.startswith("slot/")
                            and tensors[k].shape == shape):
            tensors[k][rows] = a
        else:   # scalar slots, update keys
            tensors[k] = a
    return tensors, meta


def load_checked_shard(ckpt: str, entry: Mapping[str, Any], dtype: str, shape: Sequence[int],
                       optimizer: str, weights_only: bool = False
                       ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of one shard file of checkpoint ``ckpt``, checked
    to hold all its manifest entry promises for a shard of a ``dtype``
    variable of ``shape`` (its rows) with ``optimizer``: the value, every
    slot the optimizer keeps (not ``weights_only``: a serving export), each
    of the right dtype and shape, readable metadata. Raises CheckpointError
    naming the file and what is missing."""
    return _checked(ckpt, entry, dtype, shape, optimizer, weights_only, delta=False)


def load_checked_delta(ckpt: str, entry: Mapping[str, Any], dtype: str, shape: Sequence[int],
                       optimizer: str, weights_only: bool = False
                       ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """load_checked_shard for a delta file: "rows" (strictly increasing
    int64 row numbers within the shard, as many as its entry says), those
    rows of the value and of each per-row slot, scalar slots whole."""
    return _checked(ckpt, entry, dtype, shape, optimizer, weights_only, delta=True)


def _checked(ckpt, entry, dtype, shape, optimizer, weights_only, delta):
    from psserver.contract import optimizers as optim

    try:
        file = _file_in(ckpt, entry["file"])
        rows, version = int(entry["rows"]), int(entry["version"])
        nrows = int(entry["delta_rows"]) if delta else rows
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest of {ckpt} is incomplete: a shard entry of "
                              f"{entry.get('name', '?')!r} lacks {exc}; the checkpoint cannot "
                              "be restored (restore an older one: coordinator checkpoint "
                              "list)") from None
    tensors, meta = load_shard(file, entry.get("bytes"), entry.get("crc32"))
    want = tuple(shape) if not shape else (nrows,) + tuple(shape[1:])

    def refuse(what: str):
        raise CheckpointError(f"checkpoint file {file} {what}: the checkpoint is incomplete "
                              "or damaged and nothing was restored (restore an older one: "
                              "coordinator checkpoint list)")
    value = tensors.get("value")
    if value is None:
        refuse("holds no value")
    if value.dtype.name != dtype or value.shape != want:
        refuse(f"holds a {value.dtype.name} {list(value.shape)} value, not {dtype} {list(want)}")
    if delta:
        ids = tensors.get("rows")
        if ids is None or ids.dtype != np.int64 or ids.shape != (nrows,) or not shape or (
                nrows and (ids[0] < 0 or ids[-1] >= rows or (np.diff(ids) <= 0).any())):
            refuse(f"does not hold the {nrows} increasing row numbers below {rows} its "
                   "manifest promises")
    if meta.get("optimizer", optimizer) != optimizer:
        refuse(f"was saved with optimizer {meta.get('optimizer')}, not {optimizer}")
    if not 0 <= version < 1 << 62:
        refuse(f"has version {version}")
    allowed = {"value"} | ({"rows"} if delta else set())
    if not weights_only:
        try:
            params = json.loads(meta.get("optimizer_params", "{}"))
            if not isinstance(json.loads(meta.get("allow_nonfinite", "false")), bool):
                raise ValueError("allow_nonfinite is not true or false")
            expected = optim.make_optimizer(optimizer, params).create_slots(
                np.zeros((rows,) + tuple(shape[1:]) if shape else (), np.dtype(dtype)))
        except (ValueError, TypeError) as exc:
            refuse(f"has unreadable metadata ({exc})")
        full_shape = (rows,) + tuple(shape[1:]) if shape else ()
        for name, proto in expected.items():
            got = tensors.get(f"slot/{name}")
            proto_shape = want if proto.shape == full_shape else proto.shape
            if got is None:
                refuse(f"lacks the optimizer slot {name!r} that {optimizer} keeps")
            if got.dtype != proto.dtype or got.shape != proto_shape:
                refuse(f"holds slot {name!r} as {got.dtype.name} {list(got.shape)}, not "
                       f"{proto.dtype.name} {list(proto_shape)}")
        extra = sorted(k[5:] for k in tensors if k.startswith("slot/") and k[5:] not in expected)
        if extra:
            refuse(f"holds slots {extra} that {optimizer} does not keep")
        allowed |= {"applied_ids"} | {f"slot/{n}" for n in expected}
    unknown = sorted(set(tensors) - allowed)
    if unknown and (delta or weights_only):
        refuse(f"holds arrays {unknown} a {'delta' if delta else 'serving'} file does not")
    return tensors, meta


# -- dynamic tables -----------------------------------------------------------------------------
def load_table(t, chain: list[tuple[str, dict]]) -> tuple[dict[str, np.ndarray], int]:
    """A dynamic table's rows at the last checkpoint of ``chain``, every
    shard joined and sorted by key (keys unique), and the largest shard
    step; checked against the table ``t`` (name, dim, dtype, optimizer) and
    the files against their manifests. A weights-only chain: keys and values."""
    shards = load_table_shards(t, chain)
    parts = [state for state, _, _ in shards]
    step = max((s for _, s, _ in shards), default=0)
    names = parts[0].keys() if parts else ()
    state = {k: (np.max([p[k] for p in parts]).astype(parts[0][k].dtype).reshape(())
                 if parts[0][k].ndim == 0 else np.concatenate([p[k] for p in parts]))
             for k in names}
    if state and np.unique(state["keys"]).size != state["keys"].size:
        raise CheckpointError(f"the shard files of table {t.name!r} in {chain[-1][0]} hold a "
                              "key twice; nothing was restored")
    if state:   # by key, whatever the shards were
        order = np.argsort(state["keys"], kind="stable")
        state = {k: a if a.ndim == 0 else a[order] for k, a in state.items()}
    return state, step


def check_restorable(path: str, variables: Sequence, loaded: Sequence[dict],
                     tables: Sequence = (), table_states: Sequence[tuple] = ()) -> None:
    """What a restore sends the servers, checked as they check it (values
    finite unless the variable allows otherwise; a table's rows as
    psserver.core.dynamic_table.check_rows takes them: distinct keys, finite
    rows and slots, ages and counts >= 0, its step past every age), so that
    a checkpoint they would refuse is refused (CheckpointError) before any
    of them is written."""
    from psserver.contract import optimizers as optim
    from psserver.contract.checkpoint_format import check_rows, slot_layout
    from psserver.contract.tensor import all_finite
    from psserver.errors import InvalidArgument

    for v, state in zip(variables, loaded):
        if not state["allow_nonfinite"] and not all_finite(state["value"]):
            raise CheckpointError(f"variable {v.name!r} in {path} holds NaN or Inf, which it "
                                  "does not allow; nothing was restored")
    for t, (state, step) in zip(tables, table_states):
        if not state:
            continue
        dtype = np.dtype(t.dtype)
        try:
            check_rows(state, step, t.dim, dtype,
                       *slot_layout(optim.make_optimizer(t.optimizer, {}), t.dim, dtype))
        except InvalidArgument as exc:
            raise CheckpointError(f"dynamic table {t.name!r} in {path} cannot be restored "
                                  f"({exc}); nothing was restored") from None


def load_table_shards(t, chain: list[tuple[str, dict]]) -> list[tuple]:
    """Each shard's (arrays sorted by key, step, clock) of a dynamic table
    at the last checkpoint of ``chain`` (advance_table_shard's), checked as
    load_table says."""
    path, manifest = chain[-1]
    with _malformed(path, f"dynamic table {t.name!r}"):
        return _load_table_shards(t, chain)


def _load_table_shards(t, chain: list[tuple[str, dict]]) -> list[tuple]:
    path, manifest = chain[-1]
    info = manifest.get("tables", {}).get(t.name)
    if info is None:
        from coordinator.embedding_collection import PADDED_NAME
        padded = PADDED_NAME.search(t.name) is not None
        raise CheckpointError(
            f"dynamic table {t.name!r} is not in checkpoint {path}" + (
                ": an EmbeddingCollection's padded table, named by the features in it, so "
                "the checkpoint was written with other declarations (a capacity that moved "
                "a feature in or out of it, or before tables were padded: declare the "
                "narrower features with capacity=0 to restore such a one; "
                "docs/embedding-tables.md)" if padded else ""))
    try:
        same = (int(info["dim"]), info["dtype"]) == (t.dim, t.dtype)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest of {path} is incomplete: table {t.name!r} lacks "
                              f"{exc}; nothing was restored") from None
    entries = _shard_entries(path, f"dynamic table {t.name!r}", info)
    if not same:
        raise CheckpointError(f"dynamic table {t.name!r} has dim {t.dim} {t.dtype} here but "
                              f"{info['dim']} {info['dtype']} in {path}")
    weights_only = bool(manifest.get("weights_only"))
    out = []
    for i in range(len(entries)):
        shard = None
        for p, e in _shard_history(chain, "tables", t.name, i, same_table):
            shard = advance_table_shard(shard, p, e, t, weights_only)
        out.append(shard)
    return out


def advance_table_shard(shard: tuple | None, path: str, entry: Mapping[str, Any], t,
                        weights_only: bool) -> tuple[dict[str, np.ndarray], int, float | None]:
    """A table shard's (arrays, step, clock) at checkpoint ``path`` from
    those at the checkpoint before (None: none) and its ``entry`` there: the
    file of a full entry, or the delta merged in (rows kept age by the steps
    and seconds between the two saves)."""
    if entry.get("kind", "full") == "full":
        return load_table_file(path, entry, t, weights_only, delta=False)
    if shard is None or entry.get("kind") != "delta":
        raise CheckpointError(f"the manifest of {path} gives a shard of table {t.name!r} the "
                              f"kind {entry.get('kind')!r}, which cannot follow what came "
                              "before; it cannot be restored")
    state, step, clock = shard
    delta, d_step, d_clock = load_table_file(path, entry, t, weights_only, delta=True)
    if not weights_only:   # rows kept: as old as they were, now
        if clock is None or d_step < step:
            raise CheckpointError(f"{path}: a table delta whose base lacks its clock or is at "
                                  "a later step; it cannot be restored")
        state = {**state, "age_steps": state["age_steps"] + (d_step - step),
                 "age_seconds": state["age_seconds"] + (d_clock - clock)}
    return merge_table_rows(state, delta), d_step, d_clock


def merge_table_rows(state: dict[str, np.ndarray], delta: dict[str, np.ndarray]
                     ) -> dict[str, np.ndarray]:
    """``state`` (a table's arrays, by "keys") with the rows of the delta's
    keys replaced or added and its "evicted" keys gone; scalar arrays (Adam's
    step count) the delta's. New arrays, sorted by key."""
    gone = np.concatenate([delta["keys"], delta.get("evicted", np.zeros(0, np.int64))])
    keep = ~np.isin(state["keys"], gone)
    out = {}
    for k, a in state.items():
        if a.ndim == 0:
            out[k] = delta[k]
        else:
            out[k] = np.concatenate([a[keep], delta[k]])
    order = np.argsort(out["keys"], kind="stable")
    return {k: a if a.ndim == 0 else a[order] for k, a in out.items()}


def load_table_file(ckpt: str, entry: Mapping[str, Any], t, weights_only: bool, delta: bool
                    ) -> tuple[dict[str, np.ndarray], int, float | None]:
    """(arrays, step, clock) of one table shard file, checked against its
    manifest entry and the table ``t``: "keys" (sorted, distinct) and
    "values" of its rows, and (not weights-only) the optimizer slots (any,
    with ``t.optimizer`` None: a manifest does not name it), ages and look-up
    counts; a delta's "evicted" keys apart (in the arrays). Clock: None when
    the file has none (written before incremental saves)."""
    try:
        file, rows = _file_in(ckpt, entry["file"]), int(entry["rows"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest of {ckpt} is incomplete: a shard of table "
                              f"{t.name!r} lacks {exc}; nothing was restored") from None
    tensors, meta = load_shard(file, entry.get("bytes"), entry.get("crc32"))
    keys = tensors.get("keys")
    values = tensors.get("values")
    if keys is None or keys.shape != (rows,) or keys.dtype != np.int64 or values is None or \
            values.shape != (rows, t.dim) or values.dtype.name != t.dtype:
        raise CheckpointError(f"checkpoint file {file} does not hold the {rows} rows of "
                              f"dim {t.dim} {t.dtype} its manifest promises; nothing was "
                              "restored (restore an older one: coordinator checkpoint list)")
    if rows and (np.diff(keys) <= 0).any():   # (the servers write a shard's rows by key:
        raise CheckpointError(                # a Snapshot's look-ups search them)
            f"checkpoint file {file} holds keys that are not sorted and distinct; it is "
            "damaged and nothing was restored")
    # Every other array of the file, (shape, dtype) as the servers write them.
    want = {"keys": keys, "values": values}
    if not weights_only:
        want.update({"age_steps": ((rows,), np.int64), "age_seconds": ((rows,), np.float64),
                     "freq": ((rows,), np.int64)})
        if t.optimizer is not None:
            from psserver.contract import optimizers as optim
            from psserver.contract.checkpoint_format import slot_layout
            init, per_row = slot_layout(optim.make_optimizer(t.optimizer, {}), t.dim,
                                        np.dtype(t.dtype))
            want.update({f"slot/{n}": ((rows, t.dim) if n in per_row else a.shape, a.dtype)
                         for n, a in init.items()})
    names = set(want) | ({"evicted"} if delta else set()) | (
        {n for n in tensors if n.startswith("slot/")} if t.optimizer is None else set())
    if set(tensors) != names:
        raise CheckpointError(
            f"checkpoint file {file} holds {sorted(tensors)}, not the arrays of a "
            f"{t.optimizer} table {'delta' if delta else 'shard'} ({sorted(names)}); nothing "
            "was restored")
    for name, spec in want.items():
        if isinstance(spec, tuple) and (tensors[name].shape, tensors[name].dtype) != spec:
            raise CheckpointError(
                f"checkpoint file {file} holds {name} as {tensors[name].dtype.name} "
                f"{list(tensors[name].shape)}, not {np.dtype(spec[1]).name} {list(spec[0])} "
                f"(its {rows} rows of dim {t.dim}); it is damaged and nothing was restored")
    evicted = tensors.pop("evicted", None)
    if delta and (evicted.ndim != 1 or evicted.dtype != np.int64):
        raise CheckpointError(f"checkpoint file {file}: its evicted keys are not 1-D int64")
    if delta:
        tensors["evicted"] = evicted
    try:
        step = int(meta.get("step", "0"))
        clock = float(meta["clock"]) if "clock" in meta else None
    except ValueError:
        raise CheckpointError(f"checkpoint file {file} has an unreadable step or clock") from None
    if delta and clock is None and not weights_only:
        raise CheckpointError(f"checkpoint file {file} is a table delta without a clock")
    return tensors, step, clock


def _file_in(ckpt: str, name) -> str:
    """The path of a file a manifest of checkpoint ``ckpt`` names; it must
    lie inside the checkpoint (CheckpointError: a manifest that points
    elsewhere is not read from)."""
    if not isinstance(name, str) or not name:
        raise TypeError("a file name")
    path = os.path.normpath(os.path.join(ckpt, name))
    if os.path.isabs(name) or not path.startswith(os.path.normpath(ckpt) + os.sep):
        raise CheckpointError(f"the manifest of {ckpt} names the file {name!r}, outside the "
                              "checkpoint; nothing was read from it")
    return path


def _join(arrays: list[np.ndarray], shape) -> np.ndarray:
    if not shape:
        return arrays[0]
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
