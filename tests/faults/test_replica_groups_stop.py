"""A stop signal to `hpcelastic run --replica-groups 2`: every rank of every torchft replica group stops after
the same step, a checkpoint is published, the run ends preempted (exit 5), and a rerun resumes every group
from that checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpcelastic import events, handoff
from hpcelastic.rundir import RunDir
from tests.replica_checks import train_args

pytest.importorskip("torchft")
STEPS = 80


def _run(out: Path, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "4", "--nproc-per-node", "1"]
    cmd += ["--replica-groups", "2", "--run-dir", str(run_dir), "--rdzv-timeout", "60"]
    cmd += ["--grace-period", "30", *train_args(out, steps=STEPS), "--checkpoint-every", "1000", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _groups(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"group{g}.json").read_text()) for g in (0, 1)]


def _stepping(run_dir: Path) -> bool:
    """Both groups' workers started and steps are being committed."""
    if not list(run_dir.glob("events*")):
        return False
    log = RunDir(run_dir).events()
    return bool(log.of(events.PROGRESS)) and len(log.of(events.WORKERS_STARTED)) >= 2


def _agent_of_node(launcher: int, node_rank: int) -> int:
    """The pid of `hpcelastic run`'s agent for local node rank ``node_rank``."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"HPCELASTIC_LOCAL_NODE_RANK={node_rank}".encode() in environ:
            return pid
    raise AssertionError(f"no agent for node {node_rank} among {children}")


def _stop_mid_run(out: Path, run_dir: Path, *, one_agent: bool) -> tuple[int, str]:
    """Start the job, send SIGUSR2 once both groups step (to `hpcelastic run`, or to node 3's agent
    alone); every rank must stop after the same step. Returns that step and the job's output."""
    out.mkdir()
    job = _run(out, run_dir)
    try:
        deadline = time.monotonic() + 240
        while not _stepping(run_dir):
            assert time.monotonic() < deadline and job.poll() is None, "training never started"
            time.sleep(0.2)
        time.sleep(2)
        target = _agent_of_node(job.pid, 3) if one_agent else job.pid
        os.kill(target, signal.SIGUSR2)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            pytest.fail("the job did not stop")
    assert job.returncode == 5, output[-4000:]
    log = RunDir(run_dir).events()
    [ended] = log.of(events.ATTEMPT_ENDED)
    assert ended["reason"] == "preempted", ended
    assert not log.of(events.REPLICA_GROUP_RESTARTING) and not log.of(events.RESTARTING)
    groups = _groups(out)
    last = [g["steps"][-1][0] for g in groups]
    assert all(g["stopped"] for g in groups) and last[0] == last[1], last
    # Heartbeats carry the step just committed; the checkpoint holds the count of committed steps.
    assert f"every rank stops after step {last[0]}" in output, output[-3000:]
    assert output.count(f"stopping after step {last[0]}") == 4, output[-3000:]
    assert last[0] < STEPS - 1, "the job ended before the stop"
    assert groups[0]["params"] == groups[1]["params"]
    return last[0], output


def test_stop_signal_to_one_agent_stops_every_group_after_the_same_step(tmp_path: Path) -> None:
    step, _ = _stop_mid_run(tmp_path / "out", tmp_path / "run", one_agent=True)
    print(f"SIGUSR2 to node 3's agent: every rank of both groups stopped after step {step}")


def test_stop_signal_stops_every_group_after_one_step_and_a_rerun_resumes(tmp_path: Path) -> None:
    out, run1 = tmp_path / "out1", tmp_path / "run1"
    step, _ = _stop_mid_run(out, run1, one_agent=False)
    resume_step = step + 1
    resume = handoff.resume_path(run1)
    assert resume is not None and f"step{resume_step}.pt" in resume, resume

    out2 = tmp_path / "out2"
    out2.mkdir()
    # A new run directory has no published checkpoint: the script is handed the one the stop published.
    again = _run(out2, tmp_path / "run2", "--resume", resume)
    output2, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output2[-4000:]
    resumed = _groups(out2)
    assert [g["resumed_at"] for g in resumed] == [resume_step, resume_step], output2[-3000:]
    # A group that joins the first quorum late heals from its peer: its first commit may come later.
    firsts = [g["steps"][0][0] for g in resumed]
    assert min(firsts) == resume_step and all(f >= resume_step for f in firsts), firsts
    assert resumed[0]["params"] == resumed[1]["params"]
    print(f"every rank of both groups stopped after step {step}; both resumed at step {resume_step}")
