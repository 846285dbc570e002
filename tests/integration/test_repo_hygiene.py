"""What the README's and guides' commands leave in a clone is ignored by git (issue 35 item 9)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout")
def test_the_readmes_keys_checkpoints_and_exports_are_ignored():
    """`certs/` holds a private key; `ckpt/` and `exports/` are training output."""
    paths = ["certs/tls.key", "ckpt/ckpt-00000001/manifest.json", "exports/ctr/x"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.stdout.split() == paths, r.stdout + r.stderr
    assert "'certs'" in (ROOT / "docs" / "several-machines.md").read_text()   # the command that makes them


def test_the_readmes_certificate_command_says_what_it_wrote_and_shows_no_key(tmp_path):
    """Issue 35 item 9: the one-liner printed nothing; printed as it is, a
    TLSConfig would show its private key (repr), so the key is left out."""
    import re
    import sys
    cmd = next(line for line in (ROOT / "docs" / "several-machines.md").read_text().splitlines()
               if "generate_self_signed" in line and line.startswith("python -c"))
    code = re.match(r'python -c "(.*)"$', cmd).group(1)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["wrote", "certs/tls.crt", "certs/tls.key", "certs/ca.crt"]
    from psserver.tls import TLSConfig
    assert "PRIVATE" not in repr(TLSConfig.from_files(*(str(tmp_path / p) for p in
                                                        r.stdout.split()[1:])))
