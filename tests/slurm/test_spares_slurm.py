"""Hot spares on the real Slurm testbed: `hpcelastic submit --nodes 2 --spare-nodes 1` holds a third node;
when a worker node's agent dies (SIGKILL of its whole process tree) the spare takes its place in the same
allocation, the world size stays the same and the job ends with the parameters of a fault-free run."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from tests.slurm_utils import (
    events,
    final_digest,
    named,
    reference_digest,
    status_json,
    submit_reference,
    wait_job_finished,
    wait_no_leaks,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def node_agent(run: Path, node: str) -> psutil.Process | None:
    """The hpcelastic agent of ``run`` on testbed node ``node`` (by its SLURMD_NODENAME)."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if "hpcelastic" in cmd and "agent" in cmd:
                env = p.environ()
                if env.get("HPCELASTIC_RUN_DIR") == str(run) and env.get("SLURMD_NODENAME") == node:
                    return p
        except (psutil.Error, OSError):
            continue
    return None


def test_spare_is_promoted_when_a_worker_node_agent_dies(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(
        tmp_path,
        "--nodes", "2", "--spare-nodes", "1", "--gpus-per-node", "2", "--max-restarts", "1",
        train=("--step-time", "0.2"),
    )  # fmt: skip
    slurm_jobs.append(job)
    deadline = time.monotonic() + 180
    while not (run / "checkpoints" / "step-000010.pt").exists():
        assert time.monotonic() < deadline, "training never reached step 10"
        time.sleep(0.1)
    agent = node_agent(run, "node2")
    assert agent is not None
    for p in [agent, *agent.children(recursive=True)]:
        p.kill()
    rec = wait_job_finished(job)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    assert rec["NodeList"] == "node[1-3]" and rec["NumNodes"] == "3", rec
    evs = events(run)
    (lost,) = named(evs, "node_lost")
    assert lost["node"] == "node2"
    rounds = named(evs, "rendezvous")
    assert [r["hosts"] for r in rounds] == [["node1", "node2"], ["node1", "node3"]]
    assert [r["world_size"] for r in rounds] == [4, 4]
    assert len(named(evs, "attempt_started")) == 1
    assert final_digest(tmp_path) == reference_digest()
    assert not wait_no_leaks(str(run))
    assert status_json(str(run))["outcome"] == "succeeded"
