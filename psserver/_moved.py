"""Deprecated import paths of modules that moved into the layers (docs/client.md,
"Moved names"): ``import psserver.store`` still works, warns once with
DeprecationWarning, and gives the module at its new path (the same module
object, so nothing is loaded twice). Nothing in this repository imports an
old path (tests/contract/test_layers.py); they go in a later release.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: Old path -> new path, for the modules of the 808e9e1 layout that moved.
MOVED = {
    "psserver.buffers": "psserver.link.buffers",
    "psserver.dynamic_table": "psserver.core.dynamic_table",
    "psserver.forwarder": "psserver.serve.forwarder",
    "psserver.ipc_server": "psserver.serve.ipc_server",
    "psserver.methods": "psserver.link.methods",
    "psserver.optimizers": "psserver.contract.optimizers",
    "psserver.replication": "psserver.core.replication",
    "psserver.routing": "psserver.contract.routing",
    "psserver.rpc": "psserver.serve.rpc",
    "psserver.saving": "psserver.core.saving",
    "psserver.server": "psserver.serve.server",
    "psserver.servicer": "psserver.serve.servicer",
    "psserver.shm": "psserver.contract.shm",
    "psserver.store": "psserver.core.store",
    "psserver.sync": "psserver.core.sync",
    "psserver.tables": "psserver.serve.tables",
    "psserver.tensor": "psserver.contract.tensor",
    "psserver.tf_config": "psserver.contract.tf_config",
    "psserver.tracking": "psserver.core.tracking",
    "psserver.variable": "psserver.core.variable",
    "psserver.wire": "psserver.contract.wire",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module):
        pass


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old path and hands out the module at its new one, warning."""

    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        if new is None:
            return None
        warnings.warn(f"{name} moved to {new}; import it from there ({name} goes in a "
                      "later release)", DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(name, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
