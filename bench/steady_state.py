"""What hpcelastic costs when nothing fails: the same unchanged scripts under torchrun and ``hpcelastic run``,
alternating in one run (issue 29, item 1).

One node x 2 gloo workers (``bench/_steady_train.py``: DDP, a compute-bound MLP), fault-free, as:

* DDP: no checkpoints; DCP: ``dcp.save`` every ``--save-every`` steps into the checkpoint directory;
* launchers: ``torchrun --standalone``; ``hpcelastic run`` with the defaults (warm start, slow-node
  detection, metrics endpoint); ``hpcelastic run`` with everything on (the defaults and ``--stall-timeout``,
  the hang watch sampling stacks, and the node-local checkpoint tier in /dev/shm).

Per run, from the workers' own records: the step time (wall, first step done -> last, per step) and the
workers' CPU time per step; from the launcher's process tree (``wait4``): the CPU time of everything that is
not a worker (the launcher: torchrun's agent, or hpcelastic's agent, coordinator and fork server) as a
share of one core over the run, and the largest resident memory of those processes (sampled every 0.2 s).
Configurations alternate within each round, so a slower minute of the machine falls on all of them; the
figures are medians over ``--runs`` rounds. Writes the ``steady_state`` section of bench/RESULTS.md.

    python bench/steady_state.py [--runs 5 --steps 400]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
from bench._results import machine_line, update_section  # noqa: E402

TRAIN = REPO / "bench" / "_steady_train.py"
NPROC = 2
LAUNCHERS = ("torchrun", "hpcelastic (defaults)", "hpcelastic (everything on)")


@dataclass(frozen=True)
class Result:
    step_s: float  # median over ranks of (last - first) / steps
    worker_cpu_per_step_s: float
    launcher_cpu_share: float  # of one core, over the run's wall time
    launcher_rss_mb: float


def command(launcher: str, tmp: Path, tag: str, train: list[str]) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
                str(TRAIN), *train]  # fmt: skip
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "1", "--nproc-per-node", str(NPROC)]
    cmd += ["--run-dir", str(tmp / f"{tag}-run")]
    if launcher == "hpcelastic (everything on)":
        cmd += ["--stall-timeout", "60", "--local-checkpoint-dir", f"/dev/shm/hpce-steady-{tag}-{{node}}"]
    return [*cmd, str(TRAIN), *train]


def run_once(launcher: str, tmp: Path, tag: str, steps: int, save_every: int) -> Result:
    out = tmp / f"{tag}-out"
    train = ["--steps", str(steps), "--out", str(out), "--save-every", str(save_every)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        env["HPCELASTIC_CHECKPOINT_DIR"] = str(tmp / f"{tag}-ckpt")
    t0 = time.monotonic()
    proc = subprocess.Popen(command(launcher, tmp, tag, train), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    rss: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        top = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                procs = [top, *top.children(recursive=True)]
            except psutil.Error:
                return
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    rss[p.pid] = max(rss.get(p.pid, 0.0), p.memory_info().rss / 2**20)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    done.set()
    sampler.join()
    stderr = proc.stderr.read() if proc.stderr else ""
    if status != 0:
        raise SystemExit(f"{launcher} failed (wait status {status}):\n{stderr[-3000:]}")
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(NPROC)]
    workers = {r["pid"] for r in ranks}
    # the workers' whole-life CPU is not recorded, only their training's: the launcher's share is the tree's
    # CPU less the workers' training CPU, so it includes the workers' start-up (the same for every launcher:
    # importing torch) and is an upper bound of the launcher's own
    tree_cpu = usage.ru_utime + usage.ru_stime
    worker_cpu = sum(r["cpu_s"] for r in ranks)
    launcher_rss = sum(v for pid, v in rss.items() if pid not in workers)
    return Result(
        step_s=statistics.median((r["last"] - r["first"]) / r["steps"] for r in ranks),
        worker_cpu_per_step_s=worker_cpu / sum(r["steps"] for r in ranks),
        launcher_cpu_share=max(0.0, tree_cpu - worker_cpu) / wall,
        launcher_rss_mb=launcher_rss,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--save-every", type=int, default=50)
    args = p.parse_args()
    scripts = {"DDP": 0, f"DCP, a save every {args.save_every} steps": args.save_every}
    got: dict[tuple[str, str], list[Result]] = {}
    with tracked(), tempfile.TemporaryDirectory(prefix="bench-steady-") as tmp:
        for i in range(args.runs):
            for script, save_every in scripts.items():
                for launcher in LAUNCHERS:
                    tag = f"{i}-{save_every}-{LAUNCHERS.index(launcher)}"
                    r = run_once(launcher, Path(tmp), tag, args.steps, save_every)
                    got.setdefault((script, launcher), []).append(r)
                    where = f"round {i + 1}/{args.runs} {script:<28} {launcher:<28}"
                    print(f"{where} {r.step_s * 1e3:7.2f} ms/step", flush=True)
    lines = [
        "## Cost when nothing fails: step time beside torchrun (`bench/steady_state.py`)",
        "",
        machine_line() + f" 1 node x {NPROC} gloo workers, DDP MLP (width 256), {args.steps} steps a run, "
        f"launchers alternating; medians of {args.runs} rounds.",
        "",
        "| script | launcher | step time | vs torchrun | workers' CPU per step | launcher CPU (of a core) | "
        "launcher memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for script in scripts:
        base = statistics.median(r.step_s for r in got[(script, "torchrun")])
        for launcher in LAUNCHERS:
            rs = got[(script, launcher)]
            step = statistics.median(r.step_s for r in rs)
            spread = f"{min(r.step_s for r in rs) * 1e3:.2f}-{max(r.step_s for r in rs) * 1e3:.2f}"
            lines.append(
                f"| {script} | {launcher} | {step * 1e3:.2f} ms ({spread}) | {step / base:.3f} | "
                f"{statistics.median(r.worker_cpu_per_step_s for r in rs) * 1e3:.2f} ms | "
                f"{100 * statistics.median(r.launcher_cpu_share for r in rs):.1f} % | "
                f"{statistics.median(r.launcher_rss_mb for r in rs):.0f} MB |"
            )

    def spread(rs: list[Result]) -> float:
        steps = [r.step_s for r in rs]
        return (max(steps) - min(steps)) / statistics.median(steps)

    lines += [
        "",
        f"Resolution: one configuration's rounds spread by up to {100 * max(map(spread, got.values())):.0f} "
        "% of its median (min-max); differences between medians well below that are not resolved by this "
        "run (more rounds, or longer ones, resolve more).",
    ]
    lines += [
        "",
        "Launcher CPU: the tree's CPU time (wait4) less the workers' training CPU, over the run's wall time: "
        "it includes every process's start-up (torch imports), the same for each launcher, so it bounds the "
        "launcher's own from above. Launcher memory: the largest resident set of each non-worker process, "
        "summed (hpcelastic: agent with its coordinator, and the fork server, which holds torch imported).",
    ]
    update_section("steady_state", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
