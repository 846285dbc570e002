"""The parameter-server task: variables, their optimizers, and the gRPC service.

Modules:
  errors      typed errors shared by server and client, and their gRPC codes
  tensor      numpy <-> wire Tensor conversion (raw little-endian bytes)
  wire        hand-framed ReadReply / PushRequest for ParameterServerBulk
  optimizers  SGD, Momentum, Adagrad, Adam, FTRL: dense and lazy sparse, in place
  sync        sync mode: one step's gradients gathered, applied once
  store       VariableStore: the parameter-server logic, no gRPC in it
  servicer    the thin gRPC servicer over a VariableStore
  server      create_server / serve / the ``psserver`` command, interceptors
  client      PSClient: the Python client workers and the coordinator use
  tls         TLS / mutual TLS credentials, LocalCluster's throwaway CA
  metrics     Prometheus: RPC interceptor, store observer, endpoints
  process     start a task as a child process and read back its address
"""
