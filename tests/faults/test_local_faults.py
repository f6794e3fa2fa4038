"""Real end-to-end jobs on this machine (CPU, gloo): failures restart every node, budgets, node loss."""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.faults.localjob import EXAMPLE, REPO
from tests.slurm_utils import leaked_processes


def close(a: list[float], b: list[float], tol: float = 1e-6) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b, strict=True))


def test_two_nodes_complete(local_job, reference_params) -> None:
    job = local_job()
    assert job.wait() == [0, 0]
    names = [e["event"] for e in job.events()]
    assert names[:3] == ["attempt_started", "rendezvous", "workers_started"]
    assert names[-2:] == ["attempt_ended", "job_succeeded"]
    assert job.final_params() == reference_params
    assert (job.run_dir.path / "logs" / "attempt-0" / "rank-3.log").exists()


def test_crash_restarts_all_nodes_and_matches_fault_free(local_job, reference_params) -> None:
    job = local_job(train_args=("--crash-at-step", "6", "--crash-rank", "3"))
    assert job.wait() == [0, 0]
    [cause] = job.events("root_cause")
    assert (cause["rank"], cause["node"], cause["exitcode"]) == (3, "local1", 1)
    assert "injected crash at step 6 on rank 3" in cause["error"]
    assert "RuntimeError: injected crash" in cause["traceback"]
    rdzv = job.events("rendezvous")
    assert [r["restart_count"] for r in rdzv] == [0, 1]
    assert rdzv[0]["master_port"] != rdzv[1]["master_port"]
    assert [e["world_size"] for e in job.events("workers_started")] == [4, 4]
    assert job.final_params() == reference_params


def test_sigkilled_worker_is_restarted(local_job, reference_params) -> None:
    job = local_job(train_args=("--crash-at-step", "5", "--crash-rank", "0", "--crash-mode", "sigkill"))
    assert job.wait() == [0, 0]
    [cause] = job.events("root_cause")
    assert (cause["rank"], cause["signal"]) == (0, "SIGKILL")
    assert job.final_params() == reference_params


def test_budget_exhausted_exits_3_on_every_agent(local_job) -> None:
    job = local_job(
        max_restarts=0, train_args=("--crash-at-step", "3", "--crash-rank", "1", "--crash-mode", "exit")
    )
    assert job.wait() == [3, 3]
    [ended] = job.events("attempt_ended")
    assert (ended["reason"], ended["exit_code"]) == ("restarts_exhausted", 3)
    assert job.events("root_cause")[0]["exitcode"] == 13
    assert job.events("job_failed")[0]["exit_code"] == 3


def test_agent_sigkilled_job_continues_on_survivors(local_job, reference_params) -> None:
    job = local_job(
        nodes="2:3",
        train_args=(
            "--step-time",
            "0.3",
        ),
    )
    job.wait_for_training(2)
    job.kill_agent(2)
    codes = job.wait()
    assert codes[:2] == [0, 0] and codes[2] == -signal.SIGKILL
    [lost] = job.events("node_lost")
    assert (lost["node_rank"], lost["node"]) == (2, "local2")
    rdzv = job.events("rendezvous")
    assert [r["world_size"] for r in rdzv] == [6, 4]
    assert rdzv[1]["hosts"] == ["local0", "local1"]
    assert job.events("attempt_ended")[0]["reason"] == "succeeded"
    assert close(job.final_params(), reference_params)


def test_agent_sigkilled_too_few_nodes_exits_4(local_job) -> None:
    job = local_job(
        nodes="2:2",
        train_args=(
            "--step-time",
            "0.3",
        ),
    )
    job.wait_for_training(2)
    job.kill_agent(1)
    assert job.wait()[0] == 4
    [ended] = job.events("attempt_ended")
    assert (ended["reason"], ended["exit_code"]) == ("too_few_nodes", 4)
    assert job.events("node_lost")[0]["node_rank"] == 1


def test_coordinator_agent_sigkilled_others_exit_6(local_job) -> None:
    job = local_job(
        train_args=(
            "--step-time",
            "0.3",
        )
    )
    job.wait_for_training(2)
    job.kill_agent(0)
    assert job.wait()[1] == 6
    [ended] = job.events("attempt_ended")
    assert (ended["reason"], ended["exit_code"]) == ("coordinator_lost", 6)


def test_stalled_worker_is_failed_and_restarted(local_job, reference_params) -> None:
    job = local_job(
        agent_args=("--stall-timeout", "2"),
        train_args=("--hang-at-step", "4", "--crash-rank", "2"),
    )
    assert job.wait() == [0, 0]
    failures = job.events("worker_failed")
    assert any(f["rank"] == 2 and f["error"].startswith("stalled") for f in failures)
    assert job.events("root_cause")[0]["error"].startswith("stalled")
    assert job.final_params() == reference_params


def test_preemption_signal_stops_every_node_with_code_5(local_job) -> None:
    job = local_job(
        train_args=(
            "--step-time",
            "0.3",
        )
    )
    job.wait_for_training(2)
    job.agents[1].send_signal(signal.SIGUSR2)
    assert job.wait() == [5, 5]
    [ended] = job.events("attempt_ended")
    assert (ended["reason"], ended["exit_code"]) == ("preempted", 5)
    assert job.events("signal_received")[0]["signal"] == "SIGUSR2"
    assert not job.events("restarting")
    # Outside Slurm nothing can bring the job back: the policy says so instead of requeueing.
    [skipped] = job.events("requeue_skipped")
    assert skipped["reason"] == "no_slurm_job"
    assert (job.run_dir.path / "stop-attempt-0").exists()


def test_a_stop_signal_reaching_the_nodes_apart_is_one_stop_not_a_lost_node(local_job) -> None:
    """Slurm's TERM (scancel, preemption, time limit) reaches each node when its slurmd gets to it, to
    the agent and its workers at once. Node 1 gets it 0.5 s before node 0: before, the coordinator read
    node 1 as lost, stopped node 0 and recorded a root cause (CI, preempted job); it is one stop. Node
    0's workers may fail on the closed peers first: that failure follows the stop and is no root cause."""
    job = local_job(train_args=("--step-time", "0.3"))
    job.wait_for_training(2)
    for i in (1, 0):
        agent = psutil.Process(job.agents[i].pid)
        for proc in [agent, *agent.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
    assert job.wait() == [128 + signal.SIGTERM] * 2
    stopped = job.events("agent_stopped")  # the step's stop: recorded as such, not as lost nodes (issue 21)
    assert sorted(e["node_rank"] for e in stopped) == [0, 1], job.events()
    assert not job.events("node_lost") and not job.events("root_cause") and not job.events("restarting")


def test_mpirun_bootstraps_the_job(tmp_path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        "2",
        sys.executable,
        "-m",
        "hpcelastic",
        "agent",
        "--run-dir",
        str(run_dir),
        "--nproc-per-node",
        "2",
        "--",
        str(EXAMPLE),
        "--steps",
        "4",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from hpcelastic.rundir import RunDir

    events = RunDir(run_dir).events()
    [rdzv] = [e for e in events if e["event"] == "rendezvous"]
    assert rdzv["world_size"] == 4 and len(rdzv["hosts"]) == 2
    assert [e["event"] for e in events][-1] == "job_succeeded"
    assert (run_dir / "secret").stat().st_mode & 0o077 == 0
    assert not leaked_processes(run_dir)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc-per-node", "0", "--", str(EXAMPLE)], "--nproc-per-node '0'"),
        (["--", "does_not_exist.py"], "does_not_exist.py' does not exist"),
        (["--rdzv-endpoint", "nohostport", "--", str(EXAMPLE)], "cannot parse the rendezvous endpoint"),
        (["--run-dir", "{tmp}", "--", str(EXAMPLE)], "secret"),
    ],
)
def test_bad_agent_input_is_one_clear_line(tmp_path, args: list[str], message: str) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "agent", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_agent_with_wrong_secret_is_rejected(local_job, tmp_path) -> None:
    job = local_job(
        nodes="1",
        train_args=(
            "--step-time",
            "2",  # the job outlives the rejected agent's retries
        ),
    )
    job.wait_until("rendezvous", lambda: bool(job.events("rendezvous")))
    port = job.agents[0].args[job.agents[0].args.index("--rdzv-endpoint") + 1]
    other = tmp_path / "other"
    other.mkdir()
    (other / "secret").write_text("wrong-secret")
    env = {"HPCELASTIC_LOCAL_NODE_RANK": "1", "HPCELASTIC_LOCAL_NUM_NODES": "2", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcelastic",
            "agent",
            "--run-dir",
            str(other),
            "--rdzv-endpoint",
            port,
            "--rdzv-timeout",
            "5",
            "--",
            str(EXAMPLE),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    # A refusal is unauthenticated: retried until the deadline, then coordinator_lost (exit 6), not exit 2.
    assert proc.returncode == 6, proc.stderr
    assert "rejected this agent" in proc.stderr and "secret" in proc.stderr
    job.agents[0].kill()


def test_four_nodes_worker_killed_mid_run_matches_fault_free(local_job) -> None:
    reference = local_job(nodes="4")
    assert reference.wait() == [0, 0, 0, 0]
    job = local_job(
        nodes="4", train_args=("--crash-at-step", "7", "--crash-rank", "6", "--crash-mode", "sigkill")
    )
    assert job.wait() == [0, 0, 0, 0]
    assert [e["restart_count"] for e in job.events("rendezvous")] == [0, 1]
    assert [e["world_size"] for e in job.events("workers_started")] == [8, 8]
    assert job.final_params() == reference.final_params()
