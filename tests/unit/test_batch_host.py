"""The batch shell's heartbeat (agent/batch_host.py), written by the template's own loop in bash."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from hpcelastic.agent.batch_host import batch_shell_dead, beat_path
from hpcelastic.resources import data_dir

TEMPLATE = data_dir("sbatch_templates") / "default.sbatch.j2"


def _beat_loop() -> str:
    """The heartbeat block of the batch script template, as bash runs it."""
    text = TEMPLATE.read_text()
    return text[text.index('beat_file="') : text.index("beat_pid=$!")]


def test_a_beating_batch_shell_is_alive_and_a_stopped_one_dead(tmp_path: Path) -> None:
    env = {"HPCELASTIC_RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "42", "PATH": "/usr/bin:/bin"}
    shell = subprocess.Popen(["bash", "-c", _beat_loop() + "wait"], env=env, start_new_session=True)
    path = beat_path(tmp_path, "42")
    try:
        deadline = time.monotonic() + 5
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert re.fullmatch(r"\d+\n", path.read_text())
        assert not batch_shell_dead(path, watch_s=2.5)
    finally:
        os.killpg(shell.pid, signal.SIGKILL)  # the shell and its beat loop (a session of their own)
        shell.wait()
    assert batch_shell_dead(path, watch_s=2.5)


def test_no_heartbeat_file_is_not_a_death(tmp_path: Path) -> None:
    assert not batch_shell_dead(beat_path(tmp_path, "7"), watch_s=0.5)
