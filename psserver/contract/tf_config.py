"""TensorFlow's TF_CONFIG: the cluster's addresses by job, and this task.

    {"cluster": {"chief": ["host:port"], "ps": ["host:port", ...],
                 "worker": ["host:port", ...]},
     "task": {"type": "worker", "index": 0}}

A job's addresses are a list (task i at position i) or, as
``tf.train.ClusterSpec`` also takes them, a dict of task index to address
(``{"0": "a:2222", "1": "b:2222"}``; JSON keys are strings), numbered 0, 1,
2, ... without gaps.

Plain data, no grpc and no coordinator: psserver and psworker take their
own port from here (``task_port``), and coordinator.cluster_spec builds its
``ClusterSpec`` on ``parse`` and ``job_addresses``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

TF_CONFIG_ENV = "TF_CONFIG"
#: Alternative to TF_CONFIG: a path to a file holding the same JSON. The file
#: is read again on each cluster_spec() call, so workers can be added to it.
TF_CONFIG_FILE_ENV = "TF_CONFIG_FILE"

#: The jobs a cluster has (TensorFlow's also has "evaluator", which is allowed
#: in TF_CONFIG and ignored).
JOBS = ("chief", "ps", "worker")


class ClusterConfigError(ValueError):
    """The cluster description is missing or malformed."""


@dataclasses.dataclass(frozen=True)
class TaskId:
    type: str
    index: int


def is_cluster(value: Mapping) -> bool:
    """Whether a dict is a whole cluster (job name -> addresses) rather than
    one job's tasks (index -> address): its keys are names, not numbers."""
    return any(isinstance(k, str) and not k.strip().isdigit() for k in value)


def job_addresses(job: str, addresses: Any) -> tuple[str, ...]:
    """The "host:port" of each of ``job``'s tasks, in index order, from a list
    of them or a dict of task index to address (``{0: "a:1", 1: "b:1"}``).

    Raises ClusterConfigError saying what to write instead.
    """
    if isinstance(addresses, str):
        raise ClusterConfigError(f'cluster "{job}" must be a list of "host:port", got a string')
    if isinstance(addresses, Mapping):
        addresses = _by_index(job, addresses)
    try:
        out = tuple(addresses)
    except TypeError:
        raise ClusterConfigError(
            f'cluster "{job}" must be a list of "host:port" (or a dict of task index to '
            f'"host:port"), got {type(addresses).__name__}') from None
    for a in out:
        if not isinstance(a, str) or ":" not in a:
            raise ClusterConfigError(f'bad {job} address {a!r}: expected "host:port"')
    return out


def _by_index(job: str, tasks: Mapping) -> list:
    indexed: dict[int, Any] = {}
    for key, address in tasks.items():
        if isinstance(key, bool) or not (isinstance(key, int) or
                                         (isinstance(key, str) and key.strip().isdigit())):
            raise ClusterConfigError(
                f'cluster "{job}": task index {key!r} is not a number >= 0; give the tasks as '
                '{0: "host:port", 1: "host:port"} or as a list')
        i = int(key)
        if i in indexed:
            raise ClusterConfigError(f'cluster "{job}" names task {i} twice')
        indexed[i] = address
    gaps = sorted(set(range(len(indexed))) - set(indexed))
    if gaps:
        raise ClusterConfigError(
            f'cluster "{job}" has tasks {sorted(indexed)} but no task {gaps[0]}: number a '
            "job's tasks 0, 1, 2, ... without gaps")
    return [indexed[i] for i in range(len(indexed))]


def parse(text: str) -> tuple[dict[str, Any], TaskId | None]:
    """(the "cluster" object, this task) from TF_CONFIG JSON text. The
    known jobs' addresses (JOBS) are checked and given as tuples; other keys
    are left as they are. A task of a known job must be in that job's list."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterConfigError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("cluster"), dict):
        raise ClusterConfigError('TF_CONFIG needs a "cluster" object: '
                                 '{"cluster": {"ps": [...], "worker": [...]}, "task": {...}}')
    cluster = dict(cfg["cluster"])
    for job in JOBS:
        if job in cluster:
            cluster[job] = job_addresses(job, cluster[job])
    task = None
    if cfg.get("task"):
        t = cfg["task"]
        try:
            task = TaskId(str(t["type"]), int(t.get("index", 0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ClusterConfigError(f'bad TF_CONFIG "task" {t!r}: expected {{"type": ..., "index": N}}') from None
        if task.type in JOBS:
            addrs = cluster.get(task.type, ())
            if not 0 <= task.index < len(addrs):
                raise ClusterConfigError(
                    f"TF_CONFIG task {task.type}:{task.index} is not in the cluster's "
                    f"{len(addrs)} {task.type} addresses")
    return cluster, task


def read(environ: Mapping[str, str] = os.environ) -> str | None:
    """The TF_CONFIG JSON text: the file TF_CONFIG_FILE names, else TF_CONFIG;
    None when neither is set. Raises ClusterConfigError if the file cannot be read."""
    path = environ.get(TF_CONFIG_FILE_ENV)
    if path:
        try:
            with open(path) as f:
                return f.read()
        except OSError as exc:
            raise ClusterConfigError(f"cannot read cluster file {path}: {exc}") from None
    return environ.get(TF_CONFIG_ENV) or None


def task_port(job: str, role: str, environ: Mapping[str, str] = os.environ) -> int:
    """The port of this task's own entry in the cluster, for the ``role``
    command (psserver, psworker) that runs tasks of ``job`` (ps, worker).

    0 (a free port) when there is no TF_CONFIG / TF_CONFIG_FILE, or it names
    no "task". Raises ClusterConfigError when it is malformed, when its task
    is of another job (a psserver given a worker's TF_CONFIG) or not in the
    cluster, or when the entry has no port number.
    """
    text = read(environ)
    if text is None:
        return 0
    cluster, task = parse(text)
    if task is None:
        return 0
    source = (f"{TF_CONFIG_FILE_ENV}={environ[TF_CONFIG_FILE_ENV]}"
              if environ.get(TF_CONFIG_FILE_ENV) else TF_CONFIG_ENV)
    if task.type != job:
        raise ClusterConfigError(
            f'the task in {source} is {task.type}:{task.index}, but {role} runs a "{job}" '
            f'task: make it {{"type": "{job}", "index": N}} (N: this task\'s place in the '
            f'cluster\'s "{job}" list), or pass --port')
    address = cluster[job][task.index]
    port = address.rsplit(":", 1)[1]
    if not port.isdigit():
        raise ClusterConfigError(f"{job} {task.index}'s address {address!r} in {source} has no "
                                 'port number: expected "host:port"')
    return int(port)
