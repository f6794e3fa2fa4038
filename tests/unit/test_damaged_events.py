"""Event lines that are valid JSON but not event objects: readers skip and count them (issue 10, 12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hpcelastic import events, handoff
from hpcelastic.lifecycle.finalize import finalize
from hpcelastic.lifecycle.history import History, attempt_root_cause
from hpcelastic.reasons import Reason
from hpcelastic.record.ledger import build_ledger
from hpcelastic.rundir import RunDir

DAMAGED = ["[1]", '"text"', "null", "7", '{"no_event": 1}', '{"event": 5}', "[]", '{"event": "x"', "\x00\x00"]


def _run_with_damage(tmp_path: Path) -> RunDir:
    rd = RunDir.create(tmp_path / "run")
    rd.record(events.submitted(job_id="77", backend="sbatch", nodes="1", script=str(rd.script_path)))
    with open(rd.events_path, "a") as f:
        f.write("\n".join(DAMAGED) + "\n")
    rd.record(events.attempt_started(attempt=0, job_id="77", restart_count_slurm=0, nodes=["n1"]))
    with open(rd.events_path, "a") as f:
        f.write('[{"event": "attempt_ended"}]\n')
    return rd


def test_every_reader_survives_non_object_lines(tmp_path: Path) -> None:
    rd = _run_with_damage(tmp_path)
    log = rd.events()
    assert log.damaged == len(DAMAGED) + 1
    assert [e["event"] for e in log] == ["submitted", "attempt_started"]
    History.from_log(log, 0, cancelled=False)
    assert attempt_root_cause(log) is None
    build_ledger(log, now=log[-1]["ts"] + 1)
    rd.handoff_path.write_text("[1]")  # a damaged handoff record is rebuilt from the damaged log
    assert handoff.load(rd).attempt == 0 and handoff.load(rd).job_id == "77"
    code = finalize(rd, 1, stopped=False, environ={}, say=lambda m: None)
    assert code == Reason.COORDINATOR_LOST.exit_code
    assert rd.events().last(events.ATTEMPT_ENDED, attempt=0)["reason"] == "coordinator_lost"


def test_status_warns_with_the_count_of_damaged_lines(tmp_path: Path) -> None:
    rd = _run_with_damage(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCELASTIC_"))}
    env["PATH"] = "/nonexistent"  # no Slurm: the timeline must still be complete
    for extra in ((), ("--json",)):
        out = subprocess.run(
            [sys.executable, "-m", "hpcelastic", "status", *extra, str(rd.path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "Traceback" not in out.stderr
    assert json.loads(out.stdout)["damaged_events"] == rd.events().damaged
    text = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", str(rd.path)], env=env, capture_output=True, text=True
    )
    assert f"skipped {rd.events().damaged} damaged line(s)" in text.stderr
