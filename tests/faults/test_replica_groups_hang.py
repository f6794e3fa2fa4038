"""A hang in one torchft replica group under `hpcelastic run --stall-timeout`: localized from the workers'
stacks (py-spy), only that group restarts and heals from a peer, the other group keeps stepping."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcelastic import events
from hpcelastic.hangs import pyspy
from hpcelastic.rundir import RunDir
from tests.replica_checks import check_group_restart, train_args

pytest.importorskip("torchft")
pytestmark = pytest.mark.skipif(pyspy.pyspy_path() is None, reason="py-spy is not installed")
STEPS = 160
STALL_TIMEOUT = 8


@pytest.mark.parametrize("heartbeats", [True, False], ids=["heartbeats", "stacks-only"])
def test_hang_in_group_1_is_localized_and_restarts_only_group_1(tmp_path: Path, heartbeats: bool) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "4", "--nproc-per-node", "1"]
    cmd += ["--replica-groups", "2", "--run-dir", str(run_dir), "--rdzv-timeout", "60"]
    cmd += ["--stall-timeout", str(STALL_TIMEOUT)]
    # Collective and quorum timeouts longer than the detection: the hang is found by the stall timeout.
    cmd += [*train_args(out, steps=STEPS, crash_at=10), "--fault", "hang", "--timeout", "90"]
    cmd[cmd.index("--quorum-timeout") + 1] = "90"
    if not heartbeats:  # a script without the worker API: only the stack samples show progress
        cmd.append("--no-heartbeat")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    log = RunDir(run_dir).events()
    numbers = check_group_restart(
        out, log, steps=STEPS, extra_pause_s=STALL_TIMEOUT + 10, heartbeats=heartbeats
    )
    [restart] = log.of(events.REPLICA_GROUP_RESTARTING)
    [cause] = log.of(events.ROOT_CAUSE)
    # The hung rank (rank 1 of group 1, on node 3) is named, at its line, not the rank waiting in the quorum.
    assert (cause["rank"], cause["node_rank"]) == (1, 3), cause
    assert cause["error"].startswith("stalled: hung at ") and "torchft_train.py" in cause["error"], cause
    assert "in maybe_crash" in cause["error"], cause
    stacks = json.loads((run_dir / "stacks" / "attempt-0" / f"round-{cause['round']}.json").read_text())
    assert stacks["localization"]["root_ranks"] == [1] and sorted(stacks["ranks"]) == ["0", "1"], stacks
    hung_at = json.loads((out / "crashed").read_text())["ts"]
    detected = restart["ts"] - hung_at
    assert detected < STALL_TIMEOUT + 10, f"hang found {detected:.1f} s after it began"
    assert "replica group 1: no rank made progress" in output
    (tmp_path / "output.txt").write_text(output)
    print(f"hang detected and group 1 restarting {detected:.1f} s after the hang; {numbers}")
