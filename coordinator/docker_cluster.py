"""DockerCluster: LocalCluster's interface, every task in a container of its own.

    from coordinator import DockerCluster, ParameterServerStrategy
    with DockerCluster(num_ps=2, num_workers=2, image="pstrain:0.1.0") as cluster:
        strategy = ParameterServerStrategy(cluster.spec, replication=True)
        ...
        cluster.kill_ps(1)            # its server process dies; Docker restarts the container
        cluster.disconnect("worker", 0)   # a partition: the worker's network is cut
        cluster.reconnect("worker", 0)

Tasks run the image's ``psserver`` / ``psworker`` (build it with
``deploy/build-image.sh``) on a private bridge network made for the cluster,
each with a fixed address on it (so a restarted container keeps its address,
as a pod's DNS name does), gRPC on 2222 and the data port on 2223, and the
cluster's token (plaintext gRPC inside the network, as docker-compose.yml
runs; the network is reachable from this host only). This process (the
coordinator) reaches them through the host's side of the bridge.

Needs a Docker engine and the ``docker`` package (``pip install -e
".[docker]"``). Parameter servers restart when their process dies
(``restart: unless-stopped``, as in docker-compose.yml); workers do not
(``restart_worker`` starts one again). Checkpoint directories are the
containers': use replication (``ParameterServerStrategy(replication=True)``)
for parameter servers that may die, or mount a directory (``volumes``).
"""
from __future__ import annotations

import ipaddress
import re
import secrets
import threading
import time
from typing import Sequence

from coordinator.cluster_spec import ClusterSpec

PORT, DATA_PORT = 2222, 2223
_LISTENING = re.compile(r"^(\w+) listening on (\S+)$", re.M)
#: What kill_ps runs inside a container: SIGKILL the server process (the
#: container's init then exits and its restart policy starts it again;
#: ``docker kill`` would count as stopped by hand and not restart it).
# Exits 3 when no such process runs in the container (nothing was killed).
_KILL_TASK = ("import os, sys\n"
              "killed = 0\n"
              "for p in filter(str.isdigit, os.listdir('/proc')):\n"
              "    try:\n"
              "        if int(p) not in (1, os.getpid()) and \\\n"
              "                sys.argv[1].encode() in open(f'/proc/{p}/cmdline', 'rb').read():\n"
              "            os.kill(int(p), 9)\n"
              "            killed += 1\n"
              "    except OSError:\n"
              "        pass\n"
              "sys.exit(0 if killed else 3)\n")


class DockerCluster:
    """Args:
      num_ps, num_workers: how many tasks of each role to start.
      image: the pstrain image (default ``pstrain:0.1.0``, what
        deploy/build-image.sh builds).
      token: the auth token (default: a new random one).
      ps_args, worker_args: extra command-line arguments for those tasks.
      env: extra environment variables for every task.
      volumes: docker SDK volume mounts for every task, e.g.
        ``{"/srv/ckpt": {"bind": "/checkpoints", "mode": "rw"}}``.
      start_timeout: seconds each task has to say it is listening.
      client: a ``docker.DockerClient`` (default ``docker.from_env()``).

    Raises RuntimeError (with the task's output) when a task does not start,
    and docker.errors.ImageNotFound when the image is missing (build it with
    deploy/build-image.sh).
    """

    def __init__(self, num_ps: int = 2, num_workers: int = 2, *, image: str = "pstrain:0.1.0",
                 token: str | None = None, ps_args: Sequence[str] = (),
                 worker_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 volumes: dict | None = None, start_timeout: float = 60.0, client=None):
        if num_ps < 1:
            raise ValueError("a cluster needs at least one parameter server (num_ps >= 1)")
        if num_workers < 0:
            raise ValueError("num_workers must be >= 0")
        import docker  # only here: the rest of the package does not need it
        self._docker = docker
        self.client = client or docker.from_env()
        self.client.images.get(image)   # ImageNotFound now, not per container
        self.image, self.token = image, token or secrets.token_hex(16)
        self._args = {"ps": tuple(ps_args), "worker": tuple(worker_args)}
        self._env = {"PSTRAIN_AUTH_TOKEN": self.token, **(env or {})}
        self._volumes = volumes or {}
        self._timeout = start_timeout
        self._lock = threading.Lock()
        self.id = secrets.token_hex(4)
        self.containers: dict[str, list] = {"ps": [], "worker": []}
        self.addresses: dict[str, list[str | None]] = {"ps": [], "worker": []}
        self.network = None
        try:
            self.network = self._make_network()
            subnet = self.network.attrs["IPAM"]["Config"][0]["Subnet"]
            self._hosts = ipaddress.ip_network(subnet).hosts()
            next(self._hosts)   # the gateway: this host's side of the bridge
            for role, n in (("ps", num_ps), ("worker", num_workers)):
                for i in range(n):
                    self._start(role, i)
            for role in ("ps", "worker"):
                for c in self.containers[role]:
                    self._wait_listening(c)
        except BaseException:
            self.stop()
            raise

    def _make_network(self):
        """A bridge network on a subnet Docker picks free, made again with that
        subnet stated (Docker gives fixed addresses only on a stated subnet)."""
        docker, name = self._docker, f"pstrain-{self.id}"
        labels = {"pstrain.cluster": self.id}
        for attempt in range(5):
            probe = self.client.networks.create(name, driver="bridge", labels=labels)
            try:
                probe.reload()
                config = probe.attrs["IPAM"]["Config"][0]
            finally:
                probe.remove()
            ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(
                subnet=config["Subnet"], gateway=config.get("Gateway"))])
            try:
                net = self.client.networks.create(name, driver="bridge", labels=labels,
                                                  ipam=ipam)
            except docker.errors.APIError:
                # another network took that subnet between the two calls: again
                if attempt == 4:
                    raise
                continue
            net.reload()
            return net

    # -- tasks ---------------------------------------------------------------------------
    def _start(self, role: str, index: int, ip: str | None = None):
        ip = ip or str(next(self._hosts))
        module = "psserver" if role == "ps" else "psworker"
        cmd = [module, "--host", "0.0.0.0", "--port", str(PORT), "--data-port", str(DATA_PORT),
               *self._args[role]]
        endpoint = self.client.api.create_endpoint_config(ipv4_address=ip)
        networking = self.client.api.create_networking_config({self.network.name: endpoint})
        container = self.client.api.create_container(
            self.image, cmd, name=f"pstrain-{self.id}-{role}-{index}",
            environment=self._env,
            labels={"pstrain.cluster": self.id, "pstrain.role": role, "pstrain.ip": ip},
            networking_config=networking,
            host_config=self.client.api.create_host_config(
                init=True, binds=self._volumes or None,
                restart_policy={"Name": "unless-stopped"} if role == "ps" else None))
        c = self.client.containers.get(container["Id"])
        with self._lock:
            if index < len(self.containers[role]):
                self.containers[role][index], self.addresses[role][index] = c, f"{ip}:{PORT}"
            else:
                self.containers[role].append(c)
                self.addresses[role].append(f"{ip}:{PORT}")
        c.start()
        return c

    def _wait_listening(self, c, since: float | None = None) -> None:
        """Until the task in ``c`` says it listens (in its log since ``since``)."""
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            c.reload()
            logs = c.logs(since=since).decode(errors="replace") if since else \
                c.logs().decode(errors="replace")
            if _LISTENING.search(logs):
                return
            if c.status in ("exited", "dead"):
                break
            time.sleep(0.2)   # polling the container's log: Docker has no "ready" event
        raise RuntimeError(f"{c.name} did not start within {self._timeout}s "
                           f"(status {c.status}); it printed:\n"
                           f"{c.logs().decode(errors='replace')[-3000:]}")

    def container(self, role: str, index: int):
        """The docker SDK container of task ``role`` ("ps"/"worker") ``index``."""
        with self._lock:
            return self.containers[role][index]

    def logs(self, role: str, index: int) -> str:
        return self.container(role, index).logs().decode(errors="replace")

    # -- LocalCluster's interface --------------------------------------------------------
    @property
    def spec(self) -> ClusterSpec:
        return self.snapshot()

    def snapshot(self) -> ClusterSpec:
        with self._lock:
            return ClusterSpec(ps=list(self.addresses["ps"]),
                               worker=[a for a in self.addresses["worker"] if a],
                               token=self.token)

    def kill_ps(self, index: int) -> None:
        """SIGKILL parameter server ``index``'s process inside its container:
        Docker restarts the container (on the same address), empty."""
        self._kill_inside("ps", index, "psserver")

    def kill_worker(self, index: int) -> None:
        """Kill worker ``index``'s container and drop it from the spec
        (``restart_worker`` brings it back on its address)."""
        c = self.container("worker", index)
        with self._lock:
            self.addresses["worker"][index] = None
        c.kill()

    def restart_worker(self, index: int) -> None:
        """Kill worker ``index`` (if it runs) and start it again on its
        address (the coordinator reconnects and re-queues what it lost)."""
        c = self.container("worker", index)
        since = time.time()
        c.restart(timeout=0)
        self._wait_listening(c, since)
        with self._lock:
            self.addresses["worker"][index] = self._address_of(c)

    def _kill_inside(self, role: str, index: int, module: str) -> None:
        c = self.container(role, index)
        rc, out = c.exec_run(["python", "-c", _KILL_TASK, module])
        # 137: the exec itself went down with the container it emptied
        if rc not in (0, 137):
            what = "no such process runs there" if rc == 3 else \
                (out or b"").decode(errors="replace")[-2000:]
            raise RuntimeError(f"could not kill {module} in {c.name} (exit {rc}): {what}")

    def disconnect(self, role: str, index: int) -> None:
        """Cut task ``role`` ``index`` off the network (a partition: its
        connections go silent; nothing is told)."""
        self.network.disconnect(self.container(role, index), force=True)

    def reconnect(self, role: str, index: int) -> None:
        """Undo ``disconnect``: the task is reachable on its address again."""
        c = self.container(role, index)
        self.network.connect(c, ipv4_address=self._address_of(c).rsplit(":", 1)[0])

    def _address_of(self, c) -> str:
        """HOST:PORT the task in container ``c`` was given (kept when it is
        killed, restarted or cut off)."""
        return f"{c.labels['pstrain.ip']}:{PORT}"

    def stop(self) -> None:
        """Remove every container of the cluster and its network."""
        errors, failed = self._docker.errors, []
        for c in self.client.containers.list(all=True,
                                             filters={"label": f"pstrain.cluster={self.id}"}):
            try:
                c.remove(force=True)
            except errors.NotFound:
                pass
            except errors.APIError as e:   # e.g. removal already in progress: go on
                failed.append(f"container {c.name}: {e}")
        if self.network is not None:
            try:
                self.network.remove()
            except errors.NotFound:
                pass
            except errors.APIError as e:
                failed.append(f"network {self.network.name}: {e}")
            self.network = None
        if failed:
            raise RuntimeError("DockerCluster.stop left behind (remove by hand: docker rm -f / "
                               "docker network rm): " + "; ".join(failed))

    def __enter__(self) -> "DockerCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
