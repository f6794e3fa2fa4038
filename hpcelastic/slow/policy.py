"""What to do about a slow node: a pure decision over the detector's verdicts (no I/O, no clock).

The ladder (site key ``slow.action``, each level doing what the one before does):

- ``report``: an event when a node (or the job as a whole) has been slow over several windows;
- ``exclude``: also exclude the node at the next requeue, on the evidence a swap needs (below), the way
  a lost node is excluded (``attempt_ended.bad_nodes``: the same cooldown and the same cap, so an
  exclusion never leaves the partition too small for the job: :func:`~hpcelastic.lifecycle.policy.
  capped_exclusion`);
- ``swap``: also put a hot spare in its place at the next checkpoint, when that pays.

Evidence, per node named by the detector (never a ``job-wide`` verdict). A window counts against a node
only when its verdict names the node and the job ran at least ``slow.min_slowdown`` below its pace.
A slowdown *opens* once the node is named in ``slow.windows`` of the last ``slow.windows`` + 1 windows
(one may be missed; one bad window never is enough) and *closes* after ``slow.windows`` windows in a row
without it. The time it costs is counted each second once (windows may overlap): the window's length
times (1 - rate / baseline), :func:`lost_s`, the ledger's measure too (:func:`slow_time_s`).

A node *qualifies* for an action (swap, exclusion) when its open slowdown has cost at least one swap
(ski rental: pay rent until the rent paid equals the price, so a slowdown that ends by itself costs at
most twice what the best choice in hindsight would have), or, for a node flapping too fast to stay open,
when it is slow now and its recent losses (halved every :data:`FLAP_HALF_LIFE_S`) reach
:data:`FLAP_COST_FACTOR` swaps and at least half of the job's recent slow time. Nothing is acted on when
more than half of the job's nodes are slow at once (a cause they share, as with nodes lost together).
A swap happens only right after a checkpoint completed, when the expected gain (the slowdown times the
time left: what the job would lose by keeping the node) exceeds the swap's measured cost, with a spare
that was checked and found fast, one spare per swap.

Defaults (:mod:`hpcelastic.sites`): ``slow.min_slowdown`` 0.2: healthy GPUs of one cluster differ by up
to 14 % (Meta PRISM) and a rank's steps jitter by up to 15 %; 20 % is above both, and below it a swap
rarely repays its cost. ``slow.windows`` 5: five windows named (of six) against a detector that names
the wrong node in one window of 20 (a random one of two nodes) happens by chance about once in 10^7
windows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hpcelastic import sites
from hpcelastic.errors import UserError
from hpcelastic.reasons import Named
from hpcelastic.slow.verdict import PaceWindow, SlowKind, SlowVerdict

SECTION = "slow"
#: A flapping node's losses count half after this long: a slowdown of an hour ago weighs little now.
FLAP_HALF_LIFE_S = 1800.0
#: A node flapping too fast for a slowdown to stay open is acted on once its recent losses reach this many
#: swaps ("really costs": three swaps' worth within about an hour, not one bad spell).
FLAP_COST_FACTOR = 3.0
#: More than this share of the job's nodes slow at once is a shared cause: no node is acted on.
SHARED_CAUSE_SHARE = 0.5
#: A flapping node must explain at least this share of the job's recent slow time.
FLAP_SHARE = 0.5
#: The cost of a swap assumed before one was measured (a restart from the checkpoint, conservatively).
UNMEASURED_SWAP_COST_S = 600.0


def key(name: str) -> str:
    """The schema key of setting ``name``: ``windows`` -> ``slow.windows``."""
    return f"{SECTION}.{name}"


class SlowAction(Named):
    """The ``slow.action`` ladder: each level also does what the ones before it do (``off``: no detection)."""

    OFF = "off"
    REPORT = "report"
    EXCLUDE = "exclude"
    SWAP = "swap"

    def allows(self, other: SlowAction) -> bool:
        """This level does what ``other`` does."""
        return _LADDER[self] >= _LADDER[other]


_LADDER = {a: i for i, a in enumerate(SlowAction)}


@dataclass(frozen=True)
class SlowSettings:
    """The site keys ``slow.*`` (one place for their defaults and limits: :data:`hpcelastic.sites.SCHEMA`)."""

    action: SlowAction = SlowAction(sites.default(key("action")))
    min_slowdown: float = sites.default(key("min_slowdown"))
    windows: int = sites.default(key("windows"))

    @classmethod
    def parse(cls, action: str, min_slowdown: float, windows: int) -> SlowSettings:
        """Checked settings (from flags); a bad value is a one-line :class:`UserError` naming its flag."""
        given = {key("action"): action, key("min_slowdown"): min_slowdown, key("windows"): windows}
        sites.validate(sites.unflatten(given), sites.COMMAND_LINE)
        return cls(SlowAction(action), float(min_slowdown), windows)

    @classmethod
    def from_config(cls, get: Callable[[str], Any]) -> SlowSettings:
        """From a resolved configuration's ``get`` (its values were checked when it was resolved)."""
        return cls(SlowAction(get(key("action"))), float(get(key("min_slowdown"))), int(get(key("windows"))))

    @property
    def on(self) -> bool:
        """Slow-node detection runs (any action but ``off``)."""
        return self.action is not SlowAction.OFF

    def to_text(self) -> str:
        """``ACTION,MIN_SLOWDOWN,WINDOWS``: the agent's ``--slow`` (``swap,0.2,5``)."""
        return f"{self.action},{self.min_slowdown:g},{self.windows}"

    @classmethod
    def from_text(cls, text: str) -> SlowSettings:
        """The settings :meth:`to_text` wrote; a bad one is a one-line :class:`UserError`."""
        parts = text.split(",")
        try:
            action, min_slowdown, windows = parts[0], float(parts[1]), int(parts[2])
        except (IndexError, ValueError):
            raise UserError(f"--slow {text!r}: expected ACTION,MIN_SLOWDOWN,WINDOWS (swap,0.2,5)") from None
        return cls.parse(action, min_slowdown, windows)


# ---- lost time ------------------------------------------------------------------------------------------


def fresh_s(window: PaceWindow, counted_until: float) -> float:
    """The seconds of ``window`` after ``counted_until`` (those an earlier, overlapping window left)."""
    return max(0.0, window.end - max(window.start, counted_until))


def lost_s(window: PaceWindow, counted_until: float = -math.inf) -> float:
    """Job seconds lost to running slow in ``window`` (its seconds after ``counted_until``):
    time x (1 - rate / baseline rate), never negative."""
    return fresh_s(window, counted_until) * max(0.0, 1.0 - window.ratio)


def slow_time_s(windows: Iterable[PaceWindow]) -> float:
    """The time lost to running slow over ``windows`` (the windows of the detector's verdicts, in any order,
    repeated or overlapping): each second counted once, at the ratio of the latest window covering it."""
    total, until = 0.0, -math.inf
    for w in sorted(set(windows), key=lambda w: (w.end, w.start)):
        total += lost_s(w, until)
        until = max(until, w.end)
    return total


# ---- the evidence ---------------------------------------------------------------------------------------


def _decayed(value: float, at: float, now: float) -> float:
    return value * 0.5 ** (max(0.0, now - at) / FLAP_HALF_LIFE_S)


@dataclass(frozen=True)
class Evidence:
    """What the windows so far say about one node (or, for ``SlowHistory.job_wide``, the job as a whole)."""

    recent: tuple[bool, ...] = ()  # the last ``windows`` + 1 windows, newest last: named slow or not
    misses: int = 0  # windows in a row not naming it (counted up to ``windows``)
    open: bool = False  # a slowdown is open (see the module docstring)
    since: float | None = None  # start of the first window of the current run of named windows
    run_lost_s: float = 0.0  # seconds lost in that run (each second once)
    run_slow_s: float = 0.0  # seconds that run covered (its mean slowdown: run_lost_s / run_slow_s)
    counted_until: float = -math.inf
    decayed_lost_s: float = 0.0  # lost seconds, halved every FLAP_HALF_LIFE_S, as of ``decayed_at``
    decayed_at: float = 0.0
    first_at: float | None = None  # start of the first window naming it (``flap_rate``)
    kind: SlowKind | None = None  # the latest verdict's
    rank: int | None = None
    detail: str = ""
    # What was ordered on this evidence (kept by :func:`apply`):
    reported: bool = False  # the open slowdown was reported
    flap_reported: bool = False
    qualified_at: float | None = None  # when it first had the evidence for an action, in this allocation
    excluded: bool = False
    swapped: bool = False

    @property
    def slowdown(self) -> float:
        """The mean slowdown of the current run of named windows (0 when none)."""
        return self.run_lost_s / self.run_slow_s if self.run_slow_s > 0 else 0.0

    def decayed(self, now: float) -> float:
        return _decayed(self.decayed_lost_s, self.decayed_at, now)

    def seen(
        self, window: PaceWindow, slowdown: float | None, windows: int, verdict: SlowVerdict | None = None
    ) -> Evidence:
        """This evidence after one more window that names it, charging it ``slowdown``, or not (None)."""
        named = slowdown is not None
        if not named and self.misses >= windows and not any(self.recent):
            return self  # nothing recent, nothing open: one more quiet window changes nothing
        recent = (*self.recent, named)[-(windows + 1) :]
        if not named:
            if self.misses >= windows:
                return self.evolve(recent=recent)
            if self.misses + 1 >= windows:  # the slowdown is over: a later one starts afresh
                return _EMPTY.evolve(recent=recent, misses=windows, **self._kept())
            return self.evolve(recent=recent, misses=self.misses + 1)
        fresh = fresh_s(window, self.counted_until)
        lost = fresh * (slowdown or 0.0)
        now = window.end
        return self.evolve(
            recent=recent,
            misses=0,
            open=self.open or (sum(recent) >= windows),
            since=window.start if self.since is None else self.since,
            run_lost_s=self.run_lost_s + lost,
            run_slow_s=self.run_slow_s + fresh,
            counted_until=max(self.counted_until, window.end),
            decayed_lost_s=self.decayed(now) + lost,
            decayed_at=now,
            first_at=window.start if self.first_at is None else self.first_at,
            kind=verdict.kind if verdict else self.kind,
            rank=verdict.rank if verdict else self.rank,
            detail=verdict.detail if verdict else self.detail,
        )

    def evolve(self, **changes: Any) -> Evidence:
        """A copy with ``changes`` (``dataclasses.replace`` without its checks: this runs every window)."""
        new = object.__new__(Evidence)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    def _kept(self) -> dict[str, Any]:
        """What outlives a closed slowdown: the decayed losses and the orders of this allocation."""
        return {
            "counted_until": self.counted_until,
            "decayed_lost_s": self.decayed_lost_s,
            "decayed_at": self.decayed_at,
            "first_at": self.first_at,
            "flap_reported": self.flap_reported,
            "qualified_at": self.qualified_at,
            "excluded": self.excluded,
            "swapped": self.swapped,
        }


_EMPTY = Evidence()


@dataclass(frozen=True)
class SlowHistory:
    """The verdicts of one allocation, folded window by window (:func:`observe`); a new allocation starts
    afresh (a requeue excludes what the last one found: :func:`to_exclude`)."""

    nodes: Mapping[str, Evidence] = field(default_factory=dict)
    job_wide: Evidence = Evidence()  # windows slow with no node named
    job: Evidence = Evidence()  # every slow window (named or not): the job's recent slow time
    now: float = 0.0  # the end of the latest window
    windows: int = 0  # windows seen


def observe(
    history: SlowHistory, window: PaceWindow, verdicts: Sequence[SlowVerdict], settings: SlowSettings
) -> SlowHistory:
    """``history`` after one more detection window and its verdicts (none: the job kept its pace).

    Call it for every window the pace judged (healthy or slow), in the order they end; a window it did
    not judge (the round's warm-up, a checkpoint save) is neither evidence nor its absence: leave it out.
    A verdict counts against its node only when the node costs the job at least ``settings.min_slowdown``
    of its pace (:attr:`SlowVerdict.slowdown`: its own share when the detector measured it); a
    ``job-wide`` verdict never names a node.
    """
    w = settings.windows
    job_slow = [v for v in verdicts if 1.0 - v.window.ratio >= settings.min_slowdown]
    named = {
        v.node: v
        for v in job_slow
        if v.node and v.kind is not SlowKind.JOB_WIDE and v.slowdown >= settings.min_slowdown
    }
    nodes: dict[str, Evidence] = {}
    for node in {*history.nodes, *named}:
        v = named.get(node)
        ev = history.nodes.get(node, _EMPTY)
        ev = ev.seen(v.window, v.slowdown, w, v) if v else ev.seen(window, None, w)
        if not _forgotten(ev, window.end):
            nodes[node] = ev
    unnamed = job_slow[0] if job_slow and not named else None
    slowest = min(job_slow, key=lambda v: v.window.ratio) if job_slow else None
    return SlowHistory(
        nodes=nodes,
        job_wide=_seen_job(history.job_wide, window, unnamed, w),
        job=_seen_job(history.job, window, slowest, w),
        now=max(history.now, window.end),
        windows=history.windows + 1,
    )


def _seen_job(ev: Evidence, window: PaceWindow, verdict: SlowVerdict | None, windows: int) -> Evidence:
    """The job's evidence after ``window``: the whole window's slowdown when ``verdict`` says it was slow."""
    if verdict is None:
        return ev.seen(window, None, windows)
    return ev.seen(verdict.window, max(0.0, 1.0 - verdict.window.ratio), windows, verdict)


def _forgotten(ev: Evidence, now: float) -> bool:
    """Nothing left to know about the node: no slowdown open or recent, no order given."""
    idle = not any(ev.recent) and not ev.open and ev.decayed(now) < 1.0
    return idle and ev.qualified_at is None and not (ev.flap_reported or ev.excluded or ev.swapped)


# ---- the decision ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spare:
    """A hot spare as the coordinator knows it: whether it was checked, and found at full speed."""

    node: str
    checked: bool = False
    fast: bool = False


@dataclass(frozen=True)
class JobView:
    """The job as it is when the policy decides."""

    nodes: tuple[str, ...]  # the round's nodes
    spares: tuple[Spare, ...] = ()  # the free hot spares, in the order they would be taken
    swap_cost_s: float | None = None  # a swap's measured cost (a restart from a checkpoint); None: unknown
    allocation_left_s: float | None = None  # until the allocation's time limit; None: no limit known
    job_left_s: float | None = None  # the job's remaining work at its healthy pace; None: unknown
    checkpoint_done: bool = False  # a checkpoint just completed: the moment a swap costs least

    @property
    def cost_s(self) -> float:
        return UNMEASURED_SWAP_COST_S if self.swap_cost_s is None else max(0.0, self.swap_cost_s)

    @property
    def left_s(self) -> float:
        """The time the job has left to run (the sooner of its allocation's end and its work's)."""
        known = [t for t in (self.allocation_left_s, self.job_left_s) if t is not None]
        return min(known) if known else math.inf


class Order(Named):
    """What the coordinator is told to do."""

    REPORT = "report"  # an event (node None: the job is slow as a whole)
    EXCLUDE = "exclude"  # add the node to the attempt's bad nodes: excluded at the next requeue
    SWAP = "swap"  # restart now with ``spare`` in the node's place


@dataclass(frozen=True)
class SlowOrder:
    """One order: what, on which node (None: the job), why, and for a swap the spare that takes its place.
    ``slowdown``: the share of the job's pace the node costs (for a flapping one, on average lately)."""

    order: Order
    node: str | None
    kind: SlowKind | None
    slowdown: float
    why: str
    spare: str | None = None
    rank: int | None = None


def _flapping(ev: Evidence, history: SlowHistory, cost: float) -> bool:
    """Slow now, too briefly each time to stay open, and costing three swaps and most of the job's slow time
    of the last hour or so."""
    if not ev.recent or not ev.recent[-1]:
        return False
    mine, job = ev.decayed(history.now), history.job.decayed(history.now)
    return mine >= FLAP_COST_FACTOR * cost and mine >= FLAP_SHARE * job


def flap_rate(ev: Evidence, now: float) -> float:
    """A flapping node's recent loss rate (seconds lost a second): its decayed losses over the decayed time
    since it was first named (at most their whole horizon, ``FLAP_HALF_LIFE_S / ln 2``): a node that cost
    the job 80 % of its pace for the minute it was watched costs 80 %, not 1 % of an hour's horizon."""
    span = 0.0 if ev.first_at is None else max(0.0, now - ev.first_at)
    horizon = FLAP_HALF_LIFE_S / math.log(2) * (1.0 - 0.5 ** (span / FLAP_HALF_LIFE_S))
    return ev.decayed(now) / horizon if horizon > 0 else 0.0


def qualifies(ev: Evidence, history: SlowHistory, cost: float) -> bool:
    """The evidence for an action: an open slowdown that cost a swap, or a flapping one costing three."""
    return (ev.open and ev.run_lost_s >= cost) or _flapping(ev, history, cost)


def decide(history: SlowHistory, job: JobView, settings: SlowSettings) -> tuple[SlowOrder, ...]:
    """The orders now (none: nothing to do), by the rules of the module docstring; :func:`apply` records
    them in the history so that none is given twice."""
    jw = history.job_wide
    if not settings.on:
        return ()
    if not (jw.open and not jw.reported) and not any(_actionable(ev) for ev in history.nodes.values()):
        return ()
    cost, now = job.cost_s, history.now
    orders: list[SlowOrder] = []
    if jw.open and not jw.reported:
        why = f"the job runs {jw.slowdown:.0%} below its pace and no node stands out"
        orders.append(SlowOrder(Order.REPORT, None, SlowKind.JOB_WIDE, jw.slowdown, _with(why, jw)))
    members = set(job.nodes)
    evidence = {  # only a node open or named in the latest window can be acted on
        n: ev for n, ev in sorted(history.nodes.items()) if n in members and _actionable(ev)
    }
    flapping = {n for n, ev in evidence.items() if not ev.open and _flapping(ev, history, cost)}
    for node, ev in evidence.items():
        if ev.open and not ev.reported:
            since = now if ev.since is None else ev.since
            why = f"slow for {_span(now - since)}: it costs the job {ev.slowdown:.0%} of its pace"
            orders.append(SlowOrder(Order.REPORT, node, ev.kind, ev.slowdown, _with(why, ev), rank=ev.rank))
        elif node in flapping and not ev.flap_reported:
            rate = flap_rate(ev, now)
            why = f"flapping: it cost the job {ev.decayed(now):.0f} s lately ({rate:.0%} of its pace)"
            orders.append(SlowOrder(Order.REPORT, node, ev.kind, rate, _with(why, ev), rank=ev.rank))
    if not settings.action.allows(SlowAction.EXCLUDE):
        return tuple(orders)
    slow_now = [n for n, ev in evidence.items() if ev.open or n in flapping]
    if len(slow_now) > SHARED_CAUSE_SHARE * len(job.nodes):
        return tuple(orders)  # most nodes at once: a cause they share, not theirs
    ready = {n: ev for n, ev in evidence.items() if qualifies(ev, history, cost)}
    for node, ev in ready.items():
        if not ev.excluded:
            why = (
                f"it cost the job {ev.run_lost_s if ev.open else ev.decayed(now):.0f} s, a swap {cost:.0f} s"
            )
            orders.append(SlowOrder(Order.EXCLUDE, node, ev.kind, _slowdown(ev, now), why, rank=ev.rank))
    if not (settings.action.allows(SlowAction.SWAP) and job.checkpoint_done):
        return tuple(orders)
    gains = {n: _slowdown(ev, now) * job.left_s for n, ev in ready.items()}
    spares = [s for s in job.spares if s.checked and s.fast and not _was_slow(history, s.node)]
    for node in sorted((n for n in ready if gains[n] > cost), key=lambda n: -gains[n])[: len(spares)]:
        ev, spare = ready[node], spares.pop(0)
        gain = "the time left unknown (no limit)" if math.isinf(gains[node]) else f"gain {_span(gains[node])}"
        why = f"{gain} at {_slowdown(ev, now):.0%} of the pace, a swap costs {_span(cost)}"
        orders.append(
            SlowOrder(Order.SWAP, node, ev.kind, _slowdown(ev, now), why, spare=spare.node, rank=ev.rank)
        )
    return tuple(orders)


def _actionable(ev: Evidence) -> bool:
    """Open, or named in the latest window (flapping), and still in the round."""
    return not ev.swapped and (ev.open or bool(ev.recent and ev.recent[-1]))


def _slowdown(ev: Evidence, now: float) -> float:
    """The share of the job's pace the node is expected to keep costing."""
    return max(ev.slowdown if ev.open else 0.0, flap_rate(ev, now))


def _was_slow(history: SlowHistory, node: str) -> bool:
    ev = history.nodes.get(node)
    return ev is not None and (ev.open or ev.qualified_at is not None)


def _with(why: str, ev: Evidence) -> str:
    return f"{why} ({ev.detail})" if ev.detail else why


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def apply(history: SlowHistory, orders: Sequence[SlowOrder]) -> SlowHistory:
    """``history`` with ``orders`` given (reported, excluded, swapped), so that none is given twice."""
    if not orders:
        return history
    nodes = dict(history.nodes)
    job_wide = history.job_wide
    for o in orders:
        if o.node is None:
            job_wide = replace(job_wide, reported=True)
            continue
        ev = nodes[o.node]
        if o.order is Order.REPORT:
            ev = replace(ev, reported=True) if ev.open else replace(ev, flap_reported=True)
        else:
            at = history.now if ev.qualified_at is None else ev.qualified_at
            ev = replace(ev, qualified_at=at)
            ev = replace(ev, excluded=True) if o.order is Order.EXCLUDE else replace(ev, swapped=True)
        nodes[o.node] = ev
    return replace(history, nodes=nodes, job_wide=job_wide)


def step(
    history: SlowHistory,
    window: PaceWindow,
    verdicts: Sequence[SlowVerdict],
    job: JobView,
    settings: SlowSettings,
) -> tuple[SlowHistory, tuple[SlowOrder, ...]]:
    """One window end to end: :func:`observe`, :func:`decide`, :func:`apply`."""
    history = observe(history, window, verdicts, settings)
    orders = decide(history, job, settings)
    return apply(history, orders), orders


def to_exclude(history: SlowHistory) -> tuple[str, ...]:
    """The nodes ordered excluded in this allocation, first evidence first: the attempt's bad nodes for
    slowness (the requeue policy caps and cools them down as it does lost nodes)."""
    done = [(ev.qualified_at or 0.0, n) for n, ev in history.nodes.items() if ev.excluded]
    return tuple(n for _, n in sorted(done))
