"""The slow-node policy (hpcelastic/slow/policy.py): never on one window, a job-wide slowdown or noise below
the threshold; a swap only when the slowdown has cost one and the time left repays it, with a checked fast
spare; flapping only when it really costs; the ledger's lost time counts each second once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest

from hpcelastic import sites
from hpcelastic.errors import UserError
from hpcelastic.lifecycle.policy import Capacity, capped_exclusion
from hpcelastic.slow.policy import (
    FLAP_COST_FACTOR,
    FLAP_HALF_LIFE_S,
    Evidence,
    JobView,
    Order,
    SlowAction,
    SlowHistory,
    SlowOrder,
    SlowSettings,
    Spare,
    decide,
    flap_rate,
    lost_s,
    observe,
    slow_time_s,
    step,
    to_exclude,
)
from hpcelastic.slow.verdict import PaceWindow, SlowKind, SlowVerdict

W_S = 10.0  # the detector's window in these tests
NODES = ("n0", "n1", "n2", "n3")
FIT = Spare("s0", checked=True, fast=True)
SETTINGS = SlowSettings()  # the defaults: swap, 0.2, 5 windows


def _window(i: int, ratio: float) -> PaceWindow:
    return PaceWindow(i * W_S, (i + 1) * W_S, ratio, 1.0)


def _verdicts(i: int, slow: dict[str, float] | float | None) -> list[SlowVerdict]:
    """Window ``i``'s verdicts: ``{node: ratio}`` names the node, a float is a job-wide slowdown."""
    if slow is None:
        return []
    if isinstance(slow, float):
        return [SlowVerdict(_window(i, slow), SlowKind.JOB_WIDE)]
    return [SlowVerdict(_window(i, r), SlowKind.COMPUTE, n, 8, "rank 8 last") for n, r in slow.items()]


def _run(
    pattern: Sequence[dict[str, float] | float | None],
    *,
    settings: SlowSettings = SETTINGS,
    job: JobView | None = None,
    checkpoints: Sequence[int] = (),
    history: SlowHistory | None = None,
) -> tuple[SlowHistory, list[tuple[int, SlowOrder]]]:
    """Feed one verdict pattern, a window each, through :func:`step`; every order with its window."""
    job = job or JobView(nodes=NODES, spares=(FIT,), swap_cost_s=60.0, allocation_left_s=36000.0)
    h = history or SlowHistory()
    out: list[tuple[int, SlowOrder]] = []
    for i, slow in enumerate(pattern):
        ratio = min([slow] if isinstance(slow, float) else (slow or {}).values(), default=1.0)
        h, orders = step(
            h, _window(i, ratio), _verdicts(i, slow), replace(job, checkpoint_done=i in checkpoints), settings
        )
        out += [(i, o) for o in orders]
    return h, out


def _orders(out: list[tuple[int, SlowOrder]], order: Order) -> list[tuple[int, str | None]]:
    return [(i, o.node) for i, o in out if o.order is order]


def test_one_bad_window_does_nothing() -> None:
    _, out = _run([None, {"n1": 0.3}, None, None, None, None, None, {"n1": 0.3}], checkpoints=range(20))
    assert out == []


def test_a_node_named_in_enough_windows_is_reported_one_miss_tolerated() -> None:
    pattern = [{"n1": 0.5}] * 2 + [None] + [{"n1": 0.5}] * 2  # 4 of 5: not yet
    assert _run(pattern)[1] == []
    _, out = _run([*pattern, {"n1": 0.5}])  # 5 of the last 6
    assert _orders(out, Order.REPORT) == [(5, "n1")]
    report = out[0][1]
    assert report.kind is SlowKind.COMPUTE and report.rank == 8 and "rank 8 last" in report.why


def test_two_misses_in_a_row_keep_it_from_opening() -> None:
    pattern = ([{"n1": 0.5}] * 3 + [None, None]) * 6  # 3 on, 2 off: never 5 of 6
    _, out = _run(pattern, checkpoints=range(100))
    assert _orders(out, Order.REPORT) == [] and _orders(out, Order.SWAP) == []


def test_below_the_threshold_is_noise() -> None:
    _, out = _run([{"n1": 0.85}] * 200, checkpoints=range(0, 200, 10))  # 15 %: healthy GPUs differ by 14 %
    assert out == []
    _, out = _run([{"n1": 0.79}] * 6)
    assert _orders(out, Order.REPORT) == [(4, "n1")]


def test_job_wide_never_names_a_node() -> None:
    _, out = _run([0.5] * 300, checkpoints=range(0, 300, 10))
    assert [(o.order, o.node, o.kind) for _, o in out] == [(Order.REPORT, None, SlowKind.JOB_WIDE)]


def test_ski_rental_swaps_once_the_slowdown_cost_a_swap_at_the_next_checkpoint() -> None:
    # 50 % slow, 10 s windows: 5 s lost a window; a swap costs 60 s: it has cost one after 12 windows.
    _, out = _run([{"n1": 0.5}] * 40, checkpoints=(8, 20, 30))
    assert _orders(out, Order.REPORT) == [(4, "n1")]
    assert _orders(out, Order.EXCLUDE) == [(11, "n1")]
    swaps = [(i, o.node, o.spare) for i, o in out if o.order is Order.SWAP]
    assert swaps == [(20, "n1", "s0")]  # not at the checkpoint of window 8: it had not cost a swap yet


def test_no_swap_when_the_time_left_does_not_repay_it() -> None:
    job = JobView(nodes=NODES, spares=(FIT,), swap_cost_s=60.0, allocation_left_s=110.0, job_left_s=10**6)
    _, out = _run([{"n1": 0.5}] * 30, job=job, checkpoints=range(30))
    assert _orders(out, Order.SWAP) == []  # keeping it loses 0.5 x 110 = 55 s, less than the swap's 60 s
    assert _orders(out, Order.EXCLUDE) == [(11, "n1")]
    job = replace(job, allocation_left_s=None, job_left_s=130.0)  # 0.5 x 130 = 65 s > 60 s
    assert _orders(_run([{"n1": 0.5}] * 30, job=job, checkpoints=range(30))[1], Order.SWAP) == [(11, "n1")]


@pytest.mark.parametrize(
    "spares",
    [(), (Spare("s0"),), (Spare("s0", checked=True, fast=False),), (Spare("s0", checked=False, fast=True),)],
)
def test_never_a_spare_not_checked_or_slow(spares: tuple[Spare, ...]) -> None:
    job = JobView(nodes=NODES, spares=spares, swap_cost_s=60.0)
    _, out = _run([{"n1": 0.5}] * 30, job=job, checkpoints=range(30))
    assert _orders(out, Order.SWAP) == [] and _orders(out, Order.EXCLUDE) == [(11, "n1")]


def test_never_more_swaps_than_fit_spares() -> None:
    job = JobView(nodes=("n0", "n1", "n2", "n3", "n4"), spares=(FIT, Spare("s1")), swap_cost_s=60.0)
    _, out = _run([{"n1": 0.5, "n2": 0.6}] * 30, job=job, checkpoints=(25,))
    swaps = [(i, o.node, o.spare) for i, o in out if o.order is Order.SWAP]
    assert swaps == [(25, "n1", "s0")]  # the costlier of the two, for the one fit spare


def test_the_ladder() -> None:
    pattern = [{"n1": 0.5}] * 30
    orders = {
        a: {o.order for _, o in _run(pattern, settings=SlowSettings(action=a), checkpoints=(20,))[1]}
        for a in SlowAction
    }
    assert orders == {
        SlowAction.OFF: set(),
        SlowAction.REPORT: {Order.REPORT},
        SlowAction.EXCLUDE: {Order.REPORT, Order.EXCLUDE},
        SlowAction.SWAP: {Order.REPORT, Order.EXCLUDE, Order.SWAP},
    }


def test_most_nodes_slow_at_once_is_a_shared_cause() -> None:
    _, out = _run([{"n0": 0.5, "n1": 0.5, "n2": 0.5}] * 30, checkpoints=range(30))
    assert {o.order for _, o in out} == {Order.REPORT}
    _, out = _run([{"n0": 0.5, "n1": 0.5}] * 30, checkpoints=(20,))  # half: still theirs
    assert {(o.order, o.node) for _, o in out if o.order is not Order.REPORT} == {
        (Order.EXCLUDE, "n0"),
        (Order.EXCLUDE, "n1"),
        (Order.SWAP, "n0"),
    }


def test_flapping_acts_only_when_it_really_costs() -> None:
    flap = [{"n1": 0.3}, {"n1": 0.3}, None, None, None]  # 2 on, 3 off: never open
    _, cheap = _run(flap * 12, checkpoints=range(60))  # 10 min: 24 windows x 7 s = 168 s < 3 x 60 s
    assert cheap == []
    _, out = _run(flap * 30, checkpoints=range(150))
    first = _orders(out, Order.REPORT)
    assert first and first[0][1] == "n1" and "flapping" in out[0][1].why
    lost = sum(7.0 for i in range(first[0][0] + 1) if i % 5 < 2)
    assert lost >= FLAP_COST_FACTOR * 60.0
    assert _orders(out, Order.SWAP) == [(first[0][0], "n1")]  # a checkpoint every window here


def test_a_node_named_only_lately_is_charged_its_rate_while_watched_not_over_an_hour() -> None:
    # A link slowing the job to 20 % leaves too few collectives in one window of two to name the node
    # (bench/slow_localization.py's network part): named every other window for 2 minutes.
    ev = Evidence()
    for i in range(int(120 / W_S)):
        w = _window(i, 0.2)
        ev = ev.seen(w, 0.8, 5, None) if i % 2 == 0 else ev.seen(w, None, 5)
    assert 0.3 < flap_rate(ev, 120.0) < 0.5  # half of the time at 80 %; over the hour's horizon it was 2 %
    later = FLAP_HALF_LIFE_S * 20  # long after: the whole horizon, as before
    assert flap_rate(ev, later) == pytest.approx(ev.decayed(later) * math.log(2) / FLAP_HALF_LIFE_S, rel=1e-6)


def test_flapping_under_a_job_wide_slowdown_is_not_the_node() -> None:
    # The job is 30 % slow throughout; one window in five is misattributed to n1.
    pattern = [{"n1": 0.7} if i % 5 == 0 else 0.7 for i in range(600)]
    _, out = _run(pattern, checkpoints=range(600))
    assert [(o.order, o.node) for _, o in out] == [(Order.REPORT, None)]


def test_a_node_is_charged_only_what_it_costs_by_itself() -> None:
    # The job runs 40 % slow under a load on every node; the detector names n1, late by 10 % of it.
    h, out = SlowHistory(), []
    job = JobView(nodes=NODES, spares=(FIT,), swap_cost_s=60.0, checkpoint_done=True)
    for i in range(100):
        w = _window(i, 0.6)
        verdict = SlowVerdict(w, SlowKind.COMPUTE, "n1", 8, "rank 8 last", own_slowdown=0.1)
        h, orders = step(h, w, [verdict], job, SETTINGS)
        out += [(i, o) for o in orders]
    assert [(o.order, o.node) for _, o in out] == [(Order.REPORT, None)]
    assert verdict.slowdown == pytest.approx(0.1)
    assert replace(verdict, own_slowdown=None).slowdown == pytest.approx(0.4)


def test_a_closed_slowdown_starts_afresh() -> None:
    pattern = [{"n1": 0.5}] * 10 + [None] * 5 + [{"n1": 0.5}] * 10
    h, out = _run(pattern, checkpoints=(24,))
    assert _orders(out, Order.REPORT) == [(4, "n1"), (19, "n1")]
    assert _orders(out, Order.EXCLUDE) == []  # 50 s lost each time, less than a swap
    assert h.nodes["n1"].run_lost_s == pytest.approx(50.0)


def test_orders_are_given_once_and_exclusions_first_evidence_first() -> None:
    pattern = [{"n2": 0.5}] * 15 + [{"n2": 0.5, "n1": 0.4}] * 15
    h, out = _run(pattern, settings=SlowSettings(action=SlowAction.EXCLUDE))
    assert _orders(out, Order.EXCLUDE) == [(11, "n2"), (24, "n1")]
    assert to_exclude(h) == ("n2", "n1")
    job = JobView(nodes=NODES, spares=(), swap_cost_s=60.0)
    assert decide(h, job, SlowSettings(action=SlowAction.EXCLUDE)) == ()
    # The requeue policy caps them as it caps lost nodes: 5 usable nodes, 4 needed: only the newest goes.
    capacity = Capacity(frozenset({"n0", "n1", "n2", "n3", "n4"}), 4)
    assert capped_exclusion(to_exclude(h), capacity) == ("n1",)


def test_windows_without_verdicts_close_the_slowdown() -> None:
    s = SlowSettings()
    h = SlowHistory()
    for i in range(6):
        h = observe(h, _window(i, 0.5), _verdicts(i, {"n1": 0.5}), s)
    assert h.nodes["n1"].open
    for i in range(6, 6 + s.windows):
        h = observe(h, _window(i, 1.0), [], s)
    assert not h.nodes["n1"].open and h.nodes["n1"].run_lost_s == 0


def test_lost_time_counts_each_second_once() -> None:
    a, b = PaceWindow(0, 20, 0.5, 1.0), PaceWindow(10, 30, 0.8, 1.0)  # overlapping by half
    assert lost_s(a) == pytest.approx(10.0)
    assert slow_time_s([b, a, a]) == pytest.approx(10.0 + 10 * 0.2)  # a repeated, in any order
    assert slow_time_s([PaceWindow(0, 10, 1.2, 1.0)]) == 0.0  # faster than the baseline: nothing lost
    assert slow_time_s([PaceWindow(0, 10, 0.5, 0.0)]) == 0.0  # no baseline yet: ratio 1


def test_settings_defaults_live_in_the_site_schema() -> None:
    s = SlowSettings()
    assert (str(s.action), s.min_slowdown, s.windows) == (
        sites.default("slow.action"),
        sites.default("slow.min_slowdown"),
        sites.default("slow.windows"),
    )
    assert SlowSettings.parse("exclude", 0.3, 4) == SlowSettings(SlowAction.EXCLUDE, 0.3, 4)
    values = {"slow.action": "report", "slow.min_slowdown": 0.25, "slow.windows": 8}
    assert SlowSettings.from_config(values.get) == SlowSettings(SlowAction.REPORT, 0.25, 8)


@pytest.mark.parametrize(
    "args, message",
    [
        (("swop", 0.2, 5), "--slow-action: must be one of off, report, exclude, swap (did you mean 'swap'?)"),
        (("swap", 0.02, 5), "--slow-min-slowdown: must be between 0.05 and 0.9, got 0.02"),
        (("swap", 0.2, 1), "--slow-windows: must be between 2 and 100, got 1"),
        (("swap", "x", 5), "--slow-min-slowdown: must be a number, not a string"),
    ],
)
def test_bad_settings_are_one_line_errors(args: tuple, message: str) -> None:
    with pytest.raises(UserError) as e:
        SlowSettings.parse(*args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_site_file_keys_are_checked() -> None:
    with pytest.raises(UserError, match="slow.windows: must be between 2 and 100"):
        sites.validate({"slow": {"windows": 0}}, "site.yaml")
    assert sites.validate({"slow": {"action": "report"}}, "site.yaml") == {"slow.action": "report"}
