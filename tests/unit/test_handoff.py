"""The handoff record: publish, attempts, resume, corruption recovery and crash atomicity."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcelastic import events, handoff
from hpcelastic.errors import UserError
from hpcelastic.lifecycle.executor import Executor
from hpcelastic.lifecycle.policy import AttemptEnd, Settings
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir


@pytest.fixture
def rd(tmp_path: Path) -> RunDir:
    return RunDir.create(tmp_path / "run")


def _kinds(rd: RunDir) -> list[str]:
    return [e["event"] for e in rd.events()]


def _save(d: Path, name: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_bytes(b"weights")
    return p


def test_missing_record_is_fresh(rd: RunDir) -> None:
    rec = handoff.load(rd)
    assert rec.attempt == 0 and rec.checkpoint is None and not rec.started
    assert handoff.resume_path(rd) is None
    assert _kinds(rd) == []


def test_begin_attempt_is_idempotent_per_allocation(rd: RunDir) -> None:
    assert handoff.begin_attempt(rd, "100", 0, ["node1"]) == 0
    assert handoff.begin_attempt(rd, "100", 0) == 0  # finalize re-joining the same allocation
    assert handoff.begin_attempt(rd, "100", 1) == 1  # scontrol requeue: same id, restart count + 1
    assert handoff.begin_attempt(rd, "101", 0) == 2  # resubmitted under a new id
    started = [e for e in rd.events() if e["event"] == "attempt_started"]
    assert [(e["attempt"], e["job_id"], e["restart_count_slurm"]) for e in started] == [
        (0, "100", 0),
        (1, "100", 1),
        (2, "101", 0),
    ]
    assert started[0]["nodes"] == ["node1"]
    assert handoff.load(rd).attempt == 2


def test_publish_updates_record_latest_file_and_event(rd: RunDir, tmp_path: Path) -> None:
    ckdir = tmp_path / "ckpt"
    p = _save(ckdir, "step-10.pt")
    handoff.publish(rd, ckdir, p, 10, attempt=0, rank=0)
    rec = handoff.load(rd)
    assert rec.checkpoint is not None and rec.checkpoint["path"] == str(p) and rec.checkpoint["step"] == 10
    latest = json.loads((ckdir / handoff.LATEST_FILE).read_text())
    assert latest == rec.checkpoint
    ev = rd.events()[-1]
    assert ev["event"] == "checkpoint_published" and ev["step"] == 10 and ev["checkpoint_dir"] == str(ckdir)
    assert handoff.resume_path(rd) == str(p)


def test_publish_of_missing_path_is_rejected_and_keeps_old_record(rd: RunDir, tmp_path: Path) -> None:
    ckdir = tmp_path / "ckpt"
    good = _save(ckdir, "step-1.pt")
    handoff.publish(rd, ckdir, good, 1, 0, 0)
    with pytest.raises(UserError, match="does not exist"):
        handoff.publish(rd, ckdir, ckdir / "step-2.pt", 2, 0, 0)
    assert handoff.load(rd).checkpoint["step"] == 1
    assert rd.events()[-1]["event"] == "checkpoint_rejected"
    assert json.loads((ckdir / handoff.LATEST_FILE).read_text())["step"] == 1


def test_an_older_step_after_a_newer_one_is_ignored(rd: RunDir, tmp_path: Path) -> None:
    """A leftover worker of a lost round publishes step 3 after step 5: the record stays at step 5."""
    ckdir = tmp_path / "ckpt"
    newer, older = _save(ckdir, "step-5.pt"), _save(ckdir, "step-3.pt")
    handoff.publish(rd, ckdir, newer, 5, 1, 0)
    in_force = handoff.publish(rd, ckdir, older, 3, 0, 0)
    assert in_force["path"] == str(newer) and in_force["step"] == 5
    assert handoff.load(rd).checkpoint["step"] == 5
    assert json.loads((ckdir / handoff.LATEST_FILE).read_text())["step"] == 5
    rejected = rd.events()[-1]
    assert rejected["event"] == "checkpoint_rejected" and rejected["step"] == 3
    assert "older than step 5" in rejected["why"]
    assert handoff.resume_path(rd) == str(newer)


def test_an_older_step_is_accepted_once_the_newer_checkpoint_is_gone(rd: RunDir, tmp_path: Path) -> None:
    """The run resumed from an older checkpoint because the newest was deleted: it publishes from there."""
    ckdir = tmp_path / "ckpt"
    newer, older = _save(ckdir, "step-5.pt"), _save(ckdir, "step-3.pt")
    handoff.publish(rd, ckdir, newer, 5, 0, 0)
    newer.unlink()
    handoff.publish(rd, ckdir, older, 3, 1, 0)
    assert handoff.load(rd).checkpoint["step"] == 3


_RACER = r"""
import random, sys
from pathlib import Path
from hpcelastic import handoff
run, ckdir, first = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
steps = list(range(first, 40, 4))
random.Random(first).shuffle(steps)
for step in steps:
    handoff.publish(run, ckdir, ckdir / "c.pt", step, 0, first)
"""


def test_concurrent_publishers_leave_the_newest_step(rd: RunDir, tmp_path: Path) -> None:
    """Four processes publish steps 0-39 in shuffled order at once: record and latest file end at 39."""
    ckdir = tmp_path / "ckpt"
    _save(ckdir, "c.pt")
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER, str(rd.path), str(ckdir), str(first)])
        for first in range(4)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    assert handoff.load(rd).checkpoint["step"] == 39
    assert json.loads((ckdir / handoff.LATEST_FILE).read_text())["step"] == 39
    accepted = {e["step"] for e in rd.events().of(events.CHECKPOINT_PUBLISHED)}
    rejected = {e["step"] for e in rd.events().of(events.CHECKPOINT_REJECTED)}
    assert accepted | rejected == set(range(40)) and not accepted & rejected


def test_publish_into_unusable_checkpoint_dir_is_rejected(rd: RunDir, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    p = _save(tmp_path / "elsewhere", "c.pt")
    with pytest.raises(UserError, match="checkpoint dir"):
        handoff.publish(rd, blocker / "ckpt", p, 5, 0, 0)
    assert handoff.load(rd).checkpoint is None
    assert rd.events()[-1]["event"] == "checkpoint_rejected"


def test_attempt_end_is_recorded_once(rd: RunDir) -> None:
    ex = Executor(say=lambda m: None)
    first = ex.conclude(rd, AttemptEnd(0, Reason.PREEMPTED, 5, None), Settings())
    second = ex.conclude(rd, AttemptEnd(0, Reason.RESTARTS_EXHAUSTED, 3, None), Settings())
    assert (first.action, second.action) == ("skipped", "already_decided")
    assert rd.events().ended_reason(0) is Reason.PREEMPTED and second.reason is Reason.PREEMPTED
    assert _kinds(rd).count("attempt_ended") == 1


def test_a_record_written_by_an_older_version_still_loads(rd: RunDir) -> None:
    old = {
        "version": 1,
        "attempt": 2,
        "job_id": "9",
        "restart_count_slurm": 1,
        "checkpoint_dir": None,
        "checkpoint": None,
        "last_end": {"attempt": 1, "reason": "preempted"},
        "requeues": {"failure": 1},
        "bad_nodes": ["node3"],
    }
    rd.handoff_path.write_text(json.dumps(old))
    rec = handoff.load(rd)
    assert (rec.attempt, rec.job_id, rec.restart_count_slurm) == (2, "9", 1)
    assert "handoff_corrupt" not in _kinds(rd)
    assert set(rec.to_json()) == {
        "version",
        "attempt",
        "job_id",
        "restart_count_slurm",
        "checkpoint_dir",
        "checkpoint",
    }


def test_resume_falls_back_to_older_published_checkpoint(rd: RunDir, tmp_path: Path) -> None:
    ckdir = tmp_path / "ckpt"
    old = _save(ckdir, "step-1.pt")
    new = _save(ckdir, "step-2.pt")
    handoff.publish(rd, ckdir, old, 1, 0, 0)
    handoff.publish(rd, ckdir, new, 2, 0, 0)
    new.unlink()
    assert handoff.resume_path(rd) == str(old)
    missing = rd.events()[-1]
    assert missing["event"] == "checkpoint_missing"
    assert missing["path"] == str(new) and missing["fallback"] == str(old)
    old.unlink()
    assert handoff.resume_path(rd) is None


@pytest.mark.parametrize("damage", ["{not json", '{"version": 1, "attempt": "three"}', "[]", ""])
def test_corrupt_record_is_rebuilt(rd: RunDir, tmp_path: Path, damage: str) -> None:
    ckdir = tmp_path / "ckpt"
    handoff.begin_attempt(rd, "7", 0)
    handoff.begin_attempt(rd, "7", 1)
    p = _save(ckdir, "step-5.pt")
    handoff.publish(rd, ckdir, p, 5, 1, 0)
    rd.record(
        events.attempt_ended(
            attempt=1, reason=Reason.TIME_LIMIT, exit_code=5, signature=None, progressed=True
        )
    )
    rd.handoff_path.write_text(damage)

    rec = handoff.load(rd)

    assert rec.attempt == 1 and rec.job_id == "7" and rec.restart_count_slurm == 1
    assert rec.checkpoint["path"] == str(p) and rec.checkpoint["step"] == 5
    assert rd.events().ended_reason(1) is Reason.TIME_LIMIT
    corrupt = [e for e in rd.events() if e["event"] == "handoff_corrupt"]
    assert len(corrupt) == 1 and corrupt[0]["recovered_checkpoint"] == str(p)
    handoff.HandoffRecord.from_json(json.loads(rd.handoff_path.read_text()))  # rewritten, valid again
    assert handoff.begin_attempt(rd, "7", 1) == 1  # the same allocation is still recognised


def test_expand_resume_and_checkpoint_dir_placeholders() -> None:
    assert handoff.expand_args(["--resume={resume}", "x"], "/c/s.pt", "/d") == ["--resume=/c/s.pt", "x"]
    assert handoff.expand_args(["{resume}"], None, "/d") == [""]
    assert handoff.expand_args(["--ckpt-dir", "{checkpoint_dir}/x"], None, "/d") == ["--ckpt-dir", "/d/x"]


_WRITER = r"""
import sys
from pathlib import Path
from hpcelastic import handoff
run, ckdir, start = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
p = ckdir / "c.pt"
print("ready", flush=True)
step = start
while True:
    step += 1
    handoff.publish(run, ckdir, p, step, 0, 0)
"""


def test_killed_writer_leaves_old_or_new_record(rd: RunDir, tmp_path: Path) -> None:
    """SIGKILL a publishing process at random moments: the record is always whole and never goes back."""
    ckdir = tmp_path / "ckpt"
    _save(ckdir, "c.pt")
    rng = random.Random(4)
    last_step = 0
    kills = 0
    for _ in range(25):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(rd.path), str(ckdir), str(last_step)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += proc.returncode == -signal.SIGKILL
        text = rd.handoff_path.read_text() if rd.handoff_path.exists() else None
        if text is None:
            continue
        rec = handoff.HandoffRecord.from_json(json.loads(text))  # raises on a torn record
        step = rec.checkpoint["step"]
        assert step >= last_step
        latest = json.loads((ckdir / handoff.LATEST_FILE).read_text())
        assert latest["step"] >= step  # the latest file is written first, so never behind the record
        last_step = step
    assert kills == 25 and last_step > 0
    assert not [e for e in rd.events() if e["event"] == "handoff_corrupt"]
    handoff.begin_attempt(rd, "1", 0)  # the next allocation sweeps temp files of killed writers
    assert not list(rd.path.glob(".handoff.json.*"))
