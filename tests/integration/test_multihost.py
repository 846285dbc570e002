"""Training across test hosts (bench/hosts.py): every task on a host of its
own (its own network, mount, IPC and PID namespaces, a private /dev/shm),
joined by links that are shaped, cut and healed. Nothing here shares memory
or a local socket with anything else: what works here works between
machines."""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import host_gate
import numpy as np
import pytest

from bench import hosts
from coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    LocalCluster,
    ParameterServerStrategy,
)
from coordinator.step_calls import push_gradients
from psserver.client import PSClient
from psserver.contract import TOKEN_ENV
from psserver.errors import Unavailable
from psserver.process import child_env, start_task
from psserver.tls import generate_self_signed

pytestmark = host_gate.marks(240)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = 8


def _accuracy(output: str) -> float:
    m = re.search(r"^test accuracy: ([0-9.]+)$", output, re.M)
    assert m, f"no test accuracy printed:\n{output[-3000:]}"
    return float(m.group(1))


def test_digits_trains_across_hosts_as_it_does_on_one(tmp_path):
    """Two parameter servers, two workers and the coordinator (the digits
    example as the chief of a TF_CONFIG cluster), five hosts, mutual TLS with
    a certificate naming the hosts: the same accuracy as a LocalCluster on
    one host."""
    with hosts.TestHosts(5) as h, \
            LocalCluster(2, 2, placement=h.placement(ps=[0, 1], worker=[2, 3])) as cluster:
        spec = cluster.spec
        assert all(a.startswith("198.18.") for a in spec.ps + spec.worker)
        tf_config = {"cluster": {"chief": [f"{h.addresses[4]}:2222"], "ps": spec.ps,
                                 "worker": spec.worker},
                     "task": {"type": "chief", "index": 0}}
        env = child_env({TOKEN_ENV: cluster.token, **cluster.tls.env(),
                         "TF_CONFIG": json.dumps(tf_config)})
        across = subprocess.run(
            h.run(4) + [sys.executable, "examples/digits.py", "--cluster", "tf_config",
                        "--verbose", "2"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
        assert across.returncode == 0, across.stdout[-3000:] + across.stderr[-3000:]
    one = subprocess.run([sys.executable, "examples/digits.py", "--no-plot", "--verbose", "2"],
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=150)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    acc_across, acc_one = _accuracy(across.stdout), _accuracy(one.stdout)
    assert acc_across >= 0.90 and acc_one >= 0.90, (acc_across, acc_one)
    assert abs(acc_across - acc_one) <= 0.04, (acc_across, acc_one)   # async: not bit-equal


def test_tls_holds_a_server_to_the_host_its_certificate_names(tmp_path):
    """A certificate naming the server's host is accepted from another host;
    one naming only another host is refused, before any call is served."""
    with hosts.TestHosts(2) as h:
        good = generate_self_signed(str(tmp_path / "good"), hosts=(h.addresses[0],))
        wrong = generate_self_signed(str(tmp_path / "wrong"), hosts=(h.addresses[1],))
        tasks = [start_task("psserver", ["--host", h.addresses[0], "--port", "0"],
                            env={TOKEN_ENV: "t", **cfg.env()}, prefix=h.run(0))
                 for cfg in (good, wrong)]
        try:
            with PSClient(tasks[0].address, token="t", tls=good, timeout=10) as c:
                c.create_variable("w", (4,), initializer="ones")
                np.testing.assert_array_equal(c.read("w"), np.ones(4))
                assert c.route.socket == "tcp"   # the data port, over the same TLS
            with PSClient(tasks[1].address, token="t", tls=wrong, timeout=5) as c:
                with pytest.raises(Unavailable):
                    c.list_variables()
        finally:
            for t in tasks:
                t.kill()


# -- links cut and healed ------------------------------------------------------------------
def _counting_table(strategy):
    return strategy.create_variable("w", initial_value=np.zeros((ROWS, 4), np.float32),
                                    optimizer="sgd", optimizer_params={"learning_rate": 1.0})


def counting_step(w_var, where: str = "PSTRAIN_TEST_HOST"):
    """Each step adds 1 to every element (SGD, lr 1, gradient -1) and says
    which worker ran it (the worker's environment variable ``where``)."""
    shape = tuple(w_var.shape)

    def step():
        push_gradients([(w_var, -np.ones(shape, np.float32))])
        return os.environ.get(where, "")
    return step


def counting_both(w_var, table, keys):
    """counting_step on the variable and on the dynamic table's ``keys``."""
    step = counting_step(w_var)

    def both():
        table.lookup(keys)
        table.push_gradient(keys, -np.ones((keys.size, table.dim), np.float32))
        return step()
    return both


def _host_cluster(h: hosts.TestHosts, **kw) -> LocalCluster:
    """2 parameter servers on hosts 0 and 1, 2 workers on 2 and 3 (each
    worker says its host in PSTRAIN_TEST_HOST); this process, the
    coordinator, is on the switch as a host of its own."""
    place = h.placement(ps=[0, 1], worker=[2, 3])

    def placement(role, index):
        addr, prefix = place(role, index)
        return addr, ["env", f"PSTRAIN_TEST_HOST={addr}", *prefix]
    return LocalCluster(2, 2, placement=placement, **kw)


def _run_through(coord, step, n: int, during) -> list:
    """Schedule n steps, call during() while they run, return their results."""
    scheduled = [coord.schedule(step) for _ in range(n // 2)]
    during()
    scheduled += [coord.schedule(step) for _ in range(n - n // 2)]
    return coord.fetch(scheduled)


def test_a_dynamic_table_trains_across_hosts_over_the_data_ports():
    """A dynamic embedding table over 2 parameter servers on hosts of their
    own, looked up and trained by workers on 2 other hosts: keys spread
    over both servers, the workers' look-ups and updates take the data ports,
    the rows learn their targets."""
    from psserver.client import PSClient
    keys = np.random.default_rng(5).integers(-2**63, 2**63 - 1, 200, dtype=np.int64)

    def target(k):
        return np.repeat(((k % 5) - 2).astype(np.float32)[:, None], 8, axis=1)

    with hosts.TestHosts(4) as h, _host_cluster(h) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        table = strategy.create_embedding_table("emb", 8, optimizer="sgd",
                                                optimizer_params={"learning_rate": 0.5})

        def step(seed):
            from coordinator.ps_pool import client_for
            batch = keys[np.random.default_rng(seed).integers(0, keys.size, 64)]
            rows = table.lookup(batch)
            table.push_gradient(batch, rows - target(batch))
            routes = {client_for(a).route.socket for a in table.addresses}
            return float(np.mean((rows - target(batch)) ** 2)), sorted(routes), \
                os.environ.get("PSTRAIN_TEST_HOST", "")
        with ClusterCoordinator(strategy) as coord:
            out = coord.fetch([coord.schedule(step, args=(i,)) for i in range(100)])
        losses = [o[0] for o in out]
        assert {tuple(o[1]) for o in out} == {("tcp",)}          # the data ports
        assert {o[2] for o in out} == {h.addresses[2], h.addresses[3]}   # both workers
        assert np.mean(losses[-10:]) < 0.05 * losses[0], losses
        np.testing.assert_allclose(table.lookup(keys, admit=False), target(keys), atol=0.05)
        shares = []
        for address in cluster.spec.ps:
            with PSClient(address, token=cluster.spec.token, tls=strategy.tls) as c:
                shares.append(c.table_info("emb").rows)
                c.list_tables()
                assert c.channel.plan.socket == "tcp"   # the coordinator's too
        assert sum(shares) == 200 and min(shares) > 60, shares


def test_an_embedding_step_with_two_closures_per_worker_across_hosts():
    """(b)'s step across hosts, with two closures at once on each worker: a
    table sharded over both servers, looked up together with a dense
    variable (one call per server, the data ports) and pushed row-wise with
    the dense gradient (one call per server); every update lands exactly once."""
    from coordinator import IndexedSlices, read_variables
    from coordinator.ps_pool import client_for
    vocab, dim, n = 1000, 4, 120

    def ids_of(seed):
        return np.random.default_rng(seed).integers(0, vocab, (8, 8))   # duplicates too

    with hosts.TestHosts(4) as h, _host_cluster(h) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        sgd = dict(optimizer="sgd", optimizer_params={"learning_rate": 1.0})
        table = strategy.create_variable("t", initial_value=np.zeros((vocab, dim), np.float32),
                                         **sgd)
        head = strategy.create_variable("head", initial_value=np.zeros((dim,), np.float32), **sgd)
        assert len({sh.address for sh in table.shards}) == 2

        def step(seed):
            began = time.monotonic()   # one clock for every host (no time namespaces)
            ids = ids_of(seed)
            rows, _ = read_variables([table.lookup(ids), head])
            assert rows.shape == (8, 8, dim)
            push_gradients([(table, IndexedSlices(-np.ones((ids.size, dim), np.float32),
                                                  ids.ravel())),
                            (head, -np.ones(dim, np.float32))])
            return os.environ.get("PSTRAIN_TEST_HOST", ""), began, time.monotonic()

        def routes():   # learnt by the first call (meanwhile, other threads: gRPC)
            return sorted({client_for(sh.address).route.socket for sh in table.shards})

        with ClusterCoordinator(strategy, closures_per_worker=2) as coord:
            out = coord.fetch([coord.schedule(step, args=(i,)) for i in range(n)])
            assert coord.fetch([coord.schedule(routes) for _ in range(4)]) == [["tcp"]] * 4
        assert {o[0] for o in out} == {h.addresses[2], h.addresses[3]}   # both workers
        overlapped = set()   # hosts where two steps ran at once
        for host in {o[0] for o in out}:
            spans = sorted(o[1:] for o in out if o[0] == host)
            if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
                overlapped.add(host)
        assert overlapped, "no worker ran two steps at once"
        want = np.zeros(vocab, np.float32)
        for i in range(n):
            np.add.at(want, ids_of(i).ravel(), 1)
        got, got_head = read_variables([table, head])
        np.testing.assert_array_equal(got, np.repeat(want[:, None], dim, axis=1))
        np.testing.assert_array_equal(got_head, np.full(dim, n, np.float32))


def test_a_parameter_server_cut_off_for_20s_loses_nothing_acknowledged():
    """Replication on: parameter server 0's host is cut off (both ways) for
    20 s mid-training, then healed. Every step completes, and the variable
    and the dynamic table (its shards replicated too) hold exactly one
    update per acknowledged step."""
    keys = np.random.default_rng(3).integers(-2**63, 2**63 - 1, 64, dtype=np.int64)
    with hosts.TestHosts(4) as h, _host_cluster(h) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = _counting_table(strategy)
        table = strategy.create_embedding_table("dynamic_count", 2, optimizer="sgd",
                                                optimizer_params={"learning_rate": 1.0})
        with ClusterCoordinator(strategy, ps_check_interval=0.5,
                                ps_failover_after=5.0) as coord:
            step = counting_both(w, table, keys)
            done = threading.Event()

            def cut_for_20s():
                h.cut(0)
                threading.Timer(20.0, lambda: (h.heal(0), done.set())).start()
            results = _run_through(coord, step, 60, cut_for_20s)
            assert done.wait(30)
            results += coord.fetch([coord.schedule(step) for _ in range(20)])
            coord.join()
            value = w.read()
            # its shards failed over to their backups, and were rebuilt once it answered
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)
            rows = table.lookup(keys, admit=False)
    np.testing.assert_array_equal(value, np.full((ROWS, 4), len(results), np.float32))
    np.testing.assert_array_equal(rows, np.full((keys.size, 2), len(results), np.float32))


def test_a_worker_cut_off_has_its_closures_run_elsewhere_and_rejoins():
    with hosts.TestHosts(4) as h, _host_cluster(h) as cluster:
        strategy = ParameterServerStrategy(cluster.spec,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = _counting_table(strategy)
        with ClusterCoordinator(strategy) as coord:
            step = counting_step(w)
            coord.fetch([coord.schedule(step) for _ in range(10)])
            h.cut(2)   # worker 0's host
            during = coord.fetch([coord.schedule(step) for _ in range(30)])
            assert during.count(h.addresses[3]) >= 29   # one may have run on 0 before the cut
            h.heal(2)
            rejoined = set()
            # Until worker 0 takes closures again: its connection comes back when TCP
            # retransmits (backing off while cut) or gRPC reconnects; seconds, not rounds.
            deadline = time.monotonic() + 90
            while h.addresses[2] not in rejoined and time.monotonic() < deadline:
                rejoined |= set(coord.fetch([coord.schedule(step) for _ in range(6)]))
            assert h.addresses[2] in rejoined
            coord.join()
            value = w.read()
    # every step at least once (a closure cut mid-flight may have run twice)
    assert (value >= 40 + 6).all()


def test_a_one_way_cut_of_a_parameter_server_is_survived():
    """Parameter server 0 hears nothing for 10 s while its own packets still
    leave (one direction dropped): the job waits, then goes on, nothing lost."""
    with hosts.TestHosts(4) as h, _host_cluster(h) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True,
                                           variable_partitioner=FixedShardsPartitioner(2))
        w = _counting_table(strategy)
        with ClusterCoordinator(strategy, ps_check_interval=0.5, ps_failover_after=5.0) as coord:
            step = counting_step(w)
            done = threading.Event()

            def one_way():
                h.cut(0, hosts.IN)
                threading.Timer(10.0, lambda: (h.heal(0, hosts.IN), done.set())).start()
            results = _run_through(coord, step, 40, one_way)
            assert done.wait(20)
            results += coord.fetch([coord.schedule(step) for _ in range(10)])
            coord.join()
            value = w.read()
            assert coord.cluster.recovery.wait_for_recoveries(1, timeout=60)   # failed over, rebuilt
    np.testing.assert_array_equal(value, np.full((ROWS, 4), len(results), np.float32))


def test_training_over_shaped_links():
    """Every host's link at 1 Gbit/s (and 1 ms each way where the kernel
    can delay packets): a dense model trains and every update lands once."""
    with hosts.TestHosts(4) as h:
        delay = "1ms" if hosts.netem_available() else None
        for i in range(4):
            h.shape(i, rate="1gbit", delay=delay)
        with _host_cluster(h) as cluster:
            strategy = ParameterServerStrategy(cluster.spec,
                                               variable_partitioner=FixedShardsPartitioner(2))
            big = strategy.create_variable("big", initial_value=np.zeros((512, 1024), np.float32),
                                           optimizer="sgd",
                                           optimizer_params={"learning_rate": 1.0})

            def step():   # 2 MiB read and 2 MiB pushed per step
                value = big.read()
                push_gradients([(big, -np.ones_like(value))])
                return float(value[0, 0])
            with ClusterCoordinator(strategy) as coord:
                seen = coord.fetch([coord.schedule(step) for _ in range(30)])
                coord.join()
                value = big.read()
        # the parameter servers' traffic went through the shaped queues
        assert all(h.sent(i, d) > 30 * (2 << 20) // 2 for i in (0, 1)
                   for d in (hosts.IN, hosts.OUT))
    np.testing.assert_array_equal(value, np.full((512, 1024), 30, np.float32))
    assert max(seen) <= 29


def _guide_blocks() -> list[str]:
    """The bash blocks of docs/several-machines.md's five-machine guide (before
    "One machine, by hand")."""
    with open(os.path.join(ROOT, "docs", "several-machines.md")) as f:
        text = f.read()
    section = text[:text.index("One machine, by hand")]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def test_the_several_machines_guide_works_as_written(tmp_path):
    """docs/several-machines.md, its commands as written, on five
    test hosts: the machine names replaced by the hosts' addresses, run from
    a directory outside the repository with the repository on PYTHONPATH (as
    the guide allows), the install line skipped (this test runs in that
    install). Digits reaches 0.90 with mutual TLS, the token and fixed ports,
    and leaves its checkpoints in the guide's directory."""
    import signal
    setup, certs, tasks = _guide_blocks()[:3]
    with hosts.TestHosts(5) as h:
        names = dict(zip(("ps0.example", "ps1.example", "w0.example", "w1.example",
                          "chief.example"), h.addresses))

        def as_here(line: str) -> str:
            for name, addr in names.items():
                line = line.replace(name, addr)
            return line
        exports = [as_here(ln) for ln in setup.splitlines() if ln.startswith("export ")]
        assert len(exports) == 3 and "TF_CONFIG" in exports[2], setup
        os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")   # the script's path
        # as on a machine of its own: the repository on PYTHONPATH, the install's
        # commands on PATH, nothing of this test's (child_env ties a task to its parent)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
        env.update(PYTHONPATH=ROOT, PATH=os.path.dirname(sys.executable) + os.pathsep
                   + os.environ.get("PATH", ""))
        made = subprocess.run(["sh", "-c", as_here(certs.strip())], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0 and (tmp_path / "certs" / "ca.crt").exists(), made.stderr
        started = []
        try:
            chief = None
            for line in tasks.strip().splitlines():
                command, _, where = line.partition("# on ")
                script = "\n".join(exports + [command.strip()])
                host = list(names).index(where.strip())
                if where.strip() == "chief.example":
                    chief = (host, script)
                    continue
                log = open(tmp_path / f"{where.strip()}.log", "w")
                started.append(subprocess.Popen(
                    h.run(host) + ["sh", "-c", script], cwd=tmp_path, env=env,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
                log.close()
            assert chief is not None and len(started) == 4, tasks
            run = subprocess.run(h.run(chief[0]) + ["sh", "-c", chief[1]], cwd=tmp_path,
                                 env=env, capture_output=True, text=True, timeout=200)
        finally:
            for p in started:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    logs = "".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in tmp_path.glob("*.log"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + logs
    assert _accuracy(run.stdout) >= 0.90
    assert "workers 2" in run.stdout or "2 workers" in run.stdout, run.stdout[-3000:]
    # the servers took the guide's --checkpoint-dir: the chief's checkpoints were written
    # (issue 35 item 5: without it a save was refused with PERMISSION_DENIED)
    assert "ckpt-00000500" in os.listdir(tmp_path / "ckpt"), run.stdout[-3000:]
