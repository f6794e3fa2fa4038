"""The coordinator's decisions: rounds, the job-wide budget, node loss, root cause, exit barrier."""

from __future__ import annotations

import itertools
from typing import Any

from hpcelastic.agent import messages
from hpcelastic.agent.job_state import SIGNAL_SETTLE_S, Action, JobState, Phase, Record, Send
from hpcelastic.reasons import Reason, RestartCause


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(
    n: int = 3, *, min_nodes: int | None = None, max_restarts: int = 2, clock: Clock | None = None
) -> JobState:
    ports = itertools.count(40000)
    return JobState(
        hosts=[f"n{i}" for i in range(n)],
        min_nodes=min_nodes or n,
        max_restarts=max_restarts,
        master_addr="n0",
        new_port=lambda: next(ports),
        rdzv_timeout=60,
        now=clock or Clock(),
    )


def sends(actions: list[Action], t: str) -> dict[int, Any]:
    return {a.node_rank: a.message for a in actions if isinstance(a, Send) and t == a.message.TAG}


def events(actions: list[Action], name: str) -> list[dict[str, Any]]:
    return [a.event.fields for a in actions if isinstance(a, Record) and a.event.name == name]


def join_all(st: JobState, nproc: int = 2) -> list[Action]:
    out: list[Action] = []
    for i in range(len(st.hosts)):
        out += st.join(i, f"n{i}", nproc)
    return out


def stop_all(st: JobState, nodes: list[int], rnd: int) -> list[Action]:
    out: list[Action] = []
    for n in nodes:
        out += st.workers_stopped(n, rnd, [])
    return out


def failure(rank: int, ts: float, error: str = "boom") -> dict[str, Any]:
    return {
        "round": 0,
        "rank": rank,
        "local_rank": rank % 2,
        "exitcode": 1,
        "signal": None,
        "error": error,
        "traceback": f"Traceback\n{error}",
        "ts": ts,
    }


def test_first_round_starts_when_every_node_joined() -> None:
    st = make(3)
    assert st.join(0, "n0", 2) == [] and st.join(2, "n2", 2) == []
    acts = st.join(1, "n1", 2)
    rounds = sends(acts, "round")
    assert sorted(rounds) == [0, 1, 2]
    assert [rounds[i].rank_offset for i in range(3)] == [0, 2, 4]
    assert {r.world_size for r in rounds.values()} == {6}
    assert events(acts, "rendezvous")[0]["hosts"] == ["n0", "n1", "n2"]


def test_failure_stops_all_then_restarts_everywhere_with_new_count_and_port() -> None:
    st = make(3)
    first = sends(join_all(st), "round")[0]
    acts = st.worker_failed(1, 0, [failure(3, 5.0)])
    assert sorted(sends(acts, "stop")) == [0, 1, 2]
    assert events(acts, "worker_failed")[0]["rank"] == 3
    assert stop_all(st, [0, 1], 0) == []  # still waiting for node 2
    acts = st.workers_stopped(2, 0, [])
    again = sends(acts, "round")
    assert sorted(again) == [0, 1, 2]
    assert again[0].restart_count == 1 and again[0].round == 1
    assert again[0].master_port != first.master_port
    assert events(acts, "restarting")[0]["restart_count"] == 1


def test_root_cause_is_the_earliest_failure_job_wide() -> None:
    st = make(2)
    join_all(st)
    st.worker_failed(1, 0, [failure(3, 10.5, "victim")])
    st.workers_stopped(1, 0, [])
    acts = st.workers_stopped(0, 0, [failure(0, 10.2, "real cause")])
    [cause] = events(acts, "root_cause")
    assert (cause["rank"], cause["error"]) == (0, "real cause")
    assert "real cause" in cause["traceback"]


def test_budget_is_job_wide_and_exhaustion_finishes_every_agent() -> None:
    st = make(2, max_restarts=1)
    join_all(st)
    for rnd in (0, 1):
        st.worker_failed(rnd % 2, rnd, [failure(0, float(rnd))])
        acts = stop_all(st, [0, 1], rnd)
    finish = sends(acts, "finish")
    assert sorted(finish) == [0, 1]
    assert {f.exit_code for f in finish.values()} == {3}
    assert finish[0].reason == "restarts_exhausted"
    assert st.restart_count == 1


def test_node_loss_continues_on_survivors_with_ranks_repacked() -> None:
    st = make(4, min_nodes=3)
    join_all(st)
    acts = st.lost(1, "connection closed")
    assert events(acts, "node_lost")[0]["node"] == "n1"
    assert sorted(sends(acts, "stop")) == [0, 2, 3]
    acts = stop_all(st, [0, 2, 3], 0)
    rounds = sends(acts, "round")
    assert sorted(rounds) == [0, 2, 3]
    assert [rounds[n].group_rank for n in (0, 2, 3)] == [0, 1, 2]
    assert [rounds[n].rank_offset for n in (0, 2, 3)] == [0, 2, 4]
    assert rounds[0].world_size == 6 and rounds[0].group_world_size == 3
    assert events(acts, "root_cause")[0]["error"].startswith("node lost")


def test_a_signal_to_every_agent_is_no_failure_and_no_node_is_suspect() -> None:
    """Slurm ending the step (scancel, preemption, time limit) sends every agent SIGTERM: no root cause
    (finalize asks Slurm why), and no node is excluded from the next attempt for it."""
    st = make(3)
    join_all(st)
    acts: list[Action] = []
    for n in (1, 2, 0):
        acts += st.lost(n, "agent received SIGTERM", signalled_at=1000.0)
    assert len(events(acts, "node_lost")) == 3 and not events(acts, "root_cause")
    assert st.result is not None and st.result.bad_nodes == ()


def test_a_signal_to_one_agent_is_that_nodes_loss_but_not_suspect() -> None:
    st = make(3, min_nodes=2)
    join_all(st)
    st.lost(1, "agent received SIGTERM", signalled_at=1000.0)
    acts = stop_all(st, [0, 2], 0)
    assert events(acts, "root_cause")[0]["error"] == "node lost: agent received SIGTERM"
    assert sorted(sends(acts, "round")) == [0, 2]
    st.lost(2, "connection closed")
    acts = st.workers_stopped(0, 1, [])
    assert sends(acts, "finish")[0].bad_nodes == ("n2",)


def sigterm_failure(node_rank: int) -> dict[str, Any]:
    return {**failure(node_rank, 1000.0, "killed by SIGTERM"), "signal": "SIGTERM"}


def test_a_signal_reaching_the_nodes_apart_is_still_the_steps_stop() -> None:
    """CI: node 1's agent left on Slurm's TERM while node 0's had not got it yet; node 0 stopped its
    (TERM-killed) workers for the coordinator, then left too. That is the step's stop, not node 1 lost."""
    clock = Clock()
    st = make(2, clock=clock)
    join_all(st)
    assert st.left(1, "agent received SIGTERM", signalled_at=1000.0) == []  # held: the others may follow
    acts = st.worker_failed(0, 0, [sigterm_failure(0)])
    acts += st.workers_stopped(0, 0, [])
    clock.t += 0.5
    acts += st.tick() + st.left(0, "agent received SIGTERM", signalled_at=1000.5)
    assert not events(acts, "root_cause") and not events(acts, "restarting")
    # recorded as the step's stop (issue 21): no node was lost
    assert not events(acts, "node_lost") and len(events(acts, "agent_stopped")) == 2
    assert st.result is not None and st.result.bad_nodes == ()


def test_a_worker_killed_by_the_steps_term_before_any_agent_got_it_is_still_the_steps_stop() -> None:
    """A preemption: Slurm's TERM killed node 2's worker first; the round was stopping (and every node had
    stopped its workers) when the agents' own signals came. Settling them one by one must not decide on the
    first: that would name the coordinator's node lost."""
    st = make(3)
    join_all(st)
    acts = st.worker_failed(2, 0, [sigterm_failure(2)])
    assert st.phase is Phase.STOPPING
    acts += stop_all(st, [0, 1, 2], 0)
    for n in (0, 1, 2):
        acts += st.left(n, "agent received SIGTERM", signalled_at=1000.01)
    assert not events(acts, "root_cause") and not events(acts, "restarting")
    assert not events(acts, "node_lost") and len(events(acts, "agent_stopped")) == 3
    assert st.result is not None and st.result.bad_nodes == ()


def test_a_signal_to_one_agent_counts_as_its_loss_once_the_others_did_not_follow() -> None:
    clock = Clock()
    st = make(3, min_nodes=2, clock=clock)
    join_all(st)
    st.left(1, "agent received SIGTERM", signalled_at=1000.0)
    clock.t += SIGNAL_SETTLE_S - 0.1
    assert st.tick() == [] and st.phase is Phase.RUNNING
    clock.t += 0.1
    acts = st.tick()
    assert [e["node_rank"] for e in events(acts, "node_lost")] == [1]
    assert sorted(sends(acts, "stop")) == [0, 2]
    acts = stop_all(st, [0, 2], 0)
    assert events(acts, "root_cause")[0]["error"] == "node lost: agent received SIGTERM"
    assert sorted(sends(acts, "round")) == [0, 2]


def test_a_worker_that_failed_on_its_own_is_still_the_root_cause_under_a_signal() -> None:
    st = make(2)
    join_all(st)
    st.worker_failed(0, 0, [failure(0, 999.0)])
    acts = st.left(1, "agent received SIGTERM", signalled_at=1000.0)
    acts += st.left(0, "agent received SIGTERM", signalled_at=1000.0)
    assert events(acts, "root_cause")[0]["error"] == "boom"


def test_leave_carries_signalled_over_the_wire() -> None:
    msg = messages.Leave("agent received SIGTERM", signalled_at=1000.5)
    assert messages.Leave.from_wire(msg.wire()) == msg


def test_too_few_nodes_finishes_with_code_4() -> None:
    st = make(2, min_nodes=2)
    join_all(st)
    st.lost(1, "no heartbeat")
    acts = st.workers_stopped(0, 0, [])
    assert sends(acts, "finish")[0].exit_code == 4


def test_exit_barrier_waits_for_every_node() -> None:
    st = make(3)
    join_all(st)
    assert st.workers_done(0, 0) == [] and st.workers_done(2, 0) == []
    finish = sends(st.workers_done(1, 0), "finish")
    assert {f.exit_code for f in finish.values()} == {0}


def test_preemption_stops_everyone_without_using_the_budget() -> None:
    st = make(2)
    join_all(st)
    acts = st.preempt(1, "SIGUSR2")
    assert sorted(sends(acts, "preempt")) == [0, 1]
    finish = sends(stop_all(st, [0, 1], 0), "finish")
    assert finish[0].exit_code == 5 and finish[0].reason == "preempted"
    assert st.restart_count == 0


def test_rendezvous_timeout_names_the_missing_nodes() -> None:
    clock = Clock()
    st = make(3, clock=clock)
    st.join(0, "n0", 1)
    clock.t += 61
    finish = sends(st.tick(), "finish")[0]
    assert finish.exit_code == 4
    assert "1 (n1)" in finish.message and "2 (n2)" in finish.message


def test_rendezvous_timeout_goes_on_with_enough_nodes() -> None:
    clock = Clock()
    st = make(3, min_nodes=2, clock=clock)
    st.join(0, "n0", 1)
    st.join(1, "n1", 1)
    clock.t += 61
    assert sorted(sends(st.tick(), "round")) == [0, 1]


def test_an_agent_that_never_stops_is_dropped() -> None:
    clock = Clock()
    st = make(3, min_nodes=2, clock=clock)
    join_all(st)
    st.worker_failed(0, 0, [failure(0, 1.0)])
    stop_all(st, [0, 1], 0)
    clock.t += st.stop_timeout + 1
    acts = st.tick()
    assert events(acts, "node_lost")[0]["node_rank"] == 2
    assert sorted(sends(acts, "round")) == [0, 1]


def test_late_or_duplicate_joiners_are_refused() -> None:
    st = make(2)
    st.join(0, "n0", 1)
    assert "already joined" in (st.join_error(0) or "")
    assert "outside" in (st.join_error(5) or "")
    st.join(1, "n1", 1)
    st.lost(1, "gone")
    assert "after the job started" in (st.join_error(1) or "")


def test_coordinator_node_unhealthy_ends_the_attempt() -> None:
    st = make(3, min_nodes=2)
    join_all(st)
    st.lost(0, "node unhealthy: Xid 79", unhealthy=True)
    finish = sends(stop_all(st, [1, 2], 0), "finish")
    assert finish[1].exit_code == 7 and finish[1].bad_nodes == ("n0",)


def test_phases_are_an_enum_and_the_end_is_a_reason() -> None:
    st = make(2, max_restarts=0)
    assert st.phase is Phase.RENDEZVOUS
    join_all(st)
    assert st.phase is Phase.RUNNING
    acts = st.worker_failed(0, 0, [failure(0, 1.0)])
    assert st.phase is Phase.STOPPING
    assert {m.reason for m in sends(acts, "stop").values()} == {RestartCause.WORKER_FAILED}
    stop_all(st, [0, 1], 0)
    assert st.phase is Phase.FINISHED
    assert st.result == messages.Finish(Reason.RESTARTS_EXHAUSTED, "the job-wide restart budget (0) is spent")
    assert messages.encode(st.result)["exit_code"] == Reason.RESTARTS_EXHAUSTED.exit_code
