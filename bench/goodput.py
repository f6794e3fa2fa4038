"""Goodput under injected failures: hpcelastic, torchrun and NVIDIA's ft_launcher on the same training.

One training of fixed length (``bench/_goodput_train.py``: STEPS steps of STEP_TIME s, a checkpoint every
CKPT_EVERY steps) on NODES "nodes" x NPROC CPU gloo workers, elastic down to NODES - 1. While it trains,
a failure is injected every F seconds of running training, in this order: a worker exception (SIGUSR1
makes it raise), a worker SIGKILL, and a node loss (the last node's launcher and all its processes
SIGKILLed). Each launcher also runs once without failures.

Per launcher (medians of RUNS runs): the effective training time ratio (ETTR: productive step time /
wall time, as Meta and ByteDance report it) and the seconds lost per failure: the wall time beyond the
fault-free run's, per failure; split into the work redone since the last checkpoint and the rest
(detection, teardown, rendezvous, restart to the first step again: the launcher's own cost).

Then a projection to scale from the launcher's own cost per failure R: with a mean time to failure M
(Meta: 7.9 h at 1,024 GPUs, 1.8 h at 16,384; 128 GPUs scaled from 1,024 by GPU count), a checkpoint
cost C and the Young/Daly interval tau = sqrt(2 C M), ETTR = 1 - C / tau - (R + tau / 2) / M.

torchrun and ft_launcher run ``--rdzv-backend c10d`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(a fresh worker store per round: without it they do not recover from a crash, REFERENCE.md).
ft_launcher is nvidia-resiliency-ext 0.4.1 (``pip install nvidia-resiliency-ext==0.4.1``, for this
bench only); its heartbeat API is not used by the (unchanged torchrun) script. Writes the ``goodput``
section of bench/RESULTS.md.

    python bench/goodput.py [--runs 3] [--interval 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._cleanup import tracked  # noqa: E402
from bench._results import machine_line, update_section  # noqa: E402
from hpcelastic.agent.launcher import LocalRun, start_agents  # noqa: E402

TRAIN = REPO / "bench" / "_goodput_train.py"
NODES, NPROC = 3, 1
STEPS, STEP_TIME, CKPT_EVERY = 120, 0.25, 10
FAILURES = ("worker exception", "worker SIGKILL", "node loss")
LAUNCHERS = ("hpcelastic", "torchrun", "ft_launcher")
RUN_TIMEOUT = 400.0
#: Meta's mean time to failure (hours) at 1,024 and 16,384 GPUs; 128 scaled from 1,024 by GPU count.
MTTF_H = {128: 7.9 * 1024 / 128, 1024: 7.9, 16384: 1.8}
#: Checkpoint cost (s): torch.distributed.checkpoint async_save of a 7B model (PyTorch blog).
CHECKPOINT_S = 6.3


@dataclass
class Run:
    """One training run under one launcher."""

    launcher: str
    faults: bool
    wall: float = math.nan
    productive: float = math.nan
    redone: float = 0.0
    #: Time from the first step's end to the last step's end not spent on the steps that count.
    stalled: float = math.nan
    injected: list[str] = field(default_factory=list)
    finished: bool = False
    note: str = ""

    @property
    def ettr(self) -> float:
        return self.productive / self.wall


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train_args(work: Path) -> list[str]:
    return [
        str(TRAIN),
        "--steps",
        str(STEPS),
        "--step-time",
        str(STEP_TIME),
        "--ckpt-every",
        str(CKPT_EVERY),
        "--ckpt",
        str(work / "ckpt.pt"),
        "--step-log",
        str(work / "steps.jsonl"),
        "--pid-dir",
        str(work / "pids"),
    ]


def start(launcher: str, work: Path) -> list[subprocess.Popen[bytes]]:
    """The launcher's per-node processes (node 0 first: torchrun's store host)."""
    if launcher == "hpcelastic":
        spec = LocalRun(
            min_nodes=NODES - 1,
            max_nodes=NODES,
            nproc=str(NPROC),
            max_restarts=10,
            run_dir=work / "run",
            agent_args=("--rdzv-timeout", "60", "--grace-period", "5"),
            program=tuple(train_args(work)),
        )
        return start_agents(spec)[1]
    exe = [sys.executable, "-m", "torch.distributed.run"] if launcher == "torchrun" else [ft_launcher()]
    port = free_port()
    cmd = [
        *exe,
        "--nnodes",
        f"{NODES - 1}:{NODES}",
        "--nproc-per-node",
        str(NPROC),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        work.name,
        "--max-restarts",
        "10",
        "--monitor-interval",
        "0.1",
        *train_args(work),
    ]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    procs = []
    for i in range(NODES):
        log = open(work / f"{launcher}-{i}.log", "wb")  # noqa: SIM115 - the child holds it
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        log.close()
        if i == 0:
            time.sleep(1.0)
    return procs


def ft_launcher() -> str:
    path = shutil.which("ft_launcher", path=str(Path(sys.executable).parent))
    if path is None:
        raise SystemExit("ft_launcher not found: pip install nvidia-resiliency-ext==0.4.1 (bench only)")
    return path


def steps(work: Path) -> list[dict[str, float]]:
    path = work / "steps.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def live_worker(work: Path, rank: int) -> int | None:
    """The pid of the running worker of ``rank`` (newest first)."""
    found = []
    for f in (work / "pids").glob("*"):
        with contextlib.suppress(ValueError, OSError):
            rec = json.loads(f.read_text())
            if rec["rank"] == rank and psutil.pid_exists(int(f.name)):
                proc = psutil.Process(int(f.name))
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append((rec["ts"], int(f.name)))
    return max(found)[1] if found else None


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """A node loss: the launcher process and every process under it, at once."""
    with contextlib.suppress(psutil.Error):
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)


def inject(kind: str, work: Path, procs: list[subprocess.Popen[bytes]]) -> bool:
    if kind == "node loss":
        kill_tree(procs[-1])
        return True
    pid = live_worker(work, 1)
    if pid is None:
        return False
    os.kill(pid, signal.SIGUSR1 if kind == "worker exception" else signal.SIGKILL)
    return True


def run_once(launcher: str, root: Path, faults: bool, interval: float, index: int) -> Run:
    work = root / f"{launcher}-{'faults' if faults else 'clean'}-{index}"
    work.mkdir()
    run = Run(launcher, faults)
    launched = time.time()
    procs = start(launcher, work)
    pending = list(FAILURES) if faults else []
    since = None  # when training was last seen running after the previous injection
    last_injection = launched
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            break
        log = steps(work)
        if pending and log:
            if since is None and log[-1]["end"] > last_injection:
                since = log[-1]["end"]
            due = since is not None and time.time() - since >= interval
            if due and inject(pending[0], work, procs):
                run.injected.append(pending.pop(0))
                last_injection, since = time.time(), None
        time.sleep(0.05)
    else:
        run.note = f"killed after {RUN_TIMEOUT:.0f} s"
        for p in procs:
            kill_tree(p)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    end = time.time()
    log = steps(work)
    last: dict[int, float] = {}
    for rec in log:
        if int(rec["step"]) in last:
            run.redone += last[int(rec["step"])]
        last[int(rec["step"])] = rec["end"] - rec["start"]
    run.finished = len(last) == STEPS
    run.wall = end - launched
    run.productive = sum(last.values())
    if log:
        span = max(r["end"] for r in log) - min(r["end"] for r in log)
        run.stalled = span - (run.productive - (log[0]["end"] - log[0]["start"]))
    return run


def median(values: list[float]) -> float:
    good = [v for v in values if not math.isnan(v)]
    return statistics.median(good) if good else math.nan


def projected_ettr(cost_s: float, mttf_h: float, checkpoint_s: float) -> tuple[float, float]:
    """(Young/Daly interval s, expected ETTR) for a launcher losing ``cost_s`` per failure."""
    m = mttf_h * 3600
    tau = math.sqrt(2 * checkpoint_s * m)
    return tau, 1 - checkpoint_s / tau - (cost_s + tau / 2) / m


def fmt(x: float, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if math.isnan(x) else f"{x:{spec}}{unit}"


def summarize(runs: list[Run], checkpoint_s: float, interval: float) -> str:
    per_launcher = max((sum(r.faults and r.launcher == n for r in runs) for n in LAUNCHERS), default=0)
    lines = [
        "## Goodput under failures (`bench/goodput.py`)",
        "",
        machine_line(),
        f"{NODES} nodes x {NPROC} CPU gloo worker(s) on one host (elastic down to {NODES - 1}), "
        f"{STEPS} steps of {STEP_TIME} s, a checkpoint every {CKPT_EVERY} steps; one failure every "
        f"{interval:.0f} s of running training: {', '.join(FAILURES)}. Medians of {per_launcher} faulted "
        "run(s) per launcher. 'Lost per failure': the time between the first and the last step not spent on "
        "the steps that count (less the fault-free run's), per failure; 'launcher cost': that less the work "
        "redone since the last checkpoint (detection, teardown, rendezvous, restart to the first step). "
        "ETTR: productive step time / wall time from launch to exit.",
        "",
        "| launcher | fault-free wall | faulted wall | ETTR (faulted) | lost per failure "
        "| redone per failure | launcher cost per failure | runs finished |",
        "|---|---|---|---|---|---|---|---|",
    ]
    costs: dict[str, float] = {}
    for name in LAUNCHERS:
        clean = [r for r in runs if r.launcher == name and not r.faults]
        faulted = [r for r in runs if r.launcher == name and r.faults]
        if not faulted:
            continue
        clean_wall = median([r.wall for r in clean if r.finished])
        clean_stall = median([r.stalled for r in clean if r.finished])
        clean_stall = 0.0 if math.isnan(clean_stall) else clean_stall
        lost = median(
            [(r.stalled - clean_stall) / len(r.injected) for r in faulted if r.finished and r.injected]
        )
        redone = median([r.redone / len(r.injected) for r in faulted if r.finished and r.injected])
        costs[name] = lost - redone
        done = sum(r.finished for r in faulted)
        notes = "; ".join(sorted({r.note for r in faulted if r.note}))
        wall = median([r.wall for r in faulted if r.finished])
        ettr = median([r.ettr for r in faulted if r.finished])
        lines.append(
            f"| {name} | {fmt(clean_wall, '.1f', ' s')} | {fmt(wall, '.1f', ' s')} "
            f"| {fmt(ettr * 100, '.1f', '%')} | {fmt(lost, '.2f', ' s')} | {fmt(redone, '.2f', ' s')} "
            f"| {fmt(costs[name], '.2f', ' s')} "
            f"| {done}/{len(faulted)}{' (' + notes + ')' if notes else ''} |"
        )
    if "hpcelastic" in costs and "torchrun" in costs and costs["hpcelastic"] > 0:
        lines += [
            "",
            f"torchrun's cost per failure / hpcelastic's: {costs['torchrun'] / costs['hpcelastic']:.1f}x.",
        ]
    lines += [
        "",
        "### Projected to scale",
        "",
        "Model: ETTR = 1 - C/tau - (R + tau/2)/M with the Young/Daly interval tau = sqrt(2 C M); inputs: "
        f"the launcher cost per failure R measured above, checkpoint cost C = {checkpoint_s} s (async "
        "`torch.distributed.checkpoint` save of a 7B model, PyTorch blog), M = Meta's mean time to failure "
        "(7.9 h at 1,024 GPUs, 1.8 h at 16,384; 128 GPUs scaled by GPU count from 1,024). R is assumed not "
        "to grow with the job size (it does for torchrun: its rendezvous traffic grows as N^2).",
        "",
        "| launcher | R (s) | GPUs | M (h) | tau (s) | expected ETTR |",
        "|---|---|---|---|---|---|",
    ]
    for name, cost in costs.items():
        for gpus, mttf in MTTF_H.items():
            tau, ettr = projected_ettr(max(cost, 0.0), mttf, checkpoint_s)
            row = f"| {name} | {fmt(cost, '.2f')} | {gpus:,} | {mttf:.1f} | {tau:.0f} "
            lines.append(row + f"| {fmt(ettr * 100, '.2f', '%')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="faulted runs per launcher (median)")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds of training between failures")
    ap.add_argument("--checkpoint-cost", type=float, default=CHECKPOINT_S, help="C of the projection (s)")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated subset")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = (
        "1"  # every launcher's workers alike (torchrun sets it only for nproc > 1)
    )
    runs: list[Run] = []
    with tracked(), tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        for name in args.launchers.split(","):
            for i, faults in enumerate([False] + [True] * args.runs):
                run = run_once(name, Path(tmp), faults, args.interval, i)
                print(
                    f"{name} {'faulted' if faults else 'clean'}: wall {run.wall:.1f} s, productive "
                    f"{run.productive:.1f} s, redone {run.redone:.1f} s, injected {run.injected}, "
                    f"finished {run.finished} {run.note}",
                    flush=True,
                )
                runs.append(run)
    md = summarize(runs, args.checkpoint_cost, args.interval)
    print(md)
    if not args.no_write:
        update_section("goodput", md)


if __name__ == "__main__":
    main()
