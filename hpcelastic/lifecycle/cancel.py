"""Cancel a run: mark it cancelled (no later decision brings it back), then scancel its active jobs.

The mark comes first and every path that queues the job again looks at it after Slurm queued the job
(the executor, after ``sbatch`` or ``scontrol requeue`` returned and the event is written) and at the
start of every attempt (the agents), so a cancel racing a requeue or resubmission never lets a job
run: either the cancel sees the new job in the event log, or the executor sees the mark.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from hpcelastic import events
from hpcelastic.errors import SlurmError, UserError
from hpcelastic.jobs import slurm
from hpcelastic.rundir import RunDir

CANCEL_CLAIM = "cancelled"


def mark_cancelled(run_dir: RunDir) -> None:
    """Record that the user cancelled the run, so that no decision requeues it afterwards."""
    run_dir.claim_once(CANCEL_CLAIM)


def is_cancelled(run_dir: RunDir) -> bool:
    """True once the run was cancelled (``hpcelastic cancel``)."""
    return (run_dir.path / "claims" / CANCEL_CLAIM).exists()


def cancel_job(run_dir: RunDir, job_id: str) -> None:
    """``scancel`` one job of the run and record it; raises :class:`SlurmError` when Slurm refuses."""
    slurm.cancel(job_id)
    run_dir.record(events.cancelled(job_id=job_id))


def refuse_cancelled_start(run_dir: RunDir, job_id: str | None) -> bool:
    """At the start of an attempt: True when the run was cancelled, and its Slurm job then scancelled.

    A job that a requeue or resubmission brought back while the user cancelled ends here, before
    any worker starts.
    """
    if not is_cancelled(run_dir):
        return False
    if job_id:
        with contextlib.suppress(SlurmError):  # already ending: nothing left to cancel
            cancel_job(run_dir, job_id)
    return True


@dataclass(frozen=True)
class CancelResult:
    """The jobs scancelled (newest first), and the run's latest job with its state when none was."""

    cancelled: list[str]
    latest_job_id: str
    latest_state: str | None


def cancel_run(rd: RunDir) -> CancelResult:
    """Cancel every job of the run that is still active, whichever attempt it is on.

    A previous job still winding down is cancelled too, and so is a resubmission that races with
    the cancel (it appears in the event log while we cancel).
    """
    latest = rd.latest_job_id()
    if latest is None:
        raise UserError(f"{rd.path} has no Slurm job id (never submitted); nothing to cancel")
    mark_cancelled(rd)
    job_ids = rd.job_ids()
    states = slurm.query_states(job_ids)
    active = [j for j in job_ids if j in states and states[j].state not in slurm.ENDED_STATES]
    if latest not in states:
        active.append(latest)  # too new for squeue, or already purged: let scancel say which
    cancelled: list[str] = []
    while active:
        job_id = active.pop()
        cancel_job(rd, job_id)
        cancelled.append(job_id)
        newest = rd.latest_job_id()
        if not active and newest and newest not in cancelled:
            active.append(newest)
    state = states[latest].state if latest in states else None
    return CancelResult(cancelled, latest, state)
