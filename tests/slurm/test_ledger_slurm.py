"""Where a real Slurm job's time went: ``status --json``'s ledger and ``hpcelastic report`` in Chromium.

One job through ``hpcelastic submit`` on the testbed; a worker is SIGKILLed at step 12 (after the
checkpoint of step 10), the job restarts in place and completes.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm_utils import events, named, status_json, submit_reference, wait_job_finished
from tests.unit.test_report_browser import _Dom, run_chromium

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 30
PHASES = ("redone_work_s", "detection_s", "teardown_s", "rendezvous_s", "restart_to_first_step_s")


def test_worker_crash_has_a_measured_ledger_and_a_report(tmp_path: Path, slurm_jobs: list[str]) -> None:
    job, run = submit_reference(
        tmp_path,
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--max-restarts",
        "1",
        steps=STEPS,
        train=("--fault", "sigkill", "--fault-rank", "3", "--fault-step", "12", "--step-time", "0.1"),
    )
    slurm_jobs.append(job)
    rec = wait_job_finished(job, timeout=120)
    assert (rec["JobState"], rec["Restarts"]) == ("COMPLETED", "0"), rec

    progress = named(events(run), "progress")
    firsts = [p for p in progress if p["mark"] == "first"]
    assert [p["round"] for p in firsts] == [0, 1], progress
    assert progress[-1]["mark"] == "last" and progress[-1]["step"] == STEPS
    assert progress[-1]["ranks"] == 4

    ledger = status_json(str(run))["ledger"]
    [inc] = ledger["incidents"]
    assert (inc["kind"], inc["attempt"], inc["round"], inc["recovery"]) == ("worker_failure", 0, 0, "restart")
    assert "rank 3" in inc["cause"] and "SIGKILL" in inc["cause"]
    assert all(inc[p] >= 0 for p in PHASES), inc
    assert math.isclose(inc["lost_s"], sum(inc[p] for p in PHASES), abs_tol=1e-6)
    assert inc["restart_to_first_step_s"] > 0 and inc["redone_work_s"] > 0
    assert inc["redone_steps"] == 2  # steps 11 and 12 since the checkpoint of step 10
    assert ledger["steps_measured"] and inc["estimated"] == [] and ledger["notes"] == []
    assert all(s["t1"] >= s["t0"] for s in ledger["segments"])
    [attempt] = ledger["attempts"]
    in_attempt = sum(s["t1"] - s["t0"] for s in ledger["segments"] if s["attempt"] == 0)
    assert math.isclose(in_attempt, attempt["end"] - attempt["start"], abs_tol=1e-6)
    assert math.isclose(ledger["allocated_s"], attempt["end"] - attempt["start"], abs_tol=1e-6)
    assert math.isclose(ledger["productive_s"] + ledger["badput_s"], ledger["allocated_s"], abs_tol=1e-6)
    assert math.isclose(sum(ledger["badput_by_phase"].values()), ledger["badput_s"], abs_tol=1e-6)
    assert 0 < ledger["ettr"] <= 1

    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "report", str(run)], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    page = run / "report.html"
    assert f"wrote {page}" in proc.stdout
    dom = _Dom()
    dom.feed(run_chromium(tmp_path, "--dump-dom", page.as_uri()).stdout)
    assert dom.classes.get("attempt-bar") == 1
    assert dom.classes.get("failure-marker") == 1
    assert dom.classes.get("round-seg") == 2
    assert f"{100 * ledger['ettr']:.1f} %" in dom.text["kpi-ettr"]
    assert "worker_failure" in dom.text["incidents"]
