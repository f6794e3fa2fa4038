"""Runs of unchanged scripts with a crash under ``hpcelastic run``, and the redone time their own logs prove.

Shared by ``tests/faults/test_ledger_truth_local.py`` and ``bench/ledger_truth.py``. Each script's rank 0
logs ``<event> <step> <time.time()>`` lines (``crash``, ``saved``, ``resumed``); the DDP example logs
``resumed from step N`` and its crash time in ``--timing-dir``. The truth is the training after the state
the next round resumed from until the crash: ``crash - saved(resumed step)``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
EXAMPLE = REPO / "examples" / "ddp_train.py"
STEP_TIME = 0.05


@dataclass(frozen=True)
class Case:
    """One unchanged script with a crash: ``argv`` after ``hpcelastic run``."""

    name: str
    nodes: int
    nproc: int
    argv: tuple[str, ...]
    heartbeats: bool


def cases(timing: Path) -> list[Case]:
    """The shipped example (SIGKILL at step 25, as the issue reproduced; the demo's crash at step 15),
    an Accelerate script and a DCP script (a rank SIGKILLed at step 22, checkpoints every 5 steps)."""
    example = (str(EXAMPLE), "--steps", "32", "--step-time", str(STEP_TIME), "--timing-dir")
    return [
        Case(
            "ddp_train.py (example)",
            2,
            2,
            (
                *example,
                str(timing / "example"),
                "--crash-at-step",
                "25",
                "--crash-rank",
                "3",
                "--crash-mode",
                "sigkill",
            ),
            True,
        ),  # fmt: skip
        Case(
            "ddp_train.py (demo: crash at 15)",
            2,
            2,
            (*example, str(timing / "demo"), "--crash-at-step", "15", "--crash-rank", "3"),
            True,
        ),  # fmt: skip
        Case(
            "Accelerate",
            2,
            1,
            (
                str(SCRIPTS / "accelerate_train.py"),
                "--steps",
                "30",
                "--crash-at-step",
                "22",
                "--step-time",
                str(STEP_TIME),
            ),
            False,
        ),  # fmt: skip
        Case(
            "torch.distributed.checkpoint",
            2,
            1,
            (
                str(SCRIPTS / "dcp_train.py"),
                "--steps",
                "30",
                "--crash-at-step",
                "22",
                "--step-time",
                str(STEP_TIME),
            ),
            False,
        ),  # fmt: skip
    ]


def run(case: Case, run_dir: Path) -> subprocess.CompletedProcess[str]:
    """``hpcelastic run`` of the case, as a user types it."""
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", str(case.nodes), "--nproc-per-node",
            str(case.nproc), "--run-dir", str(run_dir), *case.argv]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def status(run_dir: Path) -> dict[str, Any]:
    """``hpcelastic status --json`` of the run."""
    out = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def incident(run_dir: Path) -> dict[str, Any]:
    """The run's one incident, as ``hpcelastic status --json`` gives it."""
    (inc,) = status(run_dir)["ledger"]["incidents"]
    return inc


def saved_at(run_dir: Path) -> dict[int, float]:
    """When rank 0 logged each step's save done (the unchanged scripts' ``saved <step> <time>`` lines)."""
    found: dict[int, float] = {}
    for attempt in sorted((run_dir / "logs").glob("attempt-*")):
        for line in (attempt / "rank-0.log").read_text().splitlines():
            if m := re.fullmatch(r"saved (\d+) ([\d.]+)", line.strip()):
                found[int(m.group(1))] = float(m.group(2))
    return found


@dataclass(frozen=True)
class Truth:
    """What the script's own log proves: the step resumed after, the crash step, the redone seconds."""

    resumed: int
    crashed: int
    redone_s: float | None  # None: the log does not time the resumed step's save (the example)


def truth(case: Case, run_dir: Path, timing: Path) -> Truth:
    log = (run_dir / "logs" / "attempt-0" / "rank-0.log").read_text()
    if case.heartbeats:
        resumed = int(re.search(r"resumed from step (\d+)", log).group(1))  # type: ignore[union-attr]
        sub = "example" if "example" in case.name else "demo"
        crash = json.loads((timing / sub / "crash.json").read_text())
        return Truth(resumed, int(crash["step"]), None)
    events = [line.split() for line in log.splitlines() if re.fullmatch(r"\w+ \d+ [\d.]+", line.strip())]
    at = {(what, int(step)): float(ts) for what, step, ts in events}
    resumed = next(int(step) for what, step, _ in events if what == "resumed")
    crashed = next(int(step) for what, step, _ in events if what == "crash")
    return Truth(resumed, crashed, at[("crash", crashed)] - at[("saved", resumed)])
