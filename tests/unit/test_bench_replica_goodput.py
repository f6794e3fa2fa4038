"""bench/replica_goodput.py's helpers: the efficiency figures, and torchrun's resume via the worker API."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._replica_stats import efficiency

REPO = Path(__file__).resolve().parents[2]


def steps(group: int, pid: int, first: int, last: int, t0: float, dt: float = 1.0) -> list[dict]:
    return [
        {"group": group, "rank": 0, "pid": pid, "step": s, "ts": t0 + (s - first) * dt}
        for s in range(first, last + 1)
    ]


def test_a_group_out_for_ten_steps_costs_replica_steps_not_job_steps() -> None:
    # Group 0 steps 0..99 at 1 s; group 1 dies after step 39 and heals into step 50 (a new process).
    log = steps(0, 10, 0, 99, 0.0) + steps(1, 11, 0, 39, 0.0) + steps(1, 12, 50, 99, 50.0)
    log += [{**r, "rank": 1} for r in steps(0, 13, 0, 99, 0.0)]  # other ranks do not count
    e = efficiency(log, groups=2)
    assert e.step_s == 1.0 and e.possible == 100 and e.steps == 100
    assert e.job == 1.0
    assert e.replica == pytest.approx(190 / 200)


def test_a_job_wide_restart_counts_redone_steps_once_and_the_stall_as_lost() -> None:
    # Steps 0..59, killed; 20 s later a new process redoes 50..59 and goes on to 99.
    log = steps(0, 10, 0, 59, 0.0) + steps(0, 11, 50, 99, 79.0)
    e = efficiency(log, groups=1)
    assert e.step_s == 1.0 and e.steps == 100
    assert e.possible == pytest.approx(129)
    assert e.job == e.replica == pytest.approx(100 / 129)


def test_a_cut_run_is_measured_up_to_the_cut() -> None:
    e = efficiency(steps(0, 10, 0, 9, 0.0), groups=1, cut_at=19.0)
    assert e.possible == 20 and e.job == 0.5
