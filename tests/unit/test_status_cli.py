"""``hpcelastic status/logs/cancel/finalize`` as the user runs them: bad input is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcelastic.events import Event, EventName
from hpcelastic.rundir import RunDir


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCELASTIC_"))}
    e["XDG_STATE_HOME"] = str(tmp_path / "state")
    return e


def hpce(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpcelastic", *args], env=env, capture_output=True, text=True, timeout=60
    )


def assert_one_line_error(out: subprocess.CompletedProcess[str], *words: str) -> None:
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcelastic: error:"), out.stderr
    assert "Traceback" not in out.stderr
    for w in words:
        assert w in lines[0]


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    rd = RunDir.create(tmp_path / "run")
    rd.write_meta({"requeue_mode": "requeue", "max_requeues": 1})
    for attempt, rank, text in [(0, 0, "a0 r0\n"), (0, 1, "a0 r1\n"), (1, 0, "a1 r0\n")]:
        rd.rank_log_path(attempt, rank).write_text(text)
    return rd


def test_status_of_unknown_run_dir(env: dict[str, str], tmp_path: Path) -> None:
    assert_one_line_error(hpce(env, "status", str(tmp_path / "nope")), "no such run directory")


def test_status_of_a_directory_that_is_not_a_run(env: dict[str, str], tmp_path: Path) -> None:
    assert_one_line_error(hpce(env, "status", str(tmp_path)), "not an hpcelastic run directory")


def test_status_of_unknown_job_id(env: dict[str, str]) -> None:
    assert_one_line_error(hpce(env, "status", "987654"), "not in the run index")


def test_status_by_job_id_via_the_index(env: dict[str, str], run: RunDir) -> None:
    run.record(Event(EventName.SUBMITTED, {"job_id": "987655", "backend": "sbatch", "nodes": 1}))
    code = f"from hpcelastic.record.runindex import record_job; record_job('987655', {str(run.path)!r})"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    out = hpce(env, "status", "987655", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["run_dir"] == str(run.path) and data["latest_job_id"] == "987655"
    assert data["timeline"][0]["what"] == "submitted"
    text = hpce(env, "status")  # no argument: the latest recorded run
    assert text.returncode == 0 and str(run.path) in text.stdout


def test_logs_defaults_and_choices(env: dict[str, str], run: RunDir) -> None:
    assert hpce(env, "logs", str(run.path)).stdout == "a1 r0\n"
    assert hpce(env, "logs", str(run.path), "--attempt", "0", "--rank", "1").stdout == "a0 r1\n"


def test_logs_bad_rank_and_attempt(env: dict[str, str], run: RunDir) -> None:
    assert_one_line_error(hpce(env, "logs", str(run.path), "--rank", "7"), "rank 7", "ranks with logs: 0")
    assert_one_line_error(hpce(env, "logs", str(run.path), "--rank", "-1"))
    assert_one_line_error(hpce(env, "logs", str(run.path), "--attempt", "5"), "attempts with logs: 0, 1")


def test_logs_without_any_logs(env: dict[str, str], tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "empty-run")
    rd.record(Event(EventName.SUBMITTED, {"job_id": "1"}))
    assert_one_line_error(hpce(env, "logs", str(rd.path)), "no worker logs yet")


def test_logs_follow_stops_when_the_attempt_ends(env: dict[str, str], run: RunDir) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcelastic", "logs", str(run.path), "-f"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    with open(run.rank_log_path(1, 0), "a") as f:
        f.write("more\n")
    run.record(Event(EventName.ATTEMPT_ENDED, {"attempt": 1, "reason": "succeeded", "exit_code": 0}))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out == "a1 r0\nmore\n"
    assert "attempt 1 ended (succeeded)" in err


def test_cancel_bad_inputs(env: dict[str, str], tmp_path: Path) -> None:
    assert_one_line_error(hpce(env, "cancel", str(tmp_path / "nope")), "no such run directory")
    rd = RunDir.create(tmp_path / "never-submitted")
    rd.record(Event(EventName.ATTEMPT_STARTED, {"attempt": 0}))
    assert_one_line_error(hpce(env, "cancel", str(rd.path)), "never submitted")


def test_finalize_after_agent_decision_exits_with_it(env: dict[str, str], run: RunDir) -> None:
    run.record(Event(EventName.ATTEMPT_ENDED, {"attempt": 0, "reason": "restarts_exhausted", "exit_code": 3}))
    out = hpce(env, "finalize", "--run-dir", str(run.path), "--exit-code", "3")
    assert out.returncode == 3
    assert [e["event"] for e in run.events()] == ["attempt_ended"]  # nothing decided twice


def test_finalize_decides_when_no_agent_did(env: dict[str, str], run: RunDir) -> None:
    out = hpce(env, "finalize", "--run-dir", str(run.path), "--exit-code", "6")
    assert out.returncode == 6
    ended = [e for e in run.events() if e["event"] == "attempt_ended"]
    assert ended[0]["reason"] == "coordinator_lost" and ended[0]["exit_code"] == 6
    skipped = [e for e in run.events() if e["event"] == "requeue_skipped"]
    assert skipped[0]["reason"] == "no_slurm_job"  # outside Slurm there is nothing to requeue


def test_finalize_success_and_bad_run_dir(env: dict[str, str], run: RunDir, tmp_path: Path) -> None:
    assert hpce(env, "finalize", "--run-dir", str(run.path), "--exit-code", "0").returncode == 0
    assert run.events()[-1]["event"] == "job_succeeded"
    assert_one_line_error(hpce(env, "finalize", "--run-dir", str(tmp_path / "x"), "--exit-code", "0"))
