"""Cancel a run: mark it cancelled (no later decision brings it back), then scancel its active jobs."""

from __future__ import annotations

from dataclasses import dataclass

from hpcelastic import events
from hpcelastic.errors import UserError
from hpcelastic.jobs import slurm
from hpcelastic.rundir import RunDir

CANCEL_CLAIM = "cancelled"


def mark_cancelled(run_dir: RunDir) -> None:
    """Record that the user cancelled the run, so that no decision requeues it afterwards."""
    run_dir.claim_once(CANCEL_CLAIM)


def is_cancelled(run_dir: RunDir) -> bool:
    """True once the run was cancelled (``hpcelastic cancel``)."""
    return (run_dir.path / "claims" / CANCEL_CLAIM).exists()


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
        slurm.cancel(job_id)
        rd.record(events.cancelled(job_id=job_id))
        cancelled.append(job_id)
        newest = rd.latest_job_id()
        if not active and newest and newest not in cancelled:
            active.append(newest)
    state = states[latest].state if latest in states else None
    return CancelResult(cancelled, latest, state)
