"""Shared fixtures: the real Slurm testbed and fresh run directories."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, object]:
    """The project's real 4-node Slurm cluster (scripts/testbed.sh), brought up if it is not running.

    Fails (never skips) when it cannot be started: every machine that runs the tests can run it.
    """
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


@pytest.fixture(autouse=True)
def no_leaked_gres(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every Slurm test: no node of a running testbed instance holds GRES of a job that ended
    (``tests.slurm_utils.leaked_gres``; nodes that leaked before the test began are not its doing)."""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    from tests.slurm_utils import leaked_gres_everywhere

    before = leaked_gres_everywhere(timeout=0)
    yield
    new = leaked_gres_everywhere(known=before)
    assert not new, f"GRES still allocated on nodes without a job (scontrol -d show node GresUsed): {new}"
