"""What ``--help``, the README and ``sites validate`` tell a new user is true (issue 21, point 5)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpcelastic", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def test_submit_help_shows_the_defaults_of_every_counted_option() -> None:
    text = " ".join(_cli("submit", "--help").stdout.split())
    assert "--max-restarts INTEGER Job-wide worker restarts. [default: 3]" in text
    assert "--nproc-per-node TEXT Workers per node: N or auto. [default: --gpus-per-node, else auto]" in text
    assert "--warm-start / --no-warm-start" in text and "[default: true]" in text
    assert "--stall-timeout FLOAT" in text


def test_submit_takes_no_warm_start_and_a_fractional_stall_timeout_like_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    proc = _cli("submit", "--dry-run", "--no-warm-start", "--stall-timeout", "2.5", str(script))
    assert proc.returncode == 0, proc.stderr
    agent_line = " ".join(line.strip(" \\") for line in proc.stdout.splitlines() if "--" in line)
    assert "--stall-timeout 2.5" in agent_line and "--no-warm-start" in agent_line
    warm = _cli("submit", "--dry-run", str(script))
    assert "--no-warm-start" not in warm.stdout
    run_help = " ".join(_cli("run", "--help").stdout.split())
    assert "--stall-timeout FLOAT RANGE" in run_help


def test_sites_validate_names_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "site.yaml"
    bad.write_text("partition: 3\nmax_restarts: -1\nbogus: 1\nsignal:\n  name: KILL\n")
    proc = _cli("sites", "validate", str(bad))
    assert proc.returncode == 2 and not proc.stdout
    lines = proc.stderr.splitlines()
    assert [line.split(": ")[3] for line in lines[:4]] == [
        "partition",
        "max_restarts",
        "bogus",
        "signal.name",
    ]
    assert lines[4] == f"{bad}: 4 problems; fix them and run again"
    one_line = _cli("submit", "--dry-run", "--site", str(bad), "x.py")
    assert one_line.returncode == 2 and len(one_line.stderr.splitlines()) == 1
    assert "(and 3 more: " in one_line.stderr and "Traceback" not in one_line.stderr


def test_readme_installs_from_the_repository_not_from_an_index() -> None:
    readme = (REPO / "README.md").read_text()
    assert not re.search(r"pip install hpcelastic\b", readme)
    assert "pip wheel --no-deps -w dist ." in readme
