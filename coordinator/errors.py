"""The coordinator's errors, in one place (each raised where its docstring says)."""
from __future__ import annotations


class CoordinatorError(Exception):
    """Base of the coordinator's errors."""


class StepFunctionError(CoordinatorError):
    """A scheduled function raised on a worker.

    ``type_name`` is the worker-side exception's class name; ``remote_traceback``
    its traceback text, which ``str()`` includes.
    """

    def __init__(self, type_name: str, message: str, remote_traceback: str, worker: str = ""):
        self.type_name, self.message = type_name, message
        self.remote_traceback, self.worker = remote_traceback, worker
        super().__init__(f"{type_name}: {message}\n\nraised on worker {worker}; worker "
                         f"traceback:\n{remote_traceback}")


class ClosureCancelled(CoordinatorError):
    """The closure was not run because an earlier closure failed."""


class WorkerCallError(CoordinatorError):
    """A worker refused a closure (cannot import or unpickle it, bad token...)."""


class ParameterServerLost(CoordinatorError):
    """A parameter server restarted empty and nothing held its shards' state
    (no replication, no checkpoint, no ``recreate_lost_shards``): the job
    stops rather than train on with those shards reset (coordinator.recovery)."""
