"""Test hosts on this machine: network namespaces on one bridge.

``TestHosts(n)`` makes n hosts, each a network namespace with its own
address (198.18.<net>.10 + i/24, RFC 2544 benchmarking space), joined by a
bridge that lives in a namespace of its own; this process (the root
namespace) is on the bridge too, at 198.18.<net>.1, so a test talks to
every host directly. Hosts share this machine's kernel, pid namespace and
/dev/shm: a client here and a server there share memory but not the
network, as containers with ``--ipc=host`` or pods on one node do. ``run``
gives the command prefix that runs a process on a host.

Everything is named ``pst<pid>-...`` and removed on close, also when a
test fails; what a killed run left (its pid gone) is removed by the next.
Needs root and iproute2; ``available()`` says whether this machine can.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=20)


def available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "test hosts need root (network namespaces)"
    if shutil.which("ip") is None:
        return False, "test hosts need iproute2 (ip)"
    probe = f"pst{os.getpid()}-probe"
    got = _ip("netns", "add", probe, check=False)
    if got.returncode != 0:
        return False, f"cannot create network namespaces: {got.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def _sweep() -> None:
    """Remove namespaces and links that test runs now dead left behind."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        m = re.match(r"^pst(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.search(r"\d+: (p(\d+)r)[@:]", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            _ip("link", "del", m.group(1), check=False)


class TestHosts:
    __test__ = False   # not a test class for pytest

    def __init__(self, n: int):
        self.tag = f"pst{os.getpid()}"
        self.net = 1 + os.getpid() % 250
        self.names = [f"{self.tag}-h{i}" for i in range(n)]
        self.addresses = [f"198.18.{self.net}.{10 + i}" for i in range(n)]
        self.here = f"198.18.{self.net}.1"
        self._bridge = f"{self.tag}-br"
        self._root_link = f"p{os.getpid()}r"   # under 16 characters
        self._made: list[str] = []

    def __enter__(self) -> "TestHosts":
        _sweep()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        br = self._bridge
        _ip("netns", "add", br)
        self._made.append(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        # this process's leg
        _ip("link", "add", self._root_link, "type", "veth", "peer", "name", "up0",
            "netns", br)
        _ip("addr", "add", f"{self.here}/24", "dev", self._root_link)
        _ip("link", "set", self._root_link, "up")
        _ip("-n", br, "link", "set", "up0", "master", "br0", "up")
        for i, (name, addr) in enumerate(zip(self.names, self.addresses)):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"h{i}",
                "netns", br)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", br, "link", "set", f"h{i}", "master", "br0", "up")

    def run(self, i: int) -> list[str]:
        """The command prefix that runs a command on host i."""
        return ["ip", "netns", "exec", self.names[i]]

    def close(self) -> None:
        _ip("link", "del", self._root_link, check=False)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
