"""``hpcelastic cancel`` racing the executor's bring-back, and an attempt that starts after a cancel.

A small in-process model of slurmctld (job states; requeue brings even a cancelled job back, as
``scontrol requeue`` does for a finished batch job) stands in for the Slurm commands, and
:func:`~hpcelastic.lifecycle.cancel.cancel_run` runs at chosen points inside the executor's
``scontrol requeue`` and ``sbatch``. Whatever the interleaving, no job of the run may stay queued.
What real Slurm does is tested in tests/slurm/test_cancel_race_slurm.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from hpcelastic import events, handoff
from hpcelastic.agent.bootstrap import cancelled_before_start
from hpcelastic.agent.spec import AgentSpec
from hpcelastic.env.base import BootstrapOptions, NodeContext
from hpcelastic.jobs import slurm
from hpcelastic.lifecycle.cancel import cancel_run, mark_cancelled
from hpcelastic.lifecycle.executor import Executor
from hpcelastic.lifecycle.policy import AttemptEnd, Settings
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir

NEW_JOB = "4242"


class Slurmctld:
    """Job states, and a hook that runs the user's cancel at one point of the executor's call."""

    def __init__(self, rd: RunDir, cancel_at: str) -> None:
        self.rd, self.cancel_at = rd, cancel_at
        self.states = {"123": "RUNNING"}

    def _maybe_cancel(self, point: str) -> None:
        if point == self.cancel_at:
            cancel_run(self.rd)

    def job_info(self, job_id: str) -> slurm.JobInfo:
        return slurm.JobInfo(self.states[job_id], 0, None, None, None)

    def requeue(self, job_id: str) -> None:
        self._maybe_cancel("before requeue")
        self.states[job_id] = "PENDING"
        self._maybe_cancel("after requeue")

    def sbatch(self, *_args: object, **_kwargs: object) -> str:
        self._maybe_cancel("before sbatch")
        self.states[NEW_JOB] = "PENDING"
        self._maybe_cancel("after sbatch")
        return NEW_JOB

    def cancel(self, job_id: str, **_kwargs: object) -> None:
        if self.states.get(job_id) in (None, "CANCELLED", "COMPLETED"):
            raise slurm.SlurmError("scancel failed: Job/step already completing or completed")
        self.states[job_id] = "CANCELLED"

    def query_states(self, job_ids: Sequence[str]) -> dict[str, slurm.JobState]:
        return {j: slurm.JobState(j, self.states[j], "", "") for j in job_ids if j in self.states}


@pytest.fixture
def rd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunDir:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    r = RunDir.create(tmp_path / "run")
    r.script_path.write_text("#!/bin/bash\nsleep 60\n")
    r.record(events.submitted(job_id="123", backend="sbatch", nodes="1", script=str(r.script_path)))
    handoff.begin_attempt(r, "123", 0, ["node1"])
    return r


def _fake(monkeypatch: pytest.MonkeyPatch, ctld: Slurmctld) -> None:
    for name in ("job_info", "requeue", "sbatch", "cancel", "query_states"):
        monkeypatch.setattr(slurm, name, getattr(ctld, name))
    monkeypatch.setattr(slurm, "exclude_nodes", lambda *a, **k: None)
    monkeypatch.setattr(slurm, "dependent_job", lambda job_id: None)


@pytest.mark.parametrize(
    ("mode", "cancel_at"),
    [
        ("requeue", "before requeue"),
        ("requeue", "after requeue"),
        ("resubmit", "before sbatch"),
        ("resubmit", "after sbatch"),
    ],
)
def test_a_cancel_during_the_bring_back_leaves_no_job_queued(
    rd: RunDir, monkeypatch: pytest.MonkeyPatch, mode: str, cancel_at: str
) -> None:
    ctld = Slurmctld(rd, cancel_at)
    _fake(monkeypatch, ctld)
    said: list[str] = []
    end = AttemptEnd(0, Reason.PREEMPTED, 5, "123", ())
    out = Executor(retry_delays_s=(), say=said.append).conclude(rd, end, Settings.parse(mode, 2))

    assert all(state == "CANCELLED" for state in ctld.states.values()), ctld.states
    assert out.action == "skipped" and out.reason == "cancelled" and out.next_attempt is None
    last = rd.events()[-1]
    assert last["event"] == "cancelled" and last["job_id"] == out.job_id
    assert "cancelled" in said[-1]


def test_a_bring_back_without_a_cancel_is_left_alone(rd: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    ctld = Slurmctld(rd, cancel_at="never")
    _fake(monkeypatch, ctld)
    end = AttemptEnd(0, Reason.PREEMPTED, 5, "123", ())
    out = Executor(retry_delays_s=(), say=lambda m: None).conclude(rd, end, Settings.parse("resubmit", 2))
    assert out.action == "resubmitted" and ctld.states[NEW_JOB] == "PENDING"


def _start(rd: RunDir, node_rank: int, environ: dict[str, str]) -> bool:
    spec = AgentSpec(argv=("train.py",), rdzv=BootstrapOptions(run_dir=rd.path))
    ctx = NodeContext("slurm", node_rank, 2, ("node1", "node2"), "123", 1)
    return cancelled_before_start(spec, ctx, environ)


def test_an_attempt_of_a_cancelled_run_does_not_start(rd: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job a racing requeue brought back starts anyway: its agents leave, rank 0 scancels it."""
    cancelled: list[str] = []
    monkeypatch.setattr(slurm, "cancel", lambda job_id, **k: cancelled.append(job_id))
    environ = {"SLURM_JOB_ID": "123"}
    assert not _start(rd, 0, environ)
    mark_cancelled(rd)
    assert _start(rd, 1, environ) and cancelled == []
    assert _start(rd, 0, environ) and cancelled == ["123"]
    assert handoff.begin_attempt(rd, "123", 1) == 0  # finalize in the job begins no attempt either
    assert handoff.load(rd).attempt == 0 and len(rd.events().of(events.ATTEMPT_STARTED)) == 1
    assert [e["job_id"] for e in rd.events().of(events.CANCELLED)] == ["123"]
