"""torchft replica groups (``--replica-groups R``): the coordinator's decisions per group, free of I/O.

The round's nodes are split into R groups of consecutive node ranks (:func:`plan_groups`); each group is
a torch.distributed world of its own (its own ``MASTER_ADDR``/``MASTER_PORT`` and ranks) and one
replica of torchft's quorum. :class:`ReplicaJobState` extends :class:`~hpcelastic.agent.job_state.JobState`:

- a worker failure stops and restarts **only that group**, on its own nodes, with a new round number
  and port; the other groups keep stepping and the restarted group heals from a live peer (torchft
  does the healing; the coordinator records ``replica_group_healed`` when the group reports its first
  step: the peers are the groups then running, ``steps_missed`` the steps committed without it);
- a group that lost a node restarts with a spare in its place (a ``--spare-nodes`` node, or a node of
  a group left out); without one it is left out (torchft pairs rank r of every group with rank r of the
  others, so the groups must keep the same size), and so is a group whose restart budget is spent: each
  group may restart ``--max-restarts`` times (counted per group);
- a group restart after a node was lost by silence waits for the same fence as a job-wide round
  (:meth:`~hpcelastic.agent.job_state.JobState.fence_wait`): the lost node's workers may run until its
  lease ends;
- a group is dropped (``replica_group_dropped``) while at least ``--min-replica-groups`` groups remain;
  below that the job-wide path applies (every group stops, the job-wide budget of ``--max-restarts``
  restarts, then the requeue), as without replica groups. A job-wide restart forms the groups again from
  the nodes left, spares filling the places of lost nodes (:func:`plan_groups`).

``hpcelastic/sim/replicas.py`` drives this class through simulated weeks (the invariants in
``sim/replica_invariants.py``).

Hangs (``--stall-timeout``) are judged per group: a group is hung when every node of its current round
reports that its ranks made no progress (py-spy samples or heartbeats, ``agent/hangwatch.py``). A group
waits in torchft's quorum while a peer restarts or heals, so no group is declared hung while another group
is stopping or has not stepped since its restart, nor within the stall timeout after such a change. The
hung groups' stacks are taken and localized per group (ranks are numbered within a group); the groups
with a root rank are failed and restart alone, with a ``root_cause`` and the stacks file of their round.
A hung group with no root rank (all its ranks wait in torchft or a collective: for another group) is
restarted only when every live group is hung and none has a root rank; otherwise it is looked at again
after another stall timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcelastic import events
from hpcelastic.agent import messages
from hpcelastic.agent.job_state import (
    STACKS_TIMEOUT,
    STOPPING_PHASES,
    Action,
    Hang,
    JobState,
    Phase,
    Record,
    Say,
    Send,
)
from hpcelastic.agent.messages import Failure
from hpcelastic.hangs.localize import localize
from hpcelastic.reasons import Named, Reason, RestartCause


def plan_groups(node_ranks: Sequence[int], num_nodes: int, groups: int) -> list[list[int]]:
    """Group g gets the g-th k of the present node ranks in order (k = num_nodes // groups): with every node
    there, ranks ``[g*k, (g+1)*k)``; at a job-wide restart, spares fill the places of lost nodes. A group that
    cannot get k nodes gets none (left out): torchft pairs rank r of every group with rank r of the others."""
    k = num_nodes // groups
    present = sorted(node_ranks)
    return [present[g * k : (g + 1) * k] if len(present) >= (g + 1) * k else [] for g in range(groups)]


def check_groups(num_nodes: int, groups: int, min_groups: int) -> str | None:
    """Why ``--replica-groups``/``--min-replica-groups`` do not fit ``num_nodes`` nodes, or None."""
    if groups < 1 or min_groups < 1:
        return "--replica-groups and --min-replica-groups must be at least 1"
    if min_groups > groups:
        return (
            f"--min-replica-groups {min_groups} exceeds --replica-groups {groups}; lower "
            f"--min-replica-groups to {groups} or fewer"
        )
    if groups > 1 and num_nodes % groups:
        return (
            f"{num_nodes} node(s) do not split into {groups} replica groups of equal size; pick --nodes "
            f"as a multiple of --replica-groups"
        )
    return None


class GroupPhase(Named):
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"
    DROPPED = "dropped"


@dataclass
class Group:
    """One replica group's current round."""

    index: int
    nodes: list[int]
    round: int = -1
    phase: GroupPhase = GroupPhase.RUNNING
    restarts: int = 0
    started: dict[int, float] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    deadline: float = 0.0
    cause: RestartCause = RestartCause.WORKER_FAILED
    last_step: int | None = None
    #: Set while a restarted group has not stepped yet: (its last step before the failure, when it failed).
    healing: tuple[int | None, float] | None = None
    #: Stopped, its restart waiting for the fence (a node of the job was lost by silence).
    fenced: bool = False


class ReplicaJobState(JobState):
    """:class:`JobState` with per-group restarts (see the module docstring)."""

    def __init__(
        self,
        *,
        replica_groups: int,
        min_replica_groups: int,
        lighthouse: str,
        stall_timeout: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.replica_groups = replica_groups
        self.min_replica_groups = min_replica_groups
        self.lighthouse = lighthouse
        self.stall_timeout = stall_timeout
        self.groups: list[Group] = []
        #: node rank -> the round its agent runs now (rounds are numbered job-wide, one per group round).
        self.node_round: dict[int, int] = {}
        #: group index -> its hang being localized (stacks asked for); when a group last stopped or healed.
        self.group_hangs: dict[int, Hang] = {}
        self.groups_changed_at = -float("inf")
        #: group index -> when a hang without a root rank in it may be looked at again.
        self.hang_recheck_at: dict[int, float] = {}

    # ---- queries --------------------------------------------------------------------------------
    def group_of(self, node_rank: int) -> Group | None:
        """The live group ``node_rank`` runs in (a group left out keeps its node list; a spare taken from it
        belongs to the group it joined)."""
        return next((g for g in self.live_groups() if node_rank in g.nodes), None)

    def _alive(self, g: Group) -> list[int]:
        return [n for n in g.nodes if n in self.members]

    def live_groups(self) -> list[Group]:
        return [g for g in self.groups if g.phase is not GroupPhase.DROPPED]

    def is_current(self, node_rank: int, round_: int) -> bool:
        return self.node_round.get(node_rank) == round_

    # ---- rounds ---------------------------------------------------------------------------------
    def start_round(self) -> list[Action]:
        """The first round, or a job-wide restart: every group (re)starts."""
        self.new_round()
        nodes = sorted(self.members)[: self.round_size]
        plan = plan_groups(nodes, self.round_size, self.replica_groups)
        if sum(1 for members in plan if members) < self.min_replica_groups:
            return self.finish(
                Reason.TOO_FEW_NODES,
                f"{sum(1 for m in plan if m)} replica group(s) have nodes, fewer than --min-replica-groups "
                f"{self.min_replica_groups}",
            )
        self.groups = [Group(i, members, restarts=0) for i, members in enumerate(plan)]
        actions: list[Action] = []
        for g in self.groups:
            if g.nodes:
                actions += self._start_group(g)
            else:
                actions += self._drop(g, "no node of the group joined")
        self.round_nodes = [n for g in self.live_groups() for n in g.nodes]
        if self.phase is Phase.RUNNING and len(self.live_groups()) < self.min_replica_groups:
            return actions + self._job_wide_stop(RestartCause.NODE_LOST)
        return actions

    def _start_group(self, g: Group) -> list[Action]:
        # The group's past round is over: its failures and lost nodes are no later job-wide root cause.
        lost_here = {lost.node_rank for lost in self.lost_in_round if lost.round == g.round}
        self.lost_in_round = [lost for lost in self.lost_in_round if lost.round != g.round]
        self.failures = [f for f in self.failures if f.get("node_rank") not in {*g.nodes, *lost_here}]
        self.round += 1
        g.round, g.phase = self.round, GroupPhase.RUNNING
        g.started, g.stopped, g.done = {}, set(), set()
        for n in g.nodes:
            self.node_round[n] = self.round
        return self.round_actions(
            g.nodes,
            g.restarts,
            replica_group=g.index,
            num_replica_groups=self.replica_groups,
            lighthouse=self.lighthouse,
        )

    def started_workers(self, node_rank: int, round_: int, ts: float, *args: Any, **kw: Any) -> list[Action]:
        g = self.group_of(node_rank)
        if g is None or not self.is_current(node_rank, round_) or g.phase is not GroupPhase.RUNNING:
            return []
        with self._in_group(g):  # the base class's bookkeeping, for this group's round
            return super().started_workers(node_rank, round_, ts, *args, **kw)

    @contextlib.contextmanager
    def _in_group(self, g: Group) -> Iterator[None]:
        saved = (self.round, self.round_nodes, self.started)
        self.round, self.round_nodes, self.started = g.round, g.nodes, g.started
        try:
            yield
        finally:
            self.round, self.round_nodes, self.started = saved

    # ---- failures -------------------------------------------------------------------------------
    def worker_failed(self, node_rank: int, round_: int, failures: Sequence[Failure]) -> list[Action]:
        g = self.group_of(node_rank)
        if g is None or not self.is_current(node_rank, round_) or self.phase is Phase.FINISHED:
            return []
        actions = self.record_failures(node_rank, failures)
        if self.phase is Phase.RUNNING and g.phase is GroupPhase.RUNNING:
            actions += self._stop_group(g, RestartCause.WORKER_FAILED)
        return actions

    def _stop_group(self, g: Group, cause: RestartCause) -> list[Action]:
        g.phase, g.cause = GroupPhase.STOPPING, cause
        g.deadline = self.now() + self.stop_timeout
        self.groups_changed_at = self.now()
        g.healing = (g.last_step, self.now())
        return [Send(n, messages.Stop(g.round, cause)) for n in self._alive(g) if n not in g.stopped]

    def workers_stopped(self, node_rank: int, round_: int, failures: Sequence[Failure]) -> list[Action]:
        if not self.is_current(node_rank, round_):
            return []
        if self.phase in STOPPING_PHASES:  # the job-wide path
            actions = self.record_failures(node_rank, failures)
            self.stopped.add(node_rank)
            return actions + self.check_stopped()
        g = self.group_of(node_rank)
        if g is None or g.phase is not GroupPhase.STOPPING:
            return []
        actions = self.record_failures(node_rank, failures)
        g.stopped.add(node_rank)
        return actions + self._group_stopped(g)

    def _group_stopped(self, g: Group) -> list[Action]:
        """Once the group's live nodes all stopped: restart it on them, drop it, or go job-wide."""
        alive = self._alive(g)
        if g.phase is not GroupPhase.STOPPING or not g.stopped >= set(alive):
            return []
        if not alive:
            return self._drop(g, "no node of the group is left")
        wait = self.fence_wait()
        if wait > 0:  # decided once the fence has passed (tick), on the nodes and spares left then
            was, g.fenced = g.fenced, True
            return [] if was else [Say(f"replica group {g.index}: {self.fence_text(wait)}")]
        g.fenced = False
        actions: list[Action] = []
        lacking = self.round_size // self.replica_groups - len(alive)
        if lacking > 0:
            # torchft pairs rank r of every group with rank r of the others: the groups must stay equal.
            spares = self._spares()
            if len(spares) < lacking:
                return self._drop(g, f"it lost {lacking} of its nodes and no spare is left")
            taken = set(spares[:lacking])
            for x in self.groups:  # a spare from a group left out is no longer that group's
                if x.phase is GroupPhase.DROPPED:
                    x.nodes = [n for n in x.nodes if n not in taken]
            alive = sorted(alive + spares[:lacking])
            names = ", ".join(self.members[n].host for n in spares[:lacking])
            actions.append(
                Say(f"replica group {g.index}: spare node(s) {names} take the lost node(s)' place")
            )
        if 0 not in self.members:
            return self._job_wide_stop(g.cause)
        actions += self._group_cause(g)
        if g.restarts >= self.max_restarts:
            return actions + self._drop(g, f"its restart budget ({self.max_restarts}) is spent")
        g.restarts += 1
        g.nodes = alive
        actions += [
            Record(
                events.replica_group_restarting(
                    group=g.index,
                    round=self.round + 1,
                    nodes=[self.members[n].host for n in alive],
                    group_restarts=g.restarts,
                    max_restarts=self.max_restarts,
                    reason=g.cause,
                    last_step=g.last_step,
                )
            ),
            Say(
                f"replica group {g.index}: restarting on {len(alive)} node(s) (restart {g.restarts} of "
                f"{self.max_restarts}) after: {g.cause.value}; the other groups keep stepping"
            ),
        ]
        return actions + self._start_group(g)

    def _group_cause(self, g: Group) -> list[Action]:
        """The console line of the group's first failure in its round, with its traceback (once)."""
        found = [f for f in self.failures if f.get("round") == g.round and f.get("node_rank") in g.nodes]
        if not found:
            return []
        cause = min(found, key=lambda f: f.get("ts") or 0.0)
        return [Say(self.cause_text(f"replica group {g.index}: root cause (round {g.round})", cause,
                                    cause.get("traceback") or ""))]  # fmt: skip

    def _spares(self) -> list[int]:
        """Joined nodes in no live group: hot spares, and the nodes of groups left out."""
        in_use = {n for g in self.live_groups() for n in g.nodes}
        return [n for n in sorted(self.members) if n not in in_use]

    def _drop(self, g: Group, why: str) -> list[Action]:
        g.phase = GroupPhase.DROPPED
        remaining = len(self.live_groups())
        actions: list[Action] = [
            Record(
                events.replica_group_dropped(
                    group=g.index, reason=why, remaining=remaining, min_groups=self.min_replica_groups
                )
            ),
            Say(f"replica group {g.index} left out: {why}; {remaining} group(s) go on"),
        ]
        self.round_nodes = [n for x in self.live_groups() for n in x.nodes]
        if self.phase is Phase.RUNNING and remaining < self.min_replica_groups:
            return actions + self._job_wide_stop(g.cause)
        return actions + self._check_all_done()

    def _job_wide_stop(self, cause: RestartCause) -> list[Action]:
        """Fewer than ``--min-replica-groups`` groups: stop everything; the base class decides what next."""
        self.phase = Phase.STOPPING
        self.deadline = self.now() + self.stop_timeout
        self.round_nodes = [n for g in self.groups for n in g.nodes if n in self.members]
        # Stopped: the nodes of groups done or left out (no workers), and those of a stopping group that
        # reported their stop (a group left out keeps the stop reports of its last round: not this one's).
        idle = (GroupPhase.DONE, GroupPhase.DROPPED)
        self.stopped = {n for g in self.groups if g.phase in idle for n in g.nodes}
        self.stopped |= {n for g in self.groups if g.phase is GroupPhase.STOPPING for n in g.stopped}
        actions: list[Action] = [Say("too few replica groups left: stopping every group (job-wide path)")]
        for n in self.round_nodes:
            if n not in self.stopped:
                actions.append(Send(n, messages.Stop(self.node_round[n], cause)))
        return actions + self.check_stopped()

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
        g = self.group_of(node_rank)
        if self.phase is not Phase.RUNNING or g is None or node_rank not in self.members:
            return super().lost(
                node_rank,
                reason,
                unhealthy=unhealthy,
                signalled_at=signalled_at,
                silent=silent,
                stopped=stopped,
            )
        member = self.remove_member(node_rank, silent=silent)
        assert member is not None
        actions = self.book_departure(
            node_rank, member, reason, unhealthy=unhealthy, signalled_at=signalled_at, stopped=stopped
        )
        self.lost_in_round.append(self.lost_node(node_rank, member.host, reason, g.round, signalled_at))
        if node_rank == 0:  # the coordinator's own agent: nothing can go on without it
            return actions + self._job_wide_stop(RestartCause.NODE_LOST)
        if g.phase is GroupPhase.RUNNING:
            actions += self._stop_group(g, RestartCause.NODE_LOST)
        return actions + self._group_stopped(g)

    # ---- success, progress, time ----------------------------------------------------------------
    def workers_done(self, node_rank: int, round_: int) -> list[Action]:
        g = self.group_of(node_rank)
        if g is None or not self.is_current(node_rank, round_) or self.phase is not Phase.RUNNING:
            return []
        if g.phase is not GroupPhase.RUNNING:
            return []
        g.done.add(node_rank)
        if g.done >= set(self._alive(g)):
            g.phase = GroupPhase.DONE
        return self._check_all_done()

    def _check_all_done(self) -> list[Action]:
        live = self.live_groups()
        if self.phase is Phase.RUNNING and live and all(g.phase is GroupPhase.DONE for g in live):
            return self.finish(Reason.SUCCEEDED)
        return []

    def progress(self, node_rank: int, round_: int, step: int, ts: float, ranks: int) -> list[Action]:
        g = self.group_of(node_rank)
        if g is None or not self.is_current(node_rank, round_) or g.phase is not GroupPhase.RUNNING:
            return []
        actions: list[Action] = []
        if g.healing is not None:
            actions += self._healed(g, step, ts)
        elif g.last_step is None:  # its first step since every group started together
            stepping = events.replica_group_stepping(group=g.index, round=g.round, step=step, step_ts=ts)
            actions.append(Record(stepping))
        g.last_step = step if g.last_step is None else max(g.last_step, step)
        # The job's progress events follow the highest step of any group.
        return actions + super().progress(node_rank, self.round, step, ts, ranks)

    def _healed(self, g: Group, step: int, ts: float) -> list[Action]:
        before, failed_at = g.healing or (None, ts)
        g.healing = None
        self.groups_changed_at = self.now()
        peers = [
            x.index
            for x in self.groups
            if x is not g and x.phase is GroupPhase.RUNNING and x.healing is None and x.last_step is not None
        ]
        missed = step - before - 1 if before is not None and step > before else None
        text = f"replica group {g.index} stepping again at step {step}"
        if peers:
            text += f", healed from group(s) {', '.join(map(str, peers))}"
        return [
            Record(
                events.replica_group_healed(
                    group=g.index,
                    step=step,
                    peers=peers,
                    steps_missed=missed,
                    down_s=round(ts - failed_at, 3),
                )
            ),
            Say(text + (f" ({missed} step(s) missed)" if missed is not None else "")),
        ]

    def step_report(self, node_rank: int, round_: int, step: int | None, rate: float) -> list[Action]:
        return (
            super().step_report(node_rank, self.round, step, rate)
            if self.is_current(node_rank, round_)
            else []
        )

    def fix_stop_step(self) -> list[Action]:
        actions = super().fix_stop_step()
        return [
            Send(a.node_rank, messages.StopAt(self.node_round.get(a.node_rank, -1), a.message.step))
            if isinstance(a, Send) and isinstance(a.message, messages.StopAt)
            else a
            for a in actions
        ]

    def tick(self) -> list[Action]:
        actions = super().tick()
        if self.phase is not Phase.RUNNING:
            return actions
        now = self.now()
        if self.group_hangs and now >= min(h.deadline for h in self.group_hangs.values()):
            actions += self._declare_group_hangs()
        actions += self._check_group_hangs()
        for g in self.groups:
            if g.fenced and self.fence_wait() <= 0:
                actions += self._group_stopped(g)
            if g.phase is GroupPhase.STOPPING and now >= g.deadline:
                for n in [n for n in self._alive(g) if n not in g.stopped]:
                    actions += self.lost(n, f"did not stop its workers within {self.stop_timeout:g} s")
        return actions

    # ---- hangs, per group (see the module docstring) --------------------------------------------
    def stall_report(self, node_rank: int, report: messages.StallReport) -> list[Action]:
        if self.group_of(node_rank) is None or not self.is_current(node_rank, report.round):
            return []
        self.stall_reports[node_rank] = (report.round, report)
        return self._check_group_hangs()

    def _group_stalled(self, g: Group, now: float) -> bool:
        """Every node of ``g``'s round stalled, and no other group restarted or healed meanwhile."""
        alive = self._alive(g)
        if g.phase is not GroupPhase.RUNNING or not alive or g.index in self.group_hangs:
            return False
        if now < self.hang_recheck_at.get(g.index, -float("inf")):
            return False
        for n in alive:
            report = self.stall_reports.get(n)
            if report is None or report[0] != g.round or not report[1].stalled:
                return False
        busy = any(
            x is not g and (x.phase is GroupPhase.STOPPING or (x.phase is GroupPhase.RUNNING and x.healing))
            for x in self.groups
        )
        return not busy and now - self.groups_changed_at >= self.stall_timeout

    def _check_group_hangs(self) -> list[Action]:
        """Ask the stacks of every hung group (one localization at a time)."""
        now = self.now()
        if self.phase is not Phase.RUNNING or self.group_hangs:
            return []
        hung = [g for g in self.live_groups() if self._group_stalled(g, now)]
        actions: list[Action] = []
        for g in hung:
            idle = min(self.stall_reports[n][1].idle_s for n in self._alive(g))
            self.group_hangs[g.index] = Hang(g.round, now + STACKS_TIMEOUT, idle)
            actions.append(
                Say(
                    f"replica group {g.index}: no rank made progress for {idle:g} s: hang; "
                    "taking its workers' stacks"
                )
            )
            actions += [Send(n, messages.DumpStacks(g.round)) for n in self._alive(g)]
        return actions

    def stacks_report(self, node_rank: int, report: messages.StacksReport) -> list[Action]:
        g = self.group_of(node_rank)
        hang = self.group_hangs.get(g.index) if g is not None else None
        if g is None or hang is None or report.round != hang.round or g.round != hang.round:
            return []
        self.add_stacks(hang, node_rank, report)
        replied = all(h.replied >= set(self._alive(self.groups[i])) for i, h in self.group_hangs.items())
        return self._declare_group_hangs() if replied else []

    def _declare_group_hangs(self) -> list[Action]:
        """Localize each hung group; fail and restart those with a root rank (see the module docstring)."""
        hangs, self.group_hangs = self.group_hangs, {}
        current = {
            g.index: (g, h)
            for g in self.groups
            if (h := hangs.get(g.index)) is not None and g.phase is GroupPhase.RUNNING and g.round == h.round
        }
        if self.phase is not Phase.RUNNING or not current:
            return []
        rooted = [i for i, (_g, h) in current.items() if localize(h.stacks).determined]
        whole_job = len(current) == len(self.live_groups())
        actions: list[Action] = []
        for i, (g, h) in current.items():
            if i in rooted or (not rooted and whole_job):
                actions += self._fail_hung_group(g, h)
                continue
            self.hang_recheck_at[i] = self.now() + self.stall_timeout
            actions.append(
                Say(f"replica group {i}: its ranks wait for other groups, none hangs; not restarted")
            )
        return actions

    def _fail_hung_group(self, g: Group, hang: Hang) -> list[Action]:
        """The base class's hang verdict for this group's round, its root cause, then the group restart."""
        first = len(self.failures)
        with self._in_group(g):
            self.hang = hang
            actions = super().declare_hang()
        self.hang = None
        cause = self.failures[first] if len(self.failures) > first else None
        if cause is not None:
            traceback = cause.get("traceback") or ""
            where = f"rank {cause['rank']} on {cause['node']}" if cause.get("rank") is not None else "?"
            text = f"root cause (replica group {g.index}, round {g.round}): {where}: {cause['error']}"
            actions += [
                Record(events.root_cause(cause, traceback=traceback, exit_ts=cause.get("ts"))),
                Say(text + ("\n" + traceback.rstrip() if traceback else "")),
            ]
        return actions + self._stop_group(g, RestartCause.WORKER_FAILED)

    def stop_after_hang(self) -> list[Action]:
        return []  # only the hung group stops (_fail_hung_group)
