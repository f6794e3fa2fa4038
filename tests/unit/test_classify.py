"""Why Slurm stopped a job, from its record (lifecycle/classify.py): pure, over JobInfo values
shaped like what ``scontrol show job`` showed on the Slurm 22.05 testbed at the trap's moment."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpcelastic.jobs import slurm
from hpcelastic.lifecycle.classify import (
    Stop,
    classify_stop,
    requeued_at_end,
    requeued_by_slurm,
    slurm_ending,
)
from hpcelastic.lifecycle.history import History
from hpcelastic.lifecycle.policy import Action, AttemptEnd, RequeueMode, Settings, decide
from hpcelastic.reasons import Reason

NOW = 10_000.0


def info(
    state: str = "RUNNING",
    *,
    start: float = NOW - 500,
    end: float | None = NOW + 3000,
    limit: int | None = 3500,
    preempt: float | None = None,
    reason: str = "None",
) -> slurm.JobInfo:
    return slurm.JobInfo(state, 0, end, preempt, "/tmp", start, limit, reason)


@pytest.mark.parametrize(
    ("record", "lead", "expected"),
    [
        # plain scancel: COMPLETING, EndTime = the cancel time, far from the limit
        (info("COMPLETING", end=NOW), 180, Stop.CANCELLED),
        (info("CANCELLED", end=NOW), None, Stop.CANCELLED),
        # the time limit's --signal: RUNNING, EndTime within the lead (+60 s early)
        (info(end=NOW + 170, limit=670), 180, Stop.TIME_LIMIT),
        (info(end=NOW + 230, limit=730), 180, Stop.TIME_LIMIT),
        # a lead over 300 s is still the time limit (no fixed window)
        (info(end=NOW + 890), 900, Stop.TIME_LIMIT),
        (info(end=NOW + 890), None, Stop.PREEMPTED),
        # far from EndTime and no PreemptTime: a stop that requeues
        (info(end=NOW + 7200), 180, Stop.PREEMPTED),
        # the limit itself (TERM): EndTime - StartTime = TimeLimit
        (info("COMPLETING", start=NOW - 3500, end=NOW), 180, Stop.TIME_LIMIT),
        (info("TIMEOUT", end=NOW), 180, Stop.TIME_LIMIT),
        # preemption, whatever EndTime says
        (info(end=NOW + 30, preempt=NOW - 1), 180, Stop.PREEMPTED),
        (info("COMPLETING", end=NOW, preempt=NOW - 1), 180, Stop.PREEMPTED),
        # a node's death
        (info("NODE_FAIL", end=NOW), 180, Stop.NODE_FAILURE),
        (info("COMPLETING", end=NOW, reason="NodeDown"), 180, Stop.NODE_FAILURE),
        (None, 180, Stop.PREEMPTED),
    ],
)
def test_classify_stop(record: slurm.JobInfo | None, lead: float | None, expected: Stop) -> None:
    assert classify_stop(record, NOW, signal_lead_s=lead) is expected


def test_a_running_job_is_not_being_ended() -> None:
    assert slurm_ending(info()) is None
    assert slurm_ending(info("PENDING")) is None
    assert slurm_ending(info("COMPLETING", end=NOW)) is Stop.CANCELLED


def test_stop_reasons() -> None:
    assert Stop.CANCELLED.reason is None
    assert Stop.TIME_LIMIT.reason is Reason.TIME_LIMIT and Stop.PREEMPTED.reason is Reason.PREEMPTED
    assert Stop.NODE_FAILURE.reason is Reason.NODE_UNHEALTHY


def test_job_info_from_a_record() -> None:
    line = (
        "JobId=7 JobName=x JobState=COMPLETING Reason=NodeDown Restarts=2 TimeLimit=1-00:00:00 "
        "StartTime=2026-01-02T03:04:05 EndTime=2026-01-02T03:14:05 PreemptTime=None WorkDir=/w"
    )
    rec = slurm.job_info_from(slurm.parse_scontrol_record(line))
    assert (rec.state, rec.restarts, rec.time_limit_s, rec.reason) == ("COMPLETING", 2, 86400, "NodeDown")
    assert rec.end_time is not None and rec.start_time is not None and rec.end_time - rec.start_time == 600
    assert rec.preempt_time is None
    assert slurm.parse_limit("UNLIMITED") is None and slurm.parse_limit("10:00") == 600


# Measured on the testbed with PreemptMode=REQUEUE (tests/slurm/test_slurm_preemption.py): Slurm has
# requeued the job already when the trap runs. COMPLETING, Restarts=1 (the attempt ran with 0), no
# PreemptTime, Reason=None, and the requeued job's new StartTime/EndTime, TimeLimit apart.
PREEMPTED_REQUEUED = slurm.JobInfo("COMPLETING", 1, NOW + 600, None, "/tmp", NOW, 600, "None")


@pytest.mark.parametrize("limit", [600, None])  # with or without a time limit
@pytest.mark.parametrize("state", ["COMPLETING", "PENDING"])
def test_preemption_that_slurm_requeued_is_a_preemption(limit: int | None, state: str) -> None:
    rec = slurm.JobInfo(state, 1, NOW + 600, None, "/tmp", NOW, limit, "None")
    assert classify_stop(rec, NOW, signal_lead_s=60, restart_count=0) is Stop.PREEMPTED
    assert slurm_ending(rec, 0) is Stop.PREEMPTED
    assert requeued_by_slurm(rec, 0) and not requeued_by_slurm(rec, 1) and not requeued_by_slurm(rec, None)


def test_without_the_attempts_restart_count_the_same_record_was_misread() -> None:
    """What the product did before: a time limit (EndTime - StartTime = TimeLimit), or with no limit a
    user's cancel (the run would never have come back)."""
    assert classify_stop(PREEMPTED_REQUEUED, NOW, signal_lead_s=60) is Stop.TIME_LIMIT
    no_limit = slurm.JobInfo("COMPLETING", 1, NOW + 600, None, "/tmp", NOW, None, "None")
    assert slurm_ending(no_limit) is Stop.CANCELLED


def test_a_cancel_or_a_node_failure_is_not_taken_for_slurms_requeue() -> None:
    cancel = slurm.JobInfo("COMPLETING", 0, NOW, None, "/tmp", NOW - 500, 3500, "None")
    assert slurm_ending(cancel, 0) is Stop.CANCELLED
    node = slurm.JobInfo("NODE_FAIL", 1, NOW, None, "/tmp", NOW - 500, 3500, "NodeDown")
    assert slurm_ending(node, 0) is Stop.NODE_FAILURE


@pytest.mark.parametrize("mode", [RequeueMode.REQUEUE, RequeueMode.RESUBMIT])
def test_policy_brings_back_what_slurm_requeued_without_a_second_requeue(mode: RequeueMode) -> None:
    end = AttemptEnd(0, Reason.PREEMPTED, Reason.PREEMPTED.exit_code, "7", slurm_requeued=True)
    decision = decide(History(0), end, Settings(mode, 0))  # a preemption needs no failure budget
    assert decision.action is Action.BRING_BACK and decision.slurm_requeued
    cancelled = decide(History(0, cancelled=True), end, Settings(mode, 0))
    assert cancelled.action is Action.SKIP and cancelled.slurm_requeued  # the executor scancels it


def test_slurm_requeues_a_job_ending_within_a_preemption_grace_from_24_11() -> None:
    """Measured on the testbed: 24.11 requeues, itself, a job that ends within its preemption's grace
    (and runs it again after its next end if hpcelastic requeued it too); 22.05 fails it (FAILED)."""
    graced = slurm.JobInfo("RUNNING", 0, 2e9, 1.9e9, None, requeue=True, partition="debug")
    assert requeued_at_end(graced, (24, 11), "REQUEUE")
    assert requeued_at_end(graced, (25, 11), "GANG,REQUEUE")
    assert not requeued_at_end(graced, (22, 5), "REQUEUE")
    assert not requeued_at_end(graced, None, "REQUEUE")
    assert not requeued_at_end(graced, (24, 11), "CANCEL")
    assert not requeued_at_end(replace(graced, requeue=False), (24, 11), "REQUEUE")
    assert not requeued_at_end(replace(graced, preempt_time=None), (24, 11), "REQUEUE")
