"""Two node deaths of a job running an unchanged script, on a Slurm instance of this module's own
(``nodedeath``: 4 nodes on 127.0.17.x, SlurmdTimeout 10 s), through ``hpcelastic submit`` (issue 18,
item 1).

The script is ``reference_train.py --plain``: no ``hpcelastic.worker``, it saves and resumes on its own.
Before, its two node losses in two attempts read as one start-up failure (the same masked signature,
no heartbeat, no published checkpoint) and the job ended FAILED with exit 8; now each loss names its
host and the checkpoints on disk are progress, so both are requeued and the job finishes.

The job asks for a GPU per node: Slurm 22.05 corrupts the GRES record of a ``--no-kill`` job that is
requeued while one of its nodes is dead but not yet DOWN (its next step fails with ``Invalid generic
resource (gres) specification`` and GPUs stay allocated on idle nodes, issue 18 item 11). hpcelastic
finds the node dead (its slurmd does not answer) and requeues once Slurm has marked it DOWN.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic.jobs.slurm import ENDED_STATES, parse_scontrol_record
from tests.slurm_utils import TRAIN, events, named, reference_digest, train_args, wait_no_leaked_gres
from tests.testbed import Testbed, own_instance

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name="nodedeath")]

STEPS = 240


@pytest.fixture(scope="module")
def tb(slurm_cluster: dict[str, object]) -> Iterator[Testbed]:
    with own_instance("nodedeath", {"index": "17", "nodes": "4", "slurmd_timeout": "10"}) as inst:
        yield inst


def job_record(tb: Testbed, job: str) -> dict[str, str]:
    out = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
    return parse_scontrol_record(out.splitlines()[0]) if out.strip() else {}


def hosts(tb: Testbed, nodelist: str) -> list[str]:
    return tb.slurm("scontrol", "show", "hostnames", nodelist).split()


def saved_in(run: Path, ckpt: Path, attempt: int) -> bool:
    """The script saved a checkpoint of its own during ``attempt``."""
    began = [e["ts"] for e in named(events(run), "attempt_started") if e["attempt"] == attempt]
    return bool(began) and any(p.stat().st_mtime > began[0] for p in ckpt.glob("step-*.pt"))


def wait_running(
    tb: Testbed, job: str, run: Path, ckpt: Path, attempt: int, timeout: float = 90
) -> dict[str, str]:
    """The job runs its ``attempt`` and has trained in it (saved a checkpoint); its record."""
    deadline = time.monotonic() + timeout
    rec: dict[str, str] = {}
    while time.monotonic() < deadline:
        rec = job_record(tb, job)
        assert rec.get("JobState") not in ENDED_STATES, rec
        trained = saved_in(run, ckpt, attempt)
        if rec.get("JobState") == "RUNNING" and rec.get("Restarts") == str(attempt) and trained:
            return rec
        time.sleep(0.3)
    raise AssertionError(f"attempt {attempt} of job {job} did not train within {timeout} s: {rec}")


def test_two_node_deaths_of_an_unchanged_script_are_requeued_and_it_finishes(
    tb: Testbed, tmp_path: Path
) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
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
    argv += ["--time", "10", "--nodes", "2", "--gpus-per-node", "1", "--max-requeues", "3"]
    argv += ["--checkpoint-dir", str(ckpt), str(TRAIN), *train_args(STEPS), "--step-time", "0.05"]
    argv += ["--out", str(tmp_path / "out"), "--plain", "--ckpt-dir", str(ckpt)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=tb.slurm_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    killed = []
    try:
        for attempt in (0, 1):
            rec = wait_running(tb, job, run, ckpt, attempt)
            victim = next(n for n in hosts(tb, rec["NodeList"]) if n != rec["BatchHost"])
            tb.kill_node(victim)
            killed.append(victim)
        deadline = time.monotonic() + 120
        while (rec := job_record(tb, job)).get(
            "JobState"
        ) not in ENDED_STATES and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "2", rec
        assert not set(killed) & set(hosts(tb, rec["NodeList"])), rec
        assert not wait_no_leaked_gres(tb.slurm_env()), "GRES left allocated on nodes without a job"
    finally:
        for node in killed:
            tb.revive_node(node)
    evs = events(run)
    ended = [(e["attempt"], e["reason"]) for e in named(evs, "attempt_ended")]
    assert ended[-1] == (2, "succeeded") and len(ended) == 3, ended
    assert not {"step_failed", "coordinator_lost"} & {reason for _, reason in ended}, ended
    lost = named(evs, "attempt_ended")[:2]
    assert all(e["progressed"] for e in lost) and lost[0]["signature"] != lost[1]["signature"], lost
    assert [e["exclude"][-1:] for e in named(evs, "requeued")] == [[k] for k in killed]
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(STEPS)
