"""Step efficiency from a step log of committed steps (bench/replica_goodput.py); pure, no I/O.

A step log holds one ``{"group", "rank", "pid", "step", "ts"}`` per step a worker committed. Only rank 0
of each replica group counts (every rank of a group commits the same steps).

- fault-free step time: the median gap between two consecutive steps committed by the same process
  (a failure adds one long gap per process; the median over all gaps of the run ignores them);
- steps possible: (end - first step) / fault-free step time + 1, ``end`` being the last committed step
  (or the moment the run was cut);
- job step efficiency: distinct steps committed / steps possible;
- replica-step efficiency (torchft's figure): (group, step) pairs committed / (groups x steps possible):
  a group that was out, or healing, misses the steps the others committed meanwhile.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Efficiency:
    """What one run of one mode measured."""

    first: float
    end: float
    step_s: float
    steps: int
    possible: float
    job: float
    replica: float

    @property
    def wall(self) -> float:
        return self.end - self.first


def efficiency(lines: Iterable[dict[str, Any]], groups: int, cut_at: float | None = None) -> Efficiency:
    """Efficiencies of a run from its step log; ``cut_at``: when an unfinished run was stopped."""
    rows = sorted((r for r in lines if r["rank"] == 0), key=lambda r: r["ts"])
    if len(rows) < 2:
        raise ValueError("fewer than two committed steps: nothing to measure")
    last_ts: dict[int, float] = {}
    gaps = []
    for r in rows:
        if r["pid"] in last_ts:
            gaps.append(r["ts"] - last_ts[r["pid"]])
        last_ts[r["pid"]] = r["ts"]
    if not gaps:
        raise ValueError("no process committed two steps: no step time to measure")
    step_s = statistics.median(gaps)
    first = rows[0]["ts"]
    end = cut_at if cut_at is not None else rows[-1]["ts"]
    possible = (end - first) / step_s + 1
    steps = len({r["step"] for r in rows})
    pairs = len({(r["group"], r["step"]) for r in rows})
    return Efficiency(first, end, step_s, steps, possible, steps / possible, pairs / (groups * possible))
