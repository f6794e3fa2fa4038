"""One parser per concept: every command line and the API accept and refuse values alike."""

from __future__ import annotations

import signal

import pytest

from hpcelastic import parse
from hpcelastic.errors import UserError


@pytest.mark.parametrize(
    ("text", "expected"), [("4", (4, 4)), ("2:4", (2, 4)), (" 2 : 4 ", (2, 4)), (3, (3, 3))]
)
def test_nodes(text: str | int, expected: tuple[int, int]) -> None:
    assert parse.parse_nodes(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "at least one node"),
        ("4:2", "N_MIN is larger than N_MAX; write it as 2:4"),
        ("٣", "is not N or N_MIN:N_MAX"),
        ("1_0", "is not N or N_MIN:N_MAX"),
        ("", "is not N or N_MIN:N_MAX"),
    ],
)
def test_nodes_refused(text: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse.parse_nodes(text)


def test_nproc() -> None:
    assert parse.parse_nproc("auto") is None
    assert parse.parse_nproc("AUTO") is None
    assert parse.parse_nproc("8") == 8
    for bad in ("0", "²", "-1", "x", "1.5"):
        with pytest.raises(UserError, match=f"--nproc-per-node {bad!r} must be a positive integer or 'auto'"):
            parse.parse_nproc(bad)


def test_signals() -> None:
    assert parse.signal_name("sigusr2") == parse.signal_name(12) == "USR2"
    assert parse.signal_name("FOO") is None and parse.signal_name("999") is None
    assert parse.parse_signal("USR1") is signal.SIGUSR1
    with pytest.raises(UserError, match="--signal 'FOO' is not a signal name"):
        parse.parse_signal("FOO")
    assert parse.parse_signal_lead("TERM@0") == ("TERM", 0)
    for bad in ("USR2", "USR2@-5", "USR2@²", "FOO@1"):
        with pytest.raises(UserError, match="is not SIG@SECONDS"):
            parse.parse_signal_lead(bad)
    with pytest.raises(UserError, match="at most 65535 s"):
        parse.parse_signal_lead("USR2@65536")


def test_env_and_module_names() -> None:
    assert parse.parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    assert not parse.is_env_name("1A") and not parse.is_env_name(3) and parse.is_env_name("_A1")
    with pytest.raises(UserError, match="NUL byte"):
        parse.parse_env(["A=\0"])
    assert parse.check_module_name("pkg.train") == "pkg.train"
    with pytest.raises(UserError, match="is not a Python module name"):
        parse.check_module_name("a b")


@pytest.mark.parametrize(
    "options",
    [
        ["--array=0-1"],
        ["--array", "1,3"],
        ["--arr=0-7:2"],
        ["-a0-3"],
        ["-a", "2-3%1"],
        ["-a=4-5"],
        ["--array"],
    ],
)
def test_a_job_array_of_several_tasks_is_refused(options: list[str]) -> None:
    with pytest.raises(UserError, match=f"--sbatch-arg '{options[0]}': job arrays of several tasks"):
        parse.check_no_task_array(["--mem=0", *options], "--sbatch-arg")


@pytest.mark.parametrize(
    "options", [[], ["--array=3"], ["--array", "7%1"], ["-a5"], ["--account=x", "-A", "y"]]
)
def test_one_task_or_no_array_is_accepted(options: list[str]) -> None:
    parse.check_no_task_array(options, "--sbatch-arg")
