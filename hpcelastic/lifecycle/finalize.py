"""``hpcelastic finalize``: after srun, exit with the agents' decision, or decide when no agent could."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from hpcelastic import events, handoff
from hpcelastic.env import slurm as slurm_env
from hpcelastic.errors import EXIT_OK, EXIT_USAGE
from hpcelastic.events import EventLog
from hpcelastic.lifecycle.attempt_end import end_attempt
from hpcelastic.lifecycle.executor import say as _say
from hpcelastic.lifecycle.policy import DEFAULT_MAX_REQUEUES, DEFAULT_MODE
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir


def recorded_exit(log: EventLog, attempt: int) -> int | None:
    """The exit code an agent already decided for ``attempt``, or None when nobody decided."""
    failed = log.first(events.JOB_FAILED, attempt=attempt)
    if failed is not None:
        return int(failed.get("exit_code", 1))
    ended = log.last(events.ATTEMPT_ENDED, events.JOB_SUCCEEDED, attempt=attempt)
    return None if ended is None else int(ended.get("exit_code", 1))


def step_end_reason(srun_exit_code: int, *, stopped: bool, job_id: str | None) -> Reason:
    """How the attempt ended when no agent said: from srun's exit code and the batch script's trap."""
    if srun_exit_code == EXIT_OK:
        return Reason.SUCCEEDED
    if srun_exit_code == EXIT_USAGE:
        return Reason.STARTUP_FAILURE  # the agents rejected their own arguments: the next attempt would too
    if stopped and job_id:
        return Reason.PREEMPTED  # refined to TIME_LIMIT by end_attempt when it is the time limit
    return Reason.COORDINATOR_LOST


def finalize(
    rd: RunDir,
    srun_exit_code: int,
    *,
    stopped: bool,
    requeue_mode: str | None = None,
    max_requeues: int | None = None,
    environ: Mapping[str, str] | None = None,
    say: Callable[[str], None] = _say,
) -> int:
    """The batch script's exit code: the one recorded for this attempt, else end the attempt here."""
    environ = os.environ if environ is None else environ
    job_id = slurm_env.job_id(environ)
    if job_id is None:
        attempt = handoff.load(rd).attempt
    else:
        attempt = handoff.begin_attempt(rd, job_id, slurm_env.restart_count(environ))
    recorded = recorded_exit(rd.events(), attempt)
    if recorded is not None:
        return recorded
    reason = step_end_reason(srun_exit_code, stopped=stopped, job_id=job_id)
    say(f"the job step ended with exit code {srun_exit_code} and no agent decided; {reason}")
    meta = rd.read_meta()
    outcome = end_attempt(
        rd,
        attempt,
        reason,
        job_id=job_id,
        requeue_mode=requeue_mode or meta.get("requeue_mode") or DEFAULT_MODE,
        max_requeues=max_requeues
        if max_requeues is not None
        else int(meta.get("max_requeues", DEFAULT_MAX_REQUEUES)),
    )
    return outcome.exit_code
