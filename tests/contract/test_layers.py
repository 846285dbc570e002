"""The layout is the architecture: which layer may import which (ARCHITECTURE.md).

psserver is split by layer: ``contract`` (and ``psserver.errors``) below
everything, ``core`` (the server's state) and ``link`` (channels to a task)
on it, ``client`` on link, ``serve`` on top. Two checks of the same rules:
every import statement in the source (module-level and inside functions),
and what importing a layer really loads in a fresh interpreter.
"""
from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: What each part of the code may import from psserver and protos, and from
#: grpc / protobuf (``None``: anything). The public tools at psserver's top
#: level (errors, tls, metrics, process, profiling) sit below link and client
#: (core imports the contract only).
CONTRACT = ("psserver.contract", "psserver.errors")
TOOLS = ("psserver.tls", "psserver.metrics", "psserver.process", "psserver.profiling")
RULES = {
    "psserver.errors": (CONTRACT, False),
    "psserver.contract": (CONTRACT, False),
    "psserver.core": (CONTRACT + ("psserver.core",), False),
    "psserver.link": (CONTRACT + TOOLS + ("psserver.link", "protos"), True),
    "psserver.client": (CONTRACT + TOOLS + ("psserver.link", "psserver.client", "protos"), True),
    "psserver.tls": (CONTRACT, True),
    "psserver.metrics": (CONTRACT, True),
    "psserver.process": (CONTRACT, False),
    "psserver.profiling": (CONTRACT, False),
    "coordinator": (CONTRACT + TOOLS + ("psserver.link", "psserver.client", "protos",
                                        "coordinator"), True),
    # (a task like the server, with the task kit in serve; never the server's state)
    "psworker": (CONTRACT + TOOLS + ("psserver.serve", "psserver.link", "psserver.client",
                                     "protos"), True),
}
GRPC_OR_PROTOBUF = ("grpc", "grpc_health", "google.protobuf", "protos")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path):
    """(line, imported module) of every import statement in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for a in node.names:   # "from psserver import tls": the module psserver.tls
                yield node.lineno, f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name


def rule_of(module: str):
    best = max((k for k in RULES if module == k or module.startswith(k + ".")),
               key=len, default=None)
    return RULES.get(best)


def within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def source_files():
    for top in ("psserver", "coordinator", "psworker"):
        yield from sorted((ROOT / top).rglob("*.py"))


def resolved(target: str) -> str | None:
    """The psserver or protos module (or package) an import names, None for
    anything else ("from psserver.x import name" names psserver.x)."""
    parts = target.split(".")
    if parts[0] not in ("psserver", "protos"):
        return None
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return ".".join(parts[:n])
    return None


def test_every_import_statement_keeps_to_its_layer():
    broken = []
    for path in source_files():
        rule = rule_of(module_name(path))
        if rule is None:   # psserver.serve and the psserver command: anything
            continue
        allowed, grpc_ok = rule
        for line, target in imports(path):
            module = resolved(target)
            if module is not None and module not in ("psserver", "protos") \
                    and not within(module, allowed):
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if not grpc_ok and within(target, GRPC_OR_PROTOBUF):
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {target} "
                              "(this layer runs without grpc and protobuf)")
    assert not broken, "imports across layers (ARCHITECTURE.md, 'Layers'):\n" + "\n".join(
        sorted(set(broken)))


#: Code that makes importing grpc, protobuf or the generated code fail in the
#: interpreter it runs in, as an environment without them would.
BLOCK_GRPC_AND_PROTOBUF = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in {GRPC_OR_PROTOBUF!r}):
            raise ModuleNotFoundError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def loaded_by(modules: list[str], blocked: bool = False) -> list[str]:
    """sys.modules after importing ``modules`` in a fresh interpreter (where
    grpc and protobuf cannot be imported, with ``blocked``)."""
    code = (BLOCK_GRPC_AND_PROTOBUF if blocked else "") + f"""
import importlib, json, sys
for m in {modules!r}:
    importlib.import_module(m)
print(json.dumps(sorted(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def modules_under(package: str) -> list[str]:
    base = ROOT.joinpath(*package.split("."))
    if base.with_suffix(".py").exists():
        return [package]
    return [module_name(p) for p in sorted(base.rglob("*.py")) if p.name != "__main__.py"]


@pytest.mark.timeout(120)
def test_the_contract_layer_loads_no_grpc_and_no_protobuf():
    mods = modules_under("psserver.contract") + ["psserver.errors"] + modules_under(
        "psserver.core")
    loaded = loaded_by(mods, blocked=True)
    assert not [m for m in loaded if within(m, GRPC_OR_PROTOBUF)]
    assert not [m for m in loaded if within(m, ("psserver.link", "psserver.client",
                                                "psserver.serve"))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("package", ["psserver.client", "coordinator"])
def test_the_client_and_the_coordinator_load_no_server_internals(package):
    loaded = loaded_by(modules_under(package))
    inside = [m for m in loaded if within(m, ("psserver.core", "psserver.serve"))]
    assert not inside, f"importing {package} loads {inside}"


def test_the_checks_can_fail(tmp_path):
    """The static check sees an import inside a function, and the rules
    refuse the imports the layout forbids."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from psserver.core.store import VariableStore\n")
    assert "psserver.core.store" in {resolved(t) for _, t in imports(f)}
    assert not within("psserver.core.store", rule_of("psserver.client.data")[0])
    assert not within("psserver.serve.server", rule_of("coordinator.strategy")[0])
    assert rule_of("psserver.contract.wire") == (CONTRACT, False)
    assert "psserver.core" not in json.dumps(RULES["psserver.link"])


#: A module longer than this is doing two things: split it (ARCHITECTURE.md).
MAX_LINES = 600


def test_no_module_in_psserver_or_coordinator_passes_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in source_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by what they do): {long}"


def test_old_module_paths_warn_and_give_the_moved_module():
    """docs/client.md, "Moved names": an old path still imports, warns, and is the
    same module object as the new path (one copy of its state)."""
    code = """
import importlib, warnings
from psserver._moved import MOVED
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new), old
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
               for w in caught), old
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from psserver.contract import NotFound
from psserver.errors import NotFound as same
assert NotFound is same and caught and "psserver.errors" in str(caught[0].message)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_nothing_here_imports_an_old_path():
    from psserver._moved import MOVED
    old = []
    for top in ("psserver", "psworker", "coordinator", "tests", "bench", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for line, target in imports(path):
                if within(target, tuple(MOVED)):
                    old.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not old, "\n".join(old)
