"""The ``input`` kind for real (issue 28): ``hpcelastic run --nodes 2 --nproc-per-node 2`` with the unchanged
DDP script of the slow-node tests loading its batches through a DataLoader; from step 200 on, rank 2's
batches (node 1) each take 0.4 s longer to load. Its node is named, with kind ``input``: the agents sample
their workers' stacks only once their pace dropped (``slow/input_watch.py``), and rank 2's sit in
``__getitem__`` while the others wait for it in their collectives."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slow_job import SLOW_AFTER_STEP, train_args
from tests.slurm_utils import events, named

#: Run in turn with the other local slow-node tests (test_slow_swap_local.py says why).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slow-local")]


def test_a_rank_waiting_on_its_data_names_its_node_input(tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "2"]
    argv += ["--run-dir", str(run), "--slow-action", "report"]
    train = train_args(tmp_path, run / "checkpoints", 2000)
    train += ["--slow-input-rank", "2", "--slow-input-after", str(SLOW_AFTER_STEP), "--slow-input-s", "0.4"]
    proc = subprocess.Popen([*argv, *train], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 400
        while not (run.exists() and named(events(run), "node_slow")):
            assert proc.poll() is None, "the job ended before any node was named"
            assert time.monotonic() < deadline, [e["event"] for e in events(run)]
            time.sleep(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    evs = events(run)
    slow = named(evs, "node_slow")
    node1 = named(evs, "rendezvous")[0]["hosts"][1]
    assert slow[0]["node"] == node1 and slow[0]["kind"] == "input", slow
    assert slow[0]["rank"] == 2, slow
