"""Slow-node detection end to end, through the real CLI: ``hpcelastic run --nodes 2 --spare-nodes 1`` with
an unchanged, self-checkpointing DDP script (gloo), two workers a node. One node's workers are slowed the
way the kernel does it (a cgroup v1 CPU quota on their processes); the coordinator names that node, kind
compute, costs it against a swap's measured cost, and at the next checkpoint the node leaves and the spare
takes its place; the job ends with the model of a fault-free run, the ledger charges the slow time to
``slow``.

The same script without a quota, with the noise a detector must not act on (a CPU load on every node alike,
one rank's longer batches every third step), names no node and swaps nothing.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slow_job import QUOTA, SLOW_AFTER_STEP, STEP_TIME, reference_digest, train_args
from tests.slurm_utils import events, named, status_json

pytestmark = pytest.mark.slow

#: 900 steps: three minutes at the padded pace.
STEPS = 900
#: The noisy fault-free half: steps padded to 0.05 s (at least 80 s), noise from step 600.
NOISY_STEPS, NOISY_STEP_TIME, NOISE_AFTER_STEP = 1600, 0.05, 600


def _start(
    tmp_path: Path, *flags: str, steps: int = STEPS, extra: tuple[str, ...] = (), step_time: float = STEP_TIME
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


def test_a_node_slowed_by_a_cpu_quota_is_named_and_a_spare_replaces_it(tmp_path: Path, cpu_quota) -> None:  # type: ignore[no-untyped-def]
    proc, run = _start(tmp_path, "--spare-nodes", "1", "--slow-action", "swap")
    try:
        _wait_for(tmp_path / "pids" / "rank-3", proc, 180)
        _wait_for(run / "checkpoints" / f"ckpt-{SLOW_AFTER_STEP:06d}.pt", proc, 300)
        for rank in (2, 3):  # node 1's workers
            cpu_quota(int((tmp_path / "pids" / f"rank-{rank}").read_text()), QUOTA)
        assert proc.wait(timeout=900) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    evs = events(run)
    rounds = named(evs, "rendezvous")
    slow_node = rounds[0]["hosts"][1]
    slow = named(evs, "node_slow")
    swaps = [e for e in slow if e["action"] == "swap"]
    assert swaps, (slow, named(evs, "job_slow"))
    assert {e["node"] for e in slow} == {slow_node}, slow  # never the healthy node
    assert swaps[0]["kind"] == "compute" and swaps[0]["slowdown"] >= 0.3, swaps
    spare = swaps[0]["spare"]
    assert [e["action"] for e in slow][:2] == ["report", "exclude"], slow  # the ladder, in order
    # The next round runs on the healthy node and the spare; the slow node left as a bad node.
    assert rounds[-1]["hosts"] == [rounds[0]["hosts"][0], spare], rounds
    assert (tmp_path / "final.sha256").read_text() == reference_digest(STEPS)
    ledger = status_json(str(run))["ledger"]
    assert ledger["badput_by_cause"].get("slow", 0) > 10, ledger["badput_by_cause"]
    assert named(evs, "slow_time")


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
