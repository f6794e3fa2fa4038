"""Issue 27's differential under the testbed's faults: one unchanged ``tests/scripts/tier_libs`` script
submitted twice with ``hpcelastic submit --nodes 2 --spare-nodes 1 --nproc-per-node 2`` on one testbed
instance, without the tier and with ``--local-checkpoint-dir``, both at once, under the same two faults in
one job each:

1. a node killed whole (``testbed.sh kill-node``: slurmd and every process of the node at once) inside a save
   that rank 0 holds open: the spare takes its place (round 1, Restarts stays 0);
2. inside a later save, the node holding rank 0 killed whole: that is the batch host (rank 0's node is the
   coordinator's), whose death Slurm and hpcelastic answer with a requeue (attempt 1, Restarts=1), as users
   meet a lost batch host.

The script stands still where its mid-save fault would kill it (``TIER_LIBS_STALL_*`` in
tests/scripts/tier_libs/common.py), once a save, until its node is killed. With the tier, every round must
resume from a step at least as late as without it, the final model must be the same, the checkpoint
directory must hold a complete checkpoint at least as new, and Slurm's own view (``scontrol show job``:
JobState, Restarts, NodeList without the killed nodes) must be the same. Used by
tests/slurm/test_tier_differential_slurm.py (a few layouts) and bench/tier_differential_slurm.py (every
layout).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcelastic.jobs.slurm import ENDED_STATES, parse_scontrol_record
from hpcelastic.rundir import RunDir
from tests.faults import tier_differential as differential
from tests.faults.tier_differential import (
    NODES,
    NPROC,
    SAVE_EVERY,
    SCRIPTS,
    STEP_TIME,
    STEPS,
    WORLD,
    Fault,
    Layout,
    Outcome,
    read,
)
from tests.slurm_utils import events, named, submit_argv, wait_no_leaks
from tests.testbed import Testbed

SPARES = 1
#: A pair's nodes: two jobs of 3 at once, each losing 2 and requeued onto 3 more.
PAIR_NODES = 2 * (NODES + SPARES) + 4
#: Each job asks for every CPU of its nodes: no two jobs share a node (with ``--exclusive`` instead, each job
#: held every GRES of its nodes, and Slurm 22.05 left them allocated after the jobs ended: seen here).
CPUS = 8
#: Each job's tier directories (``{node}`` names the instance: ``tierdiff3``).
SHM = Path("/dev/shm")
TEMPLATE = "/dev/shm/hpce27s-{job}-{node}"
#: The pairs run at once, from the submissions to every job's end (a requeue waits for the dead batch host to
#: be DOWN; two pairs took 250 s, three 305 to 420 s, on two cores under other load).
TIMEOUT_S = 420


@dataclass(frozen=True)
class Stalls:
    """Where rank 0 stands still for each kill (``SAVES``: inside the saves of these steps; ``STEPS``: before
    these steps, for a layout without a mid-save point), and the rounds' resume steps that gives without the
    tier (attempt 0's rounds 0 and 1, then attempt 1's round 0)."""

    kind: str
    at: tuple[int, int]
    resumed: tuple[int, ...]


#: Inside the saves of steps 10 (the spare) and 15 (the requeue): torn, so 5 and 10 without the tier.
MID_SAVE = Stalls("SAVES", (10, 15), (0, 5, 10))
#: ``torch.save`` of one file has no point inside its save: before steps 12 and 17.
BETWEEN = Stalls("STEPS", (12, 17), (0, 10, 15))


def settings(index: int, pairs: int) -> dict[str, str]:
    """The settings of an instance (``index``: its 127.0.I.x addresses) that runs ``pairs`` pairs at once."""
    nodes = str(pairs * PAIR_NODES)
    return {"index": str(index), "nodes": nodes, "slurmd_timeout": "10", "cpus_per_node": str(CPUS)}


def stalls_for(layout: Layout) -> Stalls:
    return BETWEEN if layout.name == "torch-save-one-file" else MID_SAVE


@dataclass
class Job:
    """One submitted job of a pair and what the harness did to it."""

    layout: Layout
    stalls: Stalls
    tier: bool
    where: Path
    job: str
    run: Path
    submitted: float
    killed: list[str] = field(default_factory=list)
    record: dict[str, str] = field(default_factory=dict)
    ended: float | None = None

    @property
    def stall_dir(self) -> Path:
        return self.where / "stall"


@dataclass
class SlurmOutcome(Outcome):
    """:class:`Outcome` of a Slurm job, with ``scontrol show job``'s record at its end, the nodes the harness
    killed and the job's wall time (submission to end)."""

    record: dict[str, str]
    killed: list[str]
    seconds: float

    def brief(self) -> str:
        slurm = {k: self.record.get(k) for k in ("JobState", "Restarts", "NodeList", "ExitCode")}
        return f"scontrol={slurm} killed={self.killed} {self.seconds:.0f} s\n{super().brief()}"


def job_record(tb: Testbed, job: str) -> dict[str, str]:
    out = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
    return parse_scontrol_record(out.splitlines()[0]) if out.strip() else {}


def submit(tb: Testbed, root: Path, layout: Layout, tier: bool) -> Job:
    """Submit the layout's script under its stalls, with the tier or without."""
    stalls = stalls_for(layout)
    where = root / ("tier" if tier else "shared")
    (where / "stall").mkdir(parents=True)
    (where / "config").mkdir()
    run = where / "run"
    argv = submit_argv(run) + [
        "--time", "10", "--nodes", str(NODES), "--spare-nodes", str(SPARES), "--nproc-per-node", str(NPROC),
        "--max-restarts", "2", f"--sbatch-arg=--cpus-per-task={CPUS}",
        "--env", f"TIER_LIBS_STALL_{stalls.kind}={','.join(map(str, stalls.at))}",
        "--env", f"TIER_LIBS_STALL_DIR={where / 'stall'}",
        *(["--local-checkpoint-dir", TEMPLATE] if tier else []),
        str(SCRIPTS / layout.script), *layout.args, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
        "--step-time", str(STEP_TIME), "--out", str(where / "final.json"),
    ]  # fmt: skip
    env = {**tb.slurm_env(), "XDG_CONFIG_HOME": str(where / "config")}  # no user config of this machine
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=where, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return Job(layout, stalls, tier, where, str(json.loads(proc.stdout)["job_id"]), run, time.monotonic())


def round_hosts(run: Path) -> list[str]:
    """The hosts of the run's latest round, by node rank (rank 0's node first)."""
    rounds = named(events(run), "rendezvous")
    assert rounds, f"no round in {run}"
    return list(rounds[-1]["hosts"])


def step(tb: Testbed, job: Job) -> None:
    """Kill the node the job's next stall calls for, once rank 0 stands in it; note the job's end."""
    if job.ended is not None:
        return
    n = len(job.killed)
    if n < 2 and (job.stall_dir / f"stalled-{job.stalls.at[n]}").exists():
        hosts = round_hosts(job.run)
        batch_host = job_record(tb, job.job).get("BatchHost")
        assert hosts[0] == batch_host, f"rank 0's node {hosts[0]} is not the batch host {batch_host}"
        victim = hosts[1] if n == 0 else hosts[0]  # 1: a node the spare replaces; 2: rank 0's, a requeue
        tb.kill_node(victim)
        job.killed.append(victim)
    rec = job_record(tb, job.job)
    if rec.get("JobState") in ENDED_STATES:
        job.record, job.ended = rec, time.monotonic()


def outcome(job: Job) -> SlurmOutcome:
    """What the job left: every attempt's rounds' resume steps, the digest, the complete checkpoints."""
    run = RunDir(job.run)
    attempts = int(job.record.get("Restarts", "0")) + 1
    ranks_resumed: dict[int, list[int]] = {r: [] for r in range(WORLD)}
    logs = []
    for attempt in range(attempts):
        for r in range(WORLD):
            text = read(run.rank_log_path(attempt, r))
            ranks_resumed[r] += [int(m) for m in re.findall(r"^resumed (\d+)$", text, re.M)]
            if r == 0:
                logs.append(text)
    out = job.where / "final.json"
    digest = json.loads(out.read_text())["sha256"] if out.exists() else None
    checkpoints: dict[str, int] = {}
    root = job.run / "checkpoints"
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        if (found := job.layout.judge(entry)) is not None:
            checkpoints[entry.name] = found
    seconds = (job.ended or time.monotonic()) - job.submitted
    code = job.record.get("ExitCode", "").split(":")[0]
    codes = [int(code) if code.isdigit() else None] * NODES  # the job's, as each agent's is read locally
    return SlurmOutcome(
        codes, ranks_resumed[0], ranks_resumed, digest, events(job.run), checkpoints, "\n".join(logs),
        job.record, job.killed, seconds,
    )  # fmt: skip


def run_pairs(
    tb: Testbed, root: Path, layouts: list[Layout], timeout: float = TIMEOUT_S
) -> dict[str, tuple[SlurmOutcome, SlurmOutcome]]:
    """Each layout's script under its stalls' two node deaths, without the tier and with it: every job at once
    (the instance has :func:`settings` ``(len(layouts))``), for at most ``timeout`` seconds (then cancelled);
    each layout's outcomes without and with."""
    jobs: list[Job] = []
    try:
        for layout in layouts:
            jobs += [submit(tb, root / layout.name, layout, tier) for tier in (False, True)]
        deadline = time.monotonic() + timeout
        while any(j.ended is None for j in jobs) and time.monotonic() < deadline:
            for j in jobs:
                step(tb, j)
            time.sleep(0.3)
    finally:
        for j in jobs:
            if j.ended is None:
                tb.slurm("scancel", j.job, check=False)
                j.record = job_record(tb, j.job)
        for j in jobs:
            for node in j.killed:
                tb.revive_node(node)
            for leftover in SHM.glob(f"hpce27s-{j.job}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
    for j in jobs:
        assert not wait_no_leaks(str(j.run)), f"processes of {j.run} left"
    outcomes = [outcome(j) for j in jobs]
    return {lay.name: (outcomes[2 * i], outcomes[2 * i + 1]) for i, lay in enumerate(layouts)}


def hosts(tb: Testbed, nodelist: str) -> set[str]:
    return set(tb.slurm("scontrol", "show", "hostnames", nodelist).split()) if nodelist else set()


def check(tb: Testbed, layout: Layout, without: SlurmOutcome, with_tier: SlurmOutcome) -> None:
    """Slurm's view of both jobs, then issue 27's differential (``tests.faults.tier_differential.check``)."""
    stalls = stalls_for(layout)
    both = f"{layout.name}\n--- without: {without.brief()}\n--- with: {with_tier.brief()}"
    for o in (without, with_tier):
        assert len(o.killed) == 2, f"a stall never came: the node deaths did not happen\n{both}"
        assert o.record.get("JobState") == "COMPLETED" and o.record.get("Restarts") == "1", (
            f"{'with' if o is with_tier else 'without'} the tier, Slurm's view is not COMPLETED after one "
            f"requeue\n{both}"
        )
        assert not hosts(tb, o.record.get("NodeList", "")) & set(o.killed), f"a dead node ran the job\n{both}"
    fault = Fault(f"node deaths, stalls in {stalls.kind.lower()} {stalls.at}", (), stalls.resumed)
    differential.check(layout, fault, without, with_tier)
