"""torchft replica groups on the real Slurm testbed, through `hpcelastic submit`: 2 groups x 2 nodes; a
worker of group 1 is SIGKILLed mid-run; group 0 keeps stepping, group 1 restarts alone and heals from
group 0, both end with identical weights, and the job completes without a requeue."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcelastic.events import EventLog
from tests.replica_checks import check_group_restart, train_args
from tests.slurm_utils import events, wait_job_finished, wait_no_leaks, wait_nodes_idle

pytest.importorskip("torchft")
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STEPS = 160


def test_worker_killed_in_group_1_only_group_1_restarts(tmp_path: Path, slurm_jobs: list[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    wait_nodes_idle()
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", "testbed"]
    argv += ["--run-dir", str(tmp_path / "run"), "--time", "10", "--nodes", "4", "--nproc-per-node", "1"]
    argv += ["--replica-groups", "2", *train_args(out, steps=STEPS, crash_at=10)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    job, run = str(info["job_id"]), Path(info["run_dir"])
    slurm_jobs.append(job)
    rec = wait_job_finished(job, timeout=420)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    assert rec["NodeList"] == "node[1-4]", rec
    evs = events(run)
    rounds = [e for e in evs if e["event"] == "rendezvous"]
    assert [r["hosts"] for r in rounds] == [["node1", "node2"], ["node3", "node4"], ["node3", "node4"]]
    assert not [e for e in evs if e["event"] == "requeued"]
    stats = check_group_restart(out, EventLog(evs), steps=STEPS)
    print(f"replica groups on Slurm: {stats}")
    assert not wait_no_leaks(str(run))
