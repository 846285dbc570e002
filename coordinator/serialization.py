"""How step functions and their arguments travel to workers.

* A function importable by ``module:qualname`` on the coordinator is sent by
  reference and imported on the worker (the worker needs the same code).
* A function defined in ``__main__``, a notebook, or a local scope is sent by
  value with cloudpickle. Unpickling runs code, so a worker accepts pickled
  functions only from a caller that presented the cluster's auth token.
* Arguments and results are pickled. A worker with no token configured
  unpickles arguments with ``RestrictedUnpickler``, which admits plain data,
  numpy arrays and this package's handle types only.
"""
from __future__ import annotations

import hashlib
import importlib
import io
import pickle
from typing import Any, Callable

import cloudpickle

from protos.pstrain.v1 import worker_pb2


class FunctionImportError(ImportError):
    """A step function sent by reference, or a module that a function or the
    arguments sent by value refer to, cannot be imported on the worker."""


def not_importable(exc: ModuleNotFoundError, worker: str, needed_by: str) -> FunctionImportError:
    """What a worker says when a module that ``needed_by`` needs is missing
    there (``exc``, raised while importing or unpickling)."""
    module = exc.name or str(exc)
    return FunctionImportError(
        f"module {module!r} is not importable on worker {worker} ({needed_by} needs it): "
        "install the package there or add its directory to PYTHONPATH (workers need the "
        "coordinator's code, in the same versions)")


def qualified_name(fn: Callable) -> str | None:
    """``"module:qualname"`` if fn can be found again by importing, else None."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if obj is fn else None


def encode_function(fn: Callable, by_value: bool | None = None) -> worker_pb2.FunctionRef:
    """A FunctionRef for fn: by reference when importable, else by value."""
    if not callable(fn):
        raise TypeError(f"expected a function, got {type(fn).__name__}")
    name = None if by_value else qualified_name(fn)
    if name is not None:
        return worker_pb2.FunctionRef(qualified_name=name)
    data = cloudpickle.dumps(fn)
    return worker_pb2.FunctionRef(pickled=data, digest=function_digest(data))


def function_digest(pickled: bytes) -> bytes:
    """FunctionRef.digest of a function's pickled bytes."""
    return hashlib.blake2b(pickled, digest_size=16).digest()


def import_function(name: str, worker: str = "(this one)") -> Callable:
    """The function ``"module:qualname"`` names, imported on this worker (its
    address: ``worker``). Raises FunctionImportError saying what to install."""
    module, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as exc:   # the module, or one it imports
        raise not_importable(exc, worker, f"step function {name!r}") from None
    except Exception as exc:
        raise FunctionImportError(
            f"cannot import module {module!r} for step function {name!r} on worker {worker}: "
            f"{type(exc).__name__}: {exc}. Install the same code on the workers (or put it "
            "on their PYTHONPATH), or define the function in your main script so it is "
            "sent by value") from None
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise FunctionImportError(
            f"module {module!r} on this worker has no {qualname!r}: the worker runs "
            "different code than the coordinator; deploy the same version") from None
    return obj


def load_function(data: bytes, worker: str = "(this one)") -> Callable:
    """A function sent by value (cloudpickled). Raises FunctionImportError
    when a module it refers to (by reference: its helpers, classes, the
    module it was defined in) is missing on this worker."""
    try:
        return pickle.loads(data)
    except ModuleNotFoundError as exc:
        raise not_importable(exc, worker, "the function sent by value") from None


def dumps(obj: Any) -> bytes:
    return cloudpickle.dumps(obj)


# Globals a restricted unpickle may load: plain data, numpy arrays, and the
# handle types of this package that stand for worker-side objects.
_SAFE_GLOBALS = {
    ("builtins", n) for n in ("list", "dict", "tuple", "set", "frozenset", "int", "float",
                              "complex", "str", "bytes", "bytearray", "bool", "slice",
                              "range", "NoneType", "object")
} | {
    ("collections", "OrderedDict"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("copyreg", "_reconstructor"),
    ("coordinator.datasets", "_local_iterator"), ("coordinator.sources", "_bound_iterator"),
    ("coordinator.variables", "ShardedVariable"), ("coordinator.variables", "Shard"),
}


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_GLOBALS or (module.startswith("numpy") and name.endswith("DType")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in arguments sent to a worker without an "
            "auth token; configure PSTRAIN_AUTH_TOKEN on the cluster to send any object")


def loads(data: bytes, trusted: bool) -> Any:
    """Unpickle; with ``trusted=False`` only plain data and arrays are admitted."""
    if trusted:
        return pickle.loads(data)
    return RestrictedUnpickler(io.BytesIO(data)).load()
