"""The coordinator's hang decisions: every node stalled -> stacks -> localization -> root cause -> restart."""

from __future__ import annotations

from typing import Any

from hpcelastic.agent import messages
from hpcelastic.agent.hangwatch import fit, sample_interval
from hpcelastic.agent.job_state import STACKS_TIMEOUT, JobState, SaveStacks, Say
from hpcelastic.hangs.stacks import stack_from_json
from tests.unit.test_job_state import Clock, events, join_all, make, sends, stop_all


def frame(function: str, filename: str, line: int, native: bool = False) -> dict[str, Any]:
    return {"function": function, "filename": filename, "line": line, "native": native}


def stack(pid: int, frames: list[dict[str, Any]], local_rank: int) -> dict[str, Any]:
    thread = {"thread_id": 1, "name": "MainThread", "os_thread_id": pid, "frames": frames}
    return {
        "pid": pid,
        "state": "S",
        "native": True,
        "error": None,
        "threads": [thread],
        "local_rank": local_rank,
    }


WAITING = [
    frame("all_gather", "/v/site-packages/torch/distributed/distributed_c10d.py", 3000),
    frame("main", "/job/train.py", 88),
    frame("<module>", "/job/train.py", 120),
]
SLEEPING = [frame("main", "/job/train.py", 77), frame("<module>", "/job/train.py", 120)]


def stalled(st: JobState, node: int, round_: int = 0, yes: bool = True) -> list[Any]:
    return st.stall_report(node, messages.StallReport(round_, yes, (2 * node, 2 * node + 1), 12.0))


def node_stacks(node: int, hung_rank: int | None) -> messages.StacksReport:
    doc = {}
    for local in range(2):
        rank = 2 * node + local
        doc[str(rank)] = stack(100 + rank, SLEEPING if rank == hung_rank else WAITING, local)
    return messages.StacksReport(0, doc)


def test_hang_needs_every_node_stalled_then_names_the_odd_rank_and_restarts() -> None:
    st = make(3)
    join_all(st)
    assert stalled(st, 0) == [] and stalled(st, 1) == []
    # Node 1 moves again (a long checkpoint save ended): no hang while node 2 reports.
    assert stalled(st, 1, yes=False) == []
    assert stalled(st, 2) == []
    asked = stalled(st, 1)
    assert set(sends(asked, "dump_stacks")) == {0, 1, 2}
    assert any(isinstance(a, Say) and "hang" in a.text for a in asked)
    assert st.stacks_report(0, node_stacks(0, None)) == []
    assert st.stacks_report(1, node_stacks(1, None)) == []
    declared = st.stacks_report(2, node_stacks(2, 5))
    saved = [a for a in declared if isinstance(a, SaveStacks)]
    assert len(saved) == 1 and saved[0].localization.root_ranks == (5,) and len(saved[0].stacks) == 6
    assert saved[0].info[5] == {"node_rank": 2, "node": "n2", "local_rank": 1}
    failed = events(declared, "worker_failed")
    assert [f["rank"] for f in failed] == [5]
    assert failed[0]["error"].startswith("stalled: hung at /job/train.py:77 in main; no progress for 12 s")
    assert set(sends(declared, "stop")) == {0, 1, 2}
    after = stop_all(st, [0, 1, 2], 0)
    cause = events(after, "root_cause")
    assert cause[0]["rank"] == 5 and cause[0]["node"] == "n2" and "train.py:77" in cause[0]["error"]
    assert "line 77, in main" in cause[0]["traceback"]
    assert sends(after, "round")  # restarted as for any failure
    # Round 1 can hang again.
    for n in range(3):
        stalled(st, n, round_=1)
    assert st.hang is not None and st.hang.round == 1


def test_stale_round_reports_are_ignored_and_missing_stacks_time_out() -> None:
    clock = Clock()
    st = make(2, clock=clock)
    join_all(st)
    assert stalled(st, 0, round_=7) == [] and stalled(st, 1, round_=7) == []
    stalled(st, 0)
    assert sends(stalled(st, 1), "dump_stacks")
    st.stacks_report(0, node_stacks(0, 1))
    assert st.tick() == []
    clock.t += STACKS_TIMEOUT + 1
    declared = st.tick()
    assert [f["rank"] for f in events(declared, "worker_failed")] == [1]
    assert st.tick() == []  # declared once


def test_undetermined_hang_still_restarts() -> None:
    st = make(2)
    join_all(st)
    stalled(st, 0)
    stalled(st, 1)
    st.stacks_report(0, node_stacks(0, None))
    declared = st.stacks_report(1, node_stacks(1, None))
    failed = events(declared, "worker_failed")
    assert failed[0]["rank"] is None and "not localized" in failed[0]["error"]
    assert sends(declared, "stop")


def test_a_hang_only_the_nodes_pings_explain_names_the_cut_off_node() -> None:
    """Issue 19: node 3 reaches the coordinator but not nodes 1 and 2; every rank waits in the same
    collective, so only the pings taken with the stacks can name it (counted both ways)."""
    st = make(4)
    join_all(st)
    for n in range(4):
        asked = stalled(st, n)
    assert set(sends(asked, "dump_stacks")) == {0, 1, 2, 3}
    cut_off = {0: (), 1: (3,), 2: (3,), 3: (1, 2)}
    declared: list[Any] = []
    for n in range(4):
        report = node_stacks(n, None)
        declared = st.stacks_report(n, messages.StacksReport(0, report.stacks, cut_off[n]))
    (saved,) = [a for a in declared if isinstance(a, SaveStacks)]
    assert saved.localization.method == "network" and saved.localization.root_ranks == (6, 7)
    failed = events(declared, "worker_failed")
    assert [(f["rank"], f["node"]) for f in failed] == [(6, "n3"), (7, "n3")]
    assert "node rank(s) 3" in failed[0]["error"]


def test_pings_that_all_failed_once_name_nobody() -> None:
    """One lost ping pair is no partition: at least two failed pings are needed to name a node."""
    st = make(2)
    join_all(st)
    stalled(st, 0)
    stalled(st, 1)
    st.stacks_report(0, messages.StacksReport(0, node_stacks(0, None).stacks, (1,)))
    declared = st.stacks_report(1, node_stacks(1, None))
    (saved,) = [a for a in declared if isinstance(a, SaveStacks)]
    assert saved.localization.method == "undetermined"


def test_messages_round_trip() -> None:
    report = messages.StallReport(3, True, (1, 2), 9.5)
    assert messages.decode(messages.FROM_AGENT, messages.encode(report)) == report
    stacks = messages.StacksReport(3, {"1": {"pid": 1}}, (4, 5))
    assert messages.decode(messages.FROM_AGENT, messages.encode(stacks)) == stacks
    dump = messages.DumpStacks(3, ((1, "198.18.0.1", 4000),))
    assert messages.decode(messages.FROM_COORDINATOR, messages.encode(dump)) == dump
    stacks = node_stacks(0, 1)
    back = messages.decode(messages.FROM_AGENT, messages.encode(stacks))
    assert isinstance(back, messages.StacksReport) and back.stacks == stacks.stacks
    dump = messages.DumpStacks(4)
    assert messages.decode(messages.FROM_COORDINATOR, messages.encode(dump)) == dump


def test_stack_json_round_trip_and_report_fits_a_frame() -> None:
    doc = stack(7, WAITING + [frame("0x7f", "libc.so", 0, native=True)], 0)
    parsed = stack_from_json(doc)
    assert stack_from_json(parsed.to_json()) == parsed and parsed.extra == {"local_rank": 0}
    assert [f.native for f in parsed.main.frames] == [False, False, False, True]
    big = {
        str(r): stack(r, WAITING + [frame(f"n{i}" * 50, "lib.so", 0, True) for i in range(3000)], 0)
        for r in range(8)
    }
    small = fit(big)
    assert all(not f["native"] for r in small.values() for t in r["threads"] for f in t["frames"])


def test_sample_interval_is_at_least_two_seconds() -> None:
    assert sample_interval(4) == 2.0 and sample_interval(60) == 12.0
