"""The requeue policy: a pure decision over the run's history and how the attempt ended.

No I/O and no clock: :func:`decide` says what to do; :mod:`hpcelastic.lifecycle.executor` does it.
The rules are in docs/ARCHITECTURE.md ("Requeue policy").
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcelastic import sites
from hpcelastic.errors import UserError
from hpcelastic.lifecycle import progress
from hpcelastic.lifecycle.history import History
from hpcelastic.reasons import JobEnd, Named, Reason, SkipReason

DEFAULT_MAX_REQUEUES: int = sites.default("requeue.max_requeues")
MAX_STOPS_WITHOUT_PROGRESS = 3


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
class Capacity:
    """The nodes of the job's partition that could run it, now or once back up (all but drained ones),
    and how many it needs."""

    usable: frozenset[str]
    needed: int


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt ended, as its decider saw it."""

    attempt: int
    reason: Reason
    exit_code: int
    job_id: str | None
    bad_nodes: tuple[str, ...] = ()
    #: The decider's own node saw a step (its workers' heartbeats).
    progressed: bool = False
    signature: str | None = None
    #: Slurm has queued the job again itself (preemption with PreemptMode=REQUEUE).
    slurm_requeued: bool = False
    #: A complete checkpoint written during the attempt, found in the checkpoint directory.
    new_checkpoint: str | None = None
    #: The partition's usable nodes and how many the job needs (None: unknown, exclusions not capped).
    capacity: Capacity | None = None


class Action(Named):
    """What the executor does."""

    SUCCEED = "succeed"
    SKIP = "skip"
    BRING_BACK = "bring_back"


@dataclass(frozen=True)
class Decision:
    """The policy's verdict on one ended attempt.

    ``progressed`` (the attempt trained) and ``progress`` (why it advanced the job, or None) are what
    ``attempt_ended`` records. ``SKIP`` carries ``skip`` (why), ``job_end``
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
    progress: str | None = None


def stops_without_progress(history: History, end: AttemptEnd) -> int:
    """How many attempts in a row, ending with this one, were stopped without advancing the job.

    Preemption and time-limit requeues have no budget (a long job needs many), so this is what
    stops a job whose time limit is shorter than its start-up plus the signal lead from being
    requeued forever. An attempt that advanced (:func:`~hpcelastic.lifecycle.progress.advanced`: a
    checkpoint, published or not, or a step beyond all earlier ones) ends the count.
    """
    ended = {**history.ended, end.attempt: end.reason}
    count = 0
    for k in range(end.attempt, -1, -1):
        reason = ended.get(k)
        found = end.new_checkpoint if k == end.attempt else None
        if reason is None or not reason.is_stop:
            break
        if progress.advanced(history.attempts, k, new_checkpoint=found):
            break
        count += 1
    return count


def capped_exclusion(nodes: tuple[str, ...], capacity: Capacity | None) -> tuple[str, ...]:
    """``nodes`` (oldest evidence first), less the oldest ones that would leave the job fewer nodes than it
    needs: an exclusion never makes the job unschedulable on its partition, even once its down nodes are
    back (an excluded job that cannot start never reaches the decision that would release the exclusion).
    Drained nodes (not in ``capacity.usable``) cost nothing and stay excluded."""
    if capacity is None:
        return nodes
    room = max(0, len(capacity.usable) - capacity.needed)
    usable = [n for n in nodes if n in capacity.usable]
    dropped = set(usable[: max(0, len(usable) - room)])
    return tuple(n for n in nodes if n not in dropped)


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
    advanced = progress.advanced(history.attempts, end.attempt, new_checkpoint=end.new_checkpoint)
    progressed = end.progressed or advanced is not None or progress.trained(history.attempts, end.attempt)

    def skip(why: SkipReason, job_end: Reason | JobEnd, code: int, message: str) -> Decision:
        return Decision(
            Action.SKIP,
            code,
            progressed,
            why,
            job_end,
            message,
            slurm_requeued=end.slurm_requeued,
            progress=advanced,
        )

    if end.reason is Reason.SUCCEEDED:
        ok = Reason.SUCCEEDED.exit_code
        return Decision(Action.SUCCEED, ok, progressed, message="the job succeeded", progress=advanced)
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
    if (end.reason is Reason.STARTUP_FAILURE and not progressed) or repeated:
        how = (
            f"exactly like attempt {end.attempt - 1} (same root cause, no progress)"
            if repeated
            else "(the script's own error, no progress)"
        )
        return skip(
            SkipReason.STARTUP_FAILURE,
            Reason.STARTUP_FAILURE,
            Reason.STARTUP_FAILURE.exit_code,
            f"attempt {end.attempt} failed at start-up {how}; not requeued: fix the script, then "
            f"`hpcelastic {'submit' if end.job_id else 'run'}` again",
        )
    if not end.job_id:
        return skip(
            SkipReason.NO_SLURM_JOB,
            end.reason,
            end.exit_code,
            "not running under Slurm (no job id): nothing to requeue",
        )
    stalled = stops_without_progress(history, end)
    if stalled >= MAX_STOPS_WITHOUT_PROGRESS:
        return skip(
            SkipReason.NO_PROGRESS,
            end.reason,
            end.exit_code,
            f"the job was stopped ({end.reason}) {stalled} attempts in a row without progress (no new "
            "checkpoint, no step beyond the earlier attempts'); not requeued: give it a longer --time "
            "or a shorter --signal lead",
        )
    if not end.reason.is_stop and history.budget_used >= settings.max_requeues:
        return skip(
            SkipReason.LIMIT_REACHED,
            end.reason,
            end.exit_code,
            f"requeue limit reached ({history.budget_used} of --max-requeues {settings.max_requeues} "
            "used); not requeued: raise --max-requeues to allow more",
        )
    wanted = tuple(dict.fromkeys([*history.bad_nodes, *sorted(set(end.bad_nodes))]))
    exclude = capped_exclusion(wanted, end.capacity)
    return Decision(
        Action.BRING_BACK,
        end.reason.exit_code if end.reason.is_stop else end.exit_code,
        progressed,
        job_id=end.job_id,
        exclude=exclude,
        release=tuple(dict.fromkeys(n for n in [*history.released_nodes, *wanted] if n not in exclude)),
        slurm_requeued=end.slurm_requeued,
        progress=advanced,
    )
