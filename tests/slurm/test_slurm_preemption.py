"""Slurm's own preemption (issue 9, item 7): partition `urgent` preempts `debug` (PreemptMode=REQUEUE).

Runs on a 2-node testbed instance of this module's own (``preempt``: 127.0.11.x, ports 7817/18001..),
never on the shared default instance. A checkpointing training job goes in through ``hpcelastic
submit`` into `debug` and fills both nodes; a plain `urgent` sbatch job needs them. What Slurm 22.05
does (measured here): it TERMs the batch shell and the step at once ("CANCELLED ... DUE TO
PREEMPTION"; the ``--signal`` is not sent) and, for a job that may requeue, requeues it at once: the
trap sees ``JobState=COMPLETING``, ``Restarts`` one past the attempt's, no ``PreemptTime``. A job
submitted ``--no-requeue`` (resubmit mode) is cancelled instead: ``JobState=PREEMPTED`` with
``PreemptTime``. The assertions read ``scontrol show job`` and the run's events.

Sites that let preempted jobs checkpoint give the partition a ``GraceTime`` and set
``SlurmctldParameters=preempt_send_user_signal`` (``PreemptParameters=send_user_signal`` from 23.02):
then Slurm sends the job's ``--signal`` at preemption (measured here: to the batch shell within 0.3 s,
the job still RUNNING with ``PreemptTime`` set and EndTime now + GraceTime). A second instance
(``grace``: 127.0.13.x, GraceTime 30 s) checks that hpcelastic then stops every rank after one step,
publishes that step's checkpoint and requeues before the grace ends, so nothing is trained twice.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic import events as lifecycle_events
from hpcelastic import handoff
from hpcelastic.jobs import slurm
from hpcelastic.jobs.slurm import ENDED_STATES
from hpcelastic.lifecycle.attempt_end import end_attempt
from hpcelastic.lifecycle.cancel import mark_cancelled
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir
from tests.slurm_utils import CKPT_EVERY, REPO, TRAIN, events, named, status_json, train_args
from tests.slurm_utils import job_record as job
from tests.slurm_utils import wait_for_event as wait_event
from tests.slurm_utils import wait_job_state as wait_state
from tests.testbed import Testbed, own_instance

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group(name="preempt")]

NAME = "preempt"
SETTINGS = {"index": "11", "nodes": "2", "preempt": "1"}
WATCHED = ("JobState", "PreemptTime")
GRACE = {"index": "13", "nodes": "2", "preempt": "1", "preempt_grace": "30"}
STEPS = 150


@pytest.fixture(scope="module")
def tb(slurm_cluster: dict[str, object]) -> Iterator[Testbed]:
    """The module's own 2-node instance with preemption, brought up fresh and taken down at the end."""
    with own_instance(NAME, SETTINGS) as inst:
        yield inst


@pytest.fixture(scope="module")
def graced(slurm_cluster: dict[str, object]) -> Iterator[Testbed]:
    """A 2-node instance whose `debug` jobs get a 30 s grace and their ``--signal`` when preempted."""
    with own_instance("grace", GRACE) as inst:
        yield inst


def use_instance(tb: Testbed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Slurm commands of this test (and of hpcelastic) talk to ``tb``, its nodes idle; its jobs
    cancelled at the end."""
    env = tb.slurm_env()
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for node in (f"{tb.name}1", f"{tb.name}2"):
        tb.wait_node_state(node, ("idle",), 90)
    yield env
    tb.slurm("scancel", "-u", str(os.getuid()), check=False)


@pytest.fixture
def slurm_env(tb: Testbed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Slurm commands of this test (and of hpcelastic) talk to the module's instance."""
    yield from use_instance(tb, monkeypatch, tmp_path)


@pytest.fixture
def grace_env(graced: Testbed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Slurm commands of this test (and of hpcelastic) talk to the instance with a grace time."""
    yield from use_instance(graced, monkeypatch, tmp_path)


def submit(tmp_path: Path, site: str, *flags: str) -> tuple[str, Path]:
    """``hpcelastic submit`` of the reference training into `debug` on both nodes; (job id, run dir)."""
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", site, "--partition", "debug"]
    argv += ["--run-dir", str(tmp_path / "run"), "--time", "10", "--nodes", "2", *flags, str(TRAIN)]
    argv += [*train_args(STEPS), "--step-time", "0.2", "--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    return str(info["job_id"]), Path(info["run_dir"])


def preempt(job_id: str) -> tuple[str, list[dict[str, str]]]:
    """Submit the `urgent` job that needs both nodes; (its id, ``job_id``'s records until it left RUNNING,
    one each time its JobState or PreemptTime changed)."""
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "urgent",
            "-N2",
            "--exclusive",
            "-o",
            "/dev/null",
            "--wrap",
            "sleep 5",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    urgent = out.stdout.strip().split(";")[0]
    seen: list[dict[str, str]] = []
    start = time.monotonic()
    while time.monotonic() < start + 30:
        rec = job(job_id)
        if not seen or [rec.get(k) for k in WATCHED] != [seen[-1].get(k) for k in WATCHED]:
            seen.append({**rec, "_s": f"{time.monotonic() - start:.2f}"})
        if rec.get("JobState") not in ("RUNNING", "COMPLETING", "SIGNALING"):
            break
        time.sleep(0.05)
    return urgent, seen


def jobs_of(run: Path) -> list[str]:
    """Every job Slurm knows (pending, running or ended) that runs the run's batch script."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%o"], capture_output=True, text=True).stdout
    script = str(run / "job.sbatch")
    return sorted(
        jid for jid, _, command in (line.partition("|") for line in out.splitlines()) if command == script
    )


def published(evs: list[dict[str, object]], attempt: int) -> list[int]:
    return sorted(int(str(e["step"])) for e in named(evs, "checkpoint_published") if e["attempt"] == attempt)


@pytest.mark.parametrize("limit", ["00:10:00", "UNLIMITED"])
def test_preemption_requeued_by_slurm_is_not_requeued_again(
    tmp_path: Path, slurm_env: dict[str, str], limit: str
) -> None:
    """Requeue mode (``--requeue``): Slurm requeues the preempted job itself; hpcelastic records the
    attempt as preempted (no budget), does not requeue or resubmit, and the job resumes and completes.
    Before: with a time limit the stop was read as the time limit; without one as a user's cancel
    (the run said ``cancelled`` while Slurm ran the job again)."""
    job_id, run = submit(tmp_path, "testbed", f"--sbatch-arg=--time={limit}")
    assert job(job_id)["TimeLimit"] == limit
    wait_state(job_id, {"RUNNING"}, 60)
    wait_event(run, "checkpoint_published", 120, step=2 * CKPT_EVERY)
    urgent, seen = preempt(job_id)
    completing = [r for r in seen if r.get("JobState") == "COMPLETING"]
    assert completing and completing[0]["Restarts"] == "1", seen  # requeued by Slurm at once
    assert completing[0].get("PreemptTime", "None") == "None", seen
    wait_state(urgent, {"COMPLETED"}, 120)
    rec = wait_state(job_id, ENDED_STATES, 240)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", rec  # one preemption, one requeue
    assert jobs_of(run) == [job_id]  # no duplicate job

    evs = events(run)
    assert [(e["attempt"], e["job_id"]) for e in named(evs, "attempt_started")] == [(0, job_id), (1, job_id)]
    first = named(evs, "attempt_ended")[0]
    assert first["attempt"] == 0 and first["reason"] == "preempted", first
    (requeued,) = named(evs, "requeued")
    assert requeued["by"] == "slurm" and requeued["reason"] == "preempted", requeued
    assert not named(evs, "resubmitted") and not named(evs, "requeue_failed")
    assert not named(evs, "root_cause")  # Slurm's TERM to every agent is a stop, not a node failure
    story = status_json(str(run))
    assert [i["kind"] for i in story["ledger"]["incidents"]] == ["preemption"], story["ledger"]["incidents"]
    before, after = published(evs, 0), published(evs, 1)
    assert before and after and after[0] == before[-1] + CKPT_EVERY  # resumed from the last checkpoint
    resumed = [e for e in named(evs, "progress") if e["attempt"] == 1]
    assert resumed and int(resumed[0]["step"]) >= before[-1] > 0
    assert named(evs, "attempt_ended")[-1]["reason"] == "succeeded"
    assert story["outcome"] == "succeeded"
    assert (tmp_path / "out" / "final.json").is_file()


def test_preemption_in_resubmit_mode_resubmits_once(tmp_path: Path, slurm_env: dict[str, str]) -> None:
    """Resubmit mode (``--no-requeue``): Slurm cancels the preempted job (PREEMPTED, PreemptTime);
    hpcelastic resubmits it once; the new job resumes and completes; the old one stays PREEMPTED."""
    site = tmp_path / "resubmit-site.yaml"
    site.write_text(
        (REPO / "site_configs" / "testbed.yaml").read_text().replace("mode: requeue", "mode: resubmit")
    )
    job_id, run = submit(tmp_path, str(site))
    wait_state(job_id, {"RUNNING"}, 60)
    wait_event(run, "checkpoint_published", 120, step=2 * CKPT_EVERY)
    urgent, _ = preempt(job_id)
    rec = wait_state(job_id, {"PREEMPTED"}, 60)
    assert rec["Restarts"] == "0" and rec["PreemptTime"] != "None", rec
    resub = wait_event(run, "resubmitted", 60)
    second = str(resub["job_id"])
    wait_state(urgent, {"COMPLETED"}, 120)
    rec = wait_state(second, ENDED_STATES, 240)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    assert job(job_id)["JobState"] == "PREEMPTED" and job(job_id)["Restarts"] == "0"
    assert jobs_of(run) == sorted([job_id, second])

    evs = events(run)
    assert [e["job_id"] for e in named(evs, "attempt_started")] == [job_id, second]
    assert named(evs, "attempt_ended")[0]["reason"] == "preempted"
    assert len(named(evs, "resubmitted")) == 1 and not named(evs, "requeued")
    before, after = published(evs, 0), published(evs, 1)
    assert before and after and after[0] == before[-1] + CKPT_EVERY
    assert status_json(str(run))["outcome"] == "succeeded"


def test_a_late_decision_after_slurms_requeue_neither_requeues_nor_lets_a_cancelled_run_run(
    tmp_path: Path, slurm_env: dict[str, str]
) -> None:
    """The end-of-attempt decision comes after Slurm has requeued the preempted job and started it
    again (a slow finalize on a busy cluster). Before: ``scontrol requeue`` hit the new attempt
    (Restarts=2). Now: Slurm's requeue is recorded and nothing else is done; and when the run was
    cancelled meanwhile, the job Slurm queued again is cancelled instead of running on."""
    rd = RunDir.create(tmp_path / "run")
    rd.script_path.write_text(
        "#!/bin/bash\n#SBATCH --requeue\n#SBATCH -p debug\n#SBATCH -N2\n#SBATCH --exclusive\n"
        "#SBATCH --output=/dev/null\nsleep 300\n"
    )
    job_id = slurm.sbatch(rd.script_path, [], cwd=rd.path)
    rd.record(lifecycle_events.submitted(job_id=job_id, backend="sbatch", nodes="2", script="-"))
    for attempt in (0, 1):
        wait_state(job_id, {"RUNNING"}, 60)
        handoff.begin_attempt(rd, job_id, attempt)
        urgent, _ = preempt(job_id)
        wait_state(urgent, {"COMPLETED"}, 60)
        rec = wait_state(job_id, {"RUNNING"}, 60)
        assert rec["Restarts"] == str(attempt + 1), rec
        if attempt == 1:
            mark_cancelled(rd)
        out = end_attempt(
            rd, attempt, Reason.PREEMPTED, job_id=job_id, requeue_mode="requeue", max_requeues=3
        )
        assert out.exit_code == Reason.PREEMPTED.exit_code
    rec = wait_state(job_id, {"CANCELLED"}, 30)  # the cancelled run's job did not run on
    assert rec["Restarts"] == "2", rec  # only Slurm's two requeues
    evs = events(rd.path)
    assert [e["reason"] for e in named(evs, "attempt_ended")] == ["preempted", "preempted"]
    (requeued,) = named(evs, "requeued")
    assert requeued["by"] == "slurm" and requeued["attempt"] == 1
    assert named(evs, "job_failed")[-1]["reason"] == "cancelled"
    assert not named(evs, "resubmitted") and not named(evs, "requeue_failed")


def test_preemption_with_a_grace_time_stops_every_rank_at_one_step_and_loses_none(
    tmp_path: Path, grace_env: dict[str, str]
) -> None:
    """GraceTime + preempt_send_user_signal: the ``--signal`` comes at preemption; every rank stops
    after the same step, that step's checkpoint is published, hpcelastic requeues while the job still
    runs (one requeue: Restarts=1, one job id) and the next attempt resumes from exactly that step."""
    job_id, run = submit(tmp_path, "testbed")
    wait_state(job_id, {"RUNNING"}, 60)
    wait_event(run, "checkpoint_published", 120, step=2 * CKPT_EVERY)
    urgent, seen = preempt(job_id)
    # SIGNALING: Slurm is delivering the --signal to a job still running (24.11 shows it for a moment).
    running = ("RUNNING", "SIGNALING")
    graced = [r for r in seen if r["JobState"] in running and r.get("PreemptTime", "None") != "None"]
    # Preempted, and still running in its grace time: here the grace lasted 1.4 s (hpcelastic stops after
    # one 0.2 s step and requeues), so a poll slowed by a loaded slurmctld can miss it (CI saw RUNNING, then
    # PENDING). Then the events below prove it: only the --signal came (no TERM) and hpcelastic, not Slurm,
    # requeued.
    trail = [{k: r.get(k) for k in (*WATCHED, "Restarts", "_s")} for r in seen]
    last = seen[-1]
    missed = len(seen) >= 2 and last["JobState"] in ("PENDING", "REQUEUED") and last["Restarts"] == "1"
    assert graced or missed, trail
    wait_state(urgent, {"COMPLETED"}, 120)
    rec = wait_state(job_id, ENDED_STATES, 240)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", rec
    assert jobs_of(run) == [job_id]

    evs = events(run)
    signalled = named(evs, "signal_received")
    assert signalled and {e["signal"] for e in signalled} == {"SIGUSR2"}, signalled  # the --signal, no TERM
    first = named(evs, "attempt_ended")[0]
    assert first["attempt"] == 0 and first["reason"] == "preempted", first
    (requeued,) = named(evs, "requeued")
    assert requeued["by"] != "slurm" and requeued["reason"] == "preempted", requeued
    log = "\n".join(p.read_text() for p in run.glob("slurm-*.out"))
    m = re.search(r"every rank stops after step (\d+)", log)
    assert m, log[-3000:]
    stop = int(m.group(1))
    before = published(evs, 0)
    assert before[-1] == stop, (before, stop)  # the stop step's own checkpoint, not the last periodic one
    resumed = [int(str(e["step"])) for e in named(evs, "progress") if e["attempt"] == 1]
    assert resumed and min(resumed) >= stop, (resumed, stop)
    assert not named(evs, "root_cause")
    assert status_json(str(run))["outcome"] == "succeeded"
    assert (tmp_path / "out" / "final.json").is_file()
