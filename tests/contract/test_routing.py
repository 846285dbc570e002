"""The route table (psserver/contract/routing.py), as a table: no processes."""
import pytest

from psserver.contract import routing as R

ME = R.Host("boot-a", net_ns=10, pid_ns=20, uid=1000)
SOCK = "@pstrain-ipc-x"


def offer(host=ME, ipc_socket=SOCK, shared_memory=True, data_port=7000):
    return R.Offer(host, ipc_socket, shared_memory, data_port)


# (what the server announced, client switches) -> (socket, shm)
TABLE = [
    ("same host and namespaces", offer(), {}, (R.UNIX, True)),
    ("same host, another pid namespace", offer(R.Host("boot-a", 10, 21, 1000)), {},
     (R.UNIX, False)),
    ("same host, another user (its socket refuses us)", offer(R.Host("boot-a", 10, 20, 0)), {},
     (R.TCP, False)),
    ("same host, no segments offered", offer(shared_memory=False), {}, (R.UNIX, False)),
    ("memory shared, network not", offer(R.Host("boot-a", 11, 20, 1000)), {}, (R.TCP, False)),
    ("memory shared, network not, no data port",
     offer(R.Host("boot-a", 11, 20, 1000), data_port=0), {}, (R.GRPC, False)),
    ("another host", offer(R.Host("boot-b", 10, 20, 1000)), {}, (R.TCP, False)),
    ("another host, no data port", offer(R.Host("boot-b", 10, 20, 1000), data_port=0), {},
     (R.GRPC, False)),
    ("same host, no Unix socket offered", offer(ipc_socket=""), {}, (R.TCP, False)),
    ("same host, same-host paths off here", offer(), {"same_host_ok": False}, (R.TCP, False)),
    ("same host, everything off here", offer(), {"same_host_ok": False, "data_ok": False},
     (R.GRPC, False)),
    ("another host, data port off here", offer(R.Host("boot-b", 10, 20, 1000)),
     {"data_ok": False}, (R.GRPC, False)),
    ("a server that announces nothing (all zero)", R.Offer(), {}, (R.GRPC, False)),
    ("a server that announces only a data port", R.Offer(data_port=7000), {}, (R.TCP, False)),
]


@pytest.mark.parametrize("case, theirs, switches, expected", TABLE, ids=[t[0] for t in TABLE])
def test_plan(case, theirs, switches, expected):
    p = R.plan(ME, theirs, **switches)
    assert (p.socket, p.shm) == expected, p.why
    assert p.why


def test_a_client_that_cannot_read_proc_is_never_same_host():
    """Unknown namespaces (0) or boot id ("") match nothing, not each other."""
    blind = R.Host()
    assert R.plan(blind, offer(blind)).socket == R.TCP
    assert R.plan(R.Host("boot-a", 0, 0, 1000), offer(R.Host("boot-a", 0, 0, 1000))).socket \
        == R.TCP


CALLS = [
    # plan, the call needs shared memory -> socket
    (R.Plan(R.UNIX, True), True, R.UNIX),
    (R.Plan(R.UNIX, True), False, R.UNIX),
    (R.Plan(R.UNIX, False), True, R.GRPC),
    (R.Plan(R.UNIX, False), False, R.UNIX),
    (R.Plan(R.TCP), True, R.GRPC),
    (R.Plan(R.TCP), False, R.TCP),
    (R.Plan(), True, R.GRPC),
    (R.Plan(), False, R.GRPC),
]


@pytest.mark.parametrize("p, shm, expected", CALLS)
def test_carries(p, shm, expected):
    assert R.carries(p, shm) == expected


def test_the_calls_are_one_table():
    """Every unary gRPC method of the protocol is one Method (streams
    aside); socket ids unique and clear of the frame protocol's own (hello,
    identity); the shared-memory calls are SharedMemory's; each Method
    stands for its gRPC method with the same messages."""
    from psserver.link import methods
    ids = [m.id for m in methods.SOCKET]
    assert len(set(ids)) == len(ids) and not {methods.HELLO, methods.IDENTITY} & set(ids)
    assert all(0 < i < 256 for i in ids)
    assert [m for m in methods.ALL if m.id is not None] == list(methods.SOCKET)
    assert {m.name for m in methods.ALL if m.shm} == {"Read", "Push"}
    assert all(m.service == methods.SHM and m.id is not None for m in methods.ALL if m.shm)
    from protos.pstrain.v1 import ps_pb2, tables_pb2, worker_pb2
    services = {**ps_pb2.DESCRIPTOR.services_by_name, **worker_pb2.DESCRIPTOR.services_by_name,
                **tables_pb2.DESCRIPTOR.services_by_name}
    unary = {(s.full_name, d.name) for s in services.values() for d in s.methods
             if not (d.client_streaming or d.server_streaming)}
    paths = [(m.service, m.name) for m in methods.ALL]
    assert len(set(paths)) == len(paths) and set(paths) == unary
    for m in methods.ALL:   # each stands for a real gRPC method of the same messages
        desc = services[m.service.rsplit(".", 1)[1]].methods_by_name[m.name]
        if m.request is not None:
            assert desc.input_type.full_name == m.request.DESCRIPTOR.full_name, m
        if m.reply is not None:
            assert desc.output_type.full_name == m.reply.DESCRIPTOR.full_name, m


def test_this_host_reads_this_process():
    h = R.this_host()
    assert h.boot_id and h.net_ns and h.pid_ns and h.uid >= 0
    assert R.plan(h, offer(h)).socket == R.UNIX


def test_announce_and_offer_round_trip():
    from protos.pstrain.v1 import ps_pb2
    msg = R.announce(ps_pb2.HostInfo(), ipc_socket=SOCK, shared_memory=True, data_port=9)
    got = R.offer_of(ps_pb2.HostInfo.FromString(msg.SerializeToString()))
    assert got == R.Offer(R.this_host(), SOCK, True, 9)


# -- the form of one data call (routing.form), as a table ------------------------------
SHM_PLAN = R.Plan(R.UNIX, True, "same host")
UNIX_PLAN = R.Plan(R.UNIX, False, "another pid namespace")
TCP_PLAN = R.Plan(R.TCP, False, "another host")
GRPC_PLAN = R.Plan(R.GRPC, False, "no socket")
LIMITS = R.Limits(frame_bytes=1000, stream_bytes=100, message_bytes=500)

# (op, tensor bytes, plan, keywords) -> form
FORMS = [
    (R.READ, 10, SHM_PLAN, {"direct": True}, R.DIRECT),
    (R.READ, 10, SHM_PLAN, {"direct": True, "sync": True}, R.SEGMENT),   # a sync read waits
    (R.READ, 10, SHM_PLAN, {}, R.SEGMENT),
    (R.READ, 10, SHM_PLAN, {"segments": False}, R.FRAME),   # made again without its segment
    (R.PUSH, 5000, SHM_PLAN, {}, R.SEGMENT),
    (R.PUSH, 1000, UNIX_PLAN, {}, R.FRAME),
    (R.PUSH, 1001, UNIX_PLAN, {}, R.STREAM),   # past a frame: gRPC's streams
    (R.READ, 1000, TCP_PLAN, {"direct": True}, R.FRAME),   # no shared memory: not direct
    (R.PUSH, 100, GRPC_PLAN, {}, R.UNARY),
    (R.PUSH, 101, GRPC_PLAN, {}, R.STREAM),
    (R.GATHER, 10, SHM_PLAN, {}, R.SEGMENT),
    (R.GATHER, 2000, TCP_PLAN, {}, R.STREAM),   # past a frame and a message: several calls
    (R.GATHER, 500, GRPC_PLAN, {}, R.UNARY),     # a gather may fill a message
    (R.GATHER, 501, GRPC_PLAN, {}, R.STREAM),
    (R.TABLE, 10, SHM_PLAN, {}, R.FRAME),        # table parts never take segments
    (R.TABLE, 1000, TCP_PLAN, {}, R.FRAME),
    (R.TABLE, 1001, TCP_PLAN, {}, R.STREAM),    # past a frame and a message: several calls
    (R.TABLE, 500, GRPC_PLAN, {}, R.UNARY),
    (R.TABLE, 501, GRPC_PLAN, {}, R.STREAM),
]


@pytest.mark.parametrize("op, nbytes, plan, kw, want", FORMS,
                         ids=[f"{op}-{n}-{p.socket or 'grpc'}{'-shm' if p.shm else ''}-"
                              f"{'-'.join(sorted(kw)) or 'plain'}" for op, n, p, kw, _ in FORMS])
def test_the_form_of_each_data_call(op, nbytes, plan, kw, want):
    assert R.form(op, nbytes, plan, LIMITS, **kw) == want
