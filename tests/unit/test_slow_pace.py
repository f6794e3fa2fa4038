"""The job's pace (hpcelastic/slow/pace.py): windows, the baseline, a sustained drop, lost time."""

from __future__ import annotations

import random

import pytest

from hpcelastic.slow.pace import Judged, Judgement, Pace, PaceConfig

CFG = PaceConfig(window_s=10.0, consecutive=3, min_baseline=3, warmup_steps=5, lag_s=12.0, settle_s=0.0)


def feed(
    pace: Pace, rate_at, until: float, t: float = 0.0, steps: int = 0, sources: int = 2, jitter: float = 0.0
):
    """Sources stepping at ``rate_at(t)`` steps/s from ``t`` to ``until``; the last (t, steps)."""
    rng = random.Random(1)
    while t < until:
        t += 1.0 / rate_at(t) * (1 + rng.uniform(-jitter, jitter))
        steps += 1
        for s in range(sources):
            pace.sample(s, t, steps)
    return t, steps


def judged(pace: Pace, now: float) -> list[Judged]:
    return pace.close(now)


def test_steady_training_is_healthy_and_its_rate_is_the_baseline() -> None:
    pace = Pace(CFG)
    feed(pace, lambda t: 4.0, 200.0)
    out = judged(pace, 200.0)
    kinds = [j.judgement for j in out]
    assert Judgement.SLOW not in kinds and kinds.count(Judgement.HEALTHY) >= 15
    assert pace.baseline == pytest.approx(4.0, rel=0.01)
    assert all(j.window.steps_per_s == pytest.approx(4.0, rel=0.05) for j in out)


def test_a_sustained_drop_hands_out_its_windows_once_it_is_sustained() -> None:
    pace = Pace(CFG)
    t, steps = feed(pace, lambda t: 4.0, 100.0)
    healthy = judged(pace, t)
    feed(pace, lambda t: 2.0, 125.0, t, steps)
    held = judged(pace, 125.0)
    assert all(j.judgement is not Judgement.SLOW for j in held)  # two slow windows: not yet a drop
    t, steps = feed(pace, lambda t: 2.0, 160.0, 125.0, steps)
    out = judged(pace, 160.0)
    slow = [j for j in out if j.judgement is Judgement.SLOW]
    assert len(slow) >= 3 and all(j.sustained for j in slow)
    starts = [j.window.start for j in healthy + held + out]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)  # each window once, in order
    full = [j for j in slow if j.window.start >= 100.0]
    assert full[0].window.ratio == pytest.approx(0.5, abs=0.03)
    assert pace.baseline == pytest.approx(4.0, rel=0.01)  # slow windows never enter it


def test_a_transient_dip_is_handed_out_unsustained_when_the_pace_comes_back() -> None:
    pace = Pace(CFG)
    t, steps = feed(pace, lambda t: 4.0, 100.0)
    t, steps = feed(pace, lambda t: 2.0 if t < 118 else 4.0, 160.0, t, steps)
    out = judged(pace, 160.0)
    slow = [j for j in out if j.judgement is Judgement.SLOW]
    assert slow and not any(j.sustained for j in slow)


def test_slow_first_steps_of_a_round_are_not_judged_nor_counted() -> None:
    pace = Pace(CFG)
    pace.round_started(0.0)
    t, steps = feed(pace, lambda t: 0.1 if t < 40 else 4.0, 200.0)  # 4 steps take 40 s: compiling
    out = judged(pace, 200.0)
    assert out[0].judgement is Judgement.WARMUP
    assert Judgement.SLOW not in [j.judgement for j in out]
    assert pace.baseline == pytest.approx(4.0, rel=0.02)


def test_a_long_checkpoint_save_is_neither_slow_nor_part_of_the_baseline() -> None:
    pace = Pace(CFG)
    t, steps = feed(pace, lambda t: 4.0, 100.0)
    pace.saving(100.0)
    t, steps = feed(pace, lambda t: 4.0 if t < 100 or t > 140 else 0.5, 140.0, t, steps)
    pace.saving(100.0, 140.0)
    t, steps = feed(pace, lambda t: 4.0, 200.0, t, steps)
    out = judged(pace, 200.0)
    during = [j for j in out if 100 <= j.window.start < 140]
    assert during and all(j.judgement is Judgement.SAVE for j in during)
    assert Judgement.SLOW not in [j.judgement for j in out]
    assert pace.baseline == pytest.approx(4.0, rel=0.02)


def test_a_save_inside_a_drop_neither_breaks_nor_extends_it() -> None:
    pace = Pace(CFG)
    t, steps = feed(pace, lambda t: 4.0, 100.0)
    judged(pace, t)
    pace.saving(121.0, 129.0)
    feed(pace, lambda t: 2.0, 160.0, t, steps)
    out = judged(pace, 160.0)
    run = [j for j in out if j.window.start >= 100]
    assert [j.judgement for j in run[:4]] == [Judgement.SLOW, Judgement.SLOW, Judgement.SAVE, Judgement.SLOW]
    assert all(j.sustained for j in run[:4])


def test_steps_longer_than_a_window_still_give_rates() -> None:
    pace = Pace(CFG)
    feed(pace, lambda t: 1 / 25.0, 600.0)  # one step every 25 s
    feed(pace, lambda t: 1 / 50.0, 900.0, 600.0, 24)
    out = judged(pace, 900.0)
    assert any(j.judgement is Judgement.HEALTHY for j in out)
    assert [j for j in out if j.judgement is Judgement.SLOW and j.sustained]


def test_a_window_waits_for_every_source_until_the_lag_then_judges_without_the_silent_one() -> None:
    pace = Pace(CFG)
    for i in range(1, 200):
        pace.sample("a", i * 0.25, i)
        if i * 0.25 < 20:
            pace.sample("b", i * 0.25, i)
    assert [j.window.end for j in pace.close(31.0)] == [pytest.approx(10.25)]  # 20.25: waits for "b"
    late = pace.close(40.0)  # the lag is over: judged on "a" alone
    assert [j.window.end for j in late] == [pytest.approx(20.25)]
    assert late[0].window.steps_per_s == pytest.approx(4.0)


def test_the_median_over_sources_and_jitter_keep_a_healthy_job_healthy() -> None:
    pace = Pace(CFG)
    feed(pace, lambda t: 4.0, 600.0, sources=4, jitter=0.15)
    out = judged(pace, 600.0)
    assert not [j for j in out if j.judgement is Judgement.SLOW]


def test_rebaseline_accepts_a_new_pace_and_a_new_world_size_forgets_the_old() -> None:
    pace = Pace(CFG)
    t, steps = feed(pace, lambda t: 4.0, 100.0)
    judged(pace, t)
    pace.rebaseline()
    assert pace.baseline == 0.0
    t, steps = feed(pace, lambda t: 2.0, 200.0, t, steps)
    out = judged(pace, t)
    assert Judgement.SLOW not in [j.judgement for j in out]
    assert pace.baseline == pytest.approx(2.0, rel=0.02)
    pace.round_started(t, keep_baseline=True)
    assert pace.baseline == pytest.approx(2.0, rel=0.02)
    pace.round_started(t, keep_baseline=False)
    assert pace.baseline == 0.0


def test_settle_holds_a_window_until_its_collectives_can_have_arrived() -> None:
    pace = Pace(PaceConfig(window_s=10.0, settle_s=8.0))
    feed(pace, lambda t: 4.0, 30.0)
    assert [round(j.window.end) for j in pace.close(19.0)] == [10]
    assert [round(j.window.end) for j in pace.close(28.5)] == [20]
