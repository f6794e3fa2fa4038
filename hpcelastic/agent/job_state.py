"""The coordinator's decisions, free of I/O: membership, rounds, the job-wide budget, root cause.

:class:`JobState` receives what agents report and returns :data:`Action` values (a :class:`Send` of
a message, a :class:`Record` of an event, a :class:`Say` of a line). The network server in
``coordinator.py`` applies them; the unit tests drive this class directly.

:class:`Phase`: ``rendezvous`` (waiting for the step's nodes) -> ``running`` (a round's workers run) ->
``stopping`` (a failure or lost node: every agent stops its workers) -> a new round, or
``finished``. ``preempting`` replaces ``stopping`` after a preemption signal.

Hot spares: a round runs on the ``round_size`` lowest joined node ranks; the other agents (the
spares) join but get no round until a round node is lost, when the next round takes the lowest
spare in its place, so the world size stays the same while spares last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcelastic import events
from hpcelastic.agent import messages
from hpcelastic.agent.messages import Failure
from hpcelastic.agent.stop_step import REPORT_TIMEOUT_S, stop_step
from hpcelastic.events import Event
from hpcelastic.hangs.localize import Localization, Reachability, localize
from hpcelastic.hangs.stacks import ProcessStack, python_traceback, stack_from_json
from hpcelastic.lifecycle.history import root_cause_signature
from hpcelastic.lifecycle.progress import LONG_RUN_S
from hpcelastic.reasons import Named, Reason, RestartCause

STOP_TIMEOUT_EXTRA = 15.0
#: Slurm signals every node of a step (scancel, preemption, time limit), but each slurmd on its own
#: time: an agent that a signal stopped is held this long for the others before it counts as its
#: node's loss, so a job-wide stop is never read as one node lost and the others stopped.
SIGNAL_SETTLE_S = 2.0
#: The signal Slurm ends a step with. It reaches the step's workers as well as its agents, and a worker
#: may die of it before any agent got it: such a death is held SIGNAL_SETTLE_S for the agents' signals
#: before the round decides on it (a restart that the step's stop would cut short).
STEP_STOP_SIGNAL = "SIGTERM"
#: How long the coordinator waits for every node's stacks once all ranks stalled.
STACKS_TIMEOUT = 25.0
#: Suspect yourself first: when the coordinator loses two or more agents, more than this share of the
#: other nodes, within SUSPECT_SELF_WINDOW_S of each other, its own node (its link) is the likelier
#: cause, and none of them is named a bad node for the next attempt.
SUSPECT_SELF_SHARE = 0.5
SUSPECT_SELF_WINDOW_S = 10.0


class Phase(Named):
    """Where the job attempt is (see the module docstring)."""

    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    STOPPING = "stopping"
    PREEMPTING = "preempting"
    FINISHED = "finished"


@dataclass(frozen=True)
class Send:
    """Send ``message`` to the agent of ``node_rank``."""

    node_rank: int
    message: messages.Message


@dataclass(frozen=True)
class Record:
    """Write ``event`` to the run's event log."""

    event: Event


@dataclass(frozen=True)
class Say:
    """Print ``text`` on the coordinator's standard error."""

    text: str


@dataclass(frozen=True)
class SaveStacks:
    """Write a hang's stacks file (``<run>/stacks/attempt-<K>/round-<R>.json``)."""

    attempt: int
    round: int
    stacks: dict[int, ProcessStack]
    localization: Localization
    info: dict[int, dict[str, Any]]


#: One effect for the server to apply.
Action = Send | Record | Say | SaveStacks


@dataclass
class Hang:
    """Every node of ``round`` reported stalled: stacks asked for, collected until ``deadline``."""

    round: int
    deadline: float
    idle_s: float
    stacks: dict[int, ProcessStack] = field(default_factory=dict)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)
    replied: set[int] = field(default_factory=set)
    #: Node rank -> the peers it could not reach (pinged while its stacks were taken).
    unreachable: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class Member:
    """A joined, live agent."""

    node_rank: int
    host: str
    nproc: int


@dataclass(frozen=True)
class LostNode:
    """A node of the current round whose agent went away at ``ts`` (``signalled``: a signal told it to
    stop)."""

    node_rank: int
    node: str
    reason: str
    ts: float
    round: int
    signalled: bool = False


@dataclass(frozen=True)
class NodeSaves:
    """One node's last :class:`~hpcelastic.agent.messages.Saving` report: whether a worker of it writes a
    checkpoint file now, and when one last did (the coordinator's clock; None: none seen)."""

    saving: bool
    last: float | None


@dataclass(frozen=True)
class JobSaves:
    """The whole job's saves during a stop: some node writes (``saving``), or none does and none has since
    ``quiet_since`` (None: no node saw a save)."""

    saving: bool
    quiet_since: float | None = None


def job_saves(reports: Mapping[int, NodeSaves], nodes: Collection[int]) -> JobSaves | None:
    """The job-wide verdict over ``nodes`` (the round's nodes whose workers may still take part in a save):
    None until each has reported (a node not heard from may be writing), saving while any is, else quiet
    since the latest write any of them saw."""
    if not all(n in reports for n in nodes):
        return None
    if any(reports[n].saving for n in nodes):
        return JobSaves(True)
    return JobSaves(False, max((t for n in nodes if (t := reports[n].last) is not None), default=None))


class JobState:
    """Membership, rounds and the restart budget of one job attempt."""

    def __init__(
        self,
        *,
        hosts: Sequence[str],
        min_nodes: int,
        max_restarts: int,
        master_addr: str,
        new_port: Callable[[], int],
        rdzv_timeout: float,
        stop_timeout: float = 10.0,
        round_size: int | None = None,
        now: Callable[[], float] = time.time,
        attempt: int = 0,
        fence_s: float = 0.0,
    ) -> None:
        self.hosts = tuple(hosts)
        self.attempt = attempt
        self.min_nodes = min_nodes
        #: Nodes a round runs on (the fixed world); the other joined agents are hot spares.
        self.round_size = len(self.hosts) if round_size is None else round_size
        self.max_restarts = max_restarts
        self.master_addr = master_addr
        self._new_port = new_port
        self.now = now
        self.stop_timeout = stop_timeout + STOP_TIMEOUT_EXTRA
        self.deadline = now() + rdzv_timeout
        self.rdzv_timeout = rdzv_timeout
        self.phase = Phase.RENDEZVOUS
        self.members: dict[int, Member] = {}
        self.round = -1
        self.restart_count = 0
        #: ``round_nodes`` still members, kept up to date (not recomputed per message: O(N) each).
        self._alive_nodes: set[int] = set()
        self.round_nodes = []
        self.started: dict[int, float] = {}
        #: node rank -> (spawn, why cold) of its latest ``started`` report.
        self.spawns: dict[int, tuple[str, str]] = {}
        self.stopped: set[int] = set()
        self.done: set[int] = set()
        self.failures: list[dict[str, Any]] = []
        self.lost_in_round: list[LostNode] = []
        self.bad_nodes: list[str] = []
        #: Nodes found slow enough to exclude at the next requeue (hpcelastic/slow/), first evidence first.
        self.slow_nodes: list[str] = []
        #: (host, time, peers) of agents that vanished (connection closed or silent): suspects, see
        #: :meth:`suspects`; ``peers``: the other nodes' agents connected just before (this one's included).
        self.vanished: list[tuple[str, float, int]] = []
        #: Hosts whose agents went silent (their connection never closed): maybe only a cut link.
        self.silent_hosts: set[str] = set()
        #: Agents the liveness pass is reporting lost, not all reported yet (:meth:`silent_now`).
        self.overdue: frozenset[int] = frozenset()
        #: The previous round's root-cause signature, if it failed before any progress (a start-up failure).
        self.startup_failure: str | None = None
        #: Some rank of this attempt reached a step (in any round).
        self.stepped = False
        #: Root-cause tracebacks shown on the console (signature -> times): a repeat is named, not printed.
        self.shown_tracebacks: dict[str, int] = {}
        self.departed: set[int] = set()
        #: node rank -> (reason, time) of agents a signal stopped, held until ``leaving_until``.
        self.leaving: dict[int, tuple[str, float]] = {}
        self.leaving_until: float | None = None
        #: Decide no round's stop before this (a worker killed by STEP_STOP_SIGNAL: see there).
        self.stop_signal_hold_until: float | None = None
        #: Set while held signalled departures settle: one decision on the whole stop, not on its first node.
        self._settling = False
        self.result: messages.Finish | None = None
        #: After a preemption signal: each round node's (highest step, steps/s) until the stop step is fixed.
        self.step_reports: dict[int, tuple[int | None, float]] = {}
        self.step_deadline: float | None = None
        #: After a preemption signal: each round node's saves (``Saving``), the round it runs (with replica
        #: groups each group has its own), and what every node was last told.
        self.saves: dict[int, NodeSaves] = {}
        self.save_rounds: dict[int, int] = {}
        self.saves_told: JobSaves | None = None
        #: node rank -> (round, report) of its last stall report; a hang being localized.
        self.stall_reports: dict[int, tuple[int, messages.StallReport]] = {}
        self.hang: Hang | None = None
        self.steps = _RoundSteps()
        #: Fencing: a node lost by silence may be cut off with its workers still running; its agent stops
        #: them within ``fence_s`` of going silent (its own heartbeat timeout, then a kill). No round
        #: starts before ``fence_until``, so two workers of one rank never run in two rounds.
        self.fence_s = fence_s
        self.fence_until = 0.0
        #: A restart is decided and waits for ``fence_until``.
        self.round_due = False

    # ---- membership -------------------------------------------------------------------------
    def join_error(self, node_rank: Any) -> str | None:
        """Why an agent claiming ``node_rank`` may not join, or None."""
        if not isinstance(node_rank, int) or not 0 <= node_rank < len(self.hosts):
            return f"node rank {node_rank!r} is outside this job's {len(self.hosts)} nodes"
        if node_rank in self.members:
            return f"node rank {node_rank} has already joined (two agents on one node?)"
        if self.phase is not Phase.RENDEZVOUS:
            return f"node rank {node_rank} joined after the job started; it is not part of this attempt"
        return None

    def join(self, node_rank: int, host: str, nproc: int) -> list[Action]:
        """An authenticated agent joined; starts the first round once every node is there."""
        self.members[node_rank] = Member(node_rank, host, int(nproc))
        if node_rank in self.round_nodes:
            self._alive_nodes.add(node_rank)
        return self._rendezvous_complete()

    def _rendezvous_complete(self) -> list[Action]:
        """Start the first round once every node joined or left (a bad node leaves before joining)."""
        if len(self.members) + len(self.departed) < len(self.hosts):
            return []
        if len(self.members) >= self.min_nodes and 0 in self.members:
            return self.start_round()
        return self.check_stopped()

    def live(self) -> dict[str, float]:
        """The current round's figures for the metrics endpoint (read from its thread: plain values only):
        round, world size, and, once heartbeats came, the highest step and the steps per second since the
        round's first one."""
        out: dict[str, float] = {}
        if self.round < 0:
            return out
        out["round"] = float(self.round)
        out["world_size"] = float(
            sum(self.members[n].nproc for n in list(self.round_nodes) if n in self.members)
        )
        st = self.steps
        if st.step is not None:
            out["step"] = float(st.step)
            if st.first is not None and st.ts > st.first[1]:
                out["step_rate"] = (st.step - st.first[0]) / (st.ts - st.first[1])
        return out

    def missing(self) -> list[str]:
        """The nodes (``rank (host)``) that have not joined."""
        return [f"{i} ({h})" for i, h in enumerate(self.hosts) if i not in self.members]

    def left(
        self, node_rank: int, reason: str, *, unhealthy: bool = False, signalled_at: float | None = None
    ) -> list[Action]:
        """An agent said it leaves: a bad node at once; one a signal stopped (at ``signalled_at``, its
        clock) is held for SIGNAL_SETTLE_S, and once every joined agent left that way, they all count
        together as the step's stop."""
        if unhealthy or signalled_at is None or node_rank not in self.members or self.phase is Phase.FINISHED:
            return self.lost(node_rank, reason, unhealthy=unhealthy, signalled_at=signalled_at)
        self.leaving[node_rank] = (reason, signalled_at)
        if self.leaving_until is None:
            self.leaving_until = self.now() + SIGNAL_SETTLE_S
        if set(self.leaving) >= set(self.members):
            return self._settle_leaving()
        return []

    def _settle_leaving(self) -> list[Action]:
        """The held signalled departures become losses (the coordinator's own node first)."""
        everyone = set(self.leaving) >= set(self.members)  # the step's stop, not one node's loss
        leaving, self.leaving, self.leaving_until = self.leaving, {}, None
        actions: list[Action] = []
        self._settling = everyone
        for n, (reason, ts) in sorted(leaving.items()):
            actions += self.lost(n, reason, signalled_at=ts, stopped=everyone)
        self._settling = False
        if everyone and self.phase in STOPPING_PHASES:
            actions += self.check_stopped()
        return actions

    def lost(
        self,
        node_rank: int,
        reason: str,
        *,
        unhealthy: bool = False,
        signalled_at: float | None = None,
        silent: bool = False,
        stopped: bool = False,
    ) -> list[Action]:
        """An agent's connection closed or went ``silent``, or it left (a bad node, or stopped by a signal
        delivered at ``signalled_at``; ``stopped``: with every other agent, the step's stop)."""
        member = self.remove_member(node_rank, silent=silent)
        if member is None or self.phase is Phase.FINISHED:
            return []
        actions = self.book_departure(
            node_rank, member, reason, unhealthy=unhealthy, signalled_at=signalled_at, stopped=stopped
        )
        if self.phase is Phase.RENDEZVOUS:
            return actions + self._rendezvous_complete()
        if node_rank not in self.round_nodes:
            return actions
        self.lost_in_round.append(self.lost_node(node_rank, member.host, reason, self.round, signalled_at))
        if self.phase is Phase.RUNNING:
            actions += self._begin_stop(RestartCause.NODE_LOST)
        return actions + self.check_stopped() + self._tell_saves()

    def remove_member(self, node_rank: int, *, silent: bool) -> Member | None:
        """Take ``node_rank`` out of the members; one lost by silence (its workers may run on, cut off) fences
        the next round, job-wide or a replica group's: none starts before :meth:`fence_wait` is 0."""
        member = self.members.pop(node_rank, None)
        self._alive_nodes.discard(node_rank)
        if member is not None and silent and self.phase is not Phase.FINISHED:
            self.fence_until = max(self.fence_until, self.now() + self.fence_s)
            self.silent_hosts.add(member.host)
        return member

    def fence_wait(self) -> float:
        """Seconds until a new round may start: a silent node's agent has stopped its workers by then."""
        return max(0.0, self.fence_until - self.now())

    @staticmethod
    def fence_text(wait: float) -> str:
        return f"next round in {wait:.1f} s, once the silent node's agent has stopped its workers (fence)"

    # ---- rounds -----------------------------------------------------------------------------
    def new_round(self) -> None:
        """Forget the last round's reports: a job-wide round (or every replica group) starts now."""
        self.round_due = False
        self.phase = Phase.RUNNING
        self.started, self.stopped, self.done = {}, set(), set()
        self.failures, self.lost_in_round = [], []
        self.stop_signal_hold_until = None
        self.steps = _RoundSteps()

    def start_round(self) -> list[Action]:
        previous = set(self.round_nodes)
        self.new_round()
        self.round += 1
        # The lowest node ranks run; spares (the highest ranks) take the place of lost ones in order.
        self.round_nodes = sorted(self.members)[: self.round_size]
        actions = self.round_actions(self.round_nodes, self.restart_count)
        if previous:
            promoted = [self.members[n].host for n in self.round_nodes if n not in previous]
            if promoted:
                actions.append(Say(f"spare node(s) {', '.join(promoted)} take the place of the lost node(s)"))
        return actions

    def round_actions(self, nodes: Sequence[int], restart_count: int, **extra: Any) -> list[Action]:
        """Open round ``self.round`` on ``nodes``: a fresh port, a ``rendezvous`` event, a ``Round`` per node.

        ``extra`` are further :class:`messages.Round` fields (replica groups set theirs).
        """
        port = self._new_port()
        world = sum(self.members[n].nproc for n in nodes)
        hosts = [self.members[n].host for n in nodes]
        actions: list[Action] = [
            Record(
                events.rendezvous(
                    round=self.round,
                    hosts=hosts,
                    world_size=world,
                    master_addr=self.master_addr,
                    master_port=port,
                    restart_count=restart_count,
                )
            )
        ]
        offset = 0
        for group_rank, n in enumerate(nodes):
            rnd = messages.Round(
                round=self.round,
                restart_count=restart_count,
                max_restarts=self.max_restarts,
                group_rank=group_rank,
                group_world_size=len(nodes),
                rank_offset=offset,
                world_size=world,
                master_addr=self.master_addr,
                master_port=port,
                **extra,
            )
            actions.append(Send(n, rnd))
            offset += self.members[n].nproc
        return actions

    @property
    def round_nodes(self) -> list[int]:
        """The nodes of the current round, in rank order."""
        return self._round_nodes

    @round_nodes.setter
    def round_nodes(self, nodes: list[int]) -> None:
        self._round_nodes = nodes
        self._alive_nodes = {n for n in nodes if n in self.members}

    def is_current(self, node_rank: int, round_: int) -> bool:
        """Whether ``round_`` is the round ``node_rank`` runs now (replica groups: its group's)."""
        return round_ == self.round

    def _alive_round_nodes(self) -> set[int]:
        """The round's nodes that are still members (the state's own set: callers never change it)."""
        return self._alive_nodes

    def started_workers(
        self, node_rank: int, round_: int, ts: float, spawn: str = "cold", spawn_reason: str = ""
    ) -> list[Action]:
        """An agent spawned its workers; ``workers_started`` once every node has."""
        if round_ != self.round or self.phase is not Phase.RUNNING:
            return []
        self.started[node_rank] = ts
        self.spawns[node_rank] = (spawn, spawn_reason)
        if self.started.keys() >= self._alive_round_nodes():
            world = sum(self.members[n].nproc for n in self._alive_round_nodes())
            spawned = max(self.started.values())
            how = {self.spawns[n][0] for n in self.started}
            cold = {str(n): self.spawns[n][1] for n in sorted(self.started) if self.spawns[n][0] == "cold"}
            kind = how.pop() if len(how) == 1 else "mixed"
            up = Say(f"round {self.round}: {world} workers up on {len(self.started)} node(s) ({kind} start)")
            return [
                up,
                Record(
                    events.workers_started(
                        round=self.round,
                        world_size=world,
                        spawned_ts=spawned,
                        spawn=kind,
                        cold_reasons=cold,
                    )
                ),
            ]
        return []

    def worker_failed(self, node_rank: int, round_: int, failures: Sequence[Failure]) -> list[Action]:
        """An agent saw workers fail: every agent is told to stop its workers."""
        if round_ != self.round or self.phase is Phase.FINISHED:
            return []
        actions = self.record_failures(node_rank, failures)
        if self.phase is Phase.RUNNING:
            actions += self._begin_stop(RestartCause.WORKER_FAILED)
        return actions

    def workers_stopped(self, node_rank: int, round_: int, failures: Sequence[Failure]) -> list[Action]:
        """An agent's workers are all gone; decide once every agent of the round says so."""
        if round_ != self.round or self.phase not in STOPPING_PHASES:
            return []
        actions = self.record_failures(node_rank, failures)
        self.stopped.add(node_rank)
        return actions + self.check_stopped() + self._tell_saves()

    def workers_done(self, node_rank: int, round_: int) -> list[Action]:
        """An agent's workers all exited 0 (exit barrier): success once every node is done."""
        if round_ != self.round or self.phase is not Phase.RUNNING:
            return []
        self.done.add(node_rank)
        if self.done >= self._alive_round_nodes():
            return self.finish(Reason.SUCCEEDED)
        return []

    def preempt(self, node_rank: int, signal: str) -> list[Action]:
        """A preemption/time-limit signal reached an agent: stop everywhere, no restart."""
        if self.phase in (Phase.FINISHED, Phase.PREEMPTING):
            return []
        if self.phase is Phase.RENDEZVOUS or not self._alive_round_nodes():
            return self.finish(Reason.PREEMPTED)
        self.phase = Phase.PREEMPTING
        self.stopped = set()
        self.deadline = self.now() + self.stop_timeout
        self.step_reports, self.step_deadline = {}, self.now() + REPORT_TIMEOUT_S
        self.saves, self.save_rounds, self.saves_told = {}, {}, None
        return [Send(n, messages.Preempt(self.round, signal)) for n in sorted(self.members)]

    def step_report(self, node_rank: int, round_: int, step: int | None, rate: float) -> list[Action]:
        """A round node's highest step after the preemption signal; the stop step once all reported."""
        if round_ != self.round or self.phase is not Phase.PREEMPTING or self.step_deadline is None:
            return []
        self.step_reports[node_rank] = (step, rate)
        if self.step_reports.keys() >= self._alive_round_nodes():
            return self.fix_stop_step()
        return []

    def fix_stop_step(self) -> list[Action]:
        """Tell every round node the step all ranks stop after (see ``stop_step.py``)."""
        self.step_deadline = None
        step = stop_step(self.step_reports.values())
        text = f"every rank stops after step {step}" if step is not None else "no heartbeats: stop at once"
        stop = messages.StopAt(self.round, step)
        return [Say(text), *(Send(n, stop) for n in sorted(self._alive_round_nodes()))]

    def saving(self, node_rank: int, round_: int, saving: bool, idle_s: float | None) -> list[Action]:
        """A round node's saves changed during the stop (``idle_s``: since its last write); every round node
        hears the job's when that changes."""
        current = self.is_current(node_rank, round_) and node_rank in self._alive_nodes
        if not current or self.phase is not Phase.PREEMPTING:
            return []
        now = self.now()
        last = now if saving else None if idle_s is None else now - idle_s
        self.saves[node_rank] = NodeSaves(saving, last)
        self.save_rounds[node_rank] = round_
        return self._tell_saves()

    def _tell_saves(self) -> list[Action]:
        """Every round node still stopping hears the job-wide verdict (:func:`job_saves`) when it changed: a
        node whose workers are gone takes no part in a save any more."""
        if self.phase is not Phase.PREEMPTING:
            return []
        nodes = self._alive_nodes - self.stopped
        verdict = job_saves(self.saves, nodes)
        if verdict is None or verdict == self.saves_told:
            return []
        self.saves_told = verdict
        since, saving = verdict.quiet_since, verdict.saving
        quiet = None if saving or since is None else max(0.0, self.now() - since)
        return [Send(n, messages.JobSaving(self.save_rounds[n], saving, quiet)) for n in sorted(nodes)]

    def progress(self, node_rank: int, round_: int, step: int, ts: float, ranks: int) -> list[Action]:
        """An agent's highest step: a ``progress`` event for the round's first step, then at most one per
        :data:`~hpcelastic.events.PROGRESS_INTERVAL_S`; the round's last step is written when it stops."""
        if round_ != self.round or self.phase not in (Phase.RUNNING, *STOPPING_PHASES):
            return []
        st = self.steps
        st.ranks[node_rank] = ranks
        self.stepped = True
        if st.step is not None and step <= st.step:
            return []
        st.step, st.ts = step, ts
        now = self.now()
        if st.marked_at is None:
            st.first = (step, ts)
            return [
                self._progress_mark(events.ProgressMark.FIRST),
                Say(f"round {self.round}: training, step {step}"),
            ]
        if now - st.marked_at >= events.PROGRESS_INTERVAL_S:
            first_step, first_ts = st.first or (step, ts)
            rate = (step - first_step) / (ts - first_ts) if ts > first_ts else 0.0
            return [
                self._progress_mark(events.ProgressMark.PERIODIC),
                Say(f"round {self.round}: step {step}, {rate:.3g} steps/s"),
            ]
        return []

    def _progress_mark(self, mark: events.ProgressMark) -> Record:
        st = self.steps
        assert st.step is not None
        st.marked_at = self.now()
        ranks = sum(st.ranks.values())
        return Record(
            events.progress(
                attempt=self.attempt, round=self.round, step=st.step, step_ts=st.ts, mark=mark, ranks=ranks
            )
        )

    def _last_progress(self) -> list[Action]:
        """The round stops: its last step, once, whenever it saw a step. Also when a periodic mark already
        named that step: the ``last`` mark is what tells the ledger the round stopped (its ``shutdown``), and
        a final step that happened to fall on a periodic mark left it out (official CI, a loaded machine)."""
        st = self.steps
        if st.step is None or st.last_written:
            return []
        st.last_written = True
        return [self._progress_mark(events.ProgressMark.LAST)]

    def tick(self) -> list[Action]:
        """Time-driven decisions: rendezvous timeout, agents that never finish stopping, the stop step."""
        now = self.now()
        if self.leaving_until is not None and now >= self.leaving_until:
            return self._settle_leaving()
        if self.stop_signal_hold_until is not None and now >= self.stop_signal_hold_until:
            self.stop_signal_hold_until = None
            return self.check_stopped()
        if self.round_due and now >= self.fence_until and self.phase in STOPPING_PHASES:
            return self.start_round()
        if self.phase is Phase.PREEMPTING and self.step_deadline is not None and now >= self.step_deadline:
            return self.fix_stop_step()
        if self.hang is not None and self.hang.round == self.round and now >= self.hang.deadline:
            return self.declare_hang()
        if self.phase is Phase.RENDEZVOUS and now >= self.deadline:
            if len(self.members) >= self.min_nodes and self.members:
                missing = ", ".join(self.missing())
                return [
                    Say(f"rendezvous timed out; continuing without node(s) {missing}"),
                    *self.start_round(),
                ]
            return self.finish(
                Reason.TOO_FEW_NODES,
                f"rendezvous timed out after {self.rdzv_timeout:g} s: {len(self.members)} of "
                f"{len(self.hosts)} nodes joined (need {self.min_nodes}); "
                f"missing: {', '.join(self.missing())}",
            )
        if self.phase in STOPPING_PHASES and now >= self.deadline:
            actions: list[Action] = []
            for n in sorted(self._alive_round_nodes() - self.stopped):
                actions += self.lost(n, f"did not stop its workers within {self.stop_timeout:g} s")
            return actions
        return []

    # ---- hangs (no progress anywhere; see hpcelastic.hangs) ---------------------------------------
    def stall_report(self, node_rank: int, report: messages.StallReport) -> list[Action]:
        """A node's ranks all stalled (or one moves again); once every round node stalled, ask for stacks."""
        if report.round != self.round or self.phase is not Phase.RUNNING:
            return []
        if self.hang is not None and self.hang.round == self.round:
            return []
        self.stall_reports[node_rank] = (report.round, report)
        alive = self._alive_round_nodes()
        stalled = {n for n, (r, rep) in self.stall_reports.items() if r == self.round and rep.stalled}
        if not alive or not stalled >= alive:
            return []
        idle = min(self.stall_reports[n][1].idle_s for n in alive)
        self.hang = Hang(self.round, self.now() + STACKS_TIMEOUT, idle)
        return [
            Say(f"no rank made progress for {idle:g} s: hang; taking every worker's stacks"),
            *(Send(n, messages.DumpStacks(self.round)) for n in sorted(alive)),
        ]

    def stacks_report(self, node_rank: int, report: messages.StacksReport) -> list[Action]:
        """A node's stacks for the hang; localize once every node sent them."""
        hang = self.hang
        if hang is None or report.round != hang.round or hang.round != self.round:
            return []
        self.add_stacks(hang, node_rank, report)
        if hang.replied >= self._alive_round_nodes():
            return self.declare_hang()
        return []

    def add_stacks(self, hang: Hang, node_rank: int, report: messages.StacksReport) -> None:
        host = self.members[node_rank].host if node_rank in self.members else ""
        for rank_s, doc in report.stacks.items():
            rank = int(rank_s)
            hang.stacks[rank] = stack_from_json(doc)
            hang.info[rank] = {"node_rank": node_rank, "node": host, "local_rank": doc.get("local_rank")}
        hang.replied.add(node_rank)
        hang.unreachable[node_rank] = report.unreachable

    def declare_hang(self) -> list[Action]:
        """Localize across all ranks, save the stacks, fail the root rank(s): the round restarts."""
        hang = self.hang
        if hang is None or self.phase is not Phase.RUNNING:
            return []
        self.hang = Hang(hang.round, float("inf"), hang.idle_s)  # declared once per round
        node_of = {rank: int(info["node_rank"]) for rank, info in hang.info.items()}
        loc = localize(hang.stacks, Reachability(node_of, hang.unreachable))
        now = self.now()
        base = {"round": hang.round, "exitcode": None, "signal": None, "ts": now, "hang": loc.to_json()}
        stacks_file = f"stacks/attempt-{self.attempt}/round-{hang.round}.json"
        failures: list[dict[str, Any]] = []
        for rank in loc.root_ranks:
            info = hang.info.get(rank, {})
            where = loc.where.get(rank, "?")
            error = f"stalled: hung at {where}; no progress for {hang.idle_s:g} s ({loc.detail})"
            failures.append(
                {
                    **base,
                    **info,
                    "rank": rank,
                    "error": error,
                    "traceback": python_traceback(hang.stacks[rank]),
                    "stacks_file": stacks_file,
                }
            )
        if not failures:
            failures.append(
                {
                    **base,
                    "rank": None,
                    "node": "all nodes",
                    "stacks_file": stacks_file,
                    "error": f"stalled: no progress for {hang.idle_s:g} s, not localized: {loc.detail}",
                }
            )
        actions: list[Action] = [SaveStacks(self.attempt, hang.round, hang.stacks, loc, hang.info)]
        self.failures.extend(failures)
        actions += [Record(events.worker_failed(f, exit_ts=now)) for f in failures]
        return actions + self.stop_after_hang()

    def stop_after_hang(self) -> list[Action]:
        """A hang was declared: the round stops (replica groups stop only the hung group)."""
        return self._begin_stop(RestartCause.WORKER_FAILED)

    # ---- internals --------------------------------------------------------------------------
    def record_failures(self, node_rank: int, failures: Sequence[Failure]) -> list[Action]:
        actions: list[Action] = []
        for f in failures:
            f = {
                **f,
                "node_rank": node_rank,
                "node": self.members[node_rank].host if node_rank in self.members else "",
            }
            self.failures.append(f)
            actions.append(Record(events.worker_failed(f, exit_ts=f.get("ts"))))
            if f.get("signal") == STEP_STOP_SIGNAL and self.stop_signal_hold_until is None:
                self.stop_signal_hold_until = self.now() + SIGNAL_SETTLE_S
        return actions

    def lost_node(
        self, node_rank: int, host: str, reason: str, round_: int, signalled_at: float | None
    ) -> LostNode:
        """A lost round node: gone now, or when the signal that stopped its agent came."""
        ts = self.now() if signalled_at is None else signalled_at
        return LostNode(node_rank, host, reason, ts, round_, signalled_at is not None)

    def book_departure(
        self,
        node_rank: int,
        member: Member,
        reason: str,
        *,
        unhealthy: bool,
        signalled_at: float | None,
        stopped: bool = False,
    ) -> list[Action]:
        """Book an agent that left: an unhealthy node is bad; one that vanished is suspect for the next
        attempt; one a signal stopped (Slurm ending the step) is neither, and with all others (``stopped``)
        no node was lost at all."""
        if unhealthy:
            self.bad_nodes.append(member.host)
        record = events.agent_stopped if stopped else events.node_lost
        actions: list[Action] = [Record(record(node_rank=node_rank, node=member.host, reason=reason))]
        if signalled_at is None and not unhealthy:
            before = len(self.suspects())
            peers = 1 + sum(1 for n in self.members if n != 0)
            self.vanished.append((member.host, self.now(), peers))
            if len(self.suspects()) < before + 1:
                actions.append(Say(self._suspect_self_text()))
        self.departed.add(node_rank)
        return actions

    def slow_node(self, host: str) -> None:
        """``host`` was found slow: it is one of the attempt's bad nodes (excluded at the next requeue)."""
        if host not in self.slow_nodes:
            self.slow_nodes.append(host)

    def suspects(self) -> list[str]:
        """The vanished nodes held against themselves: all but those lost together with most of the other
        nodes still connected then (:data:`SUSPECT_SELF_SHARE` within :data:`SUSPECT_SELF_WINDOW_S`): this
        node's link explains those. Counted against the nodes still there, not the job's first ones: nodes
        lost hours before cannot be lost again (the simulated weeks with replica groups found a late cut of
        this node's link blaming the few nodes left)."""
        out = []
        for host, t, _ in self.vanished:
            together, others = self._burst(t)
            if together < 2 or together <= SUSPECT_SELF_SHARE * others:
                out.append(host)
        return out

    def silent_now(self, nodes: Collection[int]) -> None:
        """The agents the server's liveness pass is about to report lost (empty once it has): they count with
        the burst already, so a decision made in the middle of the pass sees the burst whole (the simulated
        weeks found an attempt ended, and its first lost nodes blamed, before the rest of a cut-off
        coordinator's burst was counted)."""
        self.overdue = frozenset(nodes)

    def _burst(self, t: float) -> tuple[int, int]:
        """How many agents vanished within SUSPECT_SELF_WINDOW_S of ``t`` (with those silent now, when ``t``
        is recent), and how many were there to lose."""
        burst = [p for _, u, p in self.vanished if abs(u - t) <= SUSPECT_SELF_WINDOW_S]
        pending = 0
        if self.now() - t <= SUSPECT_SELF_WINDOW_S:
            pending = sum(1 for n in self.overdue if n in self.members and n != 0)
        return len(burst) + pending, max(burst)

    def _suspect_self_text(self) -> str:
        together, others = self._burst(self.vanished[-1][1])
        return (
            f"{together} of the {others} other nodes went silent at once: this node's "
            "own network is the likelier cause, so none of them is excluded next time"
        )

    def _begin_stop(self, reason: RestartCause) -> list[Action]:
        self.phase = Phase.STOPPING
        self.deadline = self.now() + self.stop_timeout
        return [Send(n, messages.Stop(self.round, reason)) for n in sorted(self._alive_round_nodes())]

    def _holding_for_the_steps_stop(self) -> bool:
        """Every failure of the round so far is a worker killed by STEP_STOP_SIGNAL, no node vanished, not
        every agent got its signal yet, and they may still: within SIGNAL_SETTLE_S of the first death."""
        return (
            self.stop_signal_hold_until is not None
            and self.now() < self.stop_signal_hold_until
            and all(f.get("signal") == STEP_STOP_SIGNAL for f in self.failures)
            and all(n.signalled for n in self.lost_in_round)
            and not self._all_signalled()
        )

    def check_stopped(self) -> list[Action]:
        if self._settling:
            return []
        if self.phase is Phase.RENDEZVOUS:
            actions: list[Action] = []
        elif self.phase not in STOPPING_PHASES or not self.stopped >= self._alive_round_nodes():
            return []
        elif self.phase is Phase.PREEMPTING:
            return self.finish(Reason.PREEMPTED)
        elif self._holding_for_the_steps_stop():
            return []  # tick decides once the hold is over
        else:
            actions = self._last_progress() + self._root_cause()
            repeated = self._repeated_startup_failure()
            if repeated:
                return actions + self.finish(Reason.STARTUP_FAILURE, repeated)
        if 0 not in self.members:
            if self.hosts[0] in self.bad_nodes:
                return actions + self.finish(Reason.NODE_UNHEALTHY, "the coordinator's node is unhealthy")
            return actions + self.finish(Reason.COORDINATOR_LOST, "the coordinator's agent left")
        if len(self.members) < self.min_nodes:
            return actions + self.finish(
                Reason.TOO_FEW_NODES,
                f"{len(self.members)} node(s) remain, fewer than the minimum {self.min_nodes}",
            )
        if self.round_due:
            return actions  # the restart is decided: its round opens once the fence has passed (tick)
        if self.restart_count >= self.max_restarts:
            return actions + self.finish(
                Reason.RESTARTS_EXHAUSTED,
                f"the job-wide restart budget ({self.max_restarts}) is spent",
            )
        self.restart_count += 1
        why = RestartCause.NODE_LOST if self.lost_in_round else RestartCause.WORKER_FAILED
        cause = self.lost_in_round[0].reason if self.lost_in_round else why.value
        actions.append(
            Record(
                events.restarting(
                    round=self.round + 1,
                    restart_count=self.restart_count,
                    max_restarts=self.max_restarts,
                    reason=why,
                )
            )
        )
        actions.append(
            Say(
                f"restarting all workers (restart {self.restart_count} of {self.max_restarts}) after: {cause}"
            )
        )
        return actions + self._round_after_fence()

    def _round_after_fence(self) -> list[Action]:
        """The next round now, or once the lost nodes' agents have surely stopped their workers."""
        wait = self.fence_wait()
        if wait <= 0:
            return self.start_round()
        self.round_due = True
        return [Say(self.fence_text(wait))]

    def _root_cause(self) -> list[Action]:
        """The round's root cause as an event and a line (see :meth:`_round_cause`)."""
        found = self._round_cause()
        if found is None:
            return []
        cause, traceback, exit_ts = found
        text = self.cause_text(f"root cause (round {self.round})", cause, traceback)
        return [Record(events.root_cause(cause, traceback=traceback, exit_ts=exit_ts)), Say(text)]

    def cause_text(self, head: str, cause: Failure, traceback: str) -> str:
        """The console's root-cause line: where and what, how many other ranks failed alike, and the
        traceback the first time it is seen (a repeat is counted, its text is in the rank logs)."""
        where = f"rank {cause['rank']} on {cause['node']}" if cause.get("rank") is not None else cause["node"]
        text = f"{head}: {where}: {cause['error']}"
        alike = sum(
            1 for f in self.failures if f is not cause and traceback and f.get("traceback") == traceback
        )
        if alike:
            text += f" ({alike} other rank(s) failed with the same traceback)"
        if not traceback:
            return text
        key = root_cause_signature({**cause, "traceback": traceback})
        seen = self.shown_tracebacks[key] = self.shown_tracebacks.get(key, 0) + 1
        if seen > 1:
            return text + f"; the same traceback as before ({seen} times now; the rank logs have it)"
        return text + "\n" + traceback.rstrip()

    def _round_cause(self) -> tuple[dict[str, Any], str, float | None] | None:
        """The round's first failure (cause, traceback, time), job-wide: a vanished node before any
        worker failure (its loss explains them); else a worker failure the stop signal does not explain;
        else the first node a signal stopped. None when a signal stopped every node of the round: whoever
        sent it (Slurm: cancel, preemption, time limit) ends the attempt, and ``finalize`` asks Slurm why."""
        if self._all_signalled():
            return None
        lost = self._first_lost()
        failures = [f for f in self.failures if not self._follows_the_stop(f)]
        if lost is not None and (not lost.signalled or not failures):
            cause: dict[str, Any] = {"round": self.round, "node_rank": lost.node_rank, "node": lost.node}
            cause["error"] = f"node lost: {lost.reason}"
            return cause, "", lost.ts
        if failures:
            cause = min(failures, key=lambda f: f.get("ts") or 0.0)
            return cause, cause.get("traceback") or "", cause.get("ts")
        return None

    def _repeated_startup_failure(self) -> str | None:
        """Why the attempt stops restarting, when this round and the one before failed the same way before
        any progress: no rank of the attempt reached a step and the workers ran less than ``LONG_RUN_S``.
        Only a failure of the script itself counts (an exception or an exit code, on any rank): a node
        lost or a signal (an OOM kill) is not the script's doing, and keeps the restart budget."""
        found = self._round_cause()
        previous, self.startup_failure = self.startup_failure, None
        if found is None:
            return None
        cause, traceback, exit_ts = found
        script_failed = not cause.get("signal") and not str(cause.get("error", "")).startswith(
            ("node lost", "stalled")
        )
        began = min(self.started.values(), default=None)
        early = began is not None and exit_ts is not None and exit_ts - began < LONG_RUN_S
        if not (script_failed and early and not self.stepped):
            return None
        signature = root_cause_signature({**cause, "traceback": traceback})
        self.startup_failure = signature
        if previous is None and self._every_rank_failed_alike(signature):
            return (
                f"every rank of round {self.round} failed the same way before any step was seen (the "
                "script's own error, not a node's); not restarting: fix the script"
            )
        if previous is None or previous != signature:
            return None
        return (
            f"round {self.round} failed at start-up exactly like round {self.round - 1} (same error, no step "
            "seen); not restarting again: fix the script"
        )

    def _every_rank_failed_alike(self, signature: str) -> bool:
        """The attempt's first round, and every rank of it failed on its own (an exception or an exit code,
        no signal) with the same error: a usage error the script makes on every node alike, which a restart
        cannot mend. A node's trouble shows on that node's ranks only."""
        if self.restart_count or not self.round_nodes or self.lost_in_round:
            return False
        world = sum(self.members[n].nproc for n in self.round_nodes if n in self.members)
        failed: dict[int, str | None] = {}
        for f in self.failures:
            if f.get("signal") or f.get("rank") is None:
                return False
            failed[int(f["rank"])] = root_cause_signature(f)
        return len(failed) == world > 1 and set(failed.values()) == {signature}

    def _first_lost(self) -> LostNode | None:
        """The round's first vanished node, else the first a signal stopped."""
        vanished = [n for n in self.lost_in_round if not n.signalled]
        return vanished[0] if vanished else min(self.lost_in_round, key=lambda n: n.ts, default=None)

    def _follows_the_stop(self, failure: Failure) -> bool:
        """A worker failure a stop signal explains: killed by a signal on a node whose agent a signal
        stopped (Slurm signals the workers with their agent), or at or after the round's first such
        signal (its peers went away). Times are the nodes' clocks."""
        stopped = [n for n in self.lost_in_round if n.signalled]
        if not stopped:
            return False
        if failure.get("signal") and failure.get("node_rank") in {n.node_rank for n in stopped}:
            return True
        return (failure.get("ts") or 0.0) >= min(n.ts for n in stopped)

    def _all_signalled(self) -> bool:
        """Every node of the round left because a signal told its agent to stop, and every worker
        failure follows that stop."""
        lost = self.lost_in_round
        return (
            bool(lost)
            and all(n.signalled for n in lost)
            and {n.node_rank for n in lost} >= set(self.round_nodes)
            and all(self._follows_the_stop(f) for f in self.failures)
        )

    def finish(self, reason: Reason, message: str = "") -> list[Action]:
        last = self._last_progress()
        self.phase = Phase.FINISHED
        # A node whose agent vanished (crash, OOM kill, node down) is as suspect as one that
        # failed a health check, unless most others vanished with it (see ``suspects``).
        bad_nodes = tuple(dict.fromkeys([*self.bad_nodes, *self.suspects(), *self.slow_nodes]))
        unreachable = tuple(h for h in bad_nodes if h in self.silent_hosts and h not in self.bad_nodes)
        self.result = messages.Finish(reason, message, bad_nodes, unreachable)
        return [*last, *(Send(n, self.result) for n in sorted(self.members))]


STOPPING_PHASES = (Phase.STOPPING, Phase.PREEMPTING)


@dataclass
class _RoundSteps:
    """The highest step reported in the current round and what of it is written as ``progress``."""

    step: int | None = None
    ts: float = 0.0
    ranks: dict[int, int] = field(default_factory=dict)
    marked_at: float | None = None
    #: The round's ``last`` mark is written (it stopped).
    last_written: bool = False
    #: The round's first reported (step, time): its step rate is counted from there.
    first: tuple[int, float] | None = None
