"""This node's training progress for the coordinator, from its workers' heartbeats.

Pure: :class:`StepReporter` turns heartbeats into :class:`~hpcelastic.agent.messages.Progress`
messages, few of them: only when the highest step changed, the round's first step at once and then
at most one per :data:`SEND_INTERVAL_S`; :meth:`StepReporter.flush` sends what is held back before the
node reports its workers failed, stopped or done.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from hpcelastic.agent.messages import Progress

#: The least time between two progress messages of one agent (the first of a round is not held back).
SEND_INTERVAL_S = 1.0


class StepReporter:
    """The highest step of this node's workers in the current round, and when to tell the coordinator."""

    def __init__(self, interval: float = SEND_INTERVAL_S, now: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._now = now
        self._reset(-1)

    def _reset(self, round_: int) -> None:
        self.round = round_
        self.step: int | None = None
        self.ts = 0.0
        self.ranks: set[int] = set()
        self._sent_step: int | None = None
        self._sent_at = -math.inf

    def beat(self, round_: int, rank: int, step: int, ts: float) -> Progress | None:
        """Rank ``rank`` of ``round_`` reached ``step`` at ``ts``; the message to send now, if any."""
        if round_ != self.round:
            self._reset(round_)
        self.ranks.add(rank)
        if self.step is None or step > self.step:
            self.step, self.ts = step, ts
        if self.step == self._sent_step:
            return None
        if self._sent_step is not None and self._now() - self._sent_at < self.interval:
            return None
        return self._take()

    def flush(self) -> Progress | None:
        """The step held back by the rate limit, if any (before the round's workers are reported gone)."""
        if self.step is None or self.step == self._sent_step:
            return None
        return self._take()

    def _take(self) -> Progress:
        assert self.step is not None
        self._sent_step, self._sent_at = self.step, self._now()
        return Progress(self.round, self.step, self.ts, len(self.ranks))
