"""Decisions on the whole job's evidence, through ``hpcelastic submit`` on the Slurm testbed (issue 18).

An unchanged torchrun script (``reference_train.py --plain``: no ``hpcelastic.worker`` at all, it saves
and resumes on its own) that Slurm stops at its time limit again and again is requeued each time, because
every attempt leaves a new complete checkpoint in the checkpoint directory, and finishes. Before, the
third time limit in a row without a *published* checkpoint ended the job FAILED (exit 5).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcelastic.lifecycle.history import requeue_counts
from hpcelastic.lifecycle.policy import MAX_STOPS_WITHOUT_PROGRESS
from hpcelastic.reasons import RequeueCounter
from hpcelastic.rundir import RunDir
from tests.slurm_utils import (
    events,
    final_digest,
    job_record,
    named,
    reference_digest,
    status_json,
    submit_reference,
    wait_job_finished,
    wait_no_leaks,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

#: 0.3 s a step. Slurm checks time limits every 30 s (PERIODIC_TIMEOUT), so the 25 s lead's signal comes
#: 35 to 60 s into an attempt of a 1-minute limit: at most about 185 steps an attempt. 600 steps take four
#: attempts or more, three or more of them stopped by the time limit.
STEPS = 600


def test_an_unchanged_self_checkpointing_script_survives_three_time_limits(
    tmp_path: Path, slurm_jobs: list[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    job, run = submit_reference(
        tmp_path,
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--max-requeues",
        "0",
        "--signal",
        "USR2@25",
        "--checkpoint-dir",
        str(ckpt),
        time_limit="1",
        steps=STEPS,
        train=("--plain", "--ckpt-dir", str(ckpt), "--step-time", "0.3"),
    )
    slurm_jobs.append(job)
    rec = wait_job_finished(job, timeout=900)
    evs = events(run)
    ended = named(evs, "attempt_ended")
    assert rec["JobState"] == "COMPLETED", (rec, ended)
    stops = [e for e in ended if e["reason"] == "time_limit"]
    assert len(stops) >= MAX_STOPS_WITHOUT_PROGRESS, ended
    # Slurm's view: one requeue per time limit, nothing else; none counted against the failure budget.
    assert job_record(job)["Restarts"] == str(len(stops))
    counts = requeue_counts(RunDir(run).events())
    assert counts[RequeueCounter.FAILURE] == 0 and counts[RequeueCounter.TIME_LIMIT] == len(stops), counts
    # On a loaded machine an attempt can start too late to save before its signal: it does not count.
    progressed = [e for e in stops if e["progressed"] and "checkpoint" in (e["progress"] or "")]
    assert len(progressed) >= MAX_STOPS_WITHOUT_PROGRESS, [
        (e["attempt"], e["progressed"], e["progress"]) for e in stops
    ]
    assert not named(evs, "requeue_skipped") and not named(evs, "checkpoint_published")
    assert final_digest(tmp_path) == reference_digest(STEPS)
    assert not wait_no_leaks(str(run))
    assert status_json(str(run))["outcome"] == "succeeded"
