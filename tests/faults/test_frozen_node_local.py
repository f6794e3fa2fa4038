"""A whole node frozen (SIGSTOP of its agent and every worker) is named as the root cause; the job goes on.

Real `hpcelastic run` agents (no Slurm), real gloo: the coordinator stops hearing node 1's agent, declares the
node lost within the detection bound (silence, then unanswered probes), names it in ``root_cause`` and
restarts on the surviving node. Again with the heartbeats a 16,384-node job has (every 8.2 s, silence
suspected after 20.5 s) and the peer watch that such a job runs (``agent/peerwatch.py``): the node's watcher
finds it as fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.slurm_utils import REPO

pytestmark = pytest.mark.slow


def events(run: Path) -> list[dict[str, Any]]:
    lines = [line for f in sorted(run.glob("events*.jsonl")) for line in f.read_text().splitlines()]
    return sorted((json.loads(line) for line in lines if line.strip()), key=lambda e: e["ts"])


def agent_of_node(run: Path, node: int) -> psutil.Process | None:
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = p.environ()
            mine = env.get("HPCELASTIC_RUN_DIR") == str(run) and "agent" in p.cmdline()
            if mine and env.get("HPCELASTIC_LOCAL_NODE_RANK") == str(node):
                return p
    return None


#: As ``runtime.Timing.for_nodes(16384)`` has them: without the peer watch a frozen node is found after 23 s.
LARGE_JOB = {"HPCELASTIC_HEARTBEAT_INTERVAL": "8.192", "HPCELASTIC_PEER_WATCH": "1"}


@pytest.mark.parametrize("timing", [{}, LARGE_JOB], ids=["small-job", "large-job-peer-watch"])
def test_frozen_node_is_named_and_the_job_finishes(tmp_path: Path, timing: dict[str, str]) -> None:
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "1:2", "--nproc-per-node", "2"]
    argv += ["--stall-timeout", "10", "--max-restarts", "1", "--run-dir", str(run)]
    argv += [str(REPO / "examples" / "hang_train.py"), "--steps", "40", "--step-time", "0.3"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANG_")} | timing
    launcher = subprocess.Popen(
        argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    frozen: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        agent = None
        while time.monotonic() < deadline and not (
            agent and (run / "checkpoints" / "step-000005.pt").exists()
        ):
            agent = agent or agent_of_node(run, 1)
            time.sleep(0.5)
        assert agent is not None, "node 1's agent never started"
        frozen = [agent, *agent.children(recursive=True)]
        stopped_at = time.time()
        for p in frozen:
            p.send_signal(signal.SIGSTOP)
        while time.monotonic() < deadline and not any(e["event"] == "root_cause" for e in events(run)):
            time.sleep(0.5)
        (cause,) = [e for e in events(run) if e["event"] == "root_cause"]
        assert cause["node"] == "local1" and cause["rank"] is None and "node lost" in cause["error"]
        assert cause["ts"] - stopped_at < 10
        for p in frozen:
            p.kill()
        assert launcher.wait(timeout=180) == 0, (
            launcher.stderr.read().decode()[-2000:] if launcher.stderr else ""
        )
        assert [e["event"] for e in events(run)][-1] == "job_succeeded"
    finally:
        for p in frozen:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
