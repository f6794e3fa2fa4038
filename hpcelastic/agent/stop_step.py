"""One stop step for every rank after a preemption signal, free of I/O.

Each agent answers the coordinator's ``preempt`` with :class:`StepRate`'s report: the highest step
its workers reached (from their heartbeats) and how many steps a second they make. The coordinator
fixes :func:`stop_step` from all reports and sends it to every agent, which writes it into the
attempt's stop file; ``hpcelastic.worker.should_stop()`` turns true on every rank once that rank's
own step reaches it. The margin covers the steps made while the reports and the answer travel:
one step plus :data:`STOP_SLACK_S` seconds of the fastest node's rate.

:func:`stop_grace` is how long a node's workers get after the signal: the one place that computes the
time left to a stop.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

#: Seconds of training the stop step leaves for the reports and the answer to travel.
STOP_SLACK_S = 1.0
#: How long the coordinator waits for every node's report before it fixes the step from those it has.
REPORT_TIMEOUT_S = 2.0
#: How many of the latest steps the rate is measured over (not the round: its checkpoint pauses would
#: slow it down, and a stop step fixed too early is one some rank has already passed).
RATE_WINDOW = 16
#: What the attempt needs after its workers stopped and before Slurm's hard stop: the decision (about
#: 20 ms, bench/RESULTS.md), ``scontrol requeue`` and srun's teardown, with room to spare.
END_MARGIN_S = 10.0


class StepRate:
    """The highest step of one node's workers in the current round, and its recent steps per second."""

    def __init__(self) -> None:
        self.round = -1
        self.step: int | None = None
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=RATE_WINDOW + 1)

    def beat(self, round_: int, step: int, ts: float) -> None:
        """A worker of ``round_`` reached ``step`` at ``ts`` (seconds)."""
        if round_ != self.round:
            self.round, self.step = round_, None
            self._recent.clear()
        if self.step is None or step > self.step:
            self.step = step
            self._recent.append((step, ts))

    @property
    def rate(self) -> float:
        """Steps per second over the last :data:`RATE_WINDOW` new steps (0 before two distinct steps)."""
        return recent_rate(list(self._recent))


def recent_rate(beats: list[tuple[int, float]]) -> float:
    """Steps per second from ``(step, ts)`` points of increasing step: the median time per step between
    neighbours, so a checkpoint pause among them does not slow the rate down (0 without two points)."""
    per_step = sorted((t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(beats, beats[1:], strict=False))
    if not per_step:
        return 0.0
    mid = len(per_step) // 2
    median = per_step[mid] if len(per_step) % 2 else (per_step[mid - 1] + per_step[mid]) / 2
    if median > 0:
        return 1.0 / median
    span = beats[-1][1] - beats[0][1]
    return (beats[-1][0] - beats[0][0]) / span if span > 0 else 0.0


def stop_step(reports: Iterable[tuple[int | None, float]], slack_s: float = STOP_SLACK_S) -> int | None:
    """The step every rank stops after: the highest reported step + 1 + ``slack_s`` of the fastest
    rate; None when no node reported a step (scripts without heartbeats stop at once, as before)."""
    steps = [(s, r) for s, r in reports if s is not None]
    if not steps:
        return None
    top = max(s for s, _ in steps)
    rate = max(max(r, 0.0) for _, r in steps)
    return top + 1 + math.ceil(rate * slack_s)


def stop_file_text(step: int | None) -> str:
    """The stop file's content: the stop step, or empty (stop now)."""
    return "" if step is None else f"{step}\n"


def stop_grace(grace_period: float, time_left: float | None) -> float:
    """Seconds this node's workers get to stop after a stop signal: the grace period, cut short so that
    the attempt still ends (decides, requeues) before Slurm's hard stop ``time_left`` seconds away (from
    ``SLURM_JOB_END_TIME``, 23.02 and later; None where unknown: 22.05, or a preemption, whose
    GraceTime the job's environment does not carry). A stop closer than :data:`END_MARGIN_S` stops the
    workers at once."""
    if time_left is None:
        return grace_period
    return max(0.0, min(grace_period, time_left - END_MARGIN_S))
