"""``hpcelastic cancel`` while the executor resubmits the job, on the real Slurm testbed (issue 18 item 7).

Two runs go in through ``hpcelastic submit`` in resubmit mode; rank 0 of each fails at step 12, so the
agent resubmits the batch script. The run index (``$XDG_STATE_HOME/hpcelastic/index.jsonl``), which the
executor appends the new job id to between ``sbatch`` returning and the ``resubmitted`` event, is a
named pipe nobody reads: the executor stalls there, like one on a slow filesystem, with the new job
queued behind the old one but not yet in the event log. Then the user runs ``hpcelastic cancel``:

* run ``released``: the pipe is read right after the cancel, the executor goes on and finds the
  run cancelled after its ``sbatch``: the new job is scancelled while it waits and never runs;
* run ``stalled``: the pipe is never read, Slurm kills the stalled agent with the cancelled job, the
  new job starts anyway: its agents find the run cancelled before any attempt begins, and rank 0
  scancels it.

Either way the new job ends CANCELLED (``scontrol show job``), no attempt 1 begins and no worker runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.slurm_utils import TRAIN, events, named, train_args, wait_job_finished, wait_nodes_idle

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def _submit(base: Path) -> tuple[str, Path, Path]:
    """Submit the reference training (rank 0 fails at step 12) in resubmit mode; returns (job, run, index)."""
    site = base / "site.yaml"
    site.write_text(
        (REPO / "site_configs" / "testbed.yaml").read_text().replace("mode: requeue", "mode: resubmit")
    )
    env = dict(os.environ, XDG_STATE_HOME=str(base / "state"))
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", str(site)]
    argv += ["--run-dir", str(base / "run"), "--time", "5", "--nodes", "1", "--gpus-per-node", "1"]
    argv += ["--max-restarts", "0", str(TRAIN), *train_args(30), "--out", str(base / "out")]
    argv += ["--fault", "exit", "--fault-step", "12", "--fault-rank", "0"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=base, env=env)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    index = base / "state" / "hpcelastic" / "index.jsonl"
    index.unlink()
    os.mkfifo(index)  # the executor's record_job now blocks in open() until someone reads
    return str(info["job_id"]), Path(info["run_dir"]), index


def _dependent_job(job: str, timeout: float = 60) -> str:
    """The job Slurm queued behind ``job`` (the resubmission), once ``sbatch`` returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-o", "%i|%E"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            jid, _, deps = line.partition("|")
            if f"afterany:{job}" in deps:
                return jid.strip()
        time.sleep(0.3)
    raise AssertionError(f"nothing was resubmitted behind job {job} in {timeout:.0f} s")


def _cancel(run: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "cancel", str(run)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_a_cancel_during_a_resubmission_ends_the_new_job_before_any_attempt(
    tmp_path: Path, slurm_jobs: list[str]
) -> None:
    wait_nodes_idle(2)
    new: dict[str, str] = {}
    runs: dict[str, Path] = {}
    for name in ("released", "stalled"):
        (tmp_path / name).mkdir()
        job, runs[name], index = _submit(tmp_path / name)
        slurm_jobs.append(job)
        new[name] = _dependent_job(job)
        slurm_jobs.append(new[name])
        assert not named(events(runs[name]), "resubmitted")  # the executor is stalled after sbatch
        _cancel(runs[name])
        if name == "released":
            threading.Thread(target=index.read_bytes, daemon=True).start()

    for name, run in runs.items():
        rec = wait_job_finished(new[name], timeout=60)
        assert rec["JobState"] == "CANCELLED", (name, rec)
        evs = events(run)
        assert [e["attempt"] for e in named(evs, "attempt_started")] == [0], name
        assert not (run / "logs" / "attempt-1").exists(), name
        assert new[name] in [str(e["job_id"]) for e in named(evs, "cancelled")], name
    assert named(events(runs["released"]), "resubmitted")
    assert wait_job_finished(new["released"])["NodeList"] in ("", "(null)")  # it never ran
    rec = wait_job_finished(new["stalled"])
    assert rec["NodeList"] not in ("", "(null)")  # it started, its agents left
