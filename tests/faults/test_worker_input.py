"""What a worker can do to its agent: any heartbeat datagram, death by any signal. Real local jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hpcelastic.rundir import RunDir
from tests.faults.localjob import EXAMPLE, REPO

GARBAGE_SENDER = r"""
import json, os, socket, sys
path = os.environ["HPCELASTIC_HEARTBEAT_SOCKET"]
rank = int(os.environ["RANK"])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
for data in [
    b"[1]", b"1", b"null", b'"rank"', b"{}", b'{"rank": Infinity}', b'{"rank": NaN}', b'{"rank": -Infinity}',
    b'{"rank": 1e400}', b'{"rank": 0, "step": Infinity}', b'{"rank": 0, "step": [1]}', b'{"rank": "0"}',
    b'{"rank": true}', b'{"rank": 0, "step": {"a": 1}}', b'{"rank": ' + b"9" * 5000 + b"}",
    b"[" * 100000 + b"]" * 100000, b'{"rank": ' * 3000 + b"0" + b"}" * 3000, b"\xff\xfe\x00", b"",
    json.dumps({"rank": rank, "step": 10**30}).encode(),
]:
    try:
        s.sendto(data, path)
    except OSError:  # a datagram too large for the socket
        pass
s.sendto(json.dumps({"rank": rank, "step": 1}).encode(), path)
print("sent", flush=True)
"""


def test_any_heartbeat_datagram_is_survivable(tmp_path: Path) -> None:
    script = tmp_path / "garbage.py"
    script.write_text(GARBAGE_SENDER)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "run", "--nodes", "1", "--nproc-per-node", "2"]
        + ["--run-dir", str(run_dir), "--rdzv-timeout", "20", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    names = [e["event"] for e in RunDir(run_dir).events()]
    assert "job_succeeded" in names or names[-1] == "attempt_ended", names
    assert "restarting" not in names, names


def test_worker_killed_by_a_realtime_signal_is_restarted(local_job) -> None:
    job = local_job(
        nodes="1", train_args=("--crash-at-step", "4", "--crash-rank", "1", "--crash-mode", "rtsig")
    )
    assert job.wait() == [0]
    [cause] = job.events("root_cause")
    assert (cause["rank"], cause["signal"]) == (1, "SIGRTMIN+3")
    assert len(job.events("workers_started")) == 2


NO_PIDFD = """
import errno, os

def pidfd_open(pid, flags=0):
    with open(os.environ["NO_PIDFD_MARKER"], "a") as f:
        f.write(f"{pid}\\n")
    raise OSError(errno.ENOSYS, "pidfd_open is not implemented (kernel before 5.3, or a seccomp filter)")

os.pidfd_open = pidfd_open
"""


def test_agent_without_pidfd_open_sees_exits_and_restarts(tmp_path: Path) -> None:
    """``pidfd_open`` fails with ENOSYS in every process (a ``sitecustomize``): the exit pipe takes over."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_PIDFD)
    marker = tmp_path / "pidfd_calls"
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(site), "NO_PIDFD_MARKER": str(marker)}
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "run", "--nodes", "1", "--nproc-per-node", "2"]
        + ["--run-dir", str(run_dir), "--rdzv-timeout", "20", str(EXAMPLE), "--steps", "6"]
        + ["--crash-at-step", "2", "--crash-rank", "0", "--crash-mode", "exit"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    # Two workers, two rounds: every exit seen through a pipe (the fork server, where warm starts are on,
    # tries pidfd_open too, fails, and the workers start cold).
    assert len(marker.read_text().split()) >= 4
    events = RunDir(run_dir).events()
    assert [e["exitcode"] for e in events if e["event"] == "root_cause"] == [13]
    assert len([e for e in events if e["event"] == "workers_started"]) == 2
