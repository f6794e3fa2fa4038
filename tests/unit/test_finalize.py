"""``hpcelastic finalize`` after srun, when no agent decided (issue 18, items 8 and 11).

An exit code of 2 is a start-up failure only when the agents recorded a usage error; a step that
no agent began (srun's own error, agents that never met) is ``step_failed``, never a lost
coordinator. No Slurm command is reachable here (PATH holds none): the decision is recorded in
``attempt_ended`` before Slurm would be asked to requeue.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcelastic import events, handoff
from hpcelastic.env.slurm import coordinator_file
from hpcelastic.lifecycle.finalize import finalize, step_end_reason
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir

JOB = "4711"
ENVIRON = {"SLURM_JOB_ID": JOB, "SLURM_RESTART_COUNT": "0"}


@pytest.fixture(autouse=True)
def no_real_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Job 4711 may be a real job of a testbed running beside these tests: never ask or requeue it."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture
def rd(tmp_path: Path) -> RunDir:
    r = RunDir.create(tmp_path / "run")
    r.record(events.submitted(job_id=JOB, backend="sbatch", nodes="2", script=str(r.script_path)))
    return r


def ended_reason(rd: RunDir, srun_exit_code: int, *, stopped: bool = False) -> str:
    """Run finalize for the attempt of job 4711 and return the reason it recorded."""
    said: list[str] = []
    finalize(rd, srun_exit_code, stopped=stopped, environ=ENVIRON, say=said.append)
    (ended,) = rd.events().of(events.ATTEMPT_ENDED)
    assert said and ended["reason"] in said[0], said
    return str(ended["reason"])


def test_exit_2_of_agents_that_never_met_is_a_step_failure_not_bad_arguments(rd: RunDir) -> None:
    """The agents exited 2 before any began the attempt (a timeout waiting for coordinator-*.json,
    EIO reading it): no usage error was recorded, so it is no start-up failure (exit 8, never
    requeued) but a failed step, which is requeued."""
    assert ended_reason(rd, 2) == "step_failed"


def test_exit_2_after_the_agents_began_is_not_a_startup_failure(rd: RunDir) -> None:
    handoff.begin_attempt(rd, JOB, 0, ["node1", "node2"])
    assert ended_reason(rd, 2) == "coordinator_lost"


def test_a_usage_error_the_coordinator_published_is_a_startup_failure(rd: RunDir) -> None:
    """The coordinator could not use the port or interface it was given and published that error
    for the other agents: every attempt would meet it again."""
    path = coordinator_file(rd, JOB, 0)
    path.write_text(json.dumps({"error": "cannot listen on *:29500: another program holds the port"}))
    assert ended_reason(rd, 2) == "startup_failure"


def test_srun_that_could_not_create_the_step_is_not_a_lost_coordinator(rd: RunDir) -> None:
    """``srun: error: Unable to create step ... Invalid generic resource (gres) specification``: srun
    exits 1 before any agent runs."""
    assert ended_reason(rd, 1) == "step_failed"


def test_a_lost_coordinator_after_the_agents_began_stays_one(rd: RunDir) -> None:
    handoff.begin_attempt(rd, JOB, 0, ["node1", "node2"])
    assert ended_reason(rd, 1) == "coordinator_lost"


@pytest.mark.parametrize(
    ("code", "stopped", "job_id", "began", "usage_error", "reason"),
    [
        (0, False, "1", False, False, Reason.SUCCEEDED),
        (2, False, "1", True, True, Reason.STARTUP_FAILURE),
        (2, False, "1", True, False, Reason.COORDINATOR_LOST),
        (2, False, "1", False, False, Reason.STEP_FAILED),
        (1, False, "1", False, True, Reason.STEP_FAILED),  # a usage error is exit 2 only
        (143, True, "1", False, False, Reason.PREEMPTED),
        (143, True, None, True, False, Reason.COORDINATOR_LOST),
        (1, False, "1", True, False, Reason.COORDINATOR_LOST),
    ],
)
def test_step_end_reason(
    code: int, stopped: bool, job_id: str | None, began: bool, usage_error: bool, reason: Reason
) -> None:
    got = step_end_reason(code, stopped=stopped, job_id=job_id, began=began, usage_error=usage_error)
    assert got is reason
