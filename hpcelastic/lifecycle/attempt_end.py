"""The one end-of-attempt path, shared by the agent and ``hpcelastic finalize``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpcelastic.lifecycle.classify import classify_stop_signal
from hpcelastic.lifecycle.executor import Executor
from hpcelastic.lifecycle.history import attempt_root_cause, root_cause_signature
from hpcelastic.lifecycle.policy import AttemptEnd, Settings
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir


@dataclass(frozen=True)
class EndOutcome:
    """What ending the attempt did: the exit code for the caller and the line it printed."""

    exit_code: int
    message: str


def end_attempt(
    run_dir: RunDir,
    attempt: int,
    reason: Reason,
    *,
    job_id: str | None,
    bad_nodes: Sequence[str] = (),
    progressed: bool = False,
    exit_code: int | None = None,
    requeue_mode: str,
    max_requeues: int,
    executor: Executor | None = None,
) -> EndOutcome:
    """Record how ``attempt`` ended and bring the job back or stop it; at most once per attempt.

    ``reason`` PREEMPTED is refined from Slurm's record of the job (time limit or preemption). The
    attempt's root cause is read from the event log. ``exit_code`` defaults to ``reason.exit_code``.
    """
    settings = Settings.parse(requeue_mode, max_requeues)
    if reason is Reason.PREEMPTED and job_id:
        reason = classify_stop_signal(job_id)
    end = AttemptEnd(
        attempt=attempt,
        reason=reason,
        exit_code=reason.exit_code if exit_code is None else exit_code,
        job_id=job_id,
        bad_nodes=tuple(bad_nodes),
        progressed=progressed,
        signature=root_cause_signature(attempt_root_cause(run_dir.events())),
    )
    outcome = (executor or Executor()).conclude(run_dir, end, settings)
    return EndOutcome(outcome.exit_code, outcome.message)
