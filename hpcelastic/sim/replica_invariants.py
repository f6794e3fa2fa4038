"""What must hold in every simulated week with torchft replica groups (hpcelastic/sim/replicas.py), checked as
the week runs (after every coordinator decision, group round, attempt and at the week's end).

- ``group_isolated``: a group's restart never touches another group's workers: a node's workers are told
  to stop only when their own group had a fault since its round began, or when the job-wide path took over
  (fewer than ``--min-replica-groups`` groups left, the coordinator's node lost, a preemption).
- ``left_out_not_training``: a group left out, or stopped for a restart, is never counted as training: the
  replica ledger's productive time of a group never reaches into a time when its workers were stopped or
  dead (from then to its next first step; a group left out: to the end of its epoch).
- ``fence_holds``: when a group's round starts, no worker of that group from an earlier round lives on a
  node outside the new round (a silent node's workers are surely stopped before its place is reused).
- ``job_wide_once``: below ``--min-replica-groups`` the job-wide path takes over, exactly once: a decision
  that leaves fewer live groups than the minimum stops the job-wide round (the phase leaves ``running``),
  and every job-wide restart (an epoch after the attempt's first) follows exactly one ``restarting`` record
  of the job-wide budget.
- ``progress_kept`` and ``node_evidence`` (as in :mod:`hpcelastic.sim.invariants`): an attempt that wrote a
  checkpoint beyond every earlier one is never abandoned (only ``--max-requeues`` may end it), and a node is
  excluded only on evidence about it (a fault of its own), never a bystander of another group's trouble.
  Allowed: the only other node still connected when the coordinator's own link was cut, lost by silence: the
  coordinator cannot tell whose link failed and holds it against that node, as a job of two nodes does with
  a node that died (tests/slurm/test_node_deaths_slurm.py pins that).
- ``time_adds_up``: the ledger's segments and its productive time plus badput add up to the allocated time,
  and every group lane's spans to its epoch's time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcelastic.agent.job_state import Phase, Record
from hpcelastic.record import ledger
from hpcelastic.sim.invariants import Violation

if TYPE_CHECKING:
    from hpcelastic.lifecycle.policy import Decision
    from hpcelastic.sim.replicas import ReplicaSim

INVARIANTS = (
    "group_isolated",
    "left_out_not_training",
    "fence_holds",
    "job_wide_once",
    "progress_kept",
    "node_evidence",
    "time_adds_up",
)
#: Seconds of allowed rounding (the ledger reads times back from the events).
TOLERANCE_S = 1e-3


def _events(actions: Sequence[Any], name: str) -> list[dict[str, Any]]:
    return [a.event.fields for a in actions if isinstance(a, Record) and a.event.name.value == name]


@dataclass
class ReplicaChecker:
    """Collects the violations of one week."""

    violations: list[Violation] = field(default_factory=list)
    #: ``restarting`` records (the job-wide budget) since the attempt's last epoch began.
    job_restarts: int = 0

    def fail(self, sim: ReplicaSim, invariant: str, detail: str) -> None:
        self.violations.append(Violation(invariant, sim.week.seed, sim.t, detail, sim.week.replay()))

    def after_call(self, sim: ReplicaSim, before: tuple[str, int], actions: Sequence[Any]) -> None:
        """After one decision of the coordinator's state (before its actions are applied)."""
        st = sim.st
        assert st is not None
        sim.group_restarts += len(_events(actions, "replica_group_restarting"))
        sim.drops += len(_events(actions, "replica_group_dropped"))
        self.job_restarts += len(_events(actions, "restarting"))
        phase_before, _ = before
        live = len(st.live_groups())
        if phase_before == Phase.RUNNING.value and st.phase is Phase.STOPPING:
            sim.job_wide_stops += 1
        if st.groups and st.phase is Phase.RUNNING and live < sim.week.min_groups:
            self.fail(
                sim,
                "job_wide_once",
                f"{live} replica group(s) live, fewer than --min-replica-groups {sim.week.min_groups}, "
                "and the job-wide path did not take over",
            )

    def epoch_started(self, sim: ReplicaSim) -> None:
        """Every group starts together: the attempt's first epoch, or a job-wide restart."""
        if sim.epochs > 1 and self.job_restarts != 1:
            self.fail(
                sim,
                "job_wide_once",
                f"job-wide restart (epoch {sim.epochs} of attempt {sim.attempt}) after {self.job_restarts} "
                "'restarting' records of the job-wide budget, not one",
            )
        self.job_restarts = 0

    def stop_sent(self, sim: ReplicaSim, node: int, group: int) -> None:
        """The coordinator told ``node`` (running workers of ``group``) to stop them."""
        st = sim.st
        if st is None or group in sim.faulted:
            return
        if any(n not in st.members for n in sim.group_round.get(group, (0, []))[1]):
            return  # the coordinator lost a node of the group: the group's own fault, as far as it can tell
        job_wide = st.phase is not Phase.RUNNING and (
            len(st.live_groups()) < sim.week.min_groups or 0 not in st.members or sim.stop is not None
        )
        if not job_wide:
            self.fail(
                sim,
                "group_isolated",
                f"node {sim.hosts[node]} of replica group {group} told to stop, though its group had no "
                f"fault and {len(st.live_groups())} group(s) live (minimum {sim.week.min_groups})",
            )

    def round_spawn(self, sim: ReplicaSim, group: int, round_: int, nodes: Sequence[int]) -> None:
        """Group ``group``'s round ``round_`` starts on ``nodes`` (each of them kills its own old workers)."""
        new = set(nodes)
        for n, w in sim.workers.items():
            if n not in new and w.group == group and w.round != round_ and w.dead_at > sim.t:
                left = "forever" if w.dead_at == math.inf else f"{w.dead_at - sim.t:.1f} s more"
                self.fail(
                    sim,
                    "fence_holds",
                    f"replica group {group}'s round {round_} started while node {sim.hosts[n]}'s workers "
                    f"of its round {w.round} lived on ({left})",
                )

    def after_decision(self, sim: ReplicaSim, decision: Decision) -> None:
        """The real policy decided the attempt's fate."""
        if decision.action.value == "skip" and decision.skip is not None:
            advanced = sim.attempt_ckpt is not None and sim.attempt_ckpt > sim.attempt_ckpt_before
            if advanced and decision.skip.value not in ("cancelled", "limit_reached"):
                self.fail(
                    sim,
                    "progress_kept",
                    f"attempt {sim.attempt} advanced the job and was abandoned ({decision.skip.value})",
                )
        if decision.action.value == "bring_back":
            blameless = [
                n
                for n in decision.exclude
                if not sim.evidence.get(n) and n not in sim.dead and n not in sim.alone_with_coordinator
            ]
            if blameless:
                self.fail(
                    sim,
                    "node_evidence",
                    f"attempt {sim.attempt} excluded {', '.join(blameless[:3])} without evidence about them",
                )

    def after_week(self, sim: ReplicaSim) -> None:
        """The replica ledger of the week's log against the model's truth."""
        built = sim.hooks.build_ledger(sim.log.view(), now=sim.t)
        outside = (ledger.Phase.PENDING, ledger.Phase.QUEUED)
        inside = sum(s.seconds for s in built.segments if s.phase not in outside)
        counted = built.productive_s + getattr(built, "unknown_s", 0.0) + sum(built.badput_by_phase.values())
        for what, got, want in (
            ("allocated", built.allocated_s, sim.allocated),
            ("segments", inside, built.allocated_s),
            ("productive + badput", counted, built.allocated_s),
        ):
            if abs(got - want) > TOLERANCE_S:
                self.fail(sim, "time_adds_up", f"the ledger's {what}: {got:.3f} s, not {want:.3f} s")
        figures = built.replica_groups
        for lane in figures.lanes if figures is not None else []:
            spans = sum(s.t1 - s.t0 for s in lane.spans)
            if abs(spans - (lane.end - lane.start)) > TOLERANCE_S:
                self.fail(
                    sim,
                    "time_adds_up",
                    f"attempt {lane.attempt}, group {lane.group}: lane spans {spans:.3f} s, its epoch "
                    f"{lane.end - lane.start:.3f} s",
                )
            off = sim.off.get((lane.attempt, lane.group), [])
            for s in lane.spans:
                if s.phase != "productive":
                    continue
                over = sum(max(0.0, min(s.t1, b) - max(s.t0, a)) for a, b in off)
                if over > TOLERANCE_S:
                    self.fail(
                        sim,
                        "left_out_not_training",
                        f"attempt {lane.attempt}, group {lane.group}: {over:.1f} s counted productive from "
                        f"t={s.t0 / 3600:.3f} h while its workers were stopped or dead",
                    )
                    break
