"""The Python API on the real testbed: a callable through the submitit backend, under the agents."""

from __future__ import annotations

from pathlib import Path

import pytest

import hpcelastic
from tests.slurm_utils import events, named, wait_no_leaks, wait_nodes_idle

pytestmark = pytest.mark.slurm


def test_callable_runs_on_two_nodes_and_returns_rank0_result(tmp_path: Path, slurm_jobs: list[str]) -> None:
    def allreduce_ranks(scale: int) -> dict[str, int]:
        # A nested function: pickled by value, so the nodes need not import this test module.
        import os

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.tensor([int(os.environ["RANK"])])
        dist.all_reduce(t)
        world = dist.get_world_size()
        dist.destroy_process_group()
        return {
            "sum": int(t.item()) * scale,
            "world": world,
            "attempt": int(os.environ["HPCELASTIC_ATTEMPT"]),
        }

    wait_nodes_idle()
    job = hpcelastic.submit(
        allreduce_ranks,
        10,
        nodes="2",
        nproc_per_node="2",
        site="testbed",
        time="5",
        run_dir=str(tmp_path / "run"),
    )
    slurm_jobs.append(job.job_id)
    assert job.wait(poll_s=1, timeout_s=240) == "COMPLETED"
    assert job.result() == {"sum": (0 + 1 + 2 + 3) * 10, "world": 4, "attempt": 0}
    evs = events(job.run_dir)
    assert named(evs, "submitted")[0]["backend"] == "submitit"
    (rdzv,) = named(evs, "rendezvous")
    assert len(set(rdzv["hosts"])) == 2
    assert not wait_no_leaks(str(job.run_dir))
