"""The coordinator's slow-node detector (hpcelastic/slow/detector.py), fed the reports of a model run."""

from __future__ import annotations

import bisect

import pytest

from hpcelastic.agent.messages import FROM_AGENT, SlowSample, decode, encode
from hpcelastic.slow.detector import SlowDetector
from hpcelastic.slow.pace import Judgement
from hpcelastic.slow.sample import RankSample, subsample
from hpcelastic.slow.verdict import PaceWindow, SlowKind, SlowVerdict
from tests.slow_model import Run, simulate, slowed

DELAY_S = 0.0005  # a report's one-way trip


def replay(
    run: Run,
    skew: dict[str, float],
    until: float,
    every: float = 1.0,
    det: SlowDetector | None = None,
    start: float = 0.0,
) -> list[tuple[float, SlowVerdict]]:
    """Every node reports each ``every`` s (through the wire format) and the coordinator ticks; the
    verdicts with the time they came."""
    if det is None:
        det = SlowDetector()
        det.round_started(0, 0.0, len(run.node_of))
    by_rank: dict[int, list[tuple[float, int, int]]] = {}
    for (pg, seq), times in run.arrivals.items():
        for rank, t in times.items():
            by_rank.setdefault(rank, []).append((t, pg, seq))
    for series in by_rank.values():
        series.sort()
    out = []
    now = start + every
    while now < until:
        for node in sorted(set(run.node_of.values())):
            clock = now + skew.get(node, 0.0)
            samples = []
            for rank in (r for r, n in run.node_of.items() if n == node):
                ends = run.step_ends[rank]
                done = bisect.bisect_right(ends, clock)
                series = by_rank[rank]
                lo = bisect.bisect_right(series, (clock - every, 1 << 60, 0))
                hi = bisect.bisect_right(series, (clock, 1 << 60, 0))
                new = [(pg, seq, int(t * 1e9)) for t, pg, seq in series[lo:hi]]
                step_ns = int(ends[done - 1] * 1e9) if done else 0
                samples.append(RankSample(rank, done, step_ns, subsample(new)))
            msg = SlowSample(det.round, int(clock * 1e9), 2 * DELAY_S, tuple(samples))
            wire = decode(FROM_AGENT, encode(msg))
            assert isinstance(wire, SlowSample)
            det.report(node, wire, now + DELAY_S)
        out += [(now, v) for v in det.tick(now).verdicts]
        now += every
    return out


@pytest.mark.parametrize("skew", [{}, {"n1": 0.25}, {"n0": -0.4}])
def test_a_node_slowed_to_half_is_named_within_a_minute_despite_skewed_clocks(skew: dict[str, float]) -> None:
    run = simulate(steps=2400, speed=slowed({3}, 0.5, after=120.0), skew=skew, seed=3)
    verdicts = replay(run, skew, until=run.end)
    assert verdicts, "no verdict"
    first_at = verdicts[0][0]
    assert first_at - 120.0 < 60.0
    named = [(v.kind, v.node, v.rank) for _, v in verdicts]
    assert named.count((SlowKind.COMPUTE, "n1", 3)) >= len(named) - 1, named
    assert all(v.window.end > 120.0 for _, v in verdicts)
    assert verdicts[0][1].window.ratio == pytest.approx(0.5, abs=0.12)


@pytest.mark.parametrize("skew", [{}, {"n1": 0.25}])
def test_a_healthy_jittery_run_gets_no_verdict(skew: dict[str, float]) -> None:
    run = simulate(steps=3000, skew=skew, seed=4)
    assert replay(run, skew, until=run.end) == []


def test_a_job_wide_slowdown_names_no_node() -> None:
    run = simulate(steps=2400, speed=slowed({0, 1, 2, 3}, 0.6, after=120.0), seed=5)
    verdicts = replay(run, {}, until=run.end)
    assert verdicts and {(v.kind, v.node) for _, v in verdicts} == {(SlowKind.JOB_WIDE, None)}


def test_skew_is_taken_out_by_the_report_times_when_a_round_starts_slow() -> None:
    """A new round (a spare took a place) whose first windows are already slow: no healthy lateness to
    compare with yet; the clock offsets from the reports' send times keep a skewed node from being named."""
    det = SlowDetector()
    det.round_started(0, 0.0, 4)
    replay(simulate(steps=1500, seed=6), {}, until=150.0, det=det)
    skew = {"n1": 0.25}
    det.round_started(1, 200.0, 4)
    run = simulate(steps=1500, seed=7, skew=skew, speed=slowed({0, 1, 2, 3}, 0.6), start=200.0)
    verdicts = replay(run, skew, until=200.0 + run.end, det=det, start=200.0)
    assert verdicts and {(v.kind, v.node) for _, v in verdicts} == {(SlowKind.JOB_WIDE, None)}


def test_heartbeats_replace_the_step_clocks_as_the_pace() -> None:
    det = SlowDetector()
    det.round_started(0, 0.0, 2)
    for i in range(1, 400):
        t = i * 0.25
        det.report("n0", SlowSample(0, int(t * 1e9), None, (RankSample(0, i * 2, int(t * 1e9)),)), t)
        det.progress("n0", i, t)
    windows = [c.judged for c in det.tick(100.0).windows]
    assert windows and all(j.window.steps_per_s == pytest.approx(4.0) for j in windows)
    assert {j.judgement for j in windows} <= {Judgement.WARMUP, Judgement.HEALTHY}


def test_a_report_of_another_round_is_ignored() -> None:
    det = SlowDetector()
    det.round_started(2, 0.0, 2)
    det.report("n0", SlowSample(1, 10**9, None, (RankSample(0, 5, 10**9, ((0, 1, 10**9),)),)), 1.0)
    assert det.evidence(PaceWindow(0.0, 10.0, 1.0, 1.0)).arrivals == {}


def test_a_ranks_cpu_throttling_reaches_the_evidence_until_the_next_round() -> None:
    det = SlowDetector()
    det.round_started(0, 0.0, 2)
    throttled = RankSample(1, 5, 10**9, cpu_throttled=0.9)
    det.report("n1", SlowSample(0, 10**9, None, (RankSample(0, 5, 10**9), throttled)), 1.0)
    assert det.evidence(PaceWindow(0.0, 10.0, 1.0, 1.0)).cpu_throttled == {1: 0.9}
    det.round_started(1, 20.0, 2)
    assert det.evidence(PaceWindow(20.0, 30.0, 1.0, 1.0)).cpu_throttled == {}
