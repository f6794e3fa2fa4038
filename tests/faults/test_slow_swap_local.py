"""Slow-node detection must not act on noise, through the real CLI: ``hpcelastic run --nodes 2
--spare-nodes 1`` with an unchanged, self-checkpointing DDP script (gloo, two workers a node), detection on
(the default): a CPU hog on every node alike (each node's workers and its hog under one CPU quota: a
node's own CPUs) and one rank's longer batches every third step name no node and swap nothing; the job
ends with the fault-free model. (A slowed node named and replaced: the same script through ``hpcelastic
submit`` on the testbed, tests/slurm/test_slow_node_slurm.py.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slow_job import reference_digest, resumed_steps, train_args
from tests.slurm_utils import events, named

#: One group for the local slow-node tests (this module, test_slow_signal_local.py, test_slow_input_local.py):
#: each judges a job's pace on the machine's two cores, so they run in turn, never against each other's CPU
#: hogs and quotas (official CI: a quota'd rank beside another test's hogs was not the slowest).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slow-local")]

#: Steps padded to 0.05 s (at least 85 s in all), the noise from step 600: 1,100 noisy steps, over 100 s
#: even alone on the machine (a slow node is named in about 65 s: bench/slow_localization.py; the job-wide
#: report takes five slow windows of six after the pace's three: official CI's 700 noisy steps, at 16
#: steps/s before the noise, ended with slow time on the ledger but no report).
NOISY_STEPS, NOISY_STEP_TIME, NOISE_AFTER_STEP = 1700, 0.05, 600
#: Each node's CPUs (a quota on its workers and its hog) once the noise starts.
NODE_SHARE = 0.5


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


def test_a_load_on_every_node_and_a_workload_stripe_name_no_node(tmp_path: Path, cpu_quota) -> None:  # type: ignore[no-untyped-def]
    """Noise a detector must not act on: from step 600 a CPU hog on every node alike (the job runs below
    its pace), and every third step rank 1 gets 40 batches more (a stripe the workload makes). Steps padded
    to 0.05 s only, so that both show in the pace.

    Every node's two workers and its hog share one CPU quota, the node's CPUs: six hogs on the whole
    machine were not "every node alike" (the emulated nodes share its CPUs; on some kernels the scheduler
    kept one node's workers behind the other's for minutes, and that node was rightly named)."""
    stripe = ("--stripe-every", "3", "--stripe-rank", "1", "--stripe-batches", "40")
    flags = ("--spare-nodes", "1", "--slow-action", "swap")
    proc, run = _start(tmp_path, *flags, steps=NOISY_STEPS, extra=stripe, step_time=NOISY_STEP_TIME)
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        _wait_for(run / "checkpoints" / f"ckpt-{NOISE_AFTER_STEP:06d}.pt", proc, 300)
        for node in range(2):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            workers = [int((tmp_path / "pids" / f"rank-{r}").read_text()) for r in (2 * node, 2 * node + 1)]
            cpu_quota([*workers, hogs[-1].pid], NODE_SHARE)
        assert proc.wait(timeout=900) == 0
    finally:
        for p in [proc, *hogs]:
            if p.poll() is None:
                p.kill()
    evs = events(run)
    assert not named(evs, "node_slow"), named(evs, "node_slow")
    assert len(named(evs, "rendezvous")) == 1  # nothing swapped
    assert named(evs, "job_slow"), "the hogs did not take the job below its pace: the test tests nothing"
    assert all(not e.get("bad_nodes") for e in named(evs, "attempt_ended")), named(evs, "attempt_ended")
    assert resumed_steps(tmp_path) == ()  # never restarted
    assert (tmp_path / "final.sha256").read_text() == reference_digest(NOISY_STEPS)
