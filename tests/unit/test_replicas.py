"""torchft replica groups: the coordinator restarts only the failed group, drops it, or goes job-wide."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hpcelastic.agent import messages
from hpcelastic.agent.job_state import Action, Phase, Record, Say, Send
from hpcelastic.agent.replicas import ReplicaJobState, check_groups, plan_groups
from hpcelastic.agent.workers import worker_env
from hpcelastic.reasons import Reason
from tests.unit.test_workers_env import config


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(
    *, groups: int = 2, min_groups: int = 1, max_restarts: int = 2, spares: int = 0, fence_s: float = 0.0
) -> ReplicaJobState:
    ports = itertools.count(40000)
    st = ReplicaJobState(
        replica_groups=groups,
        min_replica_groups=min_groups,
        lighthouse="http://n0:29510",
        hosts=[f"n{i}" for i in range(4 + spares)],
        round_size=4,
        min_nodes=1,
        max_restarts=max_restarts,
        master_addr="n0",
        new_port=lambda: next(ports),
        rdzv_timeout=60,
        now=Clock(),
        fence_s=fence_s,
    )
    return st


def rounds(actions: list[Action]) -> dict[int, messages.Round]:
    return {
        a.node_rank: a.message
        for a in actions
        if isinstance(a, Send) and isinstance(a.message, messages.Round)
    }


def named(actions: list[Action], name: str) -> list[dict[str, Any]]:
    return [a.event.fields for a in actions if isinstance(a, Record) and a.event.name == name]


def start(st: ReplicaJobState) -> dict[int, messages.Round]:
    out: list[Action] = []
    for i in range(len(st.hosts)):
        out += st.join(i, f"n{i}", 1)
    return rounds(out)


def test_plan_and_check() -> None:
    assert plan_groups([0, 1, 2, 3], 4, 2) == [[0, 1], [2, 3]]
    assert plan_groups([0, 1, 3], 4, 2) == [[0, 1], []]  # a group short of nodes is left out
    assert plan_groups([0, 1, 4, 5], 4, 2) == [[0, 1], [4, 5]]  # spares fill a job-wide restart
    assert check_groups(3, 2, 1).startswith("3 node(s) do not split into 2 replica groups of equal size")
    assert check_groups(4, 2, 3) == (
        "--min-replica-groups 3 exceeds --replica-groups 2; lower --min-replica-groups to 2 or fewer"
    )
    assert check_groups(4, 2, 2) is None


def test_each_group_is_a_world_of_its_own() -> None:
    r = start(make())
    assert [r[n].replica_group for n in range(4)] == [0, 0, 1, 1]
    assert [(r[n].rank_offset, r[n].world_size, r[n].group_rank) for n in range(4)] == [
        (0, 2, 0),
        (1, 2, 1),
    ] * 2
    assert r[0].master_port == r[1].master_port != r[2].master_port == r[3].master_port
    assert {m.num_replica_groups for m in r.values()} == {2} and r[3].lighthouse == "http://n0:29510"


def test_worker_failure_restarts_only_its_group_and_heals() -> None:
    st = make()
    r = start(st)
    st.progress(2, r[2].round, 9, 1000.0, 1)
    st.progress(0, r[0].round, 9, 1000.0, 1)
    out = st.worker_failed(3, r[3].round, [{"rank": 1, "error": "killed by SIGKILL", "ts": 1000.0}])
    assert {a.node_rank for a in out if isinstance(a, Send)} == {2, 3}  # group 0 is not told anything
    out = st.workers_stopped(2, r[2].round, []) + st.workers_stopped(3, r[3].round, [])
    again = rounds(out)
    assert set(again) == {2, 3} and again[2].restart_count == 1 and again[2].round > r[2].round
    assert named(out, "replica_group_restarting")[0]["group"] == 1
    st.progress(0, r[0].round, 30, 1010.0, 1)
    healed = named(st.progress(2, again[2].round, 31, 1012.0, 1), "replica_group_healed")
    assert healed == [{"group": 1, "step": 31, "peers": [0], "steps_missed": 21, "down_s": 12.0}]
    for n in range(4):
        out = st.workers_done(n, (again.get(n) or r[n]).round)
    assert st.phase is Phase.FINISHED and st.result is not None and st.result.reason is Reason.SUCCEEDED


def test_group_without_restarts_left_is_dropped_while_enough_remain() -> None:
    st = make(max_restarts=0)
    r = start(st)
    st.worker_failed(2, r[2].round, [{"rank": 0, "error": "boom", "ts": 1000.0}])
    out = st.workers_stopped(2, r[2].round, []) + st.workers_stopped(3, r[3].round, [])
    assert named(out, "replica_group_dropped")[0]["remaining"] == 1 and not rounds(out)
    st.workers_done(0, r[0].round)
    st.workers_done(1, r[1].round)
    assert st.result is not None and st.result.reason is Reason.SUCCEEDED


def test_group_that_lost_a_node_is_left_out_and_the_others_go_on() -> None:
    st = make()
    r = start(st)
    out = st.lost(3, "connection closed")
    out += st.workers_stopped(2, r[2].round, [])
    assert (
        not rounds(out)
        and named(out, "replica_group_dropped")[0]["reason"] == "it lost 1 of its nodes and no spare is left"
    )
    assert st.phase is Phase.RUNNING
    st.workers_done(0, r[0].round)
    assert st.workers_done(1, r[1].round) and st.result is not None and st.result.reason is Reason.SUCCEEDED


def test_a_stop_signal_reaching_the_groups_apart_neither_drops_nor_restarts_a_group() -> None:
    """Slurm's TERM reaches group 1's nodes first: held, not a group that lost its nodes; once every
    agent left, one job-wide stop with no root cause."""
    st = make()
    r = start(st)
    out = st.left(2, "agent received SIGTERM", signalled_at=1000.0) + st.left(
        3, "agent received SIGTERM", signalled_at=1000.0
    )
    assert out == [] and st.phase is Phase.RUNNING
    out += st.workers_stopped(0, r[0].round, [])
    out += st.left(1, "agent received SIGTERM", signalled_at=1000.0) + st.left(
        0, "agent received SIGTERM", signalled_at=1000.0
    )
    for name in ("replica_group_dropped", "replica_group_restarting", "root_cause"):
        assert not named(out, name), name
    assert not named(out, "node_lost") and len(named(out, "agent_stopped")) == 4  # the step's stop
    assert st.result is not None and st.result.reason is Reason.COORDINATOR_LOST and st.result.bad_nodes == ()


def test_below_min_groups_the_job_wide_path_applies() -> None:
    st = make(min_groups=2, max_restarts=1)
    r = start(st)
    st.lost(2, "node down")
    out = st.lost(3, "node down")
    assert st.phase is Phase.STOPPING
    out += st.workers_stopped(0, r[0].round, []) + st.workers_stopped(1, r[1].round, [])
    assert st.result is not None and st.result.reason is Reason.TOO_FEW_NODES
    assert st.result.message == "1 replica group(s) have nodes, fewer than --min-replica-groups 2"
    assert {a.node_rank for a in out if isinstance(a, Send) and isinstance(a.message, messages.Finish)} == {
        0,
        1,
    }


def test_round_over_the_wire_and_worker_environment(tmp_path: Path) -> None:
    rnd = start(make())[3]
    wire = json.loads(json.dumps(messages.encode(rnd)))
    assert messages.Round.from_wire(wire) == rnd
    env = worker_env(config(tmp_path), rnd, 0, tmp_path / "err.json")
    assert (env["REPLICA_GROUP_ID"], env["NUM_REPLICA_GROUPS"]) == ("1", "2")
    assert env["TORCHFT_LIGHTHOUSE"] == "http://n0:29510" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == ("1", "2", "1")
    plain = dataclasses.replace(rnd, replica_group=-1, num_replica_groups=0, lighthouse="")
    assert "REPLICA_GROUP_ID" not in worker_env(config(tmp_path), plain, 0, tmp_path / "err.json")


def test_group_that_lost_a_node_takes_a_spare() -> None:
    st = make(spares=1)
    r = start(st)
    assert 4 not in r  # the spare gets no round
    out = st.lost(2, "node down") + st.workers_stopped(3, r[3].round, [])
    again = rounds(out)
    assert set(again) == {3, 4} and again[3].world_size == 2 and again[4].replica_group == 1
    assert (again[3].group_rank, again[4].group_rank) == (0, 1)


def test_a_group_restart_waits_for_the_fence_after_a_silent_loss() -> None:
    """A node lost by silence may still run its workers (cut off) until its lease ends: its group restarts on
    a spare only after the fence, as a job-wide round does (the simulated weeks found group rounds started
    while the lost node's workers lived on)."""
    st = make(spares=1, fence_s=3.6)
    r = start(st)
    clock = st.now
    assert isinstance(clock, Clock)
    out = st.lost(2, "no heartbeat for 4.8 s", silent=True) + st.workers_stopped(3, r[3].round, [])
    assert not rounds(out) and any(isinstance(a, Say) and "(fence)" in a.text for a in out)
    clock.t += 3.0
    assert not rounds(st.tick())
    clock.t += 0.7
    again = rounds(st.tick())
    assert set(again) == {3, 4} and again[4].replica_group == 1


def test_a_fenced_job_wide_restart_is_not_due_again() -> None:
    """Below --min-replica-groups after a silent loss, the job-wide restart waits for the fence and then
    starts every group; it is then done, so a later job-wide stop counts the budget again instead of
    restarting at once (the replica path did not clear the base class's ``round_due``)."""
    st = make(min_groups=2, max_restarts=3, spares=2, fence_s=3.6)
    r = start(st)
    clock = st.now
    assert isinstance(clock, Clock)
    st.lost(2, "no heartbeat for 4.8 s", silent=True)
    st.lost(3, "no heartbeat for 4.8 s", silent=True)
    out = st.workers_stopped(0, r[0].round, []) + st.workers_stopped(1, r[1].round, [])
    assert named(out, "restarting") and not rounds(out) and st.round_due
    clock.t += 4.0
    again = rounds(st.tick())
    assert set(again) == {0, 1, 4, 5} and not st.round_due and st.phase is Phase.RUNNING
    st.lost(4, "connection closed")
    st.lost(5, "connection closed")
    out = st.workers_stopped(0, again[0].round, []) + st.workers_stopped(1, again[1].round, [])
    assert named(out, "restarting")[0]["restart_count"] == 2


def test_a_spare_taken_from_a_dropped_group_stops_with_the_group_it_joined() -> None:
    """Group 0 is left out; its node 0 becomes group 1's spare. When group 1 restarts again, node 0's stop is
    its (the simulated weeks found it ignored: the node was still looked up in the dropped group, and was
    then declared lost for not stopping)."""
    st = make(max_restarts=2)
    r = start(st)
    st.lost(1, "connection closed")
    assert named(st.workers_stopped(0, r[0].round, []), "replica_group_dropped")
    st.lost(3, "connection closed")
    joined = rounds(st.workers_stopped(2, r[2].round, []))
    assert set(joined) == {0, 2} and joined[0].replica_group == 1
    st.worker_failed(2, joined[2].round, [{"rank": 1, "error": "boom", "ts": 1000.0}])
    out = st.workers_stopped(0, joined[0].round, []) + st.workers_stopped(2, joined[2].round, [])
    assert set(rounds(out)) == {0, 2}


def test_submit_refuses_replica_groups_that_do_not_fit(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    base = [sys.executable, "-m", "hpcelastic", "submit", "--dry-run", "--run-dir", str(tmp_path / "run")]
    cases = {
        (
            "--nodes",
            "3",
            "--replica-groups",
            "2",
        ): "3 node(s) do not split into 2 replica groups of equal size",
        ("--nodes", "2:4", "--replica-groups", "2"): "--replica-groups needs a fixed node count",
    }
    for flags, error in cases.items():
        proc = subprocess.run([*base, *flags, str(script)], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 2 and error in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert not (tmp_path / "run").exists()
    # Hangs are judged per group: --stall-timeout goes with --replica-groups to every agent.
    flags = ["--nodes", "4", "--replica-groups", "2", "--stall-timeout", "30"]
    proc = subprocess.run([*base, *flags, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--stall-timeout 30" in proc.stdout and "--replica-groups 2" in proc.stdout


def _stall(st: ReplicaJobState, node: int, round_: int, yes: bool = True) -> list[Action]:
    return st.stall_report(node, messages.StallReport(round_, yes, (node % 2,), 12.0))


def _stacks(node: int, round_: int, hung: bool) -> messages.StacksReport:
    from tests.unit.test_hang_state import SLEEPING, stack

    quorum = [{"function": "wait_quorum", "filename": "/v/site-packages/torchft/manager.py", "line": 1}]
    frames = SLEEPING if hung else quorum + SLEEPING[1:]
    return messages.StacksReport(round_, {str(node % 2): stack(100 + node, frames, 0)})


def test_hang_in_one_group_restarts_only_that_group_with_the_rank_named() -> None:
    st = make()
    st.stall_timeout = 10.0
    r = start(st)
    assert _stall(st, 2, r[2].round) == []
    asked = _stall(st, 3, r[3].round)
    assert {a.node_rank for a in asked if isinstance(a, Send)} == {2, 3}  # group 0 is not asked
    out = st.stacks_report(2, _stacks(2, r[2].round, hung=False))
    out += st.stacks_report(3, _stacks(3, r[3].round, hung=True))
    [cause] = named(out, "root_cause")
    assert (cause["rank"], cause["node"], cause["round"]) == (1, "n3", r[3].round)
    assert cause["error"].startswith("stalled: hung at /job/train.py:77")
    assert {a.node_rank for a in out if isinstance(a, Send)} == {2, 3}
    out = st.workers_stopped(2, r[2].round, []) + st.workers_stopped(3, r[3].round, [])
    assert named(out, "replica_group_restarting")[0]["group"] == 1 and set(rounds(out)) == {2, 3}
    assert st.phase is Phase.RUNNING and st.restart_count == 0


def test_no_hang_for_a_group_waiting_for_its_quorum_while_another_restarts() -> None:
    st = make()
    st.stall_timeout = 10.0
    clock = st.now
    r = start(st)
    st.progress(0, r[0].round, 5, 1000.0, 1)
    st.worker_failed(3, r[3].round, [{"rank": 1, "error": "killed", "ts": 1000.0}])
    again = rounds(st.workers_stopped(2, r[2].round, []) + st.workers_stopped(3, r[3].round, []))
    # Group 0 waits in torchft's quorum for the restarted group: stalled on both nodes, not a hang.
    assert _stall(st, 0, r[0].round) + _stall(st, 1, r[1].round) == []
    clock.t += 30  # type: ignore[attr-defined]
    assert not [a for a in st.tick() if isinstance(a, Send)]
    st.progress(2, again[2].round, 6, clock(), 1)  # group 1 healed
    clock.t += 5  # type: ignore[attr-defined]
    assert not [a for a in st.tick() if isinstance(a, Send)]  # within the stall timeout of the heal
    clock.t += 6  # type: ignore[attr-defined]
    asked = st.tick()  # still stalled a stall timeout after the heal: now it is a hang
    assert {a.node_rank for a in asked if isinstance(a, Send)} == {0, 1}


def test_group_waiting_for_a_hung_peer_is_not_restarted_the_hung_group_is() -> None:
    st = make()
    st.stall_timeout = 10.0
    r = start(st)
    # Group 0 reports first: both its ranks wait in torchft for group 1. No root rank in it: kept.
    asked = _stall(st, 0, r[0].round) + _stall(st, 1, r[1].round)
    assert {a.node_rank for a in asked if isinstance(a, Send)} == {0, 1}
    out = st.stacks_report(0, _stacks(0, r[0].round, hung=False))
    out += st.stacks_report(1, _stacks(1, r[1].round, hung=False))
    assert not [a for a in out if isinstance(a, Send)] and not named(out, "root_cause")
    assert not [a for a in st.tick() if isinstance(a, Send)]  # not asked again at once
    # Group 1 holds the hung rank: it alone restarts.
    asked = _stall(st, 2, r[2].round) + _stall(st, 3, r[3].round)
    assert {a.node_rank for a in asked if isinstance(a, Send)} == {2, 3}
    out = st.stacks_report(2, _stacks(2, r[2].round, hung=True))
    out += st.stacks_report(3, _stacks(3, r[3].round, hung=False))
    assert named(out, "root_cause")[0]["node_rank"] == 2
    assert {a.node_rank for a in out if isinstance(a, Send)} == {2, 3}


def test_a_healed_groups_old_failure_is_not_the_root_cause_of_a_later_job_wide_stop() -> None:
    st = make(min_groups=2, max_restarts=1, spares=1)
    r = start(st)
    again = rounds(st.lost(2, "node down") + st.workers_stopped(3, r[3].round, []))
    assert set(again) == {3, 4}
    st.progress(0, r[0].round, 20, 1010.0, 1)
    assert named(st.progress(3, again[3].round, 21, 1012.0, 1), "replica_group_healed")
    st.worker_failed(0, r[0].round, [{"rank": 0, "error": "first", "ts": 1020.0}])
    g0 = rounds(st.workers_stopped(0, r[0].round, []) + st.workers_stopped(1, r[1].round, []))
    assert set(g0) == {0, 1}
    st.worker_failed(1, g0[1].round, [{"rank": 1, "error": "second", "ts": 1030.0}])
    out = st.workers_stopped(0, g0[0].round, []) + st.workers_stopped(1, g0[1].round, [])
    out += st.workers_stopped(3, again[3].round, []) + st.workers_stopped(4, again[4].round, [])
    causes = named(out, "root_cause")
    assert causes and all(c["error"] == "second" for c in causes), causes
