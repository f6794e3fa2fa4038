"""The job-wide stop step: its rule, the coordinator's exchange and the worker's side of it."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import pytest

from hpcelastic.agent import messages
from hpcelastic.agent.job_state import Phase
from hpcelastic.agent.loop import ignores_stop
from hpcelastic.agent.stop_step import END_MARGIN_S, StepRate, stop_grace, stop_step
from hpcelastic.env.slurm import time_left
from tests.unit.test_job_state import Clock, join_all, make, sends


def test_stop_step_is_the_highest_step_plus_one_plus_a_second_of_the_fastest_rate() -> None:
    assert stop_step([(10, 2.0), (12, 4.5), (None, 0.0)]) == 12 + 1 + 5
    assert stop_step([(3, 0.0)]) == 4
    assert stop_step([(None, 0.0)]) is None and stop_step([]) is None


def test_step_rate_counts_steps_per_second_within_a_round() -> None:
    r = StepRate()
    r.beat(0, 5, 100.0)
    r.beat(0, 9, 102.0)
    assert r.step == 9 and r.rate == 2.0
    r.beat(1, 1, 200.0)
    assert r.step == 1 and r.rate == 0.0


def test_coordinator_fixes_one_stop_step_from_every_round_node() -> None:
    clock = Clock()
    st = make(3, clock=clock)
    join_all(st)
    out = st.preempt(1, "USR2")
    assert st.phase is Phase.PREEMPTING and len(sends(out, "preempt")) == 3
    assert st.step_report(0, 0, 40, 10.0) == [] and st.step_report(1, 0, 41, 8.0) == []
    stop = sends(st.step_report(2, 0, 39, 9.0), "stop_at")
    assert sorted(stop) == [0, 1, 2] and {m.step for m in stop.values()} == {41 + 1 + 10}
    assert st.step_report(2, 0, 45, 9.0) == []  # fixed once


def test_a_missing_report_does_not_hold_the_stop_step_back() -> None:
    clock = Clock()
    st = make(2, clock=clock)
    join_all(st)
    st.preempt(0, "USR2")
    st.step_report(0, 0, 7, 0.0)
    assert sends(st.tick(), "stop_at") == {}
    clock.t += 2.5
    stop = sends(st.tick(), "stop_at")
    assert {m.step for m in stop.values()} == {8}


def test_messages_round_trip() -> None:
    for msg in (messages.StepReport(2, None, 0.0), messages.StepReport(2, 17, 3.5), messages.StopAt(2, 30)):
        table = messages.FROM_AGENT if isinstance(msg, messages.StepReport) else messages.FROM_COORDINATOR
        assert messages.decode(table, messages.encode(msg)) == msg


@pytest.fixture
def fresh_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    stop = tmp_path / "stop"
    monkeypatch.setenv("HPCELASTIC_STOP_FILE", str(stop))
    monkeypatch.setenv("HPCELASTIC_HEARTBEAT_SOCKET", str(tmp_path / "no-agent.sock"))
    from hpcelastic import worker

    return importlib.reload(worker), stop


def test_worker_with_heartbeats_stops_exactly_at_the_stop_step(fresh_worker) -> None:  # type: ignore[no-untyped-def]
    worker, stop = fresh_worker
    worker.heartbeat(5)
    assert not worker.should_stop()
    worker._on_stop_signal(12, None)  # the signal arrived; the stop step has not
    assert not worker.should_stop()
    stop.write_text("7\n")
    assert not worker.should_stop()
    worker.heartbeat(6)
    assert not worker.should_stop()
    worker.heartbeat(7)
    assert worker.should_stop()


def test_worker_stops_at_once_without_heartbeats_or_without_a_step(fresh_worker) -> None:  # type: ignore[no-untyped-def]
    worker, stop = fresh_worker
    stop.write_text("")
    assert worker.should_stop()  # never called heartbeat
    worker.heartbeat(3)
    assert worker.should_stop()  # the file names no step


def test_a_signalled_rank_waits_for_the_coordinators_stop_step_not_its_own_clock(
    fresh_worker, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    worker, stop = fresh_worker
    worker.heartbeat(1)
    worker._on_stop_signal(12, None)
    assert not worker.should_stop()
    later = time.monotonic() + 3600.0
    monkeypatch.setattr(time, "monotonic", lambda: later)  # an hour without the stop file
    assert not worker.should_stop()
    stop.write_text("2\n")
    assert not worker.should_stop()
    worker.heartbeat(2)
    assert worker.should_stop()


def test_the_rate_is_over_recent_steps_not_the_rounds_checkpoint_pauses() -> None:
    """10 steps/s with a 120 s save every 1,000 steps: the round's average is 4.55/s, the rate 10/s."""
    r = StepRate()
    ts = 0.0
    for step in range(1, 3001):
        ts += 0.1 + (120.0 if step % 1000 == 1 and step > 1 else 0.0)
        r.beat(0, step, ts)
        if step > 2:
            assert 9.5 <= r.rate <= 10.5, (step, r.rate)
    assert stop_step([(r.step, r.rate)]) == 3000 + 1 + 10


def test_the_stop_signal_handler_takes_no_lock(fresh_worker) -> None:  # type: ignore[no-untyped-def]
    """Whatever the main thread holds when the signal comes, the handler cannot wait for it: it calls
    nothing (threading.Event.set() took the event's lock, held by the main thread inside set())."""
    worker, _stop = fresh_worker
    try:
        worker.should_stop()  # installs the handler
        handler = signal.getsignal(signal.SIGUSR2)
        assert callable(handler)
        calls: list[str] = []

        def profile(frame: FrameType, event: str, arg: object) -> None:
            if (
                event in ("call", "c_call")
                and frame.f_code.co_name != "test_the_stop_signal_handler_takes_no_lock"
            ):
                where = f"{frame.f_code.co_filename}:{frame.f_code.co_name}"
                calls.append(f"{event} {getattr(arg, '__qualname__', '')} {where}")

        sys.setprofile(profile)
        handler(signal.SIGUSR2, None)
        sys.setprofile(None)
        assert [c for c in calls if "threading" in c or "acquire" in c or "__enter__" in c] == [], calls
        assert worker.should_stop()
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


STORM = """
import os, signal, sys, threading
from hpcelastic import worker
done = False
def storm():
    while not done:
        os.kill(os.getpid(), signal.SIGUSR2)
threading.Thread(target=storm, daemon=True).start()
for _ in range(int(sys.argv[1])):
    worker._stop_signalled = worker._stop_file_seen = False
    assert worker.should_stop()
done = True
print("finished", flush=True)
"""


def test_a_stop_signal_inside_the_stop_path_cannot_freeze_the_rank(tmp_path: Path) -> None:
    """Signals fired without pause while the main thread goes through should_stop's path that records the
    stop file, again and again: the handler takes no lock, so the loop always finishes."""
    stop = tmp_path / "stop"
    stop.write_text("")
    env = dict(os.environ, HPCELASTIC_STOP_FILE=str(stop), HPCELASTIC_STOP_SIGNAL="USR2")
    proc = subprocess.run(
        [sys.executable, "-c", STORM, "30000"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr[-2000:]


def test_a_rank_ignores_the_stop_once_it_reports_a_step_it_began_after_the_stop_step_reached_it() -> None:
    assert not ignores_stop(12, 12, 9)  # stopped after the stop step: obeyed
    assert ignores_stop(13, 12, 9)  # one step past it
    assert not ignores_stop(16, 12, 15)  # already past when the file came: its step then, and one more
    assert ignores_stop(17, 12, 15)
    assert not ignores_stop(None, 12, None) and not ignores_stop(20, None, 3)  # no steps, no stop step


def test_stop_grace_is_cut_short_by_the_time_the_job_has_left() -> None:
    assert stop_grace(60, None) == 60  # 22.05, or a preemption: the grace period as configured
    assert stop_grace(60, 3600) == 60  # the time limit is far
    assert stop_grace(60, 40) == 40 - END_MARGIN_S  # the limit comes first: room for the decision
    assert stop_grace(60, 5) == 0  # nothing left: stop at once
    env = {"SLURM_JOB_END_TIME": "1000100"}
    assert time_left(env, 1_000_000.0) == 100
    assert time_left({}, 1.0) is None and time_left({"SLURM_JOB_END_TIME": "soon"}, 1.0) is None
