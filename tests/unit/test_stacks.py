"""Hang detection against real processes: py-spy dumps, signatures, localization, progress, stack files.

Nothing of py-spy is mocked: every stack comes from a live child process hanging in a known line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hpcelastic.hangs import pyspy
from hpcelastic.hangs.localize import localize
from hpcelastic.hangs.progress import ProgressTracker, Sample, sample
from hpcelastic.hangs.stacks import Frame, ProcessStack, ThreadStack, progress_key, signature, where
from hpcelastic.hangs.store import write_stacks

pytestmark = pytest.mark.skipif(pyspy.pyspy_path() is None, reason="py-spy is not installed")

Spawn = Callable[..., subprocess.Popen[str]]


def line_of(path: Path, marker: str) -> int:
    """1-based line of the only line of ``path`` containing ``marker``."""
    hits = [i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start ``python SCRIPT ARGS`` from source text; waits for its ``ready`` line; kills it afterwards."""
    procs: list[subprocess.Popen[str]] = []

    def start(source: str, *args: str, name: str = "child.py", env: dict[str, str] | None = None):
        script = tmp_path / name
        if not script.exists():
            script.write_text(textwrap.dedent(source))
        proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        if p.stdout:
            p.stdout.close()


def wait_ready(proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """Block until the child printed ``ready`` (then give it a moment to enter the hanging call)."""
    assert proc.stdout is not None
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.strip() == "ready":
            time.sleep(0.3)
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"child exited with {proc.returncode} before ready")
    raise AssertionError("child not ready in time")


SLEEPER = """
import time
def nap():
    print("ready", flush=True)
    time.sleep(600)  # HANG
nap()
"""

BUSY = """
def spin():
    print("ready", flush=True)
    x = 0
    while True:  # LOOP
        x += 1
        x %= 7
spin()
"""

DEADLOCK = """
import threading
lock = threading.Lock()
def grab():
    lock.acquire()  # HANG
lock.acquire()
t = threading.Thread(target=grab, name="grabber")
t.start()
print("ready", flush=True)
t.join()  # JOIN
"""

PIPE_READ = """
import os
r, w = os.pipe()
print("ready", flush=True)
os.read(r, 1)  # HANG
"""


def test_sleep_in_native_call(spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn(SLEEPER)
    wait_ready(proc)
    stack = pyspy.dump(proc.pid, native=True)
    assert stack.error is None and stack.native
    assert stack.main is not None and stack.main.os_thread_id == proc.pid
    assert stack.main.frames[0].native, "native frames come first (clock_nanosleep in libc)"
    assert signature(stack) == "child.py:nap < child.py:<module>"
    script = tmp_path / "child.py"
    assert where(stack) == f"{script}:{line_of(script, '# HANG')} in nap"


def test_busy_loop_holding_the_gil(spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn(BUSY)
    wait_ready(proc)
    keys, lines = set(), set()
    for _ in range(5):
        stack = pyspy.dump(proc.pid)
        assert stack.error is None and stack.main is not None
        keys.add(progress_key(stack))
        lines.add(stack.main.python_frames[0].line)
        time.sleep(0.05)
    loop = line_of(tmp_path / "child.py", "# LOOP")
    assert lines <= {loop, loop + 1, loop + 2}
    assert keys == {"child.py:spin < child.py:<module>:8"}, "a busy loop in one function is no progress"


def test_thread_deadlocked_on_a_lock(spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn(DEADLOCK)
    wait_ready(proc)
    stack = pyspy.dump(proc.pid, native=True)
    grabber = next(t for t in stack.threads if t.name == "grabber")
    assert any(f.function == "PyThread_acquire_lock_timed" for f in grabber.frames if f.native)
    inner = grabber.python_frames[0]
    assert (inner.function, inner.line) == ("grab", line_of(tmp_path / "child.py", "# HANG"))
    # The main thread waits in threading.join; ``where`` names the user's line, not threading.py.
    script = tmp_path / "child.py"
    assert where(stack) == f"{script}:{line_of(script, '# JOIN')} in <module>"


def test_blocked_read_on_a_pipe(spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn(PIPE_READ)
    wait_ready(proc)
    stack = pyspy.dump(proc.pid, native=True)
    assert stack.error is None
    script = tmp_path / "child.py"
    assert where(stack) == f"{script}:{line_of(script, '# HANG')} in <module>"


FAKE_RANKS = """
import os, sys, time
rank = int(sys.argv[1])
r, w = os.pipe()

def all_reduce():
    os.read(r, 1)  # COLLECTIVE

def train_step():
    if rank == 3:
        time.sleep(600)  # CULPRIT
    all_reduce()

print("ready", flush=True)
train_step()
"""


def test_four_ranks_the_odd_one_is_named(spawn: Spawn, tmp_path: Path) -> None:
    procs = {rank: spawn(FAKE_RANKS, str(rank), name="ranks.py") for rank in range(4)}
    for p in procs.values():
        wait_ready(p)
    stacks = pyspy.dump_many([p.pid for p in procs.values()], native=True)
    loc = localize({rank: stacks[p.pid] for rank, p in procs.items()})
    script = tmp_path / "ranks.py"
    assert loc.method == "majority"
    assert loc.root_ranks == (3,)
    assert loc.majority_signature == "ranks.py:all_reduce < ranks.py:train_step < ranks.py:<module>"
    assert loc.where[3] == f"{script}:{line_of(script, '# CULPRIT')} in train_step"
    assert loc.groups[loc.majority_signature] == (0, 1, 2)

    (tmp_path / "run").mkdir(mode=0o700)
    path = write_stacks(tmp_path / "run", 0, 1, {r: stacks[p.pid] for r, p in procs.items()}, loc)
    assert path == tmp_path / "run" / "stacks" / "attempt-0" / "round-1.json"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    doc = json.loads(path.read_text())
    assert doc["localization"]["root_ranks"] == [3]
    assert set(doc["ranks"]) == {"0", "1", "2", "3"}
    assert doc["ranks"]["3"]["threads"][0]["frames"], "all frames of all threads are kept"


def test_stopped_process_is_itself_the_answer(spawn: Spawn, tmp_path: Path) -> None:
    procs = {rank: spawn(FAKE_RANKS, str(rank), name="ranks.py") for rank in range(3)}
    for p in procs.values():
        wait_ready(p)
    os.kill(procs[1].pid, signal.SIGSTOP)
    deadline = time.time() + 5
    while pyspy.proc_state(procs[1].pid) != "T" and time.time() < deadline:
        time.sleep(0.02)
    stacks = pyspy.dump_many([p.pid for p in procs.values()], native=True)
    stopped = stacks[procs[1].pid]
    # py-spy cannot pause a stopped process; the non-blocking dump still reads its Python frames.
    assert stopped.stopped and stopped.error is None and not stopped.native
    assert signature(stopped) == "ranks.py:all_reduce < ranks.py:train_step < ranks.py:<module>"
    assert pyspy.proc_state(procs[1].pid) == "T", "dumping must not resume it"
    loc = localize({rank: stacks[p.pid] for rank, p in procs.items()})
    assert (loc.method, loc.root_ranks) == ("stopped", (1,))
    assert "stopped" in loc.detail
    os.kill(procs[1].pid, signal.SIGCONT)


GLOO = """
import os, sys, time
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=4)
t = torch.ones(4)
dist.all_reduce(t)
print("ready", flush=True)
if rank == 2:
    time.sleep(600)  # CULPRIT
dist.all_reduce(t)  # COLLECTIVE
"""


def test_gloo_all_reduce_names_the_sleeping_rank(spawn: Spawn, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}
    procs = {r: spawn(GLOO, name="gloo.py", env={**env, "RANK": str(r)}) for r in range(4)}
    for p in procs.values():
        wait_ready(p, timeout=120)
    time.sleep(0.5)
    stacks = pyspy.dump_many([p.pid for p in procs.values()], native=True)
    loc = localize({rank: stacks[p.pid] for rank, p in procs.items()})
    script = tmp_path / "gloo.py"
    assert (loc.method, loc.root_ranks) == ("collective", (2,)), loc
    assert loc.where[2] == f"{script}:{line_of(script, '# CULPRIT')} in <module>"
    # The waiting ranks agree on one signature, inside torch.distributed.
    assert loc.majority_signature is not None and "distributed_c10d.py:all_reduce" in loc.majority_signature

    # Sampled progress: nobody moves (the blocked ranks neither compute nor move bytes).
    tracker = ProgressTracker(stall_timeout=1.0)
    start = time.time()
    for i in range(3):
        for rank, p in procs.items():
            tracker.observe(rank, sample(p.pid), start + i)
    assert tracker.job_stalled(start + 2)


WORKER = """
import sys, time
def load():
    return sum(range(20000))
def forward(x):
    return [v * 2 for v in range(x % 5000)]
def step(i):
    load(); forward(i)
    if i % 50 == 0:
        print("step", i, flush=True)
print("ready", flush=True)
i = 0
while True:
    step(i); i += 1
    time.sleep(0.001)
"""


def test_sampled_progress_on_real_processes(spawn: Spawn) -> None:
    working, sleeping = spawn(WORKER, name="w.py"), spawn(SLEEPER, name="s.py")
    busy = spawn(BUSY, name="b.py")
    for p in (working, sleeping, busy):
        wait_ready(p)
    tracker = ProgressTracker(stall_timeout=1.5)
    t0 = time.time()
    for i in range(5):
        for rank, p in enumerate((working, sleeping, busy)):
            tracker.observe(rank, sample(p.pid), t0 + i)
        time.sleep(0.2)
        if working.stdout:  # keep its pipe drained
            os.set_blocking(working.stdout.fileno(), False)
            working.stdout.read()
    assert tracker.stalled(t0 + 4) == {1, 2}
    assert not tracker.job_stalled(t0 + 4), "one rank still works: not a hang"


# Pure functions below: stacks built by hand.


def _stack(
    pid: int, *frames: tuple[str, str, int], state: str = "S", error: str | None = None
) -> ProcessStack:
    fs = tuple(Frame(function=fn, filename=f, line=ln) for f, fn, ln in frames)
    threads = (ThreadStack(thread_id=1, name="MainThread", os_thread_id=pid, frames=fs),) if fs else ()
    return ProcessStack(pid=pid, threads=threads, state=state, error=error)


AR = ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", "all_reduce", 2000)
BAR = ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", "barrier", 4000)


def test_localize_two_ranks() -> None:
    waiting = _stack(1, AR, ("/job/train.py", "step", 10))
    asleep = _stack(2, ("/job/train.py", "step", 8))
    assert localize({0: waiting, 1: asleep}).root_ranks == (1,)
    other = _stack(3, ("/job/train.py", "save", 30))
    loc = localize({0: asleep, 1: other})
    assert (loc.method, loc.root_ranks) == ("undetermined", ())
    assert "undetermined" in loc.summary()


def test_localize_mismatched_collectives_by_majority() -> None:
    stacks = {r: _stack(r, AR, ("/job/train.py", "step", 10)) for r in range(7)}
    stacks[5] = _stack(5, BAR, ("/job/train.py", "evaluate", 40))
    loc = localize(stacks)
    assert (loc.method, loc.root_ranks) == ("majority", (5,))
    assert loc.where[5] == "/job/train.py:40 in evaluate"


def test_localize_all_same_and_all_different() -> None:
    same = {r: _stack(r, ("/job/train.py", "wait_file", 3)) for r in range(4)}
    loc = localize(same)
    assert (loc.method, loc.root_ranks) == ("all_same", (0, 1, 2, 3))
    in_collective = {r: _stack(r, AR, ("/job/train.py", "step", 10)) for r in range(4)}
    assert localize(in_collective).method == "undetermined"
    different = {r: _stack(r, ("/job/train.py", f"f{r}", r)) for r in range(4)}
    assert localize(different).root_ranks == ()


def test_localize_unreadable_rank_outside_the_collective() -> None:
    stacks = {r: _stack(r, AR, ("/job/train.py", "step", 10)) for r in range(2)}
    stacks[2] = _stack(2, error="Permission denied")
    loc = localize(stacks)
    assert loc.root_ranks == (2,) and loc.where[2] == "Permission denied"


def test_progress_tracker_rules() -> None:
    t = ProgressTracker(stall_timeout=10.0, grace_s=5.0)
    a, b = Sample(key="a"), Sample(key="b")
    t.observe(0, a, 0.0)
    t.observe(1, a, 0.0)
    assert t.observe(0, a, 14.0) == set(), "inside the grace"
    assert t.observe(0, a, 15.0) == {0, 1}
    t.observe(1, b, 15.0)  # stack changed at 15
    assert t.stalled(24.0) == {0} and not t.job_stalled(24.0)
    assert t.observe(1, Sample(key="b", io_bytes=10), 20.0) == {0}, "bytes moved: progress"
    assert t.job_stalled(30.0)
    # Descendants' CPU (DataLoader workers) is progress; a stopped process never progresses.
    t.observe(2, Sample(key="x", children_cpu_s=1.0), 0.0)
    t.observe(2, Sample(key="x", children_cpu_s=2.0), 16.0)
    assert 2 not in t.stalled(20.0)
    t.observe(3, Sample(key="x"), 0.0)
    t.observe(3, Sample(key="y", stopped=True), 16.0)
    assert 3 in t.stalled(16.0)
    # Heartbeats take over: a changing stack no longer counts once the script reports steps.
    t.heartbeat(4, 1, 0.0)
    t.observe(4, a, 1.0)
    t.observe(4, b, 12.0)
    assert 4 in t.stalled(15.0)
    t.heartbeat(4, 2, 16.0)
    assert 4 not in t.stalled(16.0)
    # Ranks never sampled with a stack (py-spy failed) are not declared stalled on counters alone.
    t.observe(5, Sample(key=None), 0.0)
    assert 5 not in t.stalled(100.0)


def test_main_thread_io_leaves_out_a_background_thread_that_talks() -> None:
    """torchft's threads talk to the lighthouse all the time: with ``main_thread_io`` that is no progress."""
    code = textwrap.dedent(
        """
        import os, threading, time
        def chatter():
            r, w = os.pipe()
            while True:
                os.write(w, b"x" * 100)
                os.read(r, 100)
                time.sleep(0.01)
        threading.Thread(target=chatter, daemon=True).start()
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        before = (pyspy.io_bytes(p.pid), pyspy.io_bytes(p.pid, p.pid))
        time.sleep(0.5)
        after = (pyspy.io_bytes(p.pid), pyspy.io_bytes(p.pid, p.pid))
        assert after[0] > before[0] and after[1] == before[1], (before, after)
        assert pyspy.counters(p.pid, main_thread_io=True).own_io_bytes == pyspy.io_bytes(p.pid, p.pid)
    finally:
        p.kill()
        p.wait()
