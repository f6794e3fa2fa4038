"""Hot spares: the coordinator runs a fixed world and promotes a spare in a lost node's place."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from hpcelastic.agent import messages
from hpcelastic.agent.bootstrap import node_range, round_size
from hpcelastic.agent.job_state import JobState, Phase
from hpcelastic.agent.spec import AgentSpec
from hpcelastic.env.base import NodeContext
from hpcelastic.errors import UserError
from hpcelastic.reasons import Reason
from tests.unit.test_job_state import events, sends


def make(n: int, round_size: int, min_nodes: int) -> JobState:
    ports = itertools.count(40000)
    return JobState(
        hosts=[f"n{i}" for i in range(n)],
        min_nodes=min_nodes,
        max_restarts=3,
        master_addr="n0",
        new_port=lambda: next(ports),
        rdzv_timeout=60,
        round_size=round_size,
    )


def start(st: JobState) -> dict[int, messages.Message]:
    out = []
    for i in range(len(st.hosts)):
        out += st.join(i, f"n{i}", 2)
    return sends(out, "round")


def test_spare_gets_no_round_until_a_node_is_lost_then_takes_its_place() -> None:
    st = make(3, round_size=2, min_nodes=2)
    first = start(st)
    assert sorted(first) == [0, 1] and first[0].world_size == 4
    out = st.lost(1, "connection closed")
    out += st.workers_stopped(0, 0, [])
    second = sends(out, "round")
    assert sorted(second) == [0, 2]
    assert second[2].group_rank == 1 and second[2].rank_offset == 2 and second[2].world_size == 4
    (rdzv,) = events(out, "rendezvous")
    assert rdzv["hosts"] == ["n0", "n2"] and rdzv["world_size"] == 4


def test_a_spare_lost_changes_nothing_and_success_ignores_spares() -> None:
    st = make(3, round_size=2, min_nodes=2)
    start(st)
    assert sends(st.lost(2, "gone"), "stop") == {}
    st.workers_done(0, 0)
    out = st.workers_done(1, 0)
    assert st.phase is Phase.FINISHED and st.result is not None and st.result.reason is Reason.SUCCEEDED
    assert sorted(sends(out, "finish")) == [0, 1]


def test_no_spare_left_below_min_ends_with_too_few_nodes() -> None:
    st = make(3, round_size=2, min_nodes=2)
    start(st)
    st.lost(2, "gone")
    out = st.lost(1, "gone") + st.workers_stopped(0, 0, [])
    assert st.result is not None and st.result.reason is Reason.TOO_FEW_NODES, out


def test_spares_then_min_max_shrinks_the_world_after_spares_are_spent() -> None:
    st = make(4, round_size=3, min_nodes=2)  # --nodes 2:3 --spare-nodes 1 on 4 nodes
    assert sorted(start(st)) == [0, 1, 2]
    out = st.lost(1, "gone") + st.workers_stopped(0, 0, []) + st.workers_stopped(2, 0, [])
    assert sorted(sends(out, "round")) == [0, 2, 3]
    out = st.lost(3, "gone") + st.workers_stopped(0, 1, []) + st.workers_stopped(2, 1, [])
    rnd = sends(out, "round")
    assert sorted(rnd) == [0, 2] and rnd[0].world_size == 4


def ctx(n: int) -> NodeContext:
    return NodeContext("local", 0, n, tuple(f"n{i}" for i in range(n)), None, 0)


def test_round_size_and_step_checks_count_the_spares() -> None:
    spec = AgentSpec(argv=("x",), min_nodes=2, max_nodes=2, spare_nodes=1)
    assert node_range(spec, ctx(3)) == (2, 2) and round_size(spec, ctx(3)) == 2
    elastic = AgentSpec(argv=("x",), min_nodes=2, max_nodes=3, spare_nodes=1)
    assert round_size(elastic, ctx(3)) == 2 and round_size(elastic, ctx(4)) == 3
    assert round_size(AgentSpec(argv=("x",), spare_nodes=1), ctx(3)) == 2
    with pytest.raises(UserError, match="at most 2"):
        node_range(spec, ctx(4))


def test_submit_allocates_n_plus_k_and_passes_spares_to_the_agent(tmp_path: Path) -> None:
    from hpcelastic.jobs.render import render
    from tests.unit.test_render import directives, make_spec

    spec = make_spec(tmp_path, "default", {"spare_nodes": 1}, nodes="2:3")
    text = render(spec).script_text
    assert "--nodes=3-4" in directives(text)
    assert "--nodes 2:3 --spare-nodes 1 " in text


def test_a_node_that_fails_its_health_check_is_replaced_by_a_spare() -> None:
    st = make(3, round_size=2, min_nodes=2)
    start(st)
    out = st.lost(1, "node unhealthy: GPU 0 lost", unhealthy=True) + st.workers_stopped(0, 0, [])
    rnd = sends(out, "round")
    assert sorted(rnd) == [0, 2] and rnd[0].world_size == 4
    assert st.bad_nodes == ["n1"]
