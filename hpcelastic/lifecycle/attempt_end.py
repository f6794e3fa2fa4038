"""The one end-of-attempt path, shared by the agent and ``hpcelastic finalize``.

(Interface fixed for the refactor; the body still delegates to the old policy until it moves.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
) -> EndOutcome:
    """Record how ``attempt`` ended and bring the job back or stop it; at most once per attempt.

    ``reason`` PREEMPTED is refined from Slurm's record of the job (time limit or preemption). The
    attempt's root cause is read from the event log. ``exit_code`` defaults to ``reason.exit_code``.
    """
    from hpcelastic.agent.agent import last_root_cause
    from hpcelastic.requeue import RequeuePolicy, classify_stop_signal

    if reason is Reason.PREEMPTED and job_id:
        reason = Reason(classify_stop_signal(job_id))
    code = reason.exit_code if exit_code is None else exit_code
    outcome = RequeuePolicy(requeue_mode, max_requeues).decide(
        run_dir,
        attempt,
        reason.value,
        code,
        list(bad_nodes),
        job_id,
        last_root_cause(run_dir),
        progressed=progressed,
    )
    return EndOutcome(outcome.exit_code, outcome.message)
