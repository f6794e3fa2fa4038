"""What a worker's output looks like on the console (agent/console.py) and the root cause's line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpcelastic.agent.console import RANK_LOG_ONLY, WorkerConsole, write_line
from tests.unit.test_job_state import failure, join_all, make

TRACEBACK = [
    b"[rank2]: Traceback (most recent call last):\n",
    b'[rank2]:   File "train.py", line 3, in <module>\n',
    b"[rank2]:     dist.all_reduce(x)\n",
    b"[rank2]: RuntimeError: Connection closed by peer\n",
]


@pytest.fixture
def out(tmp_path: Path):
    path = tmp_path / "console"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    yield fd, path
    os.close(fd)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_one_prefix_a_group_and_no_chatter(out) -> None:
    fd, path = out
    c = WorkerConsole("all", 2, fd=fd)
    g = WorkerConsole("all", 0, replica_group=1, fd=fd)
    c.line(b"[rank2]: loss 0.5\n")
    g.line(b"step 3\n")
    for chatter in (
        b'127.0.0.1 - - [25/Nov/2026 20:00:01] "GET /checkpoint/15/full HTTP/1.1" 200 -\n',
        b"2026-11-25T20:00:01.1Z [INFO] [torchft::manager] quorum 3\n",
        b"INFO:torchft.manager:[replica_0/0 - step 4] reconfiguring\n",
        b"[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n",
        b"[W1125 21:07:58.636953303 reducer.cpp:1529] Warning: find_unused_parameters=True\n",
    ):
        assert RANK_LOG_ONLY.search(chatter)
        c.line(chatter)
    assert lines(path) == ["[rank2] loss 0.5", "[g1 r0] step 3"]


def test_a_failed_workers_traceback_is_left_to_the_root_cause(out) -> None:
    fd, path = out
    c = WorkerConsole("all", 2, fd=fd)
    for raw in TRACEBACK:
        c.line(raw)
    assert lines(path) == []  # held until the worker's fate is known
    c.finish(failed=True)
    assert lines(path) == []


def test_a_traceback_the_worker_survives_is_shown_whole(out) -> None:
    fd, path = out
    c = WorkerConsole("all", 2, fd=fd)
    for raw in TRACEBACK:
        c.line(raw)
    c.line(b"retrying\n")  # it goes on: the traceback was logged, not fatal
    assert lines(path) == [
        "[rank2] Traceback (most recent call last):",
        '[rank2]   File "train.py", line 3, in <module>',
        "[rank2]     dist.all_reduce(x)",
        "[rank2] RuntimeError: Connection closed by peer",
        "[rank2] retrying",
    ]
    ended = WorkerConsole("all", 0, fd=fd)
    for raw in TRACEBACK:
        ended.line(raw)
    ended.finish(failed=False)
    assert lines(path)[-1] == "[rank0] RuntimeError: Connection closed by peer"


def test_rank0_and_failures_modes(out) -> None:
    fd, path = out
    for mode, rank in (("rank0", 0), ("rank0", 1), ("failures", 0)):
        WorkerConsole(mode, rank, fd=fd).line(f"{mode} {rank}\n".encode())
    assert lines(path) == ["[rank0] rank0 0"]


def test_lines_are_whole(out) -> None:
    fd, path = out
    write_line("no newline", fd)
    write_line(b"two\nlines\n", fd)
    assert lines(path) == ["no newline", "two", "lines"]


def test_the_root_cause_traceback_is_printed_once_and_repeats_are_counted() -> None:
    st = make(2)
    join_all(st)
    tb = 'Traceback (most recent call last):\n  File "t.py", line 1\nValueError: bad'
    cause = {**failure(1, 10.0, "exited with code 1: ValueError: bad"), "traceback": tb, "node": "n1"}
    peers = [{**failure(n, 10.1, "exited with code 1: ValueError: bad"), "traceback": tb} for n in (0, 0)]
    st.failures = [cause, *peers]
    first = st.cause_text("root cause (round 0)", cause, tb)
    assert first.endswith("\n" + tb) and "(2 other rank(s) failed with the same traceback)" in first
    again = st.cause_text("root cause (round 1)", cause, tb)
    assert "Traceback" not in again and "the same traceback as before (2 times now" in again
