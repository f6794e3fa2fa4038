"""``hpcelastic finalize``: after srun, exit with the agents' decision, or decide when no agent could."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

from hpcelastic import events, handoff
from hpcelastic.env import slurm as slurm_env
from hpcelastic.errors import EXIT_OK, EXIT_USAGE
from hpcelastic.events import EventLog
from hpcelastic.lifecycle.attempt_end import deferred, end_attempt
from hpcelastic.lifecycle.executor import say as _say
from hpcelastic.lifecycle.policy import DEFAULT_MAX_REQUEUES, DEFAULT_MODE
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir

#: Said with :attr:`Reason.STEP_FAILED`: where to look.
NOT_BEGUN = " (no agent began the attempt: srun could not start the step, see above, or the agents never met)"


def recorded_exit(log: EventLog, attempt: int) -> int | None:
    """The exit code an agent already decided for ``attempt``, or None when nobody decided."""
    failed = log.first(events.JOB_FAILED, attempt=attempt)
    if failed is not None:
        return int(failed.get("exit_code", 1))
    ended = log.last(events.ATTEMPT_ENDED, events.JOB_SUCCEEDED, attempt=attempt)
    return None if ended is None else int(ended.get("exit_code", 1))


def step_end_reason(
    srun_exit_code: int,
    *,
    stopped: bool,
    job_id: str | None,
    began: bool,
    usage_error: bool,
) -> Reason:
    """How the attempt ended when no agent said: from srun's exit code, the batch script's trap and
    what the agents recorded.

    ``began``: an agent began this allocation's attempt (see :func:`agents_began`); ``usage_error``:
    the agents recorded that they rejected their own settings (:func:`usage_error_recorded`). An exit
    code of 2 alone is no usage error: an agent's runtime error (a read of ``coordinator-*.json``
    that fails, a wait for it that times out) exits 2 as well.
    """
    if srun_exit_code == EXIT_OK:
        return Reason.SUCCEEDED
    if usage_error and srun_exit_code == EXIT_USAGE:
        return Reason.STARTUP_FAILURE  # every attempt would reject the same settings
    if stopped and job_id:
        return Reason.PREEMPTED  # refined to TIME_LIMIT by end_attempt when it is the time limit
    if not began:
        return Reason.STEP_FAILED  # srun could not start the step, or the agents never met
    return Reason.COORDINATOR_LOST


def agents_began(rd: RunDir, job_id: str | None, restart_count: int) -> bool:
    """Whether an agent began this allocation's attempt: the handoff record names the allocation.

    Read before ``finalize`` begins the attempt itself; outside Slurm (no job id) it is assumed.
    """
    if job_id is None:
        return True
    rec = handoff.load(rd)
    return rec.job_id == job_id and rec.restart_count_slurm == restart_count


def usage_error_recorded(rd: RunDir, job_id: str | None, restart_count: int) -> bool:
    """Whether the coordinator published a start-up error of its settings for this allocation (its
    ``coordinator-*.json`` holds ``error``: the port or interface it was given cannot be used)."""
    try:
        record = json.loads(slurm_env.coordinator_file(rd, job_id, restart_count).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "error" in record


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
    restart_count = slurm_env.restart_count(environ)
    began = agents_began(rd, job_id, restart_count)
    attempt = handoff.load(rd).attempt if job_id is None else handoff.begin_attempt(rd, job_id, restart_count)
    recorded = recorded_exit(rd.events(), attempt)
    if recorded is not None:
        return recorded
    meta = rd.read_meta()
    mode = requeue_mode or meta.get("requeue_mode") or DEFAULT_MODE
    requeues = (
        max_requeues if max_requeues is not None else int(meta.get("max_requeues", DEFAULT_MAX_REQUEUES))
    )
    left = deferred(rd, attempt)
    if left is not None:  # the coordinator's agent ran where Slurm's commands are not (a container)
        outcome = end_attempt(
            rd,
            attempt,
            left.reason,
            job_id=job_id,
            bad_nodes=left.bad_nodes,
            unreachable=left.unreachable,
            progressed=left.progressed,
            requeue_mode=mode,
            max_requeues=requeues,
        )
        return outcome.exit_code
    reason = step_end_reason(
        srun_exit_code,
        stopped=stopped,
        job_id=job_id,
        began=began,
        usage_error=usage_error_recorded(rd, job_id, restart_count),
    )
    note = NOT_BEGUN if reason is Reason.STEP_FAILED else ""
    say(f"the job step ended with exit code {srun_exit_code} and no agent decided; {reason}{note}")
    outcome = end_attempt(rd, attempt, reason, job_id=job_id, requeue_mode=mode, max_requeues=requeues)
    return outcome.exit_code
