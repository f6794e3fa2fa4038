"""Step efficiency with a failure every F seconds: torchft replica groups, a job-wide restart and torchrun.

The same training (examples/torchft_train.py, unchanged, run through bench/_replica_train.py which logs
every committed step: STEPS steps of ~STEP_TIME s, a checkpoint every 10 steps through the worker API)
on 2 "nodes" x 1 CPU gloo worker, in three modes, one after the other in the same run:

- ``replica groups``: ``hpcelastic run --replica-groups 2``: a failure restarts only the failed group,
  which heals from the other through torchft's Manager;
- ``job-wide restart``: ``hpcelastic run``, one group of 2 nodes: a failure restarts every worker from the
  last published checkpoint (a lighthouse started here: the script's Manager needs one);
- ``torchrun``: the venv's ``torchrun`` on each node (c10d rendezvous, ``--max-restarts``,
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as in bench/goodput.py): it restarts every worker, which
  resume from the checkpoint named by ``hpcelastic-latest.json`` (the worker API's contract outside the
  agent; a lighthouse started here).

Every F seconds after the first step a worker is SIGKILLed: alternately in group 1 and group 0 (replica
groups), on node 1 and node 0 (the other modes). A mode still running MAX_WALL seconds after its first
step is cut there and measured up to the cut. Definitions (bench/_replica_stats.py): the fault-free step
time is the median gap between two steps committed by the same process, in that mode's run; steps
possible = (last committed step - first step) / fault-free step time + 1; job step efficiency = distinct
steps committed / steps possible; replica-step efficiency (torchft's figure) = (group, step) pairs
committed / (groups x steps possible). torchft's published figure: 82.3 % with a failure every 60 s on
300 GPUs (83.3 % the bound). Writes the ``replica_goodput`` section of bench/RESULTS.md.

    python bench/replica_goodput.py [--interval 30] [--steps 600] [--max-wall 300] [--runs 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._cleanup import tracked  # noqa: E402
from bench._replica_stats import Efficiency, efficiency  # noqa: E402
from bench._replica_train import STEP_LOG_VARIABLE  # noqa: E402
from bench._results import machine_line, update_section  # noqa: E402
from hpcelastic.agent.lighthouse import Lighthouse  # noqa: E402

WRAPPER = REPO / "bench" / "_replica_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
MODES = ("replica", "jobwide", "torchrun")
LABELS = {
    "replica": "replica groups (`hpcelastic run --replica-groups 2`, torchft)",
    "jobwide": "job-wide restart (`hpcelastic run`, 1 group of 2 nodes)",
    "torchrun": "torchrun (`--max-restarts`, c10d)",
}


@dataclass
class Outcome:
    """One mode's run."""

    mode: str
    eff: Efficiency
    failures: int
    finished: bool
    identical: bool | None


def read_log(path: Path) -> list[dict]:
    lines = []
    for text in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            lines.append(json.loads(text))
    return lines


def live_workers(step_log: Path, key: str) -> dict[int, int]:
    """pid -> ``key`` ("group" or "rank") of the mode's live workers that committed a step.

    From the step log: hpcelastic forks restarted workers from a fork server, so neither their
    command line nor /proc's environment names them.
    """
    seen: dict[int, tuple[int, float]] = {}
    for r in read_log(step_log):
        seen.setdefault(r["pid"], (r[key], r["ts"]))
    found = {}
    for pid, (k, ts) in seen.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and p.create_time() <= ts + 1.0:
                found[pid] = k
    return found


def inject(step_log: Path, key: str, interval: float, stop: threading.Event, kills: list[float]) -> None:
    """Every ``interval`` s after the first step: SIGKILL one worker, alternating ``key`` 1, 0, 1, ...

    A target that has not committed a step since its last restart is waited for (never killed in start-up).
    """
    while not read_log(step_log):
        if stop.wait(0.5):
            return
    next_at, target = time.time() + interval, 1
    while not stop.wait(max(0.0, next_at - time.time())):
        pids = [pid for pid, k in live_workers(step_log, key).items() if k == target]
        if not pids:  # the target is restarting: try again shortly
            next_at = time.time() + 0.5
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(max(pids), signal.SIGKILL)
            kills.append(time.time())
            target = 1 - target
        next_at = kills[-1] + interval if kills else time.time() + interval


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(mode: str, base: Path, script: list[str], env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    """The mode's launcher processes (one ``hpcelastic run``, or one torchrun per node)."""
    if mode == "torchrun":
        port, procs = free_port(), []
        for node in range(2):
            cmd = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
            cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-{port}"]
            cmd += ["--max-restarts", "100", "--monitor-interval", "0.1", *script]
            with open(base / f"torchrun-{node}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=base))
            if node == 0:
                time.sleep(1.0)
        return procs
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "1"]
    cmd += ["--max-restarts", "100", "--rdzv-timeout", "180", "--run-dir", str(base / "run")]
    cmd += ["--replica-groups", "2"] if mode == "replica" else []
    with open(base / f"{mode}.log", "wb") as log:
        return [subprocess.Popen([*cmd, *script], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=base)]


def run(mode: str, args: argparse.Namespace, base: Path) -> Outcome:
    """One training under ``mode`` with failures injected; every process it started is gone on return."""
    base.mkdir(parents=True)
    out, step_log = base / "out", base / "steps.jsonl"
    out.mkdir()
    script = [str(WRAPPER), "--steps", str(args.steps), "--step-time", str(args.step_time)]
    script += ["--out-dir", str(out)]
    stop, kills = threading.Event(), []
    key = "group" if mode == "replica" else "rank"
    cut_at, finished = None, False
    with tracked():
        env = dict(os.environ, **{STEP_LOG_VARIABLE: str(step_log)})
        lighthouse = None
        if mode != "replica":  # one group: the script's Manager still needs a lighthouse
            lighthouse = Lighthouse("127.0.0.1", 1, base / "lighthouse.log")
            env["TORCHFT_LIGHTHOUSE"] = lighthouse.url
        if mode == "torchrun":
            env["HPCELASTIC_CHECKPOINT_DIR"] = str(base / "checkpoints")
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        thread = threading.Thread(
            target=inject, args=(step_log, key, args.interval, stop, kills), daemon=True
        )
        thread.start()
        procs = launch(mode, base, script, env)
        started = time.time()
        try:
            while any(p.poll() is None for p in procs):
                lines = read_log(step_log)
                first = min((r["ts"] for r in lines), default=None)
                now = time.time()
                if (first is not None and now > first + args.max_wall) or now > started + args.max_wall + 300:
                    cut_at = now
                    break
                time.sleep(1.0)
            else:
                failed = [p.returncode for p in procs if p.returncode != 0]
                if failed:
                    tails = "".join(
                        f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(base.glob("*.log"))
                    )
                    raise SystemExit(f"{mode}: exit {failed}\n{tails}")
                finished = True
        finally:
            stop.set()
            thread.join()
            if lighthouse is not None:
                lighthouse.close()
    groups = 2 if mode == "replica" else 1
    eff = efficiency(read_log(step_log), groups, cut_at=cut_at)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("group*.json"))]
    identical = len({json.dumps(r["params"]) for r in results}) == 1 if len(results) == 2 else None
    return Outcome(mode, eff, len(kills), finished, identical)


def median(values: list[float]) -> float:
    return statistics.median(values)


def cell(values: list[float], fmt: str) -> str:
    """The median, with every run's value when there are several."""
    text = format(median(values), fmt)
    return text if len(values) == 1 else f"{text} ({', '.join(format(v, fmt) for v in values)})"


def lost_per_failure(o: Outcome) -> float:
    """Seconds of job steps lost per failure: (steps possible - committed) x step time / failures."""
    return (o.eff.possible - o.eff.steps) * o.eff.step_s / o.failures if o.failures else 0.0


def table(results: dict[str, list[Outcome]], args: argparse.Namespace, took: float) -> str:
    rounds = min(len(v) for v in results.values())
    rows = [
        "| mode | failures | wall from first step (s) | fault-free step (s) | steps committed "
        "| steps possible | s lost per failure | job step efficiency | replica-step efficiency |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, outs in results.items():
        outs = outs[:rounds]
        cut = sum(not o.finished for o in outs)
        done = f"{median([o.eff.steps for o in outs]):.0f}" + (
            f"; {cut} cut at {args.max_wall:g} s" if cut else ""
        )
        rows.append(
            f"| {LABELS[mode]} | {cell([o.failures for o in outs], '.0f')} "
            f"| {median([o.eff.wall for o in outs]):.0f} | {median([o.eff.step_s for o in outs]):.3f} "
            f"| {done} | {median([o.eff.possible for o in outs]):.0f} "
            f"| {cell([lost_per_failure(o) for o in outs], '.1f')} "
            f"| {cell([o.eff.job for o in outs], '.1%')} "
            f"| {cell([o.eff.replica for o in outs], '.1%')} |"
        )
    rows.append("| torchft published (300 GPUs, a failure every 60 s) | | | | | | | | 82.3% (bound 83.3%) |")
    same = [o.identical for o in results.get("replica", [])[:rounds] if o.identical is not None]
    identical = (
        f"Replica groups ended with identical weights: {sum(same)} of {len(same)} runs.\n" if same else ""
    )
    runs = (
        "one run per mode"
        if rounds == 1
        else f"medians of {rounds} runs per mode (each run's efficiency in ())"
    )
    return (
        "## Step efficiency: torchft replica groups, job-wide restart, torchrun "
        "(`bench/replica_goodput.py`)\n\n"
        f"{machine_line()}\n\n"
        f"examples/torchft_train.py (unchanged; bench/_replica_train.py logs its committed steps), "
        f"{args.steps} steps of {args.step_time:g} s sleep + the step on 2 nodes x 1 CPU gloo worker, "
        f"a checkpoint every 10 steps; a worker SIGKILLed every {args.interval:g} s from the first step; "
        f"a mode still running {args.max_wall:g} s after its first step is cut and measured up to the cut; "
        f"{runs}, the modes taking turns in the same bench run ({took / 60:.0f} min).\n\n"
        + "\n".join(rows)
        + "\n\n"
        "Fault-free step time: the median gap between two steps committed by the same process in that mode's "
        "run. Steps possible: (last committed step - first step) / fault-free step time + 1. Job step "
        "efficiency: distinct steps committed / steps possible. Replica-step efficiency (torchft's figure): "
        "(replica group, step) pairs committed / (groups x steps possible); with one group it equals "
        "the job's. torchrun's workers resume from the checkpoint `hpcelastic-latest.json` names (the "
        "worker API's contract outside the agent).\n\n" + identical
    )


def stopped(signum: int, _frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=30.0, help="seconds between two failures")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--step-time", type=float, default=0.25, help="sleep per step (s)")
    p.add_argument("--max-wall", type=float, default=300.0, help="cut a mode this long after its first step")
    p.add_argument(
        "--runs", type=int, default=1, help="rounds of every mode (the section is rewritten after each)"
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES) or args.runs < 1:
        p.error(f"--modes: choose from {','.join(MODES)}; --runs: at least 1")
    for sig in (
        signal.SIGTERM,
        signal.SIGINT,
    ):  # stopped early: still clean up (tracked) and keep the rounds done
        signal.signal(sig, stopped)
    start = time.time()
    results: dict[str, list[Outcome]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="replica-goodput-") as tmp:
        for n in range(args.runs):
            for mode in modes:
                o = run(mode, args, Path(tmp) / f"{mode}-{n}")
                results[mode].append(o)
                print(
                    f"run {n + 1} {mode}: {o.failures} failures, {o.eff.steps} steps, job {o.eff.job:.1%}, "
                    f"replica {o.eff.replica:.1%}",
                    flush=True,
                )
            md = table(results, args, time.time() - start)
            print(md, flush=True)
            if modes == list(MODES):
                update_section("replica_goodput", md)
            else:
                print("(a subset of the modes: bench/RESULTS.md left as it is)")


if __name__ == "__main__":
    main()
