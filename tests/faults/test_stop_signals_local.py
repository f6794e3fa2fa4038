"""The stop signal and the stall timeout against checkpoint saves, on real local agents (issue 18, 4-5).

One node, three independent ranks (no collective: each plays one kind of script):

* rank 0 is an unchanged script (no ``hpcelastic.worker``, no handler for USR2) that saves a checkpoint
  slowly; the stop signal reaches it mid-save, as Slurm sends it to every process of the step;
* rank 1 calls ``heartbeat()`` but never ``should_stop()`` (as ``examples/ddp_train.py`` does);
* rank 2 calls both and stops at the job's stop step.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from hpcelastic.agent.launcher import LocalRun, start_agents
from hpcelastic.rundir import RunDir

SCRIPT = """
import os, sys, time
out, mode, rank = sys.argv[1], sys.argv[2], int(os.environ["RANK"])
ckpt = os.environ["HPCELASTIC_CHECKPOINT_DIR"]

def mark(name, text=""):
    with open(os.path.join(out, f"{name}-{rank}"), "w") as f:
        f.write(text)

def slow_save(path, seconds):
    with open(path, "wb") as f:  # a save of several seconds, as torch.save of a big model
        for _ in range(int(seconds / 0.1)):
            f.write(b"x" * 4096)
            f.flush()
            time.sleep(0.1)

if mode == "signals" and rank == 0:  # unchanged: its own loop and its own checkpoints
    for step in range(100000):
        time.sleep(0.05)
        if step == 20:
            mark("saving")
            slow_save(os.path.join(ckpt, "rank0.pt"), 3.0)
            mark("saved")
elif mode == "signals":
    from hpcelastic import worker
    for step in range(100000):
        time.sleep(0.05)
        worker.heartbeat(step)
        if rank == 2 and worker.should_stop():
            mark("stopped", str(step))
            sys.exit(0)
elif mode == "save":  # --stall-timeout 2: rank 0 saves for 5 s, rank 1 waits for it without a heartbeat
    from hpcelastic import worker
    for step in range(12):
        time.sleep(0.05)
        worker.heartbeat(step)
        if step == 5 and rank == 0:
            slow_save(os.path.join(ckpt, "big.pt"), 5.0)
            mark("saved")
        while step == 5 and not os.path.exists(os.path.join(out, "saved-0")):
            time.sleep(0.05)
    mark("done")
"""


def start(tmp_path: Path, mode: str, nproc: int, agent_args: tuple[str, ...]) -> tuple[RunDir, list, Path]:
    script, out = tmp_path / "job.py", tmp_path / "out"
    script.write_text(SCRIPT)
    out.mkdir()
    spec = LocalRun(
        min_nodes=1,
        max_nodes=1,
        nproc=str(nproc),
        max_restarts=0,
        run_dir=tmp_path / "run",
        agent_args=("--rdzv-timeout", "30", *agent_args),
        program=(str(script), str(out), mode),
    )
    run_dir, agents = start_agents(spec)
    return RunDir(run_dir.path), agents, out


def wait_file(path: Path, rd: RunDir, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"no {path.name}; events: {list(rd.events())}")
        time.sleep(0.05)


def agent_code(agent: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return agent.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()
        pytest.fail(f"the agent did not end within {timeout} s")


def test_the_stop_lets_a_save_finish_and_stops_a_rank_that_ignores_it(tmp_path: Path) -> None:
    """USR2 to the agent and to every worker at once (Slurm's ``scancel --signal=USR2``) in the middle of
    rank 0's 3 s save: rank 0 has no handler, so it is not killed by it, finishes its save and is stopped
    only then; rank 1 trains past the stop step and is stopped with a ``stop_ignored`` event; rank 2 stops
    at the stop step (or, on a loaded machine, at the first step at which it sees it). All of it long before
    the 60 s grace period ends."""
    rd, [agent], out = start(tmp_path, "signals", 3, ("--grace-period", "60"))
    wait_file(out / "saving-0", rd)
    time.sleep(0.5)
    t0 = time.monotonic()
    root = psutil.Process(agent.pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGUSR2)
    assert agent_code(agent, 60) == 5
    took = time.monotonic() - t0
    assert (out / "saved-0").exists(), "rank 0 was killed in the middle of its save"
    assert (tmp_path / "run" / "checkpoints" / "rank0.pt").stat().st_size == 30 * 4096
    stopped = int((out / "stopped-2").read_text())
    [ignored] = [e for e in rd.events() if e["event"] == "stop_ignored"]
    # Rank 2 stops at the first step at which it sees the stop step: the stop step itself when the stop file
    # reaches it in time (the coordinator adds about a second of steps to the highest step reported), later
    # when the machine is loaded (CI: stop step 54, rank 2 saw it at 62). Rank 1 trained past it regardless.
    assert ignored["rank"] == 1 and ignored["stop_step"] <= stopped, ignored
    assert ignored["step"] > ignored["stop_step"], ignored
    assert took < 20, f"the stop waited {took:.1f} s: for the grace period, not for the save"
    [ended] = [e for e in rd.events() if e["event"] == "attempt_ended"]
    assert ended["reason"] == "preempted"


def test_a_save_longer_than_the_stall_timeout_is_no_stall(tmp_path: Path) -> None:
    """--stall-timeout 2: rank 0 writes a checkpoint for 5 s while rank 1 waits for it, neither sends a
    heartbeat meanwhile. Before, both were failed as stalled (any rank's old heartbeat was enough)."""
    rd, [agent], out = start(tmp_path, "save", 2, ("--stall-timeout", "2"))
    assert agent_code(agent, 90) == 0, list(rd.events())
    assert not [e for e in rd.events() if e["event"] == "worker_failed"]
    assert (out / "done-0").exists() and (out / "done-1").exists()
