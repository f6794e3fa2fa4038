"""Localizing a slow job (hpcelastic/slow/locate.py): who arrives last at the collectives, and why."""

from __future__ import annotations

from collections import Counter

import pytest

from hpcelastic.slow import locate as loc
from hpcelastic.slow.sample import HW_THERMAL, SW_POWER_CAP, GpuFacts
from hpcelastic.slow.verdict import PaceWindow, SlowKind, SlowVerdict
from tests.slow_model import Run, simulate, slowed

HEALTHY = simulate(seed=999)
SEEDS = range(20)


def verdict(run: Run, base: Run = HEALTHY, **evidence: object) -> SlowVerdict:
    ev = loc.Evidence(arrivals=run.arrivals, node_of=run.node_of, **evidence)  # type: ignore[arg-type]
    return loc.locate(ev, PaceWindow(0.0, run.end, run.rate, base.rate))


def outcomes(**model: object) -> Counter[tuple[str, str | None, int | None]]:
    found: Counter[tuple[str, str | None, int | None]] = Counter()
    for seed in SEEDS:
        v = verdict(simulate(seed=seed, **model))  # type: ignore[arg-type]
        found[(v.kind.value, v.node, v.rank)] += 1
    return found


@pytest.mark.parametrize("speed", [0.5, 0.7])
def test_a_slow_rank_is_named_compute_with_its_node_in_19_of_20_runs_under_15_percent_jitter(
    speed: float,
) -> None:
    found = outcomes(speed=slowed({3}, speed))
    assert found[("compute", "n1", 3)] >= 19, found
    assert all(node in (None, "n1") for _, node, _ in found), found


def test_a_rank_at_85_percent_is_named_in_half_the_windows_and_never_the_wrong_node() -> None:
    """Under 15 % jitter a rank 15 % slow is not last at four fifths of the collectives in every window."""
    found = outcomes(speed=slowed({3}, 0.85))
    assert found[("compute", "n1", 3)] >= 10, found
    assert all(node in (None, "n1") for _, node, _ in found), found


def test_a_slow_rank_is_named_between_checkpoint_saves_that_wait_for_rank_0() -> None:
    """A DCP save every 4 steps: nine collectives in a burst, rank 0 last at each. By count the slow rank is
    last at a third of the collectives (before: ``job-wide``); by the time each takes it is last at nearly
    all of the window."""
    found = outcomes(buckets=1, save_every=4, speed=slowed({3}, 0.5))
    assert found[("compute", "n1", 3)] >= 19, found
    # the saves alone name nobody, rank 0's node neither
    assert set(outcomes(buckets=1, save_every=4)) == {("job-wide", None, None)}


def test_collectives_count_by_the_time_since_the_previous_one_at_most_one() -> None:
    steps = {(0, seq): {0: 0.1 * (seq - 1), 1: 0.1 * (seq - 1)} for seq in range(1, 6)}  # 0.1 s apart
    arrivals = steps | {(0, 6): {0: 0.401, 1: 0.4}, (0, 7): {0: 0.5, 1: 0.5}, (0, 8): {0: 0.8, 1: 0.8}}
    w = loc.collective_weights(arrivals | {(1, 7): {0: 9.0, 1: 9.0}})
    assert w[(0, 1)] == w[(1, 7)] == 1.0  # a group's first
    assert w[(0, 2)] == pytest.approx(1.0) and w[(0, 6)] == pytest.approx(0.01)  # a burst's second
    assert w[(0, 8)] == 1.0  # a long step counts once
    many = arrivals | {(0, seq): {0: 0.8 + seq * 1e-4, 1: 0.8} for seq in range(9, 40)}  # a long burst
    assert loc.collective_weights(many)[(0, 2)] == pytest.approx(1.0)  # the usual span is still a step's
    assert loc.quantile([3.0, 1.0, 2.0], 0.2) == loc.quantile([3.0, 1.0, 2.0], 0.2, [1.0, 1.0, 1.0]) == 1.0
    assert loc.quantile([1.0, 2.0, 3.0], 0.2, [0.1, 1.0, 1.0]) == 2.0  # the light lowest is passed over


def test_a_named_node_is_charged_what_it_costs_by_itself() -> None:
    v = verdict(simulate(speed=slowed({3}, 0.5)))
    assert v.own_slowdown == pytest.approx(1 - v.window.ratio, abs=0.1)  # it is the whole slowdown
    assert verdict(simulate(comm=0.06)).own_slowdown is None  # job-wide: nobody to charge


def test_a_whole_slow_node_is_named_without_a_rank() -> None:
    found = outcomes(nodes=4, per_node=4, speed=slowed({4, 5, 6, 7}, 0.6))
    assert found[("compute", "n1", None)] >= 19, found


def test_input_when_the_late_rank_sits_in_data_loading() -> None:
    run = simulate(speed=slowed({3}, 0.6))
    shares = {0: 0.05, 1: 0.1, 2: 0.0, 3: 0.8}
    v = verdict(run, input_share=shares)
    assert (v.kind, v.node, v.rank) == (SlowKind.INPUT, "n1", 3)
    assert "80% of its stacks in data loading" in v.detail
    # every rank loads data as much: the late one is slow at computing
    assert verdict(run, input_share=dict.fromkeys(range(4), 0.6)).kind is SlowKind.COMPUTE


def test_stack_samples_in_data_loading() -> None:
    assert loc.in_data_loading(["_next_data", "__next__", "main"])
    assert loc.in_data_loading(["__getitem__", "_worker_loop"])
    assert not loc.in_data_loading(["backward", "main"])
    # py-spy names methods by their qualified names
    assert loc.in_data_loading(
        ["_MapDatasetFetcher.fetch", "_SingleProcessDataLoaderIter._next_data", "main"]
    )
    assert not loc.in_data_loading(["Trainer.fetch_metrics", "<module>"])


def test_network_when_no_rank_is_late_but_one_nodes_round_trip_rose() -> None:
    run = simulate(comm=0.06)  # the job's collectives take long; nobody arrives late
    rtt = {"n0": 0.0004, "n1": 0.006}
    v = verdict(run, rtt=rtt, baseline_rtt={"n0": 0.0004, "n1": 0.0005})
    assert (v.kind, v.node) == (SlowKind.NETWORK, "n1")
    assert verdict(run, rtt=rtt).node == "n1"  # no healthy round trips yet: against the other nodes'
    # both links slower alike, or no round trips at all: nothing to name
    assert (
        verdict(run, rtt={"n0": 0.006, "n1": 0.006}, baseline_rtt={"n0": 0.0004, "n1": 0.0004}).node is None
    )
    assert verdict(run).kind is SlowKind.JOB_WIDE


def test_network_when_the_slow_links_node_arrives_late_because_results_reach_it_last() -> None:
    run = simulate(comm=0.04, link_lag={"n1": 0.03})
    assert verdict(run).kind is SlowKind.COMPUTE  # arrivals alone cannot tell
    v = verdict(run, rtt={"n0": 0.0004, "n1": 0.0304})  # the results' 30 ms lag is on its link
    assert (v.kind, v.node) == (SlowKind.NETWORK, "n1")


def test_a_late_node_whose_round_trip_jitters_by_milliseconds_is_slow_at_computing() -> None:
    """A node slowed on the CPU is late by far more than its round trip rose (a loaded machine's kernel
    round trip jitters by milliseconds): the rise does not explain the lateness, so not ``network``."""
    run = simulate(speed=slowed({2, 3}, 0.4))
    late = verdict(run)
    assert (late.kind, late.node) == (SlowKind.COMPUTE, "n1")
    v = verdict(run, rtt={"n0": 0.0004, "n1": 0.004}, baseline_rtt={"n0": 0.0004, "n1": 0.0004})
    assert (v.kind, v.node) == (SlowKind.COMPUTE, "n1"), v.detail


def test_job_wide_slowdowns_never_name_a_node() -> None:
    everyone = outcomes(speed=slowed({0, 1, 2, 3}, 0.7))  # a CPU hog on every node alike
    assert set(everyone) == {("job-wide", None, None)}, everyone


def test_a_rotating_stripe_is_job_wide() -> None:
    found = outcomes(stripe=lambda step, rank: step % 4 == rank)  # a different rank last every step
    assert set(found) == {("job-wide", None, None)}, found
    found = outcomes(nodes=4, per_node=8, stripe=lambda step, rank: step % 32 == rank)
    assert set(found) == {("job-wide", None, None)}, found


@pytest.mark.parametrize("k", [2, 3, 5])
def test_one_rank_given_more_data_every_kth_step_is_job_wide(k: int) -> None:
    found = outcomes(stripe=lambda step, rank: rank == 3 and step % k == 0)
    assert set(found) == {("job-wide", None, None)}, found


def test_jitter_alone_never_names_a_node_however_slow_the_job() -> None:
    for model in (dict(comm=0.05), dict(nodes=4, per_node=8, comm=0.05)):
        found = outcomes(jitter=0.15, **model)  # type: ignore[arg-type]
        assert set(found) == {("job-wide", None, None)}, found


def test_clock_skew_cancels_against_each_ranks_healthy_lateness() -> None:
    skew = {"n1": 0.08}  # node 1's clock 80 ms ahead: its ranks look 80 ms late at every collective
    healthy = simulate(seed=7, skew=skew)
    baseline = loc.rank_lateness(healthy.arrivals)
    assert baseline[2] - baseline[0] == pytest.approx(0.08, abs=0.02)
    jobwide = simulate(seed=8, skew=skew, speed=slowed({0, 1, 2, 3}, 0.7))
    assert verdict(jobwide).node == "n1"  # without the baseline the skew reads as lateness
    assert verdict(jobwide, baseline_lateness=baseline).kind is SlowKind.JOB_WIDE
    straggler = simulate(seed=9, skew=skew, speed=slowed({1}, 0.6))
    v = verdict(straggler, baseline_lateness=baseline)
    assert (v.kind, v.node, v.rank) == (SlowKind.COMPUTE, "n0", 1)


def test_too_few_collectives_name_no_one() -> None:
    run = simulate(steps=4, speed=slowed({3}, 0.5))
    v = verdict(run)
    assert v.kind is SlowKind.JOB_WIDE and "too few collectives" in v.detail


def test_a_link_that_slows_the_job_to_a_crawl_is_named_by_its_round_trip_alone() -> None:
    """Measured on the namespaced testbed: 50 ms each way on one node's link of three left a collective
    every 1.5 s (too few to compare ranks) and round trips of 0.3, 101 and 0.4 ms."""
    run = simulate(steps=4, comm=0.5)
    v = verdict(run, rtt={"n0": 0.0003, "n1": 0.101})
    assert (v.kind, v.node) == (SlowKind.NETWORK, "n1"), v.detail
    assert "too few collectives" in v.detail
    # a CPU-starved node's own round trip (4 ms) is a loaded kernel's jitter, not its link: nobody named
    v = verdict(run, rtt={"n0": 0.0004, "n1": 0.004}, baseline_rtt={"n0": 0.0004, "n1": 0.0004})
    assert v.kind is SlowKind.JOB_WIDE and "n1 4.0 (0.4)" in v.detail


def test_gpu_facts_explain_a_compute_verdict() -> None:
    run = simulate(speed=slowed({3}, 0.5))
    gpus = {
        0: GpuFacts(1980, 1980, SW_POWER_CAP, 690.0, 700.0),  # at its power limit: healthy under load
        3: GpuFacts(990, 1980, HW_THERMAL, 350.0, 700.0, 92),
    }
    v = verdict(run, gpus=gpus)
    assert (v.kind, v.rank) == (SlowKind.COMPUTE, 3)
    assert "GPU of rank 3: HW thermal slowdown, SM clock 990/1980 MHz" in v.detail
    assert GpuFacts(1980, 1980, SW_POWER_CAP).degraded() == []


def test_without_collectives_nvml_names_the_one_node_with_a_degraded_gpu() -> None:
    window = PaceWindow(0.0, 10.0, 5.0, 10.0)
    node_of = {0: "n0", 1: "n0", 2: "n1", 3: "n1"}
    healthy = GpuFacts(1980, 1980)
    gpus = {0: healthy, 1: healthy, 2: GpuFacts(700, 1980, 0x8), 3: healthy}
    v = loc.locate(loc.Evidence(arrivals={}, node_of=node_of, gpus=gpus), window)
    assert (v.kind, v.node) == (SlowKind.COMPUTE, "n1") and "HW slowdown" in v.detail
    both = {**gpus, 0: GpuFacts(700, 1980, 0x8)}
    assert loc.locate(loc.Evidence(arrivals={}, node_of=node_of, gpus=both), window).node is None


def test_gap_is_the_time_between_collectives_even_subsampled() -> None:
    run = simulate(jitter=0.0, comm=0.0, buckets=1, compute=0.1)
    every_fourth = {k: v for k, v in run.arrivals.items() if k[1] % 4 == 0}
    assert loc.gap_s(run.arrivals) == pytest.approx(0.1)
    assert loc.gap_s(every_fourth) == pytest.approx(0.1)


def _cfs_outcomes(
    throttled: dict[int, float] | None, share: float = 0.25, slowest: float = 0.6, **model: object
) -> Counter[tuple[str, str | None]]:
    """Rank 3 under a CFS quota of ``share`` over the kernel's 100 ms period (10 ms steps: at 25 % the job at
    about half its pace), 20 seeds, with ``throttled`` as the ranks' ``cpu.stat`` says."""
    base = simulate(seed=999, compute=0.01, steps=200)
    found: Counter[tuple[str, str | None]] = Counter()
    for seed in SEEDS:
        run = simulate(seed=seed, compute=0.01, steps=200, cpu_quota={3: (share, 0.1)}, **model)  # type: ignore[arg-type]
        ev = loc.Evidence(arrivals=run.arrivals, node_of=run.node_of, cpu_throttled=throttled or {})
        v = loc.locate(ev, PaceWindow(0.0, run.end, run.rate, base.rate))
        assert v.window.ratio < slowest
        found[(v.kind.value, v.node)] += 1
    return found


def test_a_lighter_cfs_quota_is_named_by_its_mean_lateness() -> None:
    """At 40 % of a 100 ms period the job runs at about 84 % of its pace and the throttled node is last at
    only 52-61 % of the collectives, its median lateness under the threshold (as on real processes here:
    56-69 %, a run called job-wide): its mean lateness, a stall at one step in two or three, names it."""
    quiet = dict.fromkeys(range(3), 0.0)
    assert set(_cfs_outcomes(None, share=0.4, slowest=0.9)) == {("job-wide", None)}
    found = _cfs_outcomes(quiet | {3: 0.95}, share=0.4, slowest=0.9)
    assert found[("compute", "n1")] == 20, found


def test_a_rank_under_a_cfs_quota_over_100_ms_is_named_on_the_kernels_word() -> None:
    """It runs its share at full speed and then stands still: late at one step in two or three, so its
    collectives alone look like a stripe's (job-wide); its cgroup's throttled periods name it."""
    assert set(_cfs_outcomes(None)) == {("job-wide", None)}
    quiet = dict.fromkeys(range(3), 0.0)
    found = _cfs_outcomes(quiet | {3: 0.95})
    assert found[("compute", "n1")] == 20, found
    v = verdict(simulate(speed=slowed({3}, 0.5)), cpu_throttled=quiet | {3: 0.95})
    assert "rank 3's CPU quota throttled it in 95% of its periods" in v.detail
    # both nodes throttled (a quota on every node alike): nobody on that evidence
    assert set(_cfs_outcomes(dict.fromkeys(range(4), 0.9))) == {("job-wide", None)}
    # throttled, but not the node that is late: nobody
    assert set(_cfs_outcomes({0: 0.9, 1: 0.0, 2: 0.0, 3: 0.0})) == {("job-wide", None)}


@pytest.mark.parametrize("k", [2, 3])
def test_a_stripe_is_not_named_for_a_throttled_node_that_is_not_late(k: int) -> None:
    found: Counter[tuple[str, str | None]] = Counter()
    for seed in SEEDS:
        run = simulate(seed=seed, stripe=lambda step, rank: rank == 3 and step % k == 0)
        ev = loc.Evidence(arrivals=run.arrivals, node_of=run.node_of, cpu_throttled={0: 0.9, 2: 0.0})
        v = loc.locate(ev, PaceWindow(0.0, run.end, run.rate, HEALTHY.rate))
        found[(v.kind.value, v.node)] += 1
    assert set(found) == {("job-wide", None)}, found
