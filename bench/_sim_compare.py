"""Shared by the simulated-week benchmarks that compare this tree with an older one (bench/sim_tier_weeks.py,
bench/sim_replica_weeks.py): the older tree, the weeks run in subprocesses, the seeds that broke what, the
trees' names and the invariant table's common rows.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Processes per tree (the machine's cores).
JOBS = 2


def old_tree(old: str) -> Path:
    """The older tree (a directory as given, or a worktree of a commit made once), holding this tree's sim."""
    path = Path(old)
    if not path.is_dir():
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpcelastic-sim-{old}"
        if not (path / "hpcelastic").is_dir():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), old], check=True
            )
    shutil.rmtree(path / "hpcelastic" / "sim", ignore_errors=True)
    shutil.copytree(ROOT / "hpcelastic" / "sim", path / "hpcelastic" / "sim")
    return path


def run_weeks(module: str, tree: Path, weeks: int) -> tuple[list[dict[str, Any]], float]:
    """Every week's JSON line of ``python -m MODULE --json``, seeds 0..weeks-1, with the code in ``tree``
    (JOBS processes); and the seconds."""
    t0 = time.perf_counter()
    share = -(-weeks // JOBS)

    def chunk(first: int) -> str:
        argv = ["--seed", str(first), "--weeks", str(min(share, weeks - first)), "--json"]
        return subprocess.run(
            [sys.executable, "-m", module, *argv],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)},
            capture_output=True,
            text=True,
        ).stdout

    with ThreadPoolExecutor(JOBS) as pool:
        outs = list(pool.map(chunk, range(0, weeks, share)))
    rows = [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]
    return rows, time.perf_counter() - t0


def first_seeds(rows: list[dict[str, Any]], most: int = 6) -> str:
    """Per violated invariant: the first seeds (``python -m <sim> --seed N`` replays one)."""
    seeds: dict[str, list[int]] = {}
    for r in rows:
        for v in r["violations"]:
            seeds.setdefault(v, []).append(r["seed"])
    shown = [
        f"`{v}`: seeds {', '.join(map(str, s[:most]))}{' ...' if len(s) > most else ''}"
        for v, s in sorted(seeds.items())
    ]
    return "; ".join(shown) or "none"


def tree_names(old: str) -> tuple[str, str]:
    """How the table names this tree (its HEAD, and whether the working tree differs) and the older one."""
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    status = ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]
    dirty = subprocess.run(status, capture_output=True, text=True).stdout.strip()
    return f"this tree (HEAD {head}{' + working tree' if dirty else ''})", f"before ({old})"


def violation_rows(by: dict[str, list[dict[str, Any]]], invariants: Sequence[str]) -> list[str]:
    """The table's head and its rows of weeks, weeks breaking any invariant and each one."""
    names = list(by)
    out = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    out.append("| weeks | " + " | ".join(str(len(rows)) for rows in by.values()) + " |")
    broken = {n: sum(1 for r in rows if r["violations"]) for n, rows in by.items()}
    out.append("| weeks breaking any invariant | " + " | ".join(str(broken[n]) for n in names) + " |")
    counts = {n: collections.Counter(v for r in rows for v in r["violations"]) for n, rows in by.items()}
    for inv in invariants:
        out.append(f"| weeks breaking `{inv}` | " + " | ".join(str(counts[n][inv]) for n in names) + " |")
    return out


def compare(
    *,
    module: str,
    section: str,
    title: str,
    description: str,
    default_old: str,
    count: str,
    table: Callable[[dict[str, list[dict[str, Any]]]], list[str]],
) -> int:
    """Run ``module``'s weeks with this tree and the older one (``--weeks``, ``--old``), write the table
    (``table``), run times and violating seeds as ``section`` of bench/RESULTS.md; ``count``: the per-week
    field whose values the head line counts."""
    from _results import machine_line, update_section

    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--weeks", type=int, default=10_000)
    parser.add_argument("--old", default=default_old, help="the older tree: a directory or a commit")
    args = parser.parse_args()
    old = old_tree(args.old)
    new_rows, new_s = run_weeks(module, ROOT, args.weeks)
    old_rows, old_s = run_weeks(module, old, args.weeks)
    new_name, old_name = tree_names(args.old)
    counted = collections.Counter(r[count] for r in new_rows)
    md = [
        f"## {title}",
        "",
        machine_line(),
        "",
        f"{args.weeks} simulated weeks (seeds 0-{args.weeks - 1}; {count}: "
        + ", ".join(f"{n} x{c}" for n, c in sorted(counted.items()))
        + f") of {module.replace('.', '/')}.py: "
        + description,
        "",
        *table({new_name: new_rows, old_name: old_rows}),
        "",
        f"Run time: this tree {new_s:.0f} s, before {old_s:.0f} s ({JOBS} processes each).",
        "",
        f"Violations, {old_name}: {first_seeds(old_rows)}.",
        "",
        f"Violations, {new_name}: {first_seeds(new_rows)}.",
    ]
    update_section(section, "\n".join(md))
    print("\n".join(md))
    return 0
