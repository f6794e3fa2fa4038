"""Helpers for tests that run against the real Slurm testbed (no mocks: real squeue/scontrol)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import psutil

from hpcelastic.jobs.slurm import ENDED_STATES, parse_scontrol_record


def job_record(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` of a job, parsed (empty if slurmctld no longer knows it)."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return {}
    return parse_scontrol_record(proc.stdout.splitlines()[0])


def wait_job_state(job_id: str, states: Collection[str], timeout: float = 180.0) -> dict[str, str]:
    """Poll ``scontrol show job`` until the job's state is in ``states``; fail with its record otherwise."""
    deadline = time.monotonic() + timeout
    rec: dict[str, str] = {}
    while time.monotonic() < deadline:
        rec = job_record(job_id)
        if rec.get("JobState") in states:
            return rec
        time.sleep(0.5)
    if not rec:  # say why Slurm gave no record: the job unknown, or slurmctld not answering
        why = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
        rec = {"scontrol": (why.stderr or why.stdout).strip(), "ping": (ping.stdout or ping.stderr).strip()}
    raise AssertionError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {rec}")


def wait_job_finished(job_id: str, timeout: float = 300.0) -> dict[str, str]:
    """Wait until the job reached a final state and return its record."""
    return wait_job_state(job_id, ENDED_STATES, timeout)


def events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's event log as a list (every host's event file, merged as ``hpcelastic status`` does)."""
    from hpcelastic.rundir import RunDir

    return [dict(e) for e in RunDir(run_dir).events()]


def event_names(run_dir: Path) -> list[str]:
    """Names of the run's events in order."""
    return [e["event"] for e in events(run_dir)]


def leaked_processes(marker: str | os.PathLike[str]) -> list[psutil.Process]:
    """Live processes with ``HPCELASTIC_RUN_DIR=<marker>`` in their environment (agents, workers...)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("HPCELASTIC_RUN_DIR") == str(marker):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_no_leaks(marker: str, timeout: float = 30.0) -> list[psutil.Process]:
    """Wait until no process of the run is left; return the survivors (empty means clean)."""
    deadline = time.monotonic() + timeout
    left = leaked_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = leaked_processes(marker)
    return left


def wait_nodes_idle(count: int = 4, timeout: float = 120.0) -> None:
    """Wait until ``count`` testbed nodes are idle, so an elastic job gets its full allocation."""
    deadline = time.monotonic() + timeout
    idle = 0
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True).stdout
        idle = sum(1 for line in out.splitlines() if line.split()[-1:] == ["idle"])
        if idle >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"only {idle} of {count} nodes idle after {timeout:.0f} s")


def gres_count(text: str) -> int:
    """The GRES a ``GresUsed`` value of ``scontrol -d show node`` counts: ``gpu:2(IDX:0,2),mps:0`` -> 2."""
    counts = (item.rsplit(":", 1)[-1] for item in re.sub(r"\([^)]*\)", "", text).split(","))
    return sum(int(c) for c in counts if c.isdigit())


def leaked_gres(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Nodes whose GRES Slurm counts as used while no job holds a CPU there: ``{node: GresUsed}``.

    ``env``: the environment of the Slurm commands (its ``SLURM_CONF`` picks the testbed instance).
    Slurm frees a job's CPUs and GRES together, so a node with GRES in use and none of its CPUs
    allocated holds GRES of a job that ended: the next job's step there fails with ``Invalid generic
    resource (gres) specification`` (Slurm 22.05, issue 18).
    """
    argv = ["scontrol", "-d", "show", "node", "-o"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    leaks = {}
    for line in proc.stdout.splitlines():
        node = parse_scontrol_record(line)
        used = node.get("GresUsed", "")
        if gres_count(used) and node.get("CPUAlloc", "0") == "0":
            leaks[node.get("NodeName", "?")] = used
    return leaks


def wait_no_leaked_gres(
    env: Mapping[str, str] | None = None, timeout: float = 30.0, known: Collection[str] = ()
) -> dict[str, str]:
    """Wait until no node but the ``known`` ones holds leaked GRES (:func:`leaked_gres`); the leaks left."""
    deadline = time.monotonic() + timeout
    while True:
        leaks = {node: used for node, used in leaked_gres(env).items() if node not in known}
        if not leaks or time.monotonic() >= deadline:
            return leaks
        time.sleep(0.5)


def testbed_confs(names: Collection[str] | None = None) -> list[Path]:
    """The ``slurm.conf`` of the testbed instances configured on this machine (default first); only those
    ``names`` when given (``"default"`` for the default instance)."""
    found = {"default": Path("/etc/slurm/slurm.conf")}
    found.update(
        {
            p.parts[-3].removeprefix("hpcelastic-testbed-"): p
            for p in sorted(Path("/var/lib").glob("hpcelastic-testbed-*/etc/slurm.conf"))
        }
    )
    return [p for name, p in found.items() if p.is_file() and (names is None or name in names)]


def leaked_gres_everywhere(
    timeout: float = 30.0,
    known: Mapping[str, Collection[str]] | None = None,
    names: Collection[str] | None = None,
) -> dict[str, dict[str, str]]:
    """:func:`wait_no_leaked_gres` on each running testbed instance (or those ``names``): ``{conf: leaks}``.

    ``known``: leaks seen earlier (an earlier result), neither waited for nor reported again.
    """
    known = known or {}
    found = {}
    for conf in testbed_confs(names):
        env = dict(os.environ, SLURM_CONF=str(conf))
        wrappers = conf.parent.parent / "bin"  # an instance of another Slurm release (scripts/testbed.sh)
        if wrappers.is_dir():
            env["PATH"] = f"{wrappers}:{env.get('PATH', '')}"
        if subprocess.run(["scontrol", "ping"], capture_output=True, env=env, timeout=30).returncode != 0:
            continue  # instance not running
        leaks = wait_no_leaked_gres(env, timeout, known.get(str(conf), ()))
        if leaks:
            found[str(conf)] = leaks
    return found


REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "reference_train.py"
CKPT_EVERY = 5


def train_args(steps: int) -> list[str]:
    """The reference training's arguments for a run of ``steps`` steps."""
    return ["--steps", str(steps), "--ckpt-every", str(CKPT_EVERY)]


@functools.cache
def reference_digest(steps: int = 30) -> str:
    """Final-parameter SHA-256 of a fault-free run of ``steps`` steps under plain torchrun."""
    out = Path(tempfile.mkdtemp(prefix="hpcelastic-reference-"))
    env = dict(os.environ, HPCELASTIC_CHECKPOINT_DIR=str(out / "ckpt"))
    env.pop("HPCELASTIC_RUN_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(TRAIN), *train_args(steps), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((out / "final.json").read_text())["sha256"]


def submit_argv(run_dir: Path, site: str = "testbed") -> list[str]:
    """``hpcelastic submit --json`` on ``site`` into ``run_dir``, through the real CLI: the flags follow."""
    return [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", site, "--run-dir", str(run_dir)]


def submit_reference(
    tmp_path: Path,
    *flags: str,
    site: str = "testbed",
    train: tuple[str, ...] = (),
    steps: int = 30,
    time_limit: str = "10",
) -> tuple[str, Path]:
    """Submit the reference training through the real CLI; returns (job id, run dir)."""
    run_dir = tmp_path / "run"
    wait_nodes_idle()
    argv = submit_argv(run_dir, site)
    argv += ["--time", time_limit, *flags, str(TRAIN), *train_args(steps)]
    argv += ["--out", str(tmp_path / "out"), *train]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    return str(info["job_id"]), Path(info["run_dir"])


def final_digest(tmp_path: Path) -> str:
    """The SHA-256 the reference training wrote at its end."""
    return json.loads((tmp_path / "out" / "final.json").read_text())["sha256"]


def named(evs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The events called ``name``."""
    return [e for e in evs if e["event"] == name]


def status_json(target: str) -> dict[str, Any]:
    """``hpcelastic status --json TARGET`` through the real CLI."""
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", "--json", target], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def wait_for_event(run_dir: Path, name: str, timeout: float = 120, **match: object) -> dict[str, Any]:
    """Wait for the first event ``name`` whose fields equal ``match``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in events(run_dir):
            if ev["event"] == name and all(ev.get(k) == v for k, v in match.items()):
                return ev
        time.sleep(0.3)
    seen = [e["event"] for e in events(run_dir)]
    raise AssertionError(f"no {name} {match} event in {timeout} s: {seen}\n{run_dir_logs(run_dir)}")


def run_dir_logs(run_dir: Path, lines: int = 8, limit: int = 4000) -> str:
    """The last ``lines`` of each log in ``run_dir`` (Slurm's outputs, agents' and ranks' logs), newest
    first, at most ``limit`` characters: what a failed wait shows of why."""
    logs = [p for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err")]
    parts = []
    for path in sorted(logs, key=lambda p: p.stat().st_mtime, reverse=True):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path.relative_to(run_dir)}\n" + "\n".join(tail))
    return "\n".join(parts)[:limit]
