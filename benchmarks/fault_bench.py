#!/usr/bin/env python3
"""Time from a fault to the next token of a stream through `beeswarm serve`, at the production heartbeat (3 s).

The swarm of tests/test_faults.py (tests/fault_swarm.py): tinycode's target in two halves on two contributors
(no replica), the bootstrap holding the coordinator's lease and one half, a spare that joined after the plan.
Each run starts a fresh swarm, streams 40 greedy tokens with the official openai client, and after 5 pieces:
- kill: SIGKILLs the stage that is not the coordinator (its connections drop at once);
- stop: SIGSTOPs it (a laptop lid closed: its connections stay open, nothing answers, it misses heartbeats);
- coordinator: SIGKILLs the coordinator, which serves the other half (a successor is elected first).
With no replica, each recovery waits for the spare to load the lost half. Reported per fault: the median, min and
max seconds from the fault to the next piece of text over `--runs`, whether every text was the greedy one, and
the runs that failed (their logs are kept, and named).

    python benchmarks/fault_bench.py [--runs 5] [--faults kill stop coordinator] [--json]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fault_swarm import FAULTS, PRODUCTION_HEARTBEAT, FaultSwarm  # noqa: E402

TINYCODE = Path(__file__).resolve().parents[1] / "beeswarm" / "assets" / "tinycode" / "target"


def run(fault: str, tmp: Path, heartbeat: float) -> tuple[float, bool] | None:
    """(seconds from the fault to the next token, whether the text was exact), or None when the run failed."""
    swarm = FaultSwarm(str(TINYCODE), tmp, heartbeat)
    try:
        swarm.start()
        got = swarm.stream(fault)
    except Exception as e:  # noqa: BLE001 - a failed run is a figure too: counted, its logs kept
        print(f"{fault}: the run failed ({type(e).__name__}: {e}); its logs: {tmp}", file=sys.stderr, flush=True)
        return None
    finally:
        swarm.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return got.fault_to_next_s, got.text == got.expected and got.finish_reason == "length"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    ap.add_argument("--heartbeat", type=float, default=PRODUCTION_HEARTBEAT)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report: dict[str, dict[str, object]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="fault-bench-"))
    for fault in args.faults:
        gaps, exact, failed = [], True, 0
        for i in range(args.runs):
            got = run(fault, tmp / f"{fault}{i}", args.heartbeat)
            if got is None:
                failed += 1
                continue
            gaps.append(got[0])
            exact &= got[1]
            print(f"{fault} run {i + 1}/{args.runs}: {got[0]:.1f} s to the next token, "
                  f"{'exact' if got[1] else 'WRONG TEXT'}", file=sys.stderr, flush=True)
        report[fault] = {"median_s": round(statistics.median(gaps), 1) if gaps else None,
                         "min_s": round(min(gaps), 1) if gaps else None, "max_s": round(max(gaps), 1) if gaps else None,
                         "runs": len(gaps), "failed": failed, "all_exact": exact}
    if args.json:
        print(json.dumps({"heartbeat_s": args.heartbeat, "faults": report}, indent=2))
        return
    print(f"heartbeat {args.heartbeat:g} s; seconds from the fault to the next token over {args.runs} runs")
    print(f"{'fault':<12} {'median':>7} {'min':>6} {'max':>6}  exact  failed")
    for fault, r in report.items():
        print(f"{fault:<12} {r['median_s']!s:>7} {r['min_s']!s:>6} {r['max_s']!s:>6}  {r['all_exact']!s:<5}  "
              f"{r['failed']}")


if __name__ == "__main__":
    main()
