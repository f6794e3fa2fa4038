"""One stop step for every rank after a preemption signal, free of I/O.

Each agent answers the coordinator's ``preempt`` with :class:`StepRate`'s report: the highest step
its workers reached (from their heartbeats) and how many steps a second they make. The coordinator
fixes :func:`stop_step` from all reports and sends it to every agent, which writes it into the
attempt's stop file; ``hpcelastic.worker.should_stop()`` turns true on every rank once that rank's
own step reaches it. The margin covers the steps made while the reports and the answer travel:
one step plus :data:`STOP_SLACK_S` seconds of the fastest node's rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

#: Seconds of training the stop step leaves for the reports and the answer to travel.
STOP_SLACK_S = 1.0
#: How long the coordinator waits for every node's report before it fixes the step from those it has.
REPORT_TIMEOUT_S = 2.0


class StepRate:
    """The highest step of one node's workers in the current round, and its steps per second."""

    def __init__(self) -> None:
        self.round = -1
        self.step: int | None = None
        self._first: tuple[int, float] | None = None
        self._last_ts = 0.0

    def beat(self, round_: int, step: int, ts: float) -> None:
        """A worker of ``round_`` reached ``step`` at ``ts`` (seconds)."""
        if round_ != self.round:
            self.round, self.step, self._first = round_, None, None
        if self._first is None:
            self._first = (step, ts)
        if self.step is None or step > self.step:
            self.step, self._last_ts = step, ts

    @property
    def rate(self) -> float:
        """Steps per second since the round's first heartbeat (0 before two distinct steps)."""
        if self._first is None or self.step is None or self._last_ts <= self._first[1]:
            return 0.0
        return (self.step - self._first[0]) / (self._last_ts - self._first[1])


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
