"""Slurm's output as 22.05 and 24.11 really print it (tests/unit/slurm_outputs/, captured from the testbed's
two releases by its capture.py), through hpcelastic's parsers: what each release says about a job must reach
the decisions the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcelastic.jobs import slurm
from hpcelastic.jobs.slurm_output import (
    config_values,
    cred_expire_s,
    job_records_from_json,
    parse_exit_code,
    parse_records,
    parse_release,
    parse_rows,
)
from hpcelastic.lifecycle.classify import Stop, slurm_ending

OUTPUTS = Path(__file__).parent / "slurm_outputs"
RELEASES = ("22.05", "24.11")
CASES = (
    "running",
    "requeued_pending",
    "array_task",
    "cancelled",
    "completed",
    "failed",
    "timeout",
    "node_fail",
)


def text_record(release: str, case: str) -> dict[str, str]:
    records = parse_records((OUTPUTS / release / f"job_{case}.txt").read_text())
    assert len(records) == 1
    return records[0]


def json_record(release: str, case: str) -> dict[str, str] | None:
    path = OUTPUTS / release / f"job_{case}.json"
    if not path.is_file():
        return None  # 22.05's scontrol has no --json
    records = job_records_from_json(path.read_text())
    assert len(records) == 1
    return records[0]


def squeue_json_record(release: str, case: str) -> dict[str, str] | None:
    """The job of ``case`` in ``squeue --json`` (22.05's ignores ``-j`` and lists every job; neither lists a
    job that has ended unless asked for every state)."""
    job_id = text_record(release, case)["JobId"]
    found = job_records_from_json((OUTPUTS / release / f"squeue_{case}.json").read_text())
    mine = [r for r in found if r["JobId"] == job_id]
    assert len(mine) <= 1
    if case in ("running", "requeued_pending", "array_task"):
        assert mine, f"squeue --json of {release} lists no job {job_id}"
    return mine[0] if mine else None


@pytest.mark.parametrize("release", RELEASES)
def test_every_release_captured_is_the_one_named(release: str) -> None:
    assert parse_release((OUTPUTS / release / "sbatch_version.txt").read_text()) == tuple(
        int(x) for x in release.split(".")
    )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("release", RELEASES)
def test_json_and_text_tell_the_same_job(release: str, case: str) -> None:
    """``scontrol --json`` (24.11's data_parser, lists and number objects) and ``squeue --json`` (22.05's
    v0.0.38, strings and integers) give the text record's facts, so a decision reads the same either way."""
    text = slurm.job_info_from(text_record(release, case))
    others = [json_record(release, case), squeue_json_record(release, case)]
    for rec in filter(None, others):
        info = slurm.job_info_from(rec)
        assert info == text, (rec, text_record(release, case))
        for key in ("JobState", "Restarts", "Partition", "BatchHost", "TresPerNode"):
            assert rec.get(key, "") == text_record(release, case).get(key, ""), key


@pytest.mark.parametrize("release", RELEASES)
def test_requeued_job_keeps_its_exclusions_and_counts_its_restart(release: str) -> None:
    for rec in filter(
        None, [text_record(release, "requeued_pending"), json_record(release, "requeued_pending")]
    ):
        assert rec["JobState"] == "PENDING" and rec["Restarts"] == "1"
        assert rec["ExcNodeList"].endswith("1")  # the node the capture excluded
        assert int(rec["NumNodes"].split("-")[0]) == 2  # evidence.partition_capacity reads the low end
        info = slurm.job_info_from(rec)
        assert info.eligible_time is not None and info.state in slurm.PENDING_AGAIN_STATES


@pytest.mark.parametrize("release", RELEASES)
def test_endings_are_classified_alike_on_both_releases(release: str) -> None:
    expected = {
        "node_fail": Stop.NODE_FAILURE,
        "timeout": Stop.TIME_LIMIT,
        "cancelled": Stop.CANCELLED,
        "running": None,
        "array_task": None,
    }
    for case, stop in expected.items():
        rec = text_record(release, case)
        assert slurm_ending(slurm.job_info_from(rec), int(rec["Restarts"])) is stop, case


def test_node_fail_and_timeout_exit_codes_changed_in_24_11() -> None:
    """24.11 gives NODE_FAIL an exit code (signal 1) and a time limit 143:0 (22.05: 0:0 and 0:15): neither
    is read as the job's own exit status, the state alone says why it ended."""
    codes = {
        r: {c: parse_exit_code(text_record(r, c)["ExitCode"]) for c in ("node_fail", "timeout")}
        for r in RELEASES
    }
    assert codes["22.05"] == {"node_fail": (0, 0), "timeout": (0, 15)}
    assert codes["24.11"] == {"node_fail": (0, 1), "timeout": (143, 0)}
    for release in RELEASES:
        assert slurm.job_info_from(text_record(release, "node_fail")).exit_code == codes[release]["node_fail"]


@pytest.mark.parametrize("release", RELEASES)
def test_squeue_rows_of_both_releases(release: str) -> None:
    rows = {case: parse_rows((OUTPUTS / release / f"squeue_{case}.txt").read_text(), 4) for case in CASES}
    assert rows["running"][0][1] == "RUNNING" and rows["running"][0][3]
    assert rows["requeued_pending"][0][1:3] == ["PENDING", "None"]
    assert rows["array_task"][0][0].endswith("_3")
    assert {case: r[0][1] for case, r in rows.items() if case in ("timeout", "node_fail", "failed")} == {
        "timeout": "TIMEOUT",
        "node_fail": "NODE_FAIL",
        "failed": "FAILED",
    }


@pytest.mark.parametrize("release", RELEASES)
def test_nodes_and_config(release: str) -> None:
    node = parse_records((OUTPUTS / release / "node.txt").read_text())[0]
    down = parse_records((OUTPUTS / release / "node_down.txt").read_text())[0]
    assert node["NodeAddr"].startswith("127.0.") and int(node["Port"]) > 17000
    assert "DOWN" in down["State"].upper()
    config = config_values((OUTPUTS / release / "config.txt").read_text(), ["AuthInfo", "SlurmdTimeout"])
    assert cred_expire_s(config["AuthInfo"]) == 10 and config["SlurmdTimeout"] == "10 sec"
    assert cred_expire_s(None) == 120


def test_unknown_json_is_refused() -> None:
    with pytest.raises(ValueError):
        job_records_from_json(json.dumps({"errors": []}))
    with pytest.raises(ValueError):
        job_records_from_json("scontrol: error: something")
