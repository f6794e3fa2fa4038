"""A DDP script that saves through DCP and lets ``DistributedDataParallel`` outlive
``destroy_process_group`` (freed when ``main`` returns, as most scripts do) ends under ``hpcelastic run``
with slow-node detection on (the default, which turns torch's Flight Recorder on): no worker hangs in
``ProcessGroupGloo``'s destructor (pytorch/pytorch#56297; ``agent/pg_teardown.py``).

Without the settle, 11 of 20 such runs hung at exit here (0 of 20 with it): four runs in a row, each
given 90 s, would all have ended on the old code with a chance of about 4 %.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.slow_job import train_args
from tests.slurm_utils import events, leaked_processes, named

RUNS, STEPS = 4, 60


def test_a_ddp_script_whose_ddp_outlives_its_group_ends_under_hpcelastic(tmp_path: Path) -> None:
    for i in range(RUNS):
        out, run = tmp_path / f"out-{i}", tmp_path / f"run-{i}"
        argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "2"]
        argv += ["--max-restarts", "0", "--run-dir", str(run)]
        script = [*train_args(out, run / "checkpoints", STEPS, 0.0, dcp=True), "--ddp-outlives-group"]
        proc = subprocess.Popen([*argv, *script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"run {i} did not end in 90 s (a worker hung at exit?)") from None
        finally:
            for p in leaked_processes(run):
                p.kill()
        assert proc.returncode == 0, err.decode()[-2000:]
        assert (out / "final.sha256").exists()
        assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())[-1].endswith("60")
        started = named(events(run), "workers_started")
        assert [e["spawn"] for e in started] == ["warm"], started  # the settle is a warm worker's
