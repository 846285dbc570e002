"""Generate the Python gRPC code from the .proto files. The one command:

    python -m protos.codegen

Output (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``) is written beside each
.proto and committed; it is never edited by hand. ``tests/test_codegen.py``
fails when the committed code no longer matches the .proto files.
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent   # repository root


def proto_files() -> list[pathlib.Path]:
    return sorted((ROOT / "protos").rglob("*.proto"))


def generate(out_dir: pathlib.Path = ROOT) -> None:
    """Run protoc (from grpcio-tools) on every .proto, writing under out_dir.

    Proto paths are taken relative to the repository root, so the generated
    modules import each other as ``protos.pstrain.v1.<name>_pb2``.
    """
    from grpc_tools import protoc
    import importlib.resources

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    files = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{ROOT}", f"-I{include}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *files]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}: {' '.join(args)}")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
