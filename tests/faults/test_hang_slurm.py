"""Hangs in an unchanged torchrun-style script, on the real Slurm testbed through `hpcelastic submit`.

examples/hang_train.py imports nothing from hpcelastic (no heartbeats): one rank stops making progress at
step 10 (a native sleep before its collective, a GIL-holding busy loop, a lock deadlock). Each test checks
that the hang is declared within the stall timeout plus 10 s, that the root cause names that rank and the
line where it hangs (events and `hpcelastic status`), that every rank's stacks are in the run directory,
and that the job restarts and ends with the fault-free model (bit-identical parameters).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.slurm_utils import (
    REPO,
    named,
    status_json,
    wait_job_finished,
    wait_no_leaks,
    wait_nodes_idle,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = REPO / "examples" / "hang_train.py"
STALL_TIMEOUT = 10
STEPS = ("--steps", "14", "--ckpt-every", "5", "--step-time", "0.1")


def hang_line(kind: str) -> int:
    """The line of examples/hang_train.py where ``kind`` hangs."""
    marker = {"sleep": "time.sleep(3600)", "busy": "x += 1", "lock": "        lock.acquire()\n    raise"}[
        kind
    ]
    text = SCRIPT.read_text()
    return text[: text.index(marker)].count("\n") + 1


def events(run: Path) -> list[dict[str, Any]]:
    """Every event of the run, from each event file, in time order."""
    lines = [line for f in sorted(run.glob("events*.jsonl")) for line in f.read_text().splitlines()]
    return sorted((json.loads(line) for line in lines if line.strip()), key=lambda e: e["ts"])


@pytest.fixture(scope="module")
def fault_free_digest() -> str:
    """Final-parameter SHA-256 of the script without a fault under plain torchrun (2 workers)."""
    out = Path(tempfile.mkdtemp(prefix="hpcelastic-hang-reference-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCELASTIC_", "HANG_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
        + [*STEPS, "--ckpt-dir", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((out / "final.json").read_text())["sha256"]


@pytest.mark.parametrize(
    ("kind", "gpus", "rank"),
    [("sleep", "4", 5), ("busy", "2", 2), ("lock", "2", 1)],
    ids=["sleep-rank5-of-8", "busy-loop-rank2-of-4", "lock-rank1-of-4"],
)
def test_hang_is_localized_and_the_job_recovers(
    tmp_path: Path, slurm_jobs: list[str], fault_free_digest: str, kind: str, gpus: str, rank: int
) -> None:
    wait_nodes_idle()
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "hpcelastic",
        "submit",
        "--json",
        "--site",
        "testbed",
        "--run-dir",
        str(run),
    ]
    argv += ["--time", "10", "--nodes", "2", "--gpus-per-node", gpus, "--max-restarts", "1"]
    argv += [
        "--stall-timeout",
        str(STALL_TIMEOUT),
        "--env",
        f"HANG_KIND={kind}",
        "--env",
        f"HANG_RANK={rank}",
    ]
    argv += [str(SCRIPT), *STEPS]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    slurm_jobs.append(job)

    rec = wait_job_finished(job, timeout=240)
    assert rec["JobState"] == "COMPLETED", rec
    assert rec["Restarts"] == "0"  # recovered inside the allocation, no requeue
    evs = events(run)
    (cause,) = named(evs, "root_cause")
    # A busy loop samples at the ``while`` line or the one in its body.
    lines = [hang_line(kind)] + ([hang_line(kind) - 1] if kind == "busy" else [])
    where = next((f"hang_train.py:{n}" for n in lines if f"hang_train.py:{n} " in cause["error"]), None)
    assert cause["rank"] == rank and where, cause
    assert len(named(evs, "restarting")) == 1
    # Detected within the stall timeout + 10 s of the moment the rank stopped.
    log = (run / "logs" / "attempt-0" / f"rank-{rank}.log").read_text()
    hung_at = float(re.search(rf"injecting a hang: {kind} at ([0-9.]+)", log).group(1))
    (failed,) = named(evs, "worker_failed")
    assert failed["ts"] - hung_at <= STALL_TIMEOUT + 10, failed["ts"] - hung_at
    stacks = json.loads((run / "stacks" / "attempt-0" / "round-0.json").read_text())
    assert stacks["localization"]["root_ranks"] == [rank]
    assert len(stacks["ranks"]) == 2 * int(gpus)
    ckpt = run / "checkpoints" / "final.json"
    assert json.loads(ckpt.read_text())["sha256"] == fault_free_digest
    assert not wait_no_leaks(str(run)), "processes of the run survived"
    story = json.dumps(status_json(str(run))["timeline"])
    assert f"rank {rank}" in story and where in story
