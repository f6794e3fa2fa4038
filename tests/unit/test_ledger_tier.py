"""The lost-time ledger when the node-local checkpoint tier restores (issue 27, item 8): redone work counts
from the checkpoint the script really resumed from, complete when it was, never when a restore copied it.

Round 0 trains from 2 s (no heartbeats: an unchanged script), the save of ``step-20`` returned at 61.0 s and
the tier knew it complete job-wide at 61.4 s (its scan every 0.5 s); rank 1 crashes at 70 s; round 1 starts
at 75 s. The truth is 70 - 61.0 = 9.0 s redone (or, from what the tier saw, 8.6 s).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from hpcelastic import events as ev
from hpcelastic.agent.resume_watch import ResumeWatch, describe
from hpcelastic.events import RestoreTier
from hpcelastic.record.ledger import Phase, ledger_lines
from tests.unit.test_ledger import (
    ckpt,
    crash_then,
    failure,
    ledger,
    opened,
    rdzv,
    rec,
    spawned,
    start,
    succeed,
)

SAVED, KNOWN, FAILED = 61.0, 61.4, 70.0


def known(ts: float, name: str, step: int, rnd: int = 0) -> dict[str, Any]:
    """The tier's ``tier_checkpoint``: ``name`` complete on every node at ``ts``."""
    return rec(ts, ev.tier_checkpoint(attempt=0, round=rnd, checkpoint=name, step=step, size=100, parts=2))


def restored(ts: float, rnd: int, name: str, step: int | None, tier: RestoreTier) -> dict[str, Any]:
    event = ev.tier_restored(attempt=0, round=rnd, node="n1", node_rank=0, checkpoint=name, step=step,
                             tier=tier, peers=["1"] if tier == RestoreTier.PEER else [], size=100,
                             duration_s=0.3)  # fmt: skip
    return rec(ts, event)


def read(ts: float, path: str, mtime: float) -> dict[str, Any]:
    """Round 1's ``checkpoint_opened`` of a file of ``path`` whose mtime is ``mtime``."""
    return opened(ts, 1, completed=mtime, path=path)


def run(*round_1: dict[str, Any], before: tuple[dict[str, Any], ...] = ()) -> list[dict[str, Any]]:
    """Round 0 with ``before`` inserted after its start (the tier's events), round 1 with ``round_1``."""
    records = crash_then(*round_1)
    return records[:3] + sorted(before, key=lambda r: r["ts"]) + records[3:]


def test_a_fetched_copy_s_mtime_is_not_when_the_checkpoint_was_complete() -> None:
    """The node read a peer's part the restore fetched at 75.4 s: its mtime is the fetch. The old ledger
    took it (kept until the failure: 0.0 s redone); the tier knew the checkpoint complete at 61.4 s."""
    led = ledger(
        run(
            restored(75.5, 1, "step-20", 20, RestoreTier.PEER),
            read(80.0, "step-20", mtime=75.4),
            before=(known(KNOWN, "step-20", 20),),
        )
    )
    (inc,) = led.incidents
    assert (inc.redone_source, inc.resumed_from) == ("checkpoint_opened", "step-20")
    assert inc.redone_work_s == pytest.approx(FAILED - KNOWN)
    # no heartbeats: the step reached at the failure is unknown, so no step count is claimed
    assert inc.redone_steps is None
    assert "redone 8.6 s (the next round read checkpoint step-20)" in ledger_lines(led)[2]


def test_a_file_the_restore_left_in_place_keeps_its_save_time() -> None:
    """The node's own part, hard-linked into place: its mtime is the save's, earlier than the tier's scan."""
    inc = ledger(
        run(
            restored(75.5, 1, "step-20", 20, RestoreTier.LOCAL),
            read(80.0, "step-20", mtime=SAVED),
            before=(known(KNOWN, "step-20", 20),),
        )
    ).incidents[0]
    assert inc.redone_work_s == pytest.approx(FAILED - SAVED)


def test_the_script_s_own_read_wins_over_the_checkpoint_the_tier_restored() -> None:
    """The tier restored step-10, the script read the newer step-20 (a copy made at 75.6 s): redone counts
    from step-20's completion, not step-10's (29.4 s) nor the copy's (0 s)."""
    inc = ledger(
        run(
            restored(75.5, 1, "step-10", 10, RestoreTier.PEER),
            read(80.0, "step-20", mtime=75.6),
            before=(known(40.6, "step-10", 10), known(KNOWN, "step-20", 20)),
        )
    ).incidents[0]
    assert (inc.redone_source, inc.resumed_from) == ("checkpoint_opened", "step-20")
    assert inc.redone_work_s == pytest.approx(FAILED - KNOWN)


def test_a_restore_without_a_read_seen_counts_from_the_restored_checkpoint() -> None:
    """No read observed (the old ledger: unknown): the tier's restore of step-20 is the evidence."""
    led = ledger(
        run(restored(75.5, 1, "step-20", 20, RestoreTier.PEER), before=(known(KNOWN, "step-20", 20),))
    )
    (inc,) = led.incidents
    assert (inc.redone_source, inc.resumed_from) == ("tier_restored", "step-20")
    assert inc.redone_work_s == pytest.approx(FAILED - KNOWN) and inc.unknown_s == 0
    assert "(the local tier restored step-20 for the next round)" in ledger_lines(led)[2]


def test_a_persisted_restore_counts_from_the_completion_its_persist_names() -> None:
    """Only the persist is in the log (its ``duration_s`` after completion); its publish, later, is not
    the completion either."""
    path = "/c/step-20"
    persisted = ev.tier_persisted(attempt=0, checkpoint="step-20", step=20, path=path, size=100,
                                  duration_s=0.6, stop=False)  # fmt: skip
    published = ev.checkpoint_published(path=path, step=20, attempt=0, rank=0, checkpoint_dir="/c")
    led = ledger(
        run(
            restored(75.5, 1, "step-20", 20, RestoreTier.PERSISTED),
            before=(rec(KNOWN + 0.6, persisted), rec(KNOWN + 0.6, published)),
        )
    )
    assert led.incidents[0].redone_work_s == pytest.approx(FAILED - KNOWN)
    assert [c.ts for c in led.checkpoints] == [pytest.approx(KNOWN)]


def test_a_restore_of_nothing_makes_all_training_before_the_failure_redone() -> None:
    """The tier had no complete checkpoint (``none``): round 1 trained from step 0; everything round 0
    trained (2 s to 70 s) was redone. The old ledger called it unknown."""
    led = ledger(run(restored(75.5, 1, "", None, RestoreTier.NONE)))
    (inc,) = led.incidents
    assert inc.redone_source == "tier_restored" and inc.unknown_s == 0
    assert inc.redone_work_s == pytest.approx(FAILED - 2.0)


def test_a_restore_of_nothing_after_a_resumed_round_redoes_the_earlier_rounds_too() -> None:
    """Round 0 trains 2-40 s (step-10 complete at 20 s), crashes; round 1 reads step-10 and trains from 46 s
    until its crash at 70 s; round 2 restores nothing (step-10 was lost): all training since 2 s was redone,
    round 0's time after step-10 charged to the first incident, the rest to the second."""
    c0, c1 = failure(0, 1, "n1", "boom"), failure(1, 1, "n1", "boom")
    records = [
        start(0.0, 0), rdzv(1.0, 0), spawned(2.0, 0), known(20.0, "step-10", 10),
        rec(40.0, ev.root_cause(c0, traceback="", exit_ts=40.0)),
        rdzv(44.0, 1), spawned(45.0, 1), read(46.0, "step-10", mtime=19.8),
        rec(70.0, ev.root_cause(c1, traceback="", exit_ts=FAILED)),
        rdzv(75.0, 2), spawned(76.0, 2), restored(75.5, 2, "", None, RestoreTier.NONE), *succeed(200.0, 0),
    ]  # fmt: skip
    led = ledger(records)
    first, second = led.incidents
    assert first.redone_work_s == pytest.approx(40.0 - 19.8)
    assert second.redone_work_s == pytest.approx((19.8 - 2.0) + (FAILED - 46.0))
    productive = [s for s in led.segments if s.phase is Phase.PRODUCTIVE]
    assert all(s.t0 >= 76.0 for s in productive)


def test_no_step_count_rests_on_checkpoint_marks_alone() -> None:
    """The tier's persists published step-10 and step-15 before the failure; it restored step-20, complete
    by 61.4 s. The old ledger took the last publish (step 15 at 45 s): "redone 25.0 s (0 step(s))"; without
    heartbeats the step reached at the failure is unknown, so no count is claimed."""
    published = [ckpt(t, 0, n) for t, n in ((30.0, 10), (45.0, 15))]
    inc = ledger(
        run(
            restored(75.5, 1, "step-20", 20, RestoreTier.LOCAL),
            before=(*published, known(KNOWN, "step-20", 20)),
        )
    ).incidents[0]
    assert inc.redone_steps is None and inc.redone_work_s == pytest.approx(FAILED - KNOWN)


def test_a_read_of_a_checkpoint_the_round_saved_itself_is_no_resume() -> None:
    """The tier restored nothing; the watch saw a read of step-5, saved by round 1 itself at 90 s (the tier's
    scan judging it). The old ledger took it (kept until the failure: 0.0 s redone); round 1 trained from
    scratch."""
    inc = ledger(
        run(restored(75.5, 1, "", None, RestoreTier.NONE), read(90.2, "step-5", mtime=90.0))
    ).incidents[0]
    assert inc.redone_source == "tier_restored" and inc.redone_work_s == pytest.approx(FAILED - 2.0)


# ---- what the agent watches: the tier's live directory, as a restore fills it -------------------------
def _read(path: Path) -> None:
    path.read_bytes()
    time.sleep(0.01)


def test_the_watch_sees_reads_through_a_restore_s_links_fetched_files_and_symlinks(tmp_path: Path) -> None:
    """A restore places a checkpoint in ``live`` as hard links (own files), fetched files (``os.replace``
    from staging) or a symlink to the persisted copy (a DCP directory, a ``.pt`` file): a worker's read of
    each is seen and named by its path in ``live``. The old watch did not follow symlinks: a read of a
    persisted copy was not seen."""
    live, shared, staging = tmp_path / "live", tmp_path / "shared", tmp_path / "staging"
    for d in (live, shared, staging):
        d.mkdir()
    (shared / "step-30").mkdir()
    (shared / "step-30" / ".metadata").write_bytes(b"meta")
    (shared / "step-35.pt").write_bytes(b"pt")
    (live / "step-30").symlink_to(shared / "step-30")
    (live / "step-35.pt").symlink_to(shared / "step-35.pt")
    (tmp_path / "own.pt").write_bytes(b"own")
    os.link(tmp_path / "own.pt", live / "step-20.pt")
    (staging / "step-25.pt").write_bytes(b"peer")
    os.replace(staging / "step-25.pt", live / "step-25.pt")
    cases = [
        (live / "step-20.pt", "step-20.pt"),
        (live / "step-25.pt", "step-25.pt"),
        (live / "step-30" / ".metadata", "step-30"),
        (live / "step-35.pt", "step-35.pt"),
    ]
    for file, checkpoint in cases:
        watch = ResumeWatch(str(live), 1)
        try:
            _read(file)
            seen = watch.take()
            assert seen == str(file), (file, seen)
            assert describe(watch.root, seen).path == checkpoint
        finally:
            watch.close()


def test_the_agent_s_own_reads_are_not_the_workers(tmp_path: Path) -> None:
    """The tier's scan reads the live directory's files (it judges a ``torch.save`` archive by its end)
    while the watch is armed: those reads are dropped; a worker's read before the scan is kept."""
    (tmp_path / "step-15.pt").write_bytes(b"old")
    (tmp_path / "step-20.pt").write_bytes(b"new")
    watch = ResumeWatch(str(tmp_path), 1)
    try:
        with watch.own_reads():
            _read(tmp_path / "step-15.pt")  # the scan
        assert not watch.pending and watch.take() is None
        _read(tmp_path / "step-20.pt")  # the worker
        with watch.own_reads():
            _read(tmp_path / "step-15.pt")
        assert watch.pending and watch.take() == str(tmp_path / "step-20.pt")
    finally:
        watch.close()
