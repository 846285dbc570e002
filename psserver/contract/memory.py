"""Freed memory given back to the system. Tasks run with a high glibc trim
threshold (psserver.process.MALLOC_ENV: freed message buffers are kept, no
page faults to take them again), so large freed blocks stay resident until
``give_back_memory`` trims the heap: after a large frame (the data port's
reader, psserver/serve/ipc_server.py) and after a dynamic table's arrays
grew (the old arrays, psserver/core/dynamic_table.py), so that a server's
resident memory follows what it holds (``--max-memory-bytes``). Free of
grpc and protobuf.
"""
from __future__ import annotations


def give_back_memory() -> None:
    """Return freed heap memory to the system (glibc's malloc_trim; a no-op
    where there is none)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
