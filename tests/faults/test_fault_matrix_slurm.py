"""The fault matrix on the real Slurm testbed: each test breaks a job the way a cluster does.

For every fault: the job ends in the right Slurm state, no process of the run survives on any
emulated node, the final parameters are bit-for-bit those of a fault-free torchrun run, and
`hpcelastic status` tells what happened. The scenarios of tests/slurm/test_recovery_e2e.py
(worker SIGKILLed, agent SIGKILLed with and without a spare node, crash loop, preemption,
resubmit) complete the matrix; the README's Reliability section lists all of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from hpcelastic.lifecycle.history import requeue_counts
from hpcelastic.reasons import RequeueCounter
from hpcelastic.rundir import RunDir
from tests.slurm_utils import (
    REPO,
    events,
    final_digest,
    job_record,
    named,
    reference_digest,
    status_json,
    submit_reference,
    wait_for_event,
    wait_job_finished,
    wait_no_leaks,
)
from tests.testbed import Testbed

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TWO_NODES = ("--nodes", "2", "--gpus-per-node", "2")


def site_file(tmp_path: Path, extra: str = "", replace: tuple[str, str] | None = None) -> str:
    """A site config: the testbed's plus ``extra`` YAML lines (a site admin's edit)."""
    text = (REPO / "site_configs" / "testbed.yaml").read_text()
    if replace:
        text = text.replace(*replace)
    path = tmp_path / "site.yaml"
    path.write_text(text + extra)
    return str(path)


def finished_ok(tmp_path: Path, job: str, run: Path, steps: int = 30, timeout: float = 300) -> dict[str, Any]:
    """Assert the run completed with the fault-free model and left nothing behind; return status."""
    rec = wait_job_finished(job, timeout=timeout)
    assert rec["JobState"] == "COMPLETED", rec
    assert final_digest(tmp_path) == reference_digest(steps)
    assert not wait_no_leaks(str(run)), "processes of the run survived"
    story = status_json(str(run))
    assert story["outcome"] == "succeeded"
    return story


def reasons(story: dict[str, Any]) -> str:
    return json.dumps(story["timeline"])


def test_worker_raises_root_cause_has_its_traceback(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(
        tmp_path, *TWO_NODES, "--max-restarts", "1", train=("--fault", "raise", "--fault-rank", "3")
    )
    slurm_jobs.append(job)
    story = finished_ok(tmp_path, job, run)
    (cause,) = named(events(run), "root_cause")
    assert cause["rank"] == 3 and "injected failure" in cause["traceback"]
    assert "RuntimeError: injected failure" in reasons(story)


def test_worker_hang_is_failed_by_the_stall_timeout(tmp_path: Path, slurm_jobs: list[str]) -> None:
    site = site_file(tmp_path, "stall_timeout: 3\n")
    job, run = submit_reference(
        tmp_path, *TWO_NODES, "--max-restarts", "1", site=site, train=("--fault", "hang", "--fault-rank", "2")
    )
    slurm_jobs.append(job)
    finished_ok(tmp_path, job, run)
    # Ranks blocked in a collective with the hung one stop beating too: every rank stalls at
    # the same step, so the root cause is "stalled" on some rank, and the job restarts once.
    (cause,) = named(events(run), "root_cause")
    assert "stalled" in cause["error"]
    assert 2 in {e["rank"] for e in named(events(run), "worker_failed")}
    assert len(named(events(run), "restarting")) == 1


def test_grandchild_left_behind_is_killed(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(
        tmp_path, *TWO_NODES, "--max-restarts", "1", train=("--fault", "grandchild", "--fault-rank", "1")
    )
    slurm_jobs.append(job)
    finished_ok(tmp_path, job, run)  # includes: no process of the run (the grandchild too) survives
    assert [r["restart_count"] for r in named(events(run), "rendezvous")] == [0, 1]


def test_coordinator_agent_killed_finalize_requeues(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(
        tmp_path, *TWO_NODES, "--max-restarts", "1", train=("--fault", "kill-agent", "--fault-rank", "0")
    )
    slurm_jobs.append(job)
    story = finished_ok(tmp_path, job, run)
    ended = named(events(run), "attempt_ended")
    assert ended[0]["reason"] == "coordinator_lost" and ended[-1]["reason"] == "succeeded"
    (requeued,) = named(events(run), "requeued")
    assert requeued["reason"] == "coordinator_lost"
    assert "coordinator_lost" in reasons(story)


def test_two_workers_on_two_nodes_crash_at_once(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(
        tmp_path, *TWO_NODES, "--max-restarts", "1", train=("--fault", "exit", "--fault-rank", "1,3")
    )
    slurm_jobs.append(job)
    finished_ok(tmp_path, job, run)
    evs = events(run)
    assert len(named(evs, "root_cause")) == 1  # one root cause job-wide, not one per node
    assert len(named(evs, "restarting")) == 1
    # The second crash can land while its agent is already stopping the round for the first; it
    # is then one of the stopped workers. Either way the root cause is one of the two.
    assert named(evs, "root_cause")[0]["rank"] in (1, 3)
    assert {e["rank"] for e in named(evs, "worker_failed")} <= {1, 3}


def test_crash_during_rendezvous_of_a_round(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(
        tmp_path, *TWO_NODES, "--max-restarts", "1", train=("--fault", "init", "--fault-rank", "2")
    )
    slurm_jobs.append(job)
    finished_ok(tmp_path, job, run)
    (cause,) = named(events(run), "root_cause")
    assert cause["rank"] == 2 and cause["exitcode"] == 17


def test_crash_while_writing_a_checkpoint_never_hands_it_off(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(
        tmp_path,
        *TWO_NODES,
        "--max-restarts",
        "1",
        train=("--fault", "ckpt-crash", "--fault-step", "10", "--fault-rank", "0"),
    )
    slurm_jobs.append(job)
    finished_ok(tmp_path, job, run)
    published = [e["step"] for e in named(events(run), "checkpoint_published")]
    # The torn step-10 file was never published: the restarted round resumed from step 5 and
    # published step 10 itself, once.
    assert published[:2] == [5, 10] and published.count(10) == 1
    (cause,) = named(events(run), "root_cause")
    assert cause["exitcode"] == 15


def test_identical_startup_failure_is_not_requeued_again(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(
        tmp_path,
        *TWO_NODES,
        "--max-restarts",
        "1",
        train=("--fault", "startup", "--fault-rank", "0", "--fault-attempt", "-1", "--fault-restart", "-1"),
    )
    slurm_jobs.append(job)
    rec = wait_job_finished(job, timeout=300)
    assert rec["JobState"] == "FAILED" and rec["ExitCode"].startswith("8:"), rec
    evs = events(run)
    # Round 1 failed exactly like round 0 before any step: the attempt stops restarting at once (before,
    # it spent the restart budget, was requeued, and failed twice more the same way).
    assert [e["reason"] for e in named(evs, "attempt_ended")] == ["startup_failure"]
    assert len(named(evs, "rendezvous")) == 2 and not named(evs, "requeued")
    assert named(evs, "requeue_skipped")[0]["reason"] == "startup_failure"
    assert not wait_no_leaks(str(run))
    story = status_json(str(run))
    assert story["outcome"] != "succeeded" and "startup_failure" in reasons(story)


@pytest.mark.parametrize(
    ("time_limit", "lead", "steps"),
    # Slurm sends the --signal on its own schedule, up to a minute early: with 7 minutes and a 330 s lead
    # (a lead over 300 s is still the time limit, not a cancel) 30-90 s in, before the 120 s of training
    # are done. (A short lead: tests/slurm/test_decisions_slurm.py's three time limits, same counters.)
    [("7", 330, 400)],
    ids=["lead-330s"],
)
def test_time_limit_checkpoints_and_requeues_without_using_the_budget(
    tmp_path: Path, slurm_jobs: list[str], time_limit: str, lead: int, steps: int
) -> None:
    job, run = submit_reference(
        tmp_path,
        *TWO_NODES,
        "--max-restarts",
        "0",
        "--signal",
        f"USR2@{lead}",
        time_limit=time_limit,
        steps=steps,
        train=("--step-time", "0.3"),
    )
    slurm_jobs.append(job)
    story = finished_ok(tmp_path, job, run, steps=steps, timeout=600)
    requeued = named(events(run), "requeued")
    assert requeued and {r["reason"] for r in requeued} == {"time_limit"}
    assert job_record(job)["Restarts"] == str(len(requeued))  # Slurm's view: one requeue each, no other
    counts = requeue_counts(RunDir(run).events())
    assert counts[RequeueCounter.FAILURE] == 0 and counts[RequeueCounter.TIME_LIMIT] == len(requeued)
    assert "time_limit" in reasons(story)


def test_scontrol_failing_during_requeue_falls_back_to_resubmit(
    tmp_path: Path, slurm_jobs: list[str]
) -> None:
    broken = tmp_path / "broken-bin"
    broken.mkdir()
    scontrol = broken / "scontrol"
    # The fault: on the compute nodes, scontrol cannot reach slurmctld (what users see when it is down).
    scontrol.write_text(
        "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\nexit 1\n"
    )
    scontrol.chmod(0o755)
    site = site_file(tmp_path, f'setup:\n  - export PATH="{broken}:$PATH"\n')
    job, run = submit_reference(
        tmp_path, *TWO_NODES, "--max-restarts", "0", site=site, train=("--fault", "exit", "--fault-rank", "1")
    )
    slurm_jobs.append(job)
    resub = wait_for_event(run, "resubmitted", timeout=240)
    slurm_jobs.append(str(resub["job_id"]))
    evs = events(run)
    assert named(evs, "requeue_failed")[0]["fallback"] == "resubmit"
    assert resub["dependency"] == f"afterany:{job}"
    story = finished_ok(tmp_path, str(resub["job_id"]), run)
    assert story["latest_job_id"] == str(resub["job_id"])
    assert len(named(events(run), "resubmitted")) == 1  # submitted once, not twice


def test_slurmctld_restarted_mid_job(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(tmp_path, *TWO_NODES, "--max-restarts", "1", train=("--step-time", "0.3"))
    slurm_jobs.append(job)
    wait_for_event(run, "checkpoint_published", step=5)
    # Only the default instance's slurmctld: other instances may be in use beside it.
    pid = Testbed().daemon_pids()["slurmctld"]
    assert pid, "the default instance's slurmctld is not running"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, "slurmctld did not stop"
        time.sleep(0.2)
    time.sleep(3)
    subprocess.run(["slurmctld"], check=True)
    deadline = time.monotonic() + 60
    while subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, "slurmctld did not come back"
        time.sleep(0.5)
    finished_ok(tmp_path, job, run)
    assert not named(events(run), "restarting")
