"""torchft replica groups when a node of group 1 really dies (slurmd and every process, SIGKILL at once).

Runs on a 5-node testbed instance of its own (``ftreplica``: 127.0.5.x, SlurmdTimeout 10 s), never on
the shared default instance. With a hot spare (``--spare-nodes 1``) the spare takes the dead node's place:
group 1 restarts on it and heals from group 0, which never stops stepping, and both end with identical
weights. Without one, group 1 is left out (torchft needs groups of equal size) while group 0, which keeps
stepping, is at least ``--min-replica-groups``. Either way the job completes in the same allocation
without a requeue, and Slurm drops the dead node from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import hostlist
import pytest

from hpcelastic import events
from hpcelastic.jobs.slurm import ENDED_STATES, parse_scontrol_record
from hpcelastic.rundir import RunDir
from tests.replica_checks import check_group0_kept_stepping, check_group_restart, train_args
from tests.testbed import Testbed, own_instance

pytest.importorskip("torchft")
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name="ftreplica")]
NAME = "ftreplica"
NODES = tuple(f"{NAME}{i}" for i in range(1, 6))
STEPS = 160


@pytest.fixture(scope="module")
def tb(slurm_cluster: dict[str, object]) -> Iterator[Testbed]:
    with own_instance(NAME, {"index": "5", "nodes": str(len(NODES)), "slurmd_timeout": "10"}) as inst:
        yield inst


def job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return parse_scontrol_record(out.splitlines()[0]) if out.strip() else {}


def wait_for(what: str, check: object, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()  # type: ignore[operator]
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"{what} not seen in {timeout:.0f} s")


def submit_and_kill(
    tb: Testbed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], kill_rank: int
) -> tuple[dict[str, str], RunDir, Path, list[str], str]:
    """Submit 2 replica groups x 2 nodes (``extra`` added), kill node rank ``kill_rank`` some 30 steps in,
    wait for the job's end: its last ``scontrol`` record, run directory, output directory, the nodes it was
    first given (in node-rank order) and the node killed."""
    for node in NODES:
        tb.wait_node_state(node, ("idle",))
    monkeypatch.setenv("SLURM_CONF", tb.slurm_env()["SLURM_CONF"])
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", "testbed"]
    argv += ["--run-dir", str(tmp_path / "run"), "--time", "10", "--nodes", "4", "--nproc-per-node", "1"]
    argv += ["--replica-groups", "2", *extra, *train_args(out, steps=STEPS)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    job_id, rd = str(info["job_id"]), RunDir(Path(info["run_dir"]))
    wait_for("the first step", lambda: rd.events().of(events.PROGRESS), 240)
    given = hostlist.expand_hostlist(job(job_id)["NodeList"])
    victim = given[kill_rank]
    try:
        time.sleep(8)  # some 30 steps into the run
        tb.kill_node(victim)
        rec = wait_for("the job's end", lambda: (r := job(job_id)).get("JobState") in ENDED_STATES and r, 300)
    finally:
        tb.revive_node(victim)
    assert isinstance(rec, dict)
    return rec, rd, out, given, victim


def test_node_death_in_group_1_with_a_spare_group_1_restarts_on_it_and_heals(
    tb: Testbed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec, rd, out, given, victim = submit_and_kill(tb, tmp_path, monkeypatch, ["--spare-nodes", "1"], 2)
    assert len(given) == 5, given
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    # Slurm removed the dead node from the allocation; the job stayed in it.
    assert hostlist.expand_hostlist(rec["NodeList"]) == [n for n in given if n != victim], rec
    log = rd.events()
    assert [e["node"] for e in log.of(events.NODE_LOST)] == [victim]
    restarts = log.of(events.REPLICA_GROUP_RESTARTING)
    assert len(restarts) == 1, [(e["event"], e.get("group"), e.get("reason"), e.get("node")) for e in log]
    (restart,) = restarts
    assert restart["reason"] == "node_lost" and restart["nodes"] == given[3:5], restart
    assert not log.of(events.REPLICA_GROUP_DROPPED) and not log.of(events.RESTARTING)
    assert not log.of(events.REQUEUED) and len(log.of(events.ATTEMPT_STARTED)) == 1
    stats = check_group_restart(out, log, steps=STEPS, injected=False)
    print(f"replica groups, node death with a spare: {stats}")


def test_node_death_in_group_1_leaves_it_out_group_0_goes_on(
    tb: Testbed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec, rd, out, given, victim = submit_and_kill(tb, tmp_path, monkeypatch, [], 3)
    assert len(given) == 4, given
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    log = rd.events()
    assert [e["node"] for e in log.of(events.NODE_LOST)] == [victim]
    (dropped,) = log.of(events.REPLICA_GROUP_DROPPED)
    assert (dropped["group"], dropped["reason"]) == (1, "it lost 1 of its nodes and no spare is left"), (
        dropped
    )
    assert not log.of(events.REPLICA_GROUP_RESTARTING) and not log.of(events.RESTARTING)
    assert not log.of(events.REQUEUED) and len(log.of(events.ATTEMPT_STARTED)) == 1
    # Slurm removed the dead node from the allocation
    assert hostlist.expand_hostlist(rec["NodeList"]) == [n for n in given if n != victim], rec
    stats = check_group0_kept_stepping(out, steps=STEPS)
    print(f"replica groups, node death: {stats}")
