"""The agent's stacks for the ``input`` kind (``slow/input_watch.py``): a node's pace over windows, and
real py-spy dumps of two processes, one loading data and one computing, taken only while the pace has
dropped."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from hpcelastic.slow.input_watch import KEEP, SAMPLE_EVERY_S, WINDOW_S, InputWatch, LocalPace

LOADING = textwrap.dedent(
    """
    import time
    class Data:
        def __getitem__(self, i):
            time.sleep(0.05)
            return i
    data = Data()
    i = 0
    while True:
        i = data[i] + 1
    """
)
COMPUTING = "while True:\n    sum(i * i for i in range(10000))\n"


def paced(rates: list[float]) -> LocalPace:
    pace, t, steps = LocalPace(), 0.0, 0
    pace.observe(t, steps)
    for r in rates:
        t, steps = t + WINDOW_S, steps + int(r * WINDOW_S)
        pace.observe(t, steps)
    return pace


def test_a_drop_counts_after_the_warm_up_and_ends_when_the_pace_is_back() -> None:
    assert not paced([2.0, 10.0, 10.0]).dropped()  # a slow first window is the warm-up
    assert paced([2.0, 10.0, 10.0, 8.0]).dropped()  # 20 % below the best
    assert not paced([2.0, 10.0, 10.0, 9.5]).dropped()  # within DROP of it
    assert not paced([2.0, 10.0, 10.0, 5.0, 10.0]).dropped()
    assert not paced([10.0, 5.0]).dropped()  # too soon to tell


def test_a_new_round_restarts_the_pace() -> None:
    pace = paced([10.0, 10.0, 10.0])
    pace.observe(100.0, 3)  # the step count went back: a new round's workers
    assert pace.start == (100.0, 3)


@pytest.fixture
def workers() -> Iterator[dict[int, int]]:
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in (LOADING, COMPUTING)]
    yield {rank: p.pid for rank, p in enumerate(procs)}
    for p in procs:
        p.kill()
        p.wait()


def test_stacks_are_taken_only_while_the_pace_has_dropped_and_tell_loading_from_compute(
    workers: dict[int, int],
) -> None:
    watch = InputWatch()
    assert watch.available, "py-spy is installed with the package's extras"
    watch.start()
    try:
        watch.watch(workers)
        t = 0.0
        for steps in (0, 100, 200, 300):  # a steady pace: no stacks
            watch.observe(t, steps)
            t += WINDOW_S
        time.sleep(2.5 * SAMPLE_EVERY_S)
        assert watch.shares() == {}
        watch.observe(t, 310)  # the pace dropped
        deadline = time.monotonic() + 20 * SAMPLE_EVERY_S
        while len(watch._stacks[1]) < 4:
            assert time.monotonic() < deadline, "no stacks sampled while the pace has dropped"
            time.sleep(0.5)
        shares = watch.shares()
        assert shares[0] >= 0.5 and shares[1] == 0.0, shares
        assert all(len(s) <= KEEP for s in watch._stacks.values())
        watch.observe(t + WINDOW_S, 410)  # back at its pace: sampling stops, the drop's stacks go
        assert watch.shares() == {}
    finally:
        watch.close()
