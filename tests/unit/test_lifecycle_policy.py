"""The run lifecycle's pure parts: the requeue decision, the stop classification, finalize's reading of
srun's exit, and the cancel algorithm (with Slurm stood in by functions)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from hpcelastic import events
from hpcelastic.events import EventLog
from hpcelastic.jobs import slurm
from hpcelastic.lifecycle.cancel import cancel_run, is_cancelled
from hpcelastic.lifecycle.finalize import recorded_exit
from hpcelastic.lifecycle.history import History, PreviousEnd, excluded_nodes, requeue_counts
from hpcelastic.lifecycle.policy import Action, AttemptEnd, Settings, decide
from hpcelastic.lifecycle.progress import AttemptProgress
from hpcelastic.reasons import JobEnd, Reason, RequeueCounter, SkipReason
from hpcelastic.rundir import RunDir

R = Reason
C = RequeueCounter
FAIL = {C.FAILURE: 1}
SIG = "abc"


def _end(
    reason: Reason, *, attempt: int = 1, job: str | None = "7", sig: str | None = None, **kw
) -> AttemptEnd:
    return AttemptEnd(attempt, reason, kw.pop("exit_code", reason.exit_code), job, signature=sig, **kw)


# (history, end, settings) -> (action, skip reason, job_failed reason, exit code)
CASES = [
    ("success", History(1), _end(R.SUCCEEDED), Settings(), (Action.SUCCEED, None, None, 0)),
    (
        "cancelled wins over requeue",
        History(1, cancelled=True),
        _end(R.PREEMPTED),
        Settings(),
        (Action.SKIP, SkipReason.CANCELLED, JobEnd.CANCELLED, 5),
    ),
    (
        "startup failure",
        History(1),
        _end(R.STARTUP_FAILURE),
        Settings(),
        (Action.SKIP, SkipReason.STARTUP_FAILURE, R.STARTUP_FAILURE, 8),
    ),
    (
        "same root cause twice, no progress",
        History(1, previous=PreviousEnd(SIG, False)),
        _end(R.RESTARTS_EXHAUSTED, sig=SIG),
        Settings(),
        (Action.SKIP, SkipReason.STARTUP_FAILURE, R.STARTUP_FAILURE, 8),
    ),
    (
        "same root cause, previous attempt progressed",
        History(1, previous=PreviousEnd(SIG, True)),
        _end(R.RESTARTS_EXHAUSTED, sig=SIG),
        Settings(),
        (Action.BRING_BACK, None, None, 3),
    ),
    (
        "same root cause, this attempt published a checkpoint",
        History(1, previous=PreviousEnd(SIG, False), attempts={1: AttemptProgress(published=True)}),
        _end(R.RESTARTS_EXHAUSTED, sig=SIG),
        Settings(),
        (Action.BRING_BACK, None, None, 3),
    ),
    (
        "no job id",
        History(1),
        _end(R.COORDINATOR_LOST, job=None),
        Settings(),
        (Action.SKIP, SkipReason.NO_SLURM_JOB, R.COORDINATOR_LOST, 6),
    ),
    (
        "three stops without a checkpoint",
        History(2, ended={0: R.TIME_LIMIT, 1: R.PREEMPTED}),
        _end(R.TIME_LIMIT, attempt=2),
        Settings(),
        (Action.SKIP, SkipReason.NO_PROGRESS, R.TIME_LIMIT, 5),
    ),
    (
        "three stops, one with a checkpoint",
        History(2, ended={0: R.TIME_LIMIT, 1: R.PREEMPTED}, attempts={0: AttemptProgress(published=True)}),
        _end(R.TIME_LIMIT, attempt=2),
        Settings(),
        (Action.BRING_BACK, None, None, 5),
    ),
    (
        "failure budget spent",
        History(1, requeues={C.FAILURE: 1, C.NODE_UNHEALTHY: 1}),
        _end(R.NODE_UNHEALTHY),
        Settings(max_requeues=2),
        (Action.SKIP, SkipReason.LIMIT_REACHED, R.NODE_UNHEALTHY, 7),
    ),
    (
        "stops do not spend the budget",
        History(1, requeues={C.PREEMPTED: 9}),
        _end(R.PREEMPTED),
        Settings(max_requeues=0),
        (Action.BRING_BACK, None, None, 5),
    ),
    (
        "a stop is not limited by a spent budget",
        History(1, requeues=FAIL),
        _end(R.TIME_LIMIT),
        Settings(max_requeues=1),
        (Action.BRING_BACK, None, None, 5),
    ),
    (
        "failure within budget keeps its exit code",
        History(1, requeues=FAIL),
        _end(R.RESTARTS_EXHAUSTED),
        Settings(max_requeues=2),
        (Action.BRING_BACK, None, None, 3),
    ),
]


@pytest.mark.parametrize(
    ("history", "end", "settings", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_decide(history: History, end: AttemptEnd, settings: Settings, expected: tuple) -> None:
    d = decide(history, end, settings)
    assert (d.action, d.skip, d.job_end, d.exit_code) == expected
    if d.action is Action.SKIP:
        assert d.message


def test_bring_back_excludes_old_and_new_bad_nodes_once() -> None:
    d = decide(History(1, bad_nodes=("n3", "n1")), _end(R.NODE_UNHEALTHY, bad_nodes=("n2", "n1")), Settings())
    assert d.action is Action.BRING_BACK and d.job_id == "7" and d.exclude == ("n3", "n1", "n2")


def test_progress_is_reported_by_workers_or_a_published_checkpoint() -> None:
    assert decide(History(1), _end(R.SUCCEEDED, progressed=True), Settings()).progressed
    published = History(1, attempts={1: AttemptProgress(published=True)})
    assert decide(published, _end(R.SUCCEEDED), Settings()).progressed
    assert not decide(History(1), _end(R.SUCCEEDED), Settings()).progressed


def test_history_from_the_event_log() -> None:
    log = EventLog(
        [
            {
                "event": "attempt_ended",
                "attempt": 0,
                "reason": "node_unhealthy",
                "signature": "s",
                "progressed": False,
            },
            {"event": "requeued", "attempt": 1, "reason": "node_unhealthy", "exclude": ["n2"]},
            {"event": "checkpoint_published", "attempt": 1, "path": "/c"},
            {"event": "resubmitted", "attempt": 2, "reason": "preempted", "exclude": ["n2", "n4"]},
        ]
    )
    h = History.from_log(log, 1, cancelled=False)
    assert h.previous == PreviousEnd("s", False) and h.attempts[1].published
    assert h.ended == {0: R.NODE_UNHEALTHY} and not h.attempts[0].published and h.budget_used == 1
    assert requeue_counts(log) == {C.FAILURE: 0, C.PREEMPTED: 1, C.TIME_LIMIT: 0, C.NODE_UNHEALTHY: 1}
    assert excluded_nodes(log) == ("n2", "n4")
    assert History.from_log(log, 0, cancelled=True).previous is None


def test_slurm_time_parsing() -> None:
    assert slurm.parse_time("Unknown") is None and slurm.parse_time("(null)") is None
    assert slurm.parse_time("nonsense") is None
    assert isinstance(slurm.parse_time("2026-01-02T03:04:05"), float)


def test_recorded_exit() -> None:
    ended = {"event": "attempt_ended", "attempt": 0, "exit_code": 3}
    failed = {"event": "job_failed", "attempt": 0, "exit_code": 8}
    assert recorded_exit(EventLog([ended]), 0) == 3
    assert recorded_exit(EventLog([ended, failed]), 0) == 8
    assert recorded_exit(EventLog([ended]), 1) is None


def test_cancel_run_cancels_active_jobs_and_a_racing_resubmission(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rd = RunDir.create(tmp_path / "run")
    for jid in ("10", "11"):
        rd.record(events.submitted(job_id=jid, backend="sbatch", nodes="1", script="s"))
    cancelled: list[str] = []

    def states(ids: Sequence[str]) -> dict[str, slurm.JobState]:
        return {
            "10": slurm.JobState("10", "COMPLETED", "None", ""),
            "11": slurm.JobState("11", "RUNNING", "", ""),
        }

    def cancel(job_id: str) -> None:
        cancelled.append(job_id)
        if job_id == "11":  # the agent resubmitted just before the cancel landed
            rd.record(events.submitted(job_id="12", backend="sbatch", nodes="1", script="s"))

    monkeypatch.setattr(slurm, "query_states", states)
    monkeypatch.setattr(slurm, "cancel", cancel)
    result = cancel_run(rd)
    assert result.cancelled == cancelled == ["11", "12"] and is_cancelled(rd)
    assert [e["job_id"] for e in rd.events().of(events.CANCELLED)] == ["11", "12"]


def test_cancel_run_of_an_ended_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rd = RunDir.create(tmp_path / "run")
    rd.record(events.submitted(job_id="10", backend="sbatch", nodes="1", script="s"))
    monkeypatch.setattr(slurm, "query_states", lambda ids: {"10": slurm.JobState("10", "PREEMPTED", "", "")})
    monkeypatch.setattr(slurm, "cancel", lambda job_id: pytest.fail("nothing to cancel"))
    result = cancel_run(rd)
    assert (result.cancelled, result.latest_job_id, result.latest_state) == ([], "10", "PREEMPTED")
    assert is_cancelled(rd)
