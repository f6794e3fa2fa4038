"""A training script for the fencing tests: every rank writes a line into ``OUT/rank-<RANK>.log`` every
0.1 s from a thread of its own (what a checkpoint writer would do, network or not), and trains with gloo
allreduces; rank 0 records the step reached (``OUT/step``) so a restarted round goes on from there."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    attempt = os.environ.get("HPCELASTIC_ATTEMPT", "0")

    def beat() -> None:
        with open(out / f"rank-{rank}.log", "a") as f:
            while True:
                f.write(f"{time.time():.3f} {os.getpid()} {attempt}.{restart}\n")
                f.flush()
                time.sleep(0.1)

    threading.Thread(target=beat, daemon=True).start()
    dist.init_process_group("gloo")
    step_file = out / "step"
    step = int(step_file.read_text()) if step_file.exists() else 0
    t = torch.ones(1024)
    while step < args.steps:
        dist.all_reduce(t)
        time.sleep(args.step_time)
        step += 1
        if rank == 0 and step % 10 == 0:
            tmp = out / "step.tmp"
            tmp.write_text(str(step))
            tmp.replace(step_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
