"""The goodput benchmark's training script: a fixed number of steps, checkpointed, with injectable faults.

An unchanged torchrun script (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher). Each step is a tiny
model's gradient all-reduce over gloo plus ``--step-time`` seconds of simulated compute; rank 0 appends
``{"step", "start", "end"}`` to ``--step-log`` and checkpoints every ``--ckpt-every`` steps. SIGUSR1 makes a
worker raise (a "worker exception"); every worker records its pid under ``--pid-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def injected(_signum: int, _frame: object) -> None:
    raise RuntimeError("injected worker exception")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-time", type=float, required=True)
    p.add_argument("--ckpt-every", type=int, required=True)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--step-log", type=Path, required=True)
    p.add_argument("--pid-dir", type=Path, required=True)
    args = p.parse_args()
    signal.signal(signal.SIGUSR1, injected)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.pid_dir.mkdir(parents=True, exist_ok=True)
    (args.pid_dir / str(os.getpid())).write_text(json.dumps({"rank": rank, "ts": time.time()}))
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 1)
    start = 0
    if args.ckpt.exists():
        state = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        start = state["step"] + 1
    for step in range(start, args.steps):
        t0 = time.time()
        x = torch.randn(64, 32)
        model.zero_grad()
        model(x).pow(2).mean().backward()
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
        time.sleep(args.step_time)
        with torch.no_grad():
            for param in model.parameters():
                assert param.grad is not None
                param -= 0.01 * param.grad / dist.get_world_size()
        if rank == 0:
            if (step + 1) % args.ckpt_every == 0:
                tmp = args.ckpt.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "step": step}, tmp)
                os.replace(tmp, args.ckpt)
            with args.step_log.open("a") as f:
                f.write(json.dumps({"step": step, "start": t0, "end": time.time()}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
