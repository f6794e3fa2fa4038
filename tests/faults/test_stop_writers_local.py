"""A stop never cuts a save that spans nodes (issue 27, item 7), under ``hpcelastic run``: 2 nodes x 1 worker.

The script plays an unchanged sharded save (DCP's shape: every rank writes its shard, then the save's last
collective, then rank 0 writes ``.metadata``) with no handler for the stop signal. Node 1's rank writes its
shard at once and waits in the collective while node 0's rank writes its own for 1.5 s. The stop signal
comes in that wait. Node 1 writes nothing then, so before the job-wide rule its agent stopped its rank at
once: rank 0's collective failed and ``.metadata`` was never written (a torn checkpoint).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcelastic.rundir import RunDir
from tests.slurm_utils import leaked_processes

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, socket, sys, time
out, rank = sys.argv[1], int(os.environ["RANK"])
save = os.path.join(os.environ["HPCELASTIC_CHECKPOINT_DIR"], "step-5")

def mark(name, text=""):
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, name))

# The save's process group: rank 0 listens, rank 1 connects (a socket stands for gloo).
if rank == 0:
    server = socket.create_server(("127.0.0.1", 0))
    mark("port", str(server.getsockname()[1]))
    peer, _ = server.accept()
else:
    while not os.path.exists(os.path.join(out, "port")):
        time.sleep(0.02)
    peer = socket.create_connection(("127.0.0.1", int(open(os.path.join(out, "port")).read())))
os.makedirs(save, exist_ok=True)
mark(f"saving-{rank}")
with open(os.path.join(save, f"__{rank}_0.distcp"), "wb") as f:
    for _ in range(15 if rank == 0 else 1):  # rank 0's shard takes 1.5 s, rank 1's a moment
        f.write(b"x" * 4096)
        f.flush()
        time.sleep(0.1)
try:  # the save's last collective: rank 0 hears from rank 1, answers, and needs its acknowledgement
    if rank == 1:
        mark("waiting-1")
        peer.sendall(b"r")
        assert peer.recv(1) == b"g"
        peer.sendall(b"a")
    else:
        assert peer.recv(1) == b"r"
        peer.sendall(b"g")
        assert peer.recv(1) == b"a"
except (OSError, AssertionError):
    sys.exit(f"rank {rank}: the save's last collective failed (a peer is gone)")
if rank == 0:
    with open(os.path.join(save, ".metadata"), "w") as f:
        f.write("complete")
    mark("metadata", repr(time.time()))
with open(os.path.join(out, f"alive-{rank}"), "a") as f:  # trains on, ignoring the stop
    while True:
        f.write(f"{time.time()!r}\\n")
        f.flush()
        time.sleep(0.05)
"""


def test_a_rank_done_with_its_shard_is_not_stopped_before_another_nodes_save_ends(tmp_path: Path) -> None:
    script, out, run = tmp_path / "save.py", tmp_path / "out", tmp_path / "run"
    script.write_text(SCRIPT)
    out.mkdir()
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "1"]
    argv += ["--run-dir", str(run), "--grace-period", "30", str(script), str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    job = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ((out / "saving-0").exists() and (out / "waiting-1").exists()):
            assert time.monotonic() < deadline and job.poll() is None, "the save never started"
            time.sleep(0.02)
        signalled = time.monotonic()
        job.send_signal(signal.SIGUSR2)  # `hpcelastic run` forwards it to both agents
        _, stderr = job.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
            pytest.fail("the job did not stop")
    events = list(RunDir(run).events())
    assert (run / "checkpoints" / "step-5" / ".metadata").exists(), f"the save was torn: {stderr[-3000:]}"
    written = float((out / "metadata").read_text())
    for rank in (0, 1):
        alive = (out / f"alive-{rank}").read_text().split()
        assert float(alive[-1]) > written, f"rank {rank} was stopped before the save completed"
    [ended] = [e for e in events if e["event"] == "attempt_ended"]
    assert ended["reason"] == "preempted", events
    assert took < 15, f"the stop took {took:.1f} s: it waited for the grace period, not for the save"
    deadline = time.monotonic() + 10
    while (left := leaked_processes(run)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"orphans: {[(p.pid, p.cmdline()) for p in left]}"
