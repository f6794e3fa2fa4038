"""The testbed itself: a second instance beside the default one, node death, unresolvable node
names, preemption by partition priority, CPU binding by task/cgroup + task/affinity.

Everything that disturbs a cluster (killing a node, preempting) happens on a small instance of
this module's own (``tbtest``: 2 nodes on 127.0.3.x, ports 7017/17201..), never on the default
instance that other tests share; the default instance is only looked at.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic.jobs.slurm import parse_scontrol_record as parse_record
from tests.testbed import Testbed, instance_of, own_instance

pytestmark = pytest.mark.slurm

SLURMD_TIMEOUT = 10  # DOWN about 27 s after the kill (SlurmdTimeout + ~17 s)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state


@pytest.fixture(scope="module")
def default_pids(slurm_cluster: dict[str, object]) -> dict[str, int | None]:
    pids = Testbed().daemon_pids()
    assert all(pids.values()), f"default testbed not fully up: {pids}"
    return pids


@pytest.fixture(scope="module")
def tb(default_pids: dict[str, int | None]) -> Iterator[Testbed]:
    """A 2-node instance of this module's own: fast SlurmdTimeout, preemption, tbtest2 unresolvable,
    tasks bound as clusters bind them (2 CPUs per node: task/affinity binds to the host's CPU ids)."""
    with own_instance(
        "tbtest",
        {"index": "3", "nodes": "2", "slurmd_timeout": str(SLURMD_TIMEOUT), "preempt": "1"}
        | {"unresolvable": "tbtest2", "task_plugin": "task/cgroup,task/affinity", "cpus_per_node": "2"},
    ) as inst:
        yield inst


def _job(tb: Testbed, job_id: str) -> dict[str, str]:
    out = tb.slurm("scontrol", "show", "job", "-o", job_id, check=False)
    return parse_record(out.splitlines()[0]) if out.strip() else {}


def _wait_job(tb: Testbed, job_id: str, states: set[str], timeout: float = 60) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    rec: dict[str, str] = {}
    while time.monotonic() < deadline:
        rec = _job(tb, job_id)
        if rec.get("JobState") in states:
            return rec
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not in {states} after {timeout} s: {rec}")


def _sbatch(tb: Testbed, *args: str) -> str:
    return tb.slurm("sbatch", "--parsable", "-o", "/dev/null", *args).strip().split(";")[0]


def test_second_instance_beside_default(tb: Testbed, default_pids: dict[str, int | None]) -> None:
    """Own config, ports and nodes; down/up of it leaves the default instance's daemons running."""
    assert tb.slurm_conf == "/var/lib/hpcelastic-testbed-tbtest/etc/slurm.conf"
    conf = Path(tb.slurm_conf).read_text()
    assert "SlurmctldPort=7017" in conf and "NodeAddr=127.0.3.2 Port=17202" in conf
    assert tb.slurm("sinfo", "-h", "-N", "-p", "debug", "-o", "%N").split() == ["tbtest1", "tbtest2"]
    ours = tb.daemon_pids()
    assert set(ours) == {"slurmctld", "tbtest1", "tbtest2"} and all(ours.values())

    tb.down()
    assert not any(_alive(p) for p in ours.values() if p)
    assert Testbed().daemon_pids() == default_pids
    assert all(_alive(p) for p in default_pids.values() if p)
    tb.up()
    assert Testbed().daemon_pids() == default_pids
    assert all(tb.daemon_pids().values())
    assert "node1" in Testbed().slurm("sinfo", "-h", "-N", "-o", "%N")


def test_unresolvable_node_name_runs_srun(tb: Testbed) -> None:
    """tbtest2 is not in /etc/hosts: Slurm reaches it by NodeAddr and srun still works there."""
    with pytest.raises(OSError):
        socket.gethostbyname("tbtest2")
    socket.gethostbyname("tbtest1")
    out = tb.slurm("srun", "-N2", "-w", "tbtest[1-2]", "printenv", "SLURMD_NODENAME", timeout=60)
    assert sorted(out.split()) == ["tbtest1", "tbtest2"]


def test_task_cgroup_confines_and_affinity_binds(tb: Testbed) -> None:
    """task/cgroup puts a step in a cpuset of its CPUs; task/affinity gives each task its own CPU."""
    show = "import os; print(sorted(os.sched_getaffinity(0)), open('/proc/self/cgroup').read().split())"
    out = tb.slurm("srun", "-w", "tbtest1", "-n1", "-c1", sys.executable, "-c", show)
    assert re.match(r"\[\d\] ", out) and "/job_" in out, out
    show = "import os; print(sorted(os.sched_getaffinity(0)))"
    out = tb.slurm("srun", "-w", "tbtest1", "-n2", "-c1", sys.executable, "-c", show)
    assert sorted(out.split()) == ["[0]", "[1]"], out


def test_preemption_requeues_debug_job(tb: Testbed) -> None:
    """A job in `urgent` preempts a `debug` job on its nodes; Slurm requeues the debug job."""
    tb.wait_node_state("tbtest1", ("idle",), 60)
    tb.wait_node_state("tbtest2", ("idle",), 60)
    low = _sbatch(tb, "-p", "debug", "-N2", "--exclusive", "--wrap", "sleep 300")
    _wait_job(tb, low, {"RUNNING"})
    high = _sbatch(tb, "-p", "urgent", "-N1", "--exclusive", "--wrap", "sleep 2")
    _wait_job(tb, high, {"RUNNING", "COMPLETED"}, 30)
    rec = _job(tb, low)
    assert rec["JobState"] in {"PENDING", "REQUEUED", "PREEMPTED"}, rec
    assert rec["Restarts"] == "1", rec
    tb.slurm("scancel", low, high, check=False)


def test_kill_node_is_a_node_death(tb: Testbed) -> None:
    """kill-node SIGKILLs the slurmd and every job process of the node; Slurm marks it DOWN and
    requeues the job; revive-node brings it back."""
    tb.wait_node_state("tbtest1", ("idle",), 60)
    job = _sbatch(tb, "-N1", "-w", "tbtest1", "--requeue", "--wrap", "srun sleep 300")
    _wait_job(tb, job, {"RUNNING"})
    slurmd = tb.daemon_pids()["tbtest1"]
    before = tb.node_pids("tbtest1")
    deadline = time.monotonic() + 20
    # slurmd, batch stepd, batch script, srun, step stepd, sleep
    while len(before) < 6 and time.monotonic() < deadline:
        time.sleep(0.3)
        before = tb.node_pids("tbtest1")
    assert instance_of("tbtest1").name == "tbtest"
    killed = tb.kill_node("tbtest1")
    assert slurmd in killed and set(before) <= set(killed), (before, killed)
    time.sleep(0.5)
    assert not [p for p in killed if _alive(p)]
    assert tb.daemon_pids()["tbtest2"], "the other node's slurmd must survive"
    took = tb.wait_node_state("tbtest1", ("down",), SLURMD_TIMEOUT + 60)
    print(f"tbtest1 DOWN {took:.1f} s after kill-node (SlurmdTimeout={SLURMD_TIMEOUT})")
    rec = _wait_job(tb, job, {"PENDING", "REQUEUED", "NODE_FAIL"}, 30)
    assert rec["Restarts"] == "1" or rec["JobState"] == "NODE_FAIL", rec
    tb.slurm("scancel", job, check=False)
    tb.revive_node("tbtest1")
    tb.wait_node_state("tbtest1", ("idle", "mixed", "allocated"), 60)
    assert Testbed().daemon_pids()["node1"], "the default instance is untouched"
