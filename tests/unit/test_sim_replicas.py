"""Simulated weeks drive the real ReplicaJobState, requeue policy and replica ledger; each invariant catches a
deliberately broken rule (hpcelastic/sim/replicas.py, hpcelastic/sim/replica_invariants.py).

A failing week prints its replay command (``python -m hpcelastic.sim.replicas --seed N -v``); the 10,000-week
count, for this tree and the code before issue 31, is bench/sim_replica_weeks.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from hpcelastic.agent.replicas import ReplicaJobState
from hpcelastic.lifecycle import policy
from hpcelastic.reasons import RestartCause, SkipReason
from hpcelastic.record import ledger
from hpcelastic.sim.replica_invariants import INVARIANTS
from hpcelastic.sim.replicas import Hooks, ReplicaWeekResult, draw, run_week

WEEKS = 200


def test_simulated_weeks_keep_every_invariant() -> None:
    results = [run_week(seed) for seed in range(WEEKS)]
    violations = [str(v) for r in results for v in r.violations]
    assert not violations, f"{len(violations)} violations, first:\n" + "\n".join(violations[:15])
    # The weeks reach every path the invariants watch.
    assert sum(r.group_restarts for r in results) > WEEKS
    assert sum(r.drops for r in results) > 10
    assert sum(r.job_wide_stops for r in results) > 10
    assert {r.outcome for r in results} >= {"finished", "abandoned:limit_reached"}


def _first(invariant: str, hooks: Hooks, seeds: Iterable[int] = range(300)) -> ReplicaWeekResult:
    """The first week of ``seeds`` that the broken rule makes break ``invariant``; the real code keeps it."""
    for seed in seeds:
        res = run_week(seed, hooks)
        if any(v.invariant == invariant for v in res.violations):
            assert not run_week(seed).violations, "the real code breaks it too"
            return res
    raise AssertionError(f"no week broke {invariant}")


class _StopsEveryGroup(ReplicaJobState):
    """Broken: a group's failure stops every group (the job-wide reflex, with replica groups)."""

    def _stop_group(self, g: Any, cause: RestartCause) -> list[Any]:
        actions = super()._stop_group(g, cause)
        for other in self.live_groups():
            if other is not g and other.phase.value == "running":
                actions += super()._stop_group(other, cause)
        return actions


class _NoFence(ReplicaJobState):
    """Broken (the code before issue 31): a node lost by silence does not fence its group's restart."""

    def lost(self, node_rank: int, reason: str, **kw: Any) -> list[Any]:
        kw["silent"] = False
        return super().lost(node_rank, reason, **kw)


class _GoesOnBelowTheMinimum(ReplicaJobState):
    """Broken: below --min-replica-groups the groups left go on; only the coordinator's loss stops the job."""

    def _job_wide_stop(self, cause: RestartCause) -> list[Any]:
        return super()._job_wide_stop(cause) if 0 not in self.members else []


def _left_out_counted(view: Any, now: float) -> ledger.Ledger:
    """Broken ledger: a group left out counts as productive."""
    built = ledger.build_ledger(view, now=now)
    for lane in built.replica_groups.lanes if built.replica_groups is not None else []:
        lane.spans = [
            dataclasses.replace(s, phase="productive") if s.phase == "dropped" else s for s in lane.spans
        ]
    return built


def _lane_short(view: Any, now: float) -> ledger.Ledger:
    """Broken ledger: a group lane loses its last span (its epoch's time no longer adds up)."""
    built = ledger.build_ledger(view, now=now)
    for lane in built.replica_groups.lanes if built.replica_groups is not None else []:
        if len(lane.spans) > 1:
            lane.spans = lane.spans[:-1]
    return built


def test_group_isolated_catches_a_failure_that_stops_every_group() -> None:
    res = _first("group_isolated", Hooks(job_state=_StopsEveryGroup))
    assert "told to stop, though its group had no fault" in str(res.violations[0])


def test_fence_holds_catches_a_group_restart_that_ignores_the_fence() -> None:
    res = _first("fence_holds", Hooks(job_state=_NoFence))
    assert "lived on" in next(str(v) for v in res.violations if v.invariant == "fence_holds")


def test_job_wide_once_catches_groups_going_on_below_the_minimum() -> None:
    res = _first("job_wide_once", Hooks(job_state=_GoesOnBelowTheMinimum))
    assert "did not take over" in next(str(v) for v in res.violations if v.invariant == "job_wide_once")


def test_left_out_not_training_catches_a_ledger_that_counts_a_dropped_group() -> None:
    res = _first("left_out_not_training", Hooks(build_ledger=_left_out_counted))
    assert "counted productive" in next(
        str(v) for v in res.violations if v.invariant == "left_out_not_training"
    )


def test_time_adds_up_catches_a_lane_that_loses_time() -> None:
    res = _first("time_adds_up", Hooks(build_ledger=_lane_short))
    assert "lane spans" in next(str(v) for v in res.violations if v.invariant == "time_adds_up")


def _gives_up_at_stops(h: Any, end: policy.AttemptEnd, s: policy.Settings) -> policy.Decision:
    """Broken: a preempted or timed-out attempt ends the job."""
    d = policy.decide(h, end, s)
    if end.reason.is_stop:
        return dataclasses.replace(
            d, action=policy.Action.SKIP, skip=SkipReason.NO_PROGRESS, job_end=end.reason
        )
    return d


def test_progress_kept_catches_a_policy_that_abandons_a_progressing_job() -> None:
    res = _first("progress_kept", Hooks(decide=_gives_up_at_stops))
    assert res.outcome == "abandoned:no_progress"


def test_node_evidence_catches_an_exclusion_of_a_bystander() -> None:
    def blames_the_last_node(h: Any, end: policy.AttemptEnd, s: policy.Settings) -> policy.Decision:
        d = policy.decide(h, end, s)
        if d.action is policy.Action.BRING_BACK:
            return dataclasses.replace(d, exclude=(*d.exclude, f"r{draw(seed).partition - 1:04d}"))
        return d

    for seed in range(300):
        res = run_week(seed, Hooks(decide=blames_the_last_node))
        if any(v.invariant == "node_evidence" for v in res.violations):
            assert not run_week(seed).violations
            return
    raise AssertionError("no week broke node_evidence")


def test_every_invariant_has_a_broken_rule_here() -> None:
    tested = {"group_isolated", "fence_holds", "job_wide_once", "left_out_not_training", "time_adds_up"}
    tested |= {"progress_kept", "node_evidence"}
    assert tested == set(INVARIANTS)
