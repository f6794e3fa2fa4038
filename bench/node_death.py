"""Node death to survivors training again in the same allocation (target < 3 s after the node's
processes die, whatever SlurmdTimeout is).

Needs the Slurm testbed script (scripts/testbed.sh); brings up its own 3-node instance ``faults``
(SlurmdTimeout 10 s), the one tests/slurm/test_slurm_faults.py uses, and takes it down at the end.
Each run submits the reference training with ``hpcelastic submit --nodes 2:3`` on 3 nodes, waits
until it trains, then makes ``faults3`` die in one of two ways, at one instant ``t0``:

* ``kill``: SIGKILL to the node's slurmd and every process of its jobs (``testbed.sh kill-node``'s
  set): the peers' kernel resets the connections, as when a node's processes crash;
* ``silent``: SIGSTOP to the same processes (SIGKILL 15 s later): nothing answers and no
  connection closes, as when a node loses power or its network; only heartbeats notice.

Measured from ``t0``: the coordinator's ``node_lost``, the survivors' new workers spawned
(``workers_started``) and their first training step (the round's first ``progress``, the
worker's own time stamp). Slurm marks the node DOWN only after SlurmdTimeout; the job is not
touched by it (``--no-kill``). Everything submitted is scancelled.

    python bench/node_death.py [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from _results import machine_line, update_section  # noqa: E402

from hpcelastic.rundir import RunDir  # noqa: E402
from tests.testbed import Testbed  # noqa: E402

NODES = ("faults1", "faults2", "faults3")
VICTIM = "faults3"
TRAIN = REPO / "examples" / "reference_train.py"
LOCK = Path("/var/lock/hpcelastic-testbed-faults.lock")
MODES = ("kill", "silent")


def submit(tmp: Path) -> tuple[str, Path]:
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", "testbed"]
    argv += ["--run-dir", str(tmp / "run"), "--time", "10", "--nodes", "2:3", "--sbatch-arg=--nodes=3"]
    argv += [str(TRAIN), "--steps", "2000", "--ckpt-every", "100", "--step-time", "0.05", "--out", str(tmp)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp, check=True)
    info = json.loads(proc.stdout)
    return str(info["job_id"]), Path(info["run_dir"])


def events(run: Path) -> list[dict[str, Any]]:
    return [dict(e) for e in RunDir(run).events()] if run.is_dir() else []


def wait_for(run: Path, test: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(run):
            if test(e):
                return e
        time.sleep(0.1)
    raise RuntimeError(f"timed out in {run}: {[e['event'] for e in events(run)]}")


def one_run(tb: Testbed, mode: str) -> dict[str, float]:
    for node in NODES:
        if not tb.node_state(node).startswith("idle"):
            tb.revive_node(node)
        tb.wait_node_state(node, ("idle",), 120)
    tmp = Path(tempfile.mkdtemp(prefix="hpce-node-death-"))
    job_id, run = submit(tmp)
    try:
        wait_for(run, lambda e: e["event"] == "progress", 120)
        time.sleep(2.0)
        pids = tb.node_pids(VICTIM)
        sig = signal.SIGKILL if mode == "kill" else signal.SIGSTOP
        t0 = time.time()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        lost = wait_for(run, lambda e: e["event"] == "node_lost", 60)
        started = wait_for(run, lambda e: e["event"] == "workers_started" and e["round"] > 0, 60)
        first = wait_for(
            run, lambda e: e["event"] == "progress" and e["round"] == started["round"] and e["step"] > 0, 60
        )
        if mode == "silent":
            time.sleep(15)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return {
            "lost": float(lost["ts"]) - t0,
            "spawned": float(started["spawned_ts"]) - t0,
            "training": float(first["step_ts"]) - t0,
        }
    finally:
        tb.slurm("scancel", job_id, check=False)
        tb.revive_node(VICTIM)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tb = Testbed("faults", {"index": "7", "nodes": "3", "slurmd_timeout": "10"})
        tb.down()
        tb.up()
        os.environ["SLURM_CONF"] = tb.slurm_conf
        try:
            for i in range(args.runs):
                for mode in MODES:
                    r = one_run(tb, mode)
                    results[mode].append(r)
                    print(f"run {i} {mode}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items()), flush=True)
        finally:
            tb.slurm("scancel", "-u", str(os.getuid()), check=False)
            tb.down()
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    for m in MODES:
        training = med[m]["training"]
        print(f"{m}: node death -> survivors training again: median {training:.2f} s ({args.runs} runs)")
    lines = [
        "## Node death to survivors training again (`bench/node_death.py`)",
        "",
        machine_line(),
        "Slurm 22.05 testbed instance `faults` (3 nodes, SlurmdTimeout 10 s);",
        "`hpcelastic submit --nodes 2:3` on 3 nodes, reference training (gloo, CPU, 1 worker per node);",
        f"faults3 dies at t0; median of {args.runs} runs, seconds after t0. Target: training again < 3 s.",
        "",
        "| how the node dies | node_lost | survivors' workers spawned | survivors training again |",
        "|---|---|---|---|",
    ]
    names = {"kill": "processes SIGKILLed (connections reset)", "silent": "node silent (SIGSTOP, heartbeats)"}
    for m in MODES:
        d = med[m]
        lines.append(f"| {names[m]} | {d['lost']:.2f} | {d['spawned']:.2f} | {d['training']:.2f} |")
    lines += [
        "",
        "The job stays RUNNING in the same allocation (`--no-kill`); Slurm drops the node from it when",
        "it marks the node DOWN after SlurmdTimeout, which the survivors do not wait for. A silent node",
        "costs the heartbeat timeout (HPCELASTIC_HEARTBEAT_TIMEOUT, 2 s) on top.",
    ]
    if not args.no_write:
        update_section("node_death", "\n".join(lines))


if __name__ == "__main__":
    main()
