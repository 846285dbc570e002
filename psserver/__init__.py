"""The parameter-server task and the Python client, one package split by layer.

Layers (ARCHITECTURE.md; tests/contract/test_layers.py enforces who imports whom):
  contract/   what every role agrees on, free of grpc and protobuf: constants,
              the wire formats (wire, wire_decode, tensor), transport choice
              (routing), keys -> shards, shared memory, the checkpoint format,
              TF_CONFIG, the optimizers' arithmetic (optimizers, rows)
  core/       the server's state and rules: VariableStore, TableStore, one
              ShardRegistry and MemoryBudget, replication, sync, saving
  link/       one channel to any task: frames, Pending, Transport (gRPC,
              sockets, fake), TaskChannel, the method table, gRPC options
  client/     PSClient (data calls) on PSAdmin (control calls)
  serve/      the task on the wire: the ``psserver`` command, the servicers,
              socket and gRPC request handling, replication forwarding

Public tools any role uses (they import the contract layer only):
  errors      the typed errors (``except psserver.errors.PSError``)
  tls         TLS / mutual TLS credentials, LocalCluster's throwaway CA
  metrics     Prometheus registry and endpoint (what tasks export: serve/task_metrics)
  process     start a task as a child process and read back its address
  profiling   PSTRAIN_PROFILE: cProfile of the calls a task serves
"""
from psserver import _moved

_moved.install()   # the old module paths, deprecated (docs/client.md, "Moved names")
