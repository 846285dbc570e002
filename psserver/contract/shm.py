"""Same-host tensor transfers through shared memory.

Loopback TCP is the slowest part of moving a large tensor between two
processes on one machine: gRPC Python moved 64 MiB at about a third of raw
TCP speed here, and raw TCP itself copies every byte twice through the
kernel. When a client and its parameter server share a host, the
``SharedMemory`` service (ps.proto) moves tensor bytes through a memory
segment instead, and its calls carry only names, shapes and offsets (Read
and Push over the task's Unix socket, Attach and Detach over gRPC):

* The client creates a segment: a memfd named ``pstrain-<hex>``, its memory
  reserved at once (``posix_fallocate``: no memory fails here, cleanly,
  instead of killing a process with SIGBUS on first touch), then sealed
  against shrinking and growing (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL).
  It maps it and calls ``Attach(name, nbytes, pid, fd)``.
* The server opens it as /proc/PID/fd/FD, checks it is that memfd (its name),
  of this user, of that size, and sealed: a segment nobody can shrink, so
  the server never touches memory that went away (a truncated file's pages
  raise SIGBUS and kill the process: a token holder could do that to a
  /dev/shm file it shared). A server on another host (another container, another
  pod) cannot open it and answers FAILED_PRECONDITION: the client's channel
  then plans without shared memory (TaskChannel.refuse; the bytes go framed
  over the socket).
* The client then closes its descriptor. From here on the memory belongs to
  the two mappings and the server's descriptor, so nothing is left behind
  when either process dies, SIGKILL included.
* ``Read``: the server copies the values into the segment under their locks;
  the client copies them out. ``Push``: the client copies the gradients in;
  the server applies them straight from the segment.

A client never uses one segment in two calls at once (``Arena`` lends each
to one call). The server maps small segments once and large ones for each
call only (``MAP_POPULATE``: 1.5 ms for 64 MiB here), so a large transfer
does not stay in its resident memory. Segments unused for ``idle_seconds``
are closed (a client that died never detaches); a client whose segment is
gone re-attaches a new one.

Asynchronous reads go further (``SharedValue``, ``MappedValue``, below): a
server moves a variable's value into a memfd when a client asks
(``SharedMemory.Share``), the client maps it read-only through
/proc/PID/fd/N and copies it out between two reads of a sequence number
(a seqlock; x86-64 only), with no call at all. Sync-mode reads, which must
wait for the step, still ask the server.

Trust: a segment is the client's memory. A client holding the cluster token
and running as the server's user can change a gradient while it is checked
(nothing stops a token holder from pushing garbage over gRPC either), but
cannot shrink the segment under the server: it is sealed.

Linux only (memfds with seals, /proc); elsewhere ``available()`` is False and the
clients use gRPC for everything.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from psserver.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

log = logging.getLogger(__name__)

NAME_PREFIX = "pstrain-"
_NAME_RE = re.compile(r"pstrain-[0-9a-f]{32}")
#: Every tensor in a segment starts at a multiple of this (cache line, and
#: any dtype's alignment).
ALIGN = 64
#: Segments up to this size stay mapped in the server between calls; larger
#: ones are mapped for each call, so they never count in its resident memory.
KEEP_MAPPED_BYTES = 4 << 20
#: The largest segment a server attaches (tmpfs memory is RAM).
MAX_SEGMENT_BYTES = 16 << 30
#: Message of the error a server gives for a segment it does not hold (closed
#: when idle, or the server restarted): the client attaches a new one.
UNKNOWN_SEGMENT = "unknown shared-memory segment"
#: Message of the error for a read larger than the segment (a variable grew).
TOO_SMALL = "too small for this read"
#: Environment switch: "0" turns shared memory off in clients and servers.
ENV = "PSTRAIN_SHM"


#: Seals every attached segment must carry.
_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
          if hasattr(fcntl, "F_SEAL_SHRINK") else 0)


def available() -> bool:
    """Whether this process may use shared memory (Linux memfds with seals,
    /proc; not switched off)."""
    return (os.environ.get(ENV, "1") != "0" and hasattr(os, "memfd_create")
            and hasattr(os, "MFD_ALLOW_SEALING") and bool(_SEALS)
            and hasattr(os, "posix_fallocate") and os.path.isdir("/proc/self/fd"))


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _map(fd: int, nbytes: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED
    if populate and hasattr(mmap, "MAP_POPULATE"):
        flags |= mmap.MAP_POPULATE
    return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _close_map(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:   # an array still views it (an exception's traceback): GC closes it
        pass


# -- server side -----------------------------------------------------------------------
@dataclass
class _Attached:
    fd: int
    nbytes: int
    kept: mmap.mmap | None   # mapped once (small segments) or None (mapped per call)
    last_used: float = field(default_factory=time.monotonic)


class Segments:
    """The segments a parameter server has attached, by id."""

    def __init__(self, idle_seconds: float = 300.0, max_segments: int = 1024,
                 max_segment_bytes: int = MAX_SEGMENT_BYTES):
        self.idle_seconds = idle_seconds
        self.max_segments = max_segments
        self.max_segment_bytes = max_segment_bytes
        self._lock = threading.Lock()
        self._by_id: dict[int, _Attached] = {}
        self._swept = time.monotonic()

    def __len__(self) -> int:
        return len(self._by_id)

    def attach(self, name: str, nbytes: int, pid: int = 0, fd: int = 0) -> int:
        """Open the client's segment ``name`` of ``nbytes`` bytes, its memfd
        ``fd`` in process ``pid``; return its id.

        Raises FailedPrecondition when there is no such segment on this host
        (the client is elsewhere), or it is not that sealed memfd of this
        user; InvalidArgument for a bad name or size.
        """
        if not available():
            raise FailedPrecondition("this parameter server does not use shared memory "
                                     f"({ENV}=0, or no sealed memfds here); use the gRPC "
                                     "transfers")
        if not _NAME_RE.fullmatch(name or ""):
            raise InvalidArgument(f"bad shared-memory segment name {name!r}: expected "
                                  f"{NAME_PREFIX} followed by 32 hex digits")
        if not 0 < nbytes <= self.max_segment_bytes:
            raise InvalidArgument(f"shared-memory segment size {nbytes} out of range "
                                  f"(1..{self.max_segment_bytes})")
        if not (0 < pid < 1 << 31 and 0 <= fd < 1 << 31):
            raise InvalidArgument(f"attach needs the client's pid and the segment's fd, got "
                                  f"{pid} and {fd}")
        self._expire()
        path = f"/proc/{pid}/fd/{fd}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise FailedPrecondition(f"cannot open shared-memory segment {name!r} ({exc}): the "
                                     "client runs elsewhere; use the gRPC transfers") from None
        try:
            st = os.fstat(fd)
            try:
                target = os.readlink(path)
            except OSError:
                target = ""
            if target != f"/memfd:{name} (deleted)" or not stat.S_ISREG(st.st_mode) or \
                    st.st_uid != os.geteuid():
                raise FailedPrecondition(f"{path} is not the memfd {name!r} of this server's "
                                         "user; refusing it")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & _SEALS != _SEALS:
                raise FailedPrecondition(
                    f"shared-memory segment {name!r} is not sealed against shrinking and "
                    "growing (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL): its memory could "
                    "vanish under this server; refusing it")
            if st.st_size != nbytes:
                raise InvalidArgument(f"shared-memory segment {name!r} has {st.st_size} bytes, "
                                      f"not the {nbytes} the request says")
            kept = _map(fd, nbytes, populate=False) if nbytes <= KEEP_MAPPED_BYTES else None
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            if len(self._by_id) >= self.max_segments:
                if kept is not None:
                    _close_map(kept)
                os.close(fd)
                raise ResourceExhausted(f"this parameter server holds {self.max_segments} "
                                        "shared-memory segments already; detach some")
            seg_id = secrets.randbits(62) + 1
            while seg_id in self._by_id:
                seg_id = secrets.randbits(62) + 1
            self._by_id[seg_id] = _Attached(fd, nbytes, kept)
        return seg_id

    def detach(self, seg_id: int) -> None:
        with self._lock:
            seg = self._by_id.pop(seg_id, None)
        if seg is not None:
            self._release(seg)

    def _release(self, seg: _Attached) -> None:
        if seg.kept is not None:
            _close_map(seg.kept)
        os.close(seg.fd)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.idle_seconds
        with self._lock:
            old = [k for k, s in self._by_id.items() if s.last_used < cutoff]
            gone = [self._by_id.pop(k) for k in old]
        for seg in gone:
            self._release(seg)

    @contextlib.contextmanager
    def mapped(self, seg_id: int) -> Iterator[memoryview]:
        """The segment's memory for one call (do not keep views past the ``with``)."""
        now = time.monotonic()
        if now - self._swept > max(1.0, min(self.idle_seconds, 30.0)):   # dead clients'
            self._swept = now
            self._expire()
        with self._lock:   # mapped before a concurrent detach can close the file
            seg = self._by_id.get(seg_id)
            if seg is None:
                raise FailedPrecondition(f"{UNKNOWN_SEGMENT} {seg_id} (closed after being "
                                         "idle, or the server restarted); attach a new one")
            seg.last_used = now
            if seg.kept is not None:
                view, m = memoryview(seg.kept), None
            else:
                m = _map(seg.fd, seg.nbytes, populate=True)
                view = memoryview(m)
        if m is None:
            yield view
            return
        try:
            yield view
        finally:
            try:
                view.release()
            except BufferError:   # an array still views it (an exception's traceback)
                pass
            _close_map(m)

    def close(self) -> None:
        with self._lock:
            segs, self._by_id = list(self._by_id.values()), {}
        for seg in segs:
            self._release(seg)


# -- client side -----------------------------------------------------------------------
class Segment:
    """A client's segment: its memory, and the id its server knows it by.
    ``fd`` (with this process's pid) is where the server opens it, until
    ``unlink()`` closes it (after attaching)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.name = NAME_PREFIX + secrets.token_hex(16)
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.posix_fallocate(fd, 0, nbytes)   # ENOSPC/ENOMEM now, not SIGBUS later
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)   # its size is fixed for good
            self._map = _map(fd, nbytes, populate=True)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.pid = fd, os.getpid()
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.seg_id = 0
        self.lent = False   # to one call now (Arena)

    def unlink(self) -> None:
        """Close this process's descriptor (the mapping stays): attached or
        not, the server needs it no more."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.unlink()
        self.array = None
        _close_map(self._map)


class Arena:
    """A client's segments for one server, each lent to one call at a time.

    ``attach(name, nbytes) -> id`` and ``detach(id)`` are the RPCs. A call
    takes a segment at least as large as it needs (a new one is made,
    rounded up to a power of two, when none is free) and gives it back.
    """

    def __init__(self, attach: Callable[["Segment"], int], detach: Callable[[int], None],
                 max_free: int = 4):
        self._attach, self._detach = attach, detach
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._max_free = max_free
        self._closed = False

    def take(self, nbytes: int) -> Segment:
        with self._lock:
            seg = None
            for s in self._free:   # the smallest that fits (few: max_free)
                if s.nbytes >= nbytes and (seg is None or s.nbytes < seg.nbytes):
                    seg = s
            if seg is not None:
                self._free.remove(seg)
                seg.lent = True
                return seg
        size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
        seg = Segment(size)
        try:
            seg.seg_id = self._attach(seg)
        except BaseException:
            seg.close()
            raise
        finally:
            seg.unlink()   # attached or not, the name is no longer needed
        seg.lent = True
        return seg

    def give(self, seg: Segment, broken: bool = False) -> None:
        """Return a segment after its call (once: a second give is ignored).
        ``broken``: never lend it again (the server no longer knows it, or may
        still be using it; it closes the segment when idle)."""
        drop: list[Segment] = []
        with self._lock:
            if not seg.lent:
                return
            seg.lent = False
            if broken or self._closed:
                drop.append(seg)
            else:
                self._free.append(seg)
                if len(self._free) > self._max_free:   # keep the largest
                    smallest = self._free[0]
                    for s in self._free:
                        if s.nbytes < smallest.nbytes:
                            smallest = s
                    self._free.remove(smallest)
                    drop.append(smallest)
        for s in drop:
            if not broken:
                with contextlib.suppress(Exception):
                    self._detach(s.seg_id)
            s.close()

    def forget(self) -> None:
        """Drop every free segment without telling the server (it restarted)."""
        with self._lock:
            segs, self._free = self._free, []
        for s in segs:
            s.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segs, self._free = self._free, []
        for s in segs:
            with contextlib.suppress(Exception):
                self._detach(s.seg_id)
            s.close()


# -- variables readers map (same host, x86-64) -------------------------------------------
#: Header of a shared variable: int64 words before its value.
HEADER_WORDS = 8
HEADER_BYTES = 64
_SEQ, _VERSION, _DEAD, _TAG = 0, 1, 2, 3


def direct_reads_available() -> bool:
    """Whether variables may be read straight from their server's memory here.

    The seqlock below relies on x86-64's ordering of stores (and of loads):
    a reader that sees the same even sequence number before and after its
    copy saw no write in between. Elsewhere reads stay calls.
    """
    import platform
    return (available() and platform.machine() in ("x86_64", "AMD64")
            and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"))


class SharedValue:
    """A variable's value in memory its clients on this host map read-only.

    Writers (the store, with the variable's lock held) wrap every change in
    ``writing()``: the sequence number is odd while the value changes and
    the version is stored before it turns even again. Readers copy the
    value between two reads of an even, unchanged sequence number
    (``read_into``), else try again: a seqlock. ``retire()`` marks it dead
    (the variable was deleted): readers map it again.
    """

    def __init__(self, value: np.ndarray, version: int):
        self.fd = os.memfd_create("pstrain-var", os.MFD_CLOEXEC)
        try:
            size = HEADER_BYTES + max(value.nbytes, 1)
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = size
        self.header = np.frombuffer(self._map, np.int64, HEADER_WORDS)
        self.value = np.frombuffer(self._map, value.dtype, value.size,
                                   HEADER_BYTES).reshape(value.shape)
        np.copyto(self.value, value)
        self.header[_VERSION] = version
        # Names this memory: a reader checks it maps the one it was told of
        # (a file descriptor number can be reused once a variable is deleted).
        self.tag = secrets.randbits(62) + 1
        self.header[_TAG] = self.tag

    @property
    def path(self) -> str:
        """Where a process of the same user on this host opens it."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    @contextlib.contextmanager
    def writing(self, var):
        self.header[_SEQ] += 1
        try:
            yield
        finally:
            self.header[_VERSION] = var.version
            self.header[_SEQ] += 1

    def retire(self) -> None:
        self.header[_SEQ] += 1
        self.header[_DEAD] = 1
        self.header[_SEQ] += 1
        self.header = self.value = None
        _close_map(self._map)
        os.close(self.fd)


class MappedValue:
    """A reader's read-only map of a SharedValue."""

    def __init__(self, path: str, dtype: str, shape, nbytes: int, tag: int):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != nbytes:
                raise OSError(f"{path} is not {nbytes} bytes")
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        self.header = np.frombuffer(self._map, np.int64, HEADER_WORDS)
        if int(self.header[_TAG]) != tag or HEADER_BYTES + n * dt.itemsize > nbytes:
            self.close()
            raise OSError(f"{path} is not the variable it was shared as")
        self.value = np.frombuffer(self._map, dt, n, HEADER_BYTES).reshape(tuple(shape))

    def read_into(self, dest: np.ndarray | None, tries: int = 64):
        """(version, array) of a consistent copy (into dest when given); False
        when the variable is gone (map it again); None when it was being
        written at every try (read through the server this time)."""
        h = self.header
        for i in range(tries):
            seq = int(h[_SEQ])
            if h[_DEAD]:
                return False
            if seq & 1:
                if i > 8:
                    time.sleep(0)
                continue
            if dest is None:
                out = self.value.copy()
            else:
                np.copyto(dest, self.value)
                out = dest
            version = int(h[_VERSION])
            if int(h[_SEQ]) == seq and not h[_DEAD]:
                return version, out
        return None

    def close(self) -> None:
        self.header = self.value = None
        _close_map(self._map)
