"""The coordinator's slow-node detector: the nodes' reports in, verdicts out. Pure (the caller passes the
time, on the coordinator's wall clock, in seconds).

Feed it :meth:`SlowDetector.round_started` at each round, every node's
:class:`~hpcelastic.agent.messages.SlowSample` (:meth:`~SlowDetector.report`), heartbeat progress where
the script sends it (:meth:`~SlowDetector.progress`: then the pace comes from heartbeats alone) and the
job's checkpoint saves (:meth:`~SlowDetector.saving`); call :meth:`~SlowDetector.tick` now and then. It
returns each closed :class:`~hpcelastic.slow.pace.Judged` window with, for the windows of a sustained drop
below the job's own pace, a :class:`~hpcelastic.slow.verdict.SlowVerdict` from
:func:`~hpcelastic.slow.locate.locate` over that window's collectives.

Clock offsets: a node's reports carry its wall clock when sent; ``received - sent`` is its offset plus
the message's one-way delay, so the least of the recent ones, less half the node's least round trip,
estimates the offset (NTP's minimum-delay filter); arrival times move to the coordinator's clock by it.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from hpcelastic.agent.messages import SlowSample
from hpcelastic.slow import locate as loc
from hpcelastic.slow.pace import Judged, Judgement, Pace, PaceConfig
from hpcelastic.slow.sample import GpuFacts
from hpcelastic.slow.verdict import PaceWindow, SlowVerdict

#: Seconds of collectives kept before the oldest window still to judge (a window is judged up to
#: ``lag_s`` after its end, and a drop's first windows once it is sustained).
KEEP_S = 120.0
#: Offset and round-trip samples kept per node, and healthy windows a rank's baseline lateness is the
#: median of.
OFFSET_SAMPLES = 32
LATENESS_WINDOWS = 12
#: Windows in a row of a job-wide drop after which it is the job's new pace.
REBASELINE_AFTER = 30


@dataclass(frozen=True)
class Closed:
    """A closed window and, in a sustained drop below the job's pace, its verdict."""

    judged: Judged
    verdict: SlowVerdict | None = None


@dataclass(frozen=True)
class Tick:
    """What :meth:`SlowDetector.tick` closed, oldest first."""

    windows: tuple[Closed, ...] = ()

    @property
    def verdicts(self) -> tuple[SlowVerdict, ...]:
        return tuple(c.verdict for c in self.windows if c.verdict is not None)


@dataclass
class _Node:
    offsets: deque[float] = field(default_factory=lambda: deque(maxlen=OFFSET_SAMPLES))
    rtts: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=OFFSET_SAMPLES))

    def offset(self) -> float:
        """Seconds to add to this node's clock to read the coordinator's."""
        if not self.offsets:
            return 0.0
        least_rtt = min((r for _, r in self.rtts), default=0.0)
        return min(self.offsets) - least_rtt / 2


class SlowDetector:
    """Aggregates the nodes' reports of one job; see the module docstring."""

    def __init__(self, config: PaceConfig | None = None) -> None:
        self.pace = Pace(config)
        self._nodes: dict[str, _Node] = {}
        self._node_of: dict[int, str] = {}
        #: (pg, seq) -> rank -> issued (coordinator clock, s).
        self._arrivals: dict[loc.Key, dict[int, float]] = {}
        self._input: dict[int, float] = {}
        self._gpus: dict[int, GpuFacts] = {}
        self._throttled: dict[int, float] = {}
        self._lateness: dict[int, deque[float]] = {}
        self._healthy_rtt: dict[str, deque[float]] = {}
        self._heartbeats = False
        self._job_wide_run = 0
        self.round = -1
        self.world_size = 0

    def round_started(self, round_: int, now: float, world_size: int) -> None:
        """Round ``round_`` started at ``now`` with ``world_size`` ranks (another size: a new baseline)."""
        self.pace.round_started(now, keep_baseline=world_size == self.world_size)
        self._lateness.clear()  # ranks may sit on other nodes now (a spare took a place)
        self.round, self.world_size = round_, world_size
        self._arrivals.clear()
        self._node_of.clear()
        self._input.clear()
        self._gpus.clear()
        self._throttled.clear()
        self._heartbeats = False
        self._job_wide_run = 0

    def report(self, node: str, msg: SlowSample, now: float) -> None:
        """Node ``node``'s report, received at ``now``."""
        if msg.round != self.round:
            return
        info = self._nodes.setdefault(node, _Node())
        info.offsets.append(now - msg.sent_ns / 1e9)
        if msg.rtt_s is not None:
            info.rtts.append((now, msg.rtt_s))
        offset = info.offset()
        for sample in msg.ranks:
            self._node_of[sample.rank] = node
            if sample.step_ns and not self._heartbeats:
                self.pace.sample(sample.rank, sample.step_ns / 1e9 + offset, sample.steps)
            for pg, seq, ns in sample.arrivals:
                self._arrivals.setdefault((pg, seq), {})[sample.rank] = ns / 1e9 + offset
            if sample.input_share is not None:
                self._input[sample.rank] = sample.input_share
            if sample.gpu is not None:
                self._gpus[sample.rank] = sample.gpu
            if sample.cpu_throttled is not None:
                self._throttled[sample.rank] = sample.cpu_throttled

    def progress(self, node: str, step: int, ts: float) -> None:
        """A node's heartbeat progress (its highest step at its wall time ``ts``): from now on the pace's only
        source."""
        if not self._heartbeats:
            self.pace.drop_sources()  # the step clocks' samples: heartbeats alone from now on
            self._heartbeats = True
        self.pace.sample(("heartbeat", node), ts + self._nodes.get(node, _Node()).offset(), step)

    def saving(self, start: float, end: float | None = None) -> None:
        """The job saved a checkpoint from ``start`` to ``end`` (None: still saving)."""
        self.pace.saving(start, end)

    def tick(self, now: float) -> Tick:
        """Close the windows that can be judged by ``now``; verdicts for those of a sustained drop."""
        closed = []
        for judged in self.pace.close(now):
            verdict = None
            if judged.judgement is Judgement.HEALTHY:
                self._learn(judged.window)
                self._job_wide_run = 0
            elif judged.sustained and judged.judgement is Judgement.SLOW:
                verdict = self.locate(judged.window)
                self._job_wide_run = self._job_wide_run + 1 if verdict.node is None else 0
            closed.append(Closed(judged, verdict))
        if self._job_wide_run >= REBASELINE_AFTER:
            self.pace.rebaseline()
            self._job_wide_run = 0
        self._forget(now)
        return Tick(tuple(closed))

    def evidence(self, window: PaceWindow) -> loc.Evidence:
        """What :func:`~hpcelastic.slow.locate.locate` gets for ``window``: the collectives issued in it."""
        arrivals = {
            key: times
            for key, times in self._arrivals.items()
            if window.start <= statistics.median(times.values()) < window.end
        }
        return loc.Evidence(
            arrivals=arrivals,
            node_of=dict(self._node_of),
            baseline_lateness={r: statistics.median(v) for r, v in self._lateness.items() if v},
            rtt=self._rtt(window.start, window.end),
            baseline_rtt={n: statistics.median(v) for n, v in self._healthy_rtt.items() if v},
            input_share=dict(self._input),
            gpus=dict(self._gpus),
            cpu_throttled=dict(self._throttled),
        )

    def locate(self, window: PaceWindow) -> SlowVerdict:
        """Who holds ``window`` back, by the evidence held now."""
        return loc.locate(self.evidence(window), window)

    def _learn(self, window: PaceWindow) -> None:
        """A healthy window: its per-rank lateness and round trips are the usual ones."""
        ev = self.evidence(window)
        for rank, late in loc.rank_lateness(ev.arrivals).items():
            self._lateness.setdefault(rank, deque(maxlen=LATENESS_WINDOWS)).append(late)
        for node, rtt in ev.rtt.items():
            self._healthy_rtt.setdefault(node, deque(maxlen=LATENESS_WINDOWS)).append(rtt)

    def _rtt(self, start: float, end: float) -> dict[str, float]:
        """Each node's median round trip reported in ``[start, end)`` (its latest before, if none)."""
        out = {}
        for node, info in self._nodes.items():
            inside = [r for t, r in info.rtts if start <= t < end]
            before = [r for t, r in info.rtts if t < start]
            if inside or before:
                out[node] = statistics.median(inside) if inside else before[-1]
        return out

    def _forget(self, now: float) -> None:
        horizon = now - KEEP_S
        for key in [k for k, times in self._arrivals.items() if max(times.values()) < horizon]:
            del self._arrivals[key]
