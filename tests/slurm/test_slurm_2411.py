"""The 24.11 subset: what hpcelastic leans on in Slurm, on Slurm 24.11.5 (Debian trixie's, in a root of its
own: ``scripts/testbed.sh`` ``TESTBED_SLURM=24.11``), a few jobs that each take several faults in turn.

* crash, hang, node death and stop step (one job, ``--nodes 2 --spare-nodes 1 --stall-timeout 10``): a
  worker SIGKILLed (restarted), a worker frozen (hang found, restarted), a round node killed whole (the
  spare takes its place), then the stop signal (every rank stops at one step, requeued by hpcelastic,
  resumed on the nodes left); beside it, an array task in resubmit mode fails its restarts (resubmitted as a
  new array job) and is then stopped with a plain ``scancel`` (cancelled, nothing brought back);
* preemption and the time limit (two jobs at once): preempted with a grace time and
  ``PreemptParameters=send_user_signal`` (the ``--signal``, one stop step, requeued within the grace), then
  without (Slurm's TERM, Slurm requeues); a ``--time 2`` job stopped by its limit's signal and requeued.

Each job ends with the fault-free model. Slurm's view (``scontrol show job``: JobState, Restarts, NodeList)
is asserted with the events. Every command here and in hpcelastic is 24.11's (the instance's wrappers first
on PATH).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import hostlist
import psutil
import pytest

from tests.slurm_utils import (
    CKPT_EVERY,
    REPO,
    TRAIN,
    events,
    job_record,
    named,
    reference_digest,
    run_dir_logs,
    status_json,
    train_args,
    wait_for_event,
    wait_job_finished,
    wait_job_state,
    wait_no_leaks,
)
from tests.testbed import Testbed, own_instance

NAME = "next"
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name=NAME)]
#: SlurmdTimeout above the testbed's MessageTimeout (20 s): on 24.11 a ping round that includes the dead
#: node records the live nodes' answers late, and with SlurmdTimeout=10 every node of the job was once set
#: DOWN for a moment under a loaded run, and Slurm requeued the job itself for it (slurmctld.log: "Nodes
#: next[1-5] not responding, setting DOWN", then "returned to service" 3 ms later).
SETTINGS = {
    "index": "30",
    "nodes": "5",
    "gpus_per_node": "2",
    "slurmd_timeout": "30",
    "preempt": "1",
    "preempt_grace": "30",
    "slurm": "24.11",
}


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with own_instance(NAME, SETTINGS) as inst:
        out = inst.slurm("sbatch", "--version")
        assert out.split()[-1].startswith("24.11"), out
        yield inst


@pytest.fixture
def env(tb: Testbed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """This test and hpcelastic use the instance's 24.11 commands; its nodes are all up at the start."""
    env = tb.env()
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for i in range(1, int(SETTINGS["nodes"]) + 1):
        node = f"{NAME}{i}"
        if tb.node_state(node).startswith(("down", "idle*")):
            tb.revive_node(node)
        tb.wait_node_state(node, ("idle",), 90)
    yield env
    tb.slurm("scancel", "-u", str(os.getuid()), check=False)


def submit(
    tmp_path: Path, name: str, *flags: str, site: str = "testbed", train: tuple[str, ...] = ()
) -> tuple[str, Path]:
    """``hpcelastic submit`` of the reference training; (job id, run dir)."""
    run = tmp_path / name
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", site, "--run-dir", str(run)]
    argv += [*flags, str(TRAIN), *train, "--out", str(tmp_path / f"{name}-out")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["job_id"]), run


def digest(tmp_path: Path, name: str) -> str:
    return json.loads((tmp_path / f"{name}-out" / "final.json").read_text())["sha256"]


def node_workers(run: Path, node: str) -> list[psutil.Process]:
    """The training workers of ``run`` on ``node``: children of its fork server (warm starts)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            env = p.environ()
            if env.get("HPCELASTIC_RUN_DIR") != str(run) or env.get("SLURMD_NODENAME") != node:
                continue
            parent = p.parent()
            if parent and any(w.endswith("forkserver.py") for w in parent.cmdline()):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def progress_in(run: Path, round_: int, attempt: int = 0, timeout: float = 120) -> None:
    """Wait until a rank of ``round_`` (of ``attempt``) reported a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["round"] == round_ and e["attempt"] == attempt for e in named(events(run), "progress")):
            return
        time.sleep(0.3)
    seen = [e["event"] for e in events(run)]
    raise AssertionError(f"no progress in round {round_} of attempt {attempt}: {seen}\n{run_dir_logs(run)}")


def test_crash_hang_node_death_stop_and_an_array_resubmitted_then_cancelled(
    tmp_path: Path, tb: Testbed, env: dict[str, str]
) -> None:
    steps = 160
    job, run = submit(
        tmp_path, "faults",
        "--nodes", "2", "--spare-nodes", "1", "--gpus-per-node", "1", "--stall-timeout", "10",
        "--max-restarts", "5", "--time", "10",
        train=(*train_args(steps), "--step-time", "0.25"),
    )  # fmt: skip
    resubmit_site = tmp_path / "resubmit.yaml"
    resubmit_site.write_text(
        (REPO / "site_configs" / "testbed.yaml").read_text().replace("mode: requeue", "mode: resubmit")
    )
    array, array_run = submit(
        tmp_path, "array", "--sbatch-arg=--array=3", "--max-restarts", "0", "--time", "10",
        site=str(resubmit_site),
        train=(*train_args(600), "--step-time", "0.2", "--fault", "exit", "--fault-step", "3",
               "--fault-rank", "0"),
    )  # fmt: skip
    rec = wait_job_state(job, {"RUNNING"}, 60)
    batch_host, round_nodes = rec["BatchHost"], None
    # 1. a worker SIGKILLed: every worker restarts in the allocation
    progress_in(run, 0)
    rounds = named(events(run), "rendezvous")
    round_nodes = rounds[0]["hosts"]
    assert batch_host == round_nodes[0]
    node_workers(run, round_nodes[1])[0].kill()
    wait_for_event(run, "restarting", 60, round=1)
    # Meanwhile the array task: restarts spent, resubmitted as a new array job, then a plain scancel.
    resub = wait_for_event(array_run, "resubmitted", 120)
    second = str(resub["job_id"])
    assert second.endswith("_3") or job_record(second).get("ArrayTaskId") == "3", job_record(second)
    old = wait_job_finished(array, 60)
    assert old["Restarts"] == "0", old
    wait_job_state(second, {"RUNNING"}, 120)
    progress_in(array_run, 0, attempt=1)
    tb.slurm("scancel", second)
    new = wait_job_finished(second, 120)
    assert new["JobState"] == "CANCELLED" and new["Restarts"] == "0", new
    time.sleep(2)
    story = status_json(str(array_run))
    assert story["outcome"] == "cancelled", story["outcome"]
    assert len(named(events(array_run), "resubmitted")) == 1 and not named(events(array_run), "requeued")
    assert not wait_no_leaks(str(array_run))
    # 2. a worker frozen: no heartbeat from its node for --stall-timeout, the hang is found, restarted
    progress_in(run, 1)
    frozen = node_workers(run, round_nodes[1])[0]
    frozen.send_signal(signal.SIGSTOP)
    wait_for_event(run, "restarting", 90, round=2)
    # 3. a round node dies whole: the spare takes its place, the world size stays
    progress_in(run, 2)
    dead = round_nodes[1]
    tb.kill_node(dead)
    wait_for_event(run, "node_lost", 60, node=dead)
    progress_in(run, 3)
    # 4. the stop signal: every rank stops at one step, hpcelastic requeues, the job resumes
    tb.slurm("scancel", "--signal=USR2", "--batch", job)
    first = wait_job_state(job, {"PENDING"}, 150)  # the requeue waits until Slurm marks the dead node DOWN
    assert first["Restarts"] == "1", first
    rec = wait_job_finished(job, 300)

    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", rec
    assert dead not in hostlist.expand_hostlist(rec["NodeList"]), rec  # resumed on the nodes left
    evs = events(run)
    causes = [e["reason"] for e in named(evs, "restarting")]
    assert causes[:3] == ["worker_failed", "worker_failed", "node_lost"], causes
    (hang,) = [e for e in named(evs, "root_cause") if e["round"] == 1]
    assert hang["error"].startswith("stalled: no heartbeat"), hang  # both nodes wait: either reports first
    hosts = [r["hosts"] for r in named(evs, "rendezvous") if r.get("round", 0) == 3]
    assert hosts and dead not in hosts[0] and len(hosts[0]) == 2  # the spare in the dead node's place
    assert [e["reason"] for e in named(evs, "attempt_ended")] == ["preempted", "succeeded"]
    (requeued,) = named(evs, "requeued")
    assert requeued["by"] == "hpcelastic" and requeued["reason"] == "preempted"
    before = max(e["step"] for e in named(evs, "checkpoint_published") if e["attempt"] == 0)
    resumed = [e["step"] for e in named(evs, "progress") if e["attempt"] == 1]
    # From the stop step's checkpoint: nothing trained twice (on a loaded machine the stop may come after
    # the last step: the requeued attempt then opens the final checkpoint and has nothing left to train).
    opened = [e["file"] for e in named(evs, "checkpoint_opened") if e["attempt"] == 1]
    assert (resumed and resumed[0] > before) or (not resumed and opened == [f"step-{steps:06d}.pt"]), (
        resumed,
        opened,
        before,
    )
    assert digest(tmp_path, "faults") == reference_digest(steps)
    assert not wait_no_leaks(str(run))
    assert status_json(str(run))["outcome"] == "succeeded"


def test_preemption_with_and_without_grace_and_the_time_limit(
    tmp_path: Path, tb: Testbed, env: dict[str, str]
) -> None:
    steps = 150
    nodes = f"{NAME}[1-2]"
    job, run = submit(
        tmp_path, "preempted", "--nodes", "2", "--time", "10", f"--sbatch-arg=--nodelist={nodes}",
        train=(*train_args(steps), "--step-time", "0.2"),
    )  # fmt: skip
    limited, limited_run = submit(
        tmp_path, "limited", "--nodes", "1", "--time", "2", f"--sbatch-arg=--nodelist={NAME}3",
        train=(*train_args(steps), "--step-time", "0.6"),  # 90 s: past the signal 60 s before the limit
    )  # fmt: skip
    wait_job_state(job, {"RUNNING"}, 60)

    def preempt() -> str:
        urgent = tb.slurm(
            "sbatch", "--parsable", "-p", "urgent", "-N2", "-w", nodes, "--exclusive", "-o", "/dev/null",
            "--wrap", "sleep 3",
        ).strip()  # fmt: skip
        return urgent.split(";")[0]

    # 1. with GraceTime=30 and send_user_signal: the --signal while RUNNING, one stop step; 24.11 requeues
    # the job itself when it ends within the grace (hpcelastic's own requeue would make it run twice)
    wait_for_event(run, "checkpoint_published", 120, attempt=0, step=2 * CKPT_EVERY)
    wait_job_finished(preempt(), 120)
    rec = wait_job_state(job, {"RUNNING"}, 120)
    assert rec["Restarts"] == "1", rec
    # 2. without a grace time: Slurm's TERM, Slurm requeues
    tb.slurm("scontrol", "update", "PartitionName=debug", "GraceTime=0")
    try:
        wait_for_event(run, "checkpoint_published", 120, attempt=1)
        wait_job_finished(preempt(), 120)
        rec = wait_job_finished(job, 300)
    finally:
        tb.slurm("scontrol", "update", "PartitionName=debug", f"GraceTime={SETTINGS['preempt_grace']}")
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "2", rec
    evs = events(run)
    assert [e["reason"] for e in named(evs, "attempt_ended")] == ["preempted", "preempted", "succeeded"]
    assert [(e["by"], e["reason"]) for e in named(evs, "requeued")] == [("slurm", "preempted")] * 2
    assert len(named(evs, "attempt_started")) == 3  # the job did not run once more after it completed
    first = [e["step"] for e in named(evs, "checkpoint_published") if e["attempt"] == 0]
    second = [e["step"] for e in named(evs, "checkpoint_published") if e["attempt"] == 1]
    stop_step = int((run / "stop-attempt-0").read_text())  # the grace's stop step, fixed for every rank
    assert max(first) == stop_step and min(second) > stop_step  # its checkpoint published, resumed from it
    resumed = [e["step"] for e in named(evs, "progress") if e["attempt"] == 1]
    assert resumed and resumed[0] > max(first)  # nothing trained twice
    assert digest(tmp_path, "preempted") == reference_digest(steps)

    # The time limit, meanwhile on another node: its --signal, a stop, requeued, completed.
    rec = wait_job_finished(limited, 360)
    assert rec["JobState"] == "COMPLETED" and int(rec["Restarts"]) >= 1, rec
    ended = [e["reason"] for e in named(events(limited_run), "attempt_ended")]
    assert ended[-1] == "succeeded" and set(ended[:-1]) == {"time_limit"}, ended
    assert digest(tmp_path, "limited") == reference_digest(steps)
    for r in (run, limited_run):
        assert not wait_no_leaks(str(r))


def test_sites_check_finds_what_the_testbed_site_gets_wrong_here_and_passes_it_fixed(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """``hpcelastic sites check`` on 24.11: the testbed site asks for 4 GPUs a node (these nodes have 2) and
    gives workers 20 s to checkpoint where the partition kills a preempted job 30 s after the signal (less
    the requeue's margin); both found, one line each. Fixed, it passes, with the probe on two nodes."""
    argv = [sys.executable, "-m", "hpcelastic", "sites", "check", "--json"]
    proc = subprocess.run([*argv, "testbed"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    out = json.loads(proc.stdout)
    assert (proc.returncode, out["slurm"]) == (1, "24.11"), (proc.stderr, out)
    texts = {f["key"]: f["text"] for f in out["findings"]}
    assert set(texts) == {"max_gpus_per_node", "requeue.grace_period"}, out
    assert (
        "at most 2" in texts["max_gpus_per_node"] and "30 s after the signal" in texts["requeue.grace_period"]
    )
    fixed = tmp_path / "next.yaml"
    text = (REPO / "site_configs" / "testbed.yaml").read_text()
    fixed.write_text(
        text.replace("max_gpus_per_node: 4", "max_gpus_per_node: 2").replace(
            "grace_period: 20", "grace_period: 10"
        )
    )
    proc = subprocess.run(
        [*argv, str(fixed), "--probe"], capture_output=True, text=True, timeout=400, cwd=tmp_path
    )
    out = json.loads(proc.stdout)
    assert (proc.returncode, out["findings"]) == (0, []), (proc.stderr, out)
    assert any(n.startswith(f"probe on {NAME}") for n in out["notes"]), out
