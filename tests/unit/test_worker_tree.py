"""Stopping the workers kills their whole tree, even a grandchild in a session of its own (issue 10, 8)."""

from __future__ import annotations

import dataclasses
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hpcelastic.agent.watchdog import Watchdog
from hpcelastic.agent.workers import TREE_VARIABLE, WorkerGroup
from tests.unit.test_workers_env import ROUND, config

# The worker starts `setsid sleep` that inherits its stdout (the agent's pipe), writes its pid, then
# either keeps running or exits at once (the grandchild is then an orphan in a session of its own).
WORKER = """
import os, subprocess, sys, time
p = subprocess.Popen(["setsid", "sleep", "300"])
with open(os.path.join(sys.argv[1], f"grandchild-{os.environ['RANK']}"), "w") as f:
    f.write(str(p.pid))
print("started", flush=True)
if sys.argv[2] == "exit":
    os._exit(1)
time.sleep(300)
"""


def _wait_pids(d: Path, n: int) -> list[int]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        files = sorted(d.glob("grandchild-*"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    pytest.fail("the workers did not start their grandchildren")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("worker_fate", ["running", "exit"])
def test_a_setsid_grandchild_is_killed_with_its_worker(tmp_path: Path, worker_fate: str) -> None:
    argv = (sys.executable, "-c", WORKER, str(tmp_path), worker_fate)
    cfg = dataclasses.replace(config(tmp_path), argv=argv)
    watchdog, devnull = Watchdog(), os.open(os.devnull, os.O_WRONLY)
    grandchildren: list[int] = []
    try:
        with selectors.DefaultSelector() as sel:
            group = WorkerGroup(cfg, sel, watchdog, out_fd=devnull)
            group.start(ROUND)
            grandchildren = _wait_pids(tmp_path, cfg.nproc)
            # Each leaves its worker's session (the setsid program may not have called setsid() yet).
            deadline = time.monotonic() + 10
            while not all(os.getsid(g) == g for g in grandchildren) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert all(os.getsid(g) == g for g in grandchildren)
            readers = [w.reader for w in group.workers]
            t0 = time.monotonic()
            group.stop(1.0)
            took = time.monotonic() - t0
        assert not [g for g in grandchildren if _alive(g)], "a setsid grandchild survived the stop"
        assert all(r is not None and not r.is_alive() for r in readers), "a worker's output pipe is held"
        assert took < 6.0
    finally:
        watchdog.close()
        os.close(devnull)
        for g in grandchildren:
            if _alive(g):
                os.kill(g, 9)


def test_the_watchdog_kills_a_setsid_grandchild_when_the_agent_dies(tmp_path: Path) -> None:
    """The agent is gone (its end of the watchdog's pipe closes): a worker's orphan in a session of its
    own, found by the workers' environment, is killed too."""
    marker = f"{TREE_VARIABLE}={tmp_path.name}"
    env = dict(os.environ, **{TREE_VARIABLE: tmp_path.name})
    orphan = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    watchdog = Watchdog()
    try:
        watchdog.mark(marker)
        watchdog.close()  # EOF, as when the agent is SIGKILLed
        assert orphan.wait(timeout=10) == -9
        assert bystander.poll() is None
    finally:
        for p in (orphan, bystander):
            p.kill()
            p.wait()
