"""The names the README and docs use, importable from where they say."""
from __future__ import annotations

import re
from pathlib import Path

import coordinator

ROOT = Path(__file__).resolve().parents[2]


def test_every_name_the_docs_import_from_coordinator_is_there():
    """Issue 35 item 10: the README showed TopK(0.1), but `from coordinator
    import TopK` failed. Every `from coordinator import ...` in the README
    and docs/, and the compression specs the README names, import."""
    names = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        found = re.findall(r"from coordinator import \(([^)]*)\)", text) + \
            re.findall(r"^\s*from coordinator import ([\w ,]+?)\s*(?:#.*)?$", text, re.M)
        names |= {n.strip() for group in found for n in group.split(",") if n.strip()}
    assert {"LocalCluster", "ParameterServerStrategy", "batches"} <= names, names  # (found)
    names |= {"TopK", "FP16", "BF16"}
    missing = sorted(n for n in names if not hasattr(coordinator, n))
    assert not missing, missing
    assert coordinator.TopK(0.1).ratio == 0.1
