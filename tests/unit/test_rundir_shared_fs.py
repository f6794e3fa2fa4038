"""The run directory on a shared filesystem: one event file per host, O_EXCL locks only (issue 10, 13)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcelastic import events, handoff
from hpcelastic.rundir import LOCK_STALE_S, RunDir

WRITER = """
import sys
from hpcelastic import events
from hpcelastic.rundir import RunDir
rd = RunDir(sys.argv[1])
for i in range(int(sys.argv[2])):
    rd.record(events.signal_received(signal="USR2", node_rank=i))
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare --uts (root)")
def test_writers_on_different_hosts_use_their_own_file_and_all_events_are_read(tmp_path: Path) -> None:
    """Three "hosts" (UTS namespaces with their own hostname) append at the same time."""
    rd = RunDir.create(tmp_path / "run")
    n = 200
    procs = [
        subprocess.Popen(
            ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"node{k}"]
            + [sys.executable, "-c", WRITER, str(rd.path), str(n)]
        )
        for k in range(3)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert sorted(p.name for p in rd.event_files()) == [f"events.node{k}.jsonl" for k in range(3)]
    log = rd.events()
    assert log.damaged == 0 and len(log) == 3 * n
    assert [e["ts"] for e in log] == sorted(e["ts"] for e in log)
    for k in range(3):
        mine = [e["node_rank"] for e in log if e["host"] == f"node{k}"]
        assert mine == list(range(n))  # each host's events in its order


def test_the_older_single_file_is_still_read(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    (rd.path / "events.jsonl").write_text(json.dumps({"ts": 1.0, "event": "submitted", "job_id": "5"}) + "\n")
    rd.record(events.cancelled(job_id="5"))
    assert [e["event"] for e in rd.events()] == ["submitted", "cancelled"]
    assert RunDir.open(rd.path).job_ids() == ["5"]


def test_the_handoff_lock_serialises_writers_without_flock(tmp_path: Path) -> None:
    """Many threads bump a counter under ``locked``: none is lost (the lock is an O_EXCL file)."""
    rd = RunDir.create(tmp_path / "run")
    counter = rd.path / "counter"
    counter.write_text("0")

    def bump() -> None:
        for _ in range(20):
            with rd.locked("handoff"):
                value = int(counter.read_text())
                counter.write_text(str(value + 1))

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert counter.read_text() == "160"
    assert not list(rd.path.glob(".handoff.excl*"))


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_lock_left_by_a_dead_holder_on_this_host_is_broken_at_once(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    (rd.path / ".handoff.excl").write_text(f"{socket.gethostname()} {_dead_pid()} abc\n")
    t0 = time.monotonic()
    assert handoff.begin_attempt(rd, "11", 0) == 0
    assert time.monotonic() - t0 < 5


def test_a_lock_of_another_host_is_waited_for_then_broken_when_stale(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    lock = rd.path / ".handoff.excl"
    lock.write_text("elsewhere 1 abc\n")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (handoff.begin_attempt(rd, "11", 0), done.set()))
    worker.start()
    assert not done.wait(1.0)  # a live lock of another host: wait
    old = time.time() - LOCK_STALE_S - 1
    os.utime(lock, (old, old))  # its holder never came back
    assert done.wait(10)
    worker.join()
    assert [e["attempt"] for e in rd.events().of(events.ATTEMPT_STARTED)] == [0]


def test_begin_attempt_needs_no_flock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mount without flock (ENOSYS) used to crash begin_attempt; the run directory never calls it."""
    import errno
    import fcntl

    def no_flock(*_args: object) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(fcntl, "lockf", no_flock)
    rd = RunDir.create(tmp_path / "run")
    assert handoff.begin_attempt(rd, "11", 0) == 0
    assert handoff.begin_attempt(rd, "11", 1) == 1


SLOW_STEP_S = 0.3


def _hold_lock(run: str, hold_s: float, slow: bool) -> None:
    """Take the handoff lock, note this holder in ``holders/`` and a violation when another is there."""
    if slow:  # a process descheduled before each of its file operations
        for name in ("open", "stat", "kill", "rename", "link", "unlink"):
            real = getattr(os, name)
            setattr(os, name, lambda *a, _real=real, **k: (time.sleep(SLOW_STEP_S), _real(*a, **k))[1])
    rd = RunDir(run)
    holders = rd.path / "holders"
    with rd.locked("handoff"):
        mine = holders / str(os.getpid())
        mine.touch()
        if len(list(holders.iterdir())) > 1:
            (rd.path / f"violation-{os.getpid()}").touch()
        time.sleep(hold_s)
        mine.unlink()


def test_breaking_a_stale_lock_never_leaves_two_holders(tmp_path: Path) -> None:
    """A slow process that judged a dead holder's lock stale acts only after a fast one broke it and
    holds the lock: it must not take that fresh lock away, so a third process never gets in beside it."""
    import multiprocessing

    rd = RunDir.create(tmp_path / "run")
    (rd.path / "holders").mkdir()
    (rd.path / ".handoff.excl").write_text(f"{socket.gethostname()} {_dead_pid()} abc\n")
    ctx = multiprocessing.get_context("fork")
    slow = ctx.Process(target=_hold_lock, args=(str(rd.path), 0.0, True))
    slow.start()
    time.sleep(1.5 * SLOW_STEP_S)  # the slow one has read the dead holder's lock
    fast = [
        ctx.Process(target=_hold_lock, args=(str(rd.path), hold, False)) for hold in (6 * SLOW_STEP_S, 0.0)
    ]
    for p in fast:
        p.start()
        time.sleep(0.05)
    for p in (slow, *fast):
        p.join(timeout=30)
        assert p.exitcode == 0
    assert not list(rd.path.glob("violation-*"))
    assert not list(rd.path.glob(".handoff.excl*"))
