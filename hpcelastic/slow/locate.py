"""Which node holds a slow job back, and why: pure, from when each rank issued each collective.

In synchronous training every rank waits in each collective for the last one to issue it, so the rank
that holds the job back is the one that arrives last (and waits least), at nearly every collective.
Per collective ``(pg, seq)`` each rank's issue time ``a_r`` is first corrected by that rank's own usual
lateness in healthy windows (``baseline_lateness``); a node's lateness at that collective is
``max(a_r, r on the node) - max(a_r, r elsewhere)``: positive exactly when the node is last, by how much
it kept the latest other rank waiting. Each collective counts by the time since the one before it, at
most a usual step's (:func:`collective_weights`): a checkpoint save's burst of collectives, where DCP's
coordinator is last, counts as little as the time it takes. A node is named when that lateness, at the
:data:`QUANTILE` (a fifth) of the window's collectives, exceeds :func:`threshold`: a share of the time
the job lost per collective (``gap x (1 - ratio)``, ``gap`` the window's time between collectives) and at
least :data:`FLOOR_S`. So it must be last at more than four fifths of the collectives, late enough to
explain a good part of the loss: 15 % per-rank jitter moves the last rank around, a workload stripe (a
different rank, or one rank every k-th step, last) leaves the quantile at or below zero, and a job-wide
slowdown names nobody. One exception, on the kernel's word: a node late by a mean (by weight) or a median
over :func:`threshold` and whose ranks' CPU quota throttled them in at least :data:`THROTTLED` of their
periods (cgroup ``cpu.stat``, ``slow/cpu_throttle.py``) while no other
node's was throttled, is named ``compute``: with the kernel's default 100 ms period such a rank runs its
share at full speed, then stands still, late at one step in two or three and on time at the others (a
stripe's pattern, which the quantile rightly does not name). Within the node a rank is named
when it is the node's last at :data:`RANK_SHARE` of the collectives. What the node costs by itself
(``own_slowdown``) is its median lateness over the time between collectives: the share of the pace the job
would win back without it (for a rank slowed on the CPU about half the truth: it also slows its part of
each collective).

Kind: ``network`` when the late node's link round trip rose (as below) by at least :data:`RTT_EXPLAINS`
of its median lateness; ``input`` when the named ranks' sampled stacks sit in data loading (DataLoader
``__next__``/``_next_data``, a dataset's ``__getitem__``) at least :data:`INPUT_SHARE` of the time and
clearly more than the others'; ``compute`` otherwise, with the GPU's NVML facts as detail (clocks,
throttle reasons, power).
With no rank late: ``network`` when one node's link round trip rose (:data:`RTT_RISE` times its healthy
value, or the other nodes' without one) while no other node's did. A link that slows a job to a crawl leaves
too few collectives in a window to compare ranks (a 50 ms delay on one node's link of three: the job at 13 %
of its pace, a collective every 1.5 s): the round trip alone then names the node ``network`` when it rose by
at least :data:`RTT_ALONE_S`, more than a loaded kernel's jitter (a CPU-starved node's own round trip rose
by 4 ms). With no collectives and no such link, ``compute`` for the one node whose GPUs report a hardware
slowdown; else ``job-wide``, its detail with the nodes' round trips.

Clock skew between nodes: arrival times are on each node's wall clock; the detector first moves them to
the coordinator's by each node's estimated offset, and the per-rank baseline lateness then cancels what is
left of a constant skew, of any size. Skew tolerated without a baseline (a node slow since the round's
start): what the offset estimate leaves, up to half the round trip, below :func:`threshold`. A drift
between two baseline updates (every healthy window) below :data:`FLOOR_S` is tolerated; NTP-disciplined
clocks drift well under a millisecond a minute.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from hpcelastic.slow.sample import GpuFacts
from hpcelastic.slow.verdict import PaceWindow, SlowKind, SlowVerdict

#: Collectives seen on two nodes or more that a window needs before any node is named by them.
MIN_COLLECTIVES = 12
#: The quantile of a node's lateness that must exceed the threshold.
QUANTILE = 0.2
#: A rank's CPU quota held it back: throttled in at least this share of its periods (other nodes' ranks:
#: under :data:`THROTTLED_CALM`).
THROTTLED = 0.5
THROTTLED_CALM = 0.1
#: The share of the job's lost time per collective the named node's lateness must reach (not all of it: a
#: rank slowed on the CPU also slows its part of the collectives), and the least lateness.
EXPLAIN = 0.1
FLOOR_S = 0.001
#: A rank is named within its node when it is the node's last at this share of the collectives.
RANK_SHARE = 0.8
#: Stacks in data loading: at least this share, and this much more than the other ranks' median.
INPUT_SHARE = 0.5
INPUT_MARGIN = 0.25
#: A node's link round trip rose this many times (others: less than :data:`RTT_CALM`), by at least
#: :data:`RTT_FLOOR_S`.
RTT_RISE = 2.0
RTT_CALM = 1.5
RTT_FLOOR_S = 0.0005
#: A late node is late because of its link only when the round trip's rise is at least this share of its
#: median lateness: a link delayed by d makes its node about d to a few d late per collective, while a node
#: slow at computing is late by its own slowdown, whatever its round trip does (on a loaded machine the
#: kernel's round trip jitters by milliseconds: official CI called a CPU-quota'd node ``network``).
RTT_EXPLAINS = 0.25
#: With too few collectives to compare ranks, a node's round trip names it only when it rose this much.
RTT_ALONE_S = 0.01
#: Function names of data loading frames (torch.utils.data's, and any dataset's ``__getitem__``).
DATA_FRAMES = frozenset({"__next__", "_next_data", "__getitem__", "__getitems__", "_get_data", "fetch"})

Key = tuple[int, int]  # (process group id, sequence number)


@dataclass(frozen=True)
class Evidence:
    """What the detector holds for one window (times in seconds on the coordinator's clock)."""

    #: (pg, seq) -> rank -> when the rank issued it, skew-corrected.
    arrivals: Mapping[Key, Mapping[int, float]]
    node_of: Mapping[int, str]
    #: rank -> its median lateness (vs the median rank) in healthy windows.
    baseline_lateness: Mapping[int, float] = field(default_factory=dict)
    #: node -> its link's round trip now, and in healthy windows.
    rtt: Mapping[str, float] = field(default_factory=dict)
    baseline_rtt: Mapping[str, float] = field(default_factory=dict)
    #: rank -> share of its recent stack samples in data loading.
    input_share: Mapping[int, float] = field(default_factory=dict)
    gpus: Mapping[int, GpuFacts] = field(default_factory=dict)
    #: rank -> share of its cgroup's CFS periods it was throttled in, lately.
    cpu_throttled: Mapping[int, float] = field(default_factory=dict)


def in_data_loading(functions: list[str] | tuple[str, ...]) -> bool:
    """A stack (its frames' function names, bare or qualified as py-spy names them:
    ``_MapDatasetFetcher.fetch``) is in data loading."""
    return any(f.rsplit(".", 1)[-1] in DATA_FRAMES for f in functions)


def quantile(values: list[float], q: float, weights: list[float] | None = None) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, low side), each counted by its weight (default 1):
    the least value whose own and lower values' weights exceed ``q`` of the total."""
    if weights is None:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered))))]
    pairs = sorted(zip(values, weights, strict=True))
    goal, total = q * sum(weights), 0.0
    for value, weight in pairs:
        total += weight
        if total > goal:
            return value
    return pairs[-1][0]


def collective_weights(arrivals: Mapping[Key, Mapping[int, float]]) -> dict[Key, float]:
    """How much each collective counts in a window: the time since its group's previous collective (each
    taken when its last rank issued it) over the usual such time, at most 1 (a group's first: 1).

    A burst of collectives counts as little as the time it takes: a DCP save's nine on gloo (its
    coordinator, rank 0, last at those where it plans and writes the metadata) every 20 steps made a
    slowed rank last at only 69 % of a DDP job's collectives, below the four fifths it takes to be named
    (the job was called ``job-wide``); a step's later gradient buckets count as little too. Capped at 1,
    so a long step (a workload stripe's) counts as one collective, no more."""
    series: dict[int, list[tuple[int, float]]] = {}
    for (pg, seq), times in arrivals.items():
        if times:
            series.setdefault(pg, []).append((seq, max(times.values())))
    spans: dict[Key, float] = {}
    for pg, points in series.items():
        points.sort()
        for (s0, t0), (s1, t1) in zip(points, points[1:], strict=False):
            if s1 > s0:
                spans[(pg, s1)] = max(0.0, t1 - t0) / (s1 - s0)
    # the usual span as the window's time sees it (half the time is in longer spans): bursts of short
    # spans, however many, leave it at a step's
    usual = quantile(list(spans.values()), 0.5, list(spans.values())) if spans else 0.0
    return {key: min(1.0, spans[key] / usual) if key in spans and usual > 0 else 1.0 for key in arrivals}


def rank_lateness(arrivals: Mapping[Key, Mapping[int, float]]) -> dict[int, float]:
    """Each rank's median lateness vs the median rank over ``arrivals`` (what a healthy window adds to a
    rank's baseline: its residual clock skew and its usual place)."""
    per: dict[int, list[float]] = {}
    for times in arrivals.values():
        if len(times) >= 2:
            mid = statistics.median(times.values())
            for rank, t in times.items():
                per.setdefault(rank, []).append(t - mid)
    return {rank: statistics.median(v) for rank, v in per.items()}


def gap_s(arrivals: Mapping[Key, Mapping[int, float]]) -> float:
    """The window's time between consecutive collectives of a group (median over ranks and pairs)."""
    per_rank: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for (pg, seq), times in arrivals.items():
        for rank, t in times.items():
            per_rank.setdefault((rank, pg), []).append((seq, t))
    gaps = []
    for series in per_rank.values():
        series.sort()
        gaps += [
            (t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(series, series[1:], strict=False) if s1 > s0
        ]
    return statistics.median(gaps) if gaps else 0.0


def threshold(gap: float, ratio: float) -> float:
    """The lateness a node must keep up: :data:`EXPLAIN` of the time lost per collective, at least
    :data:`FLOOR_S`."""
    return max(FLOOR_S, EXPLAIN * gap * max(0.0, 1.0 - ratio))


@dataclass(frozen=True)
class NodeLateness:
    """How late one node was over a window's collectives."""

    node: str
    collectives: int
    last_share: float  # share of the collectives (by weight) where it was last
    late_q: float  # lateness at :data:`QUANTILE` (s), by weight
    late_median: float
    late_mean: float  # by weight
    rank: int | None  # its rank that was last within it at :data:`RANK_SHARE`, if any


def node_lateness(ev: Evidence) -> list[NodeLateness]:
    """Every node's lateness over the collectives it shares with another node, each collective counted by
    its :func:`collective_weights`."""
    weights = collective_weights(ev.arrivals)
    late: dict[str, list[float]] = {}
    weight_of: dict[str, list[float]] = {}
    last_rank: dict[str, dict[int, float]] = {}
    for key, times in ev.arrivals.items():
        corrected: dict[str, dict[int, float]] = {}
        for rank, t in times.items():
            node = ev.node_of.get(rank)
            if node is not None:
                corrected.setdefault(node, {})[rank] = t - ev.baseline_lateness.get(rank, 0.0)
        if len(corrected) < 2:
            continue
        weight = weights[key]
        latest = {node: max(ranks.values()) for node, ranks in corrected.items()}
        for node, ranks in corrected.items():
            others = max(v for n, v in latest.items() if n != node)
            late.setdefault(node, []).append(latest[node] - others)
            weight_of.setdefault(node, []).append(weight)
            who = max(ranks, key=lambda r: ranks[r])
            counts = last_rank.setdefault(node, {})
            counts[who] = counts.get(who, 0.0) + weight
    out = []
    for node, values in late.items():
        w = weight_of[node]
        total = sum(w) or 1.0
        counts = last_rank[node]
        top = max(counts, key=lambda r: counts[r])
        out.append(
            NodeLateness(
                node,
                len(values),
                sum(wi for v, wi in zip(values, w, strict=True) if v > 0) / total,
                quantile(values, QUANTILE, w),
                quantile(values, 0.5, w),
                sum(v * wi for v, wi in zip(values, w, strict=True)) / total,
                top if len(counts) == 1 or counts[top] >= RANK_SHARE * total else None,
            )
        )
    return sorted(out, key=lambda x: (-x.late_q, x.node))


def locate(ev: Evidence, window: PaceWindow) -> SlowVerdict:
    """The verdict for a slow ``window``: who holds the job back and why, or job-wide."""
    pace = f"job at {window.ratio:.0%} of its pace"
    nodes = node_lateness(ev)
    enough = [n for n in nodes if n.collectives >= MIN_COLLECTIVES]
    gap = gap_s(ev.arrivals)
    network = _network(ev)
    least = threshold(gap, window.ratio)
    late = enough[0] if enough and enough[0].late_q >= least else _throttled(ev, enough, least)
    if late is not None:
        own = late.late_median / gap if gap > 0 else None
        return replace(_late_node(ev, window, late, pace, network), own_slowdown=own)
    if network is not None and (enough or network[1] >= RTT_ALONE_S):
        node, _rise, detail = network
        why = "no rank late" if enough else "too few collectives to compare ranks"
        return SlowVerdict(window, SlowKind.NETWORK, node=node, detail=f"{detail}; {why}; {pace}")
    if not enough:
        gpu = _gpu_only(ev)
        if gpu is not None:
            node, detail = gpu
            return SlowVerdict(window, SlowKind.COMPUTE, node=node, detail=f"{detail}; {pace}")
    why = "no node late at most collectives" if enough else "too few collectives seen on two nodes"
    return SlowVerdict(window, SlowKind.JOB_WIDE, detail=f"{why}; {pace}{_round_trips(ev)}")


def _throttled(ev: Evidence, nodes: list[NodeLateness], least_s: float) -> NodeLateness | None:
    """The one node whose ranks' CPU quota throttled them (no other node's was), if its mean lateness (or its
    median) is at least ``least_s``: over the kernel's 100 ms period a throttled rank is late by a whole
    stall at one step in two or three and on time at the others, so its median lateness can sit under the
    threshold (it was last at only 56-69 % of the collectives on real processes here) while its mean, by
    weight, does not; a node that is not the one holding the job back has a mean at or below zero."""
    worst: dict[str, float] = {}
    for rank, share in ev.cpu_throttled.items():
        node = ev.node_of.get(rank)
        if node is not None:
            worst[node] = max(share, worst.get(node, 0.0))
    held = [n for n, share in worst.items() if share >= THROTTLED]
    if len(held) != 1 or any(share >= THROTTLED_CALM for n, share in worst.items() if n != held[0]):
        return None
    late = next((n for n in nodes if n.node == held[0]), None)
    if late is None or max(late.late_mean, late.late_median) < least_s:
        return None
    return late


def _round_trips(ev: Evidence) -> str:
    """The nodes' link round trips now and usually, for a job-wide verdict's detail ('' when unknown)."""
    shown = [
        f"{node} {rtt * 1e3:.1f}"
        + (f" ({ev.baseline_rtt[node] * 1e3:.1f})" if node in ev.baseline_rtt else "")
        for node, rtt in sorted(ev.rtt.items())
    ]
    return f"; link round trips ms (usual): {', '.join(shown)}" if shown else ""


def _late_node(
    ev: Evidence, window: PaceWindow, late: NodeLateness, pace: str, network: tuple[str, float, str] | None
) -> SlowVerdict:
    """The late node's verdict: its link (its round trip rose by enough to explain its lateness: the
    collectives' results reach it last), its input, or its compute."""
    ranks = [late.rank] if late.rank is not None else [r for r, n in ev.node_of.items() if n == late.node]
    who = f"rank {late.rank}" if late.rank is not None else f"node {late.node}"
    detail = (
        f"{who} last at {late.last_share:.0%} of {late.collectives} collectives, "
        f"{late.late_median * 1e3:.0f} ms after the others (median); {pace}"
    )
    if network is not None and network[0] == late.node and network[1] >= RTT_EXPLAINS * late.late_median:
        return SlowVerdict(window, SlowKind.NETWORK, node=late.node, detail=f"{network[2]}; {detail}")
    shares = [ev.input_share[r] for r in ranks if r in ev.input_share]
    others = [s for r, s in ev.input_share.items() if r not in ranks]
    busiest = max(shares, default=0.0)
    if busiest >= INPUT_SHARE and busiest >= statistics.median(others or [0.0]) + INPUT_MARGIN:
        detail += f"; {busiest:.0%} of its stacks in data loading"
        return SlowVerdict(window, SlowKind.INPUT, node=late.node, rank=late.rank, detail=detail)
    notes = [f"GPU of rank {r}: {', '.join(ev.gpus[r].degraded())}" for r in ranks if r in ev.gpus]
    notes = [n for n in notes if not n.endswith(": ")]
    notes += [
        f"rank {r}'s CPU quota throttled it in {ev.cpu_throttled[r]:.0%} of its periods"
        for r in ranks
        if ev.cpu_throttled.get(r, 0.0) >= THROTTLED
    ]
    if notes:
        detail += "; " + "; ".join(notes)
    return SlowVerdict(window, SlowKind.COMPUTE, node=late.node, rank=late.rank, detail=detail)


def _network(ev: Evidence) -> tuple[str, float, str] | None:
    """The one node whose link round trip rose while the others' did not: the node, the rise (s), and what
    to say."""
    rises: dict[str, tuple[float, float]] = {}
    for node, rtt in ev.rtt.items():
        ref = ev.baseline_rtt.get(node)
        if ref is None:
            others = [v for n, v in ev.rtt.items() if n != node]
            ref = statistics.median(others) if others else None
        if ref is not None and ref > 0:
            rises[node] = (rtt / ref, rtt - ref)
    up = [n for n, (rise, delta) in rises.items() if rise >= RTT_RISE and delta >= RTT_FLOOR_S]
    if len(up) != 1 or any(rise >= RTT_CALM for n, (rise, _) in rises.items() if n != up[0]):
        return None
    node = up[0]
    rise, delta = rises[node]
    return node, delta, f"link round trip {ev.rtt[node] * 1e3:.1f} ms, {rise:.1f}x its usual"


def _gpu_only(ev: Evidence) -> tuple[str, str] | None:
    """The one node whose GPUs report a hardware slowdown, when no collectives say more."""
    bad: dict[str, list[str]] = {}
    for rank, facts in ev.gpus.items():
        why = facts.degraded()
        node = ev.node_of.get(rank)
        if why and node is not None:
            bad.setdefault(node, []).append(f"GPU of rank {rank}: {', '.join(why)}")
    if len(bad) != 1 or len({n for r, n in ev.node_of.items() if r in ev.gpus}) < 2:
        return None
    node, notes = next(iter(bad.items()))
    return node, "; ".join(notes) + " (NVML; no collectives to compare)"
