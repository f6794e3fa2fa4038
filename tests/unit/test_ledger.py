"""The lost-time ledger from synthetic event logs with fixed timestamps."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hpcelastic import events as ev
from hpcelastic.events import Event, EventLog, ProgressMark
from hpcelastic.reasons import Reason, RestartCause
from hpcelastic.record.ledger import IncidentKind, Ledger, Phase, build_ledger, ledger_lines

HOSTS = ["n1", "n2"]


def rec(ts: float, event: Event) -> dict[str, Any]:
    return {"ts": ts, "event": str(event.name), "host": "n1", **event.fields}


def failure(rnd: int, rank: int | None, node: str, error: str, exitcode: int | None = 1) -> dict[str, Any]:
    return {"round": rnd, "rank": rank, "local_rank": rank, "node_rank": 1, "node": node,
            "exitcode": exitcode, "signal": None, "error": error}  # fmt: skip


def start(ts: float, attempt: int, job: str = "11") -> dict[str, Any]:
    return rec(ts, ev.attempt_started(attempt=attempt, job_id=job, restart_count_slurm=attempt, nodes=HOSTS))


def rdzv(ts: float, rnd: int, hosts: list[str] = HOSTS) -> dict[str, Any]:
    ev_ = ev.rendezvous(round=rnd, hosts=hosts, world_size=4 * len(hosts), master_addr="n1",
                        master_port=29500 + rnd, restart_count=rnd)  # fmt: skip
    return rec(ts, ev_)


def spawned(ts: float, rnd: int) -> dict[str, Any]:
    return rec(ts, ev.workers_started(round=rnd, world_size=8, spawned_ts=ts))


def step(
    ts: float, attempt: int, rnd: int, n: int, mark: ProgressMark = ProgressMark.PERIODIC
) -> dict[str, Any]:
    return rec(ts + 0.2, ev.progress(attempt=attempt, round=rnd, step=n, step_ts=ts, mark=mark, ranks=8))


def ckpt(ts: float, attempt: int, n: int) -> dict[str, Any]:
    return rec(
        ts, ev.checkpoint_published(path=f"/c/{n}.pt", step=n, attempt=attempt, rank=0, checkpoint_dir="/c")
    )


def ended(ts: float, attempt: int, reason: Reason) -> dict[str, Any]:
    end = ev.attempt_ended(attempt=attempt, reason=reason, exit_code=reason.exit_code, signature=None,
                           progressed=True)  # fmt: skip
    return rec(ts, end)


def succeed(ts: float, attempt: int) -> list[dict[str, Any]]:
    return [ended(ts, attempt, Reason.SUCCEEDED), rec(ts, ev.job_succeeded(attempt=attempt))]


def submitted(ts: float) -> dict[str, Any]:
    return rec(ts, ev.submitted(job_id="11", backend="sbatch", nodes="2:2", script="train.py"))


def ledger(records: list[dict[str, Any]], now: float | None = None) -> Ledger:
    led = build_ledger(EventLog(records), now)
    # The segments of every attempt add up to its wall time, and nothing overlaps.
    assert led.allocated_s == pytest.approx(sum(a.seconds for a in led.attempts))
    assert led.productive_s + led.unknown_s + sum(led.badput_by_cause.values()) == pytest.approx(
        led.allocated_s
    )
    assert sum(led.badput_by_phase.values()) == pytest.approx(led.badput_s)
    ordered = sorted(led.segments, key=lambda s: s.t0)
    assert all(a.t1 <= b.t0 + 1e-9 for a, b in zip(ordered, ordered[1:], strict=False))
    json.dumps(led.to_json())
    return led


def worker_failure_run() -> list[dict[str, Any]]:
    """Crash at 70 (checkpoint at 50), known at 71, stopped at 75, new round at 76, first step at 85."""
    crash = failure(0, 3, "n2", "Traceback\nRuntimeError: boom")
    return [
        submitted(0.0),
        start(10.0, 0),
        rdzv(12.0, 0),
        spawned(13.0, 0),
        step(20.0, 0, 0, 1, ProgressMark.FIRST),
        ckpt(50.0, 0, 100),
        step(68.0, 0, 0, 137, ProgressMark.LAST),
        rec(71.0, ev.worker_failed(crash, exit_ts=70.0)),
        rec(75.0, ev.root_cause(crash, traceback="Traceback", exit_ts=70.0)),
        rec(75.0, ev.restarting(round=1, restart_count=1, max_restarts=3, reason=RestartCause.WORKER_FAILED)),
        rdzv(76.0, 1),
        spawned(77.0, 1),
        step(85.0, 0, 1, 101, ProgressMark.FIRST),
        *succeed(200.0, 0),
    ]


def test_worker_failure_and_restart_is_split_into_phases() -> None:
    led = ledger(worker_failure_run())
    (inc,) = led.incidents
    assert inc.kind is IncidentKind.WORKER_FAILURE
    assert inc.cause == "rank 3 on n2, exit code 1: RuntimeError: boom"
    assert (inc.attempt, inc.round, inc.t_fail, inc.recovery) == (0, 0, 70.0, "restart")
    assert inc.redone_work_s == pytest.approx(20.0)  # checkpoint at 50, crash at 70
    assert inc.detection_s == pytest.approx(1.0)
    assert inc.teardown_s == pytest.approx(4.0)
    assert inc.rendezvous_s == pytest.approx(1.0)
    assert inc.restart_to_first_step_s == pytest.approx(9.0)
    assert inc.pending_s == 0.0
    assert inc.redone_steps == 37
    assert inc.estimated == []
    assert inc.lost_s == pytest.approx(35.0)
    assert led.allocated_s == pytest.approx(190.0)
    assert led.productive_s == pytest.approx(30.0 + 115.0)
    assert led.badput_by_cause == pytest.approx({"startup": 10.0, "worker_failure": 35.0})
    assert led.badput_by_phase == pytest.approx(
        {
            "startup": 10.0,
            "redone": 20.0,
            "detection": 1.0,
            "teardown": 4.0,
            "rendezvous": 1.0,
            "restart": 9.0,
        }
    )
    assert led.ettr == pytest.approx(145.0 / 190.0)
    assert led.queued_s == pytest.approx(10.0)
    assert led.steps_measured and led.notes == []
    assert [r.first_step for r in led.attempts[0].rounds] == [20.0, 85.0]


def test_node_loss_counts_the_heartbeat_silence_as_detection() -> None:
    lost = failure(0, None, "n2", "node lost: no heartbeat for 2.0 s (node hung or unreachable)", None)
    records = [
        start(10.0, 0),
        rdzv(11.0, 0),
        spawned(12.0, 0),
        step(15.0, 0, 0, 1, ProgressMark.FIRST),
        ckpt(60.0, 0, 60),
        rec(
            72.0,
            ev.node_lost(node_rank=1, node="n2", reason="no heartbeat for 2.0 s (node hung or unreachable)"),
        ),
        rec(74.0, ev.root_cause(lost, traceback="", exit_ts=72.0)),
        rec(74.0, ev.restarting(round=1, restart_count=1, max_restarts=3, reason=RestartCause.NODE_LOST)),
        rdzv(74.5, 1, ["n1"]),
        spawned(75.0, 1),
        step(80.0, 0, 1, 61, ProgressMark.FIRST),
        *succeed(100.0, 0),
    ]
    led = ledger(records)
    (inc,) = led.incidents
    assert inc.kind is IncidentKind.NODE_LOSS
    assert inc.t_fail == pytest.approx(70.0)
    assert inc.redone_work_s == pytest.approx(10.0)
    assert inc.detection_s == pytest.approx(2.0)
    assert inc.teardown_s == pytest.approx(2.0)
    assert inc.rendezvous_s == pytest.approx(0.5)
    assert inc.restart_to_first_step_s == pytest.approx(5.5)
    assert led.productive_s == pytest.approx(45.0 + 20.0)
    assert led.badput_by_cause == pytest.approx({"startup": 5.0, "node_loss": 20.0})


def preempted_run() -> list[dict[str, Any]]:
    """No progress events: preempted at 100 (checkpoint on stop at 105), pending 111..300, then success."""
    return [
        submitted(0.0),
        start(10.0, 0),
        rdzv(11.0, 0),
        spawned(12.0, 0),
        ckpt(60.0, 0, 50),
        rec(100.0, ev.signal_received(signal="USR2", node_rank=0)),
        ckpt(105.0, 0, 80),
        ended(110.0, 0, Reason.PREEMPTED),
        rec(
            111.0,
            ev.requeued(
                job_id="11", attempt=1, reason=Reason.PREEMPTED, exclude=[], duration_s=0.4, note=None
            ),
        ),  # fmt: skip
        start(300.0, 1),
        rdzv(302.0, 0),
        spawned(304.0, 0),
        ckpt(350.0, 1, 120),
        *succeed(400.0, 1),
    ]


def test_preemption_and_requeue_count_pending_time_and_mark_estimates() -> None:
    led = ledger(preempted_run())
    (inc,) = led.incidents
    assert inc.kind is IncidentKind.PREEMPTION
    assert inc.cause == "USR2 received: preempted"
    assert (inc.t_fail, inc.recovery) == (100.0, "requeue")
    assert inc.redone_work_s == 0.0  # checkpointed on the way out
    assert inc.detection_s == 0.0
    assert inc.teardown_s == pytest.approx(11.0)
    assert inc.pending_s == pytest.approx(189.0)
    assert inc.rendezvous_s == pytest.approx(2.0)
    assert inc.restart_to_first_step_s == pytest.approx(2.0)
    assert "restart_to_first_step_s" in inc.estimated
    assert led.allocated_s == pytest.approx(101.0 + 100.0)
    assert led.productive_s == pytest.approx(88.0 + 96.0)
    assert led.pending_s == pytest.approx(189.0)
    assert led.ettr == pytest.approx(184.0 / 201.0)
    assert led.ettr_wall == pytest.approx(184.0 / 390.0)
    assert not led.steps_measured and led.notes
    assert [a.end_reason for a in led.attempts] == ["preempted", "succeeded"]
    pending = [s for s in led.segments if s.phase is Phase.PENDING]
    assert [(s.t0, s.t1, s.cause) for s in pending] == [(111.0, 300.0, "preemption")]


def test_without_evidence_the_training_before_the_failure_is_unknown_not_redone() -> None:
    crash = failure(0, 0, "n1", "OOM", exitcode=None)
    records = [
        start(0.0, 0),
        rdzv(1.0, 0),
        spawned(2.0, 0),
        rec(40.5, ev.worker_failed(crash, exit_ts=40.0)),
        rec(41.0, ev.root_cause(crash, traceback="", exit_ts=40.0)),
        ended(42.0, 0, Reason.RESTARTS_EXHAUSTED),
        rec(42.0, ev.job_failed(exit_code=3, reason=Reason.RESTARTS_EXHAUSTED, attempt=0)),
    ]
    led = ledger(records)
    (inc,) = led.incidents
    assert inc.redone_work_s == 0.0 and inc.redone_source is None and inc.unknown_s == pytest.approx(38.0)
    assert led.to_json()["incidents"][0]["redone_work_s"] is None
    assert inc.teardown_s == pytest.approx(1.5)  # to the end of the attempt
    assert inc.recovery == "none"
    assert led.productive_s == 0.0 and led.unknown_s == pytest.approx(38.0)
    assert led.ettr == 0.0 and led.ettr_upper == pytest.approx(38.0 / 42.0)
    assert [s.phase for s in led.segments if s.t0 >= 2.0][0] is Phase.UNKNOWN
    text = ledger_lines(led)
    assert text[0].startswith(
        "effective training time ratio 0.0 % to 90.5 %: productive 0.0 s, 38.0 s of unknown"
    )
    assert "redone unknown (38.0 s of training before the failure)" in text[2]
    assert text[-1].startswith("note: redone work unknown for incident(s) #1")


def test_stall_is_dated_back_by_the_stall_timeout() -> None:
    stalled = failure(0, 1, "n1", "stalled: no heartbeat for more than 30 s (last step 7)", exitcode=None)
    records = [
        start(0.0, 0),
        rdzv(1.0, 0),
        spawned(2.0, 0),
        step(5.0, 0, 0, 1, ProgressMark.FIRST),
        rec(131.0, ev.worker_failed(stalled, exit_ts=130.0)),
        rec(133.0, ev.root_cause(stalled, traceback="", exit_ts=130.0)),
        rdzv(134.0, 1),
        spawned(135.0, 1),
        rec(140.0, ev.signal_received(signal="USR2", node_rank=0)),  # preempted while restarting
        ended(145.0, 0, Reason.TIME_LIMIT),
    ]
    led = ledger(records, now=150.0)
    stall, limit = led.incidents
    assert stall.kind is IncidentKind.STALL and stall.t_fail == pytest.approx(100.0)
    assert stall.detection_s == pytest.approx(31.0)
    # round 1 never stepped, read no checkpoint and none was published: nothing tells what it resumed from
    assert stall.redone_source is None and stall.unknown_s == pytest.approx(95.0)
    assert limit.kind is IncidentKind.TIME_LIMIT
    # Round 1 never reached a step: its time up to the signal is the stall's restart, no productive time.
    assert stall.restart_to_first_step_s == pytest.approx(6.0)
    assert limit.teardown_s == pytest.approx(5.0)
    assert limit.recovery == "in_progress"  # no job end, no next attempt: waiting in the queue
    assert limit.pending_s == pytest.approx(5.0)


def test_a_run_without_failures_has_no_incidents() -> None:
    records = [submitted(0.0), start(10.0, 0), rdzv(11.0, 0), spawned(12.0, 0),
               step(15.0, 0, 0, 1, ProgressMark.FIRST), ckpt(50.0, 0, 100), *succeed(100.0, 0)]  # fmt: skip
    led = ledger(records)
    assert led.incidents == []
    assert led.productive_s == pytest.approx(85.0)
    assert led.badput_by_cause == pytest.approx({"startup": 5.0})
    assert led.ettr == pytest.approx(85.0 / 90.0)


def test_a_running_attempt_ends_now() -> None:
    records = [start(10.0, 0), rdzv(11.0, 0), spawned(12.0, 0), step(15.0, 0, 0, 1, ProgressMark.FIRST)]
    assert ledger(records, now=60.0).productive_s == pytest.approx(45.0)
    assert ledger(records).allocated_s == pytest.approx(5.2)  # without now: the newest event


def test_resubmission_after_exhausted_restarts_and_an_attempt_that_never_started() -> None:
    crash = failure(0, 0, "n1", "boom")
    records = [
        start(0.0, 0),
        rdzv(1.0, 0),
        spawned(2.0, 0),
        step(3.0, 0, 0, 1, ProgressMark.FIRST),
        ckpt(10.0, 0, 10),
        rec(20.5, ev.worker_failed(crash, exit_ts=20.0)),
        rec(21.0, ev.root_cause(crash, traceback="", exit_ts=20.0)),
        ended(22.0, 0, Reason.RESTARTS_EXHAUSTED),
        rec(
            23.0,
            ev.resubmitted(
                job_id="12",
                previous_job_id="11",
                exclude=[],
                reason=Reason.RESTARTS_EXHAUSTED,
                attempt=1,
                duration_s=0.1,
            ),
        ),  # fmt: skip
        start(50.0, 1, "12"),
        ended(80.0, 1, Reason.TOO_FEW_NODES),
        rec(80.0, ev.job_failed(exit_code=4, reason=Reason.TOO_FEW_NODES, attempt=1)),
    ]
    led = ledger(records)
    first, second = led.incidents
    assert first.kind is IncidentKind.WORKER_FAILURE and first.recovery == "requeue"
    assert first.teardown_s == pytest.approx(2.5) and first.pending_s == pytest.approx(27.0)
    assert first.rendezvous_s == pytest.approx(30.0)  # the next attempt never got its nodes together
    assert second.kind is IncidentKind.TOO_FEW_NODES and "t_fail" in second.estimated
    assert led.productive_s == pytest.approx(7.0)


def test_an_empty_log_gives_an_empty_ledger() -> None:
    led = ledger([submitted(0.0)])
    assert (led.attempts, led.incidents, led.allocated_s, led.ettr) == ([], [], 0.0, None)


def test_ledger_lines_for_status() -> None:
    lines = ledger_lines(ledger(preempted_run()))
    assert lines[0].startswith("effective training time ratio 91.5 %: productive 3 min 04 s of 3 min 21 s")
    assert lines[1] == "badput by cause: preemption 15.0 s, startup 2.0 s"
    assert lines[2].startswith("#1 preemption (attempt 0 round 0): USR2 received: preempted; lost 15.0 s")
    assert "restart ~2.0 s" in lines[2] and "pending 3 min 09 s" in lines[2]
    assert lines[-1].startswith("note: no progress events in attempt(s) 0, 1")
    assert ledger_lines(ledger([submitted(0.0)])) == ["lost-time ledger: no attempt has started yet"]


def opened(ts: float, rnd: int, completed: float, path: str = "step-20") -> dict[str, Any]:
    event = ev.checkpoint_opened(attempt=0, round=rnd, node_rank=0, path=path, file=f"{path}/.metadata",
                                 completed_ts=completed, newest=path)  # fmt: skip
    return rec(ts, event)


def crash_then(
    *next_round: dict[str, Any], marks: tuple[tuple[float, int], ...] = ()
) -> list[dict[str, Any]]:
    """Round 0 trains from 10 (its marks), rank 1 crashes at 70; round 1 starts at 75 with ``next_round``."""
    crash = failure(0, 1, "n1", "boom")
    first = [
        step(t, 0, 0, n, ProgressMark.FIRST if i == 0 else ProgressMark.PERIODIC)
        for i, (t, n) in enumerate(marks)
    ]
    return [
        start(0.0, 0), rdzv(1.0, 0), spawned(2.0, 0), *first,
        rec(70.5, ev.worker_failed(crash, exit_ts=70.0)),
        rec(71.0, ev.root_cause(crash, traceback="", exit_ts=70.0)),
        rdzv(75.0, 1), spawned(76.0, 1), *next_round, *succeed(200.0, 0),
    ]  # fmt: skip


def test_redone_work_from_the_step_the_next_round_resumed_after() -> None:
    # Steps 0..60 at 10..70 s (1 s each), marks at 0, 30, 60; round 1's first step is 41: it resumed after 40.
    led = ledger(
        crash_then(step(90.0, 0, 1, 41, ProgressMark.FIRST), marks=((10.0, 0), (40.0, 30), (69.5, 59)))
    )
    (inc,) = led.incidents
    assert (inc.redone_source, inc.redone_steps) == ("heartbeats", 19)
    assert "(19 step(s), heartbeats: the next round resumed after step 40)" in ledger_lines(led)[2]
    assert inc.redone_work_s == pytest.approx(70.0 - (40.0 + 10 * 29.5 / 29))
    assert inc.estimated == []
    # Resumed after the last step reported: only the step in flight was redone.
    led = ledger(crash_then(step(90.0, 0, 1, 60, ProgressMark.FIRST), marks=((10.0, 0), (69.5, 59))))
    assert (led.incidents[0].redone_steps, led.incidents[0].redone_work_s) == (0, pytest.approx(0.5))


def test_redone_work_from_the_checkpoint_the_next_round_read() -> None:
    """An unchanged script: no heartbeats; round 1 read the checkpoint completed at 61 s."""
    led = ledger(crash_then(opened(80.0, 1, completed=61.0)))
    (inc,) = led.incidents
    assert (inc.redone_source, inc.redone_steps) == ("checkpoint_opened", None)
    assert "redone 9.0 s (the next round read checkpoint step-20)" in ledger_lines(led)[2]
    assert inc.redone_work_s == pytest.approx(9.0) and "redone_work_s" not in inc.estimated
    # The round's first step follows its load: its restart lasted at least until the read.
    assert led.attempts[0].rounds[1].first_step == pytest.approx(80.0)
    assert inc.restart_to_first_step_s == pytest.approx(5.0)
    # A checkpoint older than the round: all of its (estimated) training was redone.
    older = ledger(crash_then(opened(80.0, 1, completed=1.5))).incidents[0]
    assert older.redone_work_s == pytest.approx(68.0) and "redone_work_s" in older.estimated


def test_the_first_evidence_wins_heartbeats_over_a_read_checkpoint() -> None:
    records = crash_then(opened(80.0, 1, completed=61.0), step(90.0, 0, 1, 60, ProgressMark.FIRST),
                         marks=((10.0, 0), (69.0, 59)))  # fmt: skip
    assert ledger(records).incidents[0].redone_source == "heartbeats"
