"""The job's pace: its step rate per window, its own recent healthy rate, and a sustained drop below it.

Pure. Sources report cumulative step counts with the wall time of their last step (:meth:`Pace.sample`):
a rank's step clock or arrivals file (``tier/step_clock.py``, ``slow/arrivals.py``), or a node's
heartbeats (``hpcelastic.worker.heartbeat``) where the script sends them. A source's steps between two
reports are interpolated linearly, so a window's rate is exact for fast steps and the best estimate for
steps longer than a window; each rate uses one source's own clock, so clock skew between nodes does not
enter. The window's rate is the median over the sources that cover it.

The baseline is the median of the last :attr:`PaceConfig.baseline_windows` healthy windows. A window
does not count toward it, and is not judged, while the round warms up (before its
:attr:`PaceConfig.warmup_steps`-th step: the first steps compile, load and allocate) or when it overlaps a
checkpoint save the detector was told of. A window below :attr:`PaceConfig.slow_ratio` of the baseline is
slow; :attr:`PaceConfig.consecutive` slow windows in a row are a sustained drop (a save in between neither
breaks nor extends the run); the time such a window lost is ``policy.lost_s``. Slow windows never enter
the baseline; :meth:`Pace.rebaseline` accepts the current pace as the new normal (the detector's call,
for a job-wide change that stays).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from hpcelastic.reasons import Named
from hpcelastic.slow.verdict import PaceWindow


@dataclass(frozen=True)
class PaceConfig:
    """The pace's thresholds (defaults: a 50 % node is judged within about 40 s of its start)."""

    window_s: float = 10.0
    #: A window below this share of the baseline is slow.
    slow_ratio: float = 0.9
    #: Slow windows in a row that make a sustained drop.
    consecutive: int = 3
    #: Healthy windows the baseline is the median of, and the fewest it needs.
    baseline_windows: int = 12
    min_baseline: int = 3
    #: Steps of a round not judged (nor counted toward the baseline).
    warmup_steps: int = 5
    #: How long after its end a window waits for every source's report.
    lag_s: float = 12.0
    #: How long after its end a window is judged at the earliest: its collectives reach the detector with
    #: the ranks' next dump (``slow/arrivals.py``, every ~5 s) and their node's next report.
    settle_s: float = 8.0


class Judgement(Named):
    """What a closed window is to the pace."""

    WARMUP = "warmup"  # the round's first steps, or no baseline yet
    SAVE = "save"  # overlaps a checkpoint save
    HEALTHY = "healthy"
    SLOW = "slow"


@dataclass(frozen=True)
class Judged:
    """A closed window, how it was judged, and whether it belongs to a sustained drop."""

    window: PaceWindow
    judgement: Judgement
    sustained: bool = False


class _Source:
    """One source's step events ``(t, steps)``, in time order."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.steps: list[int] = []

    def add(self, t: float, steps: int) -> None:
        if self.steps and (steps <= self.steps[-1] or t <= self.times[-1]):
            return  # nothing new (or a clock step backwards: ignored)
        self.times.append(t)
        self.steps.append(steps)

    def at(self, t: float) -> float | None:
        """Steps at ``t``, interpolated; None outside the events seen."""
        i = bisect.bisect_left(self.times, t)
        if i < len(self.times) and self.times[i] == t:
            return float(self.steps[i])
        if i == 0 or i == len(self.times):
            return None
        t0, t1, s0, s1 = self.times[i - 1], self.times[i], self.steps[i - 1], self.steps[i]
        return s0 + (s1 - s0) * (t - t0) / (t1 - t0)

    def covers(self, t: float) -> bool:
        return bool(self.times) and self.times[-1] >= t

    def forget_before(self, t: float) -> None:
        """Drop events no window will need (keeps one before ``t``)."""
        cut = max(0, bisect.bisect_left(self.times, t) - 1)
        del self.times[:cut], self.steps[:cut]


class Pace:
    """The job's pace over consecutive windows of one round; the baseline may outlive the round."""

    def __init__(self, config: PaceConfig | None = None) -> None:
        self.config = config or PaceConfig()
        self._healthy: deque[float] = deque(maxlen=self.config.baseline_windows)
        self._saves: list[tuple[float, float | None]] = []
        self.round_started(0.0)

    def round_started(self, now: float, keep_baseline: bool = True) -> None:
        """A new round at ``now``: its workers count steps from scratch; the baseline stays unless the job's
        shape changed (``keep_baseline`` False: another world size)."""
        self._sources: dict[Hashable, _Source] = {}
        self._next_start: float | None = None
        self._warm_at: float | None = None
        self._round_start = now
        self._run: list[Judged] = []
        self._sustained = False
        if not keep_baseline:
            self._healthy.clear()

    @property
    def baseline(self) -> float:
        """The job's healthy steps per second (0: not known yet)."""
        if len(self._healthy) < self.config.min_baseline:
            return 0.0
        return statistics.median(self._healthy)

    def sample(self, source: Hashable, t: float, steps: int) -> None:
        """Source ``source`` had taken ``steps`` steps of this round, the last at wall time ``t``."""
        if t < self._round_start:
            return
        src = self._sources.setdefault(source, _Source())
        src.add(t, steps)
        if self._warm_at is None and steps >= self.config.warmup_steps:
            self._warm_at = t
        if self._next_start is None and src.times:
            self._next_start = src.times[0]

    def drop_sources(self) -> None:
        """Forget every source's samples (the detector switches to another kind of source)."""
        self._sources.clear()

    def saving(self, start: float, end: float | None = None) -> None:
        """A checkpoint save from ``start`` to ``end`` (None: still going)."""
        if self._saves and self._saves[-1][1] is None and end is not None and start <= self._saves[-1][0]:
            self._saves[-1] = (self._saves[-1][0], end)
        else:
            self._saves.append((start, end))
        del self._saves[:-16]

    def rebaseline(self) -> None:
        """Accept the current pace as healthy: the baseline is rebuilt from the next windows."""
        self._healthy.clear()
        self._run, self._sustained = [], False

    def close(self, now: float) -> list[Judged]:
        """Every window that can be judged by ``now``, oldest first."""
        out: list[Judged] = []
        cfg = self.config
        while self._next_start is not None:
            start = self._next_start
            end = start + cfg.window_s
            covering = [s for s in self._sources.values() if s.covers(end)]
            if not covering or now < end + cfg.settle_s:
                break
            if len(covering) < len(self._sources) and now < end + cfg.lag_s:
                break
            rates = []
            for src in covering:
                a, b = src.at(start), src.at(end)
                if a is not None and b is not None:
                    rates.append((b - a) / cfg.window_s)
            self._next_start = end
            if rates:
                out += self._judge(PaceWindow(start, end, statistics.median(rates), self.baseline))
        for src in self._sources.values():
            if self._next_start is not None:
                src.forget_before(self._next_start)
        return out

    def _judge(self, window: PaceWindow) -> list[Judged]:
        """Judge ``window``; slow windows (and saves among them) are held until their run is sustained or
        broken, so each window is handed out once, in order."""
        cfg = self.config
        warm = self._warm_at is not None and window.start >= self._warm_at
        if self._overlaps_save(window):
            judged = Judged(window, Judgement.SAVE)
            return self._hold(judged) if self._run else [judged]
        if not warm or window.baseline_steps_per_s <= 0:
            if warm:
                self._healthy.append(window.steps_per_s)
            return [Judged(window, Judgement.WARMUP)]
        if window.ratio >= cfg.slow_ratio:
            self._healthy.append(window.steps_per_s)
            held = [] if self._sustained else self._run
            self._run, self._sustained = [], False
            return [*held, Judged(window, Judgement.HEALTHY)]
        return self._hold(Judged(window, Judgement.SLOW))

    def _hold(self, judged: Judged) -> list[Judged]:
        """Add to the current run; the run's windows once it holds enough slow ones, then each at once."""
        if self._sustained:
            return [Judged(judged.window, judged.judgement, sustained=True)]
        self._run.append(judged)
        if sum(j.judgement is Judgement.SLOW for j in self._run) < self.config.consecutive:
            return []
        self._sustained = True
        return [Judged(j.window, j.judgement, sustained=True) for j in self._run]

    def _overlaps_save(self, window: PaceWindow) -> bool:
        return any(s < window.end and (e is None or e > window.start) for s, e in self._saves)
