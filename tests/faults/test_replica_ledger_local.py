"""The lost-time ledger of a real torchft replica-group run (`hpcelastic run`, gloo on CPU): a worker of
group 1 is SIGKILLed; the ledger charges the lost time to group 1 only and the job keeps its productive
time (before, the groups' parallel rounds made the whole attempt start-up: ETTR 0 %)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.replica_checks import train_args

pytest.importorskip("torchft")
STEPS = 160


def test_ledger_of_a_replica_run_with_a_killed_worker(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "4", "--nproc-per-node", "1"]
    cmd += ["--replica-groups", "2", "--run-dir", str(run_dir), "--rdzv-timeout", "60"]
    cmd += train_args(out, steps=STEPS, crash_at=10)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert (out / "crashed").exists(), "the injected SIGKILL did not happen"

    status = [sys.executable, "-m", "hpcelastic", "status", str(run_dir)]
    data = json.loads(subprocess.run([*status, "--json"], capture_output=True, text=True, check=True).stdout)
    led = data["ledger"]
    rep = led["replica_groups"]
    assert rep["groups"] == 2
    assert rep["replica_steps_possible"] == 2 * STEPS, rep
    healthy, killed = rep["per_group"]
    assert killed["lost_s"] > 0 and killed["restarts"] == 1, killed
    # Group 1 misses the steps group 0 commits without it: none when group 0 was itself held up (its
    # allreduce with the dead worker timing out) until group 1 was back, as on a loaded machine.
    assert rep["replica_steps_committed"] == 2 * STEPS - killed["steps_missed"], rep
    assert 0.5 < rep["replica_step_efficiency"] <= 1.0, rep
    assert healthy["lost_s"] == 0 and healthy["restarts"] == 0 and healthy["steps_missed"] == 0, healthy
    assert healthy["productive_s"] > killed["productive_s"] > 0
    # The job itself was never interrupted: no job incident, its productive time is group 0's.
    assert led["incidents"] == [] and led["ettr"] > 0.3, led["ettr"]
    assert led["productive_s"] == pytest.approx(healthy["productive_s"], abs=0.01)
    # The time from the last step to the end of the attempt is its own category.
    assert led["badput_by_phase"].get("shutdown", 0) > 0, led["badput_by_phase"]

    text = subprocess.run(status, capture_output=True, text=True, check=True).stdout
    assert "replica groups: 2; replica-step efficiency" in text
    assert "group 1 worker_failure" in text and "healed from group(s) 0" in text
    print(text[text.index("where the time went:") :])
