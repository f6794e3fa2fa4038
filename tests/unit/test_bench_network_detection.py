"""bench/network_detection.py's pure part: node logs to spurious losses and detection times."""

from __future__ import annotations

from typing import Any

import pytest

from bench.network_detection import CUT_S, SOAK_AGENTS, STARVED_WINDOW, SUBJECT, summarize_group, table


def rec(kind: str, mode: str, agent: int, t: float, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "mode": mode, "agent": agent, "t": t, **fields}


GROUP = {
    "setting": "loss 5%",
    "soak": [1000.0, 1000.0 + 3600.0 / SOAK_AGENTS],  # one agent-hour
    "trials": [{"kind": "cut", "t0": 1100.0}, {"kind": "kill", "t0": 1200.0}, {"kind": "cut", "t0": 1300.0}],
}


def test_spurious_losses_count_soak_agents_inside_the_soak_only_and_trials_time_the_subject() -> None:
    coordinator = [
        rec("lost", "old", 0, 1501.0, at=1500.0, reason="no heartbeat"),  # spurious: counted
        rec("lost", "old", 1, 999.0, at=999.0),  # before the soak
        rec("lost", "old", SUBJECT, 1500.0, at=1500.0),  # the subject is no soak agent
        # trials: old 2 s after the cut, new 3.8 s; the kill 0.01 s; the second cut seen by old only
        rec("lost", "old", SUBJECT, 1102.0, at=1102.0),
        rec("lost", "new", SUBJECT, 1103.8, at=1103.8),
        rec("lost", "old", SUBJECT, 1200.01, at=1200.01),
        rec("lost", "new", SUBJECT, 1200.01, at=1200.01),
        rec("lost", "old", SUBJECT, 1301.5, at=1301.5),
        rec("lost", "new", SUBJECT, 1300.0 + CUT_S + 5, at=1300.0 + CUT_S + 5),  # too late: missed
    ]
    agents = {
        0: [rec("joined", "new", 0, 1001.0), rec("fenced", "new", 0, 1600.0, reason="lease")],
        SUBJECT: [rec("fenced", "old", SUBJECT, 1101.5), rec("fenced", "new", SUBJECT, 1103.5)],
    }
    s = summarize_group(GROUP, coordinator, agents, stalls=[1500.0 - STARVED_WINDOW - 1, 1499.0])
    assert s["agent_hours"] == pytest.approx(1.0)
    assert (s["old"]["spurious_lost"], s["old"]["spurious_fenced"]) == (1, 0)
    assert (s["new"]["spurious_lost"], s["new"]["spurious_fenced"]) == (0, 1)
    assert s["old"]["lost_per_hour"] == pytest.approx(1.0)
    assert s["old"]["spurious_starved"] == 1, "the loss 1 s after a CPU stall is the machine's"
    assert [r["starved"] for r in s["new"]["spurious"]] == [False], "the fence at 1600 follows no stall"
    assert s["old"]["cut_s"] == pytest.approx([2.0, 1.5]) and s["old"]["kill_s"] == pytest.approx([0.01])
    assert s["new"]["cut_s"] == pytest.approx([3.8]) and s["new"]["missed_trials"] == ["new cut at 00:21:40"]
    assert s["old"]["fence_s"] == pytest.approx([1.5]) and s["new"]["fence_s"] == pytest.approx([3.5])
    assert s["old"]["fence_lag"] == pytest.approx([-0.5]) and s["new"]["fence_lag"] == pytest.approx([-0.3])
    assert s["old"]["spurious_silent"] == 1, "its reason says the coordinator saw silence"
    s["timing"] = {"heartbeat_interval": 0.5, "heartbeat_timeout": 2.0, "probe_timeout": 2.0}
    text = table([s])
    assert (
        "| loss 5% | new (2+2 s, hb 0.5 s) |" in text
        and "3.80 (3.80-3.80, n=1)" in text
        and "| -0.30 |" in text
    )
