"""--max-memory-bytes and resident memory (issue 33 item 3): a dynamic table
grown until the budget refuses it leaves the server's resident memory near
what it holds. A table's arrays grow by copying; tasks keep freed memory
(a high glibc trim threshold, psserver.process.MALLOC_ENV), so the old
arrays stayed resident: 2.26x the limit at its peak, 2x after. The table
now gives each old array's pages back before the next one grows."""
from __future__ import annotations

import numpy as np
import pytest

from psserver.client import PSClient
from psserver.errors import ResourceExhausted

LIMIT = 96 << 20


def _memory(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in f)
                if k in ("VmRSS", "VmHWM")}


@pytest.mark.timeout(120)
def test_a_table_grown_until_refused_stays_near_its_limit_in_resident_memory(start_ps):
    ps = start_ps("--max-memory-bytes", str(LIMIT))
    with PSClient(ps.address) as c:
        c.create_table("t", 64, optimizer="adagrad")
        base = _memory(ps.proc.pid)["VmRSS"]
        k = 0
        with pytest.raises(ResourceExhausted):
            for _ in range(1000):
                c.lookup("t", np.arange(k, k + 20_000, dtype=np.int64))
                k += 20_000
        held = c.table_info("t").bytes
        mem = _memory(ps.proc.pid)
    assert k >= 100_000 and held <= 1.1 * LIMIT, (k, held)
    # At its peak (a growth: one old array resident beside the new ones) and after.
    assert mem["VmHWM"] - base <= 1.5 * LIMIT, (mem, base)
    assert mem["VmRSS"] - base <= 1.3 * LIMIT, (mem, base)
