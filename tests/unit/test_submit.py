"""`hpcelastic submit`: bad input, dry run, environment variables, and what a submission leaves behind."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hpcelastic import sites
from hpcelastic.cli import cli
from hpcelastic.errors import SlurmError
from hpcelastic.jobs.backend import submit_request
from hpcelastic.jobs.render import JobRequest, render
from hpcelastic.jobs.spec import build_spec
from hpcelastic.rundir import RunDir


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A submit directory with a training script, no user config and a pinned site."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HPCELASTIC_SITE", "testbed")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


def run_cli(
    cwd: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "hpcelastic", "submit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )


BAD_INPUT = [
    (["--site", "nosuch", "train.py"], "unknown site 'nosuch'"),
    (["--site", "broken.yaml", "train.py"], "broken.yaml: invalid YAML: line 2"),
    (["--nodes", "0", "train.py"], "--nodes '0': at least one node is needed"),
    (["--nodes", "4:2", "train.py"], "--nodes '4:2': N_MIN is larger than N_MAX"),
    (["--nodes", "two", "train.py"], "--nodes 'two' is not N or N_MIN:N_MAX"),
    (["--gpus-per-node", "8", "train.py"], "--gpus-per-node 8 is more than site 'testbed' has per node (4)"),
    (["missing.py"], "training script 'missing.py' does not exist"),
    (["--time", "1h", "train.py"], "--time: '1h' is not a Slurm time"),
    (["--time", "1", "train.py"], "signal lead time (60 s) is not shorter than --time (60 s)"),
    (["--env", "NOEQUALS", "train.py"], "--env 'NOEQUALS' is not KEY=VALUE"),
    (["--env", "UID=5", "train.py"], "UID cannot be set for the job"),
    (["--signal", "USR2", "train.py"], "--signal 'USR2' is not SIG@SECONDS"),
    (["--job-name", "a\tb", "train.py"], "contains a control character"),
    (["--run-dir", "afile/run", "train.py"], "cannot create run directory"),
    (["--template", "nosuch.j2", "train.py"], "template 'nosuch.j2' not found"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(
    workdir: Path, args: list[str], message: str
) -> None:
    (workdir / "broken.yaml").write_text("partition: [debug\n")
    (workdir / "afile").write_text("not a directory\n")
    before = sorted(p.name for p in workdir.iterdir())
    proc = run_cli(workdir, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcelastic: error: "), proc.stderr
    assert message in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(p.name for p in workdir.iterdir()) == before


def test_sbatch_failure_is_one_line_and_removes_the_run_dir(workdir: Path) -> None:
    """Real sbatch, with a partition no cluster has: it refuses, and the run directory is removed."""
    before = sorted(p.name for p in workdir.iterdir())
    proc = run_cli(workdir, "--partition", "no-such-partition-hpce", "train.py")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcelastic: error: sbatch"), proc.stderr
    assert sorted(p.name for p in workdir.iterdir()) == before  # not even ./hpcelastic-runs remains


def test_dry_run_prints_the_script_and_creates_nothing(workdir: Path) -> None:
    proc = run_cli(
        workdir, "--nodes", "2", "--dry-run", "--run-dir", "r1", "train.py", "--nodes", "7", "--lr=3"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=2\n" in proc.stdout
    assert proc.stdout.rstrip().endswith("exit $?")
    assert f"sbatch --parsable {workdir / 'r1' / 'job.sbatch'}" in proc.stderr
    assert not (workdir / "r1").exists() and not (workdir / "hpcelastic-runs").exists()
    # arguments after the script belong to the script, even ones that look like submit's own
    assert f"-- {workdir / 'train.py'} --nodes 7 --lr=3 &" in proc.stdout


def test_options_from_environment_variables(workdir: Path) -> None:
    env = {
        "HPCELASTIC_NODES": "2:3",
        "HPCELASTIC_GPUS_PER_NODE": "2",
        "HPCELASTIC_MAX_RESTARTS": "7",
        "HPCELASTIC_SIGNAL": "USR1@120",
        "HPCELASTIC_ENV": "A=1 B=2",
        "HPCELASTIC_JOB_NAME": "from-env",
    }
    result = CliRunner().invoke(cli, ["submit", "--dry-run", "--json", "train.py"], env=env)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    argv = out["agent_argv"]
    assert argv[argv.index("--nodes") + 1] == "2:3"
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[argv.index("--max-restarts") + 1] == "7"
    assert argv[argv.index("--signal") + 1] == "USR1"
    assert "#SBATCH --signal=B:USR1@120" in out["script"] and "#SBATCH --job-name=from-env" in out["script"]
    assert "export A=1\nexport B=2\n" in out["script"]
    # the command line beats the environment
    result = CliRunner().invoke(cli, ["submit", "--dry-run", "--json", "--nodes", "4", "train.py"], env=env)
    argv = json.loads(result.output)["agent_argv"]
    assert argv[argv.index("--nodes") + 1] == "4:4"


class RecordingBackend:
    """A Backend that records the request instead of talking to Slurm (tests the run directory only)."""

    name = "recording"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[bytes] = []

    def preview(self, request: JobRequest) -> str:
        return request.script_text

    def submit(self, request: JobRequest, run_dir: RunDir) -> str:
        self.seen.append(run_dir.script_path.read_bytes())
        if self.fail:
            raise SlurmError("sbatch failed: Invalid account")
        return "4242"


def _spec(workdir: Path, run_dir: str):
    cfg = sites.resolve("testbed", {"gpus_per_node": 2})
    return build_spec(cfg, script="train.py", script_args=["--lr", "3e-4"], nodes="2", run_dir=run_dir)


def test_submission_writes_the_run_directory(workdir: Path) -> None:
    request = render(_spec(workdir, "runs/a"))
    backend = RecordingBackend()
    job_id, run = submit_request(request, backend)
    assert job_id == "4242"
    assert backend.seen == [request.script_text.encode()]  # sbatch got exactly the dry-run text
    assert stat.S_IMODE(run.path.stat().st_mode) == 0o700
    assert stat.S_IMODE(run.secret_path.stat().st_mode) == 0o600 and len(run.read_secret()) == 64
    assert run.read_secret() not in run.script_path.read_text()
    config = yaml.safe_load(run.config_path.read_text())
    assert config["partition"] == "debug" and config["gpus_per_node"] == 2
    meta = run.read_meta()
    assert meta["nodes"] == "2:2" and meta["script_args"] == ["--lr", "3e-4"] and meta["site"] == "testbed"
    (event,) = run.events()
    assert event["event"] == "submitted" and event["job_id"] == "4242" and event["nodes"] == "2:2"
    assert run.latest_job_id() == "4242"
    assert (run.path / "checkpoints").is_dir()


def test_failed_submission_leaves_nothing_behind(workdir: Path) -> None:
    request = render(_spec(workdir, "deep/er/run"))
    with pytest.raises(SlurmError):
        submit_request(request, RecordingBackend(fail=True))
    assert not (workdir / "deep").exists()


def test_existing_run_dir_is_refused(workdir: Path) -> None:
    (workdir / "taken").mkdir()
    proc = run_cli(workdir, "--run-dir", "taken", "train.py")
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert list((workdir / "taken").iterdir()) == []


def test_help_and_dry_run_do_not_import_torch(workdir: Path) -> None:
    for args in (["--help"], ["submit", "--dry-run", "train.py"]):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "hpcelastic", *args],
            cwd=workdir,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
        assert "hpcelastic" in imported
        assert not {m for m in imported if m == "torch" or m.startswith("torch.")}
        if args == ["--help"]:
            assert not {"jinja2", "yaml"} & imported
