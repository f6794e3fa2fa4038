"""The control-plane load benchmark's harness, at a small size: it must still drive every phase correctly.

Runs the real coordinator process and 16 simulated agents (real sockets, real authentication) through
a rendezvous, a restart after a worker failure, a closed connection and a silent agent; asserts on
what the agents received and on the run directory's events, never on times. With the coordinator's
cap of unauthenticated connections lowered to 2, the agents (simulated, and the real client) must
connect again when their connection brings no challenge, and all join.
"""

from __future__ import annotations

from bench.control_plane_load import run_hpcelastic, run_real_clients


def test_harness_runs_a_round_a_restart_and_both_losses() -> None:
    out = run_hpcelastic(16, procs=2, hb_interval=0.1, hb_timeout=0.5, idle_s=0.2)
    assert out["problems"] == []
    assert out["lost_events"][0][0] == 8 and "connection closed" in out["lost_events"][0][1]
    assert out["lost_events"][1][0] == 5 and "no heartbeat" in out["lost_events"][1][1]
    assert out["final"]["result"]["reason"] == "succeeded"
    assert out["final"]["round"] == 3
    assert sorted(out["final"]["result"]["bad_nodes"]) == ["sim5", "sim8"]
    for key in ("joined_s", "rendezvous_s", "restart_s", "stop_s", "lost_closed_s", "lost_silent_s"):
        assert out[key] is not None and out[key] >= 0
    assert out["hb_per_s"] > 0


def test_simulated_agents_join_past_the_cap_of_unauthenticated_connections() -> None:
    out = run_hpcelastic(16, procs=2, hb_interval=0.1, hb_timeout=0.5, idle_s=0.1, max_preauth=2)
    assert out["problems"] == []
    assert out["final"]["round"] == 3


def test_real_clients_join_past_the_cap_of_unauthenticated_connections() -> None:
    out = run_real_clients(16, procs=2, max_preauth=2)
    assert out["errors"] == []
    assert out["joined"] == 16 and out["seconds"] is not None
