"""Site configs: schema validation, layering and the `hpcelastic sites` commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcelastic import parse, sites
from hpcelastic.cli import cli
from hpcelastic.errors import UserError


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No user config, no site from the environment, and a slurm.conf we control."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HPCELASTIC_SITE", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_shipped_sites_are_valid() -> None:
    names = sites.site_names()
    assert {"default", "testbed"} <= set(names) and len(names) >= 3
    for name in names:
        sites.site_config(name)


def test_testbed_site_values() -> None:
    cfg = sites.site_config("testbed")
    assert cfg.get("partition") == "debug"
    assert cfg.get("max_gpus_per_node") == 4
    assert cfg.get("gpu_request") == "gres"
    assert cfg.get("rdzv_interface") == "lo"
    assert cfg.get("requeue.mode") == "requeue"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("partiton: gpu\n", "partiton: unknown key; did you mean 'partition'?"),
        ("requeue:\n  mdoe: resubmit\n", "requeue.mdoe: unknown key; did you mean 'requeue.mode'?"),
        ("max_gpus_per_node: four\n", "max_gpus_per_node: must be an integer, not a string"),
        ("max_gpus_per_node: 0\n", "max_gpus_per_node: must be at least 1"),
        ("gpu_request: gress\n", "gpu_request: must be one of gpus-per-node, gres (did you mean 'gres'?)"),
        ("requeue: yes\n", "requeue: must be a mapping"),
        ("modules: numpy\n", "modules: must be a list"),
        ("signal:\n  name: USR9\n", "signal.name: 'USR9' is not a signal name"),
        ("time: '1:2:3:4'\n", "time: '1:2:3:4' is not a Slurm time"),
        ("time: 4:00:00\n", "time: must be a string, not an integer (14400) (quote it"),
        ("env:\n  1BAD: x\n", "env: '1BAD' is not a valid environment variable name"),
        ("rdzv_port: true\n", "rdzv_port: must be an integer, not true/false"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("partition: [unclosed\n", "invalid YAML: line 2"),
    ],
)
def test_validate_reports_file_key_and_fix(isolated: Path, text: str, expected: str) -> None:
    path = write(isolated / "site.yaml", text)
    with pytest.raises(UserError) as err:
        sites.validate(sites.load_yaml(path), str(path))
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert "\n" not in message


def test_layers_defaults_site_user_command_line(isolated: Path) -> None:
    site = write(
        isolated / "mysite.yaml",
        "partition: site-p\nqos: site-q\naccount: site-a\nenv:\n  A: site\n  B: site\n",
    )
    write(isolated / "xdg" / "hpcelastic" / "config.yaml", "qos: user-q\naccount: user-a\nenv:\n  B: user\n")
    cfg = sites.resolve(str(site), {"account": "cli-a", "partition": None})
    assert cfg.get("max_restarts") == 3  # built-in default
    assert cfg.get("partition") == "site-p"  # site (the command line gave None)
    assert cfg.get("qos") == "user-q"  # user file beats site
    assert cfg.get("account") == "cli-a"  # command line beats all
    assert cfg.get("env") == {"A": "site", "B": "user"}  # env merges key by key
    assert cfg.sources == [
        "built-in defaults",
        str(site),
        str(isolated / "xdg/hpcelastic/config.yaml"),
        "command line",
    ]


def test_bad_user_file_is_reported_with_its_path(isolated: Path) -> None:
    user = write(isolated / "xdg" / "hpcelastic" / "config.yaml", "acount: x\n")
    with pytest.raises(UserError, match=rf"^{user}: acount: unknown key; did you mean 'account'\?"):
        sites.resolve("default")


def test_command_line_values_name_the_flag() -> None:
    with pytest.raises(UserError, match=r"command line: --time: 'soon' is not a Slurm time"):
        sites.resolve("default", {"time": "soon"})


def test_site_detected_from_cluster_name(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(isolated / "slurm.conf", "SlurmctldHost=x\nClusterName=testbed\n")
    assert sites.resolve().site == "testbed"
    write(isolated / "slurm.conf", "ClusterName=perlmutter\n")
    assert sites.resolve().site == "perlmutter"
    write(isolated / "slurm.conf", "ClusterName=elsewhere\n")
    assert sites.resolve().site == "default"
    monkeypatch.setenv("HPCELASTIC_SITE", "testbed")
    assert sites.resolve().site == "testbed"


def test_unknown_site_suggests_a_name() -> None:
    with pytest.raises(UserError, match=r"unknown site 'testbd'; did you mean 'testbed'\?"):
        sites.resolve("testbd")


def test_a_site_is_found_in_the_site_dir_then_the_user_then_the_system_then_the_examples(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system, env_a, env_b = isolated / "etc", isolated / "env-a", isolated / "env-b"
    monkeypatch.setattr(sites, "SYSTEM_SITES_DIR", system)
    user = isolated / "xdg" / "hpcelastic" / "sites"
    write(system / "lab.yaml", "description: from the system\npartition: sys\n")
    assert sites.site_config("lab").get("partition") == "sys"
    write(user / "lab.yaml", "description: from the user\npartition: usr\n")
    write(user / "testbed.yaml", "description: my testbed\npartition: mine\n")  # before the example's
    assert sites.site_config("lab").get("partition") == "usr"
    assert sites.resolve("testbed").get("partition") == "mine"
    write(env_b / "lab.yaml", "partition: envb\n")
    monkeypatch.setenv("HPCELASTIC_SITE_DIR", f"{env_a}:{env_b}")  # env_a does not exist: skipped
    resolved = sites.resolve("lab")
    assert resolved.get("partition") == "envb" and resolved.site == "lab"
    assert resolved.sources == ["built-in defaults", str(env_b / "lab.yaml")]
    files = sites.site_files()
    assert files["lab"] == (env_b / "lab.yaml", "$HPCELASTIC_SITE_DIR")
    assert files["testbed"] == (user / "testbed.yaml", "user") and files["perlmutter"][1] == "packaged"
    write(isolated / "slurm.conf", "ClusterName=lab\n")
    assert sites.resolve().site == "lab"  # detected from ClusterName in any of the directories


def test_sites_list_says_where_each_site_comes_from(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(isolated / "mine" / "lab.yaml", "description: our lab\n")
    monkeypatch.setenv("HPCELASTIC_SITE_DIR", str(isolated / "mine"))
    result = CliRunner().invoke(cli, ["sites", "list"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if " lab " in x)
    assert f"our lab  [$HPCELASTIC_SITE_DIR: {isolated / 'mine' / 'lab.yaml'}]" in line
    rows = json.loads(CliRunner().invoke(cli, ["sites", "list", "--json"]).output)["sites"]
    assert {r["name"]: r["from"] for r in rows}["lab"] == "$HPCELASTIC_SITE_DIR"
    assert {r["name"]: r["from"] for r in rows}["default"] == "packaged"


def test_an_unknown_site_names_the_directories_searched_and_that_a_path_works(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPCELASTIC_SITE_DIR", str(isolated / "mine"))
    with pytest.raises(UserError) as err:
        sites.resolve("nowhere")
    text = str(err.value)
    assert "\n" not in text and str(isolated / "mine") in text and "/etc/hpcelastic/sites" in text
    assert "a path to a YAML file works too" in text
    path = write(isolated / "somewhere" / "x.yaml", "partition: p\n")
    assert sites.resolve(str(path)).get("partition") == "p"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30", 1800), ("30:15", 1815), ("2:00:00", 7200), ("1-2", 93600), ("1-2:30", 95400), ("1-0:0:5", 86405)],
)
def test_parse_time_accepts_slurm_forms(text: str, seconds: int) -> None:
    assert parse.parse_time(text) == seconds
    assert parse.parse_time(parse.format_time(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "0", "1h", "1:2:3:4", "-5", "1-", "a-1"])
def test_parse_time_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse.parse_time(text)


def test_cli_sites_list_show_validate(isolated: Path) -> None:
    runner = CliRunner()
    listed = runner.invoke(cli, ["sites", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    assert {s["name"] for s in json.loads(listed.output)["sites"]} >= {"default", "testbed"}
    shown = runner.invoke(cli, ["sites", "show", "testbed", "--json"])
    assert shown.exit_code == 0
    assert json.loads(shown.output)["config"]["requeue"]["mode"] == "requeue"
    good = write(isolated / "good.yaml", "partition: gpu\nrequeue:\n  mode: resubmit\n")
    ok = runner.invoke(cli, ["sites", "validate", str(good)])
    assert ok.exit_code == 0 and "OK (2 keys set)" in ok.output


def test_cli_sites_validate_bad_file_exit_2(isolated: Path) -> None:
    import subprocess
    import sys

    bad = write(isolated / "bad.yaml", "requeue:\n  max_requeue: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "sites", "validate", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"hpcelastic: error: {bad}: requeue.max_requeue: unknown key; did you mean 'requeue.max_requeues'?"
    ]
