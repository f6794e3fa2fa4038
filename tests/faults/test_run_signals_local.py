"""``hpcelastic run`` stopped by the user, or killed outright, and ``status`` of it (issue 18 item 12).

Three real ``hpcelastic run`` processes (2 agents x 1 gloo worker of examples/ddp_train.py) train at
once; ``status`` says each is running. Then:

* ``ctrl-c``: SIGINT to the whole process group, as a terminal's Ctrl-C sends it;
* ``term``: SIGTERM to ``hpcelastic run`` alone;
* ``killed``: SIGKILL to the whole process group (nothing can record anything);
* ``usr2``: the stop signal (USR2) to ``hpcelastic run``, as a preemption (issue 21).

The first two are stopped by the user (exit 130 / 143, no "job failed", no lost nodes in the
timeline nor in the events: the agents are recorded as stopped); the third is reported killed, not
"unknown"; the fourth stopped (exit 5), not failed, and says that nothing requeues it. The productive
time of all of them stops growing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.slurm_utils import wait_no_leaks

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ddp_train.py"


def _start(run: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "1"]
    argv += ["--run-dir", str(run), str(EXAMPLE), "--steps", "100000", "--step-time", "0.05"]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _status(run: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", "--json", str(run)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _status_text(run: Path) -> str:
    return subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", str(run)], capture_output=True, text=True, check=True
    ).stdout


def _wait_training(run: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any('"progress"' in p.read_text() for p in run.glob("events*.jsonl")):
            return
        time.sleep(0.2)
    raise AssertionError(f"{run} did not train within {timeout:.0f} s")


def test_a_stopped_or_killed_run_is_reported_as_such(tmp_path: Path) -> None:
    runs = {name: tmp_path / name for name in ("ctrl-c", "term", "killed", "usr2")}
    procs = {name: _start(run) for name, run in runs.items()}
    try:
        for run in runs.values():
            _wait_training(run)
            assert _status(run)["outcome"] == "running"
        os.killpg(procs["ctrl-c"].pid, signal.SIGINT)
        procs["term"].send_signal(signal.SIGTERM)
        os.killpg(procs["killed"].pid, signal.SIGKILL)
        procs["usr2"].send_signal(signal.SIGUSR2)
        codes = {name: p.wait(timeout=90) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert codes == {"ctrl-c": 130, "term": 143, "killed": -signal.SIGKILL, "usr2": 5}
    for name, sig in (("ctrl-c", "SIGINT"), ("term", "SIGTERM")):
        stderr = procs[name].stderr.read()  # type: ignore[union-attr]
        assert f"stopped by the user ({sig}" in stderr and "job failed" not in stderr, stderr
        assert _status(runs[name])["outcome"] == f"stopped by the user ({sig})"
        text = _status_text(runs[name])
        assert "node lost" not in text and "received SIG" not in text, text
        logged = [
            json.loads(line) for p in runs[name].glob("events*.jsonl") for line in p.read_text().splitlines()
        ]
        assert not [e for e in logged if e["event"] == "node_lost"]
        if name == "ctrl-c":  # both agents got the terminal's SIGINT: the step's stop, no node lost
            assert len([e for e in logged if e["event"] == "agent_stopped"]) == 2
    stderr = procs["usr2"].stderr.read()  # type: ignore[union-attr]
    assert "job stopped on the stop signal" in stderr and "failed" not in stderr, stderr
    assert _status(runs["usr2"])["outcome"] == "stopped (preempted); not requeued: run it again to resume"
    text = _status_text(runs["usr2"])
    assert "job stopped" in text and "job failed" not in text and "the job is requeued" not in text, text
    assert _status(runs["killed"])["outcome"].startswith("killed")
    for run in runs.values():
        assert not wait_no_leaks(str(run))

    # (a stop's training is of unknown fate until a rerun shows what it resumed from)
    def trained(run: Path) -> float:
        led = _status(run)["ledger"]
        return led["productive_s"] + led["unknown_s"]

    before = {name: trained(run) for name, run in runs.items()}
    time.sleep(1.5)
    after = {name: trained(run) for name, run in runs.items()}
    assert after == before and all(v > 0 for v in before.values()), (before, after)
