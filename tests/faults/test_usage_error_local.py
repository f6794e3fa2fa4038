"""A usage error under ``hpcelastic run``, as a new user makes it (issues 30 and 31): hpcelastic's
option after the script (``hpcelastic run --nproc-per-node 2 ddp_train.py --nodes 2``) goes to the script,
which rejects it on every rank before any step. The run ends at once (no restart: a restart cannot mend
it), exit 8, with the script's error and a hint that says where the option belongs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hpcelastic.reasons import Reason
from tests.slurm_utils import events, named

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"


def test_an_option_after_the_script_ends_the_run_once_with_a_hint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nproc-per-node", "2", "--run-dir", str(run)]
    proc = subprocess.run([*argv, str(EXAMPLE), "--nodes", "2"], capture_output=True, text=True, timeout=180)
    said = proc.stdout + proc.stderr  # the workers' lines go to stdout, hpcelastic's to stderr
    assert proc.returncode == Reason.STARTUP_FAILURE.exit_code, proc.stderr[-2000:]
    evs = events(run)
    assert not named(evs, "restarting"), [e["event"] for e in evs]
    assert "unrecognized arguments: --nodes 2" in said
    hint = [line for line in proc.stderr.splitlines() if line.startswith("hpcelastic: hint:")]
    assert hint and "--nodes came after" in hint[0] and "before the script" in hint[0], proc.stderr[-2000:]
    assert "exactly like" not in said and "`hpcelastic run` again" in said  # no round or attempt before
