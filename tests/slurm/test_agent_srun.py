"""The agent under a real `srun` step on the testbed: Slurm bootstrap, restarts across nodes, node loss."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hpcelastic.rundir import RunDir
from tests.faults.localjob import EXAMPLE
from tests.slurm_utils import leaked_processes

pytestmark = pytest.mark.slurm


def srun_agents(run: RunDir, nodes: str, *train: str) -> subprocess.Popen[str]:
    cmd = [
        "srun",
        "-N",
        "4",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",
        "--unbuffered",
        "--gres=gpu:2",
        "--export=ALL",
        sys.executable,
        "-m",
        "hpcelastic",
        "agent",
        "--run-dir",
        str(run.path),
        "--nodes",
        nodes,
        "--nproc-per-node",
        "auto",
        "--max-restarts",
        "2",
        "--rdzv-timeout",
        "60",
        "--",
        str(EXAMPLE),
        "--steps",
        "14",
        "--out",
        str(run.path / "final.json"),
        *train,
    ]
    env = dict(os.environ, HPCELASTIC_RUN_DIR=str(run.path))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.fixture
def run(tmp_path: Path, slurm_cluster) -> RunDir:
    rd = RunDir.create(tmp_path / "run")
    rd.create_secret()
    return rd


def test_srun_crash_restarts_every_node(run: RunDir) -> None:
    proc = srun_agents(run, "4", "--crash-at-step", "5", "--crash-rank", "5")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    ev = run.events()
    rdzv = [e for e in ev if e["event"] == "rendezvous"]
    assert rdzv[0]["hosts"] == ["node1", "node2", "node3", "node4"] and rdzv[0]["world_size"] == 8
    assert [r["restart_count"] for r in rdzv] == [0, 1]
    cause = next(e for e in ev if e["event"] == "root_cause")
    assert (cause["rank"], cause["node"]) == (5, "node3")
    assert not leaked_processes(run.path)


def test_srun_agent_killed_job_goes_on_with_three_nodes(run: RunDir) -> None:
    proc = srun_agents(run, "3:4", "--step-time", "0.4")
    ckpt = run.path / "checkpoints" / "ddp_train.pt"
    deadline = time.monotonic() + 120
    while not ckpt.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    victims = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "agent" in (p.info["cmdline"] or [])
        and p.environ().get("SLURM_NODEID") == "3"
        and p.environ().get("HPCELASTIC_RUN_DIR") == str(run.path)
    ]
    assert victims, "no agent found on node4"
    victims[0].send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    ev = run.events()
    lost = [e for e in ev if e["event"] == "node_lost"]
    assert lost and lost[0]["node"] == "node4", out[-3000:]
    assert [e["world_size"] for e in ev if e["event"] == "rendezvous"] == [8, 6]
    assert [e for e in ev if e["event"] == "attempt_ended"][0]["reason"] == "succeeded"
