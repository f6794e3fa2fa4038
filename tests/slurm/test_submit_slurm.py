"""`hpcelastic submit` against the real Slurm testbed (scripts/testbed.sh up).

The node agent is stood in for by a recording interpreter (the site's ``python:`` key, set through
the user config layer): it proves what the rendered script does under real sbatch and srun (two
nodes, one task each, GPUs requested, the agent's argv and environment intact, finalize after the
step) without depending on the agent itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcelastic.jobs import slurm
from hpcelastic.rundir import RunDir

pytestmark = pytest.mark.slurm

RECORDER = """#!{python}
import json, os, signal, sys, time
run = os.environ["HPCELASTIC_RUN_DIR"]
rec = {{"argv": sys.argv[1:], "node": os.environ.get("SLURMD_NODENAME"),
        "ntasks": os.environ.get("SLURM_NTASKS"), "user_env": os.environ.get("HPCE_T"), "signal": None}}
def save(*_):
    with open(os.path.join(run, "rec-%s-%s-%d.json" % (sys.argv[3], rec["node"], os.getpid())), "w") as f:
        json.dump(rec, f)
def on_usr2(*_):
    rec["signal"] = "USR2"
    save()
    sys.exit(0)
if sys.argv[3] == "agent" and os.environ.get("HPCE_WAIT_FOR_SIGNAL"):
    signal.signal(signal.SIGUSR2, on_usr2)
    open(os.path.join(run, "ready-%s" % rec["node"]), "w").close()
    time.sleep(120)
save()
"""


def wait_done(job_id: str, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = slurm.query_states([job_id]).get(job_id)
        if row and row.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return row.state
        time.sleep(1)
    slurm.cancel(job_id)
    raise AssertionError(f"job {job_id} did not finish within {timeout_s} s")


def submit(tmp_path: Path, *flags: str) -> dict:
    """Submit train.py with the recording interpreter; return submit's --json output."""
    recorder = tmp_path / "recording-python"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    (tmp_path / "xdg" / "hpcelastic").mkdir(parents=True)
    (tmp_path / "xdg" / "hpcelastic" / "config.yaml").write_text(f"python: {json.dumps(str(recorder))}\n")
    (tmp_path / "train.py").write_text("print('hi')\n")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", "testbed", "--run-dir", "run"]
    proc = subprocess.run([*argv, *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_two_nodes_one_agent_each_with_args_intact(tmp_path: Path) -> None:
    args = ["--lr", "3e-4", "it's a $(test)", "`id`", "ünï"]
    flags = [
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--time",
        "5",
        "--env",
        "HPCE_T=a b'c",
        "train.py",
        *args,
    ]
    out = submit(tmp_path, *flags)
    job = slurm.show_job(out["job_id"])
    assert wait_done(out["job_id"]) == "COMPLETED"
    run = Path(out["run_dir"])
    agents = [json.loads(p.read_text()) for p in sorted(run.glob("rec-agent-*.json"))]
    assert len(agents) == 2 and len({a["node"] for a in agents}) == 2
    for a in agents:
        assert a["ntasks"] == "2" and a["user_env"] == "a b'c"
        assert a["argv"][a["argv"].index("--") + 1 :] == [str(tmp_path / "train.py"), *args]
        assert a["argv"][a["argv"].index("--nodes") + 1] == "2:2"
    (fin,) = [json.loads(p.read_text()) for p in run.glob("rec-finalize-*.json")]
    assert fin["argv"][-2:] == ["--exit-code", "0"]
    assert (run / f"slurm-{out['job_id']}.out").exists()
    assert job["Requeue"] == "1" and job["NumNodes"].startswith("2")
    assert "gpu:2" in job.get("TresPerNode", "")
    assert [e["event"] for e in RunDir(run).events()] == ["submitted"]


def test_signal_to_the_batch_shell_reaches_every_agent(tmp_path: Path) -> None:
    """The batch shell traps USR2 (as Slurm sends it with --signal=B:) and forwards it to srun's tasks."""
    out = submit(tmp_path, "--nodes", "2", "--time", "5", "--env", "HPCE_WAIT_FOR_SIGNAL=1", "train.py")
    run = Path(out["run_dir"])
    deadline = time.monotonic() + 120
    while len(list(run.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(list(run.glob("ready-*"))) == 2, "agents did not start"
    slurm.cancel(out["job_id"], signal="USR2", batch=True)
    assert wait_done(out["job_id"]) == "COMPLETED"
    agents = [json.loads(p.read_text()) for p in run.glob("rec-agent-*.json")]
    assert sorted(a["signal"] for a in agents) == ["USR2", "USR2"]
    (fin,) = [json.loads(p.read_text()) for p in run.glob("rec-finalize-*.json")]
    assert fin["argv"][-3:] == ["--exit-code", "0", "--stopped"]
