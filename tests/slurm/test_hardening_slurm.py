"""Issue 10 on the real Slurm testbed: progress reaches the requeue decision, one line per decision."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcelastic.jobs.slurm import exclude_nodes
from tests.slurm_utils import events, job_record, named, submit_reference, wait_job_finished, wait_no_leaks

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_alike_failures_after_progress_are_not_a_startup_failure(
    tmp_path: Path, slurm_jobs: list[str]
) -> None:
    """Two attempts crash the same way at step 3, before any checkpoint, after heartbeats with steps.

    Only the workers' heartbeats show the progress: the second attempt must be judged on the requeue
    budget (limit reached, exit 3), not refused as a start-up failure (exit 8).
    """
    job, run = submit_reference(
        tmp_path,
        "--nodes", "1", "--gpus-per-node", "1", "--max-restarts", "0", "--max-requeues", "1",
        train=("--fault", "exit", "--fault-step", "3", "--fault-rank", "0", "--fault-attempt", "-1",
               "--fault-restart", "-1", "--ckpt-every", "1000"),
    )  # fmt: skip
    slurm_jobs.append(job)
    rec = wait_job_finished(job, timeout=240)
    assert rec["JobState"] == "FAILED" and rec["Restarts"] == "1" and rec["ExitCode"] == "3:0", rec
    evs = events(run)
    assert not named(evs, "checkpoint_published")
    ended = named(evs, "attempt_ended")
    assert [(e["attempt"], e["reason"], e["progressed"]) for e in ended] == [
        (0, "restarts_exhausted", True),
        (1, "restarts_exhausted", True),
    ]
    assert ended[0]["signature"] == ended[1]["signature"]
    assert [e["reason"] for e in named(evs, "requeue_skipped")] == ["limit_reached"]
    assert [e["reason"] for e in named(evs, "job_failed")] == ["restarts_exhausted"]
    # Issue 10, 19: each decision is said once, on a line of its own.
    out = "".join(p.read_text() for p in sorted(run.glob("slurm-*.out")))
    ours = [line for line in out.splitlines() if "hpcelastic" in line]
    assert sum("attempt 0 ended" in line for line in ours) == 1, ours
    assert all(line.count("hpcelastic") == 1 and line.startswith("hpcelastic") for line in ours), ours
    assert not wait_no_leaks(str(run))


def test_a_released_node_leaves_the_exclude_list_others_stay(tmp_path: Path, slurm_jobs: list[str]) -> None:
    """Issue 10, 15: a node whose cooldown is over leaves ExcNodeList; the user's own --exclude stays."""
    argv = ["sbatch", "--parsable", "--hold", "-p", "debug", "-N1", "--exclude=node3", "-o", "/dev/null"]
    proc = subprocess.run([*argv, "--wrap", "sleep 1"], capture_output=True, text=True, check=True)
    job = proc.stdout.strip()
    slurm_jobs.append(job)
    exclude_nodes(job, ["node2", "node4"])
    assert job_record(job)["ExcNodeList"] == "node[2-4]"
    exclude_nodes(job, [], release=["node2"])
    assert job_record(job)["ExcNodeList"] == "node[3-4]"
    exclude_nodes(job, ["node1"], release=["node4"])
    assert job_record(job)["ExcNodeList"] == "node[1,3]"


def _slow_sbatch(tmp_path: Path) -> dict[str, str]:
    """PATH with an ``sbatch`` that submits through the real one, then never answers (a lost reply); its
    ``--version`` answers at once."""
    bin_dir = tmp_path / "slow-bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "sbatch"
    real = shutil.which("sbatch")
    wrapper.write_text(
        f'#!/bin/sh\n[ "$1" = --version ] && exec {real} "$@"\n'
        f'{real} "$@" > {tmp_path}/real-reply\nexec sleep 120\n'
    )
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", XDG_STATE_HOME=str(tmp_path / "state"))
    return {k: v for k, v in env.items() if not k.startswith("SLURM_")}


def test_ctrl_c_after_sbatch_queued_the_job_keeps_the_run_dir(tmp_path: Path, slurm_jobs: list[str]) -> None:
    """Issue 10, 14: Ctrl-C while sbatch's reply is outstanding; the job is queued, so its run dir stays."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--site", "testbed", "--run-dir", str(run)]
    argv += ["--time", "5", "--sbatch-arg=--hold", str(tmp_path / "train.py")]
    proc = subprocess.Popen(
        argv,
        env=_slow_sbatch(tmp_path),
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        reply = tmp_path / "real-reply"
        while not (reply.exists() and reply.read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        job = reply.read_text().strip()
        slurm_jobs.append(job)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert f"job {job} was already queued" in err and "Traceback" not in err
    assert job_record(job)["JobState"] == "PENDING"
    assert (run / "job.sbatch").is_file() and (run / "secret").is_file()
    assert [e["job_id"] for e in events(run) if e["event"] == "submitted"] == [job]
