"""Requeue, resubmit, status and cancel against the real Slurm testbed (scripts/testbed.sh up).

Every job is a plain ``sbatch --requeue`` script that sleeps; nothing here stands in for
scontrol, sbatch or squeue. Everything submitted is scancelled at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hpcelastic import events, handoff
from hpcelastic.jobs import slurm
from hpcelastic.lifecycle.executor import Executor, Outcome
from hpcelastic.lifecycle.history import requeue_counts
from hpcelastic.lifecycle.policy import AttemptEnd, Settings
from hpcelastic.reasons import Reason, RequeueCounter
from hpcelastic.record.runindex import lookup, record_job
from hpcelastic.rundir import RunDir

pytestmark = pytest.mark.slurm

SCRIPT = """#!/bin/bash
#SBATCH --partition=debug
#SBATCH --nodes=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={run}/slurm-%j.out
#SBATCH --job-name=hpce-requeue-test
sleep 600
"""


@pytest.fixture
def submitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[RunDir, str]]]:
    """Submit a sleeping job into a fresh run dir; every job id of every run is scancelled afterwards."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    runs: list[RunDir] = []

    def submit(name: str = "run", *extra: str) -> tuple[RunDir, str]:
        rd = RunDir.create(tmp_path / name)
        rd.script_path.write_text(SCRIPT.format(run=rd.path))
        job_id = slurm.sbatch(rd.script_path, list(extra), cwd=rd.path)
        _submitted_event(rd, job_id)
        record_job(job_id, rd.path)
        runs.append(rd)
        return rd, job_id

    yield submit
    for rd in runs:
        for jid in rd.job_ids():
            subprocess.run(["scancel", jid], capture_output=True, check=False)


def conclude(
    rd: RunDir,
    attempt: int,
    reason: str,
    exit_code: int,
    bad_nodes: list[str],
    job_id: str,
    *,
    mode: str = "requeue",
    max_requeues: int = 2,
) -> Outcome:
    """End ``attempt`` through the lifecycle executor, quietly."""
    end = AttemptEnd(attempt, Reason(reason), exit_code, job_id, tuple(bad_nodes))
    return Executor(say=lambda m: None).conclude(rd, end, Settings.parse(mode, max_requeues))


def _submitted_event(rd: RunDir, job_id: str) -> None:
    rd.record(events.submitted(job_id=job_id, backend="sbatch", nodes="1", script=str(rd.script_path)))


def wait_for(job_id: str, ok: Callable[[dict[str, str]], bool], timeout: float = 60.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    info = slurm.show_job(job_id)
    while not ok(info):
        assert time.monotonic() < deadline, (
            f"job {job_id} never reached the expected state: {info.get('JobState')}"
        )
        time.sleep(0.5)
        info = slurm.show_job(job_id)
    return info


def running(info: dict[str, str]) -> bool:
    return info.get("JobState") == "RUNNING"


def start_attempt(rd: RunDir, job_id: str) -> tuple[int, str]:
    info = wait_for(job_id, running)
    return handoff.begin_attempt(rd, job_id, int(info["Restarts"]), [info["NodeList"]]), info["NodeList"]


def test_requeue_excludes_the_bad_node_and_decides_once(submitted) -> None:  # type: ignore[no-untyped-def]
    rd, job_id = submitted()
    attempt, node = start_attempt(rd, job_id)
    out = conclude(rd, attempt, "node_unhealthy", 7, [node], job_id)
    again = conclude(rd, attempt, "restarts_exhausted", 3, [], job_id)

    assert (out.action, out.job_id, out.next_attempt) == ("requeued", job_id, attempt + 1)
    assert again.action == "already_decided" and again.reason == "node_unhealthy"
    info = wait_for(job_id, lambda i: i["JobState"] in ("PENDING", "REQUEUED"), timeout=30)  # once killed
    assert info["Restarts"] == "1"  # requeued exactly once
    assert node in info["ExcNodeList"]
    requeued = [e for e in rd.events() if e["event"] == "requeued"]
    assert len(requeued) == 1 and requeued[0]["exclude"] == [node] and requeued[0]["note"] is None
    assert requeue_counts(rd.events())[RequeueCounter.NODE_UNHEALTHY] == 1

    back = wait_for(job_id, running, timeout=90)  # after BeginTime the job starts again, elsewhere
    assert back["NodeList"] != node
    assert start_attempt(rd, job_id)[0] == attempt + 1


def test_resubmit_mode_chains_a_new_job_then_status_and_cancel(submitted) -> None:  # type: ignore[no-untyped-def]
    rd, job_id = submitted()
    attempt, _ = start_attempt(rd, job_id)

    out = conclude(rd, attempt, "restarts_exhausted", 3, ["node3"], job_id, mode="resubmit")

    assert out.action == "resubmitted" and out.job_id and out.job_id != job_id
    new = slurm.show_job(out.job_id)
    assert new["JobState"] == "PENDING"
    assert new["Dependency"].startswith(f"afterany:{job_id}")
    assert new["ExcNodeList"] == "node3"
    assert slurm.show_job(job_id)["Restarts"] == "0"  # the old job was not requeued as well
    assert rd.latest_job_id() == out.job_id and lookup(out.job_id) == rd.path
    assert [e["event"] for e in rd.events()].count("resubmitted") == 1

    env = {**os.environ}
    status = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", out.job_id, "--json"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["latest_job_id"] == out.job_id and data["slurm_error"] is None
    assert data["slurm"][out.job_id]["state"] == "PENDING" and data["slurm"][job_id]["state"] == "RUNNING"
    assert "resubmitted as attempt 1" in [r["what"] for r in data["timeline"]]

    cancel = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "cancel", str(rd.path)], env=env, capture_output=True
    )
    assert cancel.returncode == 0, cancel.stderr
    for jid in (out.job_id, job_id):  # the new job, and the old one still winding down
        wait_for(jid, lambda i: i["JobState"] == "CANCELLED", timeout=30)
    cancelled = {e["job_id"] for e in rd.events() if e["event"] == "cancelled"}
    assert cancelled == {job_id, out.job_id}


def test_unrequeueable_job_falls_back_to_resubmit(submitted) -> None:  # type: ignore[no-untyped-def]
    rd, job_id = submitted("norequeue", "--no-requeue")
    attempt, _ = start_attempt(rd, job_id)

    out = conclude(rd, attempt, "preempted", 5, [], job_id)

    assert out.action == "resubmitted" and out.exit_code == 5
    failed = [e for e in rd.events() if e["event"] == "requeue_failed"]
    assert len(failed) == 1 and failed[0]["fallback"] == "resubmit"
    assert slurm.show_job(out.job_id)["Dependency"].startswith(f"afterany:{job_id}")
    assert requeue_counts(rd.events()) == {
        RequeueCounter.FAILURE: 0,
        RequeueCounter.PREEMPTED: 1,
        RequeueCounter.TIME_LIMIT: 0,
        RequeueCounter.NODE_UNHEALTHY: 0,
    }


def test_array_task_is_requeued_alone(submitted) -> None:  # type: ignore[no-untyped-def]
    rd, array_id = submitted("array", "--array=0-1")
    task = f"{array_id}_1"
    attempt, _ = start_attempt(rd, task)

    out = conclude(rd, attempt, "time_limit", 5, [], task)

    assert out.action == "requeued"
    assert slurm.show_job(task)["Restarts"] == "1"
    assert slurm.show_job(f"{array_id}_0")["Restarts"] == "0"


def test_status_and_cancel_of_a_running_job(submitted) -> None:  # type: ignore[no-untyped-def]
    rd, job_id = submitted()
    start_attempt(rd, job_id)
    out = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", str(rd.path)], capture_output=True, text=True
    )
    assert out.returncode == 0 and f"job         {job_id}" in out.stdout and "RUNNING" in out.stdout
    assert (
        subprocess.run([sys.executable, "-m", "hpcelastic", "cancel", job_id], capture_output=True).returncode
        == 0
    )
    wait_for(job_id, lambda i: i["JobState"] == "CANCELLED", timeout=30)
    # a decision racing with the cancel must not bring the job back
    outcome = conclude(rd, 0, "preempted", 5, [], job_id, max_requeues=3)
    assert outcome.action == "skipped" and slurm.show_job(job_id)["JobState"] == "CANCELLED"


IN_JOB = """#!/bin/bash
#SBATCH --partition=debug
#SBATCH --nodes=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={run}/slurm-%j.out
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
  {python} -c '
import os
from hpcelastic import handoff
from hpcelastic.env.slurm import job_id
from hpcelastic.lifecycle.attempt_end import end_attempt
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir
job = job_id(os.environ)
attempt = handoff.begin_attempt("{run}", job, 0)
end_attempt(RunDir("{run}"), attempt, Reason.TIME_LIMIT, job_id=job, requeue_mode="requeue", max_requeues=2)
'
fi
sleep 600
"""


def test_decision_taken_inside_the_job_survives_its_own_requeue(submitted, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The job requeues itself (Slurm then signals it): the decision is still recorded whole."""
    rd, job_id = submitted("injob")
    subprocess.run(["scancel", job_id], check=True)
    rd.script_path.write_text(IN_JOB.format(run=rd.path, python=sys.executable))
    job_id = slurm.sbatch(rd.script_path, [], cwd=rd.path)
    _submitted_event(rd, job_id)

    info = wait_for(job_id, lambda i: i["Restarts"] == "1" and i["JobState"] == "RUNNING", timeout=90)

    kinds = [e["event"] for e in rd.events()]
    assert kinds.count("requeued") == 1 and kinds.count("attempt_ended") == 1
    requeued = next(e for e in rd.events() if e["event"] == "requeued")
    assert requeued["attempt"] == 1 and requeued["reason"] == "time_limit" and requeued["duration_s"] >= 0
    assert requeue_counts(rd.events())[RequeueCounter.TIME_LIMIT] == 1
    assert handoff.begin_attempt(rd, job_id, int(info["Restarts"])) == 1


FINALIZE = """#!/bin/bash
#SBATCH --partition=debug
#SBATCH --nodes=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={run}/slurm-%j.out
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
  srun --ntasks=1 bash -c 'exit 6'
  {python} -m hpcelastic finalize --run-dir {run} --exit-code $? --max-requeues 1
  echo "finalize exited $?"
fi
sleep 600
"""


def test_finalize_requeues_when_no_agent_decided(submitted) -> None:  # type: ignore[no-untyped-def]
    """The step dies before any agent began the attempt (as when srun cannot create it): finalize in the
    batch script names it ``step_failed``, not a lost coordinator, and requeues within the failure budget."""
    rd, job_id = submitted("finalize")
    subprocess.run(["scancel", job_id], check=True)
    rd.script_path.write_text(FINALIZE.format(run=rd.path, python=sys.executable))
    job_id = slurm.sbatch(rd.script_path, [], cwd=rd.path)
    _submitted_event(rd, job_id)

    wait_for(job_id, lambda i: i["Restarts"] == "1" and i["JobState"] == "RUNNING", timeout=90)

    log = rd.events()
    started = [e for e in log if e["event"] == "attempt_started"]
    assert [(e["attempt"], e["job_id"]) for e in started] == [(0, job_id)]
    ended = [e for e in log if e["event"] == "attempt_ended"]
    assert len(ended) == 1 and ended[0]["reason"] == "step_failed" and ended[0]["exit_code"] == 9
    assert [e["event"] for e in log].count("requeued") == 1
    assert requeue_counts(rd.events())[RequeueCounter.FAILURE] == 1
