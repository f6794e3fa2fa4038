"""Hang localization end to end: how often the hung rank is named, and how fast.

Runs examples/hang_train.py (a plain torchrun-style script, no hpcelastic import) under
``hpcelastic run --nodes 2 --nproc-per-node 4 --stall-timeout T`` (8 ranks, local agents, no Slurm)
``--runs`` times; rank 5 sleeps at step 10 before its collective. Per run it reads the events and the
rank's log:

* hit: the ``root_cause`` names rank 5 and the line of the sleep;
* detection latency: the ``worker_failed`` event of the hang minus the moment rank 5 stopped (it prints it);
* the job finished (exit 0) after one restart.

Prints a markdown section and JSON; ``--write`` also writes the ``hang_localization`` section of
bench/RESULTS.md.

    python bench/hang_localization.py [--runs 10] [--stall-timeout 10] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402

SCRIPT = REPO / "examples" / "hang_train.py"
HANG_RANK = 5


def sleep_line() -> int:
    text = SCRIPT.read_text()
    return text[: text.index("time.sleep(3600)")].count("\n") + 1


def events(run: Path) -> list[dict[str, Any]]:
    lines = [line for f in sorted(run.glob("events*.jsonl")) for line in f.read_text().splitlines()]
    return sorted((json.loads(line) for line in lines if line.strip()), key=lambda e: e["ts"])


def one_run(tmp: Path, i: int, stall_timeout: float) -> dict[str, Any]:
    run = tmp / f"run-{i}"
    env = {**os.environ, "HANG_KIND": "sleep", "HANG_RANK": str(HANG_RANK)}
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "4"]
    argv += ["--stall-timeout", str(stall_timeout), "--max-restarts", "1", "--run-dir", str(run)]
    argv += [str(SCRIPT), "--steps", "12", "--ckpt-every", "5", "--step-time", "0.1"]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    wall = time.monotonic() - t0
    evs = events(run)
    cause = next((e for e in evs if e["event"] == "root_cause"), {})
    failed = next((e for e in evs if e["event"] == "worker_failed"), {})
    log = (run / "logs" / "attempt-0" / f"rank-{HANG_RANK}.log").read_text()
    m = re.search(r"injecting a hang: sleep at ([0-9.]+)", log)
    hit = cause.get("rank") == HANG_RANK and f"hang_train.py:{sleep_line()} " in str(cause.get("error"))
    return {
        "exit": proc.returncode,
        "hit": hit,
        "named": cause.get("rank"),
        "error": cause.get("error"),
        "latency_s": failed["ts"] - float(m.group(1)) if m and failed else None,
        "restarts": sum(e["event"] == "restarting" for e in evs),
        "wall_s": wall,
    }


def markdown(r: dict[str, Any]) -> str:
    lat = [x["latency_s"] for x in r["runs"] if x["latency_s"] is not None]
    ok = sum(x["exit"] == 0 and x["restarts"] == 1 for x in r["runs"])
    return f"""## Hang localization end to end (`bench/hang_localization.py`)

{machine_line()} `hpcelastic run --nodes 2 --nproc-per-node 4 --stall-timeout {r["stall_timeout"]:g}` of
examples/hang_train.py (no hpcelastic import, no heartbeats): rank 5 of 8 sleeps at step 10 before its
`all_gather`, {len(r["runs"])} runs.

| measure | value |
|---|---|
| right rank and line named (`root_cause`) | {r["hits"]} of {len(r["runs"])} |
| job finished after one restart | {ok} of {len(r["runs"])} |
| detection latency (rank stops -> hang declared), median | {statistics.median(lat):.1f} s |
| detection latency, max | {max(lat):.1f} s |
| latency minus the stall timeout, max | {max(lat) - r["stall_timeout"]:.1f} s |

The latency is the stall timeout, plus up to one sample interval (`max(2 s, stall_timeout / 5)`) on each
side, plus the stack dumps of every worker (a native dump is given up after 3 s; a Python-only dump is
taken alongside).
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--stall-timeout", type=float, default=10.0)
    ap.add_argument("--write", action="store_true", help="write the section of bench/RESULTS.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hpcelastic-hang-bench-") as tmp:
        runs = []
        for i in range(args.runs):
            runs.append(one_run(Path(tmp), i, args.stall_timeout))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    result = {"stall_timeout": args.stall_timeout, "runs": runs, "hits": sum(x["hit"] for x in runs)}
    md = markdown(result)
    print(md)
    print(json.dumps(result, indent=2))
    if args.write:
        update_section("hang_localization", md)


if __name__ == "__main__":
    main()
