"""A task on the wire: the serve layer.

``server`` starts a parameter server (gRPC, its Unix socket and data port,
health, metrics, the argument and auth kit psworker shares), ``servicer``
and ``tables`` answer the ParameterServer services over the core layer's
stores, ``ipc_server`` and ``rpc`` take requests as bytes off sockets and
gRPC, ``forwarder`` sends a primary's updates to its backup, and
``task_metrics`` says what a task exports. Imports every layer below it;
nothing but psworker and the ``psserver`` command imports it.
"""
