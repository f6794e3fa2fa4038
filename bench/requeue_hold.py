"""How long a job that requeued itself waits before it runs again, on Slurm 22.05 and 24.11 side by side.

A job that runs ``scontrol requeue $SLURM_JOB_ID`` (as hpcelastic's decider does, inside the job) is held
by Slurm for ``AuthInfo`` cred_expire + 1 s, then waits for a scheduling pass. Three ways are timed, from
the requeue to RUNNING again, on two testbed instances of this bench's own (``hold22``: the host's 22.05;
``hold24``: 24.11 from its Debian root), both with the testbed's ``cred_expire=10``:

* ``requeue``: what every requeue costs;
* ``requeue + BeginTime from inside``: the job also sets ``StartTime=now`` on itself while it completes
  (what hpcelastic could do); Slurm resets it when the job has completed;
* ``requeue + kick from outside``: a process outside the job sets ``StartTime=now+3`` once the job is
  pending (at once it fails the next start: "Job credential revoked") and ``StartTime=now`` once that has
  passed, which also makes Slurm schedule at once. hpcelastic has no process outside the job.

    python bench/requeue_hold.py [--runs 3]      (root; brings the two instances up and down)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import machine_line, update_section  # noqa: E402

from tests.testbed import Testbed, own_instance  # noqa: E402

INSTANCES = {
    "22.05": ("hold22", {"index": "38", "nodes": "1"}),
    "24.11": ("hold24", {"index": "39", "nodes": "1", "slurm": "24.11"}),
}
SCRIPT = """#!/bin/bash
#SBATCH -N1 --requeue -o /dev/null
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then exit 0; fi
sleep 1
scontrol requeue $SLURM_JOB_ID
{inside}
sleep 30
"""
INSIDE = "scontrol update JobId=$SLURM_JOB_ID StartTime=now"


def state(tb: Testbed, job: str) -> str:
    out = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
    return out.split("JobState=", 1)[1].split()[0] if "JobState=" in out else ""


def restarts(tb: Testbed, job: str) -> int:
    out = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
    return int(out.split("Restarts=", 1)[1].split()[0]) if "Restarts=" in out else 0


def one(tb: Testbed, folder: Path, way: str) -> float:
    """Seconds from the job's requeue to RUNNING again (the second run ends at once)."""
    script = folder / f"{way.split()[-1]}.sh"
    script.write_text(SCRIPT.format(inside=INSIDE if "inside" in way else ""))
    job = tb.slurm("sbatch", "--parsable", str(script)).strip().split(";")[0]
    while restarts(tb, job) < 1:
        time.sleep(0.05)
    t0 = time.monotonic()
    if "outside" in way:
        while state(tb, job) != "PENDING":
            time.sleep(0.05)
        tb.slurm("scontrol", "update", f"JobId={job}", "StartTime=now+3")
        time.sleep(3.5)
        tb.slurm("scontrol", "update", f"JobId={job}", "StartTime=now")
    while state(tb, job) not in ("RUNNING", "COMPLETED", "COMPLETING"):
        time.sleep(0.1)
    return time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    ways = ("requeue", "requeue + BeginTime from inside", "requeue + kick from outside")
    results: dict[tuple[str, str], list[float]] = {}
    folder = Path(tempfile.mkdtemp(prefix="hpcelastic-hold-"))
    for release, (name, settings) in INSTANCES.items():
        with own_instance(name, settings) as tb:
            for way in ways:
                results[(release, way)] = [one(tb, folder, way) for _ in range(args.runs)]
                print(release, way, [round(x, 1) for x in results[(release, way)]], flush=True)
    rows = [
        f"| {way} | " + " | ".join(f"{statistics.median(results[(r, way)]):.1f}" for r in INSTANCES) + " |"
        for way in ways
    ]
    md = "\n".join(
        [
            "## Requeue hold on Slurm 22.05 and 24.11 (bench/requeue_hold.py)",
            "",
            machine_line()
            + f" One-node testbed instances, `AuthInfo=cred_expire=10`; medians of {args.runs}.",
            "Seconds from a job's own `scontrol requeue` (as hpcelastic's decider runs it) to RUNNING again.",
            "",
            "| way | " + " | ".join(f"Slurm {r}" for r in INSTANCES) + " |",
            "|---|" + "---|" * len(INSTANCES),
            *rows,
            "",
            "The hold is cred_expire + 1 s, then the next scheduling pass (up to 30 s here); with",
            "Slurm's default cred_expire of 120 s a requeue waits over two minutes. A BeginTime the job",
            "sets on itself is reset when it completes; only a process outside the job, which hpcelastic",
            "does not have, could shorten it.",
        ]
    )
    update_section("requeue_hold", md)
    print(md)
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/requeue_hold.py: run as root (it brings testbed instances up)")
    sys.exit(main())
