"""The requeue policy's own share of the turnaround: decision -> job pending again (target < 1 s).

Needs the Slurm testbed (scripts/testbed.sh up). Submits small sleeping ``sbatch --requeue`` jobs,
waits until they run, then times ``RequeuePolicy.decide`` in ``requeue`` mode (``scontrol requeue``
plus excluding the node it ran on) and in ``resubmit`` mode (``sbatch --dependency=afterany``).
``duration_s`` is what decide records in its ``requeued``/``resubmitted`` event. Also shown, for
context, is how long Slurm itself takes until squeue reports the job PENDING (the kill of the old
allocation); that part is not the tool's. Everything submitted is scancelled.

    python bench/requeue_turnaround.py [--jobs 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import machine_line, update_section  # noqa: E402

from hpcelastic import events, handoff  # noqa: E402
from hpcelastic.errors import SlurmError  # noqa: E402
from hpcelastic.jobs import slurm  # noqa: E402
from hpcelastic.lifecycle.executor import Executor  # noqa: E402
from hpcelastic.lifecycle.policy import AttemptEnd, Settings  # noqa: E402
from hpcelastic.reasons import Reason  # noqa: E402
from hpcelastic.rundir import RunDir  # noqa: E402

SCRIPT = """#!/bin/bash
#SBATCH --partition=debug
#SBATCH --nodes=1
#SBATCH --requeue
#SBATCH --output={run}/slurm-%j.out
#SBATCH --job-name=hpce-bench-requeue
sleep 600
"""


def _testbed_up() -> bool:
    try:
        slurm.run_slurm(["scontrol", "ping"], timeout=10)
    except SlurmError:
        return False
    return True


def _wait(job_ids: list[str], states: tuple[str, ...], timeout: float = 120.0) -> dict[str, slurm.JobState]:
    deadline = time.monotonic() + timeout
    while True:
        found = slurm.query_states(job_ids)
        if all(j in found and found[j].state in states for j in job_ids):
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"jobs did not reach {states} in {timeout:.0f} s: {found}")
        time.sleep(0.2)


def _run_mode(base: Path, mode: str, n: int, submitted: list[str]) -> tuple[list[float], list[float]]:
    runs: list[tuple[RunDir, str]] = []
    for i in range(n):
        rd = RunDir.create(base / f"{mode}-{i}")
        rd.script_path.write_text(SCRIPT.format(run=rd.path))
        job_id = slurm.sbatch(rd.script_path, cwd=rd.path)
        rd.record(events.submitted(job_id=job_id, backend="sbatch", nodes="1", script=str(rd.script_path)))
        submitted.append(job_id)
        runs.append((rd, job_id))
    found = _wait([j for _, j in runs], ("RUNNING",))
    executor, settings = Executor(say=lambda m: None), Settings.parse(mode, 1)
    tool: list[float] = []
    pending: list[float] = []
    for rd, job_id in runs:
        node = found[job_id].nodes
        attempt = handoff.begin_attempt(rd, job_id, 0, [node])
        t0 = time.monotonic()
        end = AttemptEnd(attempt, Reason.NODE_UNHEALTHY, Reason.NODE_UNHEALTHY.exit_code, job_id, (node,))
        out = executor.conclude(rd, end, settings)
        if out.action != ("requeued" if mode == "requeue" else "resubmitted") or out.duration_s is None:
            raise SystemExit(f"{mode}: unexpected outcome {out}")
        tool.append(out.duration_s)
        if out.job_id and out.job_id != job_id:
            submitted.append(out.job_id)
        _wait([out.job_id or job_id], ("PENDING",), timeout=60)
        pending.append(time.monotonic() - t0)
    return tool, pending


def _row(name: str, values: list[float]) -> str:
    vals = sorted(values)
    p90 = vals[min(len(vals) - 1, int(round(0.9 * (len(vals) - 1))))]
    ms = [statistics.median(vals) * 1000, p90 * 1000, vals[-1] * 1000]
    return f"| {name} | {len(vals)} | " + " | ".join(f"{v:.0f}" for v in ms) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8, help="jobs per mode (default 8)")
    args = parser.parse_args()
    if not _testbed_up():
        print(
            "the Slurm testbed is not up (scontrol ping failed): run scripts/testbed.sh up first",
            file=sys.stderr,
        )
        return 2
    submitted: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="hpce-bench-requeue-") as tmp:
            os.environ["XDG_STATE_HOME"] = tmp  # keep the user's run index free of benchmark runs
            req_tool, req_pending = _run_mode(Path(tmp), "requeue", args.jobs, submitted)
            sub_tool, sub_pending = _run_mode(Path(tmp), "resubmit", args.jobs, submitted)
    finally:
        for jid in submitted:
            subprocess.run(["scancel", jid], capture_output=True, check=False)
    md = "\n".join(
        [
            "## Requeue turnaround (bench/requeue_turnaround.py)",
            "",
            machine_line() + " Slurm testbed: 4 emulated nodes on this host.",
            "",
            "Tool's share = `Executor.conclude` from the decision to Slurm accepting the job as pending",
            "again (claim, events, `scontrol requeue` + ExcNodeList of its node, or",
            "`sbatch --dependency=afterany` with `--exclude`), as recorded in the event's `duration_s`.",
            "Target: under 1 s. 'Until squeue says PENDING' adds Slurm killing the old allocation.",
            "",
            "| measure | n | median ms | p90 ms | max ms |",
            "|---|---|---|---|---|",
            _row("requeue mode: tool's share", req_tool),
            _row("requeue mode: until squeue says PENDING", req_pending),
            _row("resubmit mode: tool's share", sub_tool),
            _row("resubmit mode: until the new job is PENDING", sub_pending),
        ]
    )
    print(md)
    update_section("requeue_turnaround", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
