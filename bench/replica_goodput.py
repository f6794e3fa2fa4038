"""Step efficiency under a failure every F seconds: torchft replica groups vs a job-wide restart.

The same training (examples/torchft_train.py, STEPS steps of STEP_TIME s, a checkpoint every 10 steps)
runs under ``hpcelastic run`` on 2 "nodes" x 1 CPU gloo worker, twice:

- ``replica groups``: ``--replica-groups 2``; every F seconds a worker is SIGKILLed, alternately in
  group 1 and group 0: only its group restarts and heals from the other;
- ``job-wide restart``: one group of 2 nodes; every F seconds a worker is SIGKILLed: every worker
  restarts from the last published checkpoint (hpcelastic's default path, as torchrun's).

Reported per mode: the job's step efficiency (the fault-free time of STEPS steps, STEPS x the run's own
median step time, over the wall time from the first step to the end) and, for replica groups, the
replica-step efficiency torchft reports (replica-steps committed / replica-steps possible: every group
could have committed every step; a restarted group misses the steps it was out, ``steps_missed`` of
``replica_group_healed``). torchft's published figure: 82.3 % with a failure every 60 s on 300 GPUs
(83.3 % is the bound). Writes the ``replica_goodput`` section of bench/RESULTS.md.

    python bench/replica_goodput.py [--interval 30] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402
from hpcelastic import events  # noqa: E402
from hpcelastic.agent.lighthouse import Lighthouse  # noqa: E402
from hpcelastic.rundir import RunDir  # noqa: E402

EXAMPLE = REPO / "examples" / "torchft_train.py"


def workers(run_dir: Path) -> dict[int, int]:
    """pid -> replica group (0 without groups) of the run's live training workers."""
    found: dict[int, int] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(EXAMPLE) not in (p.info["cmdline"] or []):
                continue
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("HPCELASTIC_RUN_DIR") == str(run_dir):
            found[p.pid] = int(env.get("REPLICA_GROUP_ID", "0"))
    return found


def inject(run_dir: Path, interval: float, stop: threading.Event, kills: list[float]) -> None:
    """Every ``interval`` s after the first step: SIGKILL one worker, alternating the groups."""
    rd = RunDir(run_dir)
    while not (rd.path.is_dir() and rd.events().of(events.PROGRESS)):
        if stop.wait(0.5):
            return
    target = 1
    while not stop.wait(interval):
        live = workers(run_dir)
        pids = [pid for pid, g in live.items() if g == target] or list(live)
        if pids:
            os.kill(max(pids), signal.SIGKILL)
            kills.append(time.time())
            target = 1 - target


def run(
    mode: str, steps: int, step_time: float, interval: float, base: Path, ref_step: float | None = None
) -> dict[str, float]:
    """One training under ``mode``; ``ref_step``: the fault-free step time (else measured here)."""
    run_dir, out = base / f"{mode}-run", base / f"{mode}-out"
    out.mkdir(parents=True)
    groups = ["--replica-groups", "2"] if mode == "replica" else []
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "1"]
    cmd += [
        "--max-restarts",
        "100",
        "--rdzv-timeout",
        "180",
        "--run-dir",
        str(run_dir),
        *groups,
        str(EXAMPLE),
    ]
    cmd += ["--steps", str(steps), "--step-time", str(step_time), "--out-dir", str(out)]
    stop, kills = threading.Event(), []
    thread = threading.Thread(target=inject, args=(run_dir.absolute(), interval, stop, kills), daemon=True)
    thread.start()
    env = dict(os.environ)
    lighthouse = None
    if mode != "replica":  # one group: the script still needs a lighthouse, started here
        lighthouse = Lighthouse("127.0.0.1", 1, base / f"{mode}-lighthouse.log")
        env["TORCHFT_LIGHTHOUSE"] = lighthouse.url
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=base, env=env)
    finally:
        if lighthouse is not None:
            lighthouse.close()
    stop.set()
    thread.join()
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    log = RunDir(run_dir).events()
    first = min(e["step_ts"] for e in log.of(events.PROGRESS))
    end = log.last(events.ATTEMPT_ENDED)["ts"]
    results = [json.loads(p.read_text()) for p in sorted(out.glob("group*.json"))]
    gaps = [b[1] - a[1] for r in results for a, b in zip(r["steps"], r["steps"][1:], strict=False)]
    # A job-wide restart leaves only the last process's steps: too few to measure, take the reference.
    step = ref_step or statistics.median(gaps)
    wall = end - first
    stats = {"wall_s": wall, "step_s": step, "failures": len(kills), "job_eff": steps * step / wall}
    if mode == "replica":
        missed = sum(e.get("steps_missed") or 0 for e in log.of(events.REPLICA_GROUP_HEALED))
        stats["replica_step_eff"] = 1 - missed / (2 * steps)
        stats["identical"] = float(len({json.dumps(r["params"]) for r in results}) == 1)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-time", type=float, default=0.25)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="replica-goodput-") as tmp:
        replica = run("replica", args.steps, args.step_time, args.interval, Path(tmp))
        res = {"replica": replica}
        res["jobwide"] = run(
            "jobwide", args.steps, args.step_time, args.interval, Path(tmp), replica["step_s"]
        )
    r, j = res["replica"], res["jobwide"]
    md = (
        f"{machine_line()}\n\n"
        f"examples/torchft_train.py, {args.steps} steps of ~{r['step_s']:.2f} s on 2 nodes x 1 CPU gloo "
        f"worker; a worker SIGKILLed every {args.interval:g} s of training.\n\n"
        "| mode | failures | wall (s) | job step efficiency | replica-step efficiency |\n"
        "|---|---|---|---|---|\n"
        f"| replica groups (2 x 1 node, torchft) | {r['failures']} | {r['wall_s']:.1f} | {r['job_eff']:.1%} "
        f"| {r['replica_step_eff']:.1%} |\n"
        f"| job-wide restart (1 group of 2 nodes) | {j['failures']} | {j['wall_s']:.1f} | {j['job_eff']:.1%} "
        "| (same as job) |\n"
        f"| torchft published (300 GPUs, failure every 60 s) | | | | 82.3 % (bound 83.3 %) |\n\n"
        f"Groups ended with identical weights: {'yes' if r['identical'] else 'NO'}.\n"
    )
    print(md)
    update_section("replica_goodput", md)


if __name__ == "__main__":
    main()
