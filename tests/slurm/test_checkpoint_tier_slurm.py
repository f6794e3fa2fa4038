"""The node-local checkpoint tier through ``hpcelastic submit`` on a testbed instance of this module's own
(``ckpttier``: 4 nodes on 127.0.50.x, SlurmdTimeout 10 s), with unchanged scripts (issue 22).

``reference_train.py --plain --bare`` never imports hpcelastic (no handler for the stop signal): it
saves into ``{checkpoint_dir}`` (the node's ``/dev/shm`` directory under the tier) and resumes from the
newest checkpoint it finds there. Each emulated node's tier has a path of its own
(``/dev/shm/hpce22-JOB-NODE``). One DCP job takes a worker crash
(restored from each node's own memory), a node killed during a save (the torn save is never restored; the
lost node's files come from its peer's replica onto the spare), and a crash that spends the restart budget
(requeued: restored from the persisted tier); one ``torch.save`` job takes a crash during a direct save (the
torn file is cleared away, the previous checkpoint restored), a node death (the spare gets rank 0's file from
its peer) and a stop signal (the last checkpoint is persisted within the grace period, the requeued job
restores it). Every run ends with the fault-free model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcelastic.jobs.slurm import ENDED_STATES, parse_scontrol_record
from hpcelastic.rundir import RunDir
from tests.slurm_utils import TRAIN, events, named, reference_digest, submit_argv, wait_no_leaks
from tests.testbed import Testbed, own_instance

NAME = "ckpttier"
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name=NAME)]

SHM = Path("/dev/shm")
TEMPLATE = "/dev/shm/hpce22-{job}-{node}"
STEPS = 60


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with own_instance(NAME, {"index": "50", "nodes": "4", "slurmd_timeout": "10"}) as inst:
        yield inst


def submit(
    tb: Testbed,
    tmp_path: Path,
    tier: dict[str, Any],
    flags: list[str],
    script: list[str],
    template: str = TEMPLATE,
) -> tuple[str, Path]:
    """Submit the unchanged reference script (``script``: its extra flags) with the tier's settings in a user
    config file."""
    config = tmp_path / "config" / "hpcelastic" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"checkpoint_tier": {"local_checkpoint_dir": template, **tier}}))
    run = tmp_path / "run"
    argv = submit_argv(run)
    argv += ["--time", "10", "--nproc-per-node", "2", *flags, str(TRAIN), "--plain", "--ckpt-dir"]
    argv += ["{checkpoint_dir}", "--out", str(tmp_path / "out"), "--steps", str(STEPS), "--ckpt-every", "5"]
    argv += ["--step-time", "0.1", *script]
    env = {**tb.slurm_env(), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["job_id"]), run


def job_record(tb: Testbed, job: str) -> dict[str, str]:
    out = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
    return parse_scontrol_record(out.splitlines()[0]) if out.strip() else {}


def wait_for(what: str, check: Callable[[], Any], tb: Testbed, job: str, timeout: float = 120) -> Any:
    """Poll ``check`` until it returns something true; fail (with the job's record) if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        rec = job_record(tb, job)
        assert rec.get("JobState") not in ENDED_STATES, f"job ended before {what}: {rec}"
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s: {job_record(tb, job)}")


def wait_ended(tb: Testbed, job: str, timeout: float = 240) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while (rec := job_record(tb, job)).get("JobState") not in ENDED_STATES:
        assert time.monotonic() < deadline, f"job {job} still not done: {rec}"
        time.sleep(0.5)
    return rec


def complete(run: Path, attempt: int, round: int, step: int) -> dict[str, Any] | None:
    """The ``tier_checkpoint`` of a checkpoint of at least ``step`` in ``attempt``'s ``round``."""
    for e in named(events(run), "tier_checkpoint"):
        if e["attempt"] == attempt and e["round"] == round and (e["step"] or 0) >= step:
            return e
    return None


def replicated(run: Path, attempt: int, step: int) -> dict[str, Any] | None:
    """The ``tier_replicated`` of a checkpoint of at least ``step`` in ``attempt``."""
    for e in named(events(run), "tier_replicated"):
        if e["attempt"] == attempt and (e["step"] or 0) >= step:
            return e
    return None


def kill_worker(run: Path, attempt: int, rank: int) -> None:
    """SIGKILL the worker of ``rank`` (a crash, as a segfault or the OOM killer makes one): the process its
    rank log's last header names (a warm worker's ``/proc/PID/environ`` is its fork server's)."""
    log = RunDir(run).rank_log_path(attempt, rank)
    text = log.read_text()
    found = re.findall(r"^=== round \d+ restart \d+ pid (\d+) ===$", text, re.M)
    assert found, f"no worker header in {log}: {text[:300]!r}"
    pid = int(found[-1])
    os.kill(pid, signal.SIGKILL)


def restores(run: Path, attempt: int, round: int) -> dict[str, dict[str, Any]]:
    """Each node's ``tier_restored`` event before ``attempt``'s ``round``."""
    return {
        e["node"]: e
        for e in named(events(run), "tier_restored")
        if (e["attempt"], e["round"]) == (attempt, round)
    }


def clean_shm(job: str) -> None:
    for d in SHM.glob(f"hpce22-{job}-*"):
        shutil.rmtree(d, ignore_errors=True)


def test_dcp_job_restores_from_memory_then_a_peer_replica_then_the_persisted_tier(
    tb: Testbed, tmp_path: Path
) -> None:
    job, run = submit(
        tb, tmp_path, {"replicas": 1, "persist_every": 1},
        ["--nodes", "2", "--spare-nodes", "1", "--max-restarts", "2"],
        ["--bare", "--format", "dcp", "--fault", "slow-save", "--fault-step", "30", "--fault-rank", "0,1,2,3",
         "--fault-restart", "1", "--save-delay", "4"],
    )  # fmt: skip
    killed: list[str] = []
    try:
        # 1. A worker crash: each node restores the newest complete checkpoint from its own memory (from its
        # peer's only when the crash came before that checkpoint's replicas arrived: seen under a loaded CI).
        wait_for("a complete checkpoint", lambda: complete(run, 0, 0, 10), tb, job)
        kill_worker(run, 0, 1)
        r1 = wait_for(
            "round 1's restores", lambda: len(restores(run, 0, 1)) == 2 and restores(run, 0, 1), tb, job
        )
        crash = min(e["ts"] for e in named(events(run), "worker_failed") if e["round"] == 0)
        ckpt = next(iter(r1.values()))["checkpoint"]
        held = any(
            e["checkpoint"] == ckpt and e["ts"] <= crash for e in named(events(run), "tier_replicated")
        )
        assert {e["tier"] for e in r1.values()} <= ({"local"} if held else {"local", "peer"}), (r1, crash)
        assert len({e["checkpoint"] for e in r1.values()}) == 1 and all(e["step"] >= 10 for e in r1.values())
        # 2. A node killed during a save: step 30's save stalls 4 s on every rank (--fault slow-save).
        done = wait_for("step 25 complete in round 1", lambda: complete(run, 0, 1, 25), tb, job)
        rec = job_record(tb, job)
        nodes = tb.slurm("scontrol", "show", "hostnames", rec["NodeList"]).split()
        victim = nodes[1]  # node rank 1: position 1 of the round (the batch host is position 0)
        wait_for("its replicas", lambda: replicated(run, 0, done["step"]), tb, job)
        saving = SHM / f"hpce22-{job}-{victim}" / "hpcelastic-tier" / "live" / "step-000030"
        wait_for("the save of step 30 under way", saving.is_dir, tb, job)
        tb.kill_node(victim)
        killed.append(victim)
        r2 = wait_for(
            "round 2's restores", lambda: len(restores(run, 0, 2)) == 2 and restores(run, 0, 2), tb, job
        )
        spare = nodes[2]
        assert set(r2) == {nodes[0], spare}, r2
        assert r2[spare]["tier"] == "peer" and r2[spare]["peers"] == ["0"], r2
        assert r2[nodes[0]]["tier"] == "local", r2
        assert {e["checkpoint"] for e in r2.values()} == {done["checkpoint"]}, r2  # never the torn step 30
        # 3. A crash that spends the restart budget: requeued, restored from the persisted tier.
        persisted = wait_for(
            "a checkpoint persisted in round 2",
            lambda: [e for e in named(events(run), "tier_persisted") if (e["step"] or 0) >= 35],
            tb, job,
        )  # fmt: skip
        kill_worker(run, 0, 1)
        rec = wait_ended(tb, job)
    finally:
        for node in killed:
            tb.revive_node(node)
        clean_shm(job)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", rec
    assert killed[0] not in tb.slurm("scontrol", "show", "hostnames", rec["NodeList"]).split(), rec
    evs = events(run)
    r3 = {e["node"]: e for e in named(evs, "tier_restored") if e["attempt"] == 1 and e["round"] == 0}
    assert {e["tier"] for e in r3.values()} == {"persisted"} and len(r3) == 2, r3
    newest = max(e["step"] for e in named(evs, "tier_persisted") if e["attempt"] == 0)
    assert {e["step"] for e in r3.values()} == {newest} and newest >= persisted[0]["step"], r3
    round2 = next(e["ts"] for e in named(evs, "rendezvous") if e["round"] == 2)
    torn = [e for e in evs if e["event"].startswith("tier_") and e.get("checkpoint") == "step-000030"]
    assert not [e for e in torn if e["ts"] < round2], torn  # the save the node death tore: never used
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(STEPS)
    assert not wait_no_leaks(str(run))
    assert not list(SHM.glob(f"hpce22-{job}-*"))


def test_torch_save_job_clears_a_torn_save_restores_a_spare_and_persists_at_a_stop_signal(
    tb: Testbed, tmp_path: Path
) -> None:
    job, run = submit(
        tb, tmp_path, {"persist_every": 1000},  # nothing persisted in the background: only at the stop
        ["--nodes", "2", "--spare-nodes", "1", "--max-restarts", "2"],
        ["--bare", "--direct-save", "--fault", "ckpt-crash", "--fault-step", "15", "--fault-rank", "0"],
    )  # fmt: skip
    killed: list[str] = []
    try:
        # 1. Rank 0 dies halfway through torch.save(step-15.pt): the torn file is cleared, and the newest
        # checkpoint complete when it died (step 10, or 5 when the machine is slow) is restored.
        r1 = wait_for(
            "round 1's restores", lambda: len(restores(run, 0, 1)) == 2 and restores(run, 0, 1), tb, job
        )
        (crash,) = named(events(run), "worker_failed")
        before = [e["step"] for e in named(events(run), "tier_checkpoint") if e["ts"] < crash["ts"]]
        nodes = tb.slurm("scontrol", "show", "hostnames", job_record(tb, job)["NodeList"]).split()
        # One checkpoint on both nodes, at least the newest seen complete before the crash (the agent may
        # see a file complete only at the restore's scan, on a loaded machine); rank 0's node restores from
        # its own memory, the other from its replica or, when replication had not finished, from rank 0's.
        (restored,) = {(e["checkpoint"], e["step"]) for e in r1.values()}
        assert restored[0] in ("step-000005.pt", "step-000010.pt"), r1
        assert restored[1] >= max(before, default=0), (r1, before)
        assert r1[nodes[0]]["tier"] == "local" and r1[nodes[1]]["tier"] in ("local", "peer"), r1
        # 2. The other node dies whole: the spare gets rank 0's file (the whole checkpoint) from its peer.
        done = wait_for("step 20 replicated", lambda: replicated(run, 0, 20), tb, job)
        tb.kill_node(nodes[1])
        killed.append(nodes[1])
        r2 = wait_for(
            "round 2's restores", lambda: len(restores(run, 0, 2)) == 2 and restores(run, 0, 2), tb, job
        )
        assert r2[nodes[2]]["tier"] == "peer" and r2[nodes[2]]["peers"] == ["0"], r2
        assert r2[nodes[0]]["tier"] == "local", r2
        assert len({e["checkpoint"] for e in r2.values()}) == 1, r2
        assert all(e["step"] >= done["step"] for e in r2.values()), (r2, done)
        # 3. A stop signal (plain scancel --signal): the last checkpoint is persisted within the grace.
        wait_for("step 40 complete", lambda: complete(run, 0, 2, 40), tb, job)
        tb.slurm("scancel", "--signal=USR2", job)
        rec = wait_ended(tb, job)
    finally:
        for node in killed:
            tb.revive_node(node)
        clean_shm(job)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", rec
    evs = events(run)
    first = [e for e in evs if e.get("attempt") == 0]
    (signalled, *_) = named(evs, "signal_received")
    last = max((e for e in named(first, "tier_checkpoint")), key=lambda e: e["step"])
    # one persist at the stop, or one more for each checkpoint the script still completed in the grace
    # (CI: step 45 persisted at the signal, then 50, the script's last save, 2 ms later), the last the newest
    stops = named(first, "tier_persisted")
    assert stops and all(e["stop"] for e in stops), stops
    assert [e["step"] for e in stops] == sorted({e["step"] for e in stops}), stops
    persisted = stops[-1]
    assert persisted["checkpoint"] == last["checkpoint"], (persisted, last)
    assert 40 <= persisted["step"] < STEPS, persisted  # the workers were stopped, not finished
    assert persisted["ts"] - signalled["ts"] < 20, (persisted, signalled)  # testbed grace_period: 20 s
    assert [(e["attempt"], e["reason"]) for e in named(evs, "attempt_ended")][0] == (0, "preempted")
    r3 = {e["node"]: e for e in named(evs, "tier_restored") if e["attempt"] == 1 and e["round"] == 0}
    assert {(e["tier"], e["checkpoint"]) for e in r3.values()} == {("persisted", last["checkpoint"])}, r3
    torn = [
        e for e in named(first, "tier_checkpoint") if e["round"] == 0 and e["checkpoint"] == "step-000015.pt"
    ]
    assert not torn
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(STEPS)
    assert not wait_no_leaks(str(run))
    assert not list(SHM.glob(f"hpce22-{job}-*"))


def test_a_local_directory_on_the_shared_filesystem_is_refused_at_start_in_one_line(
    tb: Testbed, tmp_path: Path
) -> None:
    """The tier's directory on the run directory's filesystem: every node refuses it before the rendezvous
    with one line naming the setting (the coordinator's node also publishes it for agents that wait), exit 2;
    the attempt is a start-up failure (not requeued), and no tier directory is left on any node."""
    template = str(tmp_path / "local-{job}-{node}")
    job, run = submit(tb, tmp_path, {}, ["--nodes", "2"], ["--bare"], template=template)
    rec = wait_ended(tb, job, 120)
    assert rec["JobState"] == "FAILED" and rec["Restarts"] == "0", rec
    (end,) = named(events(run), "attempt_ended")
    assert end["reason"] == "startup_failure", end
    log = "\n".join(p.read_text() for p in run.glob("slurm-*.out"))
    for node in ("ckpttier1", "ckpttier2"):  # each node checks its own directory before the rendezvous
        line = "checkpoint_tier.local_checkpoint_dir: " + template.format(job=job, node=node)
        assert f"hpcelastic: error: {line} is on the same filesystem as the run directory {run};" in log, log
    assert "Traceback" not in log, log[-3000:]
    assert not list(tmp_path.glob("local-*"))
