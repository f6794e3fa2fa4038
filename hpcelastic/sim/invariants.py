"""What must hold in every simulated week, checked as the week runs (after every decision, round and attempt).

- ``progress_kept``: an attempt that advanced the job (wrote a checkpoint beyond every earlier one, published
  or not) is never abandoned, nor one that trained (any rank made a step) called a start-up failure; only
  a user's cancel or ``--max-requeues`` may end such a job.
- ``node_evidence``: a node is excluded only on evidence about it (a fault of its own: a worker failure
  there, a failed health check, its death, its own network), and never so many that the job cannot be
  scheduled on the partition once its down nodes are back (a pending job never reaches the decision that
  would release the exclusion; waiting for a repair is allowed).
- ``cancel_final``: a cancelled job never runs again.
- ``one_rank_one_round``: no worker of an earlier round is alive, with a rank of the new round, when it
  spawns.
- ``one_decision``: every attempt ends with exactly one decision.
- ``step_stop_blames_nobody``: Slurm's SIGTERM ending the step (a preemption without grace, a time limit
  the script did not stop for) reaches workers and agents in any order; once it came, a round that was
  running or preempting records no lost node, no root cause and no restart.
- ``time_adds_up``: productive time plus badput equals the allocated time, as the simulation counted
  them and in hpcelastic's lost-time ledger of the week's event log (its segments too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcelastic.sim.adapter import ledger_totals

if TYPE_CHECKING:
    from hpcelastic.sim.adapter import EndFacts
    from hpcelastic.sim.drive import DecisionLog, Sim, WeekResult

INVARIANTS = (
    "progress_kept",
    "node_evidence",
    "cancel_final",
    "one_rank_one_round",
    "one_decision",
    "step_stop_blames_nobody",
    "time_adds_up",
)
#: Seconds of allowed rounding between the two sides of ``time_adds_up``.
TIME_TOLERANCE_S = 1e-3


@dataclass(frozen=True)
class Violation:
    invariant: str
    seed: int
    ts: float
    detail: str
    replay: str

    def __str__(self) -> str:
        when = f"seed {self.seed}, t={self.ts / 3600:.2f} h"
        return f"{self.invariant} ({when}): {self.detail}; replay: {self.replay}"


@dataclass
class Checker:
    """Collects the violations of one week."""

    violations: list[Violation] = field(default_factory=list)

    def fail(self, sim: Sim, invariant: str, detail: str) -> None:
        self.violations.append(Violation(invariant, sim.week.seed, sim.t, detail, sim.week.replay()))

    def after_decision(self, sim: Sim, rec: DecisionLog, facts: EndFacts) -> None:
        if rec.action == "skip" and rec.skip not in ("cancelled", "limit_reached"):
            if rec.advanced:
                self.fail(
                    sim,
                    "progress_kept",
                    f"attempt {rec.attempt} advanced the job and was abandoned ({rec.skip})",
                )
            elif rec.trained and rec.skip == "startup_failure":
                self.fail(
                    sim, "progress_kept", f"attempt {rec.attempt} trained and was called a start-up failure"
                )
        if rec.action == "bring_back":
            blameless = [n for n in rec.exclude if not sim.evidence.get(n) and n not in sim.dead]
            if blameless:
                shown = ", ".join(blameless[:3]) + (
                    f" and {len(blameless) - 3} more" if len(blameless) > 3 else ""
                )
                self.fail(
                    sim,
                    "node_evidence",
                    f"attempt {rec.attempt} excluded {shown} without evidence about them",
                )
            self._schedulable(sim, rec, facts)
            if sim.cancelled:
                self.fail(sim, "cancel_final", f"attempt {rec.attempt} of a cancelled job was brought back")

    def _schedulable(self, sim: Sim, rec: DecisionLog, facts: EndFacts) -> None:
        """The exclusion leaves enough of the whole partition once its down nodes are back (an excluded node
        stays excluded while the job pends: no decision comes to release it)."""
        left = len(set(sim.partition) - set(rec.exclude))
        if left < facts.needed <= len(sim.partition):
            self.fail(
                sim,
                "node_evidence",
                f"attempt {rec.attempt} excluded {len(rec.exclude)} nodes: {left} nodes of the whole "
                f"partition left, the job needs {facts.needed}",
            )

    def round_spawn(self, sim: Sim, key: tuple[int, int], nodes: list[int], t: float) -> None:
        """Round ``key`` spawns on ``nodes`` at ``t`` (each of them killed its own old workers first)."""
        new = set(nodes)
        for n, (old, dead_at) in sim.workers.items():
            if n not in new and old != key and dead_at > t:
                self.fail(
                    sim,
                    "one_rank_one_round",
                    f"round {key[1]} of attempt {key[0]} spawned while node {sim.hosts[n]}'s workers of "
                    f"round {old[1]} lived on ({_left(dead_at - t)})",
                )

    def after_attempt(self, sim: Sim, t0: float, t1: float) -> None:
        if sim.week.cancel_at is not None and t0 > sim.week.cancel_at:
            self.fail(sim, "cancel_final", f"attempt {sim.attempt} started after the cancel")
        decided = sum(1 for d in sim.decisions if d.attempt == sim.attempt)
        tail = sim.log.records[sim.attempt_log :]
        logged = sum(1 for r in tail if r["event"] == "attempt_ended" and r.get("attempt") == sim.attempt)
        week_over = t1 >= sim.week_end
        if (decided, logged) != (1, 1) and not (week_over and decided == logged == 0):
            self.fail(
                sim,
                "one_decision",
                f"attempt {sim.attempt} ended with {decided} decisions ({logged} recorded)",
            )
        if sim.term_at is not None and sim.term_clean:
            blamed = [
                r["event"]
                for r in tail
                if r["ts"] >= sim.term_at and r["event"] in ("node_lost", "root_cause", "restarting")
            ]
            if blamed:
                self.fail(
                    sim,
                    "step_stop_blames_nobody",
                    f"attempt {sim.attempt}: after the step's SIGTERM the coordinator recorded "
                    + ", ".join(blamed),
                )
        spent = sum(sim.spans.values())
        if abs(spent - sim.allocated) > TIME_TOLERANCE_S:
            self.fail(sim, "time_adds_up", f"phases add up to {spent:.3f} s, allocated {sim.allocated:.3f} s")

    def after_week(self, sim: Sim, res: WeekResult) -> None:
        """The week's time, as the simulation counted it and as hpcelastic's ledger reads the log."""
        total = res.productive_s + sum(res.badput_s.values())
        if abs(total - res.allocated_s) > TIME_TOLERANCE_S:
            self.fail(
                sim,
                "time_adds_up",
                f"productive {res.productive_s:.3f} s + badput != allocated {res.allocated_s:.3f} s",
            )
        led = ledger_totals(sim.log, sim.t)
        checks = (
            ("allocated", led.allocated_s, res.allocated_s),
            ("segments", led.segments_s, led.allocated_s),
            ("productive + badput", led.productive_plus_badput_s, led.allocated_s),
        )
        for what, got, want in checks:
            if abs(got - want) > TIME_TOLERANCE_S:
                self.fail(sim, "time_adds_up", f"the ledger's {what}: {got:.3f} s, not {want:.3f} s")
                return


def _left(seconds: float) -> str:
    return "forever" if seconds == float("inf") else f"{seconds:.1f} s more"


def summary(violations: list[Violation]) -> dict[str, Any]:
    """Per invariant: how many weeks broke it and the first seeds."""
    out: dict[str, Any] = {}
    for v in violations:
        seeds = out.setdefault(v.invariant, [])
        if v.seed not in seeds:
            seeds.append(v.seed)
    return out
