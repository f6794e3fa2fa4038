"""The one end-of-attempt path, shared by the agent and ``hpcelastic finalize``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcelastic import events, handoff
from hpcelastic.lifecycle.cancel import mark_cancelled
from hpcelastic.lifecycle.classify import Stop, slurm_stop
from hpcelastic.lifecycle.evidence import new_checkpoint, partition_capacity, still_bad
from hpcelastic.lifecycle.executor import Executor
from hpcelastic.lifecycle.history import attempt_root_cause, root_cause_signature
from hpcelastic.lifecycle.policy import AttemptEnd, Settings
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir, write_json_atomic


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
    unreachable: Sequence[str] = (),
    progressed: bool = False,
    exit_code: int | None = None,
    requeue_mode: str,
    max_requeues: int,
    executor: Executor | None = None,
) -> EndOutcome:
    """Record how ``attempt`` ended and bring the job back or stop it; at most once per attempt.

    Slurm's record of the job has the last word on a stop (:mod:`~hpcelastic.lifecycle.classify`):
    ``reason`` PREEMPTED (a stop signal was seen) becomes the time limit, a preemption or a node
    failure; any other failure becomes the stop Slurm is making, if it is ending the job. A job
    Slurm is cancelling (plain ``scancel``) ends ``cancelled`` and marks the run so: it is never brought back.
    The attempt's root cause is read from the event log, a checkpoint the attempt wrote from the
    checkpoint directory, the nodes the job could be placed on from Slurm. Of ``bad_nodes``, those in
    ``unreachable`` (lost by silence only) stay bad only while their slurmd does not answer: a link that
    came back is no bad node.
    ``exit_code`` defaults to ``reason.exit_code``.
    """
    settings = Settings.parse(requeue_mode, max_requeues)
    slurm_requeued = False
    if reason is not Reason.SUCCEEDED and job_id:
        reason, slurm_requeued = _slurm_reason(run_dir, job_id, reason)
    log = run_dir.events()
    started = log.last(events.ATTEMPT_STARTED, attempt=attempt)
    end = AttemptEnd(
        attempt=attempt,
        reason=reason,
        exit_code=reason.exit_code if exit_code is None else exit_code,
        job_id=job_id,
        bad_nodes=still_bad(bad_nodes, unreachable) if job_id else tuple(bad_nodes),
        progressed=progressed,
        signature=root_cause_signature(attempt_root_cause(log)),
        slurm_requeued=slurm_requeued,
        new_checkpoint=new_checkpoint(
            run_dir.read_meta().get("checkpoint_dir"), float(started["ts"]) if started else float("inf")
        ),
        capacity=partition_capacity(job_id) if job_id and reason is not Reason.SUCCEEDED else None,
    )
    outcome = (executor or Executor()).conclude(run_dir, end, settings)
    return EndOutcome(outcome.exit_code, outcome.message)


def _slurm_reason(run_dir: RunDir, job_id: str, reason: Reason) -> tuple[Reason, bool]:
    """``reason`` as Slurm's record of ``job_id`` corrects it, and whether Slurm requeued the job itself
    (preemption with PreemptMode=REQUEUE); marks the run cancelled on a cancel."""
    lead = run_dir.read_meta().get("signal_lead_s")
    rec = handoff.load(run_dir)
    verdict = slurm_stop(
        job_id,
        signalled=reason is Reason.PREEMPTED,
        signal_lead_s=float(lead) if isinstance(lead, (int, float)) else None,
        restart_count=rec.restart_count_slurm if rec.job_id == job_id else None,
    )
    stop = verdict.stop
    if stop is Stop.CANCELLED:
        mark_cancelled(run_dir)
        run_dir.record(events.cancelled(job_id=job_id))
        return Reason.CANCELLED, False
    return (reason if stop is None or stop.reason is None else stop.reason), verdict.requeued


@dataclass(frozen=True)
class Deferred:
    """What the coordinator's agent knew of an attempt's end when it could not ask Slurm (a container
    without Slurm's commands): ``hpcelastic finalize``, outside the container, ends the attempt with it."""

    reason: Reason
    bad_nodes: tuple[str, ...] = ()
    unreachable: tuple[str, ...] = ()
    progressed: bool = False


def deferred_path(run_dir: RunDir, attempt: int) -> Path:
    """Where the agent leaves :class:`Deferred` for ``finalize``."""
    return run_dir.path / f"deferred-attempt-{attempt}.json"


def defer(run_dir: RunDir, attempt: int, end: Deferred) -> None:
    """Leave the end of ``attempt`` to ``finalize`` (written atomically)."""
    record = {
        "reason": end.reason.value,
        "bad_nodes": list(end.bad_nodes),
        "unreachable": list(end.unreachable),
        "progressed": end.progressed,
    }
    write_json_atomic(deferred_path(run_dir, attempt), record)


def deferred(run_dir: RunDir, attempt: int) -> Deferred | None:
    """The end of ``attempt`` an agent left to ``finalize``, or None."""
    try:
        rec = json.loads(deferred_path(run_dir, attempt).read_text())
        return Deferred(
            reason=Reason(rec["reason"]),
            bad_nodes=tuple(rec.get("bad_nodes") or ()),
            unreachable=tuple(rec.get("unreachable") or ()),
            progressed=bool(rec.get("progressed")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
