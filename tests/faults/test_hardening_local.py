"""Issue 10 on real local jobs (agents, gloo workers): a long TMPDIR (item 14)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_long_tmpdir_does_not_break_the_heartbeat_socket(
    local_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job-specific TMPDIR deeper than a socket address holds (107 bytes): the agent falls back to a
    short directory and the workers' heartbeats (their steps) still reach it."""
    long_tmp = tmp_path / ("t" * 60) / ("u" * 60)
    long_tmp.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    job = local_job(nodes="1", nproc=1)
    assert job.wait() == [0]
    (ended,) = job.events("attempt_ended")
    assert ended["reason"] == "succeeded" and ended["progressed"] is True
