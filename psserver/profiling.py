"""``PSTRAIN_PROFILE=DIR``: where a task's time goes, call by call (cProfile).

Set in a psserver's or psworker's environment (LocalCluster(env=...), a
container's env, a pod's), it runs every call the task serves (socket calls
on its Unix socket and data port, unary gRPC calls) under cProfile, one
profiler per serving thread, and writes ``DIR/<role>-<pid>-<tag>-<thread>.prof``
every 500 calls of that thread and when the task stops gracefully (tag:
random, as tasks on other hosts may share a pid and a directory). What is
measured is the call as served: parsing the request, the work, framing the
reply; not sending it, nor the wait for the next call. On a worker
that is the step function (RunClosure) with its reads and pushes.

    python -m psserver.profiling DIR [--sort tottime] [--top 30] [--role psworker]

merges the files (of one role, or all) and prints the functions that took
the most time. Profiling slows Python code 1.5-3x: compare profiles with
each other, not with unprofiled speed. Times are wall time on the serving
thread: a function that released the GIL (numpy's larger copies and
reductions, BLAS, socket calls) is also charged the wait to take it back
from the task's other threads, so on a server with several connections a
numpy call can look several times slower than it is alone.
``PSTRAIN_PROFILE_CLOCK=cpu`` measures each thread's CPU time instead
(time.thread_time): no waits, for locks, the GIL or the network, are
counted, so the figures add up to what the task spends. The variables are
read once, when the task starts; nothing a client sends turns it on or off.
"""
from __future__ import annotations

import argparse
import cProfile
import glob
import io
import os
import pstats
import re
import secrets
import sys
import threading
import time
from typing import Callable

ENV = "PSTRAIN_PROFILE"
#: "cpu": profile threads' CPU time; anything else (default): wall time.
CLOCK_ENV = "PSTRAIN_PROFILE_CLOCK"
#: A thread's profile is written every this many calls (and at the end).
EVERY = 500


class CallProfiles:
    """One cProfile.Profile per serving thread, each written to its own file."""

    def __init__(self, directory: str, role: str, cpu: bool = False):
        self.directory, self.role = directory, role
        self._clock = (time.thread_time,) if cpu else ()
        self._tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._threads: list[dict] = []   # each thread's profile, file and state

    def _mine(self) -> dict:
        st = getattr(self._local, "st", None)
        if st is None:
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", threading.current_thread().name)
            path = os.path.join(self.directory, f"{self.role}-{self._tag}-{name}-"
                                                f"{threading.get_ident()}.prof")
            st = self._local.st = {"profile": cProfile.Profile(*self._clock), "path": path,
                                   "calls": 0, "busy": False}
            with self._lock:
                self._threads.append(st)
        return st

    def run(self, fn: Callable, *args):
        """fn(*args), profiled (a call inside a profiled call is part of it)."""
        st = self._mine()
        if st["busy"]:
            return fn(*args)
        st["busy"] = True
        st["profile"].enable()
        try:
            return fn(*args)
        finally:
            st["profile"].disable()
            st["busy"] = False
            st["calls"] += 1
            if st["calls"] % EVERY == 0:
                self._write(st)

    def _write(self, st: dict) -> None:
        try:
            st["profile"].dump_stats(st["path"])
        except OSError as exc:   # a full disk: say so, keep serving
            print(f"{self.role}: cannot write {st['path']}: {exc}", file=sys.stderr, flush=True)

    def write_all(self) -> None:
        """Every thread's profile that is not inside a call now (the task is stopping)."""
        with self._lock:
            threads = list(self._threads)
        for st in threads:
            if st["calls"] and not st["busy"]:
                self._write(st)


#: The task's profiles, when PSTRAIN_PROFILE is set (start_from_env).
active: CallProfiles | None = None


def start_from_env(role: str) -> CallProfiles | None:
    """Turn profiling on for this process if PSTRAIN_PROFILE names a
    directory (made if missing). ValueError says what is wrong with it."""
    global active
    directory = os.environ.get(ENV, "")
    if not directory:
        return None
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{ENV}={directory!r}: cannot make that directory ({exc}); "
                         "name a directory this task may write, or unset it") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{ENV}={directory!r}: this task may not write there; "
                         "name a directory it may write, or unset it")
    clock = os.environ.get(CLOCK_ENV, "wall").lower()
    if clock not in ("cpu", "wall"):
        raise ValueError(f"{CLOCK_ENV}={clock!r}: use cpu (threads' CPU time) or wall (default)")
    active = CallProfiles(directory, role, cpu=clock == "cpu")
    return active


def served(fn: Callable, *args):
    """fn(*args), profiled when profiling is on."""
    p = active
    return fn(*args) if p is None else p.run(fn, *args)


def summary(directory: str, sort: str = "tottime", top: int = 30, role: str | None = None) -> str:
    """The merged profiles of ``directory`` (one role's, or all), as pstats prints them."""
    files = sorted(glob.glob(os.path.join(directory, f"{role or '*'}-*.prof")))
    if not files:
        raise FileNotFoundError(f"no {role or ''} profiles (*.prof) in {directory}: was the task "
                                f"started with {ENV}={directory} and stopped, or has it served "
                                f"{EVERY} calls on a thread?")
    out = io.StringIO()
    stats = pstats.Stats(files[0], stream=out)
    for f in files[1:]:
        stats.add(f)
    print(f"{len(files)} profile(s): {', '.join(os.path.basename(f) for f in files)}", file=out)
    stats.sort_stats(sort).print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m psserver.profiling",
                                description="Merge and print the profiles a task wrote "
                                            f"under {ENV}.")
    p.add_argument("directory")
    p.add_argument("--sort", default="tottime",
                   choices=["tottime", "cumulative", "calls", "ncalls", "time", "cumtime"])
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--role", choices=["psserver", "psworker"])
    args = p.parse_args(argv)
    try:
        print(summary(args.directory, args.sort, args.top, args.role))
    except FileNotFoundError as exc:
        print(f"psserver.profiling: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
