"""Checks shared by the torchft replica-group tests (local and Slurm): the example's outputs and events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcelastic import events
from hpcelastic.events import EventLog

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "torchft_train.py"
STEP_TIME = 0.25
QUORUM_TIMEOUT = 10.0


def train_args(out_dir: Path, *, steps: int, crash_at: int = -1) -> list[str]:
    """examples/torchft_train.py's arguments: group 1's rank 1 is SIGKILLed once at step ``crash_at``."""
    return [
        str(EXAMPLE),
        "--steps",
        str(steps),
        "--step-time",
        str(STEP_TIME),
        "--quorum-timeout",
        str(QUORUM_TIMEOUT),
        "--out-dir",
        str(out_dir),
        "--crash-group",
        "1",
        "--crash-rank",
        "1",
        "--crash-at-step",
        str(crash_at),
    ]


def check_group_restart(
    out_dir: Path,
    log: EventLog,
    *,
    steps: int,
    injected: bool = True,
    extra_pause_s: float = 0.0,
    heartbeats: bool = True,
) -> dict[str, Any]:
    """Group 1 restarted alone and healed from group 0, which never stopped; identical final weights.

    ``extra_pause_s``: how much longer group 0 may pause (a hung group blocks the others' cross-group
    collective until it is found and stopped). Without ``heartbeats`` the coordinator sees no steps: the
    heal shows in the restarted group's first committed step instead of a ``replica_group_healed`` event."""
    assert (out_dir / "crashed").exists() == injected, "the injected fault did not happen as asked"
    names = [e["event"] for e in log]
    assert events.RESTARTING not in names, f"a job-wide restart happened: {names}"
    restarts = log.of(events.REPLICA_GROUP_RESTARTING)
    assert [e["group"] for e in restarts] == [1], restarts
    groups = [json.loads((out_dir / f"group{g}.json").read_text()) for g in (0, 1)]
    assert groups[0]["params"] == groups[1]["params"], "the groups ended with different weights"
    kept = check_group0_kept_stepping(out_dir, steps=steps, extra_pause_s=extra_pause_s)
    if not heartbeats:
        assert groups[1]["steps"][0][0] > 0, "the restarted group 1 did not heal forward from group 0"
        return kept
    healed = log.of(events.REPLICA_GROUP_HEALED)
    assert [e["group"] for e in healed] == [1] and healed[0]["peers"] == [0], healed
    assert healed[0]["steps_missed"] >= 0 and healed[0]["step"] > restarts[0]["last_step"], healed
    return {**kept, "steps_missed": healed[0]["steps_missed"]}


def check_group0_kept_stepping(out_dir: Path, *, steps: int, extra_pause_s: float = 0.0) -> dict[str, float]:
    """Group 0 committed every step to the end; its longest pause < 3 step times + the quorum timeout."""
    group0 = json.loads((out_dir / "group0.json").read_text())
    times = [ts for _step, ts in group0["steps"]]
    done = [s for s, _ts in group0["steps"]]
    # A group that joins late at the start heals forward (torchft); from then on group 0 commits every step.
    assert done == list(range(done[0], steps)), f"group 0 missed steps: {done}"
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    typical = sorted(b - a for a, b in zip(times, times[1:], strict=False))[len(times) // 2]
    assert gap < 3 * typical + QUORUM_TIMEOUT + extra_pause_s, (
        f"group 0 paused {gap:.2f} s (step {typical:.2f} s)"
    )
    return {"group0_max_gap_s": gap, "step_s": typical}
