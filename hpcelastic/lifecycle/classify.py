"""Why Slurm stopped a job (cancel, time limit, preemption, node failure), from Slurm's record of it.

Pure over :class:`~hpcelastic.jobs.slurm.JobInfo`; :func:`slurm_stop` is the one ``scontrol`` call.
What ``scontrol show job`` shows while the batch script's trap runs (Slurm 22.05, measured):

* ``scancel``: ``JobState=COMPLETING``, ``EndTime`` = the cancel time, well short of ``TimeLimit``;
* the time limit's ``--signal``: ``RUNNING``, ``EndTime`` = the limit, at most the signal lead (+60 s) away;
* the limit itself: ``TIMEOUT``/``COMPLETING`` with ``EndTime - StartTime`` = ``TimeLimit``;
* preemption: ``PreemptTime`` set; a node's death: ``NODE_FAIL`` (``Reason=NodeDown``);
* preemption with ``PreemptMode=REQUEUE`` (the job may requeue): Slurm requeues it at once, so the
  trap sees ``COMPLETING`` (then ``PENDING``), ``Restarts`` already one past the attempt's, no
  ``PreemptTime`` and ``EndTime - StartTime = TimeLimit`` (the requeued job's new times).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hpcelastic.errors import SlurmError
from hpcelastic.jobs import slurm
from hpcelastic.reasons import Named, Reason

#: Where the signal lead is unknown: a stop this close to EndTime is the time limit.
TIME_LIMIT_WINDOW_S = 300.0
#: Slurm may send the ``--signal`` up to 60 s before the lead (its signal timer is coarse).
SIGNAL_EARLY_S = 60.0
#: Clock and rounding slack when comparing EndTime with TimeLimit or the signal lead.
LIMIT_SLACK_S = 5.0


class Stop(Named):
    """Why Slurm ended or is ending the job."""

    CANCELLED = "cancelled"
    TIME_LIMIT = "time_limit"
    PREEMPTED = "preempted"
    NODE_FAILURE = "node_failure"

    @property
    def reason(self) -> Reason | None:
        """The attempt-end reason it stands for; None for a cancel (the run is not brought back)."""
        return {
            Stop.TIME_LIMIT: Reason.TIME_LIMIT,
            Stop.PREEMPTED: Reason.PREEMPTED,
            Stop.NODE_FAILURE: Reason.NODE_UNHEALTHY,
        }.get(self)


def limit_reached(info: slurm.JobInfo) -> bool:
    """The job ran (or runs until) its whole TimeLimit: EndTime - StartTime >= TimeLimit."""
    if info.start_time is None or info.end_time is None or info.time_limit_s is None:
        return False
    return info.end_time - info.start_time >= info.time_limit_s - LIMIT_SLACK_S


def requeued_by_slurm(info: slurm.JobInfo, restart_count: int | None) -> bool:
    """Slurm has queued the job again itself during the attempt whose Slurm restart count is
    ``restart_count`` (preemption with ``PreemptMode=REQUEUE``, an admin's ``scontrol requeue``)."""
    return restart_count is not None and info.restarts is not None and info.restarts > restart_count


def slurm_ending(info: slurm.JobInfo, restart_count: int | None = None) -> Stop | None:
    """Why Slurm is ending the job, when its record says it is; None while it runs normally.

    ``restart_count``: the attempt's ``SLURM_RESTART_COUNT``; a job Slurm requeued past it is preempted.
    """
    if info.state == "NODE_FAIL" or (info.state == "COMPLETING" and info.reason.startswith("Node")):
        return Stop.NODE_FAILURE
    if info.preempt_time is not None or info.state == "PREEMPTED" or requeued_by_slurm(info, restart_count):
        return Stop.PREEMPTED
    if info.state in ("TIMEOUT", "DEADLINE") or (info.state == "COMPLETING" and limit_reached(info)):
        return Stop.TIME_LIMIT
    if info.state in ("CANCELLED", "COMPLETING"):
        return Stop.CANCELLED
    return None


#: The first release measured to requeue, itself, a job that ends within a preemption's grace time
#: (PreemptMode=REQUEUE, ``--requeue``): 24.11 does, and requeues it again at its next end if hpcelastic
#: requeued it too; 22.05 fails such a job instead (FAILED), so hpcelastic requeues it there.
REQUEUES_WITHIN_GRACE = (24, 11)


def requeued_at_end(info: slurm.JobInfo, release: tuple[int, int] | None, preempt_mode: str) -> bool:
    """Slurm will requeue the job itself when it ends: it runs within a preemption's grace (PreemptTime
    set), may be requeued, its partition's PreemptMode is REQUEUE, and the release does so
    (:data:`REQUEUES_WITHIN_GRACE`; an unknown release is taken not to)."""
    return (
        info.state == "RUNNING"
        and info.preempt_time is not None
        and info.requeue is True
        and "REQUEUE" in preempt_mode.upper()
        and release is not None
        and release >= REQUEUES_WITHIN_GRACE
    )


def classify_stop(
    info: slurm.JobInfo | None,
    now: float,
    *,
    signal_lead_s: float | None = None,
    restart_count: int | None = None,
) -> Stop:
    """Why the job was told to stop (the trap saw the stop signal or TERM).

    Slurm's own verdict first (:func:`slurm_ending`); a running job signalled within the signal lead
    (plus :data:`SIGNAL_EARLY_S`) of its EndTime is at its time limit; anything else, and a job
    Slurm could not be asked about, is a preemption (a stop that requeues).
    """
    if info is None:
        return Stop.PREEMPTED
    ending = slurm_ending(info, restart_count)
    if ending is not None:
        return ending
    window = TIME_LIMIT_WINDOW_S if signal_lead_s is None else signal_lead_s + SIGNAL_EARLY_S + LIMIT_SLACK_S
    if info.end_time is not None and info.end_time - now <= window:
        return Stop.TIME_LIMIT
    return Stop.PREEMPTED


@dataclass(frozen=True)
class SlurmVerdict:
    """What Slurm's record says about the end of an attempt."""

    stop: Stop | None
    #: Slurm has queued the job again itself (:func:`requeued_by_slurm`), or will when it ends
    #: (:func:`requeued_at_end`): nobody may requeue or resubmit it.
    requeued: bool = False


def slurm_stop(
    job_id: str,
    *,
    signalled: bool,
    signal_lead_s: float | None = None,
    restart_count: int | None = None,
) -> SlurmVerdict:
    """One ``scontrol show job``: why Slurm stops ``job_id``, and whether it requeued the job itself.

    ``signalled``: the job got a stop signal, so it is stopping whatever Slurm says
    (:func:`classify_stop`); otherwise only Slurm's own verdict counts (None while it runs on).
    ``restart_count``: the attempt's ``SLURM_RESTART_COUNT`` (see :func:`requeued_by_slurm`).
    """
    try:
        info: slurm.JobInfo | None = slurm.job_info(job_id)
    except SlurmError:
        info = None
    if info is None:
        return SlurmVerdict(Stop.PREEMPTED if signalled else None)
    requeued = requeued_by_slurm(info, restart_count)
    if not requeued and info.preempt_time is not None and info.state == "RUNNING":
        requeued = requeued_at_end(info, slurm.release(), slurm.preempt_mode(info.partition))
    if signalled:
        stop = classify_stop(info, time.time(), signal_lead_s=signal_lead_s, restart_count=restart_count)
        return SlurmVerdict(stop, requeued)
    return SlurmVerdict(slurm_ending(info, restart_count), requeued)


def classify_stop_signal(job_id: str, *, now: float | None = None) -> Stop:
    """:func:`classify_stop` over one ``scontrol show job`` of ``job_id`` (signal lead unknown)."""
    try:
        info: slurm.JobInfo | None = slurm.job_info(job_id)
    except SlurmError:
        info = None
    return classify_stop(info, time.time() if now is None else now)
