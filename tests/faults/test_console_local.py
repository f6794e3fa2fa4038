"""The console of a real ``hpcelastic run`` (issue 21, point 3): the shipped example with a worker that
raises at step 12 on 2 nodes x 2 workers, with ``--console all`` and ``--console failures`` at once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.faults.localjob import EXAMPLE

TRAIN = [str(EXAMPLE), "--steps", "20", "--step-time", "0.05", "--crash-at-step", "12", "--crash-rank", "3"]


def _start(run: Path, console: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "2", "--console"]
    argv += [console, "--run-dir", str(run), *TRAIN]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_console_shows_the_root_cause_first_once_and_progress(tmp_path: Path) -> None:
    procs = {mode: _start(tmp_path / mode, mode) for mode in ("all", "failures")}
    out = {mode: p.communicate(timeout=180)[0] for mode, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), out
    lines = out["all"].splitlines()
    assert not [line for line in lines if re.match(r"\[rank\d+\] \[rank\d+\]", line)], "doubled prefix"
    # one traceback on the console, the root cause's, right after its line; the peers' are in the rank logs
    cause = next(i for i, line in enumerate(lines) if line.startswith("hpcelastic: root cause (round 0)"))
    assert "rank 3" in lines[cause] and "injected crash at step 12" in lines[cause]
    assert [i for i, line in enumerate(lines) if "Traceback" in line] == [cause + 1]
    # the rank logs keep everything: the root cause's traceback, and whatever the peers printed (a peer
    # stopped before gloo raised prints none, so which peers have a consequent traceback is a race)
    logs = tmp_path / "all" / "logs" / "attempt-0"
    crashed = (logs / "rank-3.log").read_text()
    assert "Traceback" in crashed and "injected crash at step 12" in crashed
    # whole lines: each is hpcelastic's, a rank's, or the root cause's traceback block
    block = range(
        cause + 1, next(i for i in range(cause + 1, len(lines)) if lines[i].startswith("hpcelastic"))
    )
    for i, line in enumerate(lines):
        assert i in block or line.startswith(("hpcelastic", "[rank")), line
    # progress: workers up each round, then training with the step the round resumed at
    assert any(
        re.fullmatch(r"hpcelastic: round 0: 4 workers up on 2 node\(s\) \((warm|cold) start\)", x)
        for x in lines
    )
    assert "hpcelastic: round 1: training, step 12" in lines
    quiet = out["failures"].splitlines()
    assert not [line for line in quiet if line.startswith("[rank")]
    assert any(line.startswith("hpcelastic: root cause (round 0): rank 3") for line in quiet)
