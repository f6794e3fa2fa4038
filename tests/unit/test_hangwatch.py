"""The agent's sampler on real processes (py-spy): a node-wide stall is reported, progress is not."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from hpcelastic.agent import messages
from hpcelastic.agent.hangwatch import HangWatch
from hpcelastic.hangs import pyspy

pytestmark = pytest.mark.skipif(pyspy.pyspy_path() is None, reason="py-spy is not installed")

SLEEPER = "import time\ndef stuck():\n    time.sleep(600)\nstuck()\n"
BUSY = "def spin():\n    x = 0\n    while True:\n        x += 1\nspin()\n"
WORKING = "import time\nfor i in range(10**6):\n    print(i, flush=True)\n    time.sleep(0.2)\n"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def spawn(procs: list[subprocess.Popen[bytes]], code: str) -> int:
    procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL))
    return procs[-1].pid


def wait_report(watch: HangWatch, woke: threading.Event, timeout: float) -> messages.StallReport | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        woke.wait(0.2)
        woke.clear()
        report = watch.take_report()
        if report is not None:
            return report
    return None


def test_stall_of_every_rank_is_reported_then_stacks_are_taken(procs: list[subprocess.Popen[bytes]]) -> None:
    woke = threading.Event()
    watch = HangWatch(3.0, woke.set)
    watch.start()
    try:
        watch.watch(4, [(0, spawn(procs, SLEEPER)), (1, spawn(procs, BUSY))])
        t0 = time.monotonic()
        report = wait_report(watch, woke, 3.0 + 3 * watch.interval + 5)
        assert report is not None and report.stalled and report.round == 4 and report.ranks == (0, 1)
        assert time.monotonic() - t0 >= 3.0
        sent: list[messages.Message] = []
        watch.dump(4, [(0, 0, procs[0].pid), (1, 1, procs[1].pid)], sent.append)
        deadline = time.monotonic() + 15
        while not sent and time.monotonic() < deadline:
            time.sleep(0.1)
        (stacks,) = sent
        assert isinstance(stacks, messages.StacksReport) and set(stacks.stacks) == {"0", "1"}
        frames = [f["function"] for t in stacks.stacks["0"]["threads"] for f in t["frames"]]
        assert "stuck" in frames and stacks.stacks["1"]["local_rank"] == 1
    finally:
        watch.close()


def test_one_rank_progressing_keeps_the_node_from_stalling(procs: list[subprocess.Popen[bytes]]) -> None:
    woke = threading.Event()
    watch = HangWatch(2.0, woke.set)
    watch.start()
    try:
        watch.watch(0, [(0, spawn(procs, SLEEPER)), (1, spawn(procs, WORKING))])
        assert wait_report(watch, woke, 2.0 + 3 * watch.interval) is None
    finally:
        watch.close()
