"""Requeues are counted when decided, and excluded nodes come back after a cooldown (issue 10, 15)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcelastic import events
from hpcelastic.events import EventLog
from hpcelastic.lifecycle.executor import Executor, Result
from hpcelastic.lifecycle.history import (
    NODE_COOLDOWN_MAX_S,
    NODE_COOLDOWN_MIN_S,
    History,
    NodeFailures,
    node_cooldown_s,
    node_failures,
    nodes_cooling_down,
    requeue_counts,
)
from hpcelastic.lifecycle.policy import Action, AttemptEnd, Settings, decide
from hpcelastic.reasons import Reason, RequeueCounter
from hpcelastic.rundir import RunDir

M = NODE_COOLDOWN_MIN_S


def test_a_requeue_is_counted_before_slurm_is_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decider's Slurm commands all fail (no scontrol, no sbatch): the requeue was still spent."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    rd = RunDir.create(tmp_path / "run")
    end = AttemptEnd(0, Reason.RESTARTS_EXHAUSTED, 3, "4242", ("n2",))
    out = Executor(retry_delays_s=(), say=lambda m: None).conclude(rd, end, Settings.parse("requeue", 5))
    assert out.action is Result.FAILED
    log = rd.events()
    assert not log.of(events.REQUEUED, events.RESUBMITTED)
    assert requeue_counts(log)[RequeueCounter.FAILURE] == 1
    ended = log.last(events.ATTEMPT_ENDED, attempt=0)
    assert ended["action"] == "bring_back" and ended["exclude"] == ["n2"]


def test_old_logs_count_requeued_events_once() -> None:
    log = EventLog(
        [
            {"event": "attempt_ended", "attempt": 0, "reason": "restarts_exhausted", "action": "bring_back"},
            {"event": "requeued", "attempt": 1, "reason": "restarts_exhausted", "exclude": []},
            {"event": "requeued", "attempt": 2, "reason": "preempted", "exclude": []},  # older writer
        ]
    )
    assert requeue_counts(log)[RequeueCounter.FAILURE] == 1
    assert requeue_counts(log)[RequeueCounter.PREEMPTED] == 1


@pytest.mark.parametrize(
    ("failures", "cooldown"),
    [(1, M), (2, 2 * M), (3, 4 * M), (30, NODE_COOLDOWN_MAX_S)],
)
def test_cooldown_doubles_up_to_a_cap(failures: int, cooldown: float) -> None:
    assert node_cooldown_s(failures) == cooldown


# (failures per node, now) -> nodes still excluded
COOLDOWN_CASES = [
    ("within the first cooldown", {"n1": NodeFailures(1, 1000.0)}, 1000.0 + M - 1, ("n1",)),
    ("first cooldown over", {"n1": NodeFailures(1, 1000.0)}, 1000.0 + M, ()),
    ("second failure doubles it", {"n1": NodeFailures(2, 1000.0)}, 1000.0 + M + 1, ("n1",)),
    ("failed health check never returns", {"n1": NodeFailures(1, 0.0, unhealthy=True)}, 1e12, ("n1",)),
    (
        "only the cooled-down node returns",
        {"n1": NodeFailures(1, 0.0), "n2": NodeFailures(1, 5000.0)},
        5000.0,
        ("n2",),
    ),
]


@pytest.mark.parametrize(
    ("failures", "now", "expected"), [c[1:] for c in COOLDOWN_CASES], ids=[c[0] for c in COOLDOWN_CASES]
)
def test_nodes_cooling_down(failures: dict[str, NodeFailures], now: float, expected: tuple[str, ...]) -> None:
    assert nodes_cooling_down(failures, now) == expected


def _log() -> EventLog:
    return EventLog(
        [
            {"event": "attempt_ended", "ts": 100.0, "attempt": 0, "reason": "too_few_nodes",
             "bad_nodes": ["n2"],
             "action": "bring_back", "exclude": ["n2"]},
            {"event": "node_unhealthy", "ts": 200.0, "node": "n3", "gpu": "0", "reason": "GPU is lost"},
            {"event": "attempt_ended", "ts": 210.0, "attempt": 1, "reason": "node_unhealthy",
             "bad_nodes": ["n3"], "action": "bring_back", "exclude": ["n2", "n3"]},
            {"event": "attempt_ended", "ts": 300.0, "attempt": 2, "reason": "too_few_nodes",
             "bad_nodes": ["n2"],
             "action": "bring_back", "exclude": ["n2", "n3"]},
        ]
    )  # fmt: skip


def test_node_failures_from_the_log() -> None:
    assert node_failures(_log()) == {
        "n2": NodeFailures(2, 300.0),
        "n3": NodeFailures(1, 210.0, unhealthy=True),
    }


def test_a_lost_node_comes_back_after_its_cooldown_an_unhealthy_one_never() -> None:
    end = AttemptEnd(3, Reason.TOO_FEW_NODES, Reason.TOO_FEW_NODES.exit_code, "9", ("n4",))
    early = decide(History.from_log(_log(), 3, cancelled=False, now=300.0 + M), end, Settings(max_requeues=9))
    assert early.action is Action.BRING_BACK
    assert early.exclude == ("n2", "n3", "n4") and early.release == ()
    late_history = History.from_log(_log(), 3, cancelled=False, now=300.0 + 2 * M)
    late = decide(late_history, end, Settings(max_requeues=9))
    assert late.exclude == ("n3", "n4") and late.release == ("n2",)
    assert History.from_log(_log(), 3, cancelled=False).bad_nodes == ("n2", "n3")  # no clock: keep all
