"""Cluster membership in TensorFlow's TF_CONFIG format.

    {"cluster": {"chief": ["host:port"], "ps": ["host:port", ...],
                 "worker": ["host:port", ...]},
     "task": {"type": "worker", "index": 0}}

A ``ClusterSpec`` is a value, and also its own resolver: anything with a
``cluster_spec()`` method can describe the cluster, and the coordinator calls
it again every few seconds, so membership may change while a job runs (a
``LocalCluster`` that adds a worker, a TF_CONFIG file that a deployment
rewrites). Parameter servers are fixed for the life of a job.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from typing import Any, Mapping

from psserver.contract import TOKEN_ENV, tf_config
from psserver.contract.tf_config import (
    TF_CONFIG_ENV,
    TF_CONFIG_FILE_ENV,
    ClusterConfigError,
    TaskId,
)

ROLES = tf_config.JOBS


class NoClusterDescription(ClusterConfigError):
    """Neither TF_CONFIG nor TF_CONFIG_FILE is set."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Addresses of each role. ``token`` is the shared auth token, if any.

    Built as ``tf.train.ClusterSpec`` is, from a dict of job name to the
    job's addresses, or role by role; a job's addresses are a list (task i
    at position i) or a dict of task index to address, numbered 0, 1, 2, ...
    without gaps::

        ClusterSpec({"ps": ["h0:2222", "h1:2222"], "worker": ["h2:2222"]})
        ClusterSpec({"ps": {0: "h0:2222", 1: "h1:2222"}, "worker": ["h2:2222"]})
        ClusterSpec(ps=["h0:2222", "h1:2222"], worker=["h2:2222"])
        ClusterSpec(other_spec)   # a copy (with its token and TLS unless given)

    Raises ClusterConfigError saying what is malformed.

    The token never appears in ``as_dict()``/TF_CONFIG: deployments pass it in
    the ``PSTRAIN_AUTH_TOKEN`` environment variable (a Kubernetes Secret).
    ``tls`` likewise (``PSTRAIN_TLS_*``).
    """
    ps: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()
    chief: tuple[str, ...] = ()
    token: str | None = dataclasses.field(default=None, repr=False, compare=False)
    tls: Any = dataclasses.field(default=None, repr=False, compare=False)   # psserver.tls.TLSConfig

    def __post_init__(self):
        cluster = self.ps   # the first argument: the whole cluster, or only "ps"
        if isinstance(cluster, ClusterSpec):
            object.__setattr__(self, "token", self.token or cluster.token)
            object.__setattr__(self, "tls", self.tls or cluster.tls)
            cluster = cluster.as_dict()
        elif not (isinstance(cluster, Mapping) and tf_config.is_cluster(cluster)):
            cluster = None
        if cluster is not None:
            if self.worker or self.chief:
                raise ClusterConfigError(
                    "give the cluster either as one dict ({\"ps\": [...], \"worker\": [...]}) "
                    "or as ps=, worker=, chief=, not both")
            _check_roles(cluster)
            for role in ROLES:
                object.__setattr__(self, role, cluster.get(role, ()))
        for role in ROLES:
            object.__setattr__(self, role, tf_config.job_addresses(role, getattr(self, role)))

    def cluster_spec(self) -> "ClusterSpec":
        """A spec is its own (static) resolver."""
        return self

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    @property
    def num_workers(self) -> int:
        return len(self.worker)

    def as_dict(self) -> dict[str, list[str]]:
        return {role: list(getattr(self, role)) for role in ROLES if getattr(self, role)}

    def tf_config(self, task_type: str, index: int) -> str:
        """The TF_CONFIG JSON for one task of this cluster."""
        return json.dumps({"cluster": self.as_dict(), "task": {"type": task_type, "index": index}})

    @classmethod
    def from_dict(cls, cluster: Mapping[str, Any], token: str | None = None) -> "ClusterSpec":
        """As ``ClusterSpec(cluster, token=token)``; also for an empty dict."""
        _check_roles(cluster)
        return cls(ps=cluster.get("ps", ()), worker=cluster.get("worker", ()),
                   chief=cluster.get("chief", ()), token=token)


def _check_roles(cluster: Mapping[str, Any]) -> None:
    unknown = set(cluster) - set(ROLES) - {"evaluator"}   # TensorFlow's evaluator: ignored
    if unknown:
        raise ClusterConfigError(
            f"unknown roles {sorted(map(str, unknown))} in cluster; use {list(ROLES)}")


def parse_tf_config(text: str) -> tuple[ClusterSpec, TaskId | None]:
    """(cluster spec, this task) from TF_CONFIG JSON text (psserver/contract/tf_config.py)."""
    cluster, task = tf_config.parse(text)
    return ClusterSpec.from_dict(cluster, token=os.environ.get(TOKEN_ENV) or None), task


class TFConfigClusterResolver:
    """Reads TF_CONFIG (or the file named by TF_CONFIG_FILE, or ``path``).

    A file is read again on every ``cluster_spec()`` call, so a deployment can
    add workers to a running job by rewriting it.
    """

    def __init__(self, path: str | None = None, environ: Mapping[str, str] = os.environ):
        self._path = path or environ.get(TF_CONFIG_FILE_ENV)
        self._text = None if self._path else environ.get(TF_CONFIG_ENV)
        if self._path is None and not self._text:
            raise NoClusterDescription(
                f"no cluster description: set {TF_CONFIG_ENV} to the cluster JSON, or "
                f"{TF_CONFIG_FILE_ENV} to a file holding it")
        self.cluster_spec()   # fail now, not later, if it is malformed

    def _read(self) -> tuple[ClusterSpec, TaskId | None]:
        if self._path:
            try:
                with open(self._path) as f:
                    return parse_tf_config(f.read())
            except OSError as exc:
                raise ClusterConfigError(f"cannot read cluster file {self._path}: {exc}") from None
        return parse_tf_config(self._text)

    def cluster_spec(self) -> ClusterSpec:
        return self._read()[0]

    def task(self) -> TaskId | None:
        return self._read()[1]


class Refreshing:
    """Something that re-reads the cluster description: ``refresh()`` runs
    now, then every ``interval`` seconds on a daemon thread named ``name``,
    until ``stop()``. Subclasses set their state, then call ``start``."""

    interval: float

    def start(self, interval: float, name: str) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def refresh(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
