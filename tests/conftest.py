"""Shared fixtures: the real Slurm testbed, fresh run directories, a CPU quota on a process (cgroup v1)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """A run started in the background by a shell without job control (``cmd &``) inherits SIGINT and SIGQUIT
    ignored, and so would every process the tests start (a Ctrl-C test would then never see its Ctrl-C):
    give them back their default dispositions."""
    for sig in (signal.SIGINT, signal.SIGQUIT):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, object]:
    """The project's real 4-node Slurm cluster (scripts/testbed.sh), brought up if it is not running.

    Fails (never skips) when it cannot be started: every machine that runs the tests can run it.
    """
    with open("/var/lock/hpcelastic-testbed-default-up.lock", "w") as lock:  # parallel workers: one `up`
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(
            ["bash", str(REPO / "scripts" / "testbed.sh"), "up"], capture_output=True, text=True, timeout=300
        )
    if proc.returncode != 0:
        pytest.fail(f"the Slurm testbed did not come up:\n{proc.stdout}\n{proc.stderr}")
    return {"partition": "debug", "nodes": ["node1", "node2", "node3", "node4"], "gpus_per_node": 4}


@pytest.fixture
def slurm_jobs(slurm_cluster: dict[str, object]) -> Iterator[list[str]]:
    """A list a test appends its job ids to; every listed job is cancelled afterwards."""
    jobs: list[str] = []
    yield jobs
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, check=False)


DEFAULT_GROUP = "testbed-default"
"""The parallel runner's group (pytest-xdist ``--dist loadgroup``) of every test on the default instance."""


def xdist_group(item: pytest.Item) -> str:
    """The test's group as pytest-xdist names it: its ``xdist_group`` marks joined, or empty."""
    names = {
        str(m.args[0] if m.args else m.kwargs.get("name", "default"))
        for m in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names))


LONGEST_GROUPS = (
    DEFAULT_GROUP,
    "tier-differential",
    "next",
    "preempt",
    "tierdiff",
    "containers",
    "fabric",
    "slownode",
    "slow-local",
    "tests/faults/test_replica_groups_stop.py",
    "ftreplica",
    "tests/faults/test_replica_groups_hang.py",
    "tests/faults/test_checkpoint_tier_local.py",
    "nodedeath",
    "ckpttier",
    "tests/unit/test_sim_weeks.py",
    "faults",
)
"""The groups that take longest, longest first (their seconds in a CI run, ``--durations``). A parallel run
starts them first (``--no-loadscope-reorder`` keeps this order): a long group started last would run
alone at the end while the other workers idle."""


def group_rank(item: pytest.Item) -> int:
    """Where the item's group starts in a parallel run: the longest groups first, the others after."""
    group = xdist_group(item)
    return LONGEST_GROUPS.index(group) if group in LONGEST_GROUPS else len(LONGEST_GROUPS)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for a parallel run (``-n N --dist loadgroup``).

    A test marked ``slurm`` without a group of its own (an own-instance module names its instance with
    ``pytest.mark.xdist_group``) runs on the default instance: all those share one group, run in turn by one
    worker. Any other module is a group of its own, so its module fixtures run once. The longest groups
    go first (``LONGEST_GROUPS``).
    """
    for item in items:
        if xdist_group(item):
            continue
        name = DEFAULT_GROUP if item.get_closest_marker("slurm") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(name=name))
    items.sort(key=group_rank)


@pytest.fixture(autouse=True)
def no_leaked_gres(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every Slurm test: no node of the instances it uses (the default one, or those it holds through
    ``tests.testbed.own_instance``) holds GRES of a job that ended (``tests.slurm_utils.leaked_gres``; nodes
    that leaked before the test began are not its doing). Other instances may be busy with a parallel
    worker's tests."""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    from tests.slurm_utils import leaked_gres_everywhere
    from tests.testbed import IN_USE

    names = set(IN_USE) | ({"default"} if xdist_group(request.node) == DEFAULT_GROUP else set())
    before = leaked_gres_everywhere(timeout=0, names=names)
    yield
    new = leaked_gres_everywhere(known=before, names=names)
    assert not new, f"GRES still allocated on nodes without a job (scontrol -d show node GresUsed): {new}"


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


@pytest.fixture
def cpu_quota() -> Iterator[callable]:
    """Put a process (or several: one node's) in a new cgroup v1 CPU group with a quota of ``share`` CPUs
    for them all; undone at the end."""
    made: list[tuple[Path, Path]] = []

    def limit(pids: int | list[int], share: float, period_us: int = 100000) -> None:
        pids = [pids] if isinstance(pids, int) else pids
        group = CPU_CGROUP / f"hpcelastic-test-{os.getpid()}-{pids[0]}"
        group.mkdir()
        own = next(
            line.split(":", 2)[2]
            for line in Path(f"/proc/{pids[0]}/cgroup").read_text().splitlines()
            if line.split(":")[1].split(",").count("cpu")
        )
        made.append((group, CPU_CGROUP / own.lstrip("/")))
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(share * period_us))))
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))

    yield limit
    for group, home in made:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # it exited
                (home / "cgroup.procs").write_text(pid)
        group.rmdir()
