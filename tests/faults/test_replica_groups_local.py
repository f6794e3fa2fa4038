"""torchft replica groups under `hpcelastic run`: a failure restarts only its group, healed from a peer; the
lost-time ledger charges the lost time to that group only and the job keeps its productive time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcelastic import events as ev
from hpcelastic.agent.console import RANK_LOG_ONLY
from hpcelastic.rundir import RunDir
from tests.replica_checks import check_group_restart, train_args

pytest.importorskip("torchft")
STEPS = 160


def test_worker_killed_in_group_1_restarts_only_group_1(tmp_path: Path) -> None:
    out = tmp_path / "out" / "nested"  # not made here: the example makes its --out-dir (issue 21)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "4", "--nproc-per-node", "1"]
    cmd += ["--replica-groups", "2", "--run-dir", str(run_dir), "--rdzv-timeout", "60"]
    cmd += train_args(out, steps=STEPS, crash_at=10)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    output = proc.stdout + proc.stderr
    assert "[INFO] [torchft::" not in output, "torchft's per-quorum INFO lines belong in the rank logs"
    assert "replica group 1: restarting" in output
    check_group_console(output, run_dir)
    check_group_restart(out, RunDir(run_dir).events(), steps=STEPS)
    assert "[INFO] [torchft::lighthouse]" in (run_dir / "logs" / "lighthouse.log").read_text()
    check_replica_ledger(run_dir)


def check_group_console(output: str, run_dir: Path) -> None:
    """The console of a group restart (issue 21): each rank named with its group, the group's root cause
    before its restart, no third-party chatter (the rank logs keep it), no traceback of the killed rank's
    peers."""
    lines = output.splitlines()
    assert {"[g0 r0]", "[g0 r1]", "[g1 r0]", "[g1 r1]"} & {line[:7] for line in lines}
    assert not [line for line in lines if line.startswith("[rank")], "a group's rank 0 is not [rank0]"
    cause = next(
        i for i, line in enumerate(lines) if line.startswith("hpcelastic: replica group 1: root cause")
    )
    assert "rank 1" in lines[cause] and "SIGKILL" in lines[cause]
    assert cause < next(i for i, line in enumerate(lines) if "replica group 1: restarting" in line)
    attempt = run_dir / "logs" / "attempt-0"
    # each group's ranks have logs of their own (both groups have a rank 0)
    assert {p.name for p in attempt.glob("rank-*.log")} == {
        f"rank-{r}-g{g}.log" for r in (0, 1) for g in (0, 1)
    }
    logs_cmd = [sys.executable, "-m", "hpcelastic", "logs", str(run_dir)]
    shown = subprocess.run([*logs_cmd, "--rank", "1", "--group", "1"], capture_output=True, text=True)
    assert shown.returncode == 0 and "SIGKILL at step" in shown.stdout, shown.stderr
    ungrouped = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "logs", str(run_dir)], capture_output=True, text=True
    )
    assert ungrouped.returncode == 2 and "--group" in ungrouped.stderr
    logs = "".join(p.read_text() for p in attempt.glob("rank-*.log"))
    chatter = [line for line in logs.splitlines() if RANK_LOG_ONLY.search(line.encode())]
    assert chatter, "torchft said nothing in the rank logs: nothing was checked"
    assert not [line for line in lines if RANK_LOG_ONLY.search(line.encode())], "chatter on the console"
    assert "Traceback" not in output  # the SIGKILLed rank has none; its peers' consequent ones stay in logs


def check_replica_ledger(run_dir: Path) -> None:
    """Group 1's lost time is its own; the job was never interrupted (before, the groups' parallel rounds
    made the whole attempt start-up: ETTR 0 %)."""
    status = [sys.executable, "-m", "hpcelastic", "status", str(run_dir)]
    data = json.loads(subprocess.run([*status, "--json"], capture_output=True, text=True, check=True).stdout)
    led = data["ledger"]
    rep = led["replica_groups"]
    assert rep["groups"] == 2
    assert rep["replica_steps_possible"] == 2 * STEPS, rep
    healthy, killed = rep["per_group"]
    assert killed["lost_s"] > 0 and killed["restarts"] == 1, killed
    # Group 1 misses the steps group 0 commits without it: none when group 0 was itself held up (its
    # allreduce with the dead worker timing out) until group 1 was back, as on a loaded machine.
    assert rep["replica_steps_committed"] == 2 * STEPS - killed["steps_missed"], rep
    assert 0.5 < rep["replica_step_efficiency"] <= 1.0, rep
    assert healthy["lost_s"] == 0 and healthy["restarts"] == 0 and healthy["steps_missed"] == 0, healthy
    assert healthy["productive_s"] > killed["productive_s"] > 0
    # The job itself was never interrupted: no job incident, its productive time is group 0's, from the
    # job's first step where group 0's lane starts at its own (replica_group_stepping): the groups' first
    # steps differ by up to their reports' spread.
    assert led["incidents"] == [] and led["ettr"] > 0.3, led["ettr"]
    firsts = [r["step_ts"] for r in RunDir(run_dir).events().of(ev.REPLICA_GROUP_STEPPING) if r["round"] < 2]
    assert len(firsts) == 2, firsts
    spread = max(firsts) - min(firsts)
    assert led["productive_s"] == pytest.approx(healthy["productive_s"], abs=0.01 + spread)
    # The time from the last step to the end of the attempt is its own category.
    assert led["badput_by_phase"].get("shutdown", 0) > 0, led["badput_by_phase"]

    text = subprocess.run(status, capture_output=True, text=True, check=True).stdout
    assert "replica groups: 2; replica-step efficiency" in text
    assert "replica group 1 restarting" in text and "healed from group(s) 0" in text
    assert "group 1 worker_failure" in text


def test_replica_groups_must_split_the_nodes(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("")
    cmd = [sys.executable, "-m", "hpcelastic", "run", "--nodes", "3", "--replica-groups", "2"]
    cmd += ["--run-dir", str(tmp_path / "run"), "x.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    line = "3 node(s) do not split into 2 replica groups of equal size; pick --nodes as a multiple of "
    line += "--replica-groups"
    assert proc.stderr.strip().endswith(line)
    assert not (tmp_path / "run").exists()
