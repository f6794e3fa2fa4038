"""The status timeline built from a synthetic event log and one (stand-in) Slurm query."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from hpcelastic.errors import SlurmError
from hpcelastic.events import Event, EventName
from hpcelastic.jobs.slurm import JobState
from hpcelastic.record.status import build_status, render_text
from hpcelastic.rundir import RunDir

EVENTS = [
    {"ts": 100.0, "event": "submitted", "job_id": "11", "backend": "sbatch", "nodes": 2},
    {
        "ts": 110.0,
        "event": "attempt_started",
        "attempt": 0,
        "job_id": "11",
        "restart_count_slurm": 0,
        "nodes": ["n1"],
    },
    {"ts": 111.0, "event": "rendezvous", "round": 0, "hosts": ["n1", "n2"], "world_size": 4},
    {"ts": 112.0, "event": "workers_started", "round": 0, "world_size": 4},
    {"ts": 120.0, "event": "checkpoint_published", "path": "/c/s10.pt", "step": 10, "attempt": 0, "rank": 0},
    {"ts": 130.0, "event": "checkpoint_published", "path": "/c/s20.pt", "step": 20, "attempt": 0, "rank": 0},
    {"ts": 131.0, "event": "worker_failed", "rank": 3, "node": "n2", "exitcode": 1, "error": "victim"},
    {
        "ts": 131.5,
        "event": "root_cause",
        "rank": 1,
        "node": "n1",
        "exitcode": 1,
        "error": "Traceback\nValueError: x",
    },
    {
        "ts": 132.0,
        "event": "restarting",
        "round": 1,
        "restart_count": 1,
        "max_restarts": 1,
        "reason": "worker failed",
    },
    {"ts": 140.0, "event": "node_unhealthy", "node": "n2", "gpu": 0, "reason": "XID 79"},
    {"ts": 141.0, "event": "attempt_ended", "attempt": 0, "reason": "node_unhealthy", "exit_code": 7},
    {
        "ts": 141.5,
        "event": "resubmitted",
        "job_id": "12",
        "previous_job_id": "11",
        "exclude": ["n2"],
        "reason": "node_unhealthy",
        "attempt": 1,
    },
    {
        "ts": 150.0,
        "event": "attempt_started",
        "attempt": 1,
        "job_id": "12",
        "restart_count_slurm": 0,
        "nodes": ["n1"],
    },
    {"ts": 151.0, "event": "custom_thing", "answer": 42},
]


@pytest.fixture
def rd(tmp_path: Path) -> RunDir:
    r = RunDir.create(tmp_path / "run")
    r.events_path.write_text("".join(json.dumps(e) + "\n" for e in EVENTS) + '{"ts": 160, "event": "torn')
    return r


def test_timeline_rows_and_single_slurm_query(rd: RunDir) -> None:
    asked: list[list[str]] = []

    def query(ids: Sequence[str]) -> Mapping[str, JobState]:
        asked.append(list(ids))
        return {"12": JobState("12", "RUNNING", "None", "n1,n3")}

    st = build_status(rd, query)

    assert asked == [["11", "12"]]  # one query for every job id of the run
    assert st.job_ids == ["11", "12"] and st.latest_job_id == "12" and st.attempt == 1
    assert st.outcome == "running"
    assert st.checkpoint == {"path": "/c/s20.pt", "step": 20, "attempt": 0, "rank": 0, "published": True}
    whats = [r.what for r in st.timeline]
    assert whats == [
        "submitted",
        "attempt 0 started",
        "rendezvous round 0",
        "2 checkpoints published",
        "failure (root cause)",
        "restarting",
        "node unhealthy",
        "attempt 0 ended",
        "resubmitted as attempt 1",
        "attempt 1 started",
        "custom_thing",
    ]
    details = {r.what: r.details for r in st.timeline}
    assert details["failure (root cause)"] == "rank 1 on n1, exit code 1: ValueError: x"
    assert "steps 10..20" in details["2 checkpoints published"]
    assert (
        "new job 12 after 11" in details["resubmitted as attempt 1"]
        and "n2" in details["resubmitted as attempt 1"]
    )
    assert details["custom_thing"] == "answer=42"

    text = render_text(st)
    assert "RUNNING on n1,n3" in text and "step 20: /c/s20.pt" in text

    as_json = json.loads(json.dumps(st.to_json()))
    assert [r["what"] for r in as_json["timeline"]] == whats
    assert as_json["slurm"]["12"]["state"] == "RUNNING"


def test_slurm_unreachable_keeps_the_timeline(rd: RunDir) -> None:
    def query(ids: Sequence[str]) -> Mapping[str, JobState]:
        raise SlurmError("squeue failed: Unable to contact slurm controller", transient=True)

    st = build_status(rd, query)
    assert st.slurm_error and "Unable to contact" in st.slurm_error
    assert len(st.timeline) == 11 and st.outcome == "unknown"
    assert "unknown: squeue failed" in render_text(st)


def test_finished_run_outcome(tmp_path: Path) -> None:
    r = RunDir.create(tmp_path / "run")
    r.record(Event(EventName.SUBMITTED, {"job_id": "5"}))
    r.record(Event(EventName.ATTEMPT_ENDED, {"attempt": 0, "reason": "startup_failure", "exit_code": 8}))
    r.record(Event(EventName.JOB_FAILED, {"attempt": 0, "reason": "startup_failure", "exit_code": 8}))
    st = build_status(r, lambda ids: {})
    assert st.outcome == "failed (startup_failure)"
    assert "identically before training started" in render_text(st)


def _local_run(tmp_path: Path, pids: list[int]) -> RunDir:
    """A local run (``hpcelastic run``) that trained 10 s, its processes recorded as ``pids``."""
    from hpcelastic.agent.launcher import record_processes

    r = RunDir.create(tmp_path / "local")
    start = 1000.0
    r.record(
        Event(EventName.ATTEMPT_STARTED, {"attempt": 0, "job_id": r.local_job_id, "nodes": ["local0"]}),
        ts=start,
    )
    r.record(Event(EventName.RENDEZVOUS, {"round": 0, "hosts": ["local0"], "world_size": 1}), ts=start + 1)
    r.record(Event(EventName.WORKERS_STARTED, {"round": 0, "world_size": 1}), ts=start + 1)
    r.record(
        Event(EventName.PROGRESS, {"attempt": 0, "round": 0, "step": 9, "step_ts": start + 10}), ts=start + 10
    )
    record_processes(r, pids)
    return r


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_local_run_whose_processes_live_is_running(tmp_path: Path) -> None:
    import os

    st = build_status(_local_run(tmp_path, [os.getpid()]))
    assert st.outcome == "running"
    assert st.ledger is not None and st.ledger.allocated_s > 1000  # a live run's clock runs to now


def test_a_local_run_whose_processes_were_killed_says_so_and_its_time_stops(tmp_path: Path) -> None:
    st = build_status(_local_run(tmp_path, [_dead_pid(), _dead_pid()]))
    assert st.outcome.startswith("killed")
    assert st.ledger is not None and st.ledger.allocated_s == pytest.approx(10.0)  # up to its newest event


def test_a_local_run_stopped_by_the_user(tmp_path: Path) -> None:
    from hpcelastic.agent.launcher import stopped_by_user

    r = _local_run(tmp_path, [_dead_pid()])
    r.record(
        Event(EventName.NODE_LOST, {"node_rank": 1, "node": "local1", "reason": "agent received SIGINT"})
    )
    stopped_by_user(r, 2)
    r.record(
        Event(EventName.NODE_LOST, {"node_rank": 0, "node": "local0", "reason": "agent received SIGINT"})
    )
    r.record(
        Event(EventName.NODE_LOST, {"node_rank": 0, "node": "local0", "reason": "no heartbeat for 30 s"})
    )
    st = build_status(r)
    assert st.outcome == "stopped by the user (SIGINT)"
    rows = [(row.what, row.details) for row in st.timeline]
    assert ("stopped by the user", "SIGINT to hpcelastic run") in rows
    assert [d for w, d in rows if w == "node lost"] == ["local0: no heartbeat for 30 s"]


def test_the_timeline_says_why_an_attempt_advanced_and_who_ignored_the_stop(tmp_path: Path) -> None:
    r = RunDir.create(tmp_path / "run")
    r.record(Event(EventName.SUBMITTED, {"job_id": "5"}))
    ended = {"attempt": 0, "reason": "time_limit", "exit_code": 5, "progress": "wrote checkpoint step-9.pt"}
    r.record(Event(EventName.STOP_IGNORED, {"rank": 3, "step": 57, "stop_step": 52}))
    r.record(Event(EventName.ATTEMPT_ENDED, ended))
    text = render_text(build_status(r, lambda ids: {}))
    assert "progress: wrote checkpoint step-9.pt" in text
    assert "rank 3 trained on to step 57 past the stop step 52" in text


def test_a_requeue_slurm_made_before_hpcelastic_ended_the_attempt_gets_its_row(tmp_path: Path) -> None:
    """A node failure Slurm acted on first (it requeued the job itself): the next attempt of the same job
    started with a higher restart count and no requeue was recorded. A requeue hpcelastic recorded, or a
    new job, gets no such row."""
    r = RunDir.create(tmp_path / "run")

    def started(attempt: int, job: str, restarts: int) -> None:
        fields = {"attempt": attempt, "job_id": job, "restart_count_slurm": restarts, "nodes": ["n1"]}
        r.record(Event(EventName.ATTEMPT_STARTED, fields))

    started(0, "7", 0)
    started(1, "7", 1)
    note = {"job_id": "7", "attempt": 2, "reason": "time_limit", "exclude": [], "by": "hpcelastic"}
    r.record(Event(EventName.REQUEUED, note))
    started(2, "7", 2)
    started(3, "8", 0)
    rows = [(row.what, row.details) for row in build_status(r, lambda ids: {}).timeline]
    slurm_rows = [d for w, d in rows if "by Slurm itself" in d]
    assert slurm_rows == [
        "job 7 requeued by Slurm itself (restart count 0 -> 1) before hpcelastic ended attempt 0"
    ]
    assert [w for w, _ in rows][:3] == ["attempt 0 started", "requeued as attempt 1", "attempt 1 started"]


def test_a_default_local_run_s_job_id_says_local_once(tmp_path: Path) -> None:
    """Issue 30: a default ``hpcelastic run`` directory (``local-<stamp>-<pid>``) gave ``local-local-...``."""
    from hpcelastic.agent.launcher import default_run_dir

    default = RunDir(tmp_path / default_run_dir().name)
    assert default.local_job_id == default.path.name and default.local_job_id.count("local-") == 1
    assert RunDir(tmp_path / "exp7").local_job_id == "local-exp7"
