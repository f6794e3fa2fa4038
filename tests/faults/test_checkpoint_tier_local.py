"""The node-local checkpoint tier under ``hpcelastic run`` (every node on this machine: replication is real
but local), with the unchanged DCP script: a node lost from ``--nodes 2:3`` leaves two nodes that each
restore the union of the three nodes' files (the lost node's from its peer's replica) and reshard on load;
the run ends with the fault-free model. And a tier that cannot take a copy says so in one line naming the
setting."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from hpcelastic import events as ev
from hpcelastic.agent.launcher import LocalRun, start_agents
from hpcelastic.rundir import RunDir
from hpcelastic.tier.node import LocalTier
from hpcelastic.tier.settings import MB, TierSettings, check_node
from tests.slurm_utils import TRAIN, reference_digest

pytestmark = [pytest.mark.slow]
STEPS = 40


def tier_run(
    tmp_path: Path, template: str, min_nodes: int, max_nodes: int, program: tuple[str, ...]
) -> LocalRun:
    """``hpcelastic run`` of ``program`` on MIN:MAX local nodes x 1 worker, 2 restarts, the tier at
    ``template``."""
    return LocalRun(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc="1",
        max_restarts=2,
        run_dir=tmp_path / "run",
        local_tier=TierSettings(template).to_text(),
        agent_args=("--rdzv-timeout", "30", "--grace-period", "10"),
        program=program,
    )


def test_a_lost_node_s_files_reach_the_survivors_from_its_peer_and_the_job_shrinks(tmp_path: Path) -> None:
    template = f"/dev/shm/hpce22-local-{tmp_path.name}-{{node}}"
    spec = tier_run(
        tmp_path, template, 2, 3,
        (
            str(TRAIN), "--plain", "--format", "dcp", "--ckpt-dir", "{checkpoint_dir}", "--steps", str(STEPS),
            "--step-time", "0.1", "--out", str(tmp_path / "out"),
            "--fault", "kill-agent", "--fault-rank", "2", "--fault-step", "22",
        ),
    )  # fmt: skip
    run_dir, agents = start_agents(spec)
    codes = [a.wait(timeout=240) for a in agents]
    log = list(RunDir(run_dir.path).events())
    assert codes[:2] == [0, 0], (codes, log[-5:])
    lost = [e for e in log if e["event"] == ev.NODE_LOST]
    assert [e["node"] for e in lost] == ["local2"]
    last = max(e["round"] for e in log if e["event"] == ev.RENDEZVOUS)
    (shrunk,) = [e for e in log if e["event"] == ev.RENDEZVOUS and e["round"] == last]
    assert shrunk["world_size"] == 2
    restored = {e["node"]: e for e in log if e["event"] == ev.TIER_RESTORED and e["round"] == last}
    assert set(restored) == {"local0", "local1"} and len({e["checkpoint"] for e in restored.values()}) == 1
    assert "peer" in {e["tier"] for e in restored.values()}, restored
    # The newest checkpoint whose every part had its replica before the node was lost, or a newer one whose
    # replication the coordinator learnt of later (on a loaded machine replication may lag a save or two).
    safe = [e["step"] for e in log if e["event"] == ev.TIER_REPLICATED and e["ts"] < lost[0]["ts"]]
    assert all(e["step"] >= max(safe, default=5) for e in restored.values()), (safe, restored)
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(STEPS)
    # The killed agent's watchdog removed its node's tier too: nothing stays in the node's memory.
    assert not list(Path("/dev/shm").glob(f"hpce22-local-{tmp_path.name}-*"))


def test_a_copy_that_does_not_fit_the_budget_is_refused_with_one_line_naming_the_setting(
    tmp_path: Path,
) -> None:
    run = RunDir.create(tmp_path / "run")
    settings = TierSettings(f"/dev/shm/hpce22-budget-{tmp_path.name}", local_checkpoint_mb=1)
    node = check_node(settings, settings.local_dir("n0", "j"), run.path)
    tier = LocalTier(
        settings, node, run_dir=run, checkpoint_dir=tmp_path / "ckpt", secret="s", host="n0", node_rank=0,
        attempt=0, say=lambda text: None,
    )  # fmt: skip
    try:
        (tier.live / "step-5.pt").write_bytes(b"x" * (MB // 2))
        assert tier.room_for(MB // 4, "a replica of step-5") is None
        why = tier.room_for(MB, "a replica of step-10")
        assert why is not None and "\n" not in why
        assert why.startswith(
            "a replica of step-10 (1 MB) does not fit checkpoint_tier.local_checkpoint_mb=1 on n0"
        )
        (refused,) = [e for e in run.events() if e["event"] == ev.TIER_REFUSED]
        assert refused["size"] == MB and refused["budget"] == MB and refused["why"] == why
    finally:
        tier.close()
    assert not node.root.exists()


def test_submit_refuses_a_bad_tier_setting_in_one_line_and_creates_nothing(tmp_path: Path) -> None:
    import subprocess

    argv = [
        sys.executable,
        "-m",
        "hpcelastic",
        "submit",
        "--site",
        "testbed",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    argv += ["--local-checkpoint-dir", "ckpt-{node}", str(TRAIN)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "checkpoint_tier.local_checkpoint_dir: 'ckpt-{node}' is not an absolute path" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_script_that_publishes_resumes_from_memory_and_its_persisted_copy_is_published(
    tmp_path: Path,
) -> None:
    """``worker.publish_checkpoint`` under the tier marks the checkpoint complete; a restart resumes from the
    node's memory (``resume_path()``), and the handoff record names the persisted copy."""
    from hpcelastic import handoff

    template = f"/dev/shm/hpce22-pub-{tmp_path.name}-{{node}}"
    steps = 20
    spec = tier_run(
        tmp_path, template, 2, 2,
        (
            str(TRAIN), "--steps", str(steps), "--step-time", "0.1", "--out", str(tmp_path / "out"),
            "--fault", "sigkill", "--fault-rank", "1", "--fault-step", "16",
        ),
    )  # fmt: skip
    run_dir, agents = start_agents(spec)
    codes = [a.wait(timeout=240) for a in agents]
    log = list(RunDir(run_dir.path).events())
    assert codes == [0, 0], (codes, log[-5:])
    restores = {e["node"]: e for e in log if e["event"] == ev.TIER_RESTORED and e["round"] == 1}
    # Rank 0 saves: its node restores from its own memory; the other node from its replica, or from that
    # peer's memory when the kill came before the replica of the newest checkpoint arrived (a loaded CI run).
    restored = restores["local0"]
    complete = [
        e
        for e in log
        if e["event"] == ev.TIER_CHECKPOINT and e["ts"] < max(r["ts"] for r in restores.values())
    ]
    # the newest complete when round 1 began: the next round waits for a save the workers completed just
    # before one of them died to be answered for by every node
    newest = max(complete, key=lambda e: e["step"])
    assert restored["tier"] == "local" and restored["checkpoint"] == newest["checkpoint"], (restored, newest)
    crash = min(e["ts"] for e in log if e["event"] == ev.WORKER_FAILED and e["round"] == 0)
    held = any(
        e["event"] == ev.TIER_REPLICATED and e["checkpoint"] == newest["checkpoint"] and e["ts"] <= crash
        for e in log
    )
    assert restores["local1"]["tier"] in (("local",) if held else ("local", "peer")), (restores, crash)
    assert restores["local1"]["checkpoint"] == newest["checkpoint"], restores
    rank0 = RunDir(run_dir.path).rank_log_path(0, 0).read_text()
    live = f"/dev/shm/hpce22-pub-{tmp_path.name}-local0/hpcelastic-tier/live"
    assert f"resuming from {live}/{newest['checkpoint']}" in rank0
    published = handoff.load(run_dir.path).checkpoint
    assert published is not None and published["path"] == str(run_dir.path / "checkpoints" / "step-000020.pt")
    assert Path(published["path"]).is_file() and published["step"] == steps
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(steps)


def test_older_copies_go_only_once_a_newer_checkpoint_has_its_replicas(tmp_path: Path) -> None:
    """A node holding only peers' replicas (it wrote nothing: rank 0 saves) keeps the older one until the
    newer is safe, then drops it; a newer one not yet safe never makes it drop anything."""
    import time

    from hpcelastic.agent import messages
    from hpcelastic.tier import channel

    run = RunDir.create(tmp_path / "run")
    settings = TierSettings(f"/dev/shm/hpce22-keep-{tmp_path.name}")
    node = check_node(settings, settings.local_dir("n1", "j"), run.path)
    tier = LocalTier(
        settings, node, run_dir=run, checkpoint_dir=tmp_path / "ckpt", secret="s", host="n1", node_rank=1,
        attempt=0, say=lambda text: None,
    )  # fmt: skip
    sent: list[messages.Message] = []
    tier.send = lambda m: sent.append(m) or True
    try:
        for step in (5, 10):
            f = tmp_path / f"step-{step}.pt"
            f.write_bytes(b"x" * 1000)
            files = [channel.FileRef(f.name, f, 1000)]
            channel.put("127.0.0.1", tier.port, "s", f.name, "0", files, channel.Throttle(1 << 30))
        replicas = tier.replicas / "0"
        assert sorted(p.name for p in replicas.iterdir()) == ["step-10.pt", "step-5.pt"]
        assert [(m.name, m.kind) for m in sent] == [("step-5.pt", "replica"), ("step-10.pt", "replica")]
        tier.on_message(messages.TierSafe("step-5.pt"))
        tier.on_message(messages.TierSafe("step-10.pt"))
        deadline = time.monotonic() + 10
        while (replicas / "step-5.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(p.name for p in replicas.iterdir()) == ["step-10.pt"]
    finally:
        tier.close()


def test_with_replica_groups_a_restarted_group_heals_from_its_peer_and_restores_nothing(
    tmp_path: Path,
) -> None:
    """torchft replica groups with the tier: group 1's crash restarts group 1 alone, which heals from group 0
    (torchft) and restores nothing from the tier; the checkpoints the groups publish are complete, and the
    last one is persisted and published at the end."""
    import subprocess

    from hpcelastic import handoff
    from tests.replica_checks import check_group_restart, train_args

    pytest.importorskip("torchft")
    steps = 60
    out = tmp_path / "out"
    out.mkdir()
    run = tmp_path / "run"
    tier = f"/dev/shm/hpce22-rg-{tmp_path.name}-{{node}}"  # the option submit has too (issue 30)
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "2", "--nproc-per-node", "2"]
    cmd += ["--replica-groups", "2", "--run-dir", str(run), "--rdzv-timeout", "60"]
    cmd += ["--local-checkpoint-dir", tier]
    cmd += train_args(out, steps=steps, crash_at=10)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = RunDir(run).events()
    check_group_restart(out, log, steps=steps)
    restarted = [e for e in log if e["event"] == ev.REPLICA_GROUP_RESTARTING]
    assert [e["group"] for e in restarted] == [1]
    restored = [e for e in log if e["event"] == ev.TIER_RESTORED and e["checkpoint"]]
    assert restored == [], restored  # torchft healed group 1 from group 0's live state
    assert [e for e in log if e["event"] == ev.TIER_CHECKPOINT]
    published = handoff.load(run).checkpoint
    assert published is not None and Path(published["path"]).parent == run / "checkpoints"
    assert published["step"] == steps
    assert not list(Path("/dev/shm").glob(f"hpce22-rg-{tmp_path.name}-*"))


def test_a_full_shared_file_system_is_said_in_the_record_and_training_goes_on(tmp_path: Path) -> None:
    """The run's checkpoint directory on a file system with no room left (a tmpfs filled up): every persist
    fails with ENOSPC. Training is not held up and ends with the fault-free model; each failure is one
    ``tier_persist_missed`` naming the node and the error, the stop's persist is tried once more and said,
    ``status`` and its ledger say it, and no partial copy is left on the shared file system."""
    import subprocess

    shared = tmp_path / "shared"
    shared.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(shared)], check=True)
    try:
        fd = os.open(shared / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # until the file system is full: then every write fails (ENOSPC)
            while os.write(fd, b"\0" * 4096) > 0:
                pass
        os.close(fd)
        steps = 20
        spec = tier_run(
            tmp_path, f"/dev/shm/hpce22-full-{tmp_path.name}-{{node}}", 2, 2,
            (str(TRAIN), "--steps", str(steps), "--step-time", "0.1", "--out", str(tmp_path / "out")),
        )  # fmt: skip
        spec = dataclasses.replace(
            spec, agent_args=(*spec.agent_args, "--checkpoint-dir", str(shared / "ckpt"))
        )
        run_dir, agents = start_agents(spec)
        codes = [a.wait(timeout=240) for a in agents]
        log = list(RunDir(run_dir.path).events())
        assert codes == [0, 0], (codes, log[-5:])
        assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(steps)
        missed = [e for e in log if e["event"] == ev.TIER_PERSIST_MISSED]
        assert missed and all("No space left on device" in e["why"] for e in missed), missed
        assert {e["why"].split(":")[0] for e in missed} <= {"local0", "local1"}
        # One per checkpoint, and the last one's retry at the end of the workers once more.
        names = [e["checkpoint"] for e in missed]
        last = f"step-{steps:06d}.pt"
        assert last in names and all(names.count(n) == 1 for n in names if n != last), names
        assert names.count(last) <= 2, names
        assert not [e for e in log if e["event"] == ev.TIER_PERSISTED]
        assert [p.name for p in shared.rglob("*") if p.is_file()] == ["filler"]
        status = subprocess.run(
            [sys.executable, "-m", "hpcelastic", "status", str(run_dir.path)], capture_output=True, text=True
        )
        assert status.returncode == 0, status.stderr
        assert "checkpoint NOT persisted" in status.stdout
        assert "the local checkpoint tier did not persist" in status.stdout
    finally:
        subprocess.run(["umount", "-l", str(shared)], check=False)


def test_a_node_whose_workers_end_after_the_grace_period_still_gets_the_last_checkpoint_persisted(
    tmp_path: Path,
) -> None:
    """Rank 1's process outlives rank 0's by 8 s after training (a slow teardown), longer than the 3 s grace
    period. Node 0 waits at the exit barrier anyway, so its wait for the last persist starts when every node's
    workers are gone (``TierFlushing``), not when its own ended: the last checkpoint is persisted and nothing
    says it was missed (CI saw the coordinator's node record a false ``tier_persist_missed`` under load)."""
    steps = 20
    spec = tier_run(
        tmp_path, f"/dev/shm/hpce22-late-{tmp_path.name}-{{node}}", 2, 2,
        (
            str(TRAIN), "--steps", str(steps), "--step-time", "0.1", "--out", str(tmp_path / "out"),
            "--fault", "late-exit", "--fault-rank", "1", "--save-delay", "8",
        ),
    )  # fmt: skip
    args = ("--rdzv-timeout", "30", "--grace-period", "3", "--checkpoint-dir", str(tmp_path / "ckpt"))
    tier = TierSettings(f"/dev/shm/hpce22-late-{tmp_path.name}-{{node}}", persist_every=100)  # at the end
    run_dir, agents = start_agents(dataclasses.replace(spec, agent_args=args, local_tier=tier.to_text()))
    codes = [a.wait(timeout=240) for a in agents]
    log = list(RunDir(run_dir.path).events())
    assert codes == [0, 0], (codes, log[-5:])
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(steps)
    assert not [e for e in log if e["event"] == ev.TIER_PERSIST_MISSED]
    last = [e for e in log if e["event"] == ev.TIER_PERSISTED and e["stop"]]
    assert [e["checkpoint"] for e in last] == [f"step-{steps:06d}.pt"], last
    assert not list(Path("/dev/shm").glob(f"hpce22-late-{tmp_path.name}-*"))


def test_a_stalled_shared_file_system_costs_the_stop_its_grace_and_no_more(tmp_path: Path) -> None:
    """The persist of the last checkpoint stalls (its file in staging is a FIFO nobody reads: open blocks, as
    on a hung NFS mount), in the background and again at the end of the workers. The earlier checkpoints are
    persisted; the agents stop waiting at the end of the grace period, exit 0 with the fault-free model, and
    the record says the last checkpoint was not persisted in time."""
    import subprocess

    steps = 20
    shared = tmp_path / "shared"
    last = f"step-{steps:06d}.pt"
    stall = shared / ".hpcelastic-staging" / last / last
    stall.parent.mkdir(parents=True)
    os.mkfifo(stall)
    spec = tier_run(
        tmp_path, f"/dev/shm/hpce22-stall-{tmp_path.name}-{{node}}", 2, 2,
        (str(TRAIN), "--steps", str(steps), "--step-time", "0.1", "--out", str(tmp_path / "out")),
    )  # fmt: skip
    spec = dataclasses.replace(spec, agent_args=(*spec.agent_args, "--checkpoint-dir", str(shared)))
    run_dir, agents = start_agents(spec)
    codes = [a.wait(timeout=240) for a in agents]
    log = list(RunDir(run_dir.path).events())
    assert codes == [0, 0], (codes, log[-5:])
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(steps)
    persisted = {e["checkpoint"] for e in log if e["event"] == ev.TIER_PERSISTED}
    assert persisted and last not in persisted, persisted
    (missed,) = [e for e in log if e["event"] == ev.TIER_PERSIST_MISSED]
    assert missed["checkpoint"] == last and "grace period ended" in missed["why"], missed
    status = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "status", str(run_dir.path)], capture_output=True, text=True
    )
    assert status.returncode == 0 and "checkpoint NOT persisted" in status.stdout, status.stdout
