"""torchft replica groups under `hpcelastic run`: a failure restarts only its group, healed from a peer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcelastic.rundir import RunDir
from tests.replica_checks import check_group_restart, train_args

pytest.importorskip("torchft")
STEPS = 160


def test_worker_killed_in_group_1_restarts_only_group_1(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "4", "--nproc-per-node", "1"]
    cmd += ["--replica-groups", "2", "--run-dir", str(run_dir), "--rdzv-timeout", "60"]
    cmd += train_args(out, steps=STEPS, crash_at=10)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    output = proc.stdout + proc.stderr
    assert "[INFO] [torchft::" not in output, "torchft's per-quorum INFO lines belong in the rank logs"
    assert "replica group 1: restarting" in output
    check_group_restart(out, RunDir(run_dir).events(), steps=STEPS)
    status = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", str(run_dir)], capture_output=True, text=True
    )
    assert "replica group 1 restarting" in status.stdout and "healed from group(s) 0" in status.stdout
    assert "[INFO] [torchft::lighthouse]" in (run_dir / "logs" / "lighthouse.log").read_text()


def test_replica_groups_must_split_the_nodes(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("")
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "3", "--replica-groups", "2"]
    cmd += ["--run-dir", str(tmp_path / "run"), "x.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("3 node(s) do not split into 2 replica groups of equal size")
    assert not (tmp_path / "run").exists()
