"""What must hold in every simulated week with slow nodes (hpcelastic/sim/slow.py), checked as the week runs.

- ``healthy_kept``: a node is swapped out or excluded for slowness only if it was slow in this allocation
  (an episode of its own at :data:`~hpcelastic.sim.slow.HEALTHY_SPEED` or less), never for noise, a
  job-wide slowdown, a workload stripe or a misattributed window.
- ``slow_handled``: a node that costs the job 30 % or more of its pace, without a break, from a time when
  the detector's baseline was the job's healthy pace (a node slow since the baseline was learned is the
  job's own pace to it; a node at 70 % beside one at 86 % the baseline already holds costs it 18 %), is
  reported within :func:`~hpcelastic.sim.slow.report_bound_s` of the time the pace judges (10 minutes for
  the detector's usual windows; time in saves not counted, told of or not: a save makes no steps); with
  ``slow.action`` ``swap`` it is swapped out at the first checkpoint after its slowdown has cost a swap
  (:func:`~hpcelastic.sim.slow.swap_bound_s`), when a checked, fast spare is free and the swap clearly
  pays (twice its cost in the time left); with ``exclude`` or ``swap`` it is among the nodes excluded at
  the requeue once it cost that much.
- ``swaps_within_spares``: a swap takes a free spare of this allocation, never more swaps than spares.
- ``spare_fit``: the spare a swap takes was checked and is not slow itself.
- ``slow_time_adds_up``: the ledger's slow time (the policy's ``slow_time_s`` over the verdicts' windows)
  matches the model's truth over the same seconds against the same baseline, within the detector's
  measurement error there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hpcelastic.sim.invariants import Violation

if TYPE_CHECKING:
    from hpcelastic.sim.slow import SlowSim

INVARIANTS = ("healthy_kept", "slow_handled", "swaps_within_spares", "spare_fit", "slow_time_adds_up")
#: Seconds of allowed rounding in ``slow_time_adds_up``.
TOLERANCE_S = 1e-6


@dataclass
class SlowChecker:
    """Collects the violations of one week."""

    violations: list[Violation] = field(default_factory=list)

    def fail(self, sim: SlowSim, invariant: str, detail: str) -> None:
        self.violations.append(Violation(invariant, sim.week.seed, sim.t, detail, sim.week.replay()))

    def acted(self, sim: SlowSim, node: str, what: str) -> None:
        """A swap or an exclusion of ``node`` was ordered."""
        if sim.healthy(node):
            self.fail(sim, "healthy_kept", f"{what} of {node}, which was not slow in this allocation")

    def swapped(self, sim: SlowSim, node: str, spare: str) -> None:
        """Before ``spare`` takes ``node``'s place."""
        alloc = sim.alloc
        if spare not in alloc.free_spares:
            used = f"{alloc.swaps} swap(s) already, {len(alloc.spares)} spare(s)"
            self.fail(sim, "swaps_within_spares", f"swap of {node} for {spare}, not a free spare ({used})")
        if not sim.checked(spare):
            self.fail(sim, "spare_fit", f"swap of {node} for {spare}, a spare not checked yet")
        elif not sim.fast(spare):
            self.fail(sim, "spare_fit", f"swap of {node} for {spare}, a spare that is slow itself")

    def after_window(self, sim: SlowSim) -> None:
        """Every run of 30 % or more that has lasted the bound was reported."""
        for run in sim.alloc.runs.values():
            if run.reported_checked or not run.visible or run.judged_s < sim.report_bound:
                continue
            run.reported_checked = True
            if not sim.reported(run.node):
                self.fail(
                    sim,
                    "slow_handled",
                    f"{run.node} {run.slowdown:.0%} slow since t={run.since / 3600:.2f} h, not reported "
                    f"within {sim.report_bound:.0f} s",
                )

    def at_checkpoint(self, sim: SlowSim) -> None:
        """After the orders of a window in which a checkpoint completed: due swaps were made."""
        for run in list(sim.alloc.runs.values()):
            if sim.swap_due(run):
                self.fail(
                    sim,
                    "slow_handled",
                    f"{run.node} {run.slowdown:.0%} slow since t={run.since / 3600:.2f} h, a fit spare free "
                    f"and {sim.left_s():.0f} s left: not swapped at this checkpoint",
                )

    def at_allocation_end(self, sim: SlowSim, excluded: tuple[str, ...]) -> None:
        alloc = sim.alloc
        for node in excluded:
            self.acted(sim, node, "exclusion")
        for node in sorted(alloc.must_exclude - set(excluded)):
            self.fail(
                sim, "slow_handled", f"{node} cost the job a swap and more, not excluded at the requeue"
            )
        if abs(alloc.ledger_s - alloc.model_s) > alloc.error_s + TOLERANCE_S:
            self.fail(
                sim,
                "slow_time_adds_up",
                f"ledger {alloc.ledger_s:.1f} s slow, model {alloc.model_s:.1f} s (measurement error "
                f"{alloc.error_s:.1f} s)",
            )


def summary(violations: list[Violation]) -> dict[str, int]:
    """Violations per invariant (every invariant listed)."""
    counts = dict.fromkeys(INVARIANTS, 0)
    for v in violations:
        counts[v.invariant] += 1
    return counts
