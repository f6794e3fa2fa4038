"""Simulated weeks with slow nodes drive the real slow-node policy and the real detector's pace; each
invariant catches a deliberately broken rule (hpcelastic/sim/slow.py, hpcelastic/sim/slow_invariants.py).

The weeks here are a day long (a failing one prints its replay command, ``python -m hpcelastic.sim.slow
--seed N --days 1 -v``); bench/sim_slow_weeks.py runs 10,000 full weeks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from hpcelastic.sim.slow import Policy, SlowWeekResult, real, run_week
from hpcelastic.slow import policy
from hpcelastic.slow.policy import JobView, Order, SlowHistory, SlowOrder, SlowSettings, Spare
from hpcelastic.slow.verdict import PaceWindow

WEEKS = 300
DAYS = 1.0


def test_simulated_weeks_keep_every_invariant() -> None:
    results = [run_week(seed, days=DAYS) for seed in range(WEEKS)]
    violations = [str(v) for r in results for v in r.violations]
    assert not violations, f"{len(violations)} violations, first:\n" + "\n".join(violations[:15])
    stats = [r.stats for r in results]
    assert sum(s.swaps for s in stats) >= 10 and sum(s.exclusions for s in stats) >= 10
    assert sum(len(s.report_delays) for s in stats) >= 30  # runs of 30 % the invariant watched
    assert sum(s.job_wide_reports for s in stats) >= 10  # loads, stripes, unannounced saves
    assert sum(s.ledger_s for s in stats) > 0


def _broken(**funcs: Callable[..., Any]) -> Policy:
    p = real()
    for name, f in funcs.items():
        setattr(p, name, f)
    return p


def _first(invariant: str, broken: Policy, seeds: Iterable[int] = range(300)) -> SlowWeekResult:
    """The first week of ``seeds`` that the broken rule makes break ``invariant``; the real code keeps it."""
    for seed in seeds:
        res = run_week(seed, broken, days=DAYS)
        if any(v.invariant == invariant for v in res.violations):
            assert not run_week(seed, days=DAYS).violations, "the real code breaks it too"
            return res
    raise AssertionError(f"no week broke {invariant}")


def _hasty_observe(h: SlowHistory, w: PaceWindow, v: Any, s: SlowSettings) -> SlowHistory:
    return policy.observe(h, w, v, replace(s, windows=2, min_slowdown=0.05))


def test_acting_on_a_window_or_two_of_noise_is_caught() -> None:
    """Broken: two windows of 5 % and a swap that costs nothing are evidence enough."""
    broken = _broken(
        observe=_hasty_observe,
        decide=lambda h, job, s: policy.decide(h, replace(job, swap_cost_s=1.0), s),
    )
    res = _first("healthy_kept", broken)
    assert any("not slow in this allocation" in str(v) for v in res.violations)


def test_never_swapping_is_caught() -> None:
    """Broken: the ski rental never buys."""

    def decide(h: SlowHistory, job: JobView, s: SlowSettings) -> tuple[SlowOrder, ...]:
        return tuple(o for o in policy.decide(h, job, s) if o.order is not Order.SWAP)

    res = _first("slow_handled", _broken(decide=decide))
    assert any("not swapped at this checkpoint" in str(v) for v in res.violations)


def test_never_reporting_is_caught() -> None:
    def decide(h: SlowHistory, job: JobView, s: SlowSettings) -> tuple[SlowOrder, ...]:
        return tuple(o for o in policy.decide(h, job, s) if o.order is not Order.REPORT)

    res = _first("slow_handled", _broken(decide=decide))
    assert any("not reported within" in str(v) for v in res.violations)


def test_forgetting_the_exclusion_is_caught() -> None:
    res = _first("slow_handled", _broken(to_exclude=lambda h: ()))
    assert any("not excluded at the requeue" in str(v) for v in res.violations)


def test_swapping_in_a_spare_already_used_is_caught() -> None:
    """Broken: a spare that took a place still counts as free (more swaps than spares)."""
    used: list[str] = []

    def decide(h: SlowHistory, job: JobView, s: SlowSettings) -> tuple[SlowOrder, ...]:
        spares = job.spares or tuple(Spare(n, True, True) for n in used[-1:])
        orders = policy.decide(h, replace(job, spares=spares), s)
        used.extend(o.spare for o in orders if o.spare)
        return orders

    res = _first("swaps_within_spares", _broken(decide=decide))
    assert any("not a free spare" in str(v) for v in res.violations)


def test_a_spare_taken_unchecked_or_slow_is_caught() -> None:
    """Broken: every spare counts as checked and fast."""

    def decide(h: SlowHistory, job: JobView, s: SlowSettings) -> tuple[SlowOrder, ...]:
        spares = tuple(Spare(x.node, True, True) for x in job.spares)
        return policy.decide(h, replace(job, spares=spares), s)

    res = _first("spare_fit", _broken(decide=decide), seeds=range(150, 400))  # seeds 160, 242, 285 do
    assert any("not checked yet" in str(v) or "slow itself" in str(v) for v in res.violations)


def test_a_ledger_counting_slow_time_not_lost_time_is_caught() -> None:
    """Broken: the ledger counts the slow windows' whole length, not length x (1 - rate / baseline)."""
    res = _first("slow_time_adds_up", _broken(slow_time_s=lambda ws: sum(w.end - w.start for w in set(ws))))
    assert any("ledger" in str(v) for v in res.violations)
