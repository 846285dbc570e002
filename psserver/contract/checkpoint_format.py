"""A dynamic table shard's rows as checkpoint files and imports carry them:
the arrays ``DynamicTable.export`` makes ("keys", "values", "age_steps",
"age_seconds", "freq", "slot/<name>"), the optimizer slots a shard keeps per
row (``slot_layout``), the checks an import and a checkpoint reader apply
to them (``check_rows``) and the name of a shard's file (``table_file``);
the checksum every checkpoint file's manifest entry carries (``CHECKSUM``,
``crc32_of_file``, ``crc32_of_parts``).

Apart from the table (psserver/core/dynamic_table.py) so that the coordinator's
checkpoint reader (coordinator/checkpoint_files.py) checks a file's rows the
way a server would, before any server is written, without the server's
data structure. Pure numpy.
"""
from __future__ import annotations

import os
import urllib.parse
import zlib
from typing import Iterable

import numpy as np

from psserver.contract import TABLE_PREFIX
from psserver.contract.keys import check_keys
from psserver.errors import InvalidArgument


def table_file(name: str) -> str:
    """A table shard's checkpoint file name: "~table~" (psserver.contract.TABLE_PREFIX,
    which starts no variable's file: psserver/core/saving.py quotes names, and "~"
    is no character of a name) and the quoted table name."""
    return TABLE_PREFIX + urllib.parse.quote(name, safe="") + ".safetensors"


def slot_layout(optimizer, dim: int, dtype) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """(a table's optimizer slots for one row, the names of its per-row
    ones): what a shard of ``dim`` ``dtype`` rows keeps with ``optimizer``."""
    init = optimizer.create_slots(np.zeros((1, dim), dtype))
    return init, tuple(optimizer.array_slots(init))


def check_rows(state: dict, step: int, dim: int, dtype, slot_init: dict,
               row_slots: tuple) -> tuple:
    """export()'s arrays as import_rows takes them (a shard of ``dim``
    ``dtype`` rows whose optimizer keeps ``slot_init``, ``row_slots`` a row
    each), checked whole: (keys, values, age_steps, age_seconds, freq,
    {slot: array}) converted, or InvalidArgument saying what is wrong. A
    checkpoint's rows are checked with it before any server is written."""
    keys = check_keys(state.get("keys", np.zeros(0, np.int64))).reshape(-1)
    n = keys.size

    def need(name, shape, kinds, dtype):
        if name not in state and (n or name.startswith("slot/") and not shape):
            raise InvalidArgument(f"dynamic table import: {name} is missing")
        a = np.asarray(state.get(name, np.zeros(shape, dtype)))
        if a.shape != shape or a.dtype.kind not in kinds:
            raise InvalidArgument(f"dynamic table import: {name} must be {kinds!r}-kind "
                                  f"of shape {shape}, got {a.dtype} {a.shape}")
        return a.astype(dtype, copy=False)
    values = need("values", (n, dim), "f", dtype)
    age_steps = need("age_steps", (n,), "iu", np.int64)
    age_seconds = need("age_seconds", (n,), "f", np.float64)
    freq = need("freq", (n,), "iu", np.int64)
    slots = {}
    for name, init in slot_init.items():
        shape = (n, dim) if name in row_slots else np.shape(init)
        kinds = "f" if name in row_slots else "iuf"
        slots[name] = need(f"slot/{name}", shape, kinds, init.dtype)
    extra = sorted(set(state) - {"keys", "values", "age_steps", "age_seconds", "freq"}
                   - {f"slot/{m}" for m in slot_init})
    if extra:
        raise InvalidArgument(f"dynamic table import: unknown arrays {extra}")
    if not (keys[1:] > keys[:-1]).all() and np.unique(keys).size != n:   # (sorted: unique)
        raise InvalidArgument("dynamic table import: keys must be unique")
    if not (np.isfinite(values).all() and all(np.isfinite(a).all() for a in slots.values())
            and np.isfinite(age_seconds).all()):
        raise InvalidArgument("dynamic table import: NaN or Inf in the rows; nothing imported")
    if n and (age_steps.min() < 0 or freq.min() < 0 or age_seconds.min() < 0):
        raise InvalidArgument("dynamic table import: negative ages or counts")
    if not isinstance(step, int) or not 0 <= step < 1 << 62 or \
            (n and step < age_steps.max()):
        raise InvalidArgument(f"dynamic table import: step {step!r} must be in "
                              "[0, 2**62) and at least every row's age_steps")
    return keys, values, age_steps, age_seconds, freq, slots


#: The most occurrences one look-up may say a key had.
MAX_COUNT = 1 << 31


def fsync_dir(path: str) -> None:
    """Make a directory's entries (names renamed or made in it) durable;
    nothing where the directory cannot be opened (a platform without it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- checksums ----------------------------------------------------------------------------------
#: The checksum of every file a manifest lists (issue 33 item 7: a shard file
#: with one bit flipped, of the same size, was loaded and served). Each
#: shard entry of a manifest that says ``"checksum": CHECKSUM`` has
#: ``"crc32"``: zlib's CRC-32 of the file's bytes, as the parameter server
#: that wrote it computed them (psserver/core/save_files.py), checked by
#: every reader before anything is taken from the file
#: (coordinator/shard_files.py). CRC-32 finds every flipped bit, every
#: burst of up to 32 bits and other damage but 1 in 2**32; it is 2.2 GB/s
#: here against SHA-256's 1.3 (a 64 MiB file: 29 ms against 49). It detects
#: damage (a disk, a copy, a bit that rots), not an attacker: whoever can
#: rewrite a file can rewrite the manifest's checksum beside it.
CHECKSUM = "crc32"
#: Bytes read at a time when a checksum is computed from a file.
CHECKSUM_CHUNK = 4 << 20


def crc32_of_file(fd: int, size: int) -> int:
    """CRC-32 of the first ``size`` bytes of the open file ``fd`` (from its
    start, whatever its offset), read in CHECKSUM_CHUNK pieces. Raises
    OSError, EOFError where the file is shorter."""
    buf = bytearray(min(size, CHECKSUM_CHUNK))
    view = memoryview(buf)
    crc, pos = 0, 0
    while pos < size:
        n = os.preadv(fd, [view[:min(len(buf), size - pos)]], pos)
        if n <= 0:
            raise EOFError(f"the file ends at byte {pos}, before {size}")
        crc = zlib.crc32(view[:n], crc)
        pos += n
    return crc


def crc32_of_parts(parts: Iterable) -> int:
    """CRC-32 of the bytes of ``parts`` (bytes, or arrays: their bytes as
    they are in memory) one after another, as if they were one file."""
    crc = 0
    for part in parts:
        if isinstance(part, np.ndarray):
            part = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        crc = zlib.crc32(part, crc)
    return crc
