"""The parameter-server task: variables, their optimizers, and the gRPC service.

Modules:
  errors      typed errors shared by server and client, and their gRPC codes
  tensor      numpy <-> wire Tensor conversion (raw little-endian bytes)
  optimizers  SGD, Momentum, Adagrad, Adam: dense and lazy sparse, in place
  store       VariableStore: the parameter-server logic, no gRPC in it
  servicer    the thin gRPC servicer over a VariableStore
  server      create_server / serve / the ``psserver`` command
  client      PSClient: the Python client workers and the coordinator use
"""
