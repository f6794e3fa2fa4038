"""The GPU figures, on a machine with one GPU, side by side with torchrun in the same run.

One agent, one NCCL worker (``tests/gpu/gpu_train.py``), medians of ``--runs`` runs:

* crash -> the new worker past ``init_process_group``, and -> its first step done on the GPU, under
  ``hpcelastic run`` (warm start) and ``torchrun --max-restarts 1`` (the script's own start/init/step times
  against the crashed worker's exit);
* each DCP checkpoint of the GPU state (width 4096: 64 MiB of parameters and 64 MiB of SGD momentum) into
  the node-local tier: the time ``dcp.save`` blocks the step, and
  ``dcp.async_save``'s return, against a device-to-host copy of the model's bytes into pinned memory
  (torch.cuda's own bandwidth, the copy no tier can avoid).

Writes the ``gpu_check`` section of bench/RESULTS.md. Without a GPU it writes which figures are not yet
measured (and exits 0): ``scripts/gpu_check.sh`` runs it after the GPU tests.

    python bench/gpu_check.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402
from tests.gpu.harness import (  # noqa: E402
    STEPS,
    TRAIN,
    GpuRun,
    device,
    first_gpu,
    rehearsal,
    restart_times,
    run_training,
    why_no_gpu,
)

SECTION = "gpu_check"
TITLE = "## One GPU: warm restart and checkpoints from GPU memory (`bench/gpu_check.py`)"
NOT_MEASURED = (
    "crash -> worker past init and -> first GPU step (hpcelastic warm start, torchrun)",
    "DCP save and async_save of GPU state into the node-local tier: blocked time",
    "device-to-host copy bandwidth (pinned) beside it",
    "NVML health on the real driver, the hang watch on a worker stuck in a CUDA kernel (tests/gpu)",
)


def torchrun_restart(tmp: Path, name: str) -> GpuRun:
    """The same crash under ``torchrun --standalone --max-restarts 1``."""
    out = tmp / f"{name}-out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first_gpu(), "PYTHONUNBUFFERED": "1"}
    env["HPCELASTIC_CHECKPOINT_DIR"] = str(tmp / f"{name}-ckpt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["--max-restarts", "1", str(TRAIN), "--steps", str(STEPS), "--out", str(out), "--device", device()]
    cmd += ["--save-every", "10", "--crash-at-step", "25"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    return GpuRun(proc.returncode, proc.stdout + proc.stderr, tmp, out)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(runs: int) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="hpce-gpu-bench-"))
    ours: dict[str, list[float]] = {"to_init_s": [], "to_first_step_s": []}
    theirs: dict[str, list[float]] = {"to_init_s": [], "to_first_step_s": []}
    saves: dict[str, list[tuple[float, float, int]]] = {"save": [], "async_save": []}
    for i in range(runs):
        run = run_training(tmp, f"crash-{i}", ("--save-every", "10", "--crash-at-step", "25"))
        if run.returncode != 0:
            raise SystemExit(f"hpcelastic run failed:\n{run.output[-3000:]}")
        for k, v in restart_times(run).items():
            ours[k].append(v)
        tr = torchrun_restart(tmp, f"torchrun-{i}")
        if tr.returncode != 0:
            raise SystemExit(f"torchrun failed:\n{tr.output[-3000:]}")
        for k, v in restart_times(tr).items():
            theirs[k].append(v)
        for kind in saves:
            tier = f"/dev/shm/hpce-gpu-bench-{kind}-{i}-{{node}}"
            args = ("--save-every", "5", "--width", "4096")
            args += ("--async-save",) if kind == "async_save" else ()
            r = run_training(tmp, f"{kind}-{i}", args, ("--local-checkpoint-dir", tier))
            if r.returncode != 0:
                raise SystemExit(f"the tier run failed:\n{r.output[-3000:]}")
            saves[kind] += [
                (s["blocked_s"], s["pinned_copy_s"], s["state_bytes"]) for s in r.report()["saves"]
            ]
    lines = [TITLE, "", machine_line() + f" GPU {first_gpu()}; {runs} runs of each, medians.", ""]
    lines += ["| crash -> | hpcelastic run (warm) | torchrun |", "|---|---|---|"]
    for k, label in (("to_init_s", "worker past init_process_group"), ("to_first_step_s", "first GPU step")):
        lines.append(f"| {label} | {median(ours[k]):.2f} s | {median(theirs[k]):.2f} s |")
    lines += ["", "From the crash as the script records it to the times the restarted worker records.", ""]
    lines += ["| checkpoint into the tier | blocks the step | pinned D2H copy of the same bytes | ratio |"]
    lines += ["|---|---|---|---|"]
    for kind, got in saves.items():
        blocked, copied = median([b for b, _, _ in got]), median([c for _, c, _ in got])
        size = got[0][2] / 2**20 if got else 0.0
        lines.append(
            f"| DCP `{kind}` ({size:.0f} MiB: parameters + momentum) | {blocked * 1e3:.1f} ms | "
            f"{copied * 1e3:.2f} ms ({size / 1024 / copied if copied else 0:.1f} GiB/s) | "
            f"{blocked / copied if copied else float('nan'):.1f}x |"
        )
    return "\n".join(lines)


def not_measured(why: str) -> str:
    lines = [TITLE, "", "Not yet measured: no machine with a GPU has run it. The last run said:", ""]
    lines += [f"> {why}", "", "Figures that wait for a GPU machine:", ""]
    lines += [f"- {f}" for f in NOT_MEASURED]
    lines += ["", "`bash scripts/gpu_check.sh` there (a few minutes, never timed) rewrites this section."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    why = why_no_gpu()
    if why is not None:
        update_section(SECTION, not_measured(why))
        print(f"no GPU here ({why}); bench/RESULTS.md says which figures wait for one")
        return
    text = measure(args.runs)
    if rehearsal():
        print(text)  # a rehearsal on the CPU never writes GPU figures
        return
    update_section(SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
