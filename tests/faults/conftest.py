"""Fixtures of the fault tests: local jobs, the orphan check, a fault-free reference."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.localjob import LocalJob
from tests.slurm_utils import leaked_processes


@pytest.fixture
def local_job(tmp_path: Path) -> Iterator[Callable[..., LocalJob]]:
    """Factory of local jobs; afterwards asserts that no process of the run survives."""
    jobs: list[LocalJob] = []

    def make(**kwargs: Any) -> LocalJob:
        job = LocalJob(tmp_path / f"job{len(jobs)}", **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        for a in job.agents:
            if a.poll() is None:
                a.kill()
                a.wait()
        deadline = time.monotonic() + 10
        survivors = leaked_processes(job.run_dir.path)
        while survivors and time.monotonic() < deadline:
            time.sleep(0.1)
            survivors = leaked_processes(job.run_dir.path)
        for p in survivors:
            p.kill()
        assert not survivors, f"orphans left behind: {[(p.pid, p.cmdline()) for p in survivors]}"


@pytest.fixture(scope="session")
def reference_params(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Final parameters of a fault-free 2 nodes x 2 workers run."""
    job = LocalJob(tmp_path_factory.mktemp("reference"))
    assert job.wait() == [0, 0]
    return job.final_params()
