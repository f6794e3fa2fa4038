"""A model of synchronous data-parallel training's collectives, for the slow-node detector's unit tests.

Each step runs ``buckets`` collectives; before each a rank computes its share of the step (``compute`` s a
step, with uniform per-rank jitter, divided by its speed, doubled on a stripe's steps); every rank leaves a
collective ``comm`` after the last one issued it (plus its node's ``link_lag``: the results reach a node
behind a slow link last). Every ``save_every`` steps a checkpoint save issues ``save_collectives`` collectives
in a burst, rank 0 last at each by ``save_work`` (DCP's coordinator planning and writing the metadata; DCP
issues nine on gloo). A rank under a CFS CPU quota (``cpu_quota``: rank -> (share, period)) computes at
full speed until it used ``share x period`` in the current period, then waits for the next one. Issue times
are on each node's clock (``skew`` added).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from hpcelastic.slow.locate import Key

Speed = Callable[[int, float], float]  # (rank, time) -> speed (1.0: healthy)


@dataclass
class Run:
    """What the model produced: arrivals, and per rank the wall time of each step's end (its clock)."""

    arrivals: dict[Key, dict[int, float]] = field(default_factory=dict)
    step_ends: dict[int, list[float]] = field(default_factory=dict)
    node_of: dict[int, str] = field(default_factory=dict)
    end: float = 0.0
    steps: int = 0

    @property
    def rate(self) -> float:
        return self.steps / self.end


def simulate(
    *,
    nodes: int = 2,
    per_node: int = 2,
    steps: int = 40,
    buckets: int = 2,
    compute: float = 0.1,
    jitter: float = 0.15,
    comm: float = 0.005,
    speed: Speed | None = None,
    stripe: Callable[[int, int], bool] | None = None,
    link_lag: dict[str, float] | None = None,
    skew: dict[str, float] | None = None,
    seed: int = 0,
    start: float = 0.0,
    save_every: int = 0,
    save_collectives: int = 9,
    save_work: float = 0.003,
    cpu_quota: dict[int, tuple[float, float]] | None = None,
) -> Run:
    rng = random.Random(seed)
    world = nodes * per_node
    run = Run(node_of={r: f"n{r // per_node}" for r in range(world)})
    done = dict.fromkeys(range(world), start)
    seq = 0
    used: dict[tuple[int, int], float] = {}  # (rank, period) -> CPU time it used in that period
    for step in range(steps):
        for _ in range(buckets):
            issue = {}
            for r in range(world):
                work = compute / buckets * (1 + rng.uniform(-jitter, jitter))
                work /= speed(r, done[r]) if speed else 1.0
                if stripe is not None and stripe(step, r):
                    work *= 2
                quota = (cpu_quota or {}).get(r)
                issue[r] = done[r] + work if quota is None else _under_quota(r, done[r], work, *quota, used)
            seq += 1
            last = max(issue.values())
            for r in range(world):
                done[r] = last + comm + (link_lag or {}).get(run.node_of[r], 0.0)
            run.arrivals[(0, seq)] = {r: t + (skew or {}).get(run.node_of[r], 0.0) for r, t in issue.items()}
        for _ in range(save_collectives if save_every and (step + 1) % save_every == 0 else 0):
            work = {r: save_work if r == 0 else save_work / 10 for r in done}
            issue = {r: done[r] + work[r] * rng.uniform(0.9, 1.1) for r in done}
            seq += 1
            last = max(issue.values())
            done = dict.fromkeys(done, last + comm)
            run.arrivals[(0, seq)] = {r: t + (skew or {}).get(run.node_of[r], 0.0) for r, t in issue.items()}
        for r in range(world):
            run.step_ends.setdefault(r, []).append(done[r] + (skew or {}).get(run.node_of[r], 0.0))
    run.end = max(done.values()) - start
    run.steps = steps
    return run


def _under_quota(
    rank: int, start: float, work: float, share: float, period: float, used: dict[tuple[int, int], float]
) -> float:
    """When ``work`` s of CPU begun at ``start`` ends under a CFS quota of ``share x period`` a period."""
    t, k = start, int(start / period)
    while work > 1e-12:
        left = share * period - used.get((rank, k), 0.0)
        run = min(left, work, (k + 1) * period - t)
        if run > 1e-12:
            used[(rank, k)] = used.get((rank, k), 0.0) + run
            t, work = t + run, work - run
        if work > 1e-12:
            k += 1
            t = max(t, k * period)
    return t


def slowed(ranks: set[int], factor: float, after: float = 0.0) -> Speed:
    """``ranks`` run at ``factor`` of their speed from ``after`` on."""
    return lambda r, t: factor if r in ranks and t >= after else 1.0
