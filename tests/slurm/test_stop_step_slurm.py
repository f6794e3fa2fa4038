"""One stop step for all ranks, through ``hpcelastic submit`` on the real Slurm testbed (issue 9, item 6).

Four ranks of different speeds on 2 nodes (tests/faults/stop_step_train.py) get the preemption signal
as Slurm delivers it to the batch shell (``scancel --signal=USR2 --batch``): every rank's
``should_stop()`` turns true after the same step, the job is requeued for the preemption (failure
budget untouched) and its second run completes. Slurm's own view: COMPLETED, Restarts=1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcelastic.events import EventLog
from hpcelastic.lifecycle.history import requeue_counts
from hpcelastic.reasons import RequeueCounter
from tests.slurm_utils import REPO, events, named, wait_job_finished, wait_no_leaks, wait_nodes_idle

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TRAIN = REPO / "tests" / "faults" / "stop_step_train.py"


def test_preempted_ranks_of_different_speeds_stop_after_the_same_step(
    tmp_path: Path, slurm_jobs: list[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run = tmp_path / "run"
    wait_nodes_idle()
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", "testbed"]
    argv += ["--run-dir", str(run), "--time", "10"]
    argv += ["--nodes", "2", "--gpus-per-node", "2", str(TRAIN), str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    slurm_jobs.append(job)
    deadline = time.monotonic() + 180
    while not (out / "ready").exists():
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.2)
    time.sleep(0.3)
    subprocess.run(["scancel", "--signal=USR2", "--batch", job], check=True)
    rec = wait_job_finished(job, timeout=300)
    log = "\n".join(p.read_text() for p in run.glob("slurm-*.out"))
    story = f"{[e['event'] for e in events(run)]}\n{log[-4000:]}"
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", (rec, story)
    stops = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))}
    assert sorted(stops) == [f"rank-{r}.json" for r in range(4)], (stops, story)
    steps = {s["step"] for s in stops.values()}
    assert len(steps) == 1, stops
    assert sorted(p.name for p in out.glob("again-*")) == [f"again-{r}" for r in range(4)]
    assert f"every rank stops after step {steps.pop()}" in log, log[-3000:]
    evs = events(run)
    (requeued,) = named(evs, "requeued")
    assert requeued["reason"] == "preempted", requeued
    counts = requeue_counts(EventLog(evs))
    assert counts[RequeueCounter.FAILURE] == 0 and counts[RequeueCounter.PREEMPTED] == 1
    assert not wait_no_leaks(str(run))
