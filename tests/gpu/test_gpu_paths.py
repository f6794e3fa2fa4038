"""The GPU paths on a real GPU: CUDA in warm-started workers, the GPU as Slurm gives it, NVML from the
driver, GPU tensors through the local tier (DCP ``save`` and ``async_save``), and the hang watch on a worker
stuck in a CUDA kernel. Every run is one agent with one NCCL worker (``tests/gpu/harness.py``).

Skipped, with the reason, where no CUDA device exists: these are the only tests allowed to skip.
``scripts/gpu_check.sh`` runs them and ``bench/gpu_check.py`` on a GPU machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpcelastic import events as ev
from hpcelastic import handoff
from tests.gpu.harness import STEPS, GpuRun, first_gpu, rehearsal, restart_times, run_training, why_no_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(why_no_gpu() is not None, reason=why_no_gpu() or ""),
]  # one module, so one xdist group (tests/conftest.py): one run at a time on the one GPU


def _ok(run: GpuRun) -> None:
    assert run.returncode == 0, run.output[-4000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The fault-free model's digest: the same script, no checkpoints, no faults, no tier."""
    run = run_training(tmp_path_factory.mktemp("gpu-reference"), "reference")
    _ok(run)
    return run.report()["sha256"]


def test_a_warm_worker_initialises_cuda_trains_and_restarts_warm_after_a_crash(
    tmp_path: Path, reference: str
) -> None:
    """The fork server imported torch but never touched CUDA: the forked worker initialises it and trains,
    and after a crash the new worker is forked warm again, resumes from its DCP checkpoint and ends with
    the fault-free model."""
    run = run_training(tmp_path, "crash", ("--save-every", "10", "--crash-at-step", "25"))
    _ok(run)
    started = run.named(ev.WORKERS_STARTED)
    assert [s["spawn"] for s in started] == ["warm", "warm"], started
    report = run.report()
    assert report["cuda_initialised_at_start"] is False, report
    assert (report["restart"], report["resumed"]) == (1, 20), report
    assert report["sha256"] == reference
    times = restart_times(run)
    assert 0 < times["to_init_s"] <= times["to_first_step_s"], times


def test_the_gpu_and_the_cpus_are_the_ones_slurm_gives(tmp_path: Path) -> None:
    """The agent given one GPU (``CUDA_VISIBLE_DEVICES``, as a Slurm step has it) and part of the CPUs (as
    a job's cgroup has them): its worker sees that one GPU as device 0 and runs on those CPUs."""
    mine = sorted(os.sched_getaffinity(0))
    cpus = mine[: max(1, len(mine) // 2)]
    run = run_training(tmp_path, "binding", cpus=cpus)
    _ok(run)
    report = run.report()
    assert report["cuda_visible_devices"] == first_gpu(), report
    assert report["cpus"] == cpus and report["omp_num_threads"] == str(len(cpus)), report
    if not rehearsal():
        assert (report["device_count"], report["device"]) == (1, "cuda:0"), report


def test_nvml_health_and_facts_from_the_real_driver() -> None:
    """The agent's NVML checks on the real driver: the GPU is healthy, its clocks and power are read, and
    critical Xid events can be registered for (the health check's event set exists)."""
    if rehearsal():
        pytest.skip("NVML needs a GPU driver; the rehearsal cannot stand in for it")
    from hpcelastic.agent.health import GpuHealth

    health = GpuHealth.open([first_gpu()])
    assert health is not None, "NVML did not open (driver or nvidia-ml-py missing)"
    try:
        assert health.check() == []
        facts = health.facts()[0]
        assert facts.sm_clock_mhz and facts.max_sm_clock_mhz and facts.sm_clock_mhz <= facts.max_sm_clock_mhz
        assert facts.power_w is not None and facts.temperature_c is not None, facts
        assert health._events is not None, "nvmlEventSetCreate/RegisterEvents refused: Xids go unseen"
    finally:
        health.close()


@pytest.mark.parametrize("save", ["save", "async_save"])
def test_the_local_tier_takes_dcp_checkpoints_from_gpu_memory(
    tmp_path: Path, reference: str, save: str
) -> None:
    """An unchanged DCP script saving its GPU state every 5 steps into the node-local tier: after a crash at
    step 13 it resumes from step 10 restored from memory, ends with the fault-free model, and the last
    checkpoint is persisted and published; each save's blocking time and a pinned copy of the same bytes
    are in the report (bench/gpu_check.py puts them side by side)."""
    tier = f"/dev/shm/hpce-gpu-{save}-{tmp_path.name}-{{node}}"
    args = ("--save-every", "5", "--crash-at-step", "13")
    args += ("--async-save",) if save == "async_save" else ()
    run = run_training(tmp_path, save, args, ("--local-checkpoint-dir", tier))
    _ok(run)
    report = run.report()
    assert (report["resumed"], report["sha256"]) == (10, reference), report
    restored = [e for e in run.named(ev.TIER_RESTORED) if e.get("checkpoint")]
    assert restored, run.named(ev.TIER_RESTORED)
    assert run.named(ev.TIER_CHECKPOINT)
    published = handoff.load(run.run_dir).checkpoint
    assert published is not None and published["step"] == STEPS, published
    assert all(s["blocked_s"] > 0 and s["state_bytes"] > 0 for s in report["saves"]), report["saves"]


def test_the_hang_watch_names_a_worker_stuck_in_a_cuda_kernel(tmp_path: Path, reference: str) -> None:
    """An unchanged script (no heartbeats) with a rank stuck in a CUDA kernel: its thread spins in
    ``torch.cuda.synchronize``, burning CPU, which the stack watch does not take for progress. The watch
    fails it as stalled, names the line in the function that waits for the kernel, has its stacks in the
    run directory, and the restarted worker trains to the fault-free model."""
    train = ("--hang-at-step", "8", "--no-heartbeats")
    run = run_training(tmp_path, "hang", train, ("--stall-timeout", "5"))
    _ok(run)
    [cause] = run.named(ev.ROOT_CAUSE)
    assert cause["error"].startswith("stalled") and "gpu_train.py:" in cause["error"], cause
    stacks = json.loads((run.run_dir / "stacks" / "attempt-0" / "round-0.json").read_text())
    assert stacks["localization"]["root_ranks"] == [0], stacks["localization"]
    assert "stuck_in_cuda_kernel" in json.dumps(stacks["ranks"]["0"]), stacks["ranks"]
    assert run.report()["sha256"] == reference
