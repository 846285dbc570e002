"""The pure parts of coordinator/collective.py's all-reduce: the rule that
chooses an algorithm, how an array is cut into chunks, a group's id, the
signature every chunk carries (its operation's shapes, dtype, compression,
mean and algorithm), the checks of a chunk taken, float16 narrowing, and
which arrays fuse into one buffer. No sockets, no threads.
"""
from __future__ import annotations

import hashlib

import numpy as np

from psserver.contract import wire_decode
from psserver.errors import InvalidArgument

#: Array dtypes an all-reduce takes.
DTYPES = (np.float16, np.float32, np.float64)
#: all_reduce's compressions: the dtype chunks travel in (None: the array's).
COMPRESSIONS = {None: None, "fp16": np.dtype(np.float16)}
#: Bytes of arrays all_reduce_many fuses into one buffer at most (Horovod's
#: default fusion threshold).
FUSION_BYTES = 64 << 20
#: all_reduce's algorithms (``algorithm=None``: ``choose_algorithm``'s).
ALGORITHMS = ("ring", "direct")
#: The direct all-reduce is chosen for arrays up to this many bytes, in
#: groups of 3 up to DIRECT_MAX_MEMBERS members (see ``choose_algorithm``).
DIRECT_MAX_BYTES = 1 << 20
DIRECT_MAX_MEMBERS = 8
#: The largest array the direct all-reduce takes when named (it sends all
#: its chunks before it takes any: they wait in the others' inboxes).
DIRECT_LIMIT_BYTES = 16 << 20
#: Seconds between a direct member's looks at its sends' answers while it
#: waits for a chunk (a refused chunk fails the operation then, not at its
#: timeout).
DIRECT_POLL_SECONDS = 0.05


def group_id(name: str) -> bytes:
    """The 16-byte id every member derives from a group's name."""
    return hashlib.blake2b(name.encode(), digest_size=wire_decode.COLLECTIVE_GROUP_BYTES).digest()


def choose_algorithm(nbytes: int, members: int) -> str:
    """The all-reduce an array of ``nbytes`` takes in a group of ``members``
    (every member decides alike: the same array shape and dtype, the same
    group). Both send each member's 2(n - 1)/n of the array's bytes. The ring
    does it in 2(n - 1) steps one after another, each a hop to the next
    member: one link busy a step, large arrays pipelined in pieces. The
    direct one in 2: each member sends chunk j to member j at once, sums its
    own chunk of every member's, and sends that sum to all; n - 1 links busy
    at once. With a hop costing more than the bytes (small and mid-sized
    arrays; a hop is a few thread wake-ups and a system call or two), direct
    takes fewer of them: up to DIRECT_MAX_BYTES and DIRECT_MAX_MEMBERS
    members, measured in docs/speed.md. Two members: the ring (it is the
    same two steps)."""
    return "direct" if 3 <= members <= DIRECT_MAX_MEMBERS and \
        nbytes <= DIRECT_MAX_BYTES else "ring"


def chunk_bounds(size: int, n: int) -> list[tuple[int, int]]:
    """n contiguous chunks of ``size`` elements, sizes differing by one at most."""
    edges = [size * i // n for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def chunk_signature(shape: tuple, dtype: np.dtype, wire_dtype: np.dtype, average: bool,
               agree: bytes = b"", algorithm: str = "ring") -> int:
    text = f"{tuple(shape)}/{dtype.str}/{wire_dtype.str}/{bool(average)}/{algorithm}/".encode() \
        + agree
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def first_refusal(sent: list) -> BaseException | None:
    """The error of the first answered send that failed (a refused chunk), or None."""
    for pending in sent:
        if pending.done():
            try:
                pending.result()
            except Exception as exc:
                return exc
    return None


def check_chunk(got: np.ndarray, signature: int, into: np.ndarray, wire_dtype, want: int,
           sender: str) -> None:
    if signature != want or got.dtype != wire_dtype or got.shape != into.shape:
        raise InvalidArgument(
            f"{sender} sent a chunk of an operation on another array than this member's: the "
            "members' arrays (or compressions) differ in shape or dtype, or they call the "
            "group's operations in another order")


def narrow(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype`` (float16), finite values beyond its range clipped
    to its largest (not turned into Inf), NaN and Inf kept."""
    with np.errstate(over="ignore"):
        out = a.astype(dtype)
    over = np.isinf(out) & np.isfinite(a)
    if over.any():
        out[over] = np.copysign(np.finfo(dtype).max, a[over])
    return out


def fusion_batches(arrays: list, limit: int = FUSION_BYTES) -> list[list[int]]:
    """Indexes of ``arrays`` in fusion buffers: one dtype each, in order,
    at most ``limit`` bytes (an array larger than that alone)."""
    out, open_ = [], {}   # dtype -> (indexes, bytes) of its buffer being filled
    for i, a in enumerate(arrays):
        batch = open_.get(a.dtype)
        if batch is not None and batch[1] + a.nbytes > limit:
            out.append(batch[0])
            batch = None
        if batch is None:
            batch = ([], 0)
        batch[0].append(i)
        open_[a.dtype] = (batch[0], batch[1] + a.nbytes)
    out += [b for b, _ in open_.values()]
    return out
