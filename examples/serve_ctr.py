"""Serve the CTR model from the copy examples/ctr.py exports, and score it:
the AUC of the serving copy on the held-out examples, computed from memory
in this process (coordinator.serving.Snapshot: it reads the export's files
and never talks to the parameter servers).

    python examples/ctr.py --export /tmp/ctr-export --epochs 6 &
    python examples/serve_ctr.py --export /tmp/ctr-export --follow 60

With ``--follow S`` it follows the export for S seconds, scoring each new
export as it arrives (a delta applied in memory); without it, scores the
latest export once.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):   # run as a script: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.local import description, run_main
from coordinator.serving import Snapshot
from examples.ctr import held_out, reader_lookup


def score(snap: Snapshot, seed: int, batches: int, size: int, tables: str = "shared") -> dict:
    """AUC and loss of the export the Snapshot serves now."""
    params = {n[4:]: snap.read(n) for n in snap.variables if n.startswith("ctr/")}
    return held_out(params, reader_lookup(snap, "ctr", seed, tables), seed, batches, size)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("--export", required=True, metavar="DIR", help="examples/ctr.py --export's")
    p.add_argument("--follow", type=float, default=0.0, metavar="SECONDS",
                   help="follow the export this long, scoring each new one (default: once)")
    p.add_argument("--seed", type=int, default=0, help="the training run's --seed")
    p.add_argument("--tables", choices=("shared", "per-feature"), default="shared",
                   help="the training run's --tables")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=512)
    args = p.parse_args(argv)
    snap = Snapshot(args.export, follow=args.follow > 0, poll_seconds=0.25)
    try:
        out = {}
        end = time.monotonic() + args.follow
        generation = -1
        while True:
            if snap.generation != generation:
                generation = snap.generation
                out = {**score(snap, args.seed, args.eval_batches, args.batch_size,
                               args.tables),
                       "path": snap.path}
                print(f"serving {os.path.basename(snap.path)}: AUC {out['auc']:.4f}, "
                      f"loss {out['loss']:.4f}", flush=True)
            left = end - time.monotonic()
            if left <= 0:
                return out
            snap.wait(generation, left)
    finally:
        snap.close()


if __name__ == "__main__":
    sys.exit(run_main(main))   # Ctrl-C: one line, exit status 130
