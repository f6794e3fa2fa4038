"""Why things end: the one list of attempt-end reasons (each with its exit code) and of the reasons
a job is not brought back.

Every module that decides, records, reads or prints an end reason uses these enums; the strings
they stand for are what ``events.jsonl`` and ``handoff.json`` hold.
"""

from __future__ import annotations

import enum

from hpcelastic.errors import (
    EXIT_CANCELLED,
    EXIT_COORDINATOR_LOST,
    EXIT_NODE_UNHEALTHY,
    EXIT_OK,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_STARTUP_FAILURE,
    EXIT_STEP_FAILED,
    EXIT_STOPPED_FOR_REQUEUE,
    EXIT_TOO_FEW_NODES,
)


class Named(str, enum.Enum):
    """A string enum whose members print as their recorded value: ``str(Reason.PREEMPTED) == "preempted"``."""

    def __str__(self) -> str:
        return self.value


class Reason(Named):
    """How one attempt (one allocation of the job) ended; ``exit_code`` is what the agent exits with."""

    exit_code: int

    def __new__(cls, value: str, exit_code: int) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.exit_code = exit_code
        return member

    SUCCEEDED = ("succeeded", EXIT_OK)
    RESTARTS_EXHAUSTED = ("restarts_exhausted", EXIT_RESTARTS_EXHAUSTED)
    TOO_FEW_NODES = ("too_few_nodes", EXIT_TOO_FEW_NODES)
    PREEMPTED = ("preempted", EXIT_STOPPED_FOR_REQUEUE)
    TIME_LIMIT = ("time_limit", EXIT_STOPPED_FOR_REQUEUE)
    NODE_UNHEALTHY = ("node_unhealthy", EXIT_NODE_UNHEALTHY)
    COORDINATOR_LOST = ("coordinator_lost", EXIT_COORDINATOR_LOST)
    STARTUP_FAILURE = ("startup_failure", EXIT_STARTUP_FAILURE)
    #: The job step ended before any agent began the attempt: srun could not create it, or the agents
    #: failed before they met (no coordinator address); a failure, never a lost coordinator.
    STEP_FAILED = ("step_failed", EXIT_STEP_FAILED)
    #: Slurm ended the attempt because the user cancelled the job (``scancel``): no failure, no stop to
    #: requeue; the run is marked cancelled and never brought back.
    CANCELLED = ("cancelled", EXIT_CANCELLED)

    @property
    def is_stop(self) -> bool:
        """A stop Slurm asked for (preemption, time limit): requeued without spending the failure budget."""
        return self in (Reason.PREEMPTED, Reason.TIME_LIMIT)

    @property
    def requeue_counter(self) -> RequeueCounter:
        """Which requeue counter of the handoff record a requeue for this reason increments."""
        if self is Reason.PREEMPTED:
            return RequeueCounter.PREEMPTED
        if self is Reason.TIME_LIMIT:
            return RequeueCounter.TIME_LIMIT
        if self is Reason.NODE_UNHEALTHY:
            return RequeueCounter.NODE_UNHEALTHY
        return RequeueCounter.FAILURE

    @classmethod
    def parse(cls, value: object) -> Reason | None:
        """The reason a recorded string names, or None for anything else."""
        try:
            return cls(str(value))
        except ValueError:
            return None


class RequeueCounter(Named):
    """The handoff record's requeue counters; ``FAILURE`` and ``NODE_UNHEALTHY`` share ``--max-requeues``."""

    FAILURE = "failure"
    PREEMPTED = "preempted"
    TIME_LIMIT = "time_limit"
    NODE_UNHEALTHY = "node_unhealthy"

    @property
    def is_budgeted(self) -> bool:
        """Counted against ``--max-requeues``."""
        return self in (RequeueCounter.FAILURE, RequeueCounter.NODE_UNHEALTHY)


class SkipReason(Named):
    """Why an ended attempt is not brought back (event ``requeue_skipped``)."""

    LIMIT_REACHED = "limit_reached"
    STARTUP_FAILURE = "startup_failure"
    CANCELLED = "cancelled"
    NO_SLURM_JOB = "no_slurm_job"
    NO_PROGRESS = "no_progress"


class JobEnd(Named):
    """Job-level outcomes that are not an attempt-end reason (``job_failed.reason``)."""

    REQUEUE_FAILED = "requeue_failed"
    CANCELLED = "cancelled"


class Requeuer(Named):
    """Who queued the job again (``requeued.by``): hpcelastic (``scontrol requeue``) or Slurm itself
    (preemption with PreemptMode=REQUEUE), after which hpcelastic neither requeues nor resubmits."""

    HPCELASTIC = "hpcelastic"
    SLURM = "slurm"


class RestartCause(Named):
    """Why the workers of a round are restarted inside the allocation (event ``restarting``)."""

    WORKER_FAILED = "worker_failed"
    NODE_LOST = "node_lost"
