"""Decisions on the whole job's evidence (issue 18, items 1-3 and 12): progress, start-up failures,
evidence against a node. Each case failed on the code before: two node losses or OOM kills on two hosts
read as one start-up failure, a self-checkpointing job abandoned at its third time limit, a coordinator
cut off for seconds excluding every healthy node, a broken import restarting until the budget was spent."""

from __future__ import annotations

import os
import time
import zipfile
from pathlib import Path

from hpcelastic import events
from hpcelastic.agent import messages
from hpcelastic.agent.job_state import JobState, Phase, Send
from hpcelastic.events import EventLog
from hpcelastic.lifecycle.evidence import new_checkpoint
from hpcelastic.lifecycle.history import History, root_cause_signature
from hpcelastic.lifecycle.policy import Action, AttemptEnd, Capacity, Settings, decide
from hpcelastic.reasons import Reason, SkipReason

HOUR = 3600.0


def _log(*records: dict) -> EventLog:
    return EventLog([{"ts": r.pop("ts", 0.0), **r} for r in records])


def _node_lost(host: str) -> dict:
    return {"round": 0, "node_rank": 1, "node": host, "error": "node lost: no heartbeat for 2.0 s"}


def _attempt(
    k: int, t0: float, *, steps: tuple[int, ...] = (), ended: dict | None = None, ran: float = 2 * HOUR
) -> list[dict]:
    """The events of attempt ``k``: started at ``t0``, workers up 10 s later, ``steps`` as progress marks,
    ended ``ran`` seconds after ``t0``."""
    out = [
        {"ts": t0, "event": "attempt_started", "attempt": k, "job_id": "7"},
        {"ts": t0 + 10, "event": "workers_started", "round": 0, "spawned_ts": t0 + 10},
    ]
    out += [
        {"ts": t0 + 20 + i, "event": "progress", "attempt": k, "round": 0, "step": s}
        for i, s in enumerate(steps)
    ]
    if ended is not None:
        out.append({"ts": t0 + ran, "event": "attempt_ended", "attempt": k, **ended})
    return out


# ---- item 1: progress is any rank's step; a signature tells hosts and kinds apart ----------------------
def test_two_node_losses_on_two_hosts_after_hours_of_training_are_requeued() -> None:
    sig0, sig1 = root_cause_signature(_node_lost("node2")), root_cause_signature(_node_lost("node3"))
    assert sig0 != sig1
    log = _log(
        *_attempt(0, 0.0, ended={"reason": "too_few_nodes", "signature": sig0, "progressed": False}),
        *_attempt(1, 3 * HOUR),
    )
    history = History.from_log(log, 1, cancelled=False, now=5 * HOUR)
    d = decide(history, AttemptEnd(1, Reason.TOO_FEW_NODES, 4, "7", signature=sig1), Settings(max_requeues=3))
    assert d.action is Action.BRING_BACK and d.progressed


def test_the_same_host_lost_twice_before_any_step_still_matches_but_trained_attempts_do_not() -> None:
    sig = root_cause_signature(_node_lost("node2"))
    assert sig == root_cause_signature(_node_lost("node2"))
    # An unchanged script sends no heartbeats: two hours of workers running is progress all the same.
    log = _log(
        *_attempt(0, 0.0, ended={"reason": "too_few_nodes", "signature": sig}),
        *_attempt(1, 3 * HOUR),
    )
    history = History.from_log(log, 1, cancelled=False, now=5 * HOUR)
    assert history.previous is not None and history.previous.progressed
    d = decide(history, AttemptEnd(1, Reason.TOO_FEW_NODES, 4, "7", signature=sig), Settings(max_requeues=3))
    assert d.action is Action.BRING_BACK


def test_oom_kills_on_two_hosts_differ_and_one_import_error_on_two_hosts_matches() -> None:
    def kill(host: str) -> dict:
        return {"rank": 0, "node": host, "signal": "SIGKILL", "exitcode": None, "error": "killed by SIGKILL"}

    assert root_cause_signature(kill("node1")) != root_cause_signature(kill("node2"))
    tb = 'Traceback (most recent call last):\n  File "/w/t.py", line 3, in <module>\nModuleNotFoundError: x'
    err = {"rank": 0, "exitcode": 1, "error": "exited with code 1", "traceback": tb}
    assert root_cause_signature({**err, "node": "node1"}) == root_cause_signature(
        {**err, "rank": 5, "node": "n7"}
    )
    other = tb.replace("<module>", "load_data")
    assert root_cause_signature({**err, "traceback": other}) != root_cause_signature(err)


def test_progress_reported_by_any_rank_counts_not_only_the_deciders() -> None:
    log = _log(*_attempt(0, 0.0, steps=(1, 40)))
    history = History.from_log(log, 0, cancelled=False, now=60.0)
    d = decide(history, AttemptEnd(0, Reason.COORDINATOR_LOST, 6, "7", progressed=False), Settings())
    assert d.progressed and d.progress == "reached step 40"


def test_a_failure_before_any_progress_twice_is_a_startup_failure() -> None:
    sig = "same"
    log = _log(
        *_attempt(
            0, 0.0, ended={"reason": "restarts_exhausted", "signature": sig, "progressed": False}, ran=30
        ),
        *_attempt(1, 100.0),
    )
    history = History.from_log(log, 1, cancelled=False, now=160.0)
    d = decide(history, AttemptEnd(1, Reason.RESTARTS_EXHAUSTED, 3, "7", signature=sig), Settings())
    assert (d.action, d.skip) == (Action.SKIP, SkipReason.STARTUP_FAILURE)


# ---- item 2: three time limits of a job that checkpoints on its own ------------------------------------
def _stops(checkpoints: tuple[bool, ...], steps: tuple[tuple[int, ...], ...] = ()) -> Action:
    """The decision at the time limit of the last of ``len(checkpoints)`` daily attempts, each stopped by
    its time limit, with a checkpoint found in the directory or not, and the steps it reached."""
    last = len(checkpoints) - 1
    steps = steps or ((),) * len(checkpoints)
    records: list[dict] = []
    for k in range(last):
        found = f"step-{k}.pt" if checkpoints[k] else None
        ended = {"reason": "time_limit", "progress": f"wrote checkpoint {found}" if found else None}
        records += _attempt(k, k * 24 * HOUR, steps=steps[k], ended=ended)
    records += _attempt(last, last * 24 * HOUR, steps=steps[last])
    history = History.from_log(_log(*records), last, cancelled=False, now=(last + 1) * 24 * HOUR)
    found = f"step-{last}.pt" if checkpoints[last] else None
    end = AttemptEnd(last, Reason.TIME_LIMIT, 5, "7", new_checkpoint=found)
    return decide(history, end, Settings()).action


def test_a_self_checkpointing_job_is_requeued_at_its_third_time_limit() -> None:
    assert _stops((True, True, True)) is Action.BRING_BACK


def test_steps_beyond_the_earlier_attempts_are_progress_the_same_steps_again_are_not() -> None:
    assert _stops((False, False, False), ((0, 340), (340, 540), (540, 700))) is Action.BRING_BACK
    same = ((0, 340),) * 4
    assert _stops((False,) * 3, same[:3]) is Action.BRING_BACK  # attempt 0 got to step 340 first
    assert _stops((False,) * 4, same) is Action.SKIP  # then three stops in a row that added nothing
    assert _stops((False, False, False)) is Action.SKIP


def test_new_checkpoint_finds_complete_files_and_dcp_directories_only(tmp_path: Path) -> None:
    since = time.time() - 5
    old = tmp_path / "old.pt"
    old.write_bytes(b"x")
    os.utime(old, (since - 100, since - 100))
    assert new_checkpoint(tmp_path, since) is None
    torn = tmp_path / "torn.pt"
    with zipfile.ZipFile(torn, "w") as z:
        z.writestr("data.pkl", b"0" * 1000)
    torn.write_bytes(torn.read_bytes()[:-40])  # a save killed before the zip's end record
    (tmp_path / "step-9.pt.tmp").write_bytes(b"partial")
    dcp = tmp_path / "dcp-step-8"
    dcp.mkdir()
    (dcp / "__0_0.distcp").write_bytes(b"shard")
    assert new_checkpoint(tmp_path, since) is None  # DCP directory without its .metadata: not complete
    (dcp / ".metadata").write_bytes(b"meta")
    assert new_checkpoint(tmp_path, since) == "dcp-step-8"
    good = tmp_path / "sub" / "step-10.pt"
    good.parent.mkdir()
    with zipfile.ZipFile(good, "w") as z:
        z.writestr("data.pkl", b"1")
    os.utime(good, (time.time() + 1, time.time() + 1))
    assert new_checkpoint(tmp_path, since) == "sub/step-10.pt"
    assert new_checkpoint(tmp_path / "missing", since) is None


# ---- item 3: suspect yourself first; never exclude the job off its partition --------------------------
def _job(nodes: int, clock: list[float]) -> JobState:
    state = JobState(
        hosts=[f"n{i}" for i in range(nodes)],
        min_nodes=1,
        max_restarts=3,
        master_addr="10.0.0.1",
        new_port=lambda: 29500,
        rdzv_timeout=60,
        now=lambda: clock[0],
    )
    for i in range(nodes):
        state.join(i, f"n{i}", 2)
    assert state.phase is Phase.RUNNING
    return state


def _finish(actions: list) -> messages.Finish:
    return next(a.message for a in actions if isinstance(a, Send) and isinstance(a.message, messages.Finish))


def test_a_coordinator_cut_off_from_most_nodes_excludes_none_of_them() -> None:
    clock = [100.0]
    state = _job(8, clock)
    actions: list = []
    for n in range(1, 8):
        clock[0] += 0.05
        actions += state.lost(n, "no heartbeat for 2.0 s (node hung or unreachable)")
    clock[0] += 1
    actions += state.workers_stopped(0, 0, [])
    assert state.phase is Phase.RENDEZVOUS or state.phase is Phase.RUNNING or state.result is not None
    assert state.suspects() == []
    assert any("own network" in getattr(a, "text", "") for a in actions)


def test_one_node_lost_alone_is_still_held_against_it() -> None:
    clock = [100.0]
    state = _job(4, clock)
    state.lost(3, "connection reset")
    clock[0] += 30
    state.lost(2, "connection reset")
    assert state.suspects() == ["n3", "n2"]
    state2 = _job(4, [100.0])
    state2.lost(3, "connection reset")
    state2.lost(2, "connection reset")  # 2 of 3 others at once: more than half
    assert state2.suspects() == []


def test_exclusions_never_leave_the_job_unschedulable() -> None:
    history = History(1, bad_nodes=("n1", "n2"))
    cap = Capacity(frozenset({"n0", "n1", "n2", "n3", "n4"}), needed=3)
    end = AttemptEnd(1, Reason.NODE_UNHEALTHY, 7, "7", bad_nodes=("n3",), capacity=cap)
    d = decide(history, end, Settings(max_requeues=5))
    assert d.exclude == ("n2", "n3") and "n1" in d.release
    down = Capacity(frozenset({"n0", "n2", "n3"}), needed=3)  # n1 is drained: excluding it costs nothing
    d = decide(history, AttemptEnd(1, Reason.NODE_UNHEALTHY, 7, "7", capacity=down), Settings(max_requeues=5))
    assert d.exclude == ("n1",)


# ---- item 12: a deterministic start-up error does not spend the whole restart budget -------------------
def test_the_same_startup_error_in_two_rounds_stops_the_restarts() -> None:
    clock = [100.0]
    state = _job(2, clock)
    tb = 'Traceback (most recent call last):\n  File "/w/t.py", line 1, in <module>\nModuleNotFoundError: no'
    failure = {"rank": 0, "local_rank": 0, "exitcode": 1, "signal": None, "error": "exited with code 1"}
    for rnd in range(2):
        state.started_workers(0, rnd, clock[0])
        state.started_workers(1, rnd, clock[0])
        clock[0] += 2
        state.worker_failed(0, rnd, [{**failure, "round": rnd, "traceback": tb, "ts": clock[0]}])
        state.workers_stopped(0, rnd, [])
        actions = state.workers_stopped(1, rnd, [])
    assert state.restart_count == 1
    assert _finish(actions).reason is Reason.STARTUP_FAILURE


def _first_round_failures(state: JobState, clock: list[float], nodes: dict[int, list[int]], tb: str) -> list:
    """Round 0's workers start; ``nodes``' ranks (node rank -> global ranks) fail at once with ``tb``."""
    failure = {"local_rank": 0, "exitcode": 2, "signal": None, "error": "exited with code 2"}
    for n in range(2):
        state.started_workers(n, 0, clock[0])
    clock[0] += 1
    actions: list = []
    for n in range(2):
        failed = [
            {**failure, "rank": r, "round": 0, "traceback": tb, "ts": clock[0]} for r in nodes.get(n, [])
        ]
        actions += state.worker_failed(n, 0, failed) if failed else []
    for n in range(2):
        actions += state.workers_stopped(n, 0, [])
    return actions


def test_a_usage_error_on_every_rank_of_the_first_round_ends_the_attempt_at_once() -> None:
    """Issue 31: the script rejects its arguments on every rank before any step: no restart, one end with
    the error; the same error on one node's ranks only (that node's trouble) is restarted as before."""
    usage = "usage: train.py [-h] --data DATA\ntrain.py: error: unrecognized arguments: --nodes 2"
    clock = [100.0]
    state = _job(2, clock)  # two nodes, two workers each
    actions = _first_round_failures(state, clock, {0: [0, 1], 1: [2, 3]}, usage)
    assert state.restart_count == 0
    finish = _finish(actions)
    assert finish.reason is Reason.STARTUP_FAILURE and "every rank" in finish.message, finish
    clock = [100.0]
    state = _job(2, clock)
    _first_round_failures(state, clock, {1: [2, 3]}, usage)
    assert state.restart_count == 1 and state.result is None


def test_the_same_error_after_a_step_or_a_signal_keeps_restarting() -> None:
    for kind in ("step", "signal"):
        clock = [100.0]
        state = _job(2, clock)
        failure = {"rank": 0, "local_rank": 0, "exitcode": 1, "signal": None, "error": "exited with code 1"}
        if kind == "signal":
            failure = {**failure, "exitcode": None, "signal": "SIGKILL", "error": "killed by SIGKILL"}
        for rnd in range(2):
            state.started_workers(0, rnd, clock[0])
            state.started_workers(1, rnd, clock[0])
            if kind == "step":
                state.progress(0, rnd, 5, clock[0] + 1, 2)
            clock[0] += 2
            state.worker_failed(0, rnd, [{**failure, "round": rnd, "traceback": "", "ts": clock[0]}])
            state.workers_stopped(0, rnd, [])
            state.workers_stopped(1, rnd, [])
        assert state.restart_count == 2 and state.result is None, kind


def test_events_record_why_an_attempt_advanced() -> None:
    ev = events.attempt_ended(
        attempt=0, reason=Reason.TIME_LIMIT, exit_code=5, signature=None, progressed=True, progress="x"
    )
    assert ev.fields["progress"] == "x"


def test_a_startup_failure_after_the_attempt_progressed_is_requeued_within_the_budget() -> None:
    """Simulated week 471: the same error at the start of two late rounds of an attempt that had saved
    checkpoints earlier was read as a start-up failure and the job was abandoned."""
    end = AttemptEnd(3, Reason.STARTUP_FAILURE, 8, "7", new_checkpoint="step-900.pt")
    d = decide(History(3), end, Settings(max_requeues=2))
    assert d.action is Action.BRING_BACK
    clock = [100.0]
    state = _job(2, clock)
    failure = {"rank": 0, "local_rank": 0, "exitcode": 1, "signal": None, "error": "exited with code 1"}
    state.progress(0, 0, 7, clock[0], 2)  # round 0 trained
    for rnd in range(3):
        state.started_workers(0, rnd, clock[0])
        state.started_workers(1, rnd, clock[0])
        clock[0] += 2
        state.worker_failed(0, rnd, [{**failure, "round": rnd, "traceback": "", "ts": clock[0]}])
        state.workers_stopped(0, rnd, [])
        state.workers_stopped(1, rnd, [])
    assert state.restart_count == 3 and state.result is None  # three identical failures, still restarting


def test_no_round_starts_while_a_silent_nodes_workers_may_still_run() -> None:
    """Simulated weeks 154, 973, 2079: a node cut off went silent, the survivors' next round started at
    once, and the cut-off node's workers of the old round lived on until its agent noticed."""
    clock = [100.0]
    state = JobState(
        hosts=["n0", "n1", "n2"],
        min_nodes=2,
        max_restarts=3,
        master_addr="10.0.0.1",
        new_port=lambda: 29500,
        rdzv_timeout=60,
        now=lambda: clock[0],
        fence_s=5.5,
    )
    for i in range(3):
        state.join(i, f"n{i}", 2)
    state.lost(2, "no heartbeat for 2.0 s (node hung or unreachable)", silent=True)
    clock[0] += 1.0
    state.workers_stopped(0, 0, [])
    actions = state.workers_stopped(1, 0, [])
    assert state.round == 0 and state.round_due and any("fence" in getattr(a, "text", "") for a in actions)
    clock[0] += 4.0
    assert state.tick() == [] and state.round == 0
    clock[0] += 0.6
    rounds = [a for a in state.tick() if isinstance(a, Send) and isinstance(a.message, messages.Round)]
    assert state.round == 1 and {a.node_rank for a in rounds} == {0, 1} and state.restart_count == 1
    # A node whose connection closed (its agent died, its watchdog killed the workers) is not waited for.
    state.lost(1, "connection reset")
    state.workers_stopped(0, 1, [])
    assert state.round == 2 or state.result is not None


def test_a_node_lost_by_silence_is_marked_unreachable_for_the_decider() -> None:
    """Issue 19: a cut link is no evidence against the node once it is back: the decider checks that
    (``evidence.still_bad``) for the nodes the coordinator lost by silence only."""
    state = JobState(
        hosts=["n0", "n1", "n2"],
        min_nodes=3,
        max_restarts=3,
        master_addr="10.0.0.1",
        new_port=lambda: 29500,
        rdzv_timeout=60,
        fence_s=0.0,
    )
    for i in range(3):
        state.join(i, f"n{i}", 2)
    state.lost(2, "no heartbeat and no answer to probes", silent=True)
    state.workers_stopped(0, 0, [])
    state.workers_stopped(1, 0, [])
    assert state.result is not None and state.result.reason is Reason.TOO_FEW_NODES
    assert state.result.bad_nodes == ("n2",) and state.result.unreachable == ("n2",)
    wire = messages.decode(messages.FROM_COORDINATOR, messages.encode(state.result))
    assert wire == state.result
