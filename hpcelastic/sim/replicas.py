"""Simulated weeks with torchft replica groups: the real :class:`~hpcelastic.agent.replicas.ReplicaJobState`,
the real requeue policy and the real replica ledger (:mod:`hpcelastic.record.replica_lanes`), driven through
a model of one job's groups, nodes and workers.

Pure and seeded (``python -m hpcelastic.sim.replicas --seed N -v``). A week is one job of 2-8 replica groups
of 1-4 nodes, 0-2 hot spares, ``--min-replica-groups`` 1 to all, on a partition a little larger, over attempts
that end at their time limit, a preemption, the coordinator's loss or the job-wide path's end, each followed
by the real policy's decision (:mod:`hpcelastic.sim.adapter`). Group-level faults, at a node-day rate drawn
per week: a rank fails (a GPU fault leaves its node unhealthy in a third of them), a node dies (its agent and
workers at once; DOWN in Slurm after SlurmdTimeout, back after a repair), a node's link is cut (its workers
run on until its agent's lease ends: the fence's case; a cut shorter than the detection bound costs nothing),
a switch cuts several consecutive nodes off at once (a partition), a group's link to torchft's lighthouse is
cut (the group's quorum blocks, and fails after torchft's quorum timeout when the cut lasts longer), the
coordinator's node dies or is cut off. The job steps while any group steps; a restarted group steps again once
it healed from a live peer. :mod:`hpcelastic.sim.replica_invariants` checks the invariants as the week runs.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpcelastic.agent import messages
from hpcelastic.agent.job_state import Record
from hpcelastic.agent.replicas import ReplicaJobState
from hpcelastic.agent.stop_step import REPORT_TIMEOUT_S
from hpcelastic.record import ledger
from hpcelastic.sim import adapter, model
from hpcelastic.sim.adapter import EndFacts, Reason
from hpcelastic.sim.invariants import Violation, summary
from hpcelastic.sim.model import DETECTION_S
from hpcelastic.sim.replica_invariants import ReplicaChecker

WEEK_S = model.WEEK_S
DAY_S = model.DAY_S
GROUPS = (2, 3, 4, 8)
PER_GROUP = (1, 2, 4)
#: Workers per node (the ranks of a group are its nodes' workers).
NPROC = 8
#: torchft's quorum timeout: a group cut from its lighthouse for longer fails after it.
QUORUM_TIMEOUT_S = 60.0
#: From a round's assignment to its workers spawned (the agents' part).
SPAWN_S = 10.0
#: How long an agent takes to kill its workers at most (``RESTART_KILL_GRACE``).
KILL_S = 3.0
#: The coordinator ticks every 0.1 s; the week ticks (and a stepping group reports its step) this often.
TICK_S = 300.0
#: The fault kinds and their weights (Llama 3's taxonomy, grouped by how a replica job sees them).
RANK, NODE, CUT, PARTITION = "rank", "node", "cut", "partition"
LIGHTHOUSE, COORDINATOR = "lighthouse", "coordinator"
FAULT_WEIGHTS = {RANK: 52.0, NODE: 12.0, CUT: 12.0, PARTITION: 6.0, LIGHTHOUSE: 12.0, COORDINATOR: 6.0}
#: The coordinator's methods that deliver an agent's report (its node rank first); the others are its own.
AGENT_REPORTS = frozenset(
    (
        "join",
        "left",
        "started_workers",
        "worker_failed",
        "workers_stopped",
        "workers_done",
        "progress",
        "step_report",
    )
)
ERRORS = {
    RANK: "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    LIGHTHOUSE: "RuntimeError: torchft quorum timed out: lighthouse unreachable",
}


@dataclass(frozen=True)
class ReplicaWeek:
    """Everything a seed fixes about one simulated week with replica groups."""

    seed: int
    groups: int
    per_group: int
    spares: int
    min_groups: int
    partition: int
    max_restarts: int
    max_requeues: int
    step_s: float
    ckpt_every: int
    total_steps: int
    startup_s: float
    restart_s: float
    time_limit_s: float
    signal_lead_s: float
    preempt_per_day: float
    faults_per_node_day: float

    @property
    def nodes(self) -> int:
        return self.groups * self.per_group

    def replay(self) -> str:
        return f"python -m hpcelastic.sim.replicas --seed {self.seed} -v"


def draw(seed: int) -> ReplicaWeek:
    """The week of ``seed``."""
    rng = random.Random(seed * 7919 + 3)
    groups = rng.choice(GROUPS)
    per_group = rng.choice(PER_GROUP)
    spares = rng.choice((0, 0, 1, 2))
    nodes = groups * per_group
    step_s = rng.uniform(0.5, 6.0)
    return ReplicaWeek(
        seed=seed,
        groups=groups,
        per_group=per_group,
        spares=spares,
        min_groups=rng.choice((1, 1, max(1, groups // 2), groups)),
        partition=nodes + spares + rng.choice((1, 2, max(2, nodes // 4), nodes)),
        max_restarts=rng.choice((3, 3, 0, 10)),
        max_requeues=rng.choice((5, 5, 3, 10)),
        step_s=step_s,
        ckpt_every=max(1, round(rng.uniform(900, 3 * 3600) / step_s)),
        total_steps=round(rng.uniform(1.0, 6.0) * DAY_S / step_s),
        startup_s=rng.uniform(60, 600),
        restart_s=rng.uniform(20, 240),
        time_limit_s=rng.choices((24 * 3600.0, 12 * 3600.0, 48 * 3600.0, 4 * 3600.0), (12, 4, 4, 1))[0],
        signal_lead_s=rng.choice((180.0, 330.0)),
        preempt_per_day=rng.choice((0.0, 0.0, 0.3, 1.0)),
        faults_per_node_day=rng.choice((0.05, 0.2, 0.5, 1.5)),
    )


@dataclass
class Workers:
    """One node's workers: their group and round (job-wide numbering), and when they die (inf: alive)."""

    group: int
    round: int
    dead_at: float = math.inf


@dataclass
class Hooks:
    """The decision code a week runs: the real one, or (in tests) a deliberately broken one."""

    job_state: type[ReplicaJobState] = ReplicaJobState
    decide: adapter.Decide = field(default_factory=lambda: adapter.policy.decide)
    build_ledger: Callable[..., ledger.Ledger] = ledger.build_ledger


@dataclass
class ReplicaWeekResult:
    week: ReplicaWeek
    outcome: str
    attempts: int
    group_restarts: int
    drops: int
    job_wide_stops: int
    final_step: int
    violations: list[Violation]


class ReplicaSim:
    """One week: Slurm, the nodes, the job's attempts, the groups, the decisions."""

    def __init__(self, week: ReplicaWeek, hooks: Hooks | None = None) -> None:
        self.week = week
        self.hooks = hooks or Hooks()
        self.rng = random.Random(week.seed * 1_000_003 + 29)
        self.check = ReplicaChecker()
        self.t = 0.0
        self.week_end = WEEK_S
        self.log = adapter.Log()
        self.partition = [f"r{i:04d}" for i in range(week.partition)]
        #: host -> (died, back)
        self.dead: dict[str, tuple[float, float]] = {}
        self.excluded: tuple[str, ...] = ()
        self.job_step = 0.0
        self.ckpt_step = 0
        self.attempt = -1
        self.outcome = "running"
        self.allocated = 0.0
        self.group_restarts = self.drops = self.job_wide_stops = 0
        self._seq = itertools.count()
        # per attempt
        self.hosts: list[str] = []
        self.q: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.st: ReplicaJobState | None = None
        self.ended = False
        self.workers: dict[int, Workers] = {}
        #: group -> (round, its nodes) as last assigned
        self.group_round: dict[int, tuple[int, list[int]]] = {}
        #: group -> since when it steps (the model's truth)
        self.stepping: dict[int, float] = {}
        #: group -> since when it surely does not step (its workers died or were stopped): the ledger's
        #: productive time must not reach into it (``left_out_not_training``)
        self.off_since: dict[int, float] = {}
        #: (attempt, group) -> [t0, t1) intervals in which the group surely did not step
        self.off: dict[tuple[int, int], list[tuple[float, float]]] = {}
        #: groups whose own fault (since their round began) justifies stopping them
        self.faulted: set[int] = set()
        self.cut_until: dict[int, float] = {}
        self.lighthouse_cut_until: dict[int, float] = {}
        self.unhealthy: set[str] = set()
        self.evidence: dict[str, list[str]] = {}
        #: Nodes lost as the coordinator's only other node when its own link was cut (``node_evidence``).
        self.alone_with_coordinator: set[str] = set()
        self.stop: tuple[Reason, float, bool] | None = None
        self.attempt_log = 0
        self.attempt_ckpt_before = 0
        self.attempt_ckpt: int | None = None
        self.attempt_stepped = False
        #: Epochs (every group started together) in this attempt.
        self.epochs = 0

    # ---- the clock ------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.q, (t, next(self._seq), fn, args))

    def advance(self, t: float) -> None:
        """Move the job's step to ``t``: it steps while any group steps; checkpoints every ``ckpt_every``."""
        if self.stepping and t > self.t:
            self.job_step = min(self.job_step + (t - self.t) / self.week.step_s, float(self.week.total_steps))
            kept = int(self.job_step) // self.week.ckpt_every * self.week.ckpt_every
            if int(self.job_step) >= self.week.total_steps:
                kept = self.week.total_steps
            if kept > self.ckpt_step:
                self.ckpt_step = kept
                self.attempt_ckpt = kept
        self.t = max(self.t, t)

    # ---- the week -------------------------------------------------------------------------------
    def run(self) -> ReplicaWeekResult:
        t = 0.0
        while t < WEEK_S and self.outcome == "running":
            hosts = self._allocate(t)
            if hosts is None:
                t = self._next_allocation(t)
                continue
            t = self._run_attempt(t, hosts)
            if self.outcome == "running":
                t += self.rng.uniform(60, 1800)
        self.check.after_week(self)
        return ReplicaWeekResult(
            self.week,
            self.outcome,
            self.attempt + 1,
            self.group_restarts,
            self.drops,
            self.job_wide_stops,
            int(self.job_step),
            self.check.violations,
        )

    @property
    def needed(self) -> int:
        return self.week.nodes + self.week.spares

    def _is_dead(self, host: str, t: float, after: float = 0.0) -> bool:
        died, back = self.dead.get(host, (math.inf, 0.0))
        return died + after <= t < back

    def _usable(self, t: float) -> list[str]:
        return [h for h in self.partition if not self._is_dead(h, t, model.SLURMD_TIMEOUT_S)]

    def _allocate(self, t: float) -> list[str] | None:
        free = [h for h in self._usable(t) if h not in self.excluded and not self._is_dead(h, t)]
        return free[: self.needed] if len(free) >= self.needed else None

    def _next_allocation(self, t: float) -> float:
        if len(self.partition) - len(self.excluded) < self.needed:
            self.outcome = "unschedulable"
            return WEEK_S
        back = [u for _, u in self.dead.values() if u > t]
        return min(back) if back else WEEK_S

    def _run_attempt(self, t0: float, hosts: list[str]) -> float:
        self.attempt += 1
        self.hosts, self.q, self.ended, self.workers = hosts, [], False, {}
        self.group_round, self.stepping, self.off_since, self.faulted = {}, {}, {}, set()
        self.cut_until, self.lighthouse_cut_until, self.stop = {}, {}, None
        self.attempt_log = len(self.log.records)
        self.attempt_ckpt_before, self.attempt_ckpt, self.attempt_stepped = self.ckpt_step, None, False
        self.job_step = float(self.ckpt_step)
        self.t = t0
        self.log.attempt_started(t0, self.attempt, "1000", self.attempt, hosts)
        self.st = self._job_state(hosts)
        self.epochs = 0
        self.at(t0 + 5.0, self._agents_up)
        self.at(t0 + TICK_S, self._tick)
        self._schedule_fault(t0)
        limit = t0 + self.week.time_limit_s
        self.at(limit - self.week.signal_lead_s, self._signal, Reason.TIME_LIMIT, limit, False)
        if self.week.preempt_per_day > 0:
            tp = t0 + self.rng.expovariate(self.week.preempt_per_day / DAY_S)
            self.at(tp, self._signal, Reason.PREEMPTED, tp + 120.0, True)
        while not self.ended:
            if not self.q or self.q[0][0] >= WEEK_S:
                self.advance(WEEK_S)
                self._end_attempt(None)
                break
            t, _, fn, args = heapq.heappop(self.q)
            self.advance(t)
            fn(*args)
        self.allocated += self.t - t0
        return self.t

    def _job_state(self, hosts: list[str]) -> ReplicaJobState:
        ports = iter(range(20000, 10**9))
        w = self.week
        return self.hooks.job_state(
            replica_groups=w.groups,
            min_replica_groups=w.min_groups,
            lighthouse=f"http://{hosts[0]}:29510",
            hosts=hosts,
            min_nodes=w.per_group * w.min_groups,
            round_size=w.nodes,
            max_restarts=w.max_restarts,
            master_addr=hosts[0],
            new_port=lambda: next(ports),
            rdzv_timeout=adapter.RDZV_TIMEOUT_S,
            stop_timeout=60.0,
            now=lambda: self.t,
            attempt=self.attempt,
            fence_s=adapter.fence_s(),
        )

    # ---- the coordinator ------------------------------------------------------------------------
    def call(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Deliver an agent's report to the coordinator's state and act on what it decides."""
        st = self.st
        if st is None or self.ended:
            return
        if method in AGENT_REPORTS and args and not self._agent_up(args[0]):
            return  # that agent is dead or cut off from the coordinator: its report never arrives
        before = (st.phase.value, len(st.live_groups()))
        actions = getattr(st, method)(*args, **kwargs)
        self.check.after_call(self, before, actions)
        self._apply(actions)
        if st.result is not None and not self.ended:
            self._coordinator_decides(st.result)
        elif st.fence_until > self.t:
            self.at(st.fence_until + 1e-6, self.call, "tick")

    def _apply(self, actions: list[Any]) -> None:
        """Deliver the decision's messages in order (an agent acts on its messages as they come: a round, then
        a stop of that round); a round's messages start it together."""
        sends = self.log.apply(actions, self.t)
        rounds: dict[int, list[tuple[int, messages.Round]]] = {}
        for send in sends:
            if isinstance(send.message, messages.Round):
                rounds.setdefault(send.message.round, []).append((send.node_rank, send.message))
        restarted = {a.event.fields.get("round") for a in actions if _is(a, "replica_group_restarting")}
        started: set[int] = set()
        for send in sends:
            msg = send.message
            if isinstance(msg, messages.Round) and msg.round not in started:
                started.add(msg.round)
                epoch = (
                    msg.round not in restarted
                )  # every group starts: an attempt's start, a job-wide restart
                if epoch and not any(r not in restarted for r in started - {msg.round}):
                    self.epochs += 1
                    self.check.epoch_started(self)
                init = self.week.startup_s if epoch and self.epochs == 1 else self.week.restart_s
                self._start_group_round(msg.round, rounds[msg.round], init)
            elif isinstance(msg, messages.Stop):
                self._stop_node(send.node_rank, msg.round)
            elif isinstance(msg, messages.Preempt):
                self._preempted_node(send.node_rank, msg.round)
            elif isinstance(msg, messages.StopAt):
                self.at(self.t + self.rng.uniform(0.5, 5.0), self._stop_node, send.node_rank, msg.round, True)

    def _agents_up(self) -> None:
        for n, host in enumerate(self.hosts):
            if self.ended:
                return
            if self._is_dead(host, self.t):
                continue
            self.call("join", n, host, NPROC)
        self.at(self.t + adapter.RDZV_TIMEOUT_S, self.call, "tick")  # a dead node's agent never joins

    def _tick(self) -> None:
        """The periodic tick: the coordinator's time-driven decisions, and a stepping group's heartbeat."""
        if self.ended:
            return
        self.at(self.t + TICK_S, self._tick)
        self.call("tick")
        for g in sorted(self.stepping):
            r, nodes = self.group_round[g]
            self.call("progress", nodes[0], r, int(self.job_step), self.t, NPROC * len(nodes))
            break
        self._maybe_done()

    # ---- groups and workers ---------------------------------------------------------------------
    def _start_group_round(self, r: int, sends: list[tuple[int, messages.Round]], init: float) -> None:
        """Every node of the group's new round kills what is left of its old workers and spawns new ones."""
        g = sends[0][1].replica_group
        nodes = [n for n, _ in sends]
        self.check.round_spawn(self, g, r, nodes)
        self.group_round[g] = (r, nodes)
        self.faulted.discard(g)
        self._down(g)
        for n in nodes:
            old = self.workers.get(n)
            if old is not None and old.dead_at > self.t:
                old.dead_at = self.t
            self.workers[n] = Workers(g, r)
        self.at(self.t + SPAWN_S, self._spawned, g, r)
        self.at(self.t + SPAWN_S + init, self._first_step, g, r)

    def _alive(self, n: int, r: int) -> bool:
        w = self.workers.get(n)
        return w is not None and w.round == r and w.dead_at > self.t

    def _spawned(self, g: int, r: int) -> None:
        cur = self.group_round.get(g)
        for n in cur[1] if cur is not None and cur[0] == r else []:
            if self._alive(n, r) and self._agent_up(n):
                self.call("started_workers", n, r, self.t)

    def _first_step(self, g: int, r: int) -> None:
        """The group's workers are up: it steps (and heals from a peer) unless its quorum cannot form."""
        cur = self.group_round.get(g)
        if cur is None or cur[0] != r or self.ended or g in self.stepping:
            return
        nodes = cur[1]
        if not all(self._alive(n, r) and self.cut_until.get(n, 0.0) <= self.t for n in nodes):
            return
        blocked = self.lighthouse_cut_until.get(g, 0.0) - self.t
        if blocked > 0:
            if blocked > QUORUM_TIMEOUT_S:
                self.at(self.t + QUORUM_TIMEOUT_S, self._quorum_fails, g, r)
            else:
                self.at(self.t + blocked, self._first_step, g, r)
            return
        self._group_on(g)
        self.call("progress", nodes[0], r, int(self.job_step), self.t, NPROC * len(nodes))
        self._maybe_done()

    def _group_on(self, g: int) -> None:
        self.stepping[g] = self.t
        self.attempt_stepped = True
        since = self.off_since.pop(g, None)
        if since is not None and self.t > since:
            self.off.setdefault((self.attempt, g), []).append((since, self.t))

    def _blocked(self, g: int) -> None:
        """Group ``g`` stops stepping now (its quorum or a collective waits); its workers live on."""
        self.stepping.pop(g, None)

    def _down(self, g: int) -> None:
        """Group ``g``'s workers die or are stopped now: it surely makes no step until its next first step.
        Once the coordinator's node is dead no event can date that (a survivor ends the attempt after the
        detection bound): the attempt's end closes the group then."""
        self._blocked(g)
        if not self._is_dead(self.hosts[0], self.t):
            self.off_since.setdefault(g, self.t)

    def _maybe_done(self) -> None:
        if self.job_step < self.week.total_steps:
            return
        for g in sorted(self.stepping):
            r, nodes = self.group_round[g]
            for n in nodes:
                self.call("workers_done", n, r)

    def _stop_node(self, n: int, r: int, at_stop_step: bool = False) -> None:
        """An agent stops its workers of round ``r`` (a restart, or the stop step): gone a moment later."""
        w = self.workers.get(n)
        if w is None or w.round != r:
            if not at_stop_step and self._agent_up(n):
                self.at(self.t + 0.05, self._stopped, n, r)
            return
        if not at_stop_step:
            self.check.stop_sent(self, n, w.group)
        self._down(w.group)
        if not self._agent_up(n):
            return  # dead or cut off: its agent hears nothing (its lease ends its workers)
        done = self.t + (0.05 if w.dead_at <= self.t else self.rng.uniform(0.2, KILL_S))
        w.dead_at = min(w.dead_at, done)
        self.at(done, self._stopped, n, r)

    def _agent_up(self, n: int) -> bool:
        """Node ``n``'s agent runs and reaches the coordinator (the coordinator's own node's agent is local to
        it: a cut of that node's link does not part them)."""
        if self._is_dead(self.hosts[n], self.t):
            return False
        return n == 0 or (self.cut_until.get(n, 0.0) <= self.t and self._coordinator_reachable())

    def _coordinator_reachable(self) -> bool:
        """The coordinator's node is up and its link is not cut."""
        return not self._is_dead(self.hosts[0], self.t) and self.cut_until.get(0, 0.0) <= self.t

    def _stopped(self, n: int, r: int) -> None:
        if self._agent_up(n):
            self.call("workers_stopped", n, r, [])

    def _quorum_fails(self, g: int, r: int) -> None:
        """The group's quorum timed out (lighthouse cut): every rank of it raises."""
        cur = self.group_round.get(g)
        if cur is None or cur[0] != r or self.ended:
            return
        self.faulted.add(g)
        self._down(g)
        for n in cur[1]:
            if self._alive(n, r) and self._agent_up(n):
                self.workers[n].dead_at = self.t
                self.call("worker_failed", n, r, [self._failure(n, g, r, ERRORS[LIGHTHOUSE])])

    def _failure(self, n: int, g: int, r: int, error: str) -> dict[str, Any]:
        nodes = self.group_round[g][1]
        local = self.rng.randrange(NPROC)
        return {
            "round": r,
            "rank": nodes.index(n) * NPROC + local if n in nodes else None,
            "local_rank": local,
            "exitcode": 1,
            "signal": None,
            "error": error,
            "ts": self.t,
            "traceback": f'Traceback (most recent call last):\n  File "train.py", line 88\n{error}\n',
        }

    # ---- faults ---------------------------------------------------------------------------------
    def _schedule_fault(self, t: float) -> None:
        rate = self.week.faults_per_node_day * len(self.hosts) / DAY_S
        self.at(t + self.rng.expovariate(rate), self._fault)

    def _fault(self) -> None:
        """One fault. None strikes while the coordinator's node is dead or cut off: nothing would record it
        before the attempt ends at the detection bound."""
        if self.ended or self.stop is not None:
            return
        self._schedule_fault(self.t)
        if not self._coordinator_reachable():
            return
        kinds = list(FAULT_WEIGHTS)
        kind = self.rng.choices(kinds, [FAULT_WEIGHTS[k] for k in kinds])[0]
        n = 0 if kind == COORDINATOR else self.rng.randrange(len(self.hosts))
        if not self._agent_up(n):
            return
        host = self.hosts[n]
        if kind == RANK:
            w = self.workers.get(n)
            if w is None or w.dead_at <= self.t or self.group_round.get(w.group, (-1,))[0] != w.round:
                return  # a spare, or workers already gone: a rank fault needs a running rank
            self.evidence.setdefault(host, []).append(kind)
            self.faulted.add(w.group)
            self._down(w.group)
            w.dead_at = self.t
            self.call("worker_failed", n, w.round, [self._failure(n, w.group, w.round, ERRORS[RANK])])
            if self.rng.random() < 1 / 3 and not self.ended:  # a GPU fault: the health check fails
                self.unhealthy.add(host)
                self.log.node_unhealthy(self.t, host, "GPU failed its health check after an ECC error")
                self.call("left", n, "node unhealthy: GPU 0", unhealthy=True)
            return
        if kind == LIGHTHOUSE:
            groups = sorted(self.group_round)
            if not groups:
                return
            g = self.rng.choice(groups)
            d = self.rng.uniform(5.0, 600.0)
            self.lighthouse_cut_until[g] = max(self.lighthouse_cut_until.get(g, 0.0), self.t + d)
            if g in self.stepping:  # its next quorum blocks; it fails when the cut outlasts the timeout
                self._blocked(g)
                r = self.group_round[g][0]
                self.at(self.t + min(d, QUORUM_TIMEOUT_S), self._lighthouse_back_or_fail, g, r)
            return
        if kind == PARTITION:  # a switch: consecutive nodes cut off from the coordinator's side together
            if n == 0:
                return
            size = self.rng.randint(2, max(2, self.week.per_group + 1))
            d = self._cut_length()
            for m in range(n, min(n + size, len(self.hosts))):
                if self._agent_up(m):
                    self.evidence.setdefault(self.hosts[m], []).append(kind)
                    self._node_gone(m, False, d)
            return
        self.evidence.setdefault(host, []).append(kind)
        dies = kind == NODE or (kind == COORDINATOR and self.rng.random() < 0.5)
        self._node_gone(n, dies, 0.0 if dies else self._cut_length())

    def _cut_length(self) -> float:
        """How long a cut lasts: a third shorter than the detection bound (a flap), else 10 s to 15 min."""
        return self.rng.uniform(0.5, 4.0) if self.rng.random() < 0.3 else self.rng.uniform(10, 900)

    def _lighthouse_back_or_fail(self, g: int, r: int) -> None:
        cur = self.group_round.get(g)
        if cur is None or cur[0] != r or self.ended:
            return
        if self.lighthouse_cut_until.get(g, 0.0) > self.t:
            self._quorum_fails(g, r)
        elif g not in self.faulted and all(self._alive(n, r) for n in cur[1]):
            self._group_on(g)

    def _node_gone(self, n: int, dies: bool, d: float) -> None:
        """Node ``n`` dies, or its link is cut for ``d`` seconds: the others lose it after the detection
        bound; a cut node's agent ends its lease by then and kills its workers. A cut shorter than the bound
        costs nothing."""
        host = self.hosts[n]
        w = self.workers.get(n)
        current = w is not None and self.group_round.get(w.group, (-1,))[0] == w.round
        # The lighthouse runs on the coordinator's node: a cut there blocks every group's quorum.
        hit = sorted(self.group_round) if n == 0 else [w.group] if w is not None and current else []
        if not dies and d <= DETECTION_S:
            for g in hit:
                if g in self.stepping:
                    self._blocked(g)
                    self.at(self.t + d, self._cut_healed, g, self.group_round[g][0])
            return
        for g in hit:
            self.faulted.add(g)
            self._blocked(g)
        if dies:
            self.dead[host] = (self.t, self.t + model.SLURMD_TIMEOUT_S + model.repair_s(self.rng))
            self.cut_until[n] = math.inf
            if w is not None:
                w.dead_at = min(w.dead_at, self.t)
                if current:
                    self._down(w.group)  # (none is dated once the coordinator's node is dead: see _down)
        else:
            self.cut_until[n] = self.t + d
            if w is not None:
                w.dead_at = min(w.dead_at, self.t + DETECTION_S + self.rng.uniform(0.2, KILL_S))
        self.at(self.t + DETECTION_S, self._silent, n, dies)

    def _cut_healed(self, g: int, r: int) -> None:
        cur = self.group_round.get(g)
        if cur is None or cur[0] != r or self.ended or g in self.faulted:
            return
        if all(self._alive(n, r) for n in cur[1]) and self.lighthouse_cut_until.get(g, 0.0) <= self.t:
            self._group_on(g)

    def _silent(self, n: int, dead: bool) -> None:
        if self.ended or self.st is None:
            return
        # As the coordinator words it (agent/coordinator.py): the ledger dates the loss back by the silence.
        reason = f"no heartbeat for {DETECTION_S:.1f} s and no answer to probes (node hung or unreachable)"
        if n != 0:
            self.call("lost", n, reason, silent=True)
            return
        if dead:  # the coordinator's node died with the batch shell: a survivor decides
            facts = EndFacts(
                self.attempt,
                Reason.NODE_UNHEALTHY,
                "1000",
                self.t,
                bad_nodes=(self.hosts[0],),
                progressed=self.attempt_stepped,
                **self._evidence(),
            )
            self._end_attempt(facts)
            return
        others = [m for m in range(1, len(self.hosts)) if self.st is not None and m in self.st.members]
        if len(others) == 1:  # one node against the coordinator: whose link failed cannot be told
            self.alone_with_coordinator.add(self.hosts[others[0]])
        silent_now = getattr(self.st, "silent_now", None)  # code before issue 31 has none
        if silent_now is not None:  # the coordinator's liveness pass finds every other agent silent at once
            silent_now(others)
        for m in range(1, len(self.hosts)):  # the coordinator's own link: it hears nobody
            self.call("lost", m, reason, silent=True)
        if silent_now is not None:
            silent_now(())

    # ---- stop signals ---------------------------------------------------------------------------
    def _signal(self, reason: Reason, kill: float, requeued: bool) -> None:
        if self.ended or self.stop is not None:
            return
        self.stop = (reason, kill, requeued)
        self.at(kill, self._killed)
        self.log.record(adapter.events.signal_received(signal="USR2", node_rank=0), self.t)
        self.call("preempt", 0, "USR2")
        self.at(self.t + REPORT_TIMEOUT_S + 0.1, self.call, "tick")

    def _preempted_node(self, n: int, r: int) -> None:
        """An agent got ``Preempt``: stepping workers report their step; others just stop."""
        w = self.workers.get(n)
        if w is None or not self._agent_up(n):
            return  # a spare (no workers), or an agent that hears nothing
        if w.group in self.stepping and w.round == r and w.dead_at > self.t:
            self.at(self.t + 0.05, self.call, "step_report", n, r, int(self.job_step), 1 / self.week.step_s)
        else:
            w.dead_at = min(w.dead_at, self.t)
            self.at(self.t + 0.5, self._stopped, n, w.round)

    def _killed(self) -> None:
        if self.ended or self.stop is None:
            return
        reason, _, requeued = self.stop
        self._end_attempt(
            EndFacts(self.attempt, reason, "1000", self.t, slurm_requeued=requeued, **self._evidence())
        )

    # ---- the end of an attempt ------------------------------------------------------------------
    def _coordinator_decides(self, result: messages.Finish) -> None:
        self._end_attempt(
            adapter.coordinator_end(
                result, self.stop, self.attempt, self.t, self.attempt_stepped, self._evidence()
            )
        )

    def _evidence(self) -> dict[str, Any]:
        ckpt = self.attempt_ckpt
        return {
            "new_checkpoint": f"step-{ckpt}" if ckpt is not None else None,
            "usable": frozenset(self._usable(self.t)),
            "schedulable": frozenset(self.partition),
            "needed": self.needed,
        }

    def _end_attempt(self, facts: EndFacts | None) -> None:
        """Every worker dies; one decision (None: the week is over first)."""
        self.ended = True
        for g in list(self.stepping):
            self._down(g)
        for g, since in self.off_since.items():
            self.off.setdefault((self.attempt, g), []).append((since, math.inf))
        self.off_since = {}
        for w in self.workers.values():
            w.dead_at = min(w.dead_at, self.t)
        self.st = None
        if facts is None:
            return
        decision = adapter.conclude(
            self.log, facts, adapter.settings(self.week.max_requeues), self.hooks.decide
        )
        self.check.after_decision(self, decision)
        if decision.action is adapter.Action.SUCCEED:
            self.outcome = "finished"
        elif decision.action is adapter.Action.SKIP:
            self.outcome = f"abandoned:{decision.skip.value if decision.skip else '?'}"
        else:
            released = set(decision.release)
            self.excluded = tuple(n for n in decision.exclude if n not in released)


def _is(action: Any, event: str) -> bool:
    return isinstance(action, Record) and action.event.name.value == event


def run_week(seed: int, hooks: Hooks | None = None) -> ReplicaWeekResult:
    return ReplicaSim(draw(seed), hooks).run()


def as_json(r: ReplicaWeekResult) -> dict[str, Any]:
    w = r.week
    return {
        "seed": w.seed,
        "groups": w.groups,
        "nodes": w.nodes,
        "outcome": r.outcome,
        "attempts": r.attempts,
        "group_restarts": r.group_restarts,
        "drops": r.drops,
        "job_wide_stops": r.job_wide_stops,
        "violations": sorted({v.invariant for v in r.violations}),
        "details": [str(v) for v in r.violations[:3]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcelastic.sim.replicas", description=__doc__)
    p.add_argument("--seed", type=int, default=0, help="the (first) week's seed")
    p.add_argument("--weeks", type=int, default=1, help="how many weeks, seeds SEED, SEED+1, ...")
    p.add_argument("--json", action="store_true", help="one JSON object per week on stdout")
    p.add_argument("--verbose", "-v", action="store_true", help="print every violation of the week")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    results = [run_week(s) for s in range(a.seed, a.seed + a.weeks)]
    violations = [v for r in results for v in r.violations]
    for r in results:
        if a.json:
            print(json.dumps(as_json(r)))
        elif a.weeks == 1:
            w = r.week
            print(
                f"seed {w.seed}: {w.groups} groups x {w.per_group} node(s), {w.spares} spare(s), min "
                f"{w.min_groups}; {r.attempts} attempts, {r.group_restarts} group restarts, {r.drops} left "
                f"out, {r.job_wide_stops} job-wide stops; outcome {r.outcome}, step {r.final_step}/"
                f"{w.total_steps}"
            )
    for v in violations[: None if a.verbose else 20]:
        print(v, file=sys.stderr)
    if a.weeks > 1 and not a.json:
        took = time.perf_counter() - t0
        print(f"{a.weeks} weeks in {took:.1f} s; violations: {json.dumps(summary(violations))}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
