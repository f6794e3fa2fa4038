"""Heartbeats become ``progress`` events and feed the lost-time ledger (real agents, real gloo workers)."""

from __future__ import annotations

import subprocess
import sys

from hpcelastic.record.ledger import build_ledger


def test_crash_gives_progress_marks_and_a_measured_ledger(local_job, tmp_path) -> None:
    job = local_job(nproc=1, train_args=("--crash-at-step", "6", "--crash-rank", "1", "--step-time", "0.05"))
    assert job.wait() == [0, 0]
    progress = job.events("progress")
    by_round = {r: [p for p in progress if p["round"] == r] for r in (0, 1)}
    for r, marks in by_round.items():
        assert marks and marks[0]["mark"] == "first", (r, progress)
        assert {p["attempt"] for p in marks} == {0}
        steps = [p["step"] for p in marks]
        assert steps == sorted(steps)
    assert by_round[0][-1]["mark"] == "last" and by_round[0][-1]["step"] >= 5
    assert by_round[1][-1]["step"] == 15  # the last step (0-based) of 16
    assert by_round[1][-1]["ranks"] == 2

    ledger = build_ledger(job.rd.events())
    [inc] = ledger.incidents
    assert str(inc.kind) == "worker_failure" and inc.recovery == "restart"
    assert ledger.steps_measured and not inc.estimated and not ledger.notes
    assert inc.restart_to_first_step_s > 0 and inc.detection_s >= 0
    assert ledger.ettr is not None and 0 < ledger.ettr < 1

    status = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", str(job.rd.path)], capture_output=True, text=True
    )
    assert status.returncode == 0, status.stderr
    text = status.stdout
    assert "where the time went:" in text and "#1 worker_failure (attempt 0 round 0)" in text
    assert "step_ts=" not in text, text  # progress events are no timeline rows

    out = tmp_path / "page.html"
    report = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "report", str(job.rd.path), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert report.returncode == 0, report.stderr
    assert f"wrote {out}" in report.stdout and "next:" in report.stdout
    assert 'class="failure-marker"' in out.read_text()
