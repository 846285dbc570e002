"""Test hosts on this machine: network namespaces on one switch.

``TestHosts(n)`` makes n hosts, each a network namespace with its own
address (198.18.<net>.10 + i/24, RFC 2544 benchmarking space), joined by
veth links to a switch: a bridge that lives in a namespace of its own, so
the machine's own firewall never sees the traffic. This process (the root
namespace) is on the switch too, at 198.18.<net>.1, so a test talks to
every host directly. ``run(i)`` gives the command prefix that runs a
process on host i: with ``private=True`` (the default) in its own mount,
IPC and PID namespaces with a private /dev/shm, as on another machine; with
``private=False`` the process shares this machine's /dev/shm and pids but
not its network, as containers with ``--ipc=host`` or pods on one node do.

Links (both directions of host i's cable, or one) can be shaped
(``shape``: rate with tc's tbf; delay and loss need the kernel's netem,
``netem_available()``), cut (``cut``: packets dropped silently, by a
zero-length queue) and healed (``heal``).

Everything is named ``pst<pid>-...`` and removed on close, also when a
test fails; what a killed run left (its pid gone) is removed by the next.
Needs root and iproute2; ``available()`` says whether this machine can.
Traffic goes only to the addresses made here.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Sequence

#: Both directions of a host's link, or one: what leaves the host ("out")
#: or what reaches it ("in").
BOTH, OUT, IN = "both", "out", "in"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=20)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    got = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=20)
    if check and got.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns} failed: {got.stderr.strip()}")
    return got


def available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "test hosts need root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return False, f"test hosts need {tool} (iproute2, util-linux)"
    probe = f"pst{os.getpid()}-probe"
    got = _ip("netns", "add", probe, check=False)
    if got.returncode != 0:
        return False, f"cannot create network namespaces: {got.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


_NETEM: bool | None = None


def netem_available() -> bool:
    """Whether links can be given delay and loss (the kernel's sch_netem);
    rates and cuts need only tbf and pfifo, which every kernel has."""
    global _NETEM
    if _NETEM is None:
        probe = f"pst{os.getpid()}-netem"
        _ip("netns", "add", probe, check=False)
        try:
            _NETEM = _tc(probe, "qdisc", "replace", "dev", "lo", "root", "netem", "delay", "1ms",
                         check=False).returncode == 0
        finally:
            _ip("netns", "del", probe, check=False)
    return _NETEM


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


#: Run the rest of the command in new mount, IPC and PID namespaces with a
#: private /dev/shm; the process is killed when this prefix's process is.
_PRIVATE = ["unshare", "--mount", "--ipc", "--pid", "--mount-proc", "--kill-child",
            "sh", "-c", 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"', "sh"]


class TestHosts:
    __test__ = False   # not a test class for pytest

    def __init__(self, n: int, *, private: bool = True):
        self.private = private
        self.tag = f"pst{os.getpid()}"
        self.net = 1 + os.getpid() % 250
        self.names = [f"{self.tag}-h{i}" for i in range(n)]
        self.addresses = [f"198.18.{self.net}.{10 + i}" for i in range(n)]
        self.here = f"198.18.{self.net}.1"
        self._bridge = f"{self.tag}-br"
        self._root_link = f"p{os.getpid()}r"   # under 16 characters
        self._made: list[str] = []
        # per (host, direction): {"cut": bool, "rate": str, "delay": str, "loss": str}
        self._links: dict[tuple[int, str], dict] = {}

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
        """The command prefix that runs a command on host i (see the module)."""
        return ["ip", "netns", "exec", self.names[i], *(_PRIVATE if self.private else [])]

    def placement(self, ps: Sequence[int], worker: Sequence[int] = ()):
        """For ``LocalCluster(placement=...)``: parameter server i on host
        ps[i], worker i on host worker[i] (round robin past the end)."""
        def place(role: str, index: int) -> tuple[str, list[str]]:
            hosts_of = list(ps if role == "ps" else worker)
            if not hosts_of:
                raise ValueError(f"no test host given for the {role} tasks")
            k = hosts_of[index % len(hosts_of)]
            return self.addresses[k], self.run(k)
        return place

    # -- links ------------------------------------------------------------------------
    def _ends(self, i: int, direction: str) -> list[tuple[str, str, str]]:
        """(direction, namespace, device) whose egress carries that direction."""
        ends = {OUT: (OUT, self.names[i], "eth0"), IN: (IN, self._bridge, f"h{i}")}
        if direction == BOTH:
            return [ends[OUT], ends[IN]]
        if direction not in ends:
            raise ValueError(f"direction must be {BOTH!r}, {OUT!r} or {IN!r}, not {direction!r}")
        return [ends[direction]]

    def _apply(self, i: int, direction: str, ns: str, dev: str) -> None:
        st = self._links.get((i, direction), {})
        if st.get("cut"):
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0")
        elif st.get("delay") or st.get("loss"):
            if not netem_available():
                raise RuntimeError("this kernel has no sch_netem: links can be given a rate "
                                   "and cut, not delay or loss (see netem_available())")
            args = ["delay", st["delay"]] if st.get("delay") else []
            args += ["loss", st["loss"]] if st.get("loss") else []
            args += ["rate", st["rate"]] if st.get("rate") else []
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "netem", *args)
        elif st.get("rate"):
            bits = _bits(st["rate"])
            burst = max(64 << 10, bits // 8 // 100)   # 10 ms worth, at least a GSO packet
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", st["rate"],
                "burst", str(burst), "latency", "100ms")
        else:
            _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)

    def shape(self, i: int, *, rate: str | None = None, delay: str | None = None,
              loss: str | None = None, direction: str = BOTH) -> None:
        """Give host i's link a rate ("1gbit"), a delay ("1ms") and a loss
        ("1%") in ``direction``; None: none of that."""
        for d, ns, dev in self._ends(i, direction):
            st = self._links.setdefault((i, d), {})
            st.update(rate=rate, delay=delay, loss=loss)
            self._apply(i, d, ns, dev)

    def sent(self, i: int, direction: str) -> int:
        """Bytes host i's link carried in ``direction`` (OUT or IN) through a
        shape or cut put on it (0 when it has none)."""
        ((_, ns, dev),) = self._ends(i, direction)
        m = re.search(r"Sent (\d+) bytes", _tc(ns, "-s", "qdisc", "show", "dev", dev).stdout)
        return int(m.group(1)) if m else 0

    def cut(self, i: int, direction: str = BOTH) -> None:
        """Drop every packet of host i's link in ``direction``, silently (as
        a pulled cable or a partition: nobody is told)."""
        for d, ns, dev in self._ends(i, direction):
            self._links.setdefault((i, d), {})["cut"] = True
            self._apply(i, d, ns, dev)

    def heal(self, i: int, direction: str = BOTH) -> None:
        """Undo ``cut`` (the link's shape stays)."""
        for d, ns, dev in self._ends(i, direction):
            self._links.setdefault((i, d), {})["cut"] = False
            self._apply(i, d, ns, dev)

    def close(self) -> None:
        _ip("link", "del", self._root_link, check=False)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()


def _bits(rate: str) -> int:
    """tc's rate ("1gbit", "500mbit", "100kbit", "8bit") in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: use a number and kbit, mbit or gbit (e.g. '1gbit')")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])
