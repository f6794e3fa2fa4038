"""Slow nodes (issue 28), measured for real: ``hpcelastic run --nodes 2 --spare-nodes 1 --nproc-per-node 2``
with the unchanged DDP script of the tests (``tests/faults/slow_train.py``: plain torch, gloo, its own
``torch.save`` checkpoint every 20 steps, each step padded to 0.2 s).

* ``detect``: once the job's pace is known (step 200), node 1's two workers get a cgroup v1 CPU quota that
  makes the job run at 50, 70 or 85 % of its speed (the quota is the worker's CPU time a step, measured
  over the healthy steps, times the target speed over the step's time). Measured: the job's speed while
  slowed (from the checkpoints' times), the time to the first ``slow_time`` (a sustained drop) and to the
  first ``node_slow`` (the node named: which and its kind), whether the spare took its place, the swap's
  cost (the node leaving to the next checkpoint written) and the job's step rate after it as a share of
  the healthy rate. At 85 % (a 15 % slowdown, below ``slow.min_slowdown``) nothing is to be named.
* ``cost``: the same script unpadded, fault-free, under plain torchrun, ``hpcelastic run`` with detection
  on (the default) and with ``--slow-action off``, side by side; median wall time of ``--runs`` each.

Writes the ``slow_nodes`` section of bench/RESULTS.md. Needs root (cgroup v1 ``cpu``).

    python bench/slow_nodes.py [--runs 3] [--detect-runs 3] [--cost-steps 400]
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402
from hpcelastic.rundir import RunDir  # noqa: E402
from tests.slow_job import CKPT_EVERY, SLOW_AFTER_STEP, STEP_TIME, train_args  # noqa: E402

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
STEPS = 900
SPEEDS = (0.5, 0.7, 0.85)
#: How long a run may take at most.
RUN_TIMEOUT_S = 900
#: A slowed run ends this long after the swap (the rate after it is measured over that time), or this long
#: after the quota with no node named (more than twice the detection time at 50 %).
AFTER_S = 60.0
NOTHING_S = 150.0


def _events(run: Path) -> list[dict[str, Any]]:
    return [dict(e) for e in RunDir(run).events()] if run.exists() else []


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ckpt_times(ckpt: Path) -> list[tuple[int, float]]:
    """(step, wall time written) of every checkpoint so far."""
    out = []
    for f in ckpt.glob("ckpt-*.pt"):
        out.append((int(f.stem.split("-")[1]), f.stat().st_mtime))
    return sorted(out)


def _rate(points: list[tuple[int, float]], start: float, end: float) -> float | None:
    """Steps a second between the first and last checkpoint written in [start, end)."""
    inside = [(s, t) for s, t in points if start <= t < end]
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        return None
    return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])


def _quota(pid: int, share: float, tag: str) -> Path:
    group = CPU_CGROUP / f"hpcelastic-bench-{tag}-{pid}"
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(share * 100000))))
    (group / "cgroup.procs").write_text(str(pid))
    return group


def _release(group: Path) -> None:
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):  # it exited
            (CPU_CGROUP / "cgroup.procs").write_text(pid)
    group.rmdir()


def _seen_enough(run: Path, slowed_at: float) -> bool:
    """A run has shown what it can once the spare has trained :data:`AFTER_S` in the slow node's place, or
    once :data:`NOTHING_S` passed with no node named (at 85 % nothing is to be named)."""
    evs = _events(run)
    lost = next((e for e in evs if e["event"] == "node_lost"), None)
    if lost is not None:
        return time.time() > lost["ts"] + AFTER_S
    named = any(e["event"] == "node_slow" for e in evs)
    return not named and time.time() > slowed_at + NOTHING_S


def detect(speed: float) -> dict[str, Any]:
    """One slowed run (see the module docstring)."""
    tmp = Path(tempfile.mkdtemp(prefix="hpcelastic-bench-slow-"))
    run, ckpt = tmp / "run", tmp / "run" / "checkpoints"
    argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--spare-nodes", "1"]
    argv += ["--nproc-per-node", "2", "--max-restarts", "2", "--run-dir", str(run), "--slow-action", "swap"]
    proc = subprocess.Popen([*argv, *train_args(tmp, ckpt, STEPS)], stdout=subprocess.DEVNULL)
    groups: list[Path] = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        pids_dir = tmp / "pids"
        while not (pids_dir / "rank-3").exists() or not _ckpt_times(ckpt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the job did not start")
            time.sleep(0.2)
        pids = [int((pids_dir / f"rank-{r}").read_text()) for r in (2, 3)]
        cpu0, step0 = {p: _cpu_s(p) for p in pids}, _ckpt_times(ckpt)[-1]
        while _ckpt_times(ckpt)[-1][0] < SLOW_AFTER_STEP:
            time.sleep(0.2)
        step1 = _ckpt_times(ckpt)[-1]
        steps = step1[0] - step0[0]
        healthy_step_s = (step1[1] - step0[1]) / steps
        per_step = {p: (_cpu_s(p) - cpu0[p]) / steps for p in pids}
        for p in pids:
            groups.append(_quota(p, per_step[p] * speed / healthy_step_s, "detect"))
        slowed_at = time.time()
        while proc.poll() is None and time.monotonic() < deadline and not _seen_enough(run, slowed_at):
            time.sleep(1)
        code = proc.poll()  # None: the bench stopped it once it had seen enough
    finally:
        if proc.poll() is None:
            proc.terminate()  # hpcelastic run stops its agents and workers on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for g in groups:
            _release(g)
    evs = _events(run)
    points = _ckpt_times(ckpt)
    first = evs[0]["ts"] if evs else slowed_at
    healthy = _rate(points, first, slowed_at)
    lost = [e for e in evs if e["event"] == "node_lost"]
    swap_at = lost[0]["ts"] if lost else None
    slowed = _rate(points, slowed_at + 5, swap_at or float("inf"))
    drop = next((e["ts"] for e in evs if e["event"] == "slow_time"), None)
    named = next((e for e in evs if e["event"] == "node_slow"), None)
    swaps = [e for e in evs if e["event"] == "node_slow" and e["action"] == "swap"]
    rounds = [e for e in evs if e["event"] == "rendezvous"]
    after = [t for s, t in points if swap_at is not None and t > swap_at]
    return {
        "speed_target": speed,
        "exit": code,
        "healthy_rate": healthy,
        "speed": slowed / healthy if slowed and healthy else None,
        "drop_s": None if drop is None else drop - slowed_at,
        "named_s": None if named is None else named["ts"] - slowed_at,
        "named": None if named is None else f"{named['node']} {named['kind']}",
        "right_node": named is None or named["node"] == rounds[0]["hosts"][1],
        "swapped": bool(swaps),
        "swap_cost_s": after[0] - swap_at if after and swap_at else None,
        "after_share": (_rate(points, after[0], float("inf")) or 0) / healthy if after and healthy else None,
        "named_events": len([e for e in evs if e["event"] == "node_slow"]),
    }


def cost(kind: str, steps: int) -> float:
    """Wall seconds of one fault-free, unpadded run of ``steps`` steps (4 ranks)."""
    tmp = Path(tempfile.mkdtemp(prefix="hpcelastic-bench-slowcost-"))
    train = train_args(tmp, tmp / "ckpt", steps, 0.0)
    if kind == "torchrun":
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            *train,
        ]
    else:
        argv = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "2"]
        argv += ["--run-dir", str(tmp / "run"), "--slow-action", "swap" if kind == "detection on" else "off"]
        argv += train
    start = time.monotonic()
    subprocess.run(argv, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    return time.monotonic() - start


def _f(value: Any, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def _summary(speed: float, runs: list[dict[str, Any]]) -> str:
    """One speed's row over its runs: medians, and how many named the slowed node with kind compute."""
    named = [r["named_s"] for r in runs if r["named_s"] is not None]
    span = f" ({min(named):.0f}-{max(named):.0f})" if len(named) > 1 else ""
    right = sum(1 for r in runs if r["named"] and r["right_node"] and r["named"].endswith("compute"))
    return (
        f"| {speed:.0%} | {len(runs)} | {_f(_median(runs, 'speed'), '{:.0%}')} | "
        f"{_f(_median(runs, 'drop_s'))} | "
        f"{_f(_median(runs, 'named_s'))}{span} | {right} of {len(runs)} | "
        f"{sum(1 for r in runs if r['swapped'])} of {len(runs)} | {_f(_median(runs, 'swap_cost_s'))} | "
        f"{_f(_median(runs, 'after_share'), '{:.0%}')} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each cost configuration")
    parser.add_argument("--detect-runs", type=int, default=3, help="slowed runs at each speed")
    parser.add_argument("--cost-steps", type=int, default=400)
    args = parser.parse_args()
    results = []
    for speed in SPEEDS:
        for _ in range(args.detect_runs):
            r = detect(speed)
            print(json.dumps(r), flush=True)
            results.append(r)
    kinds = ("torchrun", "detection on", "detection off")
    walls: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.runs):
        for k in kinds:  # interleaved: a change in the machine's load hits every configuration alike
            walls[k].append(cost(k, args.cost_steps))
            print(k, f"{walls[k][-1]:.1f} s", flush=True)
    med = {k: statistics.median(v) for k, v in walls.items()}
    summary = [_summary(speed, [r for r in results if r["speed_target"] == speed]) for speed in SPEEDS]
    rows = [
        f"| {r['speed_target']:.0%} | {_f(r['speed'], '{:.0%}')} | {_f(r['drop_s'])} | {_f(r['named_s'])} | "
        f"{r['named'] or 'nothing'}{'' if r['right_node'] else ' (WRONG)'} | "
        f"{'yes' if r['swapped'] else 'no'} | {_f(r['swap_cost_s'])} | {_f(r['after_share'], '{:.0%}')} |"
        for r in results
    ]
    text = "\n".join(
        [
            "## Slow nodes (bench/slow_nodes.py)",
            "",
            machine_line(),
            "",
            f"`hpcelastic run --nodes 2 --spare-nodes 1 --nproc-per-node 2` (4 gloo ranks), tests/faults/"
            f"slow_train.py (unchanged DDP, a checkpoint every {CKPT_EVERY} steps, steps padded to "
            f"{STEP_TIME} s); at step {SLOW_AFTER_STEP} node 1's two workers get a cgroup v1 CPU quota for "
            "the "
            "target speed. Seconds from the quota to the first `slow_time` (a sustained drop) and the first "
            "`node_slow` (named); the swap's cost is the slow node leaving to the next checkpoint written; "
            f"after: the step rate after the swap over the healthy rate ({AFTER_S:.0f} s of it; a run with "
            f"no node named ends {NOTHING_S:.0f} s after the quota). {args.detect_runs} run(s) a speed.",
            "",
            "| target speed | runs | measured (median) | drop (s, median) | named (s, median; range) | right "
            "node and kind | swapped | swap cost (s, median) | after (median) |",
            "|---|---|---|---|---|---|---|---|---|",
            *summary,
            "",
            "Each run:",
            "",
            "| target speed | measured | drop (s) | named (s) | named | swapped | swap cost (s) | after |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Cost, fault-free, unpadded, {args.cost_steps} steps, median of {args.runs} (s): "
            + ", ".join(f"{k} {med[k]:.1f}" for k in kinds)
            + f"; detection on vs off {100 * (med['detection on'] / med['detection off'] - 1):+.1f} %, "
            f"vs torchrun {100 * (med['detection on'] / med['torchrun'] - 1):+.1f} % (hpcelastic run's own "
            "start-up included).",
        ]
    )
    update_section("slow_nodes", text)
    print(text)


if __name__ == "__main__":
    main()
