"""Slow nodes (issue 28): which node and kind is named over many trials, and false actions on noise;
measured for real, side by side in one run (the three parts run at once, each load on the others).

* ``compute``: ``hpcelastic run --nodes 3 --nproc-per-node 2 --slow-action report`` (``--compute-jobs``
  such jobs at once; two workers a node, so that the fork server starts them warm), the unchanged DDP
  script of the tests (``tests/faults/slow_train.py``, gloo, a ``torch.save`` checkpoint every 20 steps,
  steps padded to 0.2 s). A trial: once the job's pace is known, one node other than the coordinator's (in
  turn) has its workers' CPU quota (cgroup v1) set for half their speed, until the next ``node_slow`` or
  ``TRIAL_TIMEOUT_S``; the quota is lifted and the job left to recover for ``RECOVER_S``.
* ``network``: the same script through ``hpcelastic submit --nodes 3 --nproc-per-node 2 --slow-action report``
  on a namespaced Slurm instance of the bench's own (``benchnet``: 4 nodes, each in its own network namespace
  on 198.18.25.0/24). A trial: ``NETWORK_DELAY`` each way on one worker node's link (its CPUs untouched).
* ``false actions``: ``hpcelastic run --nodes 2 --spare-nodes 1 --nproc-per-node 2 --slow-action swap``,
  fault-free for ``--noise-minutes`` with noise: each rank's step padded up to 15 % longer at random, a
  workload stripe (rank 1 computes 4 batches more every 7th step), checkpoints, and every ``HOG_EVERY_S``
  two CPU hogs on the machine for ``HOG_FOR_S`` (every node alike). Counted: swaps and exclusions (target 0)
  and ``node_slow`` and ``job_slow`` events per hour.

Writes the ``slow_localization`` section of bench/RESULTS.md. Needs root (cgroup v1 ``cpu``, namespaces).

    python bench/slow_localization.py [--trials 20] [--compute-jobs 1] [--noise-minutes 30]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402
from bench.slow_nodes import _cpu_s, _quota, _release  # noqa: E402
from hpcelastic.rundir import RunDir  # noqa: E402
from tests.slow_job import SLOW_AFTER_STEP, STEP_TIME, train_args  # noqa: E402
from tests.testbed import own_instance  # noqa: E402

SPEED = 0.5
NETWORK_DELAY = "50ms"
TRIAL_TIMEOUT_S = 150
RECOVER_S = 25
HOG_EVERY_S, HOG_FOR_S = 300, 60
NET_SETTINGS = {"index": "25", "nodes": "4", "netns": "1", "slurmd_timeout": "15", "cpus_per_node": "4"}
STEPS = 100_000  # more than any part trains: each job is stopped when its trials are done


def _events(run: Path) -> list[dict[str, Any]]:
    return [dict(e) for e in RunDir(run).events()] if run.exists() else []


def _named(run: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in _events(run) if e["event"] == name]


def _wait(what: str, ready: Callable[[], bool], timeout: float, proc: subprocess.Popen[bytes] | None) -> bool:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the job ended before {what}")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _paced(run: Path, ckpt: Path, proc: subprocess.Popen[bytes] | None) -> list[str]:
    """Once the job trains at its pace (its checkpoint of step ``SLOW_AFTER_STEP``): its hosts by rank."""
    first = ckpt / f"ckpt-{SLOW_AFTER_STEP:06d}.pt"
    if not _wait(first.name, first.exists, 300, proc):
        raise RuntimeError(f"no {first.name} within 300 s")
    return list(_named(run, "rendezvous")[0]["hosts"])


def trials(
    run: Path,
    hosts: list[str],
    count: int,
    slow: Callable[[int], Callable[[], None]],
    proc: subprocess.Popen[bytes] | None,
    kind: str,
) -> list[dict[str, Any]]:
    """``count`` trials in turn on the worker nodes 1.. (not the coordinator's): ``slow(i)`` slows node ``i``
    and returns what lifts it. Each: the node slowed, what was named and how soon."""
    out = []
    for t in range(count):
        i = 1 + t % (len(hosts) - 1)
        seen = len(_named(run, "node_slow")) + len(_named(run, "job_slow"))
        began = time.time()
        lift = slow(i)
        try:
            _wait(
                "a verdict",
                lambda seen=seen: len(_named(run, "node_slow")) + len(_named(run, "job_slow")) > seen,
                TRIAL_TIMEOUT_S,
                proc,
            )
        finally:
            lift()
        new = sorted(_named(run, "node_slow") + _named(run, "job_slow"), key=lambda e: e["ts"])
        new = [e for e in new if e["ts"] >= began]
        first = new[0] if new else None
        row = {
            "kind": kind,
            "trial": t,
            "slowed": hosts[i],
            "named": None if first is None else first.get("node") or "job-wide",
            "named_kind": None if first is None else first.get("kind"),
            "named_s": None if first is None else first["ts"] - began,
        }
        row["right"] = row["named"] == hosts[i] and row["named_kind"] == kind
        print(json.dumps(row), flush=True)
        out.append(row)
        time.sleep(RECOVER_S)
    return out


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _local_job(
    tmp: Path, *flags: str, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    run = tmp / "run"
    ckpt = run / "checkpoints"  # the run's checkpoint directory (``hpcelastic run``'s default)
    argv = [sys.executable, "-m", "hpcelastic", "run", "--run-dir", str(run), *flags]
    argv += [*train_args(tmp, ckpt, STEPS), *extra]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), run, ckpt


def compute_trials(count: int) -> list[dict[str, Any]]:
    """One local job's trials of a CPU quota (see the module docstring)."""
    tmp = Path(tempfile.mkdtemp(prefix="hpcelastic-bench-locate-"))
    proc, run, ckpt = _local_job(tmp, "--nodes", "3", "--nproc-per-node", "2", "--slow-action", "report")
    try:
        hosts = _paced(run, ckpt, proc)
        pids = {r: int((tmp / "pids" / f"rank-{r}").read_text()) for r in range(2, 2 * len(hosts))}
        cpu0, t0 = {r: _cpu_s(p) for r, p in pids.items()}, time.monotonic()
        time.sleep(20)
        per_s = {r: (_cpu_s(p) - cpu0[r]) / (time.monotonic() - t0) for r, p in pids.items()}

        def slow(i: int) -> Callable[[], None]:
            groups = [_quota(pids[r], per_s[r] * SPEED, f"locate-{r}") for r in (2 * i, 2 * i + 1)]

            def lift() -> None:
                for g in groups:
                    _release(g)

            return lift

        return trials(run, hosts, count, slow, proc, "compute")
    finally:
        _stop(proc)


def network_trials(count: int) -> list[dict[str, Any]]:
    """One Slurm job's trials of a delayed link on the bench's namespaced instance."""
    tmp = Path(tempfile.mkdtemp(prefix="hpcelastic-bench-locate-net-"))
    run, ckpt = tmp / "run", tmp / "ckpt"
    with own_instance("benchnet", NET_SETTINGS) as tb:
        argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", "testbed-netns"]
        argv += ["--run-dir", str(run), "--time", "120", "--nodes", "3", "--nproc-per-node", "2"]
        argv += ["--checkpoint-dir", str(ckpt), "--slow-action", "report", *train_args(tmp, ckpt, STEPS)]
        proc = subprocess.run(argv, capture_output=True, text=True, env=tb.slurm_env(), cwd=tmp, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr)
        job = str(json.loads(proc.stdout)["job_id"])
        try:
            hosts = _paced(run, ckpt, None)

            def slow(i: int) -> Callable[[], None]:
                tb.netem(hosts[i], "delay", NETWORK_DELAY)
                return lambda: print(tb.heal(hosts[i]), file=sys.stderr)

            return trials(run, hosts, count, slow, None, "network")
        finally:
            tb.slurm("scancel", job, check=False)


def false_actions(minutes: float) -> dict[str, Any]:
    """A fault-free job with noise for ``minutes``: what the slow-node policy did."""
    tmp = Path(tempfile.mkdtemp(prefix="hpcelastic-bench-noise-"))
    noise = ("--jitter", "0.15", "--stripe-every", "7", "--stripe-rank", "1", "--stripe-batches", "4")
    flags = ("--nodes", "2", "--spare-nodes", "1", "--nproc-per-node", "2", "--slow-action", "swap")
    proc, run, ckpt = _local_job(tmp, *flags, extra=noise)
    stop = threading.Event()
    hog_s = 0.0

    def hogs() -> None:
        nonlocal hog_s
        while not stop.wait(HOG_EVERY_S):
            started = time.monotonic()
            spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
            stop.wait(HOG_FOR_S)
            for h in spin:
                h.kill()
                h.wait()
            hog_s += time.monotonic() - started

    threading.Thread(target=hogs, daemon=True).start()
    try:
        _paced(run, ckpt, proc)
        began = time.monotonic()
        _wait("the end", lambda: False, minutes * 60, proc)
        hours = (time.monotonic() - began) / 3600
    finally:
        stop.set()
        _stop(proc)
    slow = _named(run, "node_slow")
    return {
        "minutes": hours * 60,
        "hog_s": hog_s,
        "swaps": sum(e["action"] == "swap" for e in slow),
        "exclusions": sum(e["action"] == "exclude" for e in slow),
        "node_slow_per_h": len(slow) / hours,
        "job_slow_per_h": len(_named(run, "job_slow")) / hours,
        "restarts": len(_named(run, "restarting")),
        "nodes_named": sorted({e["node"] for e in slow}),
    }


def _share(rows: list[dict[str, Any]]) -> str:
    right = sum(r["right"] for r in rows)
    times = sorted(r["named_s"] for r in rows if r["right"])
    med = (
        f", named in {times[len(times) // 2]:.0f} s (median; {times[0]:.0f}-{times[-1]:.0f})" if times else ""
    )
    wrong = [
        f"{r['slowed']} -> {r['named'] or 'nothing'} {r['named_kind'] or ''}".strip()
        for r in rows
        if not r["right"]
    ]
    return f"{right} of {len(rows)}{med}" + (f"; missed: {', '.join(wrong)}" if wrong else "")


def section(saved: dict[str, Any]) -> str:
    """The ``slow_localization`` section of bench/RESULTS.md from every part's latest results."""
    rows = []
    if "compute" in saved:
        c = saved["compute"]
        rows.append(
            f"| compute | CPU quota for {SPEED:.0%} of its speed (cgroup v1), `hpcelastic run`, {c['jobs']} "
            f"job(s); {c['when']} | {_share(c['rows'])} |"
        )
    if "network" in saved:
        n = saved["network"]
        rows.append(
            f"| network | {NETWORK_DELAY} each way on its link (namespaced Slurm testbed, "
            f"`hpcelastic submit`); {n['when']} | {_share(n['rows'])} |"
        )
    lines = [
        "## Slow nodes: localization and false actions (bench/slow_localization.py)",
        "",
        machine_line(),
        "",
        "The unchanged DDP script of the tests (tests/faults/slow_train.py: gloo, steps padded to "
        f"{STEP_TIME} s, a checkpoint every 20 steps), `--slow-action report`, 3 nodes x 2 workers; each "
        "trial slows one worker node (in turn, never the coordinator's) until a verdict or "
        f"{TRIAL_TIMEOUT_S} s, then {RECOVER_S} s to recover. Parts run at once in the latest run: "
        f"{', '.join(saved['together'])}.",
        "",
        "| kind | how the node was slowed | right node and kind |",
        "|---|---|---|",
        *rows,
    ]
    if "noise" in saved:
        fa = saved["noise"]
        lines += [
            "",
            "False actions: `hpcelastic run --nodes 2 --spare-nodes 1 --nproc-per-node 2 --slow-action "
            f"swap`, fault-free for {fa['minutes']:.0f} min with noise (each rank's step up to 15 % "
            "longer at random, rank 1 four batches more every 7th step, checkpoints every 20 steps, two CPU "
            f"hogs on the machine for {HOG_FOR_S} s every {HOG_EVERY_S} s: {fa['hog_s']:.0f} s in all; "
            f"{fa['when']}): "
            f"**{fa['swaps']} swaps, {fa['exclusions']} exclusions**, {fa['restarts']} restarts; "
            "`node_slow` "
            f"{fa['node_slow_per_h']:.1f} an hour"
            + (f" ({', '.join(fa['nodes_named'])})" if fa["nodes_named"] else "")
            + f", `job_slow` (job-wide) {fa['job_slow_per_h']:.1f} an hour.",
        ]
    return "\n".join(lines)


#: Each part's latest results (raw), so that the parts can be run apart and the section shows them all.
SAVED = Path(__file__).with_name("slow_localization.json")
PARTS = ("compute", "network", "noise")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per kind")
    parser.add_argument("--compute-jobs", type=int, default=1, help="local jobs sharing the compute trials")
    parser.add_argument("--noise-minutes", type=float, default=30.0)
    parser.add_argument("--parts", default=",".join(PARTS), help="which to run now (the others: as saved)")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"--parts: unknown part {unknown[0]!r} (known: {', '.join(PARTS)})")
    jobs = args.compute_jobs
    per_job = [args.trials // jobs + (1 if j < args.trials % jobs else 0) for j in range(jobs)]
    saved: dict[str, Any] = json.loads(SAVED.read_text()) if SAVED.exists() else {}
    with ThreadPoolExecutor(jobs + 2) as pool:
        noise = pool.submit(false_actions, args.noise_minutes) if "noise" in parts else None
        net = pool.submit(network_trials, args.trials) if "network" in parts else None
        comp = [pool.submit(compute_trials, n) for n in per_job] if "compute" in parts else []
        stamp = time.strftime("%Y-%m-%d %H:%M")
        if comp:
            saved["compute"] = {"when": stamp, "jobs": jobs, "rows": [r for f in comp for r in f.result()]}
        if net is not None:
            saved["network"] = {"when": stamp, "rows": net.result()}
        if noise is not None:
            saved["noise"] = {"when": stamp, **noise.result()}
    saved["together"] = parts
    SAVED.write_text(json.dumps(saved, indent=1) + "\n")
    text = section(saved)
    update_section("slow_localization", text)
    print(text)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
