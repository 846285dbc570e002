"""TaskChannel (psserver/link/channel.py) over fake transports: the route
planned once from what the task announced, a call looked up on it, and the
one fallback rule when a socket fails under a call. Pure logic: no
processes (the real transports' contract is tests/integration/test_transport.py)."""
from __future__ import annotations

import pytest

from protos.pstrain.v1 import ps_pb2
from psserver.contract import PROTOCOL_VERSION, routing
from psserver.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotSent,
    Unavailable,
    WorkerRestarted,
    error_for,
)
from psserver.link import methods
from psserver.link.channel import TaskChannel
from psserver.link.transport import FakeTransport


class Task:
    """A fake task: its gRPC port answers GetServerInfo with an offer of a
    Unix socket on this host (and a data port), every other call "grpc";
    its socket answers "socket", or the next outcome of ``script`` (an
    exception is raised); ``refuse``: raised by the socket's send."""

    def __init__(self, *script, refuse=None, server_id="id-1", shared_memory=False):
        self.script, self.refuse, self.server_id = list(script), refuse, server_id
        self.shared_memory = shared_memory
        self.grpc = FakeTransport(self._grpc)
        self.unix = _Socket(self, routing.UNIX)
        self.info_asked = 0

    def _grpc(self, method, request):
        if method is methods.SERVER_INFO:
            self.info_asked += 1
            info = ps_pb2.ServerInfo(protocol_version=PROTOCOL_VERSION, server_id=self.server_id)
            routing.announce(info.host, ipc_socket="@fake", shared_memory=self.shared_memory,
                             data_port=7000)
            return info
        return "grpc"

    def channel(self) -> TaskChannel:
        return TaskChannel("127.0.0.1:9", transports={"grpc": self.grpc, "unix": self.unix})


class _Socket(FakeTransport):
    def __init__(self, task: Task, kind: str):
        super().__init__(self._answer, kind)
        self.task = task

    def _answer(self, method, request):
        outcome = self.task.script.pop(0) if self.task.script else "socket"
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def send(self, method, request, timeout, **kw):
        if self.task.refuse is not None:
            raise self.task.refuse
        return super().send(method, request, timeout, **kw)


def test_the_route_is_planned_once_and_each_call_takes_its_transport():
    task = Task()
    ch = task.channel()
    assert ch.plan.socket == routing.UNIX and not ch.plan.shm
    assert ch.call(methods.GATHER, b"") == "socket"
    assert ch.send(methods.PUSH_SPARSE, b"").result() == "socket"
    assert ch.call(methods.META, ps_pb2.VariableRef()) == "grpc"   # gRPC only
    assert ch.call(methods.SHM_PUSH, b"") == "grpc"   # needs shared memory: not offered
    assert task.info_asked == 1 and ch.task_id == "id-1"
    assert [m for m, _ in task.grpc.requests] == [methods.SERVER_INFO, methods.META,
                                                 methods.SHM_PUSH]


def test_a_call_never_sent_goes_over_grpc_and_the_route_is_planned_again():
    task = Task(refuse=NotSent("connection refused"))
    ch = task.channel()
    assert ch.plan.socket == routing.UNIX
    assert ch.call(methods.PUSH_SPARSE, b"") == "grpc"   # safe: nothing ran
    assert ch.current is None and ch.socket is None      # asked again on the next call
    task.refuse = None
    assert ch.call(methods.PUSH_SPARSE, b"") == "socket" and task.info_asked == 2


def test_a_refusal_at_the_hello_is_not_sent_either():
    task = Task(refuse=error_for(16, "wrong token"))   # Unauthenticated, raised by send
    ch = task.channel()
    ch.plan
    assert ch.call(methods.GATHER, b"") == "grpc"


def test_a_read_lost_in_flight_is_read_again_over_grpc():
    task = Task(Unavailable("connection reset"))
    ch = task.channel()
    assert ch.call(methods.GATHER, b"") == "grpc"   # idempotent: made again
    assert ch.socket is None


def test_an_update_lost_in_flight_is_not_resent_and_fails_unavailable():
    task = Task(Unavailable("connection reset"))
    ch = task.channel()
    sent = ch.send(methods.PUSH_SPARSE, b"")
    with pytest.raises(Unavailable):   # applied or not: the caller resends with its key
        sent.result()
    assert ch.socket is None and methods.PUSH_SPARSE not in [m for m, _ in task.grpc.requests]


def test_an_error_of_the_call_itself_keeps_the_socket():
    task = Task(InvalidArgument("bad ids"))
    ch = task.channel()
    with pytest.raises(InvalidArgument):
        ch.call(methods.GATHER, b"")
    assert ch.socket is task.unix and ch.call(methods.GATHER, b"") == "socket"


def test_post_and_recover_apply_on_every_way_a_call_goes():
    task = Task(Unavailable("reset"))
    ch = task.channel()
    # lost on the socket, made again over gRPC: post still makes the value
    assert ch.send(methods.GATHER, b"", post=str.upper).result() == "GRPC"
    task.script = [InvalidArgument("bad")]
    assert ch.send(methods.GATHER, b"", recover=lambda e: "answered").result() == "answered"


def test_a_refused_route_is_planned_without_until_the_task_restarts():
    task = Task(shared_memory=True)
    ch = task.channel()
    assert ch.plan.shm and ch.incarnation == 0
    ch.refuse(routing.SHM)   # the server could not open this process's segments
    assert ch.plan.socket == routing.UNIX and not ch.plan.shm
    assert "refused" in ch.plan.why
    task.server_id = "id-2"   # restarted: its offer is taken as it comes again
    ch.ask()
    assert ch.plan.shm and ch.incarnation == 1 and ch.task_id == "id-2"


def test_a_worker_fence_is_its_own_error():
    """ABORTED from a worker is its fence (WorkerRestarted); from a parameter
    server, a copy that is not primary (NotPrimary)."""
    assert isinstance(error_for(10, "fenced", "w", methods.WORKER), WorkerRestarted)
    assert not isinstance(error_for(10, "not primary", "ps", methods.PS), WorkerRestarted)


def test_a_task_of_another_protocol_version_is_refused_before_any_call():
    """The client's half of the version check (the task's own interceptor
    is the other): a task announcing another version in its ServerInfo is
    refused, naming both versions, and no call is sent to it."""
    task = Task()
    sent = []

    def answer(method, request):
        if method is methods.SERVER_INFO:
            return ps_pb2.ServerInfo(protocol_version=PROTOCOL_VERSION + 1, server_id="s-new")
        sent.append(method)
        return "grpc"

    task.grpc = FakeTransport(answer)
    ch = task.channel()
    with pytest.raises(FailedPrecondition) as info:
        ch.ask()
    assert f"speaks pstrain protocol {PROTOCOL_VERSION + 1}" in str(info.value)
    assert f"this client speaks {PROTOCOL_VERSION}" in str(info.value)
    with pytest.raises(FailedPrecondition):   # a data call plans first: refused too
        ch.call(methods.GATHER, b"")
    assert sent == []
