"""Simulated weeks (hpcelastic/sim): effective training time ratio and outcomes, today's code against the old.

Runs the same seeds through ``python -m hpcelastic.sim --json`` twice, in subprocesses: once with this
tree's decision code, once with the code of ``--old`` (default 229e54b, before issue 18's fixes), from a
git worktree into which this tree's ``hpcelastic/sim`` is copied (the simulation's adapter drives either
version's JobState, history and policy). Writes the ``sim_weeks`` section of bench/RESULTS.md.

    python bench/sim_weeks.py [--weeks 10000] [--old 229e54b]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import machine_line, update_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOBS = 2


def worktree(commit: str) -> Path:
    """A checkout of ``commit`` (made once) holding this tree's simulation."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpcelastic-sim-{commit}"
    if not (path / "hpcelastic").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True)
    shutil.rmtree(path / "hpcelastic" / "sim", ignore_errors=True)
    shutil.copytree(ROOT / "hpcelastic" / "sim", path / "hpcelastic" / "sim")
    return path


def run_weeks(tree: Path, weeks: int) -> tuple[list[dict[str, Any]], float]:
    """Every week's JSON line, seeds 0..weeks-1, run by the decision code in ``tree``; and the seconds."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "hpcelastic.sim", "--weeks", str(weeks), "--jobs", str(JOBS), "--json"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines()], time.perf_counter() - t0


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """p10, median, p90."""
    if len(values) < 2:
        v = values[0] if values else 0.0
        return v, v, v
    q = statistics.quantiles(values, n=10, method="inclusive")
    return q[0], statistics.median(values), q[8]


def outcome(row: dict[str, Any]) -> str:
    o = row["outcome"]
    return o.replace("abandoned:", "abandoned: ") if o.startswith("abandoned:") else o


def table(rows_by: dict[str, list[dict[str, Any]]]) -> list[str]:
    names = list(rows_by)
    out = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    ettr = {n: quantiles([r["ettr"] for r in rows]) for n, rows in rows_by.items()}
    work = {n: quantiles([r["work_done"] for r in rows]) for n, rows in rows_by.items()}
    out.append(
        "| ETTR median (p10-p90) | "
        + " | ".join(f"{m:.3f} ({lo:.3f}-{hi:.3f})" for lo, m, hi in ettr.values())
        + " |"
    )
    out.append(
        "| work done median (p10-p90) | "
        + " | ".join(f"{m:.2f} ({lo:.2f}-{hi:.2f})" for lo, m, hi in work.values())
        + " |"
    )
    for script in ("api", "heartbeat", "plain"):
        cells = []
        for rows in rows_by.values():
            ettrs = sorted(r["ettr"] for r in rows if r["script"] == script)
            done = [r["work_done"] for r in rows if r["script"] == script]
            cells.append(f"{statistics.median(ettrs):.3f} / {statistics.mean(done):.2f}" if ettrs else "-")
        out.append(f"| {script} script: ETTR median / mean work done | " + " | ".join(cells) + " |")
    counts = {n: collections.Counter(outcome(r) for r in rows) for n, rows in rows_by.items()}
    kinds = sorted({k for c in counts.values() for k in c}, key=lambda k: (not k.startswith("finished"), k))
    for k in kinds:
        out.append(
            f"| {k} | "
            + " | ".join(f"{counts[n][k]} ({100 * counts[n][k] / len(rows_by[n]):.1f} %)" for n in names)
            + " |"
        )
    broken = {n: collections.Counter(v for r in rows for v in r["violations"]) for n, rows in rows_by.items()}
    for inv in sorted({v for c in broken.values() for v in c}):
        out.append(f"| weeks breaking `{inv}` | " + " | ".join(str(broken[n][inv]) for n in names) + " |")
    return out


def first_seeds(rows: list[dict[str, Any]], most: int = 6) -> list[str]:
    """Per violated invariant: the first seeds (each replays with ``python -m hpcelastic.sim --seed N``)."""
    seeds: dict[str, list[int]] = {}
    for r in rows:
        for v in r["violations"]:
            seeds.setdefault(v, []).append(r["seed"])
    return [
        f"`{v}`: seeds {', '.join(map(str, s[:most]))}{' ...' if len(s) > most else ''}"
        for v, s in sorted(seeds.items())
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weeks", type=int, default=10_000)
    parser.add_argument("--old", default="229e54b", help="the commit of the old decision code")
    args = parser.parse_args()
    old_tree = worktree(args.old)
    new_rows, new_s = run_weeks(ROOT, args.weeks)
    old_rows, old_s = run_weeks(old_tree, args.weeks)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    new_name, old_name = f"new ({head})", f"old ({args.old})"
    by_nodes = collections.Counter(r["nodes"] for r in new_rows)
    md = [
        "## Simulated weeks: effective training time ratio and outcomes (bench/sim_weeks.py)",
        "",
        machine_line(),
        "",
        f"{args.weeks} simulated weeks (seeds 0-{args.weeks - 1}; nodes: "
        + ", ".join(f"{n} x{c}" for n, c in sorted(by_nodes.items()))
        + ") of hpcelastic/sim: Slurm (daily time limits, preemption with and without grace, nodes "
        "DOWN after SlurmdTimeout, a rare scancel), workers (steps, saves of random length, scripts with the "
        "worker API, with heartbeat() only, or unchanged), faults at Llama 3's rates (0.47 per 1,000 "
        "GPU-days; 59 % GPU, a faulty GPU fails again) and network drops at any node. Each week is run by "
        "both versions' real JobState, history and policy. ETTR = productive / allocated time; work done = "
        "checkpointed steps / the job's steps at the week's end (1.0: finished).",
        "",
        *table({new_name: new_rows, old_name: old_rows}),
        "",
        f"Run time: new {new_s:.0f} s, old {old_s:.0f} s ({JOBS} processes).",
        "",
        f"Violations, {old_name}: " + ("; ".join(first_seeds(old_rows)) or "none") + ".",
        "",
        f"Violations, {new_name}: " + ("; ".join(first_seeds(new_rows)) or "none") + ".",
    ]
    update_section("sim_weeks", "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
