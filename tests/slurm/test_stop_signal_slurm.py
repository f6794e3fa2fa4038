"""Slurm's plain ``scancel --signal=USR2`` in the middle of an unchanged script's save (issue 18, item 5).

The script knows nothing of hpcelastic: no ``hpcelastic.worker``, no signal handler; it resumes from
its own checkpoint and saves one with ``torch.save`` that takes seconds. Slurm sends USR2 to every
process of the step, the worker included, one second into the save. Before, USR2's default action
killed the worker at once (the save never finished, the next attempt started over); now workers start
with the stop signal ignored, the agent does not send it to a worker without a handler and stops it
only once its save is complete. Slurm's view: requeued once for the preemption, then COMPLETED.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_utils import events, job_record, named, wait_job_finished, wait_no_leaks, wait_nodes_idle

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Steps 0..59; the first attempt saves step 20 (170 kB) through a writer of 40 kB/s: about 4 s.
SCRIPT = """
import os, sys, time
import torch
ckpt_dir, out = sys.argv[1], sys.argv[2]
path = os.path.join(ckpt_dir, "ckpt.pt")

class Slow:
    def __init__(self, f):
        self.f = f
    def write(self, data):
        time.sleep(len(data) / 40000)
        return self.f.write(data)
    def flush(self):
        self.f.flush()

start = torch.load(path)["step"] + 1 if os.path.exists(path) else 0
print(f"starting at step {start}", flush=True)
open(os.path.join(out, f"start-{start}"), "w").close()
state = {f"w{i}": torch.randn(1000) for i in range(40)}
for step in range(start, 60):
    time.sleep(0.05)
    if step == 20:
        open(os.path.join(out, "saving"), "w").close()
        with open(path + ".tmp", "wb") as f:
            torch.save(state | {"step": step}, Slow(f))
        os.replace(path + ".tmp", path)
        open(os.path.join(out, "saved"), "w").close()
"""


def test_plain_usr2_lets_an_unchanged_script_finish_its_save(tmp_path: Path, slurm_jobs: list[str]) -> None:
    out, ckpt, run = tmp_path / "out", tmp_path / "ckpt", tmp_path / "run"
    out.mkdir()
    script = tmp_path / "plain_train.py"
    script.write_text(SCRIPT)
    wait_nodes_idle(1)
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", "testbed"]
    argv += ["--run-dir", str(run), "--checkpoint-dir", str(ckpt), "--time", "10"]
    argv += ["--nodes", "1", "--gpus-per-node", "1", str(script), str(ckpt), str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    slurm_jobs.append(job)
    deadline = time.monotonic() + 60
    while not (out / "saving").exists():
        assert time.monotonic() < deadline, f"the save never started: {job_record(job)}"
        time.sleep(0.1)
    time.sleep(1.0)
    assert not (out / "saved").exists(), "the save was over before the signal"
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    rec = wait_job_finished(job, timeout=120)
    log = "\n".join(p.read_text() for p in run.glob("slurm-*.out"))
    evs = events(run)
    story = f"{[e['event'] for e in evs]}\n{log[-3000:]}"
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", (rec, story)
    assert (out / "saved").exists(), story
    assert sorted(p.name for p in out.glob("start-*")) == ["start-0", "start-21"], story
    assert [e["signal"] for e in named(evs, "signal_received")] == ["SIGUSR2"], story
    (signalled,) = named(evs, "signal_received")
    ended = named(evs, "attempt_ended")[0]
    assert ended["ts"] - signalled["ts"] < 12, "the agent waited for the grace period, not for the save"
    (requeued,) = named(evs, "requeued")
    assert requeued["reason"] == "preempted", requeued
    assert not named(evs, "worker_failed"), story
    assert not wait_no_leaks(str(run))
