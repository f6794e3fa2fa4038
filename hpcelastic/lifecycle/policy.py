"""The requeue policy: a pure decision over the run's history and how the attempt ended.

No I/O and no clock: :func:`decide` says what to do; :mod:`hpcelastic.lifecycle.executor` does it.
The rules are in docs/ARCHITECTURE.md ("Requeue policy").
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcelastic import sites
from hpcelastic.errors import UserError
from hpcelastic.lifecycle.history import History
from hpcelastic.reasons import JobEnd, Named, Reason, SkipReason

DEFAULT_MAX_REQUEUES: int = sites.default("requeue.max_requeues")
MAX_STOPS_WITHOUT_CHECKPOINT = 3


class RequeueMode(Named):
    """How a job comes back: the same job id (``scontrol requeue``) or a new job (``sbatch``)."""

    REQUEUE = "requeue"
    RESUBMIT = "resubmit"


MODES = tuple(m.value for m in RequeueMode)
DEFAULT_MODE = RequeueMode(sites.default("requeue.mode"))


@dataclass(frozen=True)
class Settings:
    """The user's requeue settings (``--requeue-mode``, ``--max-requeues``)."""

    mode: RequeueMode = DEFAULT_MODE
    max_requeues: int = DEFAULT_MAX_REQUEUES

    @classmethod
    def parse(cls, mode: str, max_requeues: int) -> Settings:
        """Validated settings; :class:`UserError` names a bad value."""
        if mode not in MODES:
            raise UserError(f"unknown requeue mode {mode!r}; use one of: {', '.join(MODES)}")
        if max_requeues < 0:
            raise UserError(f"--max-requeues must be 0 or more, not {max_requeues}")
        return cls(RequeueMode(mode), max_requeues)


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt ended, as its decider saw it."""

    attempt: int
    reason: Reason
    exit_code: int
    job_id: str | None
    bad_nodes: tuple[str, ...] = ()
    progressed: bool = False
    signature: str | None = None
    #: Slurm has queued the job again itself (preemption with PreemptMode=REQUEUE).
    slurm_requeued: bool = False


class Action(Named):
    """What the executor does."""

    SUCCEED = "succeed"
    SKIP = "skip"
    BRING_BACK = "bring_back"


@dataclass(frozen=True)
class Decision:
    """The policy's verdict on one ended attempt.

    ``progressed`` is what ``attempt_ended`` records. ``SKIP`` carries ``skip`` (why), ``job_end``
    (the ``job_failed`` reason) and ``message``; ``BRING_BACK`` carries ``job_id``, ``exclude`` and
    ``release`` (nodes excluded before whose cooldown is over).
    ``slurm_requeued``: Slurm has queued the job again itself; a ``BRING_BACK`` then neither requeues
    nor resubmits (a second requeue or a duplicate job), a ``SKIP`` cancels the job Slurm queued.
    ``exit_code`` is what the caller exits with.
    """

    action: Action
    exit_code: int
    progressed: bool
    skip: SkipReason | None = None
    job_end: Reason | JobEnd | None = None
    message: str = ""
    job_id: str | None = None
    exclude: tuple[str, ...] = ()
    release: tuple[str, ...] = ()
    slurm_requeued: bool = False


def stops_without_checkpoint(history: History, end: AttemptEnd) -> int:
    """How many attempts in a row, ending with this one, were stopped before publishing a checkpoint.

    Preemption and time-limit requeues have no budget (a long job needs many), so this is what
    stops a job whose time limit is shorter than its start-up plus the signal lead from being
    requeued forever without progress.
    """
    ended = {**history.ended, end.attempt: end.reason}
    count = 0
    for k in range(end.attempt, -1, -1):
        reason = ended.get(k)
        if reason is None or not reason.is_stop or k in history.published:
            break
        count += 1
    return count


def cancelled_decision(end: AttemptEnd, progressed: bool) -> Decision:
    """The run was cancelled by the user: never brought back."""
    return Decision(
        Action.SKIP,
        end.exit_code,
        progressed,
        SkipReason.CANCELLED,
        JobEnd.CANCELLED,
        "the run was cancelled by the user",
        slurm_requeued=end.slurm_requeued,
    )


def decide(history: History, end: AttemptEnd, settings: Settings) -> Decision:
    """Succeed, skip (and why) or bring the job back, by the rules of the module docstring."""
    progressed = end.progressed or history.published_in_attempt

    def skip(why: SkipReason, job_end: Reason | JobEnd, code: int, message: str) -> Decision:
        return Decision(
            Action.SKIP, code, progressed, why, job_end, message, slurm_requeued=end.slurm_requeued
        )

    if end.reason is Reason.SUCCEEDED:
        return Decision(Action.SUCCEED, Reason.SUCCEEDED.exit_code, progressed, message="the job succeeded")
    if history.cancelled:
        return cancelled_decision(end, progressed)
    prev = history.previous
    repeated = (
        end.signature is not None
        and prev is not None
        and prev.signature == end.signature
        and not prev.progressed
        and not progressed
    )
    if end.reason is Reason.STARTUP_FAILURE or repeated:
        return skip(
            SkipReason.STARTUP_FAILURE,
            Reason.STARTUP_FAILURE,
            Reason.STARTUP_FAILURE.exit_code,
            f"attempt {end.attempt} failed at start-up exactly like attempt {end.attempt - 1} (same root "
            "cause, no progress); not requeued: fix the script, then `hpcelastic submit` again",
        )
    if not end.job_id:
        return skip(
            SkipReason.NO_SLURM_JOB,
            end.reason,
            end.exit_code,
            "not running under Slurm (no job id): nothing to requeue",
        )
    stalled = stops_without_checkpoint(history, end)
    if stalled >= MAX_STOPS_WITHOUT_CHECKPOINT:
        return skip(
            SkipReason.NO_PROGRESS,
            end.reason,
            end.exit_code,
            f"the job was stopped ({end.reason}) {stalled} attempts in a row before it published a "
            "checkpoint; not requeued: give it a longer --time or a shorter --signal lead",
        )
    if not end.reason.is_stop and history.budget_used >= settings.max_requeues:
        return skip(
            SkipReason.LIMIT_REACHED,
            end.reason,
            end.exit_code,
            f"requeue limit reached ({history.budget_used} of --max-requeues {settings.max_requeues} "
            "used); not requeued: raise --max-requeues to allow more",
        )
    exclude = tuple(dict.fromkeys([*history.bad_nodes, *sorted(set(end.bad_nodes))]))
    return Decision(
        Action.BRING_BACK,
        end.reason.exit_code if end.reason.is_stop else end.exit_code,
        progressed,
        job_id=end.job_id,
        exclude=exclude,
        release=tuple(n for n in history.released_nodes if n not in exclude),
        slurm_requeued=end.slurm_requeued,
    )
