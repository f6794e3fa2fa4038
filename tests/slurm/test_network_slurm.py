"""Network faults on real links between nodes, through ``hpcelastic submit`` (issue 19, items 2, 4, 5).

A Slurm instance of this module's own (``fabric``: 4 nodes, each in a network namespace of its own with
198.18.23.i on a bridge, slurmctld at 198.18.23.254, SlurmdTimeout 15 s). Faults are packets dropped or
delayed on the fabric side of a node's link (``scripts/testbed.sh cut-link | netem | flap | partition``):
the node and its processes live on and still reach the shared filesystem. Outcomes are asserted on
Slurm's record of the job (JobState, Restarts, ExcNodeList) and on the events. A node slowed by its link
(not cut) is named ``network`` and replaced by the spare (issue 28).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic.jobs.slurm import ENDED_STATES, parse_scontrol_record
from tests import slow_job
from tests.slurm_utils import TRAIN, events, named, reference_digest, train_args
from tests.testbed import Testbed, own_instance

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name="fabric")]

NAME = "fabric"
SETTINGS = {"index": "23", "nodes": "4", "netns": "1", "slurmd_timeout": "15", "cpus_per_node": "4"}
FENCE_TRAIN = Path(__file__).with_name("fence_train.py")
#: The nodes talk over eth0 in their namespaces (site_configs/testbed-netns.yaml).
SITE = "testbed-netns"


@pytest.fixture(scope="module")
def tb(slurm_cluster: dict[str, object]) -> Iterator[Testbed]:
    with own_instance(NAME, SETTINGS) as inst:
        yield inst


def node(i: int) -> str:
    return f"{NAME}{i}"


def job_record(tb: Testbed, job: str) -> dict[str, str]:
    out = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
    return parse_scontrol_record(out.splitlines()[0]) if out.strip() else {}


def submit(tb: Testbed, tmp_path: Path, *flags: str, script: Path, args: list[str]) -> tuple[str, Path]:
    run = tmp_path / "run"
    wait_until("every node idle", lambda: idle_nodes(tb) == 4, 60)  # a MIN:MAX job gets MAX nodes
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", SITE, "--run-dir", str(run)]
    argv += ["--time", "10", *flags, str(script), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=tb.slurm_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["job_id"]), run


def submit_reference(tb: Testbed, tmp_path: Path, steps: int, *flags: str) -> tuple[str, Path]:
    """The reference training (final model in ``tmp_path/out``) on three nodes, one worker each."""
    args = [*train_args(steps), "--step-time", "0.1", "--out", str(tmp_path / "out")]
    return submit(tb, tmp_path, "--nodes", "3", "--nproc-per-node", "1", *flags, script=TRAIN, args=args)


def idle_nodes(tb: Testbed) -> int:
    return tb.slurm("sinfo", "-h", "-N", "-o", "%T").split().count("idle")


def wait_until(what: str, predicate: object, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def wait_ended(tb: Testbed, job: str, timeout: float = 240) -> dict[str, str]:
    rec: dict[str, str] = {}

    def ended() -> bool:
        nonlocal rec
        rec = job_record(tb, job)
        return rec.get("JobState") in ENDED_STATES

    wait_until(f"job {job} ended ({rec})", ended, timeout)
    return rec


def training(run: Path, attempt: int = 0) -> bool:
    return any(e.get("attempt", attempt) == attempt for e in named(events(run), "progress"))


def test_short_drops_loss_and_delay_leave_the_round_alone(tb: Testbed, tmp_path: Path) -> None:
    """1 s and 3 s cuts, a link flapping faster than detection, 20 % loss on one link, 300 ms of delay on
    one and 1 % loss on another, then 5 % loss with 50 ms +- 20 ms on every link: none silences a node for
    the detection bound (4.75 s on both paths). Faults on two links at once where they can be, to keep the
    test short."""
    steps = 320
    job, run = submit_reference(tb, tmp_path, steps)
    try:
        wait_until("the job trains", lambda: training(run))
        tb.cut_link(node(2), 1)
        tb.cut_link(node(3), 3)
        time.sleep(5)
        tb.flap(node(2), 1, 1, 3)
        tb.netem(node(3), "loss", "20%")
        time.sleep(7)
        tb.netem(node(3), "off")
        tb.netem(node(2), "delay", "300ms")
        tb.netem(node(3), "loss", "1%")
        time.sleep(5)
        tb.netem(node(2), "off")
        tb.netem(node(3), "off")
        for i in (1, 2, 3):
            tb.netem(node(i), "delay", "50ms", "20ms", "loss", "5%")
        time.sleep(10)
    finally:
        for i in (1, 2, 3):
            tb.heal(node(i))
    rec = wait_ended(tb, job)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    evs = events(run)
    assert not named(evs, "node_lost") and not named(evs, "restarting"), [e["event"] for e in evs]
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(steps)


def rank_lives(out: Path) -> dict[int, list[tuple[float, float, int, str]]]:
    """For each rank, each worker process that ran it: (first line, last line, pid, attempt.restart)."""
    lives: dict[int, list[tuple[float, float, int, str]]] = {}
    for log in out.glob("rank-*.log"):
        rank = int(log.stem.split("-")[1])
        by_pid: dict[int, list[float]] = {}
        tags: dict[int, str] = {}
        for line in log.read_text().splitlines():
            ts, pid, tag = line.split()
            by_pid.setdefault(int(pid), []).append(float(ts))
            tags[int(pid)] = tag
        lives[rank] = sorted((min(t), max(t), pid, tags[pid]) for pid, t in by_pid.items())
    return lives


def test_a_node_cut_off_for_good_is_fenced_before_its_spare_takes_its_ranks(
    tb: Testbed, tmp_path: Path
) -> None:
    """The round node is cut off from everyone (not from the filesystem) for longer than SlurmdTimeout:
    it is lost within the detection bound, its agent stops its workers, the spare takes its ranks only
    after the fence, Slurm marks the node DOWN and the job (``--no-kill``) finishes in its allocation."""
    out = tmp_path / "out"
    args = ["--out", str(out), "--steps", "500", "--step-time", "0.05"]
    flags = ("--nodes", "2", "--spare-nodes", "1", "--nproc-per-node", "2")
    job, run = submit(tb, tmp_path, *flags, script=FENCE_TRAIN, args=args)
    try:
        wait_until("the job trains", lambda: (out / "step").exists())
        rec = job_record(tb, job)
        victim = node(2) if node(2) in tb.slurm("scontrol", "show", "hostnames", rec["NodeList"]) else None
        assert victim is not None and rec["BatchHost"] != victim, rec
        cut_at = time.time()
        tb.cut_link(victim)
        lost = None

        def victim_lost() -> bool:
            nonlocal lost
            lost = next((e for e in named(events(run), "node_lost") if e["node"] == victim), None)
            return lost is not None

        wait_until("the cut node is lost", victim_lost, 60)
        wait_until(f"Slurm marks {victim} DOWN", lambda: tb.node_state(victim).startswith("down"), 90)
        rec = wait_ended(tb, job)
    finally:
        tb.heal(victim)
        tb.revive_node(victim)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    assert lost is not None and "no answer to probes" in lost["reason"], lost
    print(f"cut link lost after {lost['ts'] - cut_at:.1f} s")
    evs = events(run)
    assert len(named(evs, "restarting")) == 1, [e["event"] for e in evs]
    # Fencing: for every rank, the worker of the old round wrote its last line before the new one started.
    lives = rank_lives(out)
    assert set(lives) == {0, 1, 2, 3}, lives
    replaced = {r: v for r, v in lives.items() if len(v) > 1}
    assert replaced, "the spare took the cut node's ranks"
    for rank, runs in lives.items():
        for (_, old_end, old_pid, _), (new_start, _, new_pid, _) in zip(runs, runs[1:], strict=False):
            assert old_end < new_start, (
                f"rank {rank}: pid {old_pid} wrote until {old_end}, {new_pid} from {new_start}"
            )


def test_the_coordinators_node_cut_off_excludes_no_healthy_node(tb: Testbed, tmp_path: Path) -> None:
    """The batch host (coordinator) loses its link for 10 s: it loses both others, which fence themselves;
    the job is requeued once, nothing excluded, and finishes with the same model as torchrun."""
    steps = 150
    job, run = submit_reference(tb, tmp_path, steps, "--max-requeues", "2")
    wait_until("the job trains", lambda: training(run))
    batch_host = job_record(tb, job)["BatchHost"]
    tb.cut_link(batch_host, 10)
    rec = wait_ended(tb, job)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", rec
    assert rec.get("ExcNodeList", "(null)") in ("(null)", ""), rec
    requeued = named(events(run), "requeued")
    assert len(requeued) == 1 and requeued[0]["exclude"] == [], requeued
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(steps)


def test_a_flapping_link_loses_the_node_once_and_the_job_shrinks(tb: Testbed, tmp_path: Path) -> None:
    """A node's link is cut for 6 s, back for 2 s, four times, `--nodes 2:3` on 3 nodes: lost once (its
    agent fences and leaves the attempt), the job goes on with the other two, no restart storm."""
    out = tmp_path / "out"
    args = ["--out", str(out), "--steps", "500", "--step-time", "0.05"]
    flags = ("--nodes", "2:3", "--sbatch-arg=--nodes=3", "--nproc-per-node", "1")
    job, run = submit(tb, tmp_path, *flags, script=FENCE_TRAIN, args=args)
    wait_until("the job trains", lambda: (out / "step").exists())
    victim = tb.slurm("scontrol", "show", "hostnames", job_record(tb, job)["NodeList"]).split()[2]
    tb.flap(victim, 6, 2, 4)
    rec = wait_ended(tb, job)
    tb.heal(victim)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    evs = events(run)
    assert [e["node"] for e in named(evs, "node_lost")] == [victim], named(evs, "node_lost")
    assert len(named(evs, "restarting")) == 1


def test_a_node_lost_by_silence_is_bad_only_while_its_slurmd_does_not_answer(tb: Testbed) -> None:
    """The decider's second look (``evidence.still_bad``) at a node lost by silence, from the root namespace:
    cut off, it stays bad; healed, it is no longer held against (a node that crashed stays bad)."""
    env = tb.slurm_env()
    code = (
        "import sys; from hpcelastic.lifecycle.evidence import still_bad; "
        f"print(','.join(still_bad(['{node(3)}', '{node(4)}'], ['{node(4)}'])))"
    )

    def decide() -> str:
        argv = [sys.executable, "-c", code]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    tb.cut_link(node(4))
    try:
        assert decide() == f"{node(3)},{node(4)}"
    finally:
        tb.heal(node(4))
    assert decide() == node(3)


def test_an_asymmetric_partition_is_caught_by_hang_detection_which_names_the_node(
    tb: Testbed, tmp_path: Path
) -> None:
    """fabric4 still reaches the coordinator's node but no longer fabric2 and fabric3: every collective just
    waits. Hang detection declares the hang, the nodes' pings name fabric4, the round restarts (in the
    allocation) and, the partition healed, the job finishes with the same model. The script is unchanged
    (no heartbeats): the hang is seen in its stacks (py-spy), all in the same collective."""
    steps = 300
    ckpt = tmp_path / "ckpt"
    job, run = submit(
        tb,
        tmp_path,
        "--nodes",
        "4",
        "--nproc-per-node",
        "1",
        "--stall-timeout",
        "10",
        script=TRAIN,
        args=[
            *train_args(steps),
            "--step-time",
            "0.1",
            "--out",
            str(tmp_path / "out"),
            "--plain",
            "--ckpt-dir",
            str(ckpt),
        ],
    )
    victim = node(4)
    try:
        wait_until("the job trains", lambda: any(ckpt.glob("step-*.pt")))
        tb.partition(victim, node(2), node(3))
        wait_until("the hang is declared", lambda: named(events(run), "worker_failed"), 90)
    finally:
        tb.heal(victim)
    rec = wait_ended(tb, job)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    evs = events(run)
    failed = named(evs, "worker_failed")
    assert {f["node"] for f in failed} == {victim}, failed
    stacks = json.loads((run / "stacks" / "attempt-0" / "round-0.json").read_text())
    assert stacks["localization"]["method"] == "network", stacks["localization"]
    assert named(evs, "root_cause")[0]["node"] == victim
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(steps)


def test_a_node_slowed_by_its_link_is_named_network_and_replaced_by_the_spare(
    tb: Testbed, tmp_path: Path
) -> None:
    """Slow nodes, the network kind (issue 28): the unchanged DDP script of the slow-node tests
    (``tests/faults/slow_train.py``, two workers a node, its own ``torch.save`` checkpoints) on two nodes and
    a spare; once its pace is known, 50 ms each way on the second node's link (its CPUs untouched). The
    coordinator names that node ``network`` and, at a checkpoint, the spare takes its place: the job
    completes in its allocation (COMPLETED, Restarts 0) with the fault-free model, and no other node is
    ever named."""
    steps, ckpt = 400, tmp_path / "ckpt"
    flags = ["--nodes", "2", "--spare-nodes", "1", "--nproc-per-node", "2", "--slow-action", "swap"]
    flags += ["--checkpoint-dir", str(ckpt)]
    script, *args = slow_job.train_args(tmp_path, ckpt, steps)
    job, run = submit(tb, tmp_path, *flags, script=Path(script), args=args)
    first = ckpt / f"ckpt-{slow_job.SLOW_AFTER_STEP:06d}.pt"
    wait_until(f"{first.name} (the job's pace known)", first.exists, 180)
    slowed = named(events(run), "rendezvous")[0]["hosts"][1]
    tb.netem(slowed, "delay", "50ms")
    try:
        wait_until("the slow node named", lambda: named(events(run), "node_slow"), 150)
        wait_until("the spare in its place", lambda: len(named(events(run), "rendezvous")) > 1, 120)
    finally:
        tb.heal(slowed)
    rec = wait_ended(tb, job, 300)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    evs = events(run)
    slow = named(evs, "node_slow")
    assert {(e["node"], e["kind"]) for e in slow} == {(slowed, "network")}, slow
    # What the node costs is charged as it is (the job at a fifth or so of its pace), not averaged over an
    # hour's horizon (it read 1 % when the verdicts named it in one window of two).
    assert all(e["slowdown"] >= 0.3 for e in slow), slow
    swaps = [e for e in slow if e["action"] == "swap"]
    rounds = named(evs, "rendezvous")
    assert swaps and rounds[-1]["hosts"] == [rounds[0]["hosts"][0], swaps[0]["spare"]], (swaps, rounds)
    resumed = slow_job.resumed_steps(tmp_path)
    assert len(resumed) == 1 and resumed[0] >= slow_job.SLOW_AFTER_STEP, resumed
    assert (tmp_path / "final.sha256").read_text() == slow_job.reference_digest(steps, resumed=resumed)


def test_cuts_of_the_coordinators_link_shorter_than_detection_cost_no_restart(
    tb: Testbed, tmp_path: Path
) -> None:
    """Issue 31, item 3: the batch host's link (the coordinator's node) cut for 1, 3 and 4 s, below the
    detection bound (4.75 s), one after the other: no node is lost, no round restarts, Slurm never
    requeues the job, and it finishes with the fault-free model."""
    steps = 300
    job, run = submit_reference(tb, tmp_path, steps)
    wait_until("the job trains", lambda: training(run))
    batch_host = job_record(tb, job)["BatchHost"]
    for seconds in (1, 3, 4):
        tb.cut_link(batch_host, seconds)
        time.sleep(seconds + 6)  # the cut, then past the detection bound after it
    rec = wait_ended(tb, job)
    evs = events(run)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    assert not named(evs, "node_lost") and not named(evs, "restarting"), [e["event"] for e in evs]
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(steps)
