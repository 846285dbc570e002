"""Start a task (``psserver``, ``psworker``) as a child process on a free port.

Used by LocalCluster and the tests. The child binds port 0 and prints
``<role> listening on HOST:PORT`` once serving; ``start_task`` reads that
line (with a deadline) so the caller knows the real address, as TensorFlow's
multi-process test clusters pass the bound address back over a pipe.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from typing import Sequence

_LISTENING = re.compile(r"^(\w+) listening on (\S+)$")

#: BLAS threads per child process. Several tasks share the machine's cores;
#: numpy's default of one BLAS thread per core oversubscribes them badly.
DEFAULT_BLAS_THREADS = "1"


class TaskProcess:
    """A running child task. ``address`` is where it listens."""

    def __init__(self, proc: subprocess.Popen, address: str, role: str, log_lines: list[str],
                 group: bool = False):
        self.proc, self.address, self.role = proc, address, role
        self.log_lines = log_lines   # everything the child printed (filled by a thread)
        # Started through a prefix (a test host): signals go to its process
        # group, so they reach the task behind `unshare --fork` (which ignores
        # SIGTERM itself).
        self._group = group

    def signal(self, sig: int) -> None:
        """Send sig to the task (see __init__)."""
        if self._group:
            try:
                os.killpg(self.proc.pid, sig)
                return
            except ProcessLookupError:
                pass
        self.proc.send_signal(sig)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def task_pid(self) -> int:
        """The pid of the task itself (as this machine's /proc sees it): the
        same as ``pid`` unless a prefix forked on the way (a test host's
        ``unshare --fork``)."""
        return innermost_pid(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait up to timeout, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
        return self.proc.wait()

    def output(self) -> str:
        return "".join(self.log_lines)


def innermost_pid(pid: int) -> int:
    """Follow a chain of single children down from pid (wrappers that fork
    once, then wait): the last one."""
    for _ in range(8):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = f.read().split()
        except OSError:
            return pid
        if len(children) != 1:
            return pid
        pid = int(children[0])
    return pid


#: glibc malloc settings for tasks. By default buffers of 128 KiB and more
#: come from mmap and go back to the OS when freed, so every message-sized
#: copy touches fresh pages: measured ~1,350 page faults per 1.33 MB read on a
#: parameter server, and SerializeToString of that reply 1,092 us against
#: 182 us once memory is kept (bench/suite.py profile). Keeping freed memory
#: for reuse made the MLP benchmark's steps 1.2x faster and left a parameter
#: server's resident memory at 1.35x its variables (target <= 1.5x). The
#: Dockerfile sets the same for deployed tasks.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, DEFAULT_BLAS_THREADS)
    for var, value in MALLOC_ENV.items():
        env.setdefault(var, value)
    env["PSTRAIN_PARENT_PID"] = str(os.getpid())   # the task ends if this process dies
    env["PYTHONUNBUFFERED"] = "1"
    # The child imports this repository's packages even when not installed.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def start_task(module: str, args: Sequence[str] = (), *, env: dict[str, str] | None = None,
               timeout: float = 30.0, prefix: Sequence[str] = (),
               own_session: bool = False) -> TaskProcess:
    """Run ``python -m module args`` and wait until it prints its address.
    ``prefix``: a command that execs the rest (``ip netns exec NAME``: the
    task runs on a test host, bench/hosts.py). ``own_session``: start it in
    a session (and process group) of its own, as a prefixed task is, so a
    Ctrl-C at the terminal reaches only this program, which stops its tasks
    itself (LocalCluster); the task still ends when this process is gone
    (``PSTRAIN_PARENT_PID``).

    Raises RuntimeError (with the child's output) if it exits or stays silent
    for ``timeout`` seconds; the child is killed then.
    """
    proc = subprocess.Popen([*prefix, sys.executable, "-m", module, *args], env=child_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL,
                            start_new_session=bool(prefix) or own_session)
    lines: list[str] = []
    found: "queue.Queue[tuple[str, str] | None]" = queue.Queue()

    def pump() -> None:   # reads the child's output for its whole life
        announced = False
        for line in proc.stdout:
            lines.append(line)
            m = _LISTENING.match(line.strip())
            if m and not announced:
                announced = True
                found.put((m.group(1), m.group(2)))
        if not announced:
            found.put(None)

    threading.Thread(target=pump, name=f"{module}-output-{proc.pid}", daemon=True).start()
    try:
        got = found.get(timeout=timeout)
    except queue.Empty:
        got = None
    if got is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{module} did not start within {timeout}s; it printed:\n{''.join(lines)}")
    role, address = got
    return TaskProcess(proc, address, role, lines, group=bool(prefix))
