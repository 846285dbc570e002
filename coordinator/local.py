"""LocalCluster: real psserver and psworker processes on this machine.

    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)

Every task is a child process bound to a free port on 127.0.0.1 (or where
``placement`` puts it: a test host, bench/hosts.py). The
cluster makes a fresh auth token, and a throwaway CA and certificate, and
gives them to every task: all calls are mutual TLS with the token, so
functions sent by value are accepted and nothing else on the machine can
call the tasks or read the traffic (``tls=False`` turns TLS off). ``cluster.spec`` always describes the tasks running now:
``add_worker()`` grows it while a job runs, and the coordinator picks the new
worker up. Leaving the ``with`` block (or ``stop()``) ends every process.

The tasks run in sessions of their own: a Ctrl-C at the terminal reaches
only the program, which stops them as its ``with`` blocks unwind (a program
killed outright leaves none behind either: each task watches its parent,
``PSTRAIN_PARENT_PID``). ``run_main(main)`` makes that quiet for a
program's entry point: one line, no traceback, exit status 130.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import weakref
from concurrent import futures
from typing import Any, Callable, Sequence

from coordinator.cluster_spec import ClusterSpec
from psserver.contract import TOKEN_ENV
from psserver.process import TaskProcess, start_task
from psserver.tls import TLSConfig, generate_self_signed


def _tls_root() -> str:
    return os.path.join(tempfile.gettempdir(), f"pstrain-tls-{os.geteuid()}")


def _tls_dir() -> str:
    """A new directory for a LocalCluster's throwaway CA and key, named by
    this process's pid, under a per-user root (mode 0700); first the
    directories of LocalClusters whose process is gone (killed: SIGKILL runs
    no cleanup) are removed, so their private keys do not pile up."""
    root = _tls_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if not os.path.isdir(root) or os.path.islink(root) or st.st_uid != os.geteuid():
        raise RuntimeError(f"{root} is not a directory of this user: remove it")
    os.chmod(root, 0o700)
    for name in os.listdir(root):
        pid = name.split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _user_pythonpath() -> str:
    """This process's own import paths (not the interpreter's), for the tasks.

    Step functions sent by reference are imported on the workers, so they must
    find the user's modules the way this process does: its working directory,
    its script's directory, and any path the script added to sys.path.
    """
    interpreter = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths = [os.getcwd()]
    for p in sys.path:
        if not p or "site-packages" in p or "dist-packages" in p:
            continue
        real = os.path.realpath(p)
        if any(real == q or real.startswith(q + os.sep) for q in interpreter):
            continue
        if p not in paths:
            paths.append(p)
    return os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])


#: Exit status of a program stopped by Ctrl-C: 128 + SIGINT, as shells report it.
EXIT_INTERRUPTED = 128 + signal.SIGINT

#: LocalClusters of this process whose tasks are running (for run_main's words).
_running: "weakref.WeakSet[LocalCluster]" = weakref.WeakSet()


def plural(n: int, word: str) -> str:
    """"1 worker", "2 workers"."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def description(doc: str) -> str:
    """A program's --help description: its docstring's first paragraph on
    one line (a first line alone stops mid-sentence where it wraps)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


#: How to install what the torch examples need (docs/checkpoints.md says the
#: same: tests/integration/test_examples.py).
TORCH_INSTALL = ('pip install torch --index-url https://download.pytorch.org/whl/cpu && '
                 'pip install -e ".[torch,examples]"')


def import_torch(script: str, as_main: bool):
    """``torch``, for an example that needs it. Without it a script run as
    itself (``as_main``) exits saying how to install it; an import raises
    ModuleNotFoundError saying the same."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        message = f"{script} needs PyTorch (its CPU build is enough): {TORCH_INSTALL}"
        if as_main:
            sys.exit(message)
        raise ModuleNotFoundError(message, name="torch") from exc
    return torch


def run_main(main: Callable[..., Any], *args: Any) -> int:
    """Run ``main(*args)``, a program's entry point; return its exit status.

    Ctrl-C (SIGINT) ends it promptly and quietly: one line on stderr,
    "interrupted; stopping the cluster" (a LocalCluster is running) or
    "interrupted; stopping", then KeyboardInterrupt unwinds the program's
    ``with`` blocks (a ClusterCoordinator cuts its closures in flight, which
    end CANCELLED rather than re-queued; a LocalCluster stops its tasks),
    and the status is 130 (``EXIT_INTERRUPTED``), without a traceback. A
    second Ctrl-C while stopping ends the program at once (its tasks follow
    within a second). Use it as ``sys.exit(run_main(main))``.
    """
    def interrupted(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_DFL)   # a second Ctrl-C: at once
        print("interrupted; stopping the cluster" if len(_running) else "interrupted; stopping",
              file=sys.stderr, flush=True)
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        main(*args)
        return 0
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, previous)


class LocalCluster:
    """Args:
      num_ps, num_workers: how many tasks of each role to start (num_ps 0:
        workers only, for an all-reduce job).
      token: the auth token (default: a new random one).
      tls: True (default) makes a CA and certificate for mutual TLS; False
        runs plaintext; or a psserver.tls.TLSConfig to use.
      restart: roles whose tasks are started again, on the same port, when
        they die (as docker-compose's and Kubernetes' restart policies do).
        Default ("ps",): a killed parameter server comes back (empty; the
        coordinator restores it). Add "worker" to restart workers too.
      ps_args, worker_args: extra command-line arguments for those tasks.
      checkpoint_dirs: where the parameter servers may write checkpoint
        shards (``psserver --checkpoint-dir``; a CheckpointManager directory
        must lie under one). Default: the current directory and the system's
        temporary directory.
      env: extra environment variables for every task.
      pin_workers: bind worker i to one CPU (``psworker --cpus``): the i-th
        of the CPUs this process may use, round robin. Each worker then keeps
        its core and its caches (as MPI and Horovod bind ranks to cores);
        measured on a 2-core machine with 2 workers: about 3% more steps/s.
        Off by default: on a machine other work shares it only helps when
        there are no more workers than free cores.
      placement: where each task runs: ``placement(role, index)`` ("ps" or
        "worker") -> (the address it binds, a command prefix that runs it
        there). Default: 127.0.0.1 on this machine. bench/hosts.py's
        ``TestHosts.placement`` puts each task on a test host of its own;
        the TLS certificate then names every address of the tasks started
        with the cluster, and where it puts the next ps and worker (add_ps,
        add_worker).
    """

    def __init__(self, num_ps: int = 2, num_workers: int = 2, *, token: str | None = None,
                 ps_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, start_timeout: float = 60.0,
                 tls: bool | TLSConfig = True, restart: tuple[str, ...] = ("ps",),
                 pin_workers: bool = False, checkpoint_dirs: tuple[str, ...] | None = None,
                 placement: Callable[[str, int], tuple[str, Sequence[str]]] | None = None):
        if num_ps < 0 or num_ps + num_workers < 1:
            raise ValueError("a cluster needs num_ps >= 0 and at least one task (0 parameter "
                             "servers: for ParameterServerStrategy(mode=\"allreduce\"))")
        if num_workers < 0:
            raise ValueError("num_workers must be >= 0")
        self.token = token or secrets.token_hex(16)
        if checkpoint_dirs is None:
            checkpoint_dirs = (os.getcwd(), tempfile.gettempdir())
        for d in checkpoint_dirs:   # (a server refuses a missing one: made here, as asked)
            os.makedirs(d, exist_ok=True)
        self._ps_args = tuple(a for d in checkpoint_dirs
                              for a in ("--checkpoint-dir", os.path.abspath(d))) + tuple(ps_args)
        self._worker_args = tuple(worker_args)
        self._pin_cpus = sorted(os.sched_getaffinity(0)) if pin_workers else None
        self._placement = placement
        self._tls_dir = None
        if tls is True:
            self._tls_dir = _tls_dir()
            names = ["127.0.0.1", "localhost", "::1"]
            names += sorted({self._where(role, i)[0] for role, n in (("ps", num_ps),
                                                                    ("worker", num_workers))
                             for i in range(n)} - set(names))
            names += sorted(set(self._spare_hosts(num_ps, num_workers)) - set(names))
            tls = generate_self_signed(self._tls_dir, hosts=tuple(names))
        self.tls: TLSConfig | None = tls or None
        self._env = {TOKEN_ENV: self.token, "PYTHONPATH": _user_pythonpath(),
                     **(self.tls.env() if self.tls else {}), **(env or {})}
        self._timeout = start_timeout
        self._restart = tuple(restart)
        self._stopping = threading.Event()
        self.restarts = 0   # tasks restarted by the supervisor
        self._lock = threading.Lock()
        self.ps: list[TaskProcess] = []
        self.workers: list[TaskProcess | None] = []
        try:
            with futures.ThreadPoolExecutor(max(1, num_ps + num_workers)) as pool:
                ps = [pool.submit(self._start, "ps", i) for i in range(num_ps)]
                ws = [pool.submit(self._start, "worker", i) for i in range(num_workers)]
                self.ps = [f.result() for f in ps]
                self.workers = [f.result() for f in ws]
        except BaseException:
            self.stop()
            raise
        _running.add(self)
        for i in range(len(self.ps)):
            self._supervise("ps", i)
        for i in range(len(self.workers)):
            self._supervise("worker", i)

    def _tasks(self, role: str) -> list:
        return self.ps if role == "ps" else self.workers

    def _supervise(self, role: str, index: int) -> None:
        """Start the task again on its port whenever it exits, until stop()."""
        if role not in self._restart:
            return

        def watch() -> None:
            while not self._stopping.is_set():
                with self._lock:
                    task = self._tasks(role)[index]
                if task is None:
                    return
                task.proc.wait()
                if self._stopping.is_set():
                    return
                with self._lock:
                    if self._tasks(role)[index] is not task:   # replaced by hand
                        continue
                try:
                    new = self._start(role, index, port=task.address.rsplit(":", 1)[1])
                except RuntimeError:
                    if self._stopping.wait(0.5):   # port still held: try again shortly
                        return
                    continue
                with self._lock:
                    self._tasks(role)[index] = new
                    self.restarts += 1
        threading.Thread(target=watch, name=f"LocalCluster-supervise-{role}{index}",
                         daemon=True).start()

    def _args(self, role: str, index: int) -> tuple[str, ...]:
        if role == "ps":
            return self._ps_args
        if self._pin_cpus is None:
            return self._worker_args
        return ("--cpus", str(self._pin_cpus[index % len(self._pin_cpus)]), *self._worker_args)

    def _spare_hosts(self, num_ps: int, num_workers: int) -> list[str]:
        """Where the placement puts the next task of each role (add_ps,
        add_worker), if it says: the certificate names them too."""
        out = []
        for role, n in (("ps", num_ps), ("worker", num_workers)):
            try:
                out.append(self._where(role, n)[0])
            except (IndexError, KeyError, ValueError):   # (a placement of fixed size)
                pass
        return out

    def _where(self, role: str, index: int) -> tuple[str, Sequence[str]]:
        return ("127.0.0.1", ()) if self._placement is None else self._placement(role, index)

    def _start(self, role: str, index: int, port: str = "0") -> TaskProcess:
        host, prefix = self._where(role, index)
        module = "psserver" if role == "ps" else "psworker"
        return start_task(module, ["--host", host, "--port", port, *self._args(role, index)],
                          env=self._env, timeout=self._timeout, prefix=prefix, own_session=True)

    @property
    def spec(self) -> "LocalClusterSpec":
        """The cluster as it is now (a ClusterSpec whose cluster_spec() stays current)."""
        return LocalClusterSpec(self)

    def snapshot(self) -> ClusterSpec:
        with self._lock:
            return ClusterSpec(ps=[p.address for p in self.ps],
                               worker=[w.address for w in self.workers if w is not None],
                               token=self.token, tls=self.tls)

    def add_worker(self) -> int:
        """Start one more worker; return its index. The coordinator adopts it."""
        with self._lock:
            next_index = len(self.workers)
        w = self._start("worker", next_index)
        with self._lock:
            self.workers.append(w)
            index = len(self.workers) - 1
        self._supervise("worker", index)
        return index

    def add_ps(self) -> str:
        """Start one more parameter server; return its address (give it to
        ClusterCoordinator.add_parameter_server: the job does not take it
        by itself)."""
        with self._lock:
            next_index = len(self.ps)
        p = self._start("ps", next_index)
        with self._lock:
            self.ps.append(p)
        self._supervise("ps", next_index)
        return p.address

    def restart_worker(self, index: int) -> None:
        """SIGKILL worker ``index`` (if running) and start a new one on its address.

        The spec does not change; the coordinator reconnects to the new
        process, re-creates its datasets and re-queues what the old one lost.
        """
        if "worker" in self._restart:
            raise ValueError("workers are restarted by the cluster itself (restart includes "
                             "\"worker\"): kill the process and it comes back")
        with self._lock:
            old = self.workers[index]
        if old is None:
            raise ValueError(f"worker {index} was removed with kill_worker; use add_worker")
        old.kill()
        new = self._start("worker", index, port=old.address.rsplit(":", 1)[1])
        with self._lock:
            self.workers[index] = new

    def kill_worker(self, index: int) -> None:
        """SIGKILL a worker and drop it from the spec."""
        with self._lock:
            w, self.workers[index] = self.workers[index], None
        if w is not None:
            w.kill()

    def kill_ps(self, index: int) -> None:
        """SIGKILL parameter server ``index`` (restarted if "ps" is in restart)."""
        with self._lock:
            task = self.ps[index]
        task.kill()

    def stop(self) -> None:
        """Stop every task (SIGTERM, then SIGKILL after a grace period): the
        workers first, then the parameter servers, so that a step a worker is
        still running (its coordinator was interrupted) ends against servers
        that answer, instead of waiting out the worker's grace period."""
        self._stopping.set()
        _running.discard(self)
        with self._lock:
            groups = ([t for t in self.workers if t is not None], list(self.ps))
        for tasks in groups:
            for t in tasks:
                if t.alive():
                    t.signal(signal.SIGTERM)
            for t in tasks:
                t.terminate(timeout=10)
        if self._tls_dir:
            shutil.rmtree(self._tls_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalClusterSpec(ClusterSpec):
    """A ClusterSpec that re-reads its LocalCluster on each cluster_spec() call."""

    def __init__(self, cluster: LocalCluster):
        snap = cluster.snapshot()
        super().__init__(ps=snap.ps, worker=snap.worker, chief=snap.chief, token=snap.token,
                         tls=snap.tls)
        object.__setattr__(self, "_cluster", cluster)

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster.snapshot()
