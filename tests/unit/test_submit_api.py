"""The Python API's pieces that run without Slurm: the submitit task, its preview, the callable runner."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import click
import cloudpickle
import pytest

from hpcelastic import api, callable_runner, sites
from hpcelastic.errors import UserError
from hpcelastic.jobs.render import render
from hpcelastic.jobs.spec import build_spec
from hpcelastic.jobs.submitit_backend import SubmititBackend


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")


def test_callable_runner_calls_and_rank0_stores_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "callable.pkl"
    path.write_bytes(
        cloudpickle.dumps((lambda a, b=0: {"sum": a + b, "rank": os.environ["RANK"]}, (2,), {"b": 3}))
    )
    monkeypatch.setenv("RANK", "1")
    assert callable_runner.run(path) == {"sum": 5, "rank": "1"}
    assert not (tmp_path / "result.pkl").exists()
    monkeypatch.setenv("RANK", "0")
    callable_runner.run(path)
    assert pickle.loads((tmp_path / "result.pkl").read_bytes()) == {"sum": 5, "rank": "0"}
    assert api.Job(job_id="1", run_dir=tmp_path).result() == {"sum": 5, "rank": "0"}


def test_callable_runner_failure_exits_nonzero_with_traceback(tmp_path: Path) -> None:
    def boom() -> None:
        raise ValueError("bad batch")

    path = tmp_path / "callable.pkl"
    path.write_bytes(cloudpickle.dumps((boom, (), {})))
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic.callable_runner", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 1 and "ValueError: bad batch" in proc.stderr


def test_result_before_completion_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="has not returned"):
        api.Job(job_id="1", run_dir=tmp_path).result()


def test_submitit_preview_requests_one_task_per_node_and_requeue(tmp_path: Path) -> None:
    cfg = sites.resolve("testbed", {"gpus_per_node": 2, "backend": "submitit"})
    spec = build_spec(cfg, script="train.py", nodes="2:3", run_dir=str(tmp_path / "run"))
    text = SubmititBackend().preview(render(spec))
    for line in [
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --nodes=2-3",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@60",
        "#SBATCH --gres=gpu:2",
        "#SBATCH --partition=debug",
    ]:
        assert line in text, line
    assert f"{tmp_path / 'run' / 'submitit'}" in text and "submitit.core._submit" in text


def test_submitit_refuses_resubmit_mode(tmp_path: Path) -> None:
    site = tmp_path / "s.yaml"
    site.write_text("requeue:\n  mode: resubmit\nbackend: submitit\n")
    spec = build_spec(sites.resolve(str(site)), script="train.py")
    with pytest.raises(UserError, match="requeue mode 'requeue' only"):
        SubmititBackend().preview(render(spec))


def test_agent_task_forwards_the_signal_and_runs_finalize(tmp_path: Path) -> None:
    """AgentTask in its own process: the agent stand-in exits 5 on USR2; task 0 then runs finalize."""
    record = tmp_path / "record.json"
    agent = textwrap.dedent(
        f"""
        import json, os, signal, sys, time
        signal.signal(signal.SIGUSR2, lambda *a: (open({str(record)!r}, "w").write(json.dumps(
            {{"got": "USR2", "env": os.environ.get("HPCE_X")}})), sys.exit(5)))
        open({str(tmp_path / "ready")!r}, "w").close()
        time.sleep(30)
        """
    )
    finalize = (
        f"import sys, json; open({str(tmp_path / 'fin')!r}, 'w').write(json.dumps(sys.argv[1:])); sys.exit(5)"
    )
    driver = textwrap.dedent(
        f"""
        from hpcelastic.jobs.submitit_backend import AgentTask, AgentFailed
        task = AgentTask(({sys.executable!r}, "-c", {agent!r}), ({sys.executable!r}, "-c", {finalize!r}),
                         (("HPCE_X", "v"),), ("USR2", "TERM"))
        try:
            task()
        except AgentFailed as e:
            raise SystemExit(e.exit_code)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], env={**os.environ, "SLURM_PROCID": "0"})
    deadline = time.monotonic() + 20
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=20) == 5
    assert json.loads(record.read_text()) == {"got": "USR2", "env": "v"}
    assert json.loads((tmp_path / "fin").read_text()) == ["--exit-code", "5"]


def test_api_prepare_matches_cli_defaults(tmp_path: Path) -> None:
    spec = api.prepare("train.py", ["--x"], site="testbed", nodes="2", env={"K": "v"}, signal="USR1@100")
    assert spec.signal == "USR1" and spec.signal_lead_s == 100 and dict(spec.env)["K"] == "v"
    assert spec.run_dir.startswith(str(tmp_path / "hpcelastic-runs" / "train-"))
    assert spec.checkpoint_dir == os.path.join(spec.run_dir, "checkpoints")


def test_api_keywords_and_cli_flags_are_one_declaration() -> None:
    from hpcelastic.cli.submit_cmd import submit as submit_cmd
    from hpcelastic.jobs.options import API_NAMES, SUBMIT_OPTIONS

    flags = {o.name: (tuple(o.opts), o.envvar) for o in submit_cmd.params if isinstance(o, click.Option)}
    assert set(flags) - {"help"} == {o.name for o in SUBMIT_OPTIONS}
    assert set(API_NAMES) == {o.name for o in SUBMIT_OPTIONS} - {"dry_run", "json"}
    # every flag and HPCELASTIC_<OPTION> variable of before the options were declared once
    assert flags["time"] == (("--time",), "HPCELASTIC_TIME")
    assert flags["sbatch_args"] == (("--sbatch-arg",), "HPCELASTIC_SBATCH_ARG")
    assert flags["max_requeues"] == (("--max-requeues",), "HPCELASTIC_MAX_REQUEUES")
    assert flags["module"] == (("-m", "--module"), "HPCELASTIC_MODULE")
    assert flags["json"] == (("--json",), "HPCELASTIC_JSON")
    for name, key in sites.option_keys().items():
        assert name in flags, key


def test_api_misspelt_option_is_a_type_error_with_a_hint() -> None:
    with pytest.raises(TypeError, match="unknown submit option 'gpu_per_node'; did you mean 'gpus_per_node'"):
        api.prepare("train.py", gpu_per_node=2)
    with pytest.raises(TypeError, match="'dry_run'"):
        api.prepare("train.py", dry_run=True)


def test_api_and_cli_take_their_defaults_from_the_schema(tmp_path: Path) -> None:
    (tmp_path / "site.yaml").write_text("description: empty\n")
    spec = api.prepare("train.py", site=str(tmp_path / "site.yaml"))
    assert (spec.max_requeues, spec.max_restarts) == (
        sites.default("requeue.max_requeues"),
        sites.default("max_restarts"),
    )
    assert (spec.signal, spec.signal_lead_s) == (
        sites.default("signal.name"),
        sites.default("signal.lead_time"),
    )
    assert (spec.nodes_min, spec.nodes_max, spec.nproc_per_node) == (1, 1, "auto")
