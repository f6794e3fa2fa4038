"""The coordinator's slow-node watch: the detector and the policy of one attempt, glued as the simulated
weeks glue them (hpcelastic/sim/slow.py), with what the coordinator must do as plain data out.

Pure but for holding state: the caller passes the time (the coordinator's wall clock) and carries out
:class:`WatchOut` (record the events, add the excluded nodes to the attempt's bad nodes, retire the
nodes a spare replaces). The swap's cost is measured: the latest round's start to its first step (a
swap restarts the round from the checkpoint just written: its cost is a round's start); before any was
measured, :data:`~hpcelastic.slow.policy.UNMEASURED_SWAP_COST_S`.

A spare is *checked* when it reported a speed check (:class:`~hpcelastic.agent.messages.SpeedCheck`) and
*fast* when that speed is at least :data:`SPARE_FAST_SHARE` of the median the round's nodes reported at
their start; a spare that reported none is unchecked and takes no slow node's place.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from hpcelastic import events
from hpcelastic.agent.messages import SlowSample
from hpcelastic.events import Event
from hpcelastic.slow import policy
from hpcelastic.slow.detector import SlowDetector
from hpcelastic.slow.pace import Judgement, PaceConfig
from hpcelastic.slow.verdict import PaceWindow, SlowKind

#: A checkpoint counts as just written this long after its last file closed (two reports of a node).
CHECKPOINT_FRESH_S = 12.0
#: A spare is fast when its speed check reaches this share of the round nodes' median.
SPARE_FAST_SHARE = 0.85
#: The time lost to running slow is recorded at most this often (and when a slow spell ends).
SLOW_TIME_EVERY_S = 60.0


@dataclass
class WatchOut:
    """What the coordinator does after a tick."""

    events: list[Event] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)  # bad nodes for the next requeue
    retire: list[tuple[str, str]] = field(default_factory=list)  # (node, reason): a spare takes its place


class SlowWatch:
    """One attempt's slow-node detection and decisions (see the module docstring)."""

    def __init__(
        self,
        settings: policy.SlowSettings,
        coordinator_host: str,
        config: PaceConfig | None = None,
        time_left: Callable[[float], float | None] = lambda now: None,
    ):
        self.settings = settings
        #: Seconds from a time to the allocation's end (Slurm's ``SLURM_JOB_END_TIME``); None: unknown.
        self.time_left = time_left
        self.coordinator_host = coordinator_host
        self.detector = SlowDetector(config or PaceConfig())
        self.history = policy.SlowHistory()
        self.attempt = 0
        self.round = -1
        self.nodes: tuple[str, ...] = ()
        self.spares: tuple[str, ...] = ()
        self.round_start: float | None = None
        self.first_step_at: float | None = None
        self.swap_cost_s: float | None = None
        self.speed: dict[str, float] = {}
        self.saving_nodes: set[str] = set()
        self.last_save_end: float | None = None
        self.save_start: float | None = None
        self.verdict_windows: list[PaceWindow] = []
        self.lost_recorded_at: float = -math.inf
        self.lost_told = 0.0
        self.baseline_rate: float | None = None

    # ---- input ---------------------------------------------------------------------------------
    def round_started(
        self,
        attempt: int,
        round_: int,
        now: float,
        world_size: int,
        nodes: tuple[str, ...],
        spares: tuple[str, ...],
    ) -> WatchOut:
        """A new round on ``nodes`` (``spares``: the free spares, in the order they would be taken)."""
        out = WatchOut(self._slow_time_event(now, force=True))
        self.attempt, self.round, self.nodes, self.spares = attempt, round_, nodes, spares
        self.detector.round_started(round_, now, world_size)
        self.round_start, self.first_step_at = now, None
        self.saving_nodes.clear()
        self.save_start = None
        self.verdict_windows, self.lost_told, self.lost_recorded_at = [], 0.0, -math.inf
        return out

    def speed_check(self, node: str, speed: float) -> None:
        """A node's speed check (a fixed CPU workload's rate; higher is faster)."""
        self.speed[node] = speed

    def report(self, node: str, msg: SlowSample, now: float) -> None:
        """A node's :class:`SlowSample`, received at ``now``."""
        if msg.round != self.round:
            return
        self.detector.report(node, msg, now)
        if self.first_step_at is None and any(r.steps for r in msg.ranks) and self.round_start is not None:
            self.first_step_at = now
            self.swap_cost_s = max(0.0, now - self.round_start)
        self._saves(node, msg, now)

    def progress(self, node: str, step: int, ts: float) -> None:
        """A node's heartbeat progress (scripts that call ``heartbeat()``)."""
        self.detector.progress(node, step, ts)

    def _saves(self, node: str, msg: SlowSample, now: float) -> None:
        was_saving = bool(self.saving_nodes)
        if msg.saving:
            self.saving_nodes.add(node)
        else:
            self.saving_nodes.discard(node)
        if self.saving_nodes and not was_saving:
            age = msg.save_age_s or 0.0
            self.save_start = now - age
            self.detector.saving(self.save_start)
        elif was_saving and not self.saving_nodes:
            start = self.save_start if self.save_start is not None else now
            self.detector.saving(start, now)
            self.last_save_end = now
        elif not msg.saving and msg.save_age_s is not None:
            end = now - msg.save_age_s
            if self.last_save_end is None or end > self.last_save_end:
                self.last_save_end = end

    # ---- decisions -----------------------------------------------------------------------------
    def tick(self, now: float) -> WatchOut:
        """Close the windows due, fold them into the history and give the policy's orders."""
        out = WatchOut()
        for closed in self.detector.tick(now).windows:
            if closed.judged.judgement not in (Judgement.HEALTHY, Judgement.SLOW):
                continue
            window, verdict = closed.judged.window, closed.verdict
            if window.baseline_steps_per_s > 0:
                self.baseline_rate = window.baseline_steps_per_s
            verdicts = [verdict] if verdict is not None else []
            if verdict is not None:
                self.verdict_windows.append(window)
            self.history = policy.observe(self.history, window, verdicts, self.settings)
            self._carry_out(self._decide(now, checkpoint_done=False), out)
        if self._checkpoint_just_done(now):
            self._carry_out(self._decide(now, checkpoint_done=True), out)
        out.events += self._slow_time_event(now)
        return out

    def _checkpoint_just_done(self, now: float) -> bool:
        return (
            not self.saving_nodes
            and self.last_save_end is not None
            and now - self.last_save_end <= CHECKPOINT_FRESH_S
        )

    def _decide(self, now: float, checkpoint_done: bool) -> tuple[policy.SlowOrder, ...]:
        orders = policy.decide(self.history, self._job_view(checkpoint_done, now), self.settings)
        self.history = policy.apply(self.history, orders)
        return orders

    def _job_view(self, checkpoint_done: bool, now: float | None = None) -> policy.JobView:
        return policy.JobView(
            nodes=self.nodes,
            allocation_left_s=None if now is None else self.time_left(now),
            spares=tuple(self._spare(s) for s in self.spares[:1]),  # the next spare is the one promoted
            swap_cost_s=self.swap_cost_s,
            checkpoint_done=checkpoint_done,
        )

    def _spare(self, node: str) -> policy.Spare:
        speed, usual = self.speed.get(node), [self.speed[n] for n in self.nodes if n in self.speed]
        if speed is None or not usual:
            return policy.Spare(node)
        return policy.Spare(node, checked=True, fast=speed >= SPARE_FAST_SHARE * statistics.median(usual))

    def _carry_out(self, orders: tuple[policy.SlowOrder, ...], out: WatchOut) -> None:
        for o in orders:
            if o.node is None:
                out.events.append(
                    events.job_slow(attempt=self.attempt, round=self.round, slowdown=o.slowdown, why=o.why)
                )
                continue
            swap = o.order is policy.Order.SWAP
            if swap and o.node == self.coordinator_host:
                continue  # the coordinator's node: replaced at a requeue only (its exclusion came first)
            kind = str(o.kind or SlowKind.COMPUTE)
            out.events.append(
                events.node_slow(
                    attempt=self.attempt,
                    round=self.round,
                    node=o.node,
                    rank=o.rank,
                    kind=kind,
                    slowdown=o.slowdown,
                    action=str(o.order),
                    why=o.why,
                    spare=o.spare,
                )
            )
            if o.order is policy.Order.EXCLUDE:
                out.exclude.append(o.node)
            elif swap:
                out.retire.append((o.node, f"slow ({kind}): {o.why}; spare {o.spare} takes its place"))

    def _slow_time_event(self, now: float, force: bool = False) -> list[Event]:
        """A ``slow_time`` event when the round's lost time grew and one is due."""
        lost = policy.slow_time_s(self.verdict_windows)
        if lost <= self.lost_told + 1e-9 or self.round < 0:
            return []
        if not force and now - self.lost_recorded_at < SLOW_TIME_EVERY_S and self._slow_recently():
            return []
        self.lost_told, self.lost_recorded_at = lost, now
        return [
            events.slow_time(
                attempt=self.attempt, round=self.round, lost_s=lost, baseline_rate=self.baseline_rate
            )
        ]

    def _slow_recently(self) -> bool:
        """The latest judged window was slow (a spell goes on: its total is written when it ends)."""
        return bool(self.history.job.recent and self.history.job.recent[-1])

    def flush(self, now: float) -> list[Event]:
        """The round's last ``slow_time`` (at the attempt's end)."""
        return self._slow_time_event(now, force=True)
