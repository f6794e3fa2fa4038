"""`hpcelastic run --nodes 2 --spare-nodes 1`: three agents on this machine, workers on two; the spare
takes the place of an agent that is SIGKILLed with its process tree, the world size stays 4 and the job
succeeds."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from hpcelastic.agent.launcher import LocalRun, start_agents

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "reference_train.py"


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once (a node's agent and everything it started)."""
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        p.kill()


def test_spare_agent_takes_a_killed_agents_place(tmp_path: Path) -> None:
    spec = LocalRun(
        min_nodes=2,
        max_nodes=2,
        spare_nodes=1,
        nproc="2",
        max_restarts=1,
        run_dir=tmp_path / "run",
        agent_args=("--rdzv-timeout", "60", "--grace-period", "5"),
        program=(str(TRAIN), "--steps", "40", "--ckpt-every", "5", "--step-time", "0.1")
        + ("--out", str(tmp_path / "out")),
    )
    run_dir, agents = start_agents(spec)
    assert len(agents) == 3
    ckpt = run_dir.path / "checkpoints" / "step-000005.pt"
    deadline = time.monotonic() + 180
    while not ckpt.exists():
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "training never started"
        time.sleep(0.05)
    kill_tree(agents[1].pid)
    codes = [a.wait(timeout=max(1, deadline + 60 - time.monotonic())) for a in agents]
    assert codes == [0, -9, 0], codes
    evs = [e for e in run_dir.events() if e["event"] in ("rendezvous", "node_lost")]
    rounds = [e for e in evs if e["event"] == "rendezvous"]
    assert [len(r["hosts"]) for r in rounds] == [2, 2] and [r["world_size"] for r in rounds] == [4, 4]
    assert rounds[0]["hosts"][1] != rounds[1]["hosts"][1]
    assert [e["node_rank"] for e in evs if e["event"] == "node_lost"] == [1]
    final = json.loads((tmp_path / "out" / "final.json").read_text())
    assert final["world_size"] == 4 and final["steps"] == 40
