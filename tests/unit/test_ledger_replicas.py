"""The ledger of torchft replica-group runs, and the shutdown phase, from event logs built with the
events constructors (fixed timestamps)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hpcelastic import events as ev
from hpcelastic.events import EventLog, ProgressMark
from hpcelastic.reasons import Reason, RestartCause
from hpcelastic.record.ledger import Phase, build_ledger, ledger_lines
from hpcelastic.record.replica_lanes import GroupLane
from tests.unit.test_ledger import ended, failure, ledger, rdzv, rec, spawned, step, succeed

NODES = ["n1", "n2", "n3", "n4"]
G0, G1 = ["n1", "n2"], ["n3", "n4"]


def start(ts: float) -> dict[str, Any]:
    return rec(ts, ev.attempt_started(attempt=0, job_id="7", restart_count_slurm=0, nodes=NODES))


def group_start() -> list[dict[str, Any]]:
    """Attempt at 0; both groups' rounds (0 and 1) opened at 10; the job's first step at 20."""
    return [
        start(0.0),
        rdzv(10.0, 0, G0),
        rdzv(10.001, 1, G1),
        spawned(11.0, 1),
        spawned(11.0, 0),
        step(20.0, 0, 1, 0, ProgressMark.FIRST),
    ]


def kill(ts: float, rnd: int, node: str, *, exit_ts: float) -> dict[str, Any]:
    return rec(ts, ev.worker_failed(failure(rnd, 3, node, "killed by SIGKILL"), exit_ts=exit_ts))


def group_restart(ts: float, group: int, rnd: int, hosts: list[str], last_step: int) -> list[dict[str, Any]]:
    restarting = ev.replica_group_restarting(group=group, round=rnd, nodes=hosts, group_restarts=1,
                                             max_restarts=3, reason=RestartCause.WORKER_FAILED,
                                             last_step=last_step)  # fmt: skip
    return [rec(ts, restarting), rdzv(ts + 0.001, rnd, hosts), spawned(ts + 1.0, rnd)]


def healed(ts: float, group: int, at: int, missed: int | None) -> dict[str, Any]:
    return rec(ts, ev.replica_group_healed(group=group, step=at, peers=[1 - group], steps_missed=missed,
                                           down_s=10.0))  # fmt: skip


def end(ts: float, rnd: int, last_step: int) -> list[dict[str, Any]]:
    """The job's last step at ``ts - 5`` (its ``last`` progress mark), then success at ``ts``."""
    return [step(ts - 5.0, 0, rnd, last_step, ProgressMark.LAST), *succeed(ts, 0)]


def killed_group_1_run() -> list[dict[str, Any]]:
    """Group 1's worker killed at 50 (seen 50.5, restarting 51); healed at 64 (15 steps missed); the job's
    last step 79 at 100; success at 105."""
    return [
        *group_start(),
        kill(50.5, 1, "n4", exit_ts=50.0),
        *group_restart(51.0, 1, 2, G1, 29),
        healed(64.0, 1, 45, 15),
        *end(105.0, 2, 79),
    ]


def lane(led: Any, group: int) -> GroupLane:
    (found,) = [x for x in led.replica_groups.lanes if x.group == group]
    # A lane's spans are consecutive and cover its epoch.
    assert [s.t1 for s in found.spans[:-1]] == pytest.approx([s.t0 for s in found.spans[1:]])
    assert (found.spans[0].t0, found.spans[-1].t1) == pytest.approx((found.start, found.end))
    return found


def test_a_killed_group_loses_its_own_time_and_the_job_keeps_training() -> None:
    led = ledger(killed_group_1_run())
    # The job: start-up to the first step, productive while a group steps, shutdown after the last step.
    assert led.incidents == []
    assert led.productive_s == pytest.approx(80.0)
    assert led.badput_by_cause == pytest.approx({"startup": 20.0, "shutdown": 5.0})
    assert led.ettr == pytest.approx(80.0 / 105.0)
    rep = led.replica_groups
    assert rep is not None and rep.groups == 2
    healthy, killed = rep.per_group
    assert (healthy.productive_s, healthy.lost_s, healthy.restarts, healthy.steps_missed) == (
        pytest.approx(80.0), 0.0, 0, 0)  # fmt: skip
    assert killed.productive_s == pytest.approx(30.0 + 36.0)
    assert killed.lost_s == pytest.approx(14.0)
    assert (killed.restarts, killed.steps_missed, killed.steps_missed_estimated) == (1, 15, False)
    (inc,) = lane(led, 1).incidents
    assert (inc.kind, inc.round, inc.t_fail, inc.recovery, inc.healed_from) == (
        "worker_failure", 1, 50.0, "healed", [0])  # fmt: skip
    assert inc.detection_s == pytest.approx(0.5)
    assert inc.teardown_s == pytest.approx(0.5)
    assert inc.rendezvous_s + inc.restart_to_heal_s == pytest.approx(13.0)
    phases = "startup productive detection teardown rendezvous restart productive shutdown"
    assert [s.phase for s in lane(led, 1).spans] == phases.split()
    assert [s.phase for s in lane(led, 0).spans] == ["startup", "productive", "shutdown"]
    # torchft's figure: replica-steps committed / possible (80 job steps x 2 groups, 15 missed).
    assert (rep.replica_steps_committed, rep.replica_steps_possible) == (145, 160)
    assert rep.replica_step_efficiency == pytest.approx(145 / 160)
    assert rep.replica_time_efficiency == pytest.approx((80.0 + 66.0) / (2 * 105.0))


def test_the_old_ledger_saw_no_productive_time_in_a_replica_run() -> None:
    """Regression: the groups' parallel rounds made the whole attempt 'startup' (ETTR 0 %)."""
    led = build_ledger(EventLog(killed_group_1_run()))
    assert led.ettr is not None and led.ettr > 0.7
    assert [r.round for r in led.attempts[0].rounds] == [0]  # the epoch is one round of the job


def test_time_when_no_group_steps_is_not_productive() -> None:
    """Group 0 fails at 40 (back at 60), group 1 at 45 (back at 58): nobody steps from 45 to 58."""
    records = [
        *group_start(),
        kill(40.2, 0, "n2", exit_ts=40.0),
        *group_restart(41.0, 0, 2, G0, 19),
        kill(45.2, 1, "n4", exit_ts=45.0),
        *group_restart(46.0, 1, 3, G1, 24),
        healed(58.0, 1, 30, 5),
        healed(60.0, 0, 31, 11),
        *end(105.0, 3, 79),
    ]
    led = ledger(records)
    assert led.productive_s == pytest.approx(25.0 + 42.0)
    assert led.badput_by_cause == pytest.approx({"startup": 20.0, "worker_failure": 13.0, "shutdown": 5.0})
    gap = [s for s in led.segments if s.cause == "worker_failure"]
    assert [(s.t0, s.t1, s.phase) for s in gap] == [(45.0, 58.0, Phase.RESTART)]
    rep = led.replica_groups
    assert rep is not None and [t.steps_missed for t in rep.per_group] == [11, 5]
    assert rep.replica_steps_committed == 160 - 16


def test_a_group_left_out_after_a_node_loss() -> None:
    reason = "no heartbeat for 2.0 s (node hung or unreachable)"
    records = [
        *group_start(),
        rec(50.0, ev.node_lost(node_rank=3, node="n4", reason=reason)),
        rec(
            50.1,
            ev.replica_group_dropped(
                group=1, reason="it lost 1 of its nodes and no spare is left", remaining=1, min_groups=1
            ),
        ),  # fmt: skip
        *end(105.0, 1, 79),
    ]
    led = ledger(records)
    assert led.productive_s == pytest.approx(80.0)
    rep = led.replica_groups
    assert rep is not None
    left = rep.per_group[1]
    assert left.dropped and left.dropped_s == pytest.approx(54.9)
    assert left.productive_s == pytest.approx(28.0)
    (inc,) = lane(led, 1).incidents
    assert (inc.kind, inc.t_fail, inc.recovery) == ("node_loss", 48.0, "dropped")
    assert inc.detection_s == pytest.approx(2.0)
    # Estimated from the job's progress marks (step 0 at 20, step 79 at 100): step ~27.7 at 48.
    assert (left.steps_missed, left.steps_missed_estimated) == (51, True)
    assert rep.replica_steps_committed == 160 - 51


def test_status_text_and_json_carry_the_replica_figures() -> None:
    led = ledger(killed_group_1_run())
    text = "\n".join(ledger_lines(led))
    assert "replica groups: 2; replica-step efficiency 90.6 % (145 of 160 replica-steps committed)" in text
    assert "group 0: productive 1 min 20 s, lost 0.0 s, 0 step(s) missed" in text
    assert "group 1: productive 1 min 06 s, lost 14.0 s, 1 restart(s), 15 step(s) missed" in text
    assert "healed from group(s) 0" in text
    data = json.loads(json.dumps(led.to_json()))["replica_groups"]
    assert data["groups"] == 2 and data["replica_step_efficiency"] == pytest.approx(145 / 160)
    assert [g["lost_s"] for g in data["per_group"]] == pytest.approx([0.0, 14.0])
    assert data["lanes"][1]["incidents"][0]["lost_s"] == pytest.approx(14.0)


def test_shutdown_after_the_last_step_is_not_productive() -> None:
    """Without replica groups: the last step at 90 (its ``last`` mark), the attempt ends at 100."""
    records = [start(0.0), rdzv(1.0, 0, NODES), spawned(2.0, 0), step(10.0, 0, 0, 1, ProgressMark.FIRST),
               step(90.0, 0, 0, 80, ProgressMark.LAST), *succeed(100.0, 0)]  # fmt: skip
    led = ledger(records)
    assert led.replica_groups is None
    assert led.productive_s == pytest.approx(80.0)
    assert led.badput_by_cause == pytest.approx({"startup": 10.0, "shutdown": 10.0})
    assert led.badput_by_phase == pytest.approx({"startup": 10.0, "shutdown": 10.0})
    assert "replica" not in "\n".join(ledger_lines(led))
    assert led.to_json()["replica_groups"] is None


def test_a_hung_group_is_its_own_incident_not_the_jobs() -> None:
    """A group hang writes a ``root_cause`` of the group's round; the group restarts alone."""
    stalled = failure(1, 3, "n4", "stalled: hung at train.py:10; no progress for 10 s (rank 1 alone)", None)
    records = [
        *group_start(),
        rec(60.1, ev.worker_failed(stalled, exit_ts=60.0)),
        rec(60.2, ev.root_cause(stalled, traceback="", exit_ts=60.0)),
        *group_restart(61.0, 1, 2, G1, 39),
        healed(70.0, 1, 60, 20),
        *end(105.0, 2, 79),
    ]
    led = ledger(records)
    assert led.incidents == [] and led.productive_s == pytest.approx(80.0)
    (inc,) = lane(led, 1).incidents
    assert (inc.kind, inc.t_fail, inc.recovery) == ("stall", 50.0, "healed")
    assert inc.detection_s == pytest.approx(10.1)


def test_a_job_wide_restart_starts_a_new_epoch_of_groups() -> None:
    """Group 1 loses a node and too few groups remain: every group stops and restarts (a new epoch)."""
    reason = "no heartbeat for 2.0 s (node hung or unreachable)"
    lost = failure(1, None, "n4", f"node lost: {reason}", None)
    dropped = ev.replica_group_dropped(group=1, reason="it lost 1 of its nodes and no spare is left",
                                       remaining=1, min_groups=2)  # fmt: skip
    restarting = ev.restarting(round=2, restart_count=1, max_restarts=3, reason=RestartCause.NODE_LOST)
    records = [
        *group_start(),
        ckpt_at(45.0, 25),
        rec(50.0, ev.node_lost(node_rank=3, node="n4", reason=reason)),
        rec(50.1, dropped),
        step(47.0, 0, 1, 27, ProgressMark.LAST),
        rec(50.2, ev.root_cause(lost, traceback="", exit_ts=50.0)),
        rec(50.3, restarting),
        rdzv(50.4, 2, G0),
        rdzv(50.401, 3, ["n3", "n5"]),
        step(60.0, 0, 3, 28, ProgressMark.FIRST),
        *end(105.0, 3, 67),
    ]
    led = ledger(records)
    (inc,) = led.incidents
    assert (inc.kind.value, inc.t_fail, inc.recovery) == ("node_loss", 48.0, "restart")
    # the new epoch's first step is 28: it resumed after step 27 (at 47): only the step in flight was redone
    assert inc.redone_work_s == pytest.approx(1.0) and inc.detection_s == pytest.approx(2.0)
    assert inc.redone_source == "heartbeats" and inc.redone_steps == 0
    assert inc.restart_to_first_step_s == pytest.approx(9.6)
    assert [r.round for r in led.attempts[0].rounds] == [0, 2]
    assert led.productive_s == pytest.approx(27.0 + 40.0)
    rep = led.replica_groups
    assert rep is not None and len(rep.lanes) == 4
    assert all(not x.incidents for x in rep.lanes)  # the failure is the job's, not one group's
    assert [x.seconds("productive") for x in rep.lanes] == pytest.approx([28.0, 28.0, 40.0, 40.0])
    assert rep.per_group[1].job_s == pytest.approx(2.4)  # detection, teardown and rendezvous of the job
    assert (rep.replica_steps_committed, rep.replica_steps_possible) == (2 * (28 + 40), 2 * (28 + 40))


def ckpt_at(ts: float, n: int) -> dict[str, Any]:
    return rec(ts, ev.checkpoint_published(path=f"/c/{n}.pt", step=n, attempt=0, rank=0, checkpoint_dir="/c"))


def test_a_bad_end_after_a_heal_is_dated_by_its_own_failure() -> None:
    """The coordinator's node goes at 90 after group 1 healed: the job's incident starts at 90, not 50."""
    records = [
        *group_start(),
        kill(50.5, 1, "n4", exit_ts=50.0),
        *group_restart(51.0, 1, 2, G1, 29),
        healed(64.0, 1, 45, 15),
        ckpt_at(80.0, 70),
        rec(90.0, ev.node_lost(node_rank=0, node="n1", reason="its connection closed")),
        ended(95.0, 0, Reason.COORDINATOR_LOST),
    ]
    led = ledger(records)
    (inc,) = led.incidents
    assert (inc.kind.value, inc.t_fail) == ("coordinator_lost", 90.0)
    assert inc.redone_work_s == pytest.approx(10.0)  # since the checkpoint at 80
    assert led.productive_s == pytest.approx(60.0)
    assert [x.seconds("productive") for x in led.replica_groups.lanes] == pytest.approx([70.0, 30.0 + 26.0])


def test_a_group_that_never_stepped_is_not_counted_productive() -> None:
    """Group 1's quorum never formed (its lighthouse link cut): group 0 stepped from 20 (its
    replica_group_stepping), group 1 none before its ranks failed at 80. Its lane has no productive time
    (the ledger took the job's first step for every group's before that event; the simulated weeks with
    replica groups caught it)."""
    led = ledger(
        [
            *group_start(),
            rec(20.0, ev.replica_group_stepping(group=0, round=0, step=1, step_ts=20.0)),
            kill(80.0, 1, "n3", exit_ts=80.0),
            *group_restart(81.0, 1, 2, G1, 60),
            healed(95.0, 1, 70, 10),
            *end(105.0, 2, 85),
        ]
    )
    g0, g1 = lane(led, 0), lane(led, 1)
    assert g0.seconds("productive") == pytest.approx(80.0)  # 20 .. 100, the job's last step
    assert g1.seconds("productive") == pytest.approx(5.0)  # healed at 95 .. 100 only
    assert g1.seconds("startup") == pytest.approx(70.0)  # 10 .. 80: never stepped in its first round
