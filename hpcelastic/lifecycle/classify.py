"""Was a stop signal a preemption or the time limit? Decided from Slurm's record of the job."""

from __future__ import annotations

import time

from hpcelastic.errors import SlurmError
from hpcelastic.jobs import slurm
from hpcelastic.reasons import Reason

TIME_LIMIT_WINDOW_S = 300.0


def classify_stop(info: slurm.JobInfo | None, now: float, window_s: float = TIME_LIMIT_WINDOW_S) -> Reason:
    """TIME_LIMIT when the job is within ``window_s`` of its EndTime, else PREEMPTED.

    A job with a PreemptTime is preempted whatever its EndTime (Slurm moves EndTime to the end of
    the grace time on preemption). Without a record (Slurm could not be asked): PREEMPTED; both
    requeue, they only count against different counters.
    """
    if info is None or info.preempt_time is not None:
        return Reason.PREEMPTED
    if info.end_time is not None and info.end_time - now <= window_s:
        return Reason.TIME_LIMIT
    return Reason.PREEMPTED


def classify_stop_signal(job_id: str, *, now: float | None = None) -> Reason:
    """:func:`classify_stop` over one ``scontrol show job`` of ``job_id``."""
    try:
        info: slurm.JobInfo | None = slurm.job_info(job_id)
    except SlurmError:
        info = None
    return classify_stop(info, time.time() if now is None else now)
