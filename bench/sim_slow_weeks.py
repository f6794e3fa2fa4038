"""Simulated weeks with slow nodes (hpcelastic/sim/slow.py): invariant violations, what the policy did and
how soon, and the ledger's slow time against the model's.

Runs seeds 0..N-1 through ``python -m hpcelastic.sim.slow --json`` in subprocesses (niced), and writes the
``sim_slow_weeks`` section of bench/RESULTS.md.

    python bench/sim_slow_weeks.py [--weeks 10000] [--jobs 2] [--cache DIR]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import machine_line, update_section  # noqa: E402
from sim_tier_weeks import first_seeds  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTION = "sim_slow_weeks"
CHUNK = 250  # weeks per subprocess (each prints its weeks when done)
INVARIANTS = ("healthy_kept", "slow_handled", "swaps_within_spares", "spare_fit", "slow_time_adds_up")
#: Slowdown classes of the delays: a node at 50 %, 70 % and 85 % of its speed costs the job about this much.
CLASSES = ((0.3, 0.4, "30-40 %"), (0.4, 0.6, "40-60 %"), (0.6, 1.0, "60 % or more"))
DESCRIPTION = " ".join(
    (
        "each week is one job of 2-64 nodes and 0-3 hot spares over allocations of 4-48 h (requeued at the",
        "time limit, the policy's exclusions cooled down and capped as lost nodes are), driving the tree's",
        "policy and the real detector's pace (windows of 10-30 s, its baseline, sustained drops, saves,",
        "warm-up, rebaseline) with a modelled locate (the slowest node named when it explains a quarter of",
        "the loss, missed up to 3 %, a job-wide slowdown misattributed to a random node up to 5 %). Slow",
        "nodes: persistent, transient (20 s to 10 h), flapping (on and off for 30 min to 10 h), at 30-95 %",
        "of their speed, spares too; noise: GPUs 14 % apart, 15 % step jitter, workload stripes, slow first",
        "steps, checkpoint saves of 15 s to 10 min (announced to the detector in 70 % of the weeks), the",
        "machine under load on all nodes alike. Settings drawn per week around the defaults (action swap,",
        "exclude or report; min_slowdown 0.2-0.25; windows 5-8).",
    )
)


def code_key() -> str:
    """A hash of the code the weeks run (hpcelastic/slow and hpcelastic/sim as in the working tree)."""
    digest = hashlib.sha256()
    for path in sorted(
        [*(ROOT / "hpcelastic" / "slow").glob("*.py"), *(ROOT / "hpcelastic" / "sim").glob("*.py")]
    ):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def run_weeks(weeks: int, jobs: int, cache: Path | None = None) -> tuple[list[dict[str, Any]], float]:
    """Every week's JSON line, seeds 0..weeks-1; and the seconds it took. With ``cache``, each chunk's lines
    are kept in ``cache/<code key>/`` and a later run takes them from there (the weeks can be run a few
    chunks at a time, on a machine's idle cores)."""
    t0 = time.perf_counter()
    kept = cache / code_key() if cache is not None else None

    def chunk(first: int) -> str:
        done = kept / f"{first}-{min(CHUNK, weeks - first)}.jsonl" if kept is not None else None
        if done is not None and done.exists():
            return done.read_text()
        argv = ["--seed", str(first), "--weeks", str(min(CHUNK, weeks - first)), "--json"]
        proc = subprocess.run(
            ["nice", "-n", "10", sys.executable, "-m", "hpcelastic.sim.slow", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if proc.returncode not in (0, 1):  # 1: the weeks ran and some broke an invariant (in their lines)
            raise RuntimeError(f"seeds {first}+: exit {proc.returncode}: {proc.stderr[-2000:]}")
        out = proc.stdout
        if done is not None:
            done.parent.mkdir(parents=True, exist_ok=True)
            done.with_suffix(".tmp").write_text(out)
            done.with_suffix(".tmp").replace(done)
        return out

    with ThreadPoolExecutor(jobs) as pool:
        outs = list(pool.map(chunk, range(0, weeks, CHUNK)))
    rows = [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]
    return rows, time.perf_counter() - t0


def delays(rows: list[dict[str, Any]], key: str) -> list[str]:
    """Median, 90th percentile and most of the delays (from a 30 %+ run's start), per slowdown class."""
    out = []
    for low, high, name in CLASSES:
        values = sorted(d for r in rows for s, d in r[key] if low <= s < high)
        if not values:
            out.append(f"| {name} | 0 | | | |")
            continue
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        out.append(
            f"| {name} | {len(values)} | {statistics.median(values):.0f} | {p90:.0f} | {values[-1]:.0f} |"
        )
    return out


def orders(total: collections.Counter[str], counts: collections.Counter[str]) -> list[tuple[str, int]]:
    return [
        ("swaps (a checked, fast spare in a slow node's place at a checkpoint)", total["swaps"]),
        ("exclusions at a requeue", total["exclusions"]),
        ("false actions (a swap or exclusion of a node not slow in its allocation)", counts["healthy_kept"]),
        ("reports naming a node", total["reports"]),
        ("of them naming a node without a slowdown of its own within the bound", total["false_reports"]),
        ("job-wide reports (loads, stripes, unannounced saves, slow starts)", total["job_wide_reports"]),
        (
            "runs of 30 %+ the pace could not see (baseline learned while slow, or none yet)",
            total["invisible_runs"],
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weeks", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None, help="keep each chunk's weeks here (resumable)")
    args = parser.parse_args()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "hpcelastic/slow", "hpcelastic/sim"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    rows, took = run_weeks(args.weeks, args.jobs, args.cache)
    counts = collections.Counter(v for r in rows for v in r["violations"])
    nodes = collections.Counter(r["nodes"] for r in rows)
    total = collections.Counter()
    for r in rows:
        total.update(
            {k: r[k] for k in ("reports", "false_reports", "job_wide_reports", "swaps", "exclusions")}
        )
        total.update({k: r[k] for k in ("invisible_runs", "windows")})
    ledger, model = sum(r["ledger_s"] for r in rows), sum(r["model_s"] for r in rows)
    true_slow = sum(r["true_slow_s"] for r in rows)
    hours = sum(r["windows"] for r in rows)  # judged windows: their time, below
    md = [
        "## Simulated weeks with slow nodes (bench/sim_slow_weeks.py)",
        "",
        machine_line(),
        "",
        f"{len(rows)} simulated weeks (seeds 0-{args.weeks - 1}; nodes: "
        + ", ".join(f"{n} x{c}" for n, c in sorted(nodes.items()))
        + f") of hpcelastic/sim/slow.py at HEAD {head}"
        + (" (hpcelastic/slow or hpcelastic/sim changed in the working tree)" if dirty else "")
        + ": "
        + DESCRIPTION,
        "",
        "| | weeks |",
        "|---|---|",
        f"| weeks | {len(rows)} |",
        f"| weeks breaking any invariant | {sum(1 for r in rows if r['violations'])} |",
        *(f"| weeks breaking `{inv}` | {counts[inv]} |" for inv in INVARIANTS),
        "",
        "| the policy's orders, all weeks | |",
        "|---|---|",
        *(f"| {what} | {n} |" for what, n in orders(total, counts)),
        "",
        "Detection to action, seconds from the start of a run of 30 % or more (the slowest node, without a "
        "break) to the policy's report, and to its swap (at the first checkpoint once the slowdown cost a "
        "swap; checkpoints every 10 min to 3 h):",
        "",
        "| slowdown | reports | median | p90 | max |",
        "|---|---|---|---|---|",
        *delays(rows, "report_delays"),
        "",
        "| slowdown | swaps | median | p90 | max |",
        "|---|---|---|---|---|",
        *delays(rows, "swap_delays"),
        "",
        f"Ledger: {ledger / 3600:.0f} h of slow time over the verdicts' windows (`policy.slow_time_s`), "
        f"the model's truth over the same seconds {model / 3600:.0f} h "
        f"({(ledger - model) / model:+.2%}); all the time slow nodes, loads and stripes cost "
        f"{true_slow / 3600:.0f} h (the rest: drops the pace did not sustain, or could not see, and "
        f"rebaselined loads). {hours} windows judged or skipped as calm.",
        "",
        f"Run time: {took:.0f} s ({args.jobs} processes"
        + (", chunks kept from earlier runs of the same code included" if args.cache else "")
        + f"). Violations: {first_seeds(rows)}.",
    ]
    update_section(SECTION, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
