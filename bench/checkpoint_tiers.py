"""Checkpoint tiers side by side: DCP ``save`` to the shared checkpoint directory, DCP ``async_save`` to it,
and hpcelastic's node-local tier (DCP ``save``, or ``async_save``, into ``/dev/shm``, replicated to a peer
node and persisted in the background), on the same training in the same run (issue 22).

``bench/_tier_train.py`` under ``hpcelastic run``: NODES emulated nodes x 1 CPU gloo worker, each holding
MB of state of its own (sharded, 64 MB tensors), a checkpoint every CKPT_EVERY steps. Per method, medians of
RUNS runs:

- blocked: the training's time inside the checkpoint call, against a memory copy of the state (``clone``);
- failure to training again, including the load: a worker SIGKILLed once the second checkpoint is written
  (with the tier: replicated, the steady state between checkpoints) (restore
  from the node's own memory, or a reload from the shared directory, read cold: its pages are evicted from
  the page cache first, as a read from a network filesystem would be), and a node's agent and workers
  SIGKILLed with ``--spare-nodes 1`` (the spare restores the lost node's files from its peer's replica):
  the time from the kill to the first step of the new round;
- peak host memory per node: the largest sum, over the run, of a node's processes' resident anonymous memory
  and its local tier's bytes in ``/dev/shm`` (which count against memory; files mapped to send them are not
  counted twice);
- work redone per failure at the checkpoint interval each method affords for the same blocked-time budget
  (BUDGET of the training time): tau = C / BUDGET, half of it redone on average;
- the goodput projection of bench/goodput.py redone with each method's measured C and R (the failure to
  training again), and the bytes per node per interval the tier's replication needs.

The shared directory is the run directory's filesystem on this machine's disk (DCP's ``save`` syncs every
file it writes). Writes the ``checkpoint_tiers`` section of bench/RESULTS.md.

Memory: every emulated node (and the spare) shares this machine's RAM. A node holds its state, DCP's staging
copy with ``async_save``, and up to two checkpoints' worth of its own files and its peer's in ``/dev/shm``:
about 6-8x its state at the peak. With 1 GB per node a node-loss run with ``async_save`` peaks at 7.3 GB
per node (three agents: 2 nodes and the spare): it fits this 23 GB machine alone, and was killed by the
kernel while other sessions shared it, so the default is 512 MB and ``--mb 1024`` writes a section of its own.

    python bench/checkpoint_tiers.py [--nodes 2] [--mb 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._cleanup import tracked  # noqa: E402
from bench._results import machine_line, update_section  # noqa: E402
from bench.goodput import MTTF_H, projected_ettr  # noqa: E402
from hpcelastic.agent.launcher import LocalRun, start_agents  # noqa: E402
from hpcelastic.rundir import RunDir  # noqa: E402
from hpcelastic.tier.node import bytes_under  # noqa: E402
from hpcelastic.tier.settings import TierSettings  # noqa: E402

TRAIN = REPO / "bench" / "_tier_train.py"
STEPS, STEP_TIME, CKPT_EVERY = 60, 0.5, 10
#: The share of training time each method may spend blocked in checkpoints (for the redone-work column).
BUDGET = 0.01
#: State per node, MB, unless ``--mb`` says otherwise (see the docstring for why not 1 GB).
DEFAULT_MB = 512
#: Today's projection (bench/goodput.py): async DCP of a 7B model, hpcelastic's launcher cost per failure.
TODAY_C, TODAY_R = 6.3, 0.54
METHODS = ("shared save", "shared async_save", "local tier", "local tier + async_save")
RUN_TIMEOUT = 600.0


@dataclass
class Sample:
    """One run of one method and fault."""

    method: str
    fault: str
    copy_s: float = math.nan
    blocked_s: list[float] = field(default_factory=list)
    #: Of the blocked time, the waits for the previous async save to finish writing.
    waited_s: list[float] = field(default_factory=list)
    recovery_s: float = math.nan
    load_s: float = math.nan
    #: The tier's restore before the new round's workers started (the slowest node's).
    restore_s: float = math.nan
    peak_mb: float = math.nan
    ok: bool = False
    note: str = ""


def times(out: Path) -> list[dict[str, float]]:
    rows = []
    for f in out.glob("times-*.jsonl"):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["ts"])


class MemoryWatch:
    """Samples each local node's memory: its agent's process tree's resident bytes plus its tier's bytes."""

    def __init__(self, agents: list[subprocess.Popen[bytes]], tier_dirs: list[Path]) -> None:
        self.agents = agents
        self.tier_dirs = tier_dirs
        self.peak = [0] * len(agents)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            for i, agent in enumerate(self.agents):
                total = 0
                with contextlib.suppress(psutil.Error):
                    root = psutil.Process(agent.pid)
                    for p in [root, *root.children(recursive=True)]:
                        total += anon_bytes(p.pid)
                total += bytes_under(self.tier_dirs[i]) if i < len(self.tier_dirs) else 0
                self.peak[i] = max(self.peak[i], total)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def anon_bytes(pid: int) -> int:
    """A process's resident anonymous memory (``RssAnon``): its own, not the files it maps (the tier's files
    it sends are counted once, as the tier's bytes)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_pid(run: Path, rank: int) -> int | None:
    import re

    log = RunDir(run).rank_log_path(0, rank)
    with contextlib.suppress(OSError):
        found = re.findall(r"^=== round \d+ restart \d+ pid (\d+) ===$", log.read_text(), re.M)
        return int(found[-1]) if found else None
    return None


def wait(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def run_once(method: str, fault: str, nodes: int, mb: int, root: Path) -> Sample:
    """One training of ``method``, ``fault`` (``worker`` or ``node``) injected after its 2nd checkpoint."""
    sample = Sample(method, fault)
    work = Path(tempfile.mkdtemp(prefix="ckpt-tiers-", dir=root))
    out, run = work / "out", work / "run"
    tier = method.startswith("local tier")
    ckpt = work / "shared-ckpt"
    template = f"/dev/shm/hpce22-bench-{work.name}-{{node}}"
    program = [str(TRAIN), "--mb", str(mb), "--steps", str(STEPS), "--step-time", str(STEP_TIME)]
    program += ["--ckpt-every", str(CKPT_EVERY), "--out", str(out)]
    program += ["--ckpt-dir", "{checkpoint_dir}" if tier else str(ckpt)]
    program += ["--async"] if method.endswith("async_save") else []
    program += [] if tier else ["--cold-load"]
    spares = 1 if fault == "node" else 0
    spec = LocalRun(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc="1",
        max_restarts=2,
        run_dir=run,
        spare_nodes=spares,
        program=tuple(program),
        rdzv_timeout=60,
        grace_period=60,
        local_tier=TierSettings(template).to_text() if tier else None,
        agent_args=("--checkpoint-dir", str(ckpt)),
    )
    _, agents = start_agents(spec)
    tier_dirs = [Path(template.format(node=f"local{i}")) for i in range(nodes + spares)]
    watch = MemoryWatch(agents, tier_dirs if tier else [])
    try:
        second = ckpt / f"step-{2 * CKPT_EVERY:06d}" if not tier else None

        def second_done() -> bool:
            """The second checkpoint is written (its .metadata), or, with the tier, replicated: the failure
            comes in the steady state, not while the tier still copies the checkpoint to the peer."""
            if second is not None:
                return (second / ".metadata").exists()
            evs = [e for e in RunDir(run).events() if e["event"] == "tier_replicated"]
            return any((e.get("step") or 0) >= 2 * CKPT_EVERY for e in evs)

        if not wait(second_done, RUN_TIMEOUT / 2):
            sample.note = "no second checkpoint"
            return sample
        kill_ts = time.time()
        if fault == "worker":
            pid = worker_pid(run, 0)
            try:
                if pid is None:
                    raise ProcessLookupError
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                sample.note = "the worker was gone before the fault"
                return sample
        else:
            victim = psutil.Process(agents[nodes - 1].pid)
            procs = [victim, *victim.children(recursive=True)]
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        codes = [a.wait(timeout=RUN_TIMEOUT) for a in agents]
        rows = times(out)
        sample.copy_s = statistics.median([r["copy_s"] for r in rows if "copy_s" in r])
        sample.blocked_s = [r["blocked_s"] for r in rows if "blocked_s" in r and r["ts"] < kill_ts]
        sample.waited_s = [r["waited_s"] for r in rows if "waited_s" in r and r["ts"] < kill_ts]
        firsts = [r for r in rows if "first_step" in r and r["ts"] > kill_ts]
        loads = [r["loaded_s"] for r in rows if "loaded_s" in r and r["ts"] > kill_ts]
        if firsts:
            sample.recovery_s = max(r["ts"] for r in firsts) - kill_ts
        sample.load_s = max(loads) if loads else math.nan
        restores = [
            e["duration_s"]
            for e in RunDir(run).events()
            if e["event"] == "tier_restored" and e["ts"] > kill_ts
        ]
        sample.restore_s = max(restores) if restores else math.nan
        sample.ok = codes[0] == 0 and bool(firsts)
        if not sample.ok:
            sample.note = f"exit codes {codes}"
    finally:
        peaks = watch.stop()
        sample.peak_mb = max(peaks) / (1 << 20) if peaks else math.nan
        for a in agents:
            with contextlib.suppress(OSError):
                a.kill()
        for d in tier_dirs:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return sample


def med(values: list[float]) -> float:
    good = [v for v in values if not math.isnan(v)]
    return statistics.median(good) if good else math.nan


def fmt(x: float, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if math.isnan(x) else f"{x:{spec}}{unit}"


def summarize(samples: list[Sample], nodes: int, mb: int, runs: int) -> str:
    def of(method: str, fault: str) -> list[Sample]:
        return [s for s in samples if s.method == method and s.fault == fault and s.ok]

    copy = med([s.copy_s for s in samples if s.ok])
    blocked = {m: med([b for s in samples if s.method == m and s.ok for b in s.blocked_s]) for m in METHODS}
    waited = {m: med([b for s in samples if s.method == m and s.ok for b in s.waited_s]) for m in METHODS}
    lines = [
        "## Checkpoint tiers: shared directory, async, node-local (`bench/checkpoint_tiers.py`)",
        "",
        machine_line(),
        f"{nodes} nodes x 1 CPU gloo worker under `hpcelastic run`, {mb} MB of sharded state per node (64 MB "
        f"tensors), DCP checkpoints every {CKPT_EVERY} steps of {STEP_TIME} s; the shared directory is this "
        "machine's disk (DCP `save` syncs its files), the local tier `/dev/shm` with 1 replica and every "
        f"checkpoint persisted in the background. Medians of {runs} run(s) per method and fault.",
        "",
        f"A memory copy of a node's state (`clone`): {fmt(copy)} s.",
        "",
        "| method | blocked per checkpoint | of it, waiting for the previous save | / memory copy "
        "| failure to training (worker crash) | load in it | restore in it "
        "| failure to training (node lost, spare) | restore in it | peak host memory per node |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    recovery: dict[str, float] = {}
    for m in METHODS:
        crash, node = of(m, "worker"), of(m, "node")
        rec_crash = med([s.recovery_s for s in crash])
        rec_node = med([s.recovery_s for s in node])
        recovery[m] = rec_node if not math.isnan(rec_node) else rec_crash
        peak = med([s.peak_mb for s in crash + node])
        lines.append(
            f"| {m} | {fmt(blocked[m], '.2f', ' s')} | {fmt(waited[m], '.2f', ' s')} "
            f"| {fmt(blocked[m] / copy, '.1f', 'x')} "
            f"| {fmt(rec_crash, '.2f', ' s')} | {fmt(med([s.load_s for s in crash]), '.2f', ' s')} "
            f"| {fmt(med([s.restore_s for s in crash]), '.2f', ' s')} | {fmt(rec_node, '.2f', ' s')} "
            f"| {fmt(med([s.restore_s for s in node]), '.2f', ' s')} | {fmt(peak, '.0f', ' MB')} |"
        )
    shared = blocked["shared save"]
    lines.append("")
    for m in ("local tier", "local tier + async_save"):
        lines.append(
            f"{m}: blocked / memory copy {fmt(blocked[m] / copy, '.2f', 'x')} (target <= 2x); DCP save to "
            f"the shared directory / {m}: {fmt(shared / blocked[m], '.1f', 'x')} (target >= 5x)."
        )
    lines += [
        "",
        f"### Work redone per failure at the same blocked-time budget ({BUDGET:.0%} of training time)",
        "",
        "Interval tau = C / budget; a failure redoes tau / 2 on average.",
        "",
        "| method | C (s) | interval (s) | redone per failure (s) |",
        "|---|---|---|---|",
    ]
    for m in METHODS:
        tau = blocked[m] / BUDGET
        lines.append(f"| {m} | {fmt(blocked[m])} | {fmt(tau, '.0f')} | {fmt(tau / 2, '.1f')} |")
    lines += [
        "",
        "### Goodput projected to scale (bench/goodput.py's model with these C and R)",
        "",
        "ETTR = 1 - C/tau - (R + tau/2)/M, tau = sqrt(2 C M), M = Meta's mean time to failure. C: the "
        "blocked time measured above; R: failure to training again measured above after a node loss (a "
        "spare restores from its peer's replica, or reads the shared directory). 'today': "
        f"C = {TODAY_C} s (async DCP of a 7B model), R = {TODAY_R} s (bench/goodput.py). Replication: each "
        f"node sends its part ({mb} MB here) to 1 peer per interval.",
        "",
        "| method | C (s) | R (s) | GPUs | tau (s) | expected ETTR | replication per node per interval |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [("today (async DCP 7B)", TODAY_C, TODAY_R)] + [(m, blocked[m], recovery[m]) for m in METHODS]
    for name, c, r in rows:
        for gpus, mttf in MTTF_H.items():
            if math.isnan(c) or math.isnan(r):
                continue
            tau, ettr = projected_ettr(r, mttf, c)
            net = f"{mb} MB per {tau:.0f} s = {mb / tau:.1f} MB/s" if name.startswith("local") else "-"
            lines.append(f"| {name} | {c:.2f} | {r:.2f} | {gpus:,} | {tau:.0f} | {ettr * 100:.2f}% | {net} |")
    tau_local = projected_ettr(
        recovery["local tier + async_save"], MTTF_H[16384], blocked["local tier + async_save"]
    )[0]
    lines += [
        "",
        "### What replication needs of the network at GPU scale",
        "",
        "Each node sends its part of every checkpoint to 1 peer (`replicas: 1`) once per interval, in the "
        "background and throttled (`replication_mb_s`). A node's part at 16,384 GPUs (2,048 nodes of 8), "
        "with mixed-precision Adam (16 bytes a parameter) sharded over every GPU, at the interval projected "
        f"above for the local tier + async_save ({fmt(tau_local, '.0f')} s):",
        "",
        "| model | state (16 B/param) | a node's part | bytes a node sends per interval | MB/s a node |",
        "|---|---|---|---|---|",
    ]
    for name, params in (("7B", 7e9), ("70B", 70e9), ("405B", 405e9)):
        total = params * 16
        part = total / 2048
        lines.append(
            f"| {name} | {total / 1e9:,.0f} GB | {part / 1e6:,.0f} MB | {part / 1e6:,.0f} MB "
            f"| {fmt(part / 1e6 / tau_local, '.1f')} |"
        )
    lines += [
        "",
        "Against a 400 Gb/s (50 GB/s) NIC per node these are well under 1 % of the link; the persist to "
        "the shared filesystem (every `persist_every`-th checkpoint) moves the same bytes to the filesystem "
        "instead of to a peer, off the training's critical path.",
    ]
    return "\n".join(lines)


def section_of(mb: int) -> str:
    """The bench/RESULTS.md section of a state size: each size's figures are kept side by side."""
    return "checkpoint_tiers" if mb == DEFAULT_MB else f"checkpoint_tiers_{mb}mb"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--mb", type=int, default=DEFAULT_MB, help="state per node, MB (see the docstring)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset (a quick check)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    ap.add_argument("--samples", type=Path, help="also save every run's figures to this JSON file")
    ap.add_argument("--summarize", type=Path, help="only summarize the figures a --samples file holds")
    args = ap.parse_args()
    if args.summarize:
        saved = json.loads(args.summarize.read_text())
        samples = [Sample(**s) for s in saved["samples"]]
        md = summarize(samples, saved["nodes"], saved["mb"], saved["runs"])
        print(md)
        if not args.no_write:
            update_section(section_of(saved["mb"]), md)
        return
    samples = []
    with tracked(), tempfile.TemporaryDirectory(prefix="ckpt-tiers-", dir=str(REPO)) as tmp:
        for i in range(args.runs):
            for method in [m for m in METHODS if m in args.methods.split(",")]:
                for fault in ("worker", "node"):
                    s = run_once(method, fault, args.nodes, args.mb, Path(tmp))
                    print(
                        f"run {i + 1} {method:18} {fault:6} blocked {med(s.blocked_s):.2f} s "
                        f"recovery {s.recovery_s:.2f} s load {s.load_s:.2f} s restore {s.restore_s:.2f} s "
                        f"peak {s.peak_mb:.0f} MB "
                        f"{'ok' if s.ok else 'FAILED ' + s.note}",
                        flush=True,
                    )
                    samples.append(s)
    if args.samples:
        saved = {
            "nodes": args.nodes,
            "mb": args.mb,
            "runs": args.runs,
            "samples": [asdict(s) for s in samples],
        }
        args.samples.write_text(json.dumps(saved))
    md = summarize(samples, args.nodes, args.mb, args.runs)
    print(md)
    if not args.no_write:
        update_section(section_of(args.mb), md)


if __name__ == "__main__":
    main()
