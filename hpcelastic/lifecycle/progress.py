"""What counts as a job's progress, judged on the whole job's evidence (pure, no I/O).

Two questions, answered per attempt from the run's event log (and, for the attempt that is ending,
what the decider found in the checkpoint directory):

- did the attempt *advance* the job? A checkpoint published with ``hpcelastic.worker``, a new complete
  checkpoint in the checkpoint directory (published or not: an unchanged script saves on its own),
  or a step above every step of the earlier attempts (any rank's heartbeat, as the coordinator
  wrote it in ``progress`` events). A job that is stopped (time limit, preemption) several attempts
  in a row without advancing is not brought back again.
- did the attempt *train*? It advanced, or any rank reached a step, or its workers ran for
  :data:`LONG_RUN_S` (an unchanged script sends no heartbeats). A failure of an attempt that did not
  train is a start-up failure; the same one twice in a row ends the job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: Workers that ran this long count as training even without a single heartbeat (an unchanged script
#: sends none): a failure after it is not a start-up failure. Erring short costs at most a budgeted
#: requeue of a slow start-up that fails; erring long abandons a job that trained (a GPU that fails the
#: same way after 20 minutes, twice, found by the simulated weeks, seed 8538).
LONG_RUN_S = 600.0


@dataclass(frozen=True)
class AttemptProgress:
    """One attempt's evidence of progress, as its events tell it."""

    #: The highest step any rank reached (None: no heartbeat).
    top_step: int | None = None
    #: A checkpoint was published (``checkpoint_published``).
    published: bool = False
    #: Seconds from its first ``workers_started`` to its end (or to now while it runs).
    trained_s: float = 0.0
    #: Why its decider found it advanced the job (its ``attempt_ended.progress``), e.g. a new checkpoint.
    advanced: str | None = None
    #: Its decider found it trained (its ``attempt_ended.progressed``).
    trained: bool = False


def best_step_before(attempts: Mapping[int, AttemptProgress], attempt: int) -> int | None:
    """The highest step any attempt before ``attempt`` reached."""
    steps = [p.top_step for k, p in attempts.items() if k < attempt and p.top_step is not None]
    return max(steps) if steps else None


def advanced(
    attempts: Mapping[int, AttemptProgress], attempt: int, *, new_checkpoint: str | None = None
) -> str | None:
    """Why ``attempt`` advanced the job, or None when nothing says it did.

    ``new_checkpoint`` is a checkpoint the decider found complete in the checkpoint directory, written
    during the attempt.
    """
    p = attempts.get(attempt, AttemptProgress())
    if p.published:
        return "published a checkpoint"
    if new_checkpoint:
        return f"wrote checkpoint {new_checkpoint}"
    if p.advanced:
        return p.advanced
    best = best_step_before(attempts, attempt)
    if p.top_step is not None and (best is None or p.top_step > best):
        return f"reached step {p.top_step}" + (f" (earlier attempts: {best})" if best is not None else "")
    return None


def trained(attempts: Mapping[int, AttemptProgress], attempt: int) -> bool:
    """Whether ``attempt`` got past start-up: a step, a checkpoint, or workers that ran :data:`LONG_RUN_S`."""
    p = attempts.get(attempt, AttemptProgress())
    return (
        p.trained
        or p.top_step is not None
        or p.trained_s >= LONG_RUN_S
        or advanced(attempts, attempt) is not None
    )
