"""The client side of the wire: how a call reaches a task.

  frames       the socket frame protocol both ends of a task's sockets speak
  pending      Pending: the one future type (a call's result to come)
  transport    Transport.send: GrpcTransport, SocketTransport, FakeTransport
  channel      TaskChannel: plans the route once, the one fallback rule
  grpc_common  gRPC options both ends use, the retry policy from methods.IDEMPOTENT
"""
