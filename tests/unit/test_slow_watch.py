"""The coordinator's slow-node watch (hpcelastic/slow/watch.py) and what carries its orders out: events,
exclusions at the requeue (``JobState.slow_node`` into ``Finish.bad_nodes``), retirements; the spare check;
the saves it sees; the ledger's ``slow`` cause; the messages and the ``--slow`` text."""

from __future__ import annotations

import pytest

from hpcelastic import events
from hpcelastic.agent.job_state import JobState
from hpcelastic.agent.messages import (
    FROM_AGENT,
    FROM_COORDINATOR,
    Retire,
    SlowSample,
    SpeedCheck,
    decode,
    encode,
)
from hpcelastic.errors import UserError
from hpcelastic.events import EventLog
from hpcelastic.reasons import Reason
from hpcelastic.record.ledger import build_ledger, slow_time_s
from hpcelastic.slow import policy, speed
from hpcelastic.slow.policy import Order, SlowAction, SlowOrder, SlowSettings
from hpcelastic.slow.verdict import PaceWindow, SlowKind
from hpcelastic.slow.watch import CHECKPOINT_FRESH_S, SlowWatch, WatchOut


def _watch(**kw: object) -> SlowWatch:
    w = SlowWatch(SlowSettings(**kw), coordinator_host="n0")  # type: ignore[arg-type]
    w.round_started(attempt=2, round_=1, now=100.0, world_size=4, nodes=("n0", "n1"), spares=("s0", "s1"))
    return w


def test_orders_become_events_exclusions_and_retirements() -> None:
    w, out = _watch(), WatchOut()
    orders = (
        SlowOrder(Order.REPORT, "n1", SlowKind.COMPUTE, 0.5, "slow for 1 min", rank=3),
        SlowOrder(Order.EXCLUDE, "n1", SlowKind.COMPUTE, 0.5, "it cost 40 s", rank=3),
        SlowOrder(Order.SWAP, "n1", SlowKind.COMPUTE, 0.5, "gain 10 min", spare="s0", rank=3),
        SlowOrder(Order.SWAP, "n0", SlowKind.NETWORK, 0.4, "gain 9 min", spare="s0"),
        SlowOrder(Order.REPORT, None, SlowKind.JOB_WIDE, 0.3, "no node stands out"),
    )
    w._carry_out(orders, out)
    slow = [e.fields for e in out.events if e.name is events.NODE_SLOW]
    assert [(e["node"], e["action"], e["rank"], e["kind"]) for e in slow] == [
        ("n1", "report", 3, "compute"),
        ("n1", "exclude", 3, "compute"),
        ("n1", "swap", 3, "compute"),
    ]  # the coordinator's own node is never retired: its exclusion waits for the requeue
    assert [e.fields["slowdown"] for e in out.events if e.name is events.JOB_SLOW] == [0.3]
    assert out.exclude == ["n1"]
    assert [node for node, _ in out.retire] == ["n1"] and "s0" in out.retire[0][1]
    assert all(e.fields["attempt"] == 2 and e.fields["round"] == 1 for e in out.events)


def test_a_spare_takes_a_place_only_checked_and_fast() -> None:
    w = _watch()
    assert w._spare("s0") == policy.Spare("s0")  # no check yet: unchecked
    w.speed_check("n0", 1000.0)
    w.speed_check("n1", 900.0)
    w.speed_check("s0", 500.0)
    assert w._spare("s0") == policy.Spare("s0", checked=True, fast=False)
    w.speed_check("s0", 950.0)
    assert w._spare("s0") == policy.Spare("s0", checked=True, fast=True)
    assert [s.node for s in w._job_view(True).spares] == ["s0"]  # only the next spare can be promoted
    assert w._job_view(True, 50.0).allocation_left_s is None  # no Slurm end time: unknown
    w.time_left = lambda now: 1000.0 - now
    assert w._job_view(True, 400.0).allocation_left_s == 600.0
    assert speed.measure(0.05) > 0


def test_a_checkpoint_counts_as_just_written_after_its_saves_end() -> None:
    w = _watch()
    w.report("n0", SlowSample(1, 0, saving=True, save_age_s=0.0), 110.0)
    assert not w._checkpoint_just_done(111.0)  # still saving
    w.report("n0", SlowSample(1, 0, saving=False, save_age_s=1.0), 115.0)
    assert w._checkpoint_just_done(116.0)
    assert not w._checkpoint_just_done(115.0 + CHECKPOINT_FRESH_S + 1)
    w.report("n1", SlowSample(1, 0, saving=False, save_age_s=2.0), 200.0)  # a save too quick to see open
    assert w._checkpoint_just_done(199.0 + CHECKPOINT_FRESH_S - 1)
    w.report("n1", SlowSample(0, 0, saving=False, save_age_s=0.0), 300.0)  # another round's: ignored
    assert not w._checkpoint_just_done(301.0)


def test_the_swap_cost_is_a_rounds_start_to_its_first_step() -> None:
    from hpcelastic.slow.sample import RankSample

    w = _watch()
    assert w._job_view(False).cost_s == policy.UNMEASURED_SWAP_COST_S
    w.report("n0", SlowSample(1, 0, ranks=(RankSample(0, 0, 0),)), 105.0)
    assert w.swap_cost_s is None  # no step yet
    w.report("n0", SlowSample(1, 0, ranks=(RankSample(0, 3, 0),)), 118.0)
    assert w._job_view(False).cost_s == pytest.approx(18.0)


def test_slow_time_is_recorded_while_it_grows_and_flushed_at_the_end() -> None:
    w = _watch()
    window = PaceWindow(100.0, 110.0, 1.0, 2.0)
    w.verdict_windows.append(window)
    first = w._slow_time_event(120.0)
    assert [e.fields["lost_s"] for e in first] == [5.0]
    assert w._slow_time_event(121.0) == []  # nothing new
    w.verdict_windows.append(PaceWindow(110.0, 120.0, 1.0, 2.0))
    w.history = policy.SlowHistory(job=policy.Evidence(recent=(True,)))
    assert w._slow_time_event(125.0) == []  # a spell goes on: at most once a minute
    assert [e.fields["lost_s"] for e in w.flush(126.0)] == [10.0]
    log = EventLog([{"event": "slow_time", "attempt": 0, "round": 0, "lost_s": 4.0}] + [
        {"event": "slow_time", "attempt": 0, "round": 1, "lost_s": s} for s in (5.0, 10.0)
    ])  # fmt: skip
    assert slow_time_s(log) == 14.0  # the latest of each round


def test_the_ledger_charges_slow_time_out_of_productive() -> None:
    t = 1000.0
    recs = [
        {"event": "attempt_started", "ts": t, "attempt": 0, "job_id": "1", "nodes": ["a"],
         "restart_count_slurm": 0},
        {"event": "rendezvous", "ts": t + 1, "round": 0, "hosts": ["a"], "world_size": 1},
        {"event": "progress", "ts": t + 2, "attempt": 0, "round": 0, "step": 1, "step_ts": t + 2,
         "mark": "first"},
        {"event": "slow_time", "ts": t + 60, "attempt": 0, "round": 0, "lost_s": 20.0, "baseline_rate": 1.0},
        {"event": "progress", "ts": t + 100, "attempt": 0, "round": 0, "step": 90, "step_ts": t + 100,
         "mark": "last"},
        {"event": "attempt_ended", "ts": t + 101, "attempt": 0, "reason": "succeeded", "action": "none"},
    ]  # fmt: skip
    without = build_ledger(EventLog([r for r in recs if r["event"] != "slow_time"]))
    ledger = build_ledger(EventLog(recs))
    assert ledger.productive_s == pytest.approx(without.productive_s - 20.0)
    assert ledger.badput_by_cause["slow"] == ledger.badput_by_phase["slow"] == 20.0
    assert ledger.allocated_s == without.allocated_s


def test_a_slow_node_is_a_bad_node_at_the_attempts_end() -> None:
    state = JobState(
        hosts=["a", "b"], min_nodes=2, max_restarts=0, master_addr="::1", new_port=lambda: 1, rdzv_timeout=9
    )
    state.slow_node("b")
    state.slow_node("b")
    state.finish(Reason.SUCCEEDED)
    assert state.result is not None and state.result.bad_nodes == ("b",)


def test_messages_and_settings_round_trip() -> None:
    sample = SlowSample(3, 7, 0.001, saving=True, save_age_s=1.5)
    assert decode(FROM_AGENT, encode(sample)) == sample
    assert decode(FROM_AGENT, encode(SpeedCheck(12.5))) == SpeedCheck(12.5)
    assert decode(FROM_COORDINATOR, encode(Retire(2, "slow"))) == Retire(2, "slow")
    s = SlowSettings(SlowAction.EXCLUDE, 0.3, 4)
    assert SlowSettings.from_text(s.to_text()) == s
    assert not SlowSettings.from_text("off,0.2,5").on
    with pytest.raises(UserError, match="--slow"):
        SlowSettings.from_text("swap")
    with pytest.raises(UserError, match="slow.action"):
        SlowSettings.from_text("sawp,0.2,5")
