"""The Python client of one parameter server (psserver/client/data.py).

``PSClient`` makes every call: the data calls (reads, pushes, row look-ups,
dynamic tables; each ``x_async`` returns a ``Pending``) and the control
calls it takes from ``PSAdmin`` (create, delete, metadata, checkpoints,
replication, tables' lifecycle), which also stands alone.
"""
from psserver.client.admin import PSAdmin, table_spec
from psserver.client.data import PSClient
from psserver.client.results import Snapshot

__all__ = ["PSAdmin", "PSClient", "Snapshot", "table_spec"]
