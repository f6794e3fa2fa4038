"""Running ``tests/gpu/gpu_train.py`` under ``hpcelastic run`` on one GPU, for the GPU tests and
``bench/gpu_check.py`` alike.

Where no CUDA device exists the GPU tests skip with :func:`why_no_gpu`'s reason.
``HPCELASTIC_GPU_REHEARSAL=1`` runs them on the CPU instead (gloo, no NVML): a rehearsal of the harness for
whoever changes it on a machine without a GPU; it proves nothing about CUDA and CI never sets it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcelastic.rundir import RunDir

TRAIN = Path(__file__).with_name("gpu_train.py")
REHEARSAL_VARIABLE = "HPCELASTIC_GPU_REHEARSAL"
#: Steps of every run: the fault-free digest is the same for all of them.
STEPS = 30


def rehearsal() -> bool:
    return os.environ.get(REHEARSAL_VARIABLE) == "1"


def device() -> str:
    return "cpu" if rehearsal() else "cuda"


def why_no_gpu() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    if rehearsal():
        return None
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): scripts/gpu_check.sh runs on a GPU"
    return None


def first_gpu() -> str:
    """The GPU the check uses, named as Slurm would give it to the job (``CUDA_VISIBLE_DEVICES``)."""
    visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if g.strip()]
    return visible[0] if visible else "0"


@dataclass
class GpuRun:
    """One finished ``hpcelastic run`` of the training script."""

    returncode: int
    output: str
    run_dir: Path
    out: Path
    events: list[dict[str, Any]] = field(default_factory=list)

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    def report(self, rank: int = 0) -> dict[str, Any]:
        return json.loads((self.out / f"rank-{rank}.json").read_text())

    def start_times(self, restart: int, rank: int = 0) -> dict[str, float]:
        return json.loads((self.out / f"start-{rank}-{restart}.json").read_text())


def run_training(
    tmp: Path,
    name: str,
    train_args: tuple[str, ...] = (),
    agent_args: tuple[str, ...] = (),
    *,
    cpus: list[int] | None = None,
    timeout: float = 240,
) -> GpuRun:
    """``hpcelastic run --nodes 1 --nproc-per-node 1`` of the training script on the first GPU, given to
    the agent as Slurm gives a job its GPU (``CUDA_VISIBLE_DEVICES``), on ``cpus`` when given."""
    run_dir, out = tmp / f"{name}-run", tmp / f"{name}-out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first_gpu(), "PYTHONUNBUFFERED": "1"}
    # With one worker per node the agent leaves OMP_NUM_THREADS unset, and numpy's OpenBLAS would start a
    # thread pool in the fork server, which then refuses warm starts (docs/ARCHITECTURE.md): a one-GPU
    # node's job sets this to get them, as this check does.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.pop("HPCELASTIC_CHECKPOINT_DIR", None)
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "1", "--nproc-per-node", "1"]
    cmd += ["--run-dir", str(run_dir), *agent_args, str(TRAIN)]
    cmd += ["--steps", str(STEPS), "--out", str(out), "--device", device(), *train_args]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    events = list(RunDir(run_dir).events()) if run_dir.exists() else []
    return GpuRun(proc.returncode, proc.stdout + proc.stderr, run_dir, out, events)


def restart_times(run: GpuRun) -> dict[str, float]:
    """Crash -> the new worker past ``init_process_group``, and -> its first step done on the GPU (s), from
    the times the script wrote itself (so under any launcher)."""
    crashed = float(json.loads((run.out / "crash-0.json").read_text())["ts"])
    again = run.start_times(restart=1)
    return {"to_init_s": again["init"] - crashed, "to_first_step_s": again["step"] - crashed}
