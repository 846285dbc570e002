"""A TCP forwarder for tests: a port mapping, or a link that can be cut.

Imported by test modules as ``from proxy import CuttableProxy`` (pytest puts
tests/ on sys.path: the directory has no __init__.py).
"""
from __future__ import annotations

import socket
import threading


class CuttableProxy:
    """A TCP forwarder that can cut its link (close everything, refuse new)."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._lock = threading.Condition()
        self._cut = False
        self._conns: list[socket.socket] = []
        self.refused = 0
        self._stop = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def _accept(self):
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    self.refused += 1
                    self._lock.notify_all()
                    client.close()
                    continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        with self._lock:
            self._cut = True
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._conns.clear()

    def wait_refused(self, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self.refused > 0, timeout)

    def restore(self):
        with self._lock:
            self._cut = False

    def close(self):
        self._stop = True
        self.listener.close()
        self.cut()


def spec_through(cluster, proxy: CuttableProxy):
    """The cluster's spec with its first parameter server reached through proxy."""
    from coordinator import ClusterSpec

    snap = cluster.snapshot()
    return ClusterSpec(ps=[proxy.address, *snap.ps[1:]], worker=snap.worker,
                       token=snap.token, tls=snap.tls)
