"""A real local job (`hpcelastic run`'s code path) with CPU gloo workers, for the fault tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch  # imported up front: importing it while a job trains would let a short job finish first

from hpcelastic.agent.launcher import LocalRun, start_agents
from hpcelastic.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ddp_train.py"
STEPS = 16


class LocalJob:
    """N agents on this machine running examples/ddp_train.py."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        nodes: str = "2",
        nproc: int = 2,
        max_restarts: int = 3,
        agent_args: tuple[str, ...] = (),
        train_args: tuple[str, ...] = (),
    ) -> None:
        lo, _, hi = nodes.partition(":")
        self.out = tmp_path / "final.json"
        spec = LocalRun(
            min_nodes=int(lo),
            max_nodes=int(hi or lo),
            nproc=str(nproc),
            max_restarts=max_restarts,
            run_dir=tmp_path / "run",
            agent_args=("--rdzv-timeout", "30", "--grace-period", "5", *agent_args),
            program=(str(EXAMPLE), "--steps", str(STEPS), "--out", str(self.out), *train_args),
        )
        self.run_dir, self.agents = start_agents(spec)
        self.rd = RunDir(self.run_dir.path)

    def wait(self, timeout: float = 90) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for a in self.agents:
            try:
                codes.append(a.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for b in self.agents:
                    b.kill()
                pytest.fail(f"agents still running after {timeout} s; events: {self.rd.events()}")
        return codes

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.rd.events() if name is None or e["event"] == name]

    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        pytest.fail(f"timed out waiting for {what}; events: {self.rd.events()}")

    def wait_for_training(self, min_step: int = 2) -> None:
        """Until rank 0 has checkpointed step ``min_step`` (so a fault lands mid-training)."""
        ckpt = self.run_dir.path / "checkpoints" / "ddp_train.pt"

        def progressed() -> bool:
            logs = self.run_dir.path / "logs" / "attempt-0" / "rank-0.log"
            return (
                ckpt.exists()
                and logs.exists()
                and logs.read_text().count("\n") >= 0
                and self._step() >= min_step
            )

        self.wait_until(f"training step {min_step}", progressed)

    def _step(self) -> int:
        try:
            return int(
                torch.load(self.run_dir.path / "checkpoints" / "ddp_train.pt", weights_only=True)["step"]
            )
        except Exception:
            return -1

    def kill_agent(self, i: int) -> None:
        os.kill(self.agents[i].pid, signal.SIGKILL)

    def final_params(self) -> list[float]:
        return json.loads(self.out.read_text())["params"]
