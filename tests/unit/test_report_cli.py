"""``hpcelastic report`` and the ledger in ``hpcelastic status``, as the user runs them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpcelastic.rundir import RunDir
from tests.unit.test_report_browser import synthetic_run
from tests.unit.test_status_cli import assert_one_line_error, hpce


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCELASTIC_"))}
    e["XDG_STATE_HOME"] = str(tmp_path / "state")
    return e


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    rd = RunDir.create(tmp_path / "run")
    rd.events_path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_run()))
    return rd


def test_report_writes_the_page_into_the_run_dir(env: dict[str, str], run: RunDir) -> None:
    out = hpce(env, "report", str(run.path))
    assert out.returncode == 0, out.stderr
    page = run.path / "report.html"
    lines = out.stdout.strip().splitlines()
    assert (
        lines[0].startswith(f"wrote {page} (effective training time ratio ") and "3 incident(s)" in lines[0]
    )
    assert lines[1].startswith("next: open it in a web browser")
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and 'id="timeline"' in html


def test_report_to_a_chosen_file(env: dict[str, str], run: RunDir, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.html"
    out = hpce(env, "report", str(run.path), "-o", str(target))
    assert out.returncode == 0, out.stderr
    assert target.read_text().count('class="failure-marker"') == 3
    assert not (run.path / "report.html").exists()


def test_report_bad_input_is_one_line_and_leaves_nothing(
    env: dict[str, str], run: RunDir, tmp_path: Path
) -> None:
    assert_one_line_error(hpce(env, "report", str(tmp_path / "nope")), "no such run directory")
    assert_one_line_error(hpce(env, "report", str(tmp_path)), "not an hpcelastic run directory")
    missing = tmp_path / "no-such-dir" / "r.html"
    assert_one_line_error(hpce(env, "report", str(run.path), "-o", str(missing)), "no such directory")
    assert not missing.parent.exists()
    before = sorted(p.name for p in run.path.iterdir())
    assert_one_line_error(hpce(env, "report", str(run.path), "-o", str(run.path)), "directory")
    assert sorted(p.name for p in run.path.iterdir()) == before


def test_status_shows_the_ledger_after_the_timeline(env: dict[str, str], run: RunDir) -> None:
    out = hpce(env, "status", str(run.path))
    assert out.returncode == 0, out.stderr
    timeline, ledger = out.stdout.split("\nwhere the time went:\n")
    assert "failure (root cause)" in timeline and "step_ts" not in timeline
    assert ledger.lstrip().startswith("effective training time ratio")
    assert "#1 worker_failure" in ledger and "preemption" in ledger

    data = json.loads(hpce(env, "status", "--json", str(run.path)).stdout)
    assert [i["kind"] for i in data["ledger"]["incidents"]] == [
        "worker_failure",
        "preemption",
        "worker_failure",
    ]
    assert 0 < data["ledger"]["ettr"] <= 1
    assert not any(r["event"] == "progress" for r in data["timeline"])
