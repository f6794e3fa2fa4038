"""Why Slurm stopped a job, from its record (lifecycle/classify.py): pure, over JobInfo values
shaped like what ``scontrol show job`` showed on the Slurm 22.05 testbed at the trap's moment."""

from __future__ import annotations

import pytest

from hpcelastic.jobs import slurm
from hpcelastic.lifecycle.classify import Stop, classify_stop, slurm_ending
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
