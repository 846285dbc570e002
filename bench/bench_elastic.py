"""Adding a parameter server to a running CTR job: the pause, the move, the model.

    python -m bench.bench_elastic [--quick] [--hosts] [--rows N] [--json out.json]

bench/bench_ctr.py's workload (DLRM, one dynamic table, 2 parameter servers
and 2 workers, async), its table filled first to ``--rows`` rows (keys the
data never uses, besides the data's own), trained for a number of steps;
at a third of them a third server is added
(ClusterCoordinator.add_parameter_server: about a third of the rows move
to it, between two steps). Each round trains twice with the same seeds and
data: once with the add, once without. Reported, medians of the rounds:

* the longest gap between two completed steps around the add, and the
  longest anywhere in the run without it (what the add costs a job);
* steps/s before and after the add (and in the run without it);
* the rows copied ahead of the move while training goes on (seconds,
  bytes/s, and steps/s meanwhile), then the move between two steps (its
  seconds, and the rows it sent: those changed since the copy); the
  copy's bytes/s against the same bytes over one bare TCP connection to a
  process on the new server's host (bench.common TCPReference): what the
  wire allows;
* the variable shards the new server took (an even share of the DLRM's
  dense variables, each whole), their bytes and seconds, and the whole add;
* the AUC of both runs after the same steps (an add changes no update).

``--hosts``: every task on a test host of its own (bench/hosts.py; root).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

from bench.common import TCPReference, machine_info, print_table, write_json

FILL_CHUNK = 100_000


def timed(step):
    """The step, returning when it ended (wall clock: the tasks share one)."""
    def run(*args):
        step(*args)
        return time.time()
    return run


def one_run(rows: int, steps: int, add: bool, placement=None) -> dict:
    from bench.bench_ctr import OursCTR
    from coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy
    with LocalCluster(num_ps=2, num_workers=2, placement=placement) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        with ClusterCoordinator(strategy) as coord:
            w = OursCTR(strategy, coord, 60, capacity=0)   # (--rows may pass 4M)
            for lo in range(0, rows, FILL_CHUNK):   # keys the data never has (1 << 62 on)
                w.table.lookup((1 << 62) + np.arange(lo, min(rows, lo + FILL_CHUNK)))
            w.run(20)   # warm-up
            step = timed(w.step)
            done = [coord.schedule(step, args=(w.it,)) for _ in range(steps)]
            move = None
            if add:
                done[steps // 3].fetch()
                address = cluster.add_ps()   # (--hosts: on a host of its own)
                t0 = time.time()
                moves = coord.add_parameter_server(address)
                move_end = time.time()
                move = moves[0]   # (the table's; then the variable shards it took)
                shards = [m for m in moves if hasattr(m, "shard")]
            ends = np.sort([d.fetch() for d in done])
            out = {"auc": w.auc(), "rows": w.table.stats().rows}
    gaps = np.diff(ends)
    out["longest_gap"] = float(gaps.max())
    if move is None:
        out["steps_per_s"] = (ends.size - 1) / (ends[-1] - ends[0])
        return out
    before, after = ends[ends <= t0], ends[ends >= move_end]
    across = [b - a for a, b in zip(ends[:-1], ends[1:]) if a <= move_end and b >= t0]
    ahead = move.ahead
    ahead_s = ahead.seconds if ahead is not None else 0.0
    during = ends[(ends >= t0) & (ends <= t0 + ahead_s)]
    out.update(longest_gap=float(max(across, default=0.0)),
               ahead_rows=ahead.rows if ahead is not None else 0,
               ahead_bytes=ahead.bytes if ahead is not None else 0, ahead_seconds=ahead_s,
               steps_per_s_during=during.size / ahead_s if ahead_s else 0.0,
               sent_rows=move.sent,
               steps_per_s_before=_rate(before), steps_per_s_after=_rate(after),
               move_seconds=move.seconds, move_bytes=move.bytes, move_rows=move.rows,
               moved_fraction=move.rows / (move.rows + move.kept),
               variable_shards_moved=len(shards),
               variable_bytes_moved=sum(m.bytes for m in shards),
               variable_move_seconds=sum(m.seconds for m in shards),
               add_seconds=move_end - t0)
    return out


def _rate(ends: np.ndarray) -> float:
    """Steps/s of steps that ended at ``ends`` (sorted); nan for fewer than 2."""
    return (ends.size - 1) / (ends[-1] - ends[0]) if ends.size > 1 else float("nan")


def tcp_reference(nbytes: int, prefix=(), host: str = "127.0.0.1") -> float:
    """Seconds for ``nbytes`` over one bare TCP connection (median of 3)."""
    with TCPReference(host, prefix) as ref:
        ref.upload(1 << 20)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            ref.upload(nbytes)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows, steps and rounds")
    ap.add_argument("--hosts", action="store_true",
                    help="every task on a test host of its own (root)")
    ap.add_argument("--rows", type=int, default=None, help="rows the table holds (1,000,000)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = args.rows or (200_000 if args.quick else 1_000_000)
    steps, rounds = (240, 1) if args.quick else (400, 3)
    from bench.suite import BLAS_ENV
    os.environ.update(BLAS_ENV)
    res = {"machine": machine_info(), "rows": rows, "steps": steps, "rounds": rounds,
           "runs": []}
    with contextlib.ExitStack() as stack:
        placement = None
        tcp_at = ((), "127.0.0.1")
        if args.hosts:
            from bench.hosts import TestHosts
            hosts = stack.enter_context(TestHosts(5))
            placement = hosts.placement(ps=[0, 1, 4], worker=[2, 3])   # (ps 2: the one added)
            tcp_at = (hosts.run(4), hosts.addresses[4])
        for _ in range(rounds):
            res["runs"].append({"resized": one_run(rows, steps, True, placement),
                                "unresized": one_run(rows, steps, False, placement)})
        moved = statistics.median(r["resized"]["ahead_bytes"] or r["resized"]["move_bytes"]
                                  for r in res["runs"])
        res["tcp_seconds"] = tcp_reference(int(moved), *tcp_at)
    med = {k: statistics.median(r["resized"][k] for r in res["runs"])
           for k in res["runs"][0]["resized"]}
    base = {k: statistics.median(r["unresized"][k] for r in res["runs"])
            for k in res["runs"][0]["unresized"]}
    res["median"], res["median_unresized"] = med, base
    where = "across hosts" if args.hosts else "same host"
    print_table(["adding a 3rd server to a CTR job, " + where, "with the add", "without"], [
        ["rows in the table / moved", f"{med['rows']:,.0f} / {med['move_rows']:,.0f} "
         f"({med['moved_fraction']:.1%})", f"{base['rows']:,.0f}"],
        ["longest gap between two steps", f"{med['longest_gap']:.3f} s (around the add)",
         f"{base['longest_gap']:.3f} s (anywhere)"],
        ["steps/s before / during the copy ahead / after", f"{med['steps_per_s_before']:.1f} / "
         f"{med['steps_per_s_during']:.1f} / {med['steps_per_s_after']:.1f}",
         f"{base['steps_per_s']:.1f}"],
        ["copied ahead, training going on: rows, seconds, bytes/s",
         f"{med['ahead_rows']:,.0f}, {med['ahead_seconds']:.3f} s, "
         f"{med['ahead_bytes'] / max(med['ahead_seconds'], 1e-9) / 2**20:.1f} MiB/s "
         f"({med['ahead_seconds'] / res['tcp_seconds']:.0f}x bare TCP's "
         f"{res['tcp_seconds']:.3f} s)", ""],
        ["the move between two steps: seconds, rows sent (changed since)",
         f"{med['move_seconds']:.3f} s, {med['sent_rows']:,.0f}", ""],
        ["variable shards moved: count, MiB, seconds",
         f"{med['variable_shards_moved']:.0f}, {med['variable_bytes_moved'] / 2**20:.2f}, "
         f"{med['variable_move_seconds']:.3f} s", ""],
        ["the whole add (tables, then variables)", f"{med['add_seconds']:.3f} s", ""],
        ["AUC after the same steps", f"{med['auc']:.4f}", f"{base['auc']:.4f}"]],
        title=f"bench_elastic: {rows:,} rows, {steps} steps, medians of {rounds}")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
