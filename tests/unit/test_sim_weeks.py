"""500 simulated weeks drive the real decision code; each invariant catches a deliberately broken decision.

See hpcelastic/sim. A failing week prints its replay command (``python -m hpcelastic.sim --seed N``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable

from hpcelastic.agent.job_state import Action, JobState
from hpcelastic.lifecycle import policy
from hpcelastic.reasons import SkipReason
from hpcelastic.sim import model
from hpcelastic.sim.drive import Hooks, Sim, WeekResult, run_week, run_weeks

#: About 40 s a 1,000 weeks on one core. The 10,000 weeks (seeds 0-9999), beside the old decision code,
#: are bench/sim_weeks.py's; the tests run the first 500 of them.
WEEKS = 500


def test_five_hundred_weeks_keep_every_invariant() -> None:
    results = run_weeks(0, WEEKS, jobs=max(2, os.cpu_count() or 1))
    violations = [str(v) for r in results for v in r.violations]
    assert len(results) == WEEKS
    assert not violations, f"{len(violations)} violations, first:\n" + "\n".join(violations[:15])
    finished = sum(1 for r in results if r.outcome == "finished")
    assert finished > WEEKS // 3, f"only {finished} of {WEEKS} weeks finished"


def _first(
    seeds: Iterable[int], invariant: str, hooks: Callable[[model.Week], Hooks], nodes: int | None = None
) -> tuple[model.Week, WeekResult]:
    """The first week of ``seeds`` whose broken run breaks ``invariant``."""
    for seed in seeds:
        week = model.draw_week(seed, nodes)
        res = run_week(week, hooks(week))
        if any(v.invariant == invariant for v in res.violations):
            return week, res
    raise AssertionError(f"no week broke {invariant}")


def _clean(week: model.Week) -> None:
    assert run_week(week).violations == [], "the real decision code breaks it too"


def _broken_decide(wrap: Callable[..., policy.Decision]) -> Callable[[model.Week], Hooks]:
    return lambda week: Hooks(decide=lambda h, e, s: wrap(week, h, e, s))


def test_abandoning_a_progressing_job_is_caught() -> None:
    def gives_up_at_stops(
        week: model.Week, h: object, end: policy.AttemptEnd, s: policy.Settings
    ) -> policy.Decision:
        d = policy.decide(h, end, s)  # type: ignore[arg-type]
        if end.reason.is_stop:
            return dataclasses.replace(
                d, action=policy.Action.SKIP, skip=SkipReason.NO_PROGRESS, job_end=end.reason
            )
        return d

    week, res = _first(range(100), "progress_kept", _broken_decide(gives_up_at_stops), nodes=8)
    assert res.outcome == "abandoned:no_progress"
    _clean(week)


def test_excluding_a_node_without_evidence_is_caught() -> None:
    def blames_a_bystander(
        week: model.Week, h: object, end: policy.AttemptEnd, s: policy.Settings
    ) -> policy.Decision:
        d = policy.decide(h, end, s)  # type: ignore[arg-type]
        if d.action is policy.Action.BRING_BACK:
            return dataclasses.replace(d, exclude=(*d.exclude, f"n{week.partition - 1:04d}"))
        return d

    week, _ = _first(range(100), "node_evidence", _broken_decide(blames_a_bystander), nodes=16)
    _clean(week)


def test_bringing_back_a_cancelled_job_is_caught() -> None:
    def ignores_cancel(
        week: model.Week, h: object, end: policy.AttemptEnd, s: policy.Settings
    ) -> policy.Decision:
        return policy.decide(dataclasses.replace(h, cancelled=False), end, s)  # type: ignore[type-var]

    cancelled = (s for s in range(5000) if model.draw_week(s, 8).cancel_at is not None)
    week, res = _first(cancelled, "cancel_final", _broken_decide(ignores_cancel), nodes=8)
    assert res.outcome == "came_back_after_cancel"
    _clean(week)


class _Elastic(JobState):
    """Broken: restarts on the nodes it still has instead of ending the attempt (as if --nodes 1:N)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.min_nodes = 1


def test_a_round_beside_a_lost_nodes_workers_is_caught() -> None:
    blips = (s for s in range(5000) if model.draw_week(s, 64).blips_per_node_day > 0.002)
    week, res = _first(blips, "one_rank_one_round", lambda w: Hooks(job_state=_Elastic), nodes=64)
    assert any("lived on" in str(v) for v in res.violations)
    _clean(week)


class _DecidesOnTheFirstSignal(JobState):
    """Broken: decides on a worker the step's SIGTERM killed at once, and on each settled departure alone."""

    def _holding_for_the_steps_stop(self) -> bool:
        return False

    def _settle_leaving(self) -> list[Action]:
        leaving, self.leaving, self.leaving_until = self.leaving, {}, None
        actions: list[Action] = []
        for n, (reason, ts) in sorted(leaving.items()):
            actions += self.lost(n, reason, signalled_at=ts, stopped=True)
        return actions


def test_blaming_a_node_for_the_steps_stop_is_caught() -> None:
    week, res = _first(
        range(2000), "step_stop_blames_nobody", lambda w: Hooks(job_state=_DecidesOnTheFirstSignal)
    )
    assert any("root_cause" in str(v) or "restarting" in str(v) for v in res.violations)
    _clean(week)


def test_a_second_decision_for_one_attempt_is_caught() -> None:
    week, res = _first(
        range(10), "one_decision", lambda w: Hooks(recorded_exit=lambda log, attempt: None), nodes=8
    )
    _clean(week)


class _LosesSaves(Sim):
    """Broken bookkeeping: the time spent saving checkpoints is dropped."""

    def span(self, phase: str, until: float) -> None:
        if self.phase == "save":
            self.phase, self.phase_t = phase, until
            return
        super().span(phase, until)


def test_time_that_does_not_add_up_is_caught() -> None:
    week = model.draw_week(1, 8)
    res = _LosesSaves(week).run()
    assert any(v.invariant == "time_adds_up" for v in res.violations)
    _clean(week)


def test_a_week_replays_alone_and_a_violation_names_its_replay() -> None:
    week = model.draw_week(4242)
    a, b = run_week(week), run_week(model.draw_week(4242))
    assert (a.outcome, a.ettr, a.attempts, [d.ts for d in a.decisions]) == (
        b.outcome,
        b.ettr,
        b.attempts,
        [d.ts for d in b.decisions],
    )
    v = run_week(model.draw_week(1, 8), Hooks(recorded_exit=lambda log, attempt: None)).violations[0]
    assert str(v).endswith("replay: python -m hpcelastic.sim --seed 1 --nodes 8 -v")
    assert week.replay() == "python -m hpcelastic.sim --seed 4242 -v"
