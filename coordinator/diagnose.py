"""How long a task may stay silent before the coordinator names it.

What is said about it (which task, where, what to check) is the one
diagnosis every caller shares, in psserver/link/diagnose.py: clients, the
operator commands, ParameterServerStrategy (a parameter server that does not
answer its first call) and the worker threads (coordinator/worker_channel.py:
a worker that does not).
"""
from __future__ import annotations

import os

#: How long a task may not answer the coordinator's first call before it is
#: named (seconds): ParameterServerStrategy raises Unavailable for a parameter
#: server, ClusterCoordinator logs a warning for a worker and keeps waiting
#: (workers may start late; a worker whose host does not resolve or whose
#: port refuses connections is named at its first failed call). A task that
#: is up answers in milliseconds; 10 s leaves room for a slow start or a
#: loaded machine, and is short enough that a wrong address is named before
#: anyone wonders. ``PSTRAIN_CONNECT_SECONDS``.
CONNECT_SECONDS = float(os.environ.get("PSTRAIN_CONNECT_SECONDS", "10"))
