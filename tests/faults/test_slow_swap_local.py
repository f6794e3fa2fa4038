"""Slow-node detection must not act on noise, through the real CLI: ``hpcelastic run --nodes 2
--spare-nodes 1`` with an unchanged, self-checkpointing DDP script (gloo, two workers a node), detection on
(the default): a CPU load on every node alike and one rank's longer batches every third step name no node
and swap nothing; the job ends with the fault-free model. (A slowed node named and replaced: the same
script through ``hpcelastic submit`` on the testbed, tests/slurm/test_slow_node_slurm.py.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slow_job import reference_digest, train_args
from tests.slurm_utils import events, named

pytestmark = pytest.mark.slow

#: Steps padded to 0.05 s (at least 80 s in all), the noise from step 600.
NOISY_STEPS, NOISY_STEP_TIME, NOISE_AFTER_STEP = 1600, 0.05, 600


def _start(
    tmp_path: Path, *flags: str, steps: int, extra: tuple[str, ...] = (), step_time: float
) -> tuple[subprocess.Popen[bytes], Path]:
    run = tmp_path / "run"
    # Two workers a node: their fork server starts them warm (one alone would import torch with OpenBLAS's
    # threads, and cold workers record no collectives).
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "2"]
    argv += ["--max-restarts", "2", "--run-dir", str(run), *flags]
    # The agents' checkpoint directory (RUN/checkpoints) is where the script saves: the agent sees saves end.
    train = [*train_args(tmp_path, run / "checkpoints", steps, step_time), *extra]
    proc = subprocess.Popen([*argv, *train], stdout=subprocess.DEVNULL)
    return proc, run


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the job ended before {path.name}"
        assert time.monotonic() < end, f"no {path.name} in {timeout:.0f} s"
        time.sleep(0.5)


def test_a_load_on_every_node_and_a_workload_stripe_name_no_node(tmp_path: Path) -> None:
    """Noise a detector must not act on: from step 600 six CPU hogs load the machine (every node alike: the
    job runs below its pace), and every third step rank 1 gets 40 batches more (a stripe the workload makes).
    Steps padded to 0.05 s only, so that both show in the pace."""
    stripe = ("--stripe-every", "3", "--stripe-rank", "1", "--stripe-batches", "40")
    flags = ("--spare-nodes", "1", "--slow-action", "swap")
    proc, run = _start(tmp_path, *flags, steps=NOISY_STEPS, extra=stripe, step_time=NOISY_STEP_TIME)
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        _wait_for(run / "checkpoints" / f"ckpt-{NOISE_AFTER_STEP:06d}.pt", proc, 300)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(6)]
        assert proc.wait(timeout=900) == 0
    finally:
        for p in [proc, *hogs]:
            if p.poll() is None:
                p.kill()
    evs = events(run)
    assert not named(evs, "node_slow"), named(evs, "node_slow")
    assert len(named(evs, "rendezvous")) == 1  # nothing swapped
    # (Measured here: the hogs took the job 32 % below its pace: `job_slow`, its time in `slow_time`.)
    assert all(not e.get("bad_nodes") for e in named(evs, "attempt_ended")), named(evs, "attempt_ended")
    assert (tmp_path / "final.sha256").read_text() == reference_digest(NOISY_STEPS)
