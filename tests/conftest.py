"""Shared fixtures: real task processes on 127.0.0.1, ephemeral ports.

Every process a fixture starts is killed at teardown, also when the test
fails; pytest-timeout bounds every test (pyproject.toml sets the default).
"""
from __future__ import annotations

import threading

import pytest

from psserver.client import PSClient
from psserver.process import TaskProcess, start_task


@pytest.fixture
def start_ps():
    """Factory: start_ps(*extra_args, env=None) -> TaskProcess (a real psserver)."""
    started: list[TaskProcess] = []

    def start(*args: str, env: dict | None = None) -> TaskProcess:
        t = start_task("psserver", ["--port", "0", *args], env=env)
        started.append(t)
        return t
    yield start
    for t in started:
        t.kill()


@pytest.fixture
def ps(start_ps) -> TaskProcess:
    """One running parameter server."""
    return start_ps()


@pytest.fixture
def client(ps):
    with PSClient(ps.address) as c:
        yield c


@pytest.fixture(autouse=True)
def no_thread_leak():
    """Fail a test that leaves non-daemon threads of its own running."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate()
              if t not in before and t.is_alive() and not t.daemon]
    for t in leaked:
        t.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"
