"""``python -m hpcelastic.sim``: replay one simulated week, or run many and report the violations."""

from __future__ import annotations

import argparse
import json
import sys
import time

from hpcelastic.sim.drive import WeekResult, run_weeks
from hpcelastic.sim.invariants import summary


def week_line(res: WeekResult) -> str:
    w = res.week
    return (
        f"seed {w.seed}: {w.nodes} nodes (partition {w.partition}), {w.script.value} script, "
        f"{res.attempts} attempts, outcome {res.outcome}, ETTR {res.ettr:.3f}, "
        f"step {res.final_step}/{w.total_steps}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcelastic.sim", description=__doc__)
    p.add_argument("--seed", type=int, default=0, help="the (first) week's seed")
    p.add_argument("--weeks", type=int, default=1, help="how many weeks, seeds SEED, SEED+1, ...")
    p.add_argument("--nodes", type=int, default=None, help="force the node count")
    p.add_argument("--jobs", "-j", type=int, default=1, help="processes to run the weeks in")
    p.add_argument("--json", action="store_true", help="one JSON object per week on stdout")
    p.add_argument("--verbose", "-v", action="store_true", help="print each decision of a replayed week")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    results = run_weeks(a.seed, a.weeks, nodes=a.nodes, jobs=a.jobs)
    violations = [v for r in results for v in r.violations]
    for r in results:
        if a.json:
            print(json.dumps(as_json(r)))
        elif a.weeks == 1:
            print(week_line(r))
            for d in r.decisions if a.verbose else ():
                skip = f" ({d.skip})" if d.skip else ""
                print(
                    f"  {d.ts / 3600:7.2f} h attempt {d.attempt}: {d.action}{skip}, "
                    f"{len(d.exclude)} excluded, advanced={d.advanced}"
                )
    for v in violations[:20]:
        print(v, file=sys.stderr)
    if a.weeks > 1 and not a.json:
        took = time.perf_counter() - t0
        print(f"{a.weeks} weeks in {took:.1f} s; violations: {json.dumps(summary(violations))}")
    return 1 if violations else 0


def as_json(r: WeekResult) -> dict[str, object]:
    return {
        "seed": r.week.seed,
        "nodes": r.week.nodes,
        "script": r.week.script.value,
        "outcome": r.outcome,
        "ettr": r.ettr,
        "attempts": r.attempts,
        "allocated_s": round(r.allocated_s, 1),
        "productive_s": round(r.productive_s, 1),
        "work_done": round(r.work_done, 4),
        "violations": sorted({v.invariant for v in r.violations}),
    }


if __name__ == "__main__":
    sys.exit(main())
