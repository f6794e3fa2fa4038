"""Training progress from heartbeats to ``progress`` events: the agent's rate limit and the
coordinator's first/periodic/last marks."""

from __future__ import annotations

from typing import Any

from hpcelastic import events as ev
from hpcelastic.agent import messages
from hpcelastic.agent.job_state import Action, Record
from hpcelastic.agent.progress import StepReporter
from hpcelastic.hangs.progress import ProgressTracker, Sample
from tests.unit.test_job_state import Clock, failure, join_all, make, stop_all


class Mono:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def marks(actions: list[Action]) -> list[dict[str, Any]]:
    return [a.event.fields for a in actions if isinstance(a, Record) and a.event.name == ev.PROGRESS]


def test_reporter_sends_the_first_step_at_once_then_at_most_one_per_second() -> None:
    clock = Mono()
    rep = StepReporter(interval=1.0, now=clock)
    first = rep.beat(0, 0, 1, 100.0)
    assert first == messages.Progress(0, 1, 100.0, 1)
    assert rep.beat(0, 1, 1, 100.1) is None  # same step from another rank: nothing new
    clock.t = 0.5
    assert rep.beat(0, 0, 2, 100.5) is None  # held back by the rate limit
    assert rep.beat(0, 1, 3, 100.6) is None
    clock.t = 1.2
    assert rep.beat(0, 0, 3, 101.2) == messages.Progress(0, 3, 100.6, 2)  # the highest, at its own time
    assert rep.flush() is None  # nothing held back
    assert rep.beat(0, 1, 4, 101.3) is None
    assert rep.flush() == messages.Progress(0, 4, 101.3, 2)


def test_reporter_starts_over_in_a_new_round() -> None:
    clock = Mono()
    rep = StepReporter(interval=1.0, now=clock)
    rep.beat(0, 0, 9, 100.0)
    assert rep.beat(1, 0, 6, 110.0) == messages.Progress(1, 6, 110.0, 1)  # resumed from a checkpoint


def test_progress_message_round_trips() -> None:
    msg = messages.Progress(2, 17, 123.5, 4)
    assert messages.decode(messages.FROM_AGENT, messages.encode(msg)) == msg


def test_coordinator_writes_first_periodic_and_last_marks() -> None:
    clock = Clock()
    st = make(2, clock=clock)
    st.attempt = 3
    join_all(st)
    first = marks(st.progress(0, 0, 1, 1000.5, 2))
    assert first == [{"attempt": 3, "round": 0, "step": 1, "step_ts": 1000.5, "mark": "first", "ranks": 2}]
    clock.t += 10
    assert marks(st.progress(1, 0, 5, 1010.0, 2)) == []  # before PROGRESS_INTERVAL_S
    assert marks(st.progress(0, 0, 4, 1010.0, 2)) == []  # not higher than what is known
    clock.t += ev.PROGRESS_INTERVAL_S
    [periodic] = marks(st.progress(0, 0, 30, 1070.0, 2))
    assert (periodic["mark"], periodic["step"], periodic["ranks"]) == ("periodic", 30, 4)
    clock.t += 1
    assert marks(st.progress(1, 0, 31, 1071.0, 2)) == []
    st.worker_failed(1, 0, [failure(3, 1071.5)])
    assert marks(st.progress(0, 0, 32, 1071.4, 2)) == []  # a node flushes while stopping
    acts = stop_all(st, [0, 1], 0)
    [last] = marks(acts)
    assert (last["mark"], last["round"], last["step"], last["step_ts"]) == ("last", 0, 32, 1071.4)
    assert marks(st.progress(0, 0, 40, 1080.0, 2)) == []  # the old round is over
    [again] = marks(st.progress(0, 1, 31, 1080.0, 2))
    assert (again["mark"], again["round"], again["step"]) == ("first", 1, 31)


def test_last_mark_when_the_job_succeeds_also_without_new_steps() -> None:
    st = make(2)
    join_all(st)
    st.progress(0, 0, 1, 1000.0, 2)
    st.progress(0, 0, 2, 1000.1, 2)
    st.workers_done(0, 0)
    [last] = marks(st.workers_done(1, 0))
    assert (last["mark"], last["step"]) == ("last", 2)

    quiet = make(2)
    join_all(quiet)
    quiet.progress(0, 0, 1, 1000.0, 2)
    quiet.workers_done(0, 0)
    # The first mark already says step 1; the last still says the round stopped there, once.
    [stopped] = marks(quiet.workers_done(1, 0))
    assert (stopped["mark"], stopped["step"]) == ("last", 1)
    assert marks(quiet.workers_done(1, 0)) == [] and marks(quiet.workers_done(0, 0)) == []


def test_a_rank_with_heartbeats_that_writes_a_checkpoint_is_no_hang() -> None:
    """Rank 0 saves for longer than the stall timeout (its bytes written grow), rank 1 waits for it in a
    barrier: the job is not hung. Before, heartbeat ranks were judged on heartbeats alone."""
    tracker = ProgressTracker(stall_timeout=10.0)
    for rank in (0, 1):
        tracker.heartbeat(rank, 100, now=0.0)
        tracker.observe(rank, Sample(key="save", io_bytes=0), now=0.0)
    for t in range(2, 40, 2):
        tracker.observe(0, Sample(key="save", io_bytes=t * 1_000_000), now=float(t))
        tracker.observe(1, Sample(key="barrier", io_bytes=0), now=float(t))
        assert not tracker.job_stalled(float(t)), t
    assert tracker.stalled(38.0) == {1}
    tracker.observe(0, Sample(key="save", io_bytes=38_000_000), now=50.0)
    assert tracker.job_stalled(50.0)  # the save is over and no heartbeat follows: hung
