"""Simulated weeks with slow nodes: the real slow-node policy (:mod:`hpcelastic.slow.policy`) and the real
detector's pace (:class:`~hpcelastic.slow.detector.SlowDetector`: windows, baseline, sustained drops, saves,
warm-up, rebaseline), driven through a model of one job's steps.

Pure and seeded (``python -m hpcelastic.sim.slow --seed N -v``). A week is one job of 2-64 nodes and 0-3 hot
spares on a partition a little larger, over allocations that end at their time limit (a requeue: the
policy's exclusions cooled down and capped as the requeue policy does lost nodes), until its work is done.
Slow nodes: persistent (to the week's end), transient (20 s to 10 h) and flapping (on and off for 30 min to
10 h), at 30-95 % of their speed, compute, network or input, on any node of the partition (spares too).
Noise: healthy nodes differ by up to 14 % (the slowest sets the job's pace), the step times jitter (per-rank
jitter up to 15 %: the pace's samples land early or late), workload stripes (a rank given more data every
k-th step: the job slower in some segments), slow first steps after every start, checkpoint saves of 15 s
to 10 min (no steps meanwhile; the detector told of them in most weeks, not in the others), and the machine
under load on all nodes alike.

The detector's ``locate`` is modelled (generating every rank's collectives for 10,000 weeks costs too much;
``tests/unit/test_slow_locate.py`` measures the real one): a slow window names the job's slowest node when
its own slowdown explains :data:`~hpcelastic.slow.locate.EXPLAIN` of the window's loss, except with the
week's miss probability (then ``job-wide``); any other slow window is ``job-wide``, except with the week's
misattribution probability, when it names a random node of the round with no measured share (the detector's
target is the right node in 19 of 20 trials: up to 5 %). :mod:`hpcelastic.sim.slow_invariants` checks the
invariants as the week runs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from hpcelastic.lifecycle.history import node_cooldown_s
from hpcelastic.lifecycle.policy import Capacity, capped_exclusion
from hpcelastic.sim.slow_invariants import SlowChecker, Violation, summary
from hpcelastic.slow import policy as real_policy
from hpcelastic.slow.detector import SlowDetector
from hpcelastic.slow.locate import EXPLAIN
from hpcelastic.slow.pace import Judgement, PaceConfig
from hpcelastic.slow.policy import JobView, Order, SlowAction, SlowHistory, SlowOrder, SlowSettings, Spare
from hpcelastic.slow.verdict import PaceWindow, SlowKind, SlowVerdict

WEEK_S = 7 * 86400.0
#: The modelled locate names no node whose own slowdown is below this (the rank jitter's floor).
NAME_FLOOR = 0.05
#: A node that ran at this share of its speed or less in an allocation was slow there (not healthy).
HEALTHY_SPEED = 0.9
#: ``slow_handled`` covers a node costing the job this share of its pace ...
HANDLE_SLOWDOWN = 0.3
#: ... for this long (or the bound, when the detector's windows make it longer), as long as the detector's
#: baseline is the job's healthy pace (within this share) when it starts: to a pace whose baseline was
#: learned while the node was slow (or that has none yet) the node's pace is the job's own, not a drop.
HANDLE_S = 600.0
VISIBLE = 0.85
#: A baseline below this share of the healthy pace holds a slow node already (above it: the pace's own noise).
BASELINE_HOLDS_SLOW = 0.95
#: A swap must be made when the time it saves is this many times its cost ...
SWAP_PAYS = 2.0
#: ... once the slowdown has cost the swap this many times over (its measured slowdown is noisy).
COST_MARGIN = 1.25
NODE_COUNTS = (2, 4, 8, 16, 32, 64)
NODE_WEIGHTS = (20, 25, 25, 15, 10, 5)
KINDS = (SlowKind.COMPUTE, SlowKind.NETWORK, SlowKind.INPUT)
PERSISTENT, TRANSIENT, FLAPPING = "persistent", "transient", "flapping"
SOURCE = "job"  # the pace's one step source: the job's steps, as a rank's step clock reports them
#: Segments of truth kept for the windows still to close (the pace closes a window up to lag_s after it).
KEEP_SEGMENTS = 64

Policy = SimpleNamespace  # observe, decide, apply, to_exclude, slow_time_s: the policy module's functions


def real() -> Policy:
    """The tree's policy, as the simulation calls it (tests swap one function for a broken one)."""
    names = ("observe", "decide", "apply", "to_exclude", "slow_time_s")
    return SimpleNamespace(**{n: getattr(real_policy, n) for n in names})


def report_bound_s(settings: SlowSettings, config: PaceConfig) -> float:
    """How soon a node slow by 30 % or more must be reported, in time the pace judges (saves not counted):
    10 minutes, or when the windows are long, twice the windows the pace (a sustained drop) and the policy
    need, the first partly slow window and the pace's lag."""
    needed = config.consecutive + settings.windows + 1
    return max(HANDLE_S, (2 * needed + 1) * config.window_s + config.lag_s)


def swap_bound_s(report_bound: float, cost_s: float, slowdown: float) -> float:
    """How soon after its start a slowdown has cost a swap, as the policy measures it (ski rental)."""
    return report_bound + COST_MARGIN * cost_s / slowdown


@dataclass(frozen=True)
class Episode:
    """A node at ``speed`` of its own: persistent, transient, or flapping (``on_s`` on, ``off_s`` off)."""

    node: str
    start: float
    end: float
    speed: float
    kind: SlowKind
    shape: str
    on_s: float = 0.0
    off_s: float = 0.0

    def active(self, t: float) -> bool:
        if not self.start <= t < self.end:
            return False
        return self.shape != FLAPPING or (t - self.start) % (self.on_s + self.off_s) < self.on_s


@dataclass(frozen=True)
class Load:
    """The machine under load: every node at ``factor`` of its speed."""

    start: float
    end: float
    factor: float


@dataclass(frozen=True)
class SlowWeek:
    """Everything a seed fixes about one week."""

    seed: int
    nodes: int
    spares: int
    partition: tuple[str, ...]
    static: dict[str, float]  # each node's healthy speed (0.86-1)
    settings: SlowSettings
    window_s: float  # the pace's window, and the model's segment (a step sample each)
    step_s: float
    episodes: tuple[Episode, ...]
    loads: tuple[Load, ...]
    jitter: float  # per-rank step jitter: a sample's time is off by up to this share of a step
    p_miss: float  # the detector says job-wide instead of naming the slow node
    p_mis: float  # the detector names a random node for a job-wide slowdown
    stripe_p: float  # a segment is slower for the workload's stripe (few steps: the heavy ones weigh)
    first_segments: int
    first_factor: float
    ckpt_every_s: float
    save_mean_s: float
    saves_known: bool  # the detector is told of the saves (their windows are not judged)
    swap_cost_s: float
    measured_cost_s: float
    time_limit_s: float
    startup_s: float
    work_s: float
    check_delay_s: float
    unchecked_p: float  # a spare never checked in an allocation
    horizon_s: float = WEEK_S  # the simulated time (a week; shorter in the unit tests)

    def replay(self) -> str:
        days = "" if self.horizon_s == WEEK_S else f" --days {self.horizon_s / 86400:g}"
        return f"python -m hpcelastic.sim.slow --seed {self.seed}{days} -v"

    @property
    def segment_s(self) -> float:
        return self.window_s

    @property
    def pace(self) -> PaceConfig:
        return PaceConfig(window_s=self.window_s)


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _episode(rng: random.Random, node: str, horizon_s: float) -> Episode:
    shape = rng.choices((PERSISTENT, TRANSIENT, FLAPPING), (3, 4.5, 2.5))[0]
    start = rng.uniform(0, horizon_s)
    speed = rng.choice((0.5, 0.7, 0.85, rng.uniform(0.3, 0.95)))
    kind = rng.choice(KINDS)
    if shape == PERSISTENT:
        return Episode(node, start, math.inf, speed, kind, shape)
    if shape == TRANSIENT:
        return Episode(node, start, start + _log_uniform(rng, 20, 36000), speed, kind, shape)
    on, off = rng.uniform(20, 300), rng.uniform(20, 1200)
    return Episode(node, start, start + _log_uniform(rng, 1800, 36000), speed, kind, shape, on, off)


def draw_week(seed: int, days: float = 7.0) -> SlowWeek:
    """The week of ``seed`` (``days`` long: its slowdowns and loads in that time, the job's work scaled)."""
    rng = random.Random(seed)
    horizon = days * 86400
    n = rng.choices(NODE_COUNTS, NODE_WEIGHTS)[0]
    spares = rng.choice((0, 1, 1, 2, 3))
    partition = tuple(f"n{i:03d}" for i in range(n + spares + rng.choice((0, 1, 2, max(1, n // 4)))))
    settings = SlowSettings(
        action=rng.choice((SlowAction.SWAP, SlowAction.SWAP, SlowAction.SWAP, SlowAction.EXCLUDE)),
        min_slowdown=rng.choice((0.2, 0.2, 0.25)),
        windows=rng.choice((5, 5, 6, 8)),
    )
    if rng.random() < 0.1:
        settings = replace(settings, action=SlowAction.REPORT)
    loads = []
    for _ in range(rng.choice((0, 0, 1, 3))):
        start = rng.uniform(0, horizon)
        loads.append(Load(start, start + _log_uniform(rng, 600, 36000), rng.uniform(0.6, 0.92)))
    cost = rng.uniform(30, 600)
    return SlowWeek(
        seed=seed,
        nodes=n,
        spares=spares,
        partition=partition,
        static={p: rng.uniform(0.86, 1.0) for p in partition},
        settings=settings,
        window_s=rng.choice((10.0, 10.0, 20.0, 30.0)),
        step_s=rng.uniform(0.1, 1.0),
        episodes=tuple(
            _episode(rng, rng.choice(partition), horizon) for _ in range(rng.choice((0, 1, 1, 2, 3, 5)))
        ),
        loads=tuple(loads),
        jitter=rng.uniform(0.0, 0.15),
        p_miss=rng.choice((0.0, 0.01, 0.03)),
        p_mis=rng.choice((0.0, 0.02, 0.05)),
        stripe_p=rng.choice((0.0, 0.02, 0.05)),
        first_segments=rng.choice((1, 2, 4)),
        first_factor=rng.uniform(0.2, 0.7),
        ckpt_every_s=rng.uniform(600, 3 * 3600),
        save_mean_s=rng.choice((15.0, 60.0, 180.0, 600.0)),
        saves_known=rng.random() < 0.7,
        swap_cost_s=cost,
        measured_cost_s=cost * rng.uniform(0.8, 1.25),
        time_limit_s=rng.choice((4 * 3600.0, 12 * 3600.0, 24 * 3600.0, 48 * 3600.0)),
        startup_s=rng.uniform(60, 600),
        work_s=rng.uniform(1.0, 6.0) * horizon / 7,
        check_delay_s=rng.choice((0.0, 120.0, 900.0)),
        unchecked_p=0.1,
        horizon_s=horizon,
    )


@dataclass
class Run:
    """The slowest round node, costing the job HANDLE_SLOWDOWN or more of its pace since ``since``;
    ``judged_s``: the time since then outside saves (what the pace judges)."""

    node: str
    since: float
    slowdown: float
    visible: bool  # the detector's baseline was the job's healthy pace when it started
    judged_s: float = 0.0
    reported_checked: bool = False


@dataclass(frozen=True)
class Segment:
    """The truth of one segment: when, the job's pace (a share of the healthy one), its slowest round node and
    that node's own pace, and the round's steps at its start and end."""

    start: float
    end: float
    ratio: float
    slowest: tuple[str, float] | None
    steps_before: float
    steps: float


@dataclass
class Allocation:
    """One allocation of the job: its nodes, the detector, the policy's history, the invariants' books."""

    start: float
    end: float
    round: list[str]
    spares: tuple[str, ...]
    free_spares: list[str]
    check_at: dict[str, float]
    detector: SlowDetector
    history: SlowHistory = field(default_factory=SlowHistory)
    swaps: int = 0
    rounds: int = 0
    runs: dict[str, Run] = field(default_factory=dict)
    must_exclude: set[str] = field(default_factory=set)
    verdict_windows: list[PaceWindow] = field(default_factory=list)
    counted_until: float = -math.inf
    model_s: float = 0.0  # the true slow time over the seconds the ledger counts
    error_s: float = 0.0  # the detector's measurement error over those seconds
    ledger_s: float = 0.0
    round_start: float = 0.0
    base: float = 1.0  # the round's healthy pace: its slowest node's static speed
    steps: float = 0.0  # the round's steps so far (the pace's source counts from the round's start)
    sampled: int = 0
    sampled_at: float = -math.inf
    truth: deque[Segment] = field(default_factory=lambda: deque(maxlen=KEEP_SEGMENTS))


@dataclass
class WeekStats:
    """What the bench counts, per week."""

    reports: int = 0
    false_reports: int = 0  # a report naming a node with no slowdown of its own lately
    job_wide_reports: int = 0
    swaps: int = 0
    exclusions: int = 0
    #: (a visible run's slowdown, seconds from its start to the report, or the swap)
    report_delays: list[tuple[float, float]] = field(default_factory=list)
    swap_delays: list[tuple[float, float]] = field(default_factory=list)
    invisible_runs: int = 0  # runs the pace could not see (its baseline was already slow)
    windows: int = 0
    ledger_s: float = 0.0
    model_s: float = 0.0
    true_slow_s: float = 0.0  # all the time the job lost to slow nodes, loads, stripes (not saves, starts)


@dataclass
class SlowWeekResult:
    week: SlowWeek
    violations: list[Violation]
    stats: WeekStats
    allocations: int
    work_done: float


class ModelDetector(SlowDetector):
    """The real detector with its ``locate`` modelled (see the module docstring)."""

    def __init__(self, sim: SlowSim, config: PaceConfig) -> None:
        super().__init__(config)
        self.sim = sim

    def locate(self, window: PaceWindow) -> SlowVerdict:
        return self.sim.model_verdict(window)


class SlowSim:
    """One week: allocations of segments; the detector judges windows, the policy decides after each."""

    def __init__(self, week: SlowWeek, policy: Policy | None = None) -> None:
        self.week = week
        self.policy = policy or real()
        self.rng = random.Random(week.seed * 7919 + 17)
        self.checker = SlowChecker()
        self.stats = WeekStats()
        self.t = 0.0
        self.work_left = week.work_s
        self.failures: dict[str, tuple[int, float]] = {}  # node -> (exclusions, last)
        self.excluded: tuple[str, ...] = ()
        self.allocations = 0
        self.by_node: dict[str, list[Episode]] = {}
        for e in week.episodes:
            self.by_node.setdefault(e.node, []).append(e)
        self.report_bound = report_bound_s(week.settings, week.pace)
        self.alloc = Allocation(0.0, 0.0, [], (), [], {}, ModelDetector(self, week.pace))
        self.save: tuple[float, float] | None = None
        self.next_ckpt = math.inf
        self.calm_since = math.inf  # since when every segment ran at the healthy pace, without a save
        self.stripe_due = False  # the calm-stretch skip stopped at a stripe's segment

    # ---- the truth ----------------------------------------------------------------------------------------
    def speed(self, node: str, t: float) -> float:
        """``node``'s speed at ``t`` as a share of its own healthy speed."""
        episodes = self.by_node.get(node)
        return min((e.speed for e in episodes if e.active(t)), default=1.0) if episodes else 1.0

    def healthy(self, node: str, since: float | None = None) -> bool:
        """No slowdown of its own since ``since`` (the allocation's start) until now."""
        start = self.alloc.start if since is None else since
        return not any(
            e.speed <= HEALTHY_SPEED and e.start < self.t and e.end > start
            for e in self.by_node.get(node, ())
        )

    def checked(self, spare: str) -> bool:
        return self.t >= self.alloc.check_at.get(spare, math.inf)

    def fast(self, spare: str) -> bool:
        return self.speed(spare, self.t) > HEALTHY_SPEED

    def spare_view(self, spare: str) -> Spare:
        """What the coordinator knows of a spare: checked or not, and if so whether it is at full speed."""
        checked = self.checked(spare)
        return Spare(spare, checked, checked and self.fast(spare))

    def reported(self, node: str) -> bool:
        ev = self.alloc.history.nodes.get(node)
        return ev is not None and (ev.reported or ev.flap_reported or ev.qualified_at is not None)

    def left_s(self) -> float:
        return min(self.alloc.end - self.t, self.work_left)

    def load(self, t: float) -> float:
        return math.prod(load.factor for load in self.week.loads if load.start <= t < load.end)

    def slowest(self, t: float) -> tuple[str, float] | None:
        """The round node slowest at ``t`` by its own slowdown, and its pace as a share of the job's healthy
        pace; None when no round node is slow."""
        alloc = self.alloc
        best: tuple[str, float] | None = None
        for node in alloc.round:
            if node in self.by_node:
                pace = self.week.static[node] * self.speed(node, t) / alloc.base
                if pace < 1.0 and (best is None or pace < best[1]):
                    best = (node, pace)
        return best

    def swap_due(self, run: Run) -> bool:
        """``slow_handled``'s swap clause: the run cost a swap, a fit spare is free and it clearly pays."""
        w = self.week
        if w.settings.action is not SlowAction.SWAP or not run.visible or run.node not in self.alloc.round:
            return False
        if run.judged_s < swap_bound_s(self.report_bound, w.measured_cost_s, run.slowdown):
            return False
        fit = [s for s in self.alloc.free_spares if self.checked(s) and self.fast(s) and self.healthy(s)]
        pays = run.slowdown * (self.left_s() - w.measured_cost_s) > SWAP_PAYS * w.measured_cost_s
        slow = [n for n in self.alloc.round if self.speed(n, self.t) <= HEALTHY_SPEED]
        return bool(fit) and pays and len(slow) <= real_policy.SHARED_CAUSE_SHARE * len(self.alloc.round)

    # ---- the week -----------------------------------------------------------------------------------------
    def run(self) -> SlowWeekResult:
        while self.t < self.week.horizon_s and self.work_left > 0:
            self.allocation()
            self.t += self.rng.uniform(60, 3600)  # queued again
        return SlowWeekResult(
            self.week,
            self.checker.violations,
            self.stats,
            self.allocations,
            1 - max(0.0, self.work_left) / self.week.work_s,
        )

    def allocate(self) -> Allocation:
        w = self.week
        needed = w.nodes + w.spares
        order = list(w.partition)
        self.rng.shuffle(order)
        picked = [n for n in order if n not in self.excluded][:needed]
        picked += [n for n in order if n not in picked][: needed - len(picked)]
        spares = tuple(picked[w.nodes :])
        ready = self.t + w.startup_s + w.check_delay_s
        check_at = {s: math.inf if self.rng.random() < w.unchecked_p else ready for s in spares}
        detector = ModelDetector(self, w.pace)
        return Allocation(
            self.t, self.t + w.time_limit_s, picked[: w.nodes], spares, list(spares), check_at, detector
        )

    def allocation(self) -> None:
        w = self.week
        self.allocations += 1
        self.alloc = alloc = self.allocate()
        self.t = alloc.start + w.startup_s
        self.start_round()
        self.save, self.next_ckpt = None, self.t + w.ckpt_every_s
        while self.t < min(alloc.end, w.horizon_s) and self.work_left > 0:
            self.skip_calm()
            self.segment()
        self.end_allocation()

    def end_allocation(self) -> None:
        alloc = self.alloc
        for run in alloc.runs.values():
            self.run_ended(run)
        alloc.ledger_s = self.policy.slow_time_s(alloc.verdict_windows)
        self.stats.ledger_s += alloc.ledger_s
        self.stats.model_s += alloc.model_s
        slow = tuple(self.policy.to_exclude(alloc.history))
        self.checker.at_allocation_end(self, slow)
        self.stats.exclusions += len(slow)
        for node in slow:
            count, _ = self.failures.get(node, (0, 0.0))
            self.failures[node] = (count + 1, self.t)
        # The next allocation's exclusions: the requeue policy's cooldown and cap, as for lost nodes.
        cooling = sorted(
            (last, n) for n, (count, last) in self.failures.items() if self.t < last + node_cooldown_s(count)
        )
        capacity = Capacity(frozenset(self.week.partition), self.week.nodes + self.week.spares)
        self.excluded = capped_exclusion(tuple(n for _, n in cooling), capacity)

    def start_round(self) -> None:
        alloc = self.alloc
        alloc.round_start = self.t
        alloc.base = min(self.week.static[n] for n in alloc.round)
        alloc.steps, alloc.sampled, alloc.sampled_at = 0.0, 0, -math.inf
        alloc.truth.clear()
        for run in alloc.runs.values():
            self.run_ended(run)
        alloc.runs = {}
        alloc.rounds += 1
        alloc.detector.round_started(alloc.rounds, self.t, self.week.nodes)
        self.calm_since = math.inf

    # ---- one segment: the truth, a step sample, the windows the pace closes -------------------------------
    def segment(self) -> None:
        w, alloc = self.week, self.alloc
        t0 = self.t
        t1 = t0 + w.segment_s
        if self.save is None and t0 >= self.next_ckpt:
            self.save = (t0, t0 + w.save_mean_s * self.rng.lognormvariate(0.0, 0.5))
            if w.saves_known:
                alloc.detector.saving(self.save[0], None)
        slowest = self.slowest((t0 + t1) / 2)
        r, running = self.segment_ratio(t0, t1, slowest)
        self.work_left -= w.segment_s * r
        self.stats.true_slow_s += w.segment_s * (1 - running)
        rate = r * alloc.base / w.step_s
        before, alloc.steps = alloc.steps, alloc.steps + rate * w.segment_s
        alloc.truth.append(Segment(t0, t1, r, slowest, before, alloc.steps))
        self.sample(t1, rate)
        self.t = t1
        saving, done = self.save is not None, self.save is not None and self.save[1] <= t1
        if done and self.save is not None:
            if w.saves_known:
                alloc.detector.saving(*self.save)
            self.next_ckpt = self.save[1] + w.ckpt_every_s
            self.save = None
        calm = r == 1.0 and not saving
        self.calm_since = min(self.calm_since, t0) if calm else math.inf
        self.track_runs(t1, slowest, judged=not saving)  # a save makes no steps to judge by, told of or not
        for closed in alloc.detector.tick(t1).windows:
            if closed.judged.judgement in (Judgement.HEALTHY, Judgement.SLOW):
                self.window(closed.judged.window, closed.verdict)
        if done:
            self.decide(checkpoint_done=True)
            self.checker.at_checkpoint(self)

    def segment_ratio(self, t0: float, t1: float, slowest: tuple[str, float] | None) -> tuple[float, float]:
        """The job's true pace over [t0, t1) as a share of its healthy pace, and the share it ran at (that
        pace but for its first steps and saves: what slow nodes, loads and stripes cost)."""
        w, mid = self.week, (t0 + t1) / 2
        running = (slowest[1] if slowest else 1.0) * self.load(mid)
        stripe = self.stripe_due or self.rng.random() < w.stripe_p
        self.stripe_due = False
        if stripe:
            running *= 1 - self.rng.uniform(0.05, 0.35)
        r = running
        if t0 < self.alloc.round_start + w.first_segments * w.segment_s:
            r *= w.first_factor
        if self.save:
            r *= 1 - max(0.0, min(t1, self.save[1]) - max(t0, self.save[0])) / (t1 - t0)
        return r, running

    def sample(self, t: float, rate: float) -> None:
        """The step source's report: its last whole step and when it ended, off by the ranks' jitter."""
        alloc = self.alloc
        whole = math.floor(alloc.steps)
        if whole <= alloc.sampled or rate <= 0:
            return
        at = t - (alloc.steps - whole) / rate + self.rng.uniform(-1, 1) * self.week.jitter * self.week.step_s
        if at > alloc.sampled_at:
            alloc.detector.pace.sample(SOURCE, at, whole)
            alloc.sampled, alloc.sampled_at = whole, at

    def steps_at(self, t: float) -> float:
        """The round's true steps at ``t``, from the segments kept (steady within each)."""
        truth = self.alloc.truth
        if not truth or t <= truth[0].start:
            return truth[0].steps_before if truth else 0.0
        for s in truth:
            if t <= s.end:
                return s.steps_before + (s.steps - s.steps_before) * (t - s.start) / (s.end - s.start)
        return truth[-1].steps

    def middle(self, start: float, end: float) -> Segment | None:
        """The kept segment in the middle of [start, end)."""
        mid = (start + end) / 2
        return next((s for s in self.alloc.truth if s.end >= mid), None)

    def model_verdict(self, window: PaceWindow) -> SlowVerdict:
        """The modelled ``locate`` of a slow window (see the module docstring)."""
        w, alloc = self.week, self.alloc
        middle = self.middle(window.start, window.end)
        loss = max(0.0, 1.0 - window.ratio)
        if middle is not None and middle.slowest is not None:
            node, pace = middle.slowest
            own = 1.0 - pace
            if own >= max(NAME_FLOOR, EXPLAIN * loss) and self.rng.random() >= w.p_miss:
                mid = (middle.start + middle.end) / 2
                kind = next((e.kind for e in self.by_node[node] if e.active(mid)), SlowKind.COMPUTE)
                rank = alloc.round.index(node) * 8
                detail = f"rank {rank} last, {own:.0%} of the pace"
                measured = own * self.rng.uniform(0.9, 1.1)
                return SlowVerdict(window, kind, node, rank, detail, own_slowdown=measured)
        if self.rng.random() < w.p_mis:
            node = self.rng.choice(alloc.round)
            return SlowVerdict(window, self.rng.choice(KINDS), node, 0, "misattributed")
        return SlowVerdict(window, SlowKind.JOB_WIDE)

    # ---- the policy -------------------------------------------------------------------------------------
    def job_view(self, checkpoint_done: bool) -> JobView:
        alloc = self.alloc
        return JobView(
            nodes=tuple(alloc.round),
            spares=tuple(self.spare_view(s) for s in alloc.free_spares),
            swap_cost_s=self.week.measured_cost_s,
            allocation_left_s=alloc.end - self.t,
            job_left_s=self.work_left,
            checkpoint_done=checkpoint_done,
        )

    def window(self, window: PaceWindow, verdict: SlowVerdict | None) -> None:
        """A window the pace judged (healthy, or slow with a verdict in a sustained drop): the policy acts."""
        alloc = self.alloc
        self.stats.windows += 1
        verdicts = [verdict] if verdict is not None else []
        if verdict is not None:
            self.count(window)
        alloc.history = self.policy.observe(alloc.history, window, verdicts, self.week.settings)
        self.decide(checkpoint_done=False)
        self.checker.after_window(self)

    def decide(self, checkpoint_done: bool) -> None:
        alloc = self.alloc
        orders = tuple(self.policy.decide(alloc.history, self.job_view(checkpoint_done), self.week.settings))
        alloc.history = self.policy.apply(alloc.history, orders)
        self.carry_out(orders)

    def count(self, window: PaceWindow) -> None:
        """The model's side of ``slow_time_adds_up``: the truth over the seconds the ledger counts, against
        the same baseline, and the measurement's error there."""
        alloc = self.alloc
        alloc.verdict_windows.append(window)
        fresh = max(0.0, window.end - max(window.start, alloc.counted_until))
        alloc.counted_until = max(alloc.counted_until, window.end)
        if fresh <= 0 or window.baseline_steps_per_s <= 0:
            return
        steps = self.steps_at(window.end) - self.steps_at(window.start)
        true_ratio = steps / (window.end - window.start) / window.baseline_steps_per_s
        alloc.model_s += fresh * max(0.0, 1.0 - true_ratio)
        alloc.error_s += fresh * abs(max(0.0, 1.0 - true_ratio) - max(0.0, 1.0 - window.ratio))

    def carry_out(self, orders: Sequence[SlowOrder]) -> None:
        alloc = self.alloc
        for o in orders:
            if o.order is Order.REPORT:
                self.reported_order(o)
            elif o.order is Order.EXCLUDE and o.node is not None:
                self.checker.acted(self, o.node, "exclusion")
            elif o.order is Order.SWAP and o.node is not None and o.spare is not None:
                self.checker.acted(self, o.node, "swap")
                self.checker.swapped(self, o.node, o.spare)
                run = alloc.runs.get(o.node)
                if run is not None and run.visible:
                    self.stats.swap_delays.append((run.slowdown, self.t - run.since))
                if o.spare in alloc.free_spares:
                    alloc.free_spares.remove(o.spare)
                alloc.round[alloc.round.index(o.node)] = o.spare
                alloc.swaps += 1
                self.stats.swaps += 1
        if any(o.order is Order.SWAP for o in orders):
            self.t += self.week.swap_cost_s  # the restart from the checkpoint that just completed
            self.start_round()

    def reported_order(self, o: SlowOrder) -> None:
        if o.node is None:
            self.stats.job_wide_reports += 1
            return
        self.stats.reports += 1
        if self.healthy(o.node, since=self.t - self.report_bound):
            self.stats.false_reports += 1
        run = self.alloc.runs.get(o.node)
        if run is not None and run.visible:
            self.stats.report_delays.append((run.slowdown, self.t - run.since))

    # ---- runs of HANDLE_SLOWDOWN (slow_handled) ----------------------------------------------------------
    def track_runs(self, t: float, slowest: tuple[str, float] | None, judged: bool) -> None:
        alloc, w = self.alloc, self.week
        if not alloc.runs and (slowest is None or 1 - slowest[1] < HANDLE_SLOWDOWN):
            return  # no run to end, none can start (held below only lowers a cost): the baseline is not read
        healthy, unloaded = alloc.base * self.load(t) / w.step_s, alloc.base / w.step_s
        baseline = alloc.detector.pace.baseline
        # What the node costs the job's pace: its speed against the baseline the detector judges by (a node
        # at 70 % beside another at 86 % that the baseline already holds costs the job 18 %, not 30 %; a
        # job-wide load is not the node's). No baseline yet: nothing is judged, no run.
        held = unloaded / baseline if 0 < baseline < BASELINE_HOLDS_SLOW * unloaded else 1.0
        cost = 1 - slowest[1] * held if slowest and baseline > 0 else 0.0
        node = slowest[0] if slowest and cost >= HANDLE_SLOWDOWN else None
        for other in [n for n in alloc.runs if n != node]:
            self.run_ended(alloc.runs.pop(other))
        if node is None or slowest is None:
            return
        run = alloc.runs.get(node)
        if run is None:
            visible = baseline >= VISIBLE * healthy
            run = alloc.runs[node] = Run(node, t - w.segment_s, cost, visible)
            self.stats.invisible_runs += not visible
        run.slowdown = min(run.slowdown, cost)
        run.judged_s += w.segment_s if judged else 0.0

    def run_ended(self, run: Run) -> None:
        """A run that lasted until it had cost a swap must end in the node's exclusion (action >= exclude)."""
        w = self.week
        if not w.settings.action.allows(SlowAction.EXCLUDE) or not run.visible:
            return
        if run.judged_s >= swap_bound_s(self.report_bound, w.measured_cost_s, run.slowdown):
            self.alloc.must_exclude.add(run.node)

    # ---- calm stretches ----------------------------------------------------------------------------------
    def skip_calm(self) -> None:
        """Jump over segments in which nothing can happen: no slow node, load, save or stripe, every window
        the pace still holds healthy, and a policy history with nothing open or recent (more healthy windows
        would change nothing). The pace starts its windows afresh after the jump, keeping its baseline."""
        w, alloc = self.week, self.alloc
        settle = w.window_s + w.pace.lag_s + 2 * w.segment_s
        if self.save is not None or self.t - self.calm_since < settle or not _quiescent(alloc.history):
            return
        horizon = min(alloc.end, w.horizon_s, self.next_ckpt, self.t + self.work_left)
        for e in (e for n in alloc.round for e in self.by_node.get(n, ())):
            if e.start < horizon and e.end > self.t:
                horizon = min(horizon, max(self.t, e.start))
        for load in w.loads:
            if load.start < horizon and load.end > self.t:
                horizon = min(horizon, max(self.t, load.start))
        segments = int((horizon - self.t) // w.segment_s) - 2
        if segments <= 0:
            return
        calm = min(segments, self.calm_segments())
        if calm <= 0:
            return
        self.t += calm * w.segment_s
        self.work_left -= calm * w.segment_s
        self.stats.windows += int(calm * w.segment_s / w.window_s)
        alloc.steps += calm * w.segment_s * alloc.base / w.step_s
        alloc.truth.clear()
        alloc.sampled, alloc.sampled_at = 0, -math.inf
        alloc.detector.round_started(alloc.rounds, self.t, w.nodes)  # same round: the baseline stays
        self.stripe_due = calm < segments

    def calm_segments(self) -> int:
        """How many segments pass before a stripe's heavy steps, drawn geometrically."""
        p = self.week.stripe_p
        if p <= 0:
            return sys.maxsize
        return int(math.log(1 - self.rng.random()) / math.log(1 - p))


def _quiescent(history: SlowHistory) -> bool:
    """Nothing open or recent: more windows without verdicts change no decision."""
    evidence = [history.job_wide, history.job, *history.nodes.values()]
    return all(not ev.open and not any(ev.recent) for ev in evidence)


def run_week(seed: int, policy: Policy | None = None, days: float = 7.0) -> SlowWeekResult:
    """Week ``seed`` (``days`` long), with ``policy`` (the tree's by default)."""
    return SlowSim(draw_week(seed, days), policy).run()


def run_weeks(first: int, count: int, days: float = 7.0) -> list[SlowWeekResult]:
    return [run_week(seed, days=days) for seed in range(first, first + count)]


def as_json(r: SlowWeekResult) -> dict[str, Any]:
    s, w = r.stats, r.week
    return {
        "seed": w.seed,
        "nodes": w.nodes,
        "spares": w.spares,
        "action": str(w.settings.action),
        "allocations": r.allocations,
        "work_done": round(r.work_done, 4),
        "windows": s.windows,
        "reports": s.reports,
        "false_reports": s.false_reports,
        "job_wide_reports": s.job_wide_reports,
        "swaps": s.swaps,
        "exclusions": s.exclusions,
        "invisible_runs": s.invisible_runs,
        "report_delays": [[round(a, 3), round(b, 1)] for a, b in s.report_delays],
        "swap_delays": [[round(a, 3), round(b, 1)] for a, b in s.swap_delays],
        "ledger_s": round(s.ledger_s, 1),
        "model_s": round(s.model_s, 1),
        "true_slow_s": round(s.true_slow_s, 1),
        "episodes": len(w.episodes),
        "violations": sorted({v.invariant for v in r.violations}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcelastic.sim.slow", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="the (first) week's seed")
    p.add_argument("--weeks", type=int, default=1, help="how many weeks, seeds SEED, SEED+1, ...")
    p.add_argument("--days", type=float, default=7.0, help="each week's length in days")
    p.add_argument("--json", action="store_true", help="one JSON object per week on stdout")
    p.add_argument("--verbose", "-v", action="store_true", help="the week's draw and figures")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    results = run_weeks(a.seed, a.weeks, a.days)
    violations = [v for r in results for v in r.violations]
    for r in results:
        if a.json:
            print(json.dumps(as_json(r)))
        elif a.verbose:
            print(r.week)
            print(json.dumps(as_json(r)))
    for v in violations[:20]:
        print(v, file=sys.stderr)
    if not a.json:
        took = time.perf_counter() - t0
        print(f"{a.weeks} weeks in {took:.1f} s; violations: {json.dumps(summary(violations))}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
